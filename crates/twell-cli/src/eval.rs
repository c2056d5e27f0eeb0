//! `twell eval`: perplexity on held-out text and a per-layer FFN sparsity report
//! (table, JSON, SVG chart of density per layer).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sparse_llama::corpus::Corpus;
use sparse_llama::perplexity::{perplexity, Perplexity};
use sparse_llama::sparsity::{LayerSparsity, SparsityTracker};

use crate::model_args::{default_corpus, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to score: a directory of .txt files, a file, or dir/*.txt (default: the
    /// State of the Union corpus in the data directory).
    #[arg(long)]
    pub text: Option<String>,
    /// Score only the last N documents (by name; for the corpus, the latest speeches).
    #[arg(long, default_value_t = 5)]
    pub last: usize,
    /// Tokens per scored window.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Stop after this many tokens of text (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG chart of FFN density per layer.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

#[derive(Serialize)]
struct EvalReport {
    model: String,
    ffn_mode: String,
    activation: String,
    documents: Vec<String>,
    perplexity: Perplexity,
    layers: Vec<LayerSparsity>,
}

pub fn run(args: &EvalArgs) -> Result<()> {
    if args.last == 0 {
        bail!("--last must be at least 1");
    }
    if args.context < 2 {
        bail!("--context must be at least 2");
    }
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let (ck, mut model) = args.model.open_for_inference()?;
    let device = model.device().clone();
    model.record_ffn_stats(true);
    let text = args.text.clone().unwrap_or_else(default_corpus);
    let corpus = Corpus::open(&text)
        .with_context(|| format!("opening --text {text}"))?
        .last(args.last);
    let eos = model.config().eos_ids().first().copied();
    let mut tokens = corpus.tokenize(&ck.tokenizer, eos)?;
    if args.max_tokens > 0 {
        tokens.truncate(args.max_tokens);
    }
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} windows {msg}")
            .expect("static progress template"),
    );
    let mut tracker = SparsityTracker::new(&model);
    let ppl = perplexity(
        &model,
        &tokens,
        args.context,
        args.batch,
        &device,
        |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            tracker.observe(&model)
        },
    )?;
    bar.finish_and_clear();
    let layers = tracker.report(model.config().intermediate_size);

    println!(
        "perplexity {:.3} (mean NLL {:.4}) over {} tokens in {} windows of {}",
        ppl.perplexity, ppl.mean_nll, ppl.tokens_scored, ppl.windows, ppl.context
    );
    println!(
        "{:>5} {:>9} {:>9} {:>10} {:>9}",
        "layer", "L0", "density", "dead", "overflow"
    );
    let opt = |v: Option<f64>, scale: f64| {
        v.map(|x| format!("{:.2}%", scale * x))
            .unwrap_or_else(|| "n/a".into())
    };
    for l in &layers {
        println!(
            "{:>5} {:>9.1} {:>8.2}% {:>10} {:>9}",
            l.layer,
            l.mean_l0,
            100.0 * l.density,
            opt(l.dead_fraction, 100.0),
            opt(l.tile_overflow_rate, 100.0)
        );
    }
    let mean_density = layers.iter().map(|l| l.density).sum::<f64>() / layers.len().max(1) as f64;
    println!(
        "mean FFN density {:.2}% of d_ff {}",
        100.0 * mean_density,
        model.config().intermediate_size
    );

    if let Some(path) = &args.svg {
        crate::chart::density_per_layer(path, &layers)?;
    }
    if let Some(path) = &args.json {
        let report = EvalReport {
            model: ck.source.display().to_string(),
            ffn_mode: format!("{:?}", model.config().ffn_mode),
            activation: model.config().activation.hf_name().into(),
            documents: corpus
                .files
                .iter()
                .map(|f| f.display().to_string())
                .collect(),
            perplexity: ppl,
            layers,
        };
        crate::output::write_json(path, &report)?;
    }
    Ok(())
}
