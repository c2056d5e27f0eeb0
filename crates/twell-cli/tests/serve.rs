//! `twell serve` on a loopback port, driven by curl and by the OpenAI Python client:
//! chat and text completions, streaming, 16 concurrent streams, a client that goes
//! away, a full queue, bad requests (and a bounded fuzz of bodies), the metrics'
//! accounting, and a graceful shutdown with a request in flight.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;
use common::{data_dir, tiny_checkpoint};

/// Whether the default model and the openai client are installed; under `CI=true` they
/// must be.
fn default_model_installed() -> bool {
    common::installed(&[
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-sparse",
        "python/.complete",
    ])
}

/// A running `twell serve`, killed when dropped.
struct Server {
    child: Child,
    addr: String,
    /// The line that gave the address.
    banner: String,
}

impl Server {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_twell"))
            .arg("serve")
            .args(["--port", "0"])
            .args(args)
            .env("TWELL_DATA", data_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start twell serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut seen = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find("http://") {
                        let addr = line[at + 7..].split('/').next().unwrap().to_string();
                        return Self {
                            child,
                            addr,
                            banner: line,
                        };
                    }
                    seen.push_str(&line);
                    seen.push('\n');
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("twell serve did not start:\n{seen}");
                }
            }
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `curl` a request: the status and the body.
    fn curl(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut cmd = Command::new("curl");
        cmd.args(["-sN", "-X", method, "-w", "\n%{http_code}", &self.url(path)]);
        if body.is_some() {
            cmd.args([
                "-H",
                "content-type: application/json",
                "--data-binary",
                "@-",
            ]);
            cmd.stdin(Stdio::piped());
        }
        cmd.stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("curl");
        if let Some(b) = body {
            child.stdin.take().unwrap().write_all(b.as_bytes()).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    fn metrics(&self) -> String {
        self.curl("GET", "/metrics", None).1
    }

    /// One metric's value (the sum over its labels).
    fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.metrics(), name)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until `cond` holds (the engine runs on its own clock).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends a JSON POST over a plain socket and returns the socket, to read the answer
/// as it comes (or to hang up part way).
fn post_raw(addr: &str, path: &str, body: &str) -> TcpStream {
    let mut socket = TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    socket
}

/// A completion request that runs to `max_tokens` (`ignore_eos`), so that it is still
/// running when a test hangs up on it.
fn completion(max_tokens: usize, stream: bool) -> String {
    format!(
        r#"{{"model":"default","prompt":"It is a great honor","max_tokens":{max_tokens},"temperature":0.8,"seed":3,"stream":{stream},"ignore_eos":true}}"#
    )
}

#[test]
fn sixteen_concurrent_streams_bad_requests_and_the_metrics_account_for_each() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_checkpoint(dir.path());
    let server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--max-sequences",
        "16",
        "--max-body-bytes",
        "4096",
    ]);
    let mut requests = 0;
    let (code, body) = server.curl("GET", "/health", None);
    assert_eq!(code, 200, "{body}");
    requests += 1;
    let (code, body) = server.curl("GET", "/v1/models", None);
    assert!(
        code == 200 && body.contains("\"tiny\"") && body.contains("\"default\""),
        "{body}"
    );
    requests += 1;

    // 16 streams at once, each ending in [DONE].
    let streams: Vec<_> = (0..16)
        .map(|i| {
            let url = server.url("/v1/completions");
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"model":"tiny","prompt":"Speech {i}:","max_tokens":48,"temperature":0.9,"seed":{i},"stream":true}}"#
                );
                let out = Command::new("curl")
                    .args(["-sN", "-H", "content-type: application/json", "-d", &body, &url])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout).into_owned()
            })
        })
        .collect();
    for s in streams {
        let text = s.join().unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(
            text.contains("\"finish_reason\":\"stop\"")
                || text.contains("\"finish_reason\":\"length\""),
            "{text}"
        );
        requests += 1;
    }

    // Greedy completions of prompts of different lengths, decoded together in batched
    // steps, each equal to what `twell generate` writes for its prompt alone.
    let prompts = ["It", "It is a great honor to", "The state of our union is"];
    let together: Vec<_> = prompts
        .iter()
        .map(|p| {
            let url = server.url("/v1/completions");
            let body = format!(
                r#"{{"model":"tiny","prompt":"{p}","max_tokens":40,"temperature":0,"ignore_eos":true}}"#
            );
            std::thread::spawn(move || {
                let out = Command::new("curl")
                    .args(["-s", "-H", "content-type: application/json", "-d", &body, &url])
                    .output()
                    .unwrap();
                let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                reply["choices"][0]["text"].as_str().unwrap().to_string()
            })
        })
        .collect();
    for (p, served) in prompts.iter().zip(together) {
        let served = served.join().unwrap();
        requests += 1;
        let out = Command::new(env!("CARGO_BIN_EXE_twell"))
            .args([
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                p,
            ])
            .args([
                "--max-tokens",
                "40",
                "--repeat-penalty",
                "1",
                "--ignore-eos",
            ])
            .output()
            .unwrap();
        let generated = String::from_utf8_lossy(&out.stdout);
        let generated = generated.strip_prefix(p).unwrap().trim_end_matches('\n');
        assert_eq!(served.trim_end_matches('\n'), generated, "prompt {p:?}");
        assert!(!served.is_empty());
    }

    // Stop texts with characters of several bytes are held back whole.
    let (code, reply) = server.curl(
        "POST",
        "/v1/completions",
        Some(
            r#"{"model":"tiny","prompt":"It","max_tokens":30,"temperature":0,"stop":["éé","→x"]}"#,
        ),
    );
    assert_eq!(code, 200, "{reply}");
    requests += 1;

    // Bad requests: an OpenAI-style error with a 4xx, and the server keeps serving.
    let big = format!(r#"{{"model":"default","prompt":"{}"}}"#, "a".repeat(5000));
    let bad: &[(&str, &str, u16, &str)] = &[
        ("/v1/completions", "{not json", 400, "request body"),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":7}"#,
            400,
            "request body",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":"x","max_tokens":"ten"}"#,
            400,
            "request body",
        ),
        (
            "/v1/completions",
            r#"{"model":"gpt-4","prompt":"x"}"#,
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"default","messages":[]}"#,
            400,
            "messages",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":"x","max_tokens":100000}"#,
            400,
            "context",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":"x","max_tokens":0}"#,
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":"x","temperature":9}"#,
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":"x","n":3}"#,
            400,
            "n:",
        ),
        (
            "/v1/completions",
            r#"{"model":"default","prompt":""}"#,
            400,
            "no tokens",
        ),
        ("/v1/completions", &big, 413, "length limit"),
        ("/v1/nothing", "{}", 404, "no such route"),
    ];
    for (path, body, want, needle) in bad {
        let (code, reply) = server.curl("POST", path, Some(body));
        assert_eq!(code, *want, "{path} {body}: {reply}");
        let json: serde_json::Value =
            serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{reply}: {e}"));
        let message = json["error"]["message"].as_str().unwrap_or_default();
        let code_field = json["error"]["code"].as_str().unwrap_or_default();
        assert!(
            message.contains(needle) || code_field.contains(needle),
            "{reply}"
        );
        assert!(
            !message.contains("backtrace") && !message.contains(" at ./"),
            "{reply}"
        );
        requests += 1;
    }
    // A bounded fuzz: random bodies, each answered with a 4xx or a completion.
    let mut seed = 0x2545f4914f6cdd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let pieces = [
        "{",
        "}",
        "\"model\"",
        ":",
        "\"default\"",
        ",",
        "\"prompt\"",
        "\"x\"",
        "\"max_tokens\"",
        "5",
        "-1",
        "null",
        "[",
        "]",
        "\"stream\"",
        "true",
        "1e999",
        "\"\\u0000\"",
        "\u{ff}",
    ];
    for _ in 0..60 {
        let len = (next() % 12) as usize;
        let body: String = (0..len)
            .map(|_| pieces[(next() % pieces.len() as u64) as usize])
            .collect();
        let (code, reply) = server.curl("POST", "/v1/completions", Some(&body));
        assert!(
            (200..500).contains(&code) && code != 0,
            "{body:?} -> {code} {reply}"
        );
        if code >= 400 {
            assert!(reply.contains("\"error\""), "{body:?} -> {reply}");
        }
        requests += 1;
    }
    let (code, reply) = server.curl("POST", "/v1/completions", Some(&completion(8, false)));
    assert_eq!(code, 200, "{reply}");
    requests += 1;

    // Every response is counted, by endpoint and status.
    let metrics = server.metrics();
    assert_eq!(
        metric_sum(&metrics, "twell_requests_total") as usize,
        requests,
        "{metrics}"
    );
    assert!(
        metric_sum(&metrics, "twell_generated_tokens_total") > 0.0,
        "{metrics}"
    );
    assert!(metrics.contains("twell_ffn_density{"), "{metrics}");
    // The engine's time is split by phase; prompts and decode steps both ran.
    for phase in ["prefill", "decode", "sample", "emit"] {
        let line = format!("twell_engine_seconds_total{{phase=\"{phase}\"}} ");
        let secs = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line)?.parse::<f64>().ok());
        assert!(secs.is_some_and(|s| s > 0.0), "{phase}: {metrics}");
    }
    assert!(
        metrics.contains("twell_time_to_first_token_seconds_count"),
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "twell_running_sequences"),
        0.0,
        "{metrics}"
    );
}

/// The default model: the OpenAI client's calls, a client that goes away mid-stream,
/// a full queue, and a shutdown with a request in flight.
#[test]
fn the_default_model_serves_the_openai_client_and_frees_what_clients_drop() {
    if !default_model_installed() {
        return;
    }
    let server = Server::start(&[]);
    // A server runs `auto` unless --ffn says otherwise (the adapter declares `sparse`).
    assert!(server.banner.contains("(ffn auto)"), "{}", server.banner);
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py"))
        .arg(server.url("/v1"))
        .arg("smollm2-135m-sparse")
        .env("PYTHONPATH", data_dir().join("python"))
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client_requests: f64 = stdout.trim().parse().unwrap();
    assert_eq!(server.metric("twell_requests_total"), client_requests);

    // A client that reads the first piece of a long stream and hangs up: its sequence
    // is cancelled and its slot freed.
    let mut socket = post_raw(&server.addr, "/v1/completions", &completion(2000, true));
    let mut first = [0u8; 512];
    let n = socket.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
    drop(socket);
    eventually("the cancelled stream", || {
        server.metric("twell_requests_cancelled_total") == 1.0
            && server.metric("twell_running_sequences") == 0.0
    });
    // The same for a whole (not streamed) request whose client gives up waiting.
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "1",
            "-H",
            "content-type: application/json",
        ])
        .args([
            "-d",
            &completion(2000, false),
            &server.url("/v1/completions"),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "curl should have timed out");
    eventually("the cancelled whole request", || {
        server.metric("twell_requests_cancelled_total") == 2.0
            && server.metric("twell_running_sequences") == 0.0
    });
    drop(server);

    // One slot and one place in the queue: of six requests at once, some get 429.
    let server = Server::start(&["--max-sequences", "1", "--queue", "1"]);
    let url = server.url("/v1/completions");
    let codes: Vec<u16> = (0..6)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let out = Command::new("curl")
                    .args([
                        "-s",
                        "-o",
                        "/dev/null",
                        "-w",
                        "%{http_code}",
                        "-H",
                        "content-type: application/json",
                    ])
                    .args(["-d", &completion(24, false), &url])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout).parse::<u16>().unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(codes.contains(&429) && codes.contains(&200), "{codes:?}");
    assert!(codes.iter().all(|c| *c == 200 || *c == 429), "{codes:?}");

    // SIGTERM with a stream in flight: the stream still ends in [DONE], then the server
    // exits cleanly.
    let mut server = server;
    let socket = post_raw(&server.addr, "/v1/completions", &completion(40, true));
    let mut reader = BufReader::new(socket);
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status}");
}

/// `twell bench serve` against the default model: one level per concurrency, every
/// request counted, and the generated tokens as the server's usage reports them; a
/// server that is not there is a clear error.
#[test]
fn bench_serve_loads_the_default_model_and_reports_each_level() {
    if !default_model_installed() {
        return;
    }
    let server = Server::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("load.json");
    let out = Command::new(env!("CARGO_BIN_EXE_twell"))
        .args(["bench", "serve", &server.url("/v1")])
        .args(["--concurrency", "1,3", "--rounds", "2", "--max-tokens", "6"])
        .args(["--warmup-rounds", "1"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let levels: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let levels = levels.as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for (level, (concurrency, requests)) in levels.iter().zip([(1, 2), (3, 6)]) {
        assert_eq!(level["concurrency"], concurrency);
        assert_eq!(level["warmup_requests"], concurrency);
        assert_eq!(level["requests"], requests);
        let tokens = level["generated_tokens"].as_u64().unwrap();
        assert!((requests..=6 * requests).contains(&tokens), "{level}");
        assert!(level["tokens_per_sec"].as_f64().unwrap() > 0.0, "{level}");
        let (p50, p99) = (
            level["ttft_p50_secs"].as_f64().unwrap(),
            level["ttft_p99_secs"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99, "{level}");
    }
    // The server counted them, the warm-up's too (and any /metrics reads).
    assert!(server.metric("twell_requests_total") >= 12.0);
    drop(server);

    let out = Command::new(env!("CARGO_BIN_EXE_twell"))
        .args([
            "bench",
            "serve",
            "http://127.0.0.1:9/v1",
            "--concurrency",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("sending a request"),
        "{stderr}"
    );
}

/// `twell bench serve` refuses levels and counts it cannot run, before any request.
#[test]
fn bench_serve_refuses_empty_levels_and_counts() {
    for (flags, want) in [
        (&["--concurrency", "0"][..], "--concurrency"),
        (&["--rounds", "0"][..], "--rounds"),
        (&["--max-tokens", "0"][..], "--max-tokens"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_twell"))
            .args(["bench", "serve", "http://127.0.0.1:9/v1"])
            .args(flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(want),
            "{flags:?}: {stderr}"
        );
    }
}

/// Requests that share a prompt prefix (the chat template's system turn, a question's
/// opening words) start from its cached prefill, and answer as a server without the
/// cache does.
#[test]
fn a_shared_prompt_prefix_is_prefilled_once_and_answers_the_same() {
    if !default_model_installed() {
        return;
    }
    let ask = |server: &Server, question: &str| -> String {
        let body = format!(
            r#"{{"model":"default","messages":[{{"role":"user","content":"{question}"}}],"max_tokens":12,"temperature":0}}"#
        );
        let (code, reply) = server.curl("POST", "/v1/chat/completions", Some(&body));
        assert_eq!(code, 200, "{reply}");
        let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
        reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let questions = [
        "What is the capital of France?",
        "What is the capital of France?",
        "What is the capital of France?",
        "What is the capital of Italy?",
        "What is the capital of Spain?",
    ];
    // One FFN path for both: `auto` picks its side by timing, and the sides' sums differ
    // in their last bits. f32 weights: the quantized CPU kernels pick their form by row
    // count (a prompt's rows past the cached prefix are few), and this checks the cache,
    // not their last bits; with them, one CI run saw a greedy answer part after five
    // tokens.
    let flags = ["--ffn", "sparse", "--quantize", "none"];
    let plain = Server::start(&[&flags[..], &["--prefix-cache", "0"]].concat());
    let want: Vec<String> = questions.iter().map(|q| ask(&plain, q)).collect();
    assert_eq!(plain.metric("twell_prefix_cache_hits_total"), 0.0);
    drop(plain);
    let cached = Server::start(&flags);
    let got: Vec<String> = questions.iter().map(|q| ask(&cached, q)).collect();
    assert_eq!(got, want);
    // France a third time, and Spain after Italy (the shared "What is the capital of").
    assert_eq!(cached.metric("twell_prefix_cache_hits_total"), 2.0);
    assert!(cached.metric("twell_prefix_cache_tokens_total") >= 2.0 * 16.0);
}
