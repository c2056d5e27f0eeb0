//! `twell bench loss`: the training losses over `[tokens, vocab]` logits (cross-entropy
//! and the distillation KL), forward and backward, as one fused op against the same
//! loss as candle ops, in one run, with the peak device memory of each. At SmolLM2's
//! vocabulary (49,152) these tensors are the widest of a fine-tuning step.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use serde::Serialize;

use super::memory::MemoryProbe;
use super::random_tokens;
use super::timing::{interleaved_medians, Rounds};
use crate::device::{DeviceArg, DtypeArg};

#[derive(clap::Args, Debug)]
pub struct LossBenchArgs {
    /// Positions N of the logits `[N, vocab]`, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384")]
    pub tokens: Vec<usize>,
    /// Vocabulary size (SmolLM2's by default).
    #[arg(long, default_value_t = 49152)]
    pub vocab: usize,
    /// The student logits' dtype: bf16 (the CUDA kernels' dtype), f16 or f32. The
    /// teacher's logits are f32, as a fine-tune's teacher gives them.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    pub dtype: DtypeArg,
    #[command(flatten)]
    pub device: DeviceArg,
    #[command(flatten)]
    pub rounds: Rounds,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize, Debug, Clone)]
pub struct LossRow {
    /// `cross_entropy` or `kl_divergence`.
    pub loss: &'static str,
    pub tokens: usize,
    pub vocab: usize,
    /// Forward + backward of the loss as candle ops (the reference each op is checked
    /// against), and of the fused op.
    pub candle_ms: f64,
    pub fused_ms: f64,
    pub speedup: f64,
    /// Peak device memory above the inputs during one step (None on CPU).
    pub candle_peak_bytes: Option<u64>,
    pub fused_peak_bytes: Option<u64>,
}

#[derive(Serialize, Debug)]
pub struct LossReport {
    pub device: String,
    pub dtype: String,
    pub rows: Vec<LossRow>,
}

/// The loss of the student's logits against a target: class ids for the
/// cross-entropy, the teacher's logits for the KL.
type LossFn<'a> = dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a;

/// Forward and backward of `loss` in `logits`; the gradient is dropped.
fn step(loss: &LossFn, logits: &Var) -> candle_core::Result<()> {
    std::hint::black_box(loss(logits.as_tensor())?.backward()?);
    Ok(())
}

/// Times candle's loss against the fused one on the same logits, and measures the
/// peak memory of one step of each.
fn compare(
    device: &Device,
    args: &LossBenchArgs,
    logits: &Var,
    (candle, fused): (&LossFn, &LossFn),
) -> Result<[f64; 2]> {
    let mut candle_run = |_: usize| step(candle, logits);
    let mut fused_run = |_: usize| step(fused, logits);
    let t = interleaved_medians(device, args.rounds, &mut [&mut candle_run, &mut fused_run])?;
    Ok([t[0], t[1]])
}

/// Peak device memory above what is in use now, during one step of `loss`.
fn peak(device: &Device, loss: &LossFn, logits: &Var) -> Result<Option<u64>> {
    let memory = MemoryProbe::start(device)?;
    step(loss, logits)?;
    memory.peak_extra()
}

pub fn run(args: &LossBenchArgs) -> Result<LossReport> {
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!("--tokens: token counts must be at least 1");
    }
    if args.vocab < 2 {
        bail!("--vocab {}: must be at least 2", args.vocab);
    }
    args.rounds.check()?;
    let mut rows = Vec::new();
    for &n in &args.tokens {
        // Random logits: the timings do not depend on their values (and the CPU's rng
        // takes no seed).
        let logits = Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (n, args.vocab), &device)? * 3.0)?.to_dtype(dtype)?,
        )?;
        let teacher = (Tensor::randn(0f32, 1.0, (n, args.vocab), &device)? * 4.0)?;
        let targets = random_tokens(1, n, args.vocab, &device)?.flatten_all()?;
        let ce_candle =
            |s: &Tensor| candle_nn::loss::cross_entropy(&s.to_dtype(DType::F32)?, &targets);
        let ce_fused = |s: &Tensor| fused_ops::cross_entropy(s, &targets);
        let kl_candle = |s: &Tensor| fused_ops::kl_divergence_reference(s, &teacher);
        let kl_fused = |s: &Tensor| fused_ops::kl_divergence_fused(s, &teacher);
        let cases: [(&'static str, &LossFn, &LossFn); 2] = [
            ("cross_entropy", &ce_candle, &ce_fused),
            ("kl_divergence", &kl_candle, &kl_fused),
        ];
        for (loss, candle, fused) in cases {
            let [candle_s, fused_s] = compare(&device, args, &logits, (candle, fused))?;
            rows.push(LossRow {
                loss,
                tokens: n,
                vocab: args.vocab,
                candle_ms: candle_s * 1e3,
                fused_ms: fused_s * 1e3,
                speedup: candle_s / fused_s,
                candle_peak_bytes: peak(&device, candle, &logits)?,
                fused_peak_bytes: peak(&device, fused, &logits)?,
            });
        }
    }
    Ok(LossReport {
        device: format!("{device:?}"),
        dtype: args.dtype.to_string(),
        rows,
    })
}

pub fn print(report: &LossReport) {
    println!("device {} dtype {}", report.device, report.dtype);
    println!(
        "{:>14} {:>7} {:>7} {:>10} {:>10} {:>8} {:>12} {:>12}",
        "loss", "N", "vocab", "candle ms", "fused ms", "speedup", "candle peak", "fused peak"
    );
    let mib =
        |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0));
    for r in &report.rows {
        println!(
            "{:>14} {:>7} {:>7} {:>10.3} {:>10.3} {:>7.2}x {:>12} {:>12}",
            r.loss,
            r.tokens,
            r.vocab,
            r.candle_ms,
            r.fused_ms,
            r.speedup,
            mib(r.candle_peak_bytes),
            mib(r.fused_peak_bytes)
        );
    }
}
