//! `twell bench serve`: load on a running OpenAI-compatible server (`twell serve`, or
//! another for comparison). At each concurrency, `warmup_rounds × concurrency` untimed
//! requests, then `rounds × concurrency` timed ones, streamed chat, at most `concurrency`
//! in flight; the aggregate generated tokens/s and the p50/p99 time to first token. The
//! warm-up lets a server do its once-per-batch-size work (a GPU server captures a decode
//! graph per batch size, and `auto` times its sides) before the level is timed, as a
//! server under steady load has done it long before. A client in Rust on tokio, so that
//! the client, not the server, is never what a figure measures.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct ServeBenchArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8080/v1.
    pub url: String,
    /// Requests in flight at once, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub concurrency: Vec<usize>,
    /// Timed requests per level: `rounds × concurrency`.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Untimed requests per level before the timed ones: `warmup_rounds × concurrency`.
    #[arg(long, default_value_t = 1)]
    pub warmup_rounds: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f64,
    /// Seconds a request may take before the benchmark fails.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One concurrency level's figures.
#[derive(Serialize, Debug, Clone)]
pub struct Level {
    pub concurrency: usize,
    /// Untimed requests before the timed ones.
    pub warmup_requests: usize,
    /// Timed requests.
    pub requests: usize,
    pub generated_tokens: usize,
    pub wall_secs: f64,
    pub tokens_per_sec: f64,
    pub ttft_p50_secs: f64,
    pub ttft_p99_secs: f64,
}

const PROMPTS: [&str; 4] = [
    "Tell me about the history of the printing press.",
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "What are the main causes of the seasons on Earth?",
];

/// What one streamed request gave: its time to first token and its generated tokens.
struct Outcome {
    ttft: Duration,
    tokens: usize,
}

pub fn run(args: &ServeBenchArgs) -> Result<Vec<Level>> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency takes levels of at least 1");
    }
    if args.rounds == 0 || args.max_tokens == 0 {
        bail!("--rounds and --max-tokens must be at least 1");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the client's runtime")?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.timeout_secs))
        .build()
        .context("building the HTTP client")?;
    let url = format!("{}/chat/completions", args.url.trim_end_matches('/'));
    let mut levels = Vec::new();
    for &concurrency in &args.concurrency {
        let level = runtime.block_on(level(&client, &url, concurrency, args))?;
        eprintln!(
            "concurrency {concurrency}: {:.1} tokens/s, time to first token p50 {:.3} s",
            level.tokens_per_sec, level.ttft_p50_secs
        );
        levels.push(level);
    }
    if let Some(path) = &args.json {
        crate::output::write_json(path, &levels)?;
    }
    Ok(levels)
}

async fn level(
    client: &reqwest::Client,
    url: &str,
    concurrency: usize,
    args: &ServeBenchArgs,
) -> Result<Level> {
    let warmup = args.warmup_rounds * concurrency;
    if warmup > 0 {
        requests(client, url, concurrency, warmup, args).await?;
    }
    let requests_timed = args.rounds * concurrency;
    let start = Instant::now();
    let outcomes = requests(client, url, concurrency, requests_timed, args).await?;
    let wall = start.elapsed().as_secs_f64();
    let generated: usize = outcomes.iter().map(|o| o.tokens).sum();
    let mut ttfts: Vec<f64> = outcomes.iter().map(|o| o.ttft.as_secs_f64()).collect();
    ttfts.sort_by(f64::total_cmp);
    Ok(Level {
        concurrency,
        warmup_requests: warmup,
        requests: requests_timed,
        generated_tokens: generated,
        wall_secs: wall,
        tokens_per_sec: generated as f64 / wall,
        ttft_p50_secs: nearest_rank(&ttfts, 0.50),
        ttft_p99_secs: nearest_rank(&ttfts, 0.99),
    })
}

/// `count` streamed chat requests, at most `concurrency` in flight, each with its own
/// seed and one of [`PROMPTS`] in turn.
async fn requests(
    client: &reqwest::Client,
    url: &str,
    concurrency: usize,
    count: usize,
    args: &ServeBenchArgs,
) -> Result<Vec<Outcome>> {
    let gate = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let (client, url, gate) = (client.clone(), url.to_string(), gate.clone());
        let body = serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": PROMPTS[i % PROMPTS.len()]}],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": i,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await?;
            one(&client, &url, &body).await
        }));
    }
    let mut outcomes = Vec::with_capacity(count);
    for task in tasks {
        outcomes.push(task.await.context("a request's task")??);
    }
    Ok(outcomes)
}

/// The `q` quantile of sorted values by nearest rank.
fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One streamed chat request: reads the server-sent events to `[DONE]`, timing the
/// first one with text, and takes the generated count from the usage chunk.
async fn one(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> Result<Outcome> {
    let start = Instant::now();
    let response = client
        .post(url)
        .json(body)
        .send()
        .await
        .context("sending a request")?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("the server answered {status}: {text}");
    }
    let mut stream = response.bytes_stream();
    let mut pending = Vec::new();
    let (mut ttft, mut tokens, mut done) = (None, None, false);
    while let Some(piece) = stream.next().await {
        pending.extend_from_slice(&piece.context("reading the stream")?);
        // Whole lines only; a partial one waits for the next piece.
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Some(data) = std::str::from_utf8(&line)?.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: serde_json::Value =
                serde_json::from_str(data).with_context(|| format!("an event: {data}"))?;
            let has_text = chunk["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty());
            if has_text && ttft.is_none() {
                ttft = Some(start.elapsed());
            }
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
            }
        }
    }
    if !done {
        bail!("a stream ended without data: [DONE]");
    }
    let tokens = tokens.context("a stream without a usage chunk (stream_options.include_usage)")?;
    Ok(Outcome {
        ttft: ttft.unwrap_or_else(|| start.elapsed()),
        tokens,
    })
}

pub fn print(levels: &[Level]) {
    println!(
        "{:>11} {:>8} {:>10} {:>12} {:>14} {:>14}",
        "concurrency", "requests", "tokens", "tokens/s", "TTFT p50 (s)", "TTFT p99 (s)"
    );
    for l in levels {
        println!(
            "{:>11} {:>8} {:>10} {:>12.1} {:>14.3} {:>14.3}",
            l.concurrency,
            l.requests,
            l.generated_tokens,
            l.tokens_per_sec,
            l.ttft_p50_secs,
            l.ttft_p99_secs
        );
    }
}

#[cfg(test)]
mod tests {
    use super::nearest_rank;

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 0.5), 50.0);
        assert_eq!(nearest_rank(&v, 0.99), 99.0);
        assert_eq!(nearest_rank(&[3.0], 0.99), 3.0);
        assert!(nearest_rank(&[], 0.5).is_nan());
    }
}
