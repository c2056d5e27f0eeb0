//! `twell generate`: streaming text generation.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use sparse_llama::generate::{generate, GenerationConfig};
use twell::Activation;

use crate::model_args::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (the user's message with --chat).
    #[arg(long, short)]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template (ChatML).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: the template's own).
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Keep generating past the end-of-sequence tokens, to --max-tokens (as llama.cpp's
    /// `--ignore-eos`): decode speed at a known context.
    #[arg(long)]
    pub ignore_eos: bool,
    /// On CUDA, launch each decode step's ops one by one instead of replaying the step
    /// captured as a CUDA graph (the same ops: for debugging and comparison).
    #[arg(long)]
    pub no_graph: bool,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long, default_value_t = 1.1)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
    /// Write the generation statistics as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!("--temperature must be >= 0");
    }
    if let Some(p) = args.top_p {
        if !(p > 0.0 && p <= 1.0) {
            bail!("--top-p must be in (0, 1]");
        }
    }
    if args.top_k == Some(0) {
        bail!("--top-k must be at least 1");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1: 0 would run nothing");
    }
    if args.repeat_penalty <= 0.0 || !args.repeat_penalty.is_finite() {
        bail!("--repeat-penalty must be > 0");
    }
    let (ck, mut model) = args.model.open_for_inference()?;
    let device = model.device().clone();
    let relu = model.config().activation == Activation::Relu;
    model.record_ffn_stats(relu);

    let text = if args.chat {
        ck.chat_format()?
            .prompt(args.system.as_deref(), &args.prompt)
    } else {
        args.prompt.clone()
    };
    let enc = ck
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(anyhow::Error::msg)
        .context("tokenizing the prompt")?;
    let prompt = enc.get_ids().to_vec();
    let mut eos = model.config().eos_ids();
    if args.ignore_eos {
        eos.clear();
    } else if args.chat {
        if let Some(id) = ck.tokenizer.token_to_id("<|im_end|>") {
            eos.push(id);
        }
    }
    let cfg = GenerationConfig {
        max_new_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        seed: args.seed,
        graphs: !args.no_graph,
    };
    if !args.chat {
        print!("{}", args.prompt);
    }
    let mut stdout = std::io::stdout();
    let (_, stats) = generate(
        &mut model,
        &ck.tokenizer,
        &prompt,
        &eos,
        &cfg,
        &device,
        |piece| {
            print!("{piece}");
            let _ = stdout.flush();
        },
    )?;
    println!();
    eprintln!(
        "prompt {} tokens, {:.1} tokens/s | generated {} tokens, {:.1} tokens/s{}{} | ffn {}{}{} on {:?} {:?}",
        stats.prompt_tokens,
        stats.prefill_tokens_per_sec(),
        stats.generated_tokens,
        stats.decode_tokens_per_sec(),
        match stats.generated_tokens {
            0..=2 => String::new(),
            _ => format!(
                " (first step {:.1} ms, then {:.1} tokens/s)",
                1e3 * stats.first_decode_step_secs,
                stats.later_decode_tokens_per_sec()
            ),
        },
        match stats.mean_ffn_density {
            Some(d) if stats.decode_engine => format!(" | mean FFN density {:.2}% (prompt)", 100.0 * d),
            Some(d) => format!(" | mean FFN density {:.2}%", 100.0 * d),
            None => String::new(),
        },
        model.config().ffn_mode.name(),
        decode_paths(&stats.decode_ffn_paths),
        match (stats.decode_engine, stats.decode_graph) {
            (true, true) => " | decode: CUDA graphs",
            (true, false) => " | decode: slot steps op by op",
            _ => "",
        },
        device.location(),
        model.dtype(),
    );
    if let Some(path) = &args.json {
        crate::output::write_json(path, &stats)?;
    }
    Ok(())
}

/// Which FFN paths the decode steps took, e.g. " (decode: TwELL sparse 100%)".
fn decode_paths(paths: &std::collections::BTreeMap<String, usize>) -> String {
    let total: usize = paths.values().sum();
    if total == 0 {
        return String::new();
    }
    let mut parts: Vec<(&String, &usize)> = paths.iter().collect();
    parts.sort_by(|a, b| b.1.cmp(a.1));
    let list: Vec<String> = parts
        .iter()
        .map(|(name, n)| {
            let label = match name.as_str() {
                "sparse" => "TwELL sparse",
                other => other,
            };
            format!("{label} {:.0}%", 100.0 * **n as f64 / total as f64)
        })
        .collect();
    format!(" (decode: {})", list.join(", "))
}
