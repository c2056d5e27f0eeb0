//! `twell bench layers`: a real model's MLP layers on the rows its own text feeds them,
//! candle's dense MLP against the TwELL path and `Auto` on each layer's weights. The
//! sweep's synthetic inputs fire every neuron alike; a fine-tuned checkpoint's density
//! differs from layer to layer and token to token, and its active neurons cluster, so
//! `Auto`'s choices are checked here on what users run.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{Module, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sparse_llama::corpus::Corpus;
use sparse_llama::Cache;
use twell::density::MlpWeights;
use twell::{Activation, FfnMode, SparseMlp};

use super::mlp::DenseMlp;
use super::sweep::AUTO_FLOOR;
use super::timing::{interleaved_medians, Rounds};
use crate::model_args::{default_corpus, ModelArgs};

/// The model and the text whose MLP inputs a bench captures ([`capture_mlp_inputs`]).
#[derive(clap::Args, Debug)]
pub struct CapturedText {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text whose tokens feed the model: a directory of .txt files, a file, or
    /// dir/*.txt (default: the corpus's held-out speeches, its last 10 documents).
    #[arg(long)]
    pub text: Option<String>,
    /// The text goes through the model in windows of this many tokens.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
}

#[derive(clap::Args, Debug)]
pub struct LayersArgs {
    #[command(flatten)]
    pub input: CapturedText,
    /// Token rows per call: each layer runs on M of the rows its text gave it, spread
    /// evenly over the windows' positions (a window's first positions fire more
    /// neurons than the rest).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub tokens: Vec<usize>,
    #[command(flatten)]
    pub rounds: Rounds,
    /// `Auto` re-measures the density every this many calls (0: only when unknown).
    #[arg(long, default_value_t = twell::auto::AUTO_RECHECK_CALLS)]
    pub auto_recheck: usize,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Every layer at one token count; times are per layer (all layers run back to back in
/// each timed call, each on its own rows, as a forward pass runs them).
#[derive(Serialize, Debug, Clone)]
pub struct LayersRow {
    pub tokens: usize,
    pub layers: usize,
    pub mean_density: f64,
    pub min_layer_density: f64,
    pub max_layer_density: f64,
    pub dense_ms: f64,
    pub sparse_ms: f64,
    pub speedup: f64,
    pub auto_ms: f64,
    pub auto_speedup: f64,
    /// How many layers `Auto` ran on each side in its last timed call.
    pub auto_sides: Vec<(String, usize)>,
}

#[derive(Serialize, Debug)]
pub struct LayersReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub hidden: usize,
    pub ffn: usize,
    pub rows: Vec<LayersRow>,
}

/// One layer's three variants on the same weights.
struct Layer {
    dense: DenseMlp,
    sparse: SparseMlp,
    auto: SparseMlp,
}

impl Layer {
    fn new(mlp: &SparseMlp, auto_recheck: usize) -> Result<Self> {
        let w = MlpWeights {
            gate: mlp.gate_proj().clone(),
            up: mlp.up_proj().contiguous()?,
            down: mlp.down_proj().contiguous()?,
        };
        Ok(Self {
            dense: DenseMlp::new(&w),
            sparse: w.relu_mlp(FfnMode::Sparse)?,
            auto: w
                .relu_mlp(FfnMode::Auto)?
                .with_density_recheck(auto_recheck),
        })
    }
}

pub fn run(args: &LayersArgs) -> Result<LayersReport> {
    args.rounds.check()?;
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!("--tokens: token counts must be at least 1");
    }
    let (ck, model, inputs) = capture_mlp_inputs(
        &args.input,
        *args.tokens.iter().max().expect("checked non-empty"),
    )?;
    let config = model.config().clone();
    let device = inputs[0].device().clone();
    let dtype = inputs[0].dtype();

    let layers = model
        .mlps()
        .map(|mlp| Layer::new(mlp, args.auto_recheck))
        .collect::<Result<Vec<_>>>()?;
    let bar = ProgressBar::new(args.tokens.len() as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .expect("static progress template"),
    );
    let mut rows = Vec::new();
    for &m in &args.tokens {
        bar.set_message(format!("M={m}"));
        let captured = inputs[0].dim(0)?;
        let spread: Vec<u32> = (0..m)
            .map(|i| ((2 * i + 1) * captured / (2 * m)) as u32)
            .collect();
        let spread = Tensor::from_vec(spread, m, &device)?;
        let xs = inputs
            .iter()
            .map(|x| x.index_select(&spread, 0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        rows.push(measure(
            args.rounds,
            &layers,
            &xs,
            config.intermediate_size,
        )?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let report = LayersReport {
        model: ck.source.display().to_string(),
        device: crate::device::device_name(&device),
        dtype: format!("{dtype:?}"),
        hidden: config.hidden_size,
        ffn: config.intermediate_size,
        rows,
    };
    if let Some(path) = &args.json {
        crate::output::write_json(path, &report)?;
    }
    Ok(report)
}

/// Loads `--model`, runs `--text` (default: the corpus's held-out speeches) through it in
/// windows of `--context` tokens, at least `rows` rows and [`MIN_CAPTURED_ROWS`], and
/// returns each layer's MLP input rows `[rows', hidden]` (rows' ≥ rows). The model must
/// be ReLU-gated: the TwELL path and its active neurons need it.
pub(crate) fn capture_mlp_inputs(
    input: &CapturedText,
    rows: usize,
) -> Result<(
    sparse_llama::checkpoint::Checkpoint,
    sparse_llama::Llama,
    Vec<Tensor>,
)> {
    let (model_args, text, context) = (&input.model, input.text.as_deref(), input.context);
    if context == 0 {
        bail!("--context must be at least 1");
    }
    let ck = model_args.open()?;
    let device = model_args.device()?;
    let dtype = model_args.dtype(&device);
    let mut model = ck.load_model(dtype, &device, &model_args.load_options())?;
    let config = model.config().clone();
    if config.activation != Activation::Relu {
        bail!(
            "this bench needs a ReLU-gated model (its active neurons): the sparse default \
             (no --dense), a fine-tuned checkpoint, or --relu"
        );
    }
    let rows_needed = rows.max(MIN_CAPTURED_ROWS);
    let context = context.min(config.max_position_embeddings);
    let text_arg = text.map(String::from).unwrap_or_else(default_corpus);
    let mut corpus =
        Corpus::open(&text_arg).with_context(|| format!("opening --text {text_arg}"))?;
    if text.is_none() {
        corpus = corpus.last(10);
    }
    let eos = config.eos_ids().first().copied();
    let tokens = corpus.tokenize(&ck.tokenizer, eos)?;
    let windows = rows_needed.div_ceil(context);
    if tokens.len() < windows * context.min(rows_needed) {
        bail!(
            "the text gives {} tokens, {rows_needed} rows need {}",
            tokens.len(),
            windows * context.min(rows_needed)
        );
    }
    let width = context.min(rows_needed);
    let ids = Tensor::from_slice(&tokens[..windows * width], (windows, width), &device)?;
    model.keep_mlp_inputs(true);
    let mut cache = Cache::new(false, dtype, &config, &device)?;
    model.forward(&ids, 0, &mut cache)?;
    let inputs = model.take_mlp_inputs()?;
    model.keep_mlp_inputs(false);
    Ok((ck, model, inputs))
}

/// At least this many rows go through the model, so that few rows are a spread of
/// positions rather than a window's first.
const MIN_CAPTURED_ROWS: usize = 1024;

/// Every layer on its rows `xs[l]`: dense, TwELL and `Auto` interleaved.
fn measure(rounds: Rounds, layers: &[Layer], xs: &[Tensor], ffn: usize) -> Result<LayersRow> {
    let device = xs[0].device().clone();
    let m = xs[0].dim(0)?;
    let mut densities = Vec::with_capacity(layers.len());
    for (layer, x) in layers.iter().zip(xs) {
        // Each variant once before timing (the sparse side builds its up/down matrix
        // and gate screen on its first call), then `Auto` settles on a side.
        std::hint::black_box(layer.dense.forward(x)?);
        std::hint::black_box(layer.sparse.forward(x)?);
        std::hint::black_box(layer.auto.forward(x)?);
        layer.auto.calibrate(x)?;
        let nnz = super::mlp::probe(x, &layer.sparse)?.nnz()?;
        densities.push(nnz as f64 / (m * ffn) as f64);
    }
    let mut dense_run = |_: usize| -> candle_core::Result<()> {
        for (layer, x) in layers.iter().zip(xs) {
            std::hint::black_box(layer.dense.forward(x)?);
        }
        Ok(())
    };
    let mut sparse_run = |_: usize| -> candle_core::Result<()> {
        for (layer, x) in layers.iter().zip(xs) {
            std::hint::black_box(layer.sparse.forward(x)?);
        }
        Ok(())
    };
    let mut auto_run = |_: usize| -> candle_core::Result<()> {
        for (layer, x) in layers.iter().zip(xs) {
            std::hint::black_box(layer.auto.forward(x)?);
        }
        Ok(())
    };
    let t: Vec<f64> = interleaved_medians(
        &device,
        rounds,
        &mut [&mut dense_run, &mut sparse_run, &mut auto_run],
    )?
    .into_iter()
    .map(|call| call / layers.len() as f64)
    .collect();
    let mut auto_sides: Vec<(String, usize)> = Vec::new();
    for layer in layers {
        let side = layer.auto.last_side().map_or("?", twell::auto::Side::name);
        match auto_sides.iter_mut().find(|(s, _)| s == side) {
            Some((_, n)) => *n += 1,
            None => auto_sides.push((side.to_string(), 1)),
        }
    }
    let n = densities.len() as f64;
    Ok(LayersRow {
        tokens: m,
        layers: layers.len(),
        mean_density: densities.iter().sum::<f64>() / n,
        min_layer_density: densities.iter().copied().fold(f64::INFINITY, f64::min),
        max_layer_density: densities.iter().copied().fold(0.0, f64::max),
        dense_ms: t[0] * 1e3,
        sparse_ms: t[1] * 1e3,
        speedup: t[0] / t[1],
        auto_ms: t[2] * 1e3,
        auto_speedup: t[0] / t[2],
        auto_sides,
    })
}

pub fn print(report: &LayersReport) {
    println!(
        "{} | {} {} | {} layers of {}x{}, each on its own rows; times per layer",
        report.model,
        report.device,
        report.dtype,
        report.rows.first().map_or(0, |r| r.layers),
        report.hidden,
        report.ffn
    );
    println!(
        "{:>6} {:>8} {:>15} {:>10} {:>10} {:>8} {:>10} {:>6}  auto sides",
        "M", "density", "layers min-max", "dense ms", "sparse ms", "speedup", "auto ms", "auto"
    );
    for r in &report.rows {
        let sides: Vec<String> = r
            .auto_sides
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect();
        println!(
            "{:>6} {:>7.2}% {:>6.2}-{:>6.2}% {:>10.4} {:>10.4} {:>7.2}x {:>10.4} {:>5.2}x  {}",
            r.tokens,
            100.0 * r.mean_density,
            100.0 * r.min_layer_density,
            100.0 * r.max_layer_density,
            r.dense_ms,
            r.sparse_ms,
            r.speedup,
            r.auto_ms,
            r.auto_speedup,
            sides.join(", ")
        );
    }
    let worst = report
        .rows
        .iter()
        .min_by(|a, b| a.auto_speedup.total_cmp(&b.auto_speedup));
    if let Some(w) = worst {
        println!(
            "Auto worst {:.2}x (M {}), under {AUTO_FLOOR}x at {} of {} token counts",
            w.auto_speedup,
            w.tokens,
            report
                .rows
                .iter()
                .filter(|r| r.auto_speedup < AUTO_FLOOR)
                .count(),
            report.rows.len()
        );
    }
}
