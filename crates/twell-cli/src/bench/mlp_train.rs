//! `twell bench mlp-train`: one MLP layer's training step (forward + backward),
//! candle's dense autograd against the TwELL path on the same weights, in one run,
//! with the peak device memory of each.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Module, Tensor, Var, D};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use twell::density::{synthetic_input, synthetic_mlp};
use twell::{Activation, FfnMode, SparseMlp};

use super::memory::MemoryProbe;
use super::mlp::{check_sweep, probe};
use super::timing::{interleaved_medians, Rounds};
use crate::device::{DeviceArg, DtypeArg};

#[derive(clap::Args, Debug)]
pub struct MlpTrainBenchArgs {
    /// MLP shapes as HIDDENxFFN, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2048x5632")]
    pub shape: Vec<String>,
    /// Token counts M per step.
    #[arg(long, value_delimiter = ',', default_value = "2048,16384")]
    pub tokens: Vec<usize>,
    /// Target activation densities (fraction of d_ff), set through a gate bias.
    #[arg(long, value_delimiter = ',', default_value = "0.005,0.01,0.03")]
    pub density: Vec<f64>,
    /// f32, bf16 or f16 (the CUDA kernels take bf16).
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    pub dtype: DtypeArg,
    #[command(flatten)]
    pub device: DeviceArg,
    /// L1 coefficient of the sparse variant's loss (its L1 term is part of the step;
    /// the dense variant trains without one, as a plain fine-tune would).
    #[arg(long, default_value_t = 1e-3)]
    pub l1: f64,
    #[command(flatten)]
    pub rounds: Rounds,
    /// The sparse variant's CUDA backward: chosen by the measured density (`auto`), or
    /// fixed, to time the paths against each other.
    #[arg(long, value_enum, default_value_t = BackwardArg::Auto)]
    pub backward: BackwardArg,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG chart of speed-up against density here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// `--backward`: [`twell::BackwardPath`], or the density's choice.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardArg {
    Auto,
    /// dx and the weight gradients per active pair.
    Sparse,
    /// dx through dense GEMMs, the weight gradients per pair.
    DenseDx,
    /// Everything through dense GEMMs.
    Dense,
}

impl BackwardArg {
    fn path(self) -> Option<twell::BackwardPath> {
        match self {
            Self::Auto => None,
            Self::Sparse => Some(twell::BackwardPath::Sparse),
            Self::DenseDx => Some(twell::BackwardPath::DenseDx),
            Self::Dense => Some(twell::BackwardPath::Dense),
        }
    }
}

#[derive(Serialize, Debug, Clone)]
pub struct MlpTrainRow {
    pub hidden: usize,
    pub ffn: usize,
    pub tokens: usize,
    pub target_density: f64,
    pub measured_density: f64,
    pub dense_ms: f64,
    pub sparse_ms: f64,
    pub speedup: f64,
    /// Dense FLOP rate of the step, 18·M·d·f / time (3 forward and 6 backward GEMMs).
    pub dense_tflops: f64,
    /// Peak device memory above the weights during one step (None on CPU).
    pub dense_peak_bytes: Option<u64>,
    pub sparse_peak_bytes: Option<u64>,
    /// Whether the sparse backward ran on the device kernels.
    pub sparse_backward_on_device: bool,
}

#[derive(Serialize, Debug)]
pub struct MlpTrainReport {
    pub device: String,
    pub dtype: String,
    pub l1: f64,
    pub rows: Vec<MlpTrainRow>,
}

/// One layer's trainable weights (candle `Var`s), shared by a dense and a sparse
/// `SparseMlp`.
struct Layer {
    dense: SparseMlp,
    sparse: SparseMlp,
}

impl Layer {
    fn new(
        w: twell::density::MlpWeights,
        backward: Option<twell::BackwardPath>,
    ) -> candle_core::Result<Self> {
        let vars = [
            Var::from_tensor(&w.gate)?,
            Var::from_tensor(&w.up)?,
            Var::from_tensor(&w.down)?,
        ];
        // The sparse variant trains the fused up/down matrix, as a sparse fine-tune does
        // (`sparse_llama::fused_mlp`); same values, its own variable.
        let up_down = Var::from_tensor(&twell::up_down_matrix(&w.up, &w.down)?)?;
        let mut sparse = SparseMlp::from_up_down(
            vars[0].as_tensor().clone(),
            up_down.as_tensor().clone(),
            Activation::Relu,
            FfnMode::Sparse,
        )?;
        if let Some(path) = backward {
            sparse = sparse.with_backward_path(path);
        }
        Ok(Self {
            dense: SparseMlp::new(
                vars[0].as_tensor().clone(),
                vars[1].as_tensor().clone(),
                vars[2].as_tensor().clone(),
                Activation::Relu,
                FfnMode::Dense,
            )?,
            sparse,
        })
    }
}

/// Forward, loss and backward of one variant; the gradients are dropped. The loss
/// sums each row first: candle's `sum_all` over `[M, d]` runs in one thread block
/// (2.3 ms at M = 16384 on an H200), which would drown the layer being measured.
fn step(mlp: &SparseMlp, x: &Var, l1: Option<f64>) -> candle_core::Result<()> {
    let total = |t: Tensor| t.sum(D::Minus1)?.to_dtype(DType::F32)?.sum_all();
    let loss = match l1 {
        None => total(Module::forward(mlp, x.as_tensor())?)?,
        Some(lambda) => {
            let (out, l1) = mlp.forward_with_l1(x.as_tensor())?;
            (total(out)? + (l1.to_dtype(DType::F32)?.sum_all()? * lambda)?)?
        }
    };
    std::hint::black_box(loss.backward()?);
    Ok(())
}

pub fn run(args: &MlpTrainBenchArgs) -> Result<MlpTrainReport> {
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    let shapes = check_sweep(&args.shape, &args.density, &args.tokens)?;
    args.rounds.check()?;
    if !(args.l1 >= 0.0 && args.l1.is_finite()) {
        bail!("--l1 {}: must be a finite number >= 0", args.l1);
    }
    let total = shapes.len() * args.density.len() * args.tokens.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .expect("static progress template"),
    );
    let mut rows = Vec::new();
    for &(hidden, ffn) in &shapes {
        for &density in &args.density {
            // Two weight sets, one per variant, swapped every round.
            let layers = (0..2)
                .map(|k| {
                    let weights = synthetic_mlp(hidden, ffn, density, dtype, &device, 2000 + k)?;
                    Layer::new(weights, args.backward.path())
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            for &m in &args.tokens {
                bar.set_message(format!("{hidden}x{ffn} density {density} M={m}"));
                let x = Var::from_tensor(&synthetic_input(m, hidden, dtype, &device, 9)?)?;
                let measured_density = probe(x.as_tensor(), &layers[0].sparse)?.density()?;
                let lambda = Some(args.l1);
                let mut dense_run = |round: usize| step(&layers[round % 2].dense, &x, None);
                let mut sparse_run =
                    |round: usize| step(&layers[(round + 1) % 2].sparse, &x, lambda);
                let t = interleaved_medians(
                    &device,
                    args.rounds,
                    &mut [&mut dense_run, &mut sparse_run],
                )?;
                let memory = MemoryProbe::start(&device)?;
                step(&layers[0].dense, &x, None)?;
                let dense_peak_bytes = memory.peak_extra()?;
                let memory = MemoryProbe::start(&device)?;
                let calls = twell::device_backward_calls();
                step(&layers[0].sparse, &x, lambda)?;
                let sparse_peak_bytes = memory.peak_extra()?;
                rows.push(MlpTrainRow {
                    hidden,
                    ffn,
                    tokens: m,
                    target_density: density,
                    measured_density,
                    dense_ms: t[0] * 1e3,
                    sparse_ms: t[1] * 1e3,
                    speedup: t[0] / t[1],
                    dense_tflops: 18.0 * (m * hidden * ffn) as f64 / t[0] / 1e12,
                    dense_peak_bytes,
                    sparse_peak_bytes,
                    sparse_backward_on_device: twell::device_backward_calls() > calls,
                });
                bar.inc(1);
            }
            drop(layers);
        }
    }
    bar.finish_and_clear();
    let report = MlpTrainReport {
        device: crate::device::device_name(&device),
        dtype: args.dtype.to_string(),
        l1: args.l1,
        rows,
    };
    if let Some(path) = &args.json {
        crate::output::write_json(path, &report)?;
    }
    if let Some(path) = &args.svg {
        let points: Vec<_> = report
            .rows
            .iter()
            .map(|r| crate::chart::SpeedupPoint {
                hidden: r.hidden,
                ffn: r.ffn,
                tokens: r.tokens,
                density: r.target_density,
                speedup: r.speedup,
            })
            .collect();
        crate::chart::speedup_vs_density(
            path,
            "TwELL MLP training step (forward + backward): speed-up over dense",
            &points,
        )?;
    }
    Ok(report)
}

pub fn print(report: &MlpTrainReport) {
    println!(
        "training step (forward + backward) | device {} | dtype {} | sparse loss + {} * L1",
        report.device, report.dtype, report.l1
    );
    println!(
        "{:>6} {:>6} {:>7} {:>8} {:>8} {:>10} {:>10} {:>8} {:>8} {:>10} {:>10} {:>7}",
        "hidden",
        "d_ff",
        "M",
        "target",
        "density",
        "dense ms",
        "sparse ms",
        "speedup",
        "dense TF",
        "dense MiB",
        "sparse MiB",
        "mem"
    );
    // Peak memory is read on a GPU only: elsewhere the columns say "-", not NaN.
    let mib = |b: Option<u64>| {
        b.map_or("-".to_string(), |b| {
            format!("{:.1}", b as f64 / (1 << 20) as f64)
        })
    };
    let ratio = |d: Option<u64>, s: Option<u64>| match (d, s) {
        (Some(d), Some(s)) => format!("{:.2}x", s as f64 / d.max(1) as f64),
        _ => "-".to_string(),
    };
    for r in &report.rows {
        println!(
            "{:>6} {:>6} {:>7} {:>7.2}% {:>7.2}% {:>10.3} {:>10.3} {:>7.2}x {:>8.1} {:>10} {:>10} {:>7}{}",
            r.hidden,
            r.ffn,
            r.tokens,
            100.0 * r.target_density,
            100.0 * r.measured_density,
            r.dense_ms,
            r.sparse_ms,
            r.speedup,
            r.dense_tflops,
            mib(r.dense_peak_bytes),
            mib(r.sparse_peak_bytes),
            ratio(r.dense_peak_bytes, r.sparse_peak_bytes),
            if r.sparse_backward_on_device { "" } else { "  (host backward)" }
        );
    }
}
