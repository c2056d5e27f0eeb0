//! `twell bench mlp`: one MLP layer, candle's dense MLP against the TwELL path on
//! the same weights, across shapes, token counts and densities, in one run.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{Module, Tensor};
use candle_nn::Linear;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use twell::density::{synthetic_input, synthetic_mlp, MlpWeights};
use twell::{FfnMode, SparseMlp};

use super::memory::MemoryProbe;
use super::timing::{host_read_bandwidth, interleaved_medians, Rounds};
use crate::device::{DeviceArg, DtypeArg};

#[derive(clap::Args, Debug)]
pub struct MlpBenchArgs {
    /// MLP shapes as HIDDENxFFN, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "576x1536,2048x5632")]
    pub shape: Vec<String>,
    /// Token counts M.
    #[arg(long, value_delimiter = ',', default_value = "1,16,512")]
    pub tokens: Vec<usize>,
    /// Target activation densities (fraction of d_ff), set through a gate bias.
    #[arg(long, value_delimiter = ',', default_value = "0.005,0.01,0.03,0.1")]
    pub density: Vec<f64>,
    /// f32, bf16 or f16.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    #[command(flatten)]
    pub device: DeviceArg,
    #[command(flatten)]
    pub rounds: Rounds,
    /// Run the sparse variants without the int8 gate screen (CPU, few tokens), to
    /// measure what the screen itself gains.
    #[arg(long)]
    pub no_screen: bool,
    /// Weight sets rotated between rounds and variants (each variant of a round runs
    /// on its own set), so caches do not flatter any side.
    #[arg(long, default_value_t = 3)]
    pub weight_sets: usize,
    /// Layers run back to back in each timed call, each on its own weight set, as a
    /// decode step runs a model's layers: the worker threads stay awake from one layer
    /// to the next, and every layer's weights come cold from memory. Times are per
    /// layer. 1 times isolated calls, where the threads have gone to sleep.
    #[arg(long, default_value_t = 1)]
    pub chain: usize,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG chart of speed-up against density here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Also time each stage of the CUDA sparse path (gate GEMM, pack, up, down) with
    /// device events; this synchronises after every sparse call.
    #[arg(long)]
    pub stages: bool,
    /// The CUDA gate GEMM of the sparse variants (`twell::GateGemm`).
    #[arg(long, value_enum, default_value_t = GateArg::Auto)]
    pub gate: GateArg,
    /// How the CUDA prefill row kernels of the sparse variants find a row's active
    /// neurons (`twell::RowWalk`).
    #[arg(long, value_enum, default_value_t = WalkArg::Mask)]
    pub walk: WalkArg,
    /// The CUDA kernel of the sparse variants at 2 to 16 rows (`twell::FewRows`).
    #[arg(long, value_enum, default_value_t = FewRowsArg::Auto)]
    pub few_rows: FewRowsArg,
    /// The CUDA staged kernels of the sparse variants at 2 to 64 rows where the few-row
    /// kernel does not run (`twell::StagedRows`).
    #[arg(long, value_enum, default_value_t = StagedRowsArg::Auto)]
    pub staged_rows: StagedRowsArg,
    /// `Auto` re-measures the density every this many calls (0: only when unknown);
    /// on a GPU each measurement is a sync (`SparseMlp::with_density_recheck`).
    #[arg(long, default_value_t = twell::auto::AUTO_RECHECK_CALLS)]
    pub auto_recheck: usize,
}

/// `--gate`: [`twell::GateGemm`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateArg {
    /// cuBLASLt with the ReLU mask from 4,096 rows, cuBLAS below.
    Auto,
    /// cuBLASLt with the ReLU mask at every size.
    Masked,
    /// cuBLAS's plain GEMM at every size.
    Plain,
}

/// `--walk`: [`twell::RowWalk`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkArg {
    /// A bit mask of the gate's positives.
    Mask,
    /// The TwELL slots the pack writes.
    Slots,
}

/// `--few-rows`: [`twell::FewRows`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FewRowsArg {
    /// The measured best for the size.
    Auto,
    /// The one-launch kernel with the gates on the tensor cores.
    TensorCores,
    /// The one-launch kernel with the gates on the CUDA cores.
    CudaCores,
    /// The staged kernels.
    Staged,
}

/// `--staged-rows`: [`twell::StagedRows`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedRowsArg {
    /// The measured best for the size.
    Auto,
    /// The row kernels, a row split over up to eight warps.
    RowKernels,
    /// A warp per slot and per tile, sums meeting in atomics.
    SlotKernels,
    /// Up a warp per chunk of a row's neurons, down a block per column slice of a row.
    SpreadKernels,
}

impl StagedRowsArg {
    pub fn paths(self) -> twell::StagedRows {
        match self {
            Self::Auto => twell::StagedRows::Auto,
            Self::RowKernels => twell::StagedRows::RowKernels,
            Self::SlotKernels => twell::StagedRows::SlotKernels,
            Self::SpreadKernels => twell::StagedRows::SpreadKernels,
        }
    }
}

impl FewRowsArg {
    pub fn paths(self) -> twell::FewRows {
        match self {
            Self::Auto => twell::FewRows::Auto,
            Self::TensorCores => twell::FewRows::TensorCores,
            Self::CudaCores => twell::FewRows::CudaCores,
            Self::Staged => twell::FewRows::Staged,
        }
    }
}

impl MlpBenchArgs {
    /// The TwELL configuration of the sparse variants.
    pub fn twell_config(&self) -> twell::TwellConfig {
        twell::TwellConfig::default().with_paths(twell::KernelPaths {
            gate: match self.gate {
                GateArg::Auto => twell::GateGemm::Auto,
                GateArg::Masked => twell::GateGemm::Masked,
                GateArg::Plain => twell::GateGemm::Plain,
            },
            walk: match self.walk {
                WalkArg::Mask => twell::RowWalk::Mask,
                WalkArg::Slots => twell::RowWalk::Slots,
            },
            few_rows: self.few_rows.paths(),
            staged_rows: self.staged_rows.paths(),
        })
    }
}

#[derive(Serialize, Debug, Clone)]
pub struct MlpRow {
    pub hidden: usize,
    pub ffn: usize,
    pub tokens: usize,
    pub target_density: f64,
    pub measured_density: f64,
    pub mean_l0: f64,
    pub dense_ms: f64,
    pub sparse_ms: f64,
    pub speedup: f64,
    /// `SparseMlp` in `Auto` mode: sparse or dense by measured density and size.
    pub auto_ms: f64,
    pub auto_speedup: f64,
    /// The side `Auto` ran on its last timed call (`sparse`, `products` or `dense`).
    pub auto_side: Option<&'static str>,
    /// Weight bytes the dense MLP must read, over its time.
    pub dense_gbps: f64,
    /// Weight bytes the sparse MLP must read (all of Wg, the union of active up/down
    /// rows), over its time.
    pub sparse_gbps: f64,
    /// Dense FLOP rate, 6·M·d·f / time.
    pub dense_gflops: f64,
    /// Peak device memory above the weights and x during one call (None on CPU).
    pub dense_peak_bytes: Option<u64>,
    pub sparse_peak_bytes: Option<u64>,
    /// The same for `Auto` (on a GPU above the break-even, `twell_mlp_products`).
    pub auto_peak_bytes: Option<u64>,
    /// Mean ms of each CUDA sparse stage (gate GEMM, pack, up, down), with --stages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages_ms: Option<[f64; 4]>,
}

#[derive(Serialize, Debug)]
pub struct MlpReport {
    pub device: String,
    pub dtype: String,
    pub threads: usize,
    pub host_read_gbps: f64,
    /// Layers per timed call (`--chain`); every time is per layer.
    pub chain: usize,
    pub rows: Vec<MlpRow>,
}

pub fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (h, f) = s
        .split_once('x')
        .with_context(|| format!("shape '{s}' is not HIDDENxFFN"))?;
    let hidden: usize = h
        .trim()
        .parse()
        .with_context(|| format!("bad hidden size in '{s}'"))?;
    let ffn: usize = f
        .trim()
        .parse()
        .with_context(|| format!("bad d_ff in '{s}'"))?;
    if hidden < 2 || ffn == 0 {
        bail!("shape '{s}': need hidden >= 2 and d_ff >= 1");
    }
    Ok((hidden, ffn))
}

/// The `--shape`, `--density` and `--tokens` of a layer sweep, checked; returns the
/// shapes as `(hidden, d_ff)`.
pub fn check_sweep(
    shapes: &[String],
    densities: &[f64],
    tokens: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let shapes = shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    for &d in densities {
        if !(d > 0.0 && d < 1.0) {
            bail!("--density {d}: each density must be in (0, 1)");
        }
    }
    if tokens.contains(&0) {
        bail!("--tokens: token counts must be at least 1");
    }
    Ok(shapes)
}

/// One TwELL pass of `mlp`'s weights over `x`, outside autograd: the density (and, on
/// the host, which neurons fired) the sparse variant will see.
pub fn probe(x: &Tensor, mlp: &SparseMlp) -> candle_core::Result<twell::MlpOutput> {
    let w_ud = twell::up_down_matrix(&mlp.up_proj().detach(), &mlp.down_proj().detach())?;
    twell::twell_mlp(
        &x.detach(),
        &mlp.gate_proj().detach(),
        &w_ud,
        twell::TwellConfig::default(),
    )
}

/// candle's own dense MLP on the same weights: three `candle_nn::Linear`s.
pub(crate) struct DenseMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl DenseMlp {
    pub(crate) fn new(w: &MlpWeights) -> Self {
        Self {
            gate: Linear::new(w.gate.clone(), None),
            up: Linear::new(w.up.clone(), None),
            down: Linear::new(w.down.clone(), None),
        }
    }
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (self.gate.forward(x)?.relu()? * self.up.forward(x)?)?;
        self.down.forward(&h)
    }
}

pub fn run(args: &MlpBenchArgs) -> Result<MlpReport> {
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    let shapes = check_sweep(&args.shape, &args.density, &args.tokens)?;
    args.rounds.check()?;
    if args.weight_sets == 0 {
        bail!("--weight-sets must be at least 1");
    }
    if args.chain == 0 || args.chain > args.weight_sets {
        bail!(
            "--chain {} must be between 1 and --weight-sets ({}), so that every layer of a \
             chain has weights of its own",
            args.chain,
            args.weight_sets
        );
    }
    let chain = args.chain;
    if args.stages && !device.is_cuda() {
        bail!("--stages times the CUDA kernels: give --device cuda");
    }
    #[cfg(feature = "cuda")]
    twell::cuda::set_stage_profiling(args.stages);
    let host_bw = if device.is_cpu() {
        host_read_bandwidth()
    } else {
        f64::NAN
    };
    let total = shapes.len() * args.density.len() * args.tokens.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .expect("static progress template"),
    );
    let mut rows = Vec::new();
    for &(hidden, ffn) in &shapes {
        for &density in &args.density {
            let sets: Vec<(DenseMlp, SparseMlp, SparseMlp)> = (0..args.weight_sets)
                .map(|k| {
                    let w = synthetic_mlp(hidden, ffn, density, dtype, &device, 1000 + k as u64)?;
                    let sparse = w
                        .relu_mlp(FfnMode::Sparse)?
                        .with_gate_screen(!args.no_screen)
                        .with_twell_config(args.twell_config());
                    let auto = w
                        .relu_mlp(FfnMode::Auto)?
                        .with_gate_screen(!args.no_screen)
                        .with_twell_config(args.twell_config())
                        .with_density_recheck(args.auto_recheck);
                    Ok((DenseMlp::new(&w), sparse, auto))
                })
                .collect::<candle_core::Result<_>>()?;
            for &m in &args.tokens {
                bar.set_message(format!("{hidden}x{ffn} density {density} M={m}"));
                rows.push(measure(args, &sets, (hidden, ffn, density), m)?);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let report = MlpReport {
        device: crate::device::device_name(&device),
        dtype: args.dtype.to_string(),
        threads: rayon::current_num_threads(),
        host_read_gbps: host_bw / 1e9,
        chain,
        rows,
    };
    if let Some(path) = &args.json {
        crate::output::write_json(path, &report)?;
    }
    if let Some(path) = &args.svg {
        let points: Vec<_> = report.rows.iter().map(Into::into).collect();
        crate::chart::speedup_vs_density(path, "TwELL sparse MLP: speed-up over dense", &points)?;
    }
    Ok(report)
}

/// One row of the table: the dense, sparse and `Auto` variants of `sets` timed side by
/// side on `m` tokens of hidden `hidden`, with their memory and read rates.
fn measure(
    args: &MlpBenchArgs,
    sets: &[(DenseMlp, SparseMlp, SparseMlp)],
    (hidden, ffn, density): (usize, usize, f64),
    m: usize,
) -> Result<MlpRow> {
    let device = sets[0].1.gate_proj().device().clone();
    let dtype = args.dtype.dtype();
    let chain = args.chain;
    let x = synthetic_input(m, hidden, dtype, &device, 7)?;
    // Density actually reached, and the union of active neurons.
    let probe = probe(&x, &sets[0].1)?;
    // The union of active neurons needs per-neuron counts, which only the
    // host op keeps; on a GPU it is estimated from the density (uniform).
    let nnz = probe.nnz()?;
    let union = match probe.fired_per_neuron() {
        Some(fired) => fired.iter().filter(|&&c| c > 0).count(),
        None => {
            let p = nnz as f64 / (m * ffn) as f64;
            (ffn as f64 * (1.0 - (1.0 - p).powi(m as i32))).round() as usize
        }
    };
    // Every variant once on every set before any timing: a `SparseMlp` builds
    // its gate screen and up/down matrix on its first call, and with more sets
    // than warm-up rounds that build would land in the timed calls.
    for (dense, sparse, auto) in sets {
        std::hint::black_box(dense.forward(&x)?);
        std::hint::black_box(sparse.forward(&x)?);
        std::hint::black_box(auto.forward(&x)?);
    }
    // `Auto` times its candidates on its first calls of a size and density; the timed
    // rounds measure it once it has chosen (its timings are shared by every set).
    sets[0].2.calibrate(&x)?;
    // Variant v of round r runs layers on sets r + v, r + v + 1, ...: its own
    // sets, not the ones the variant before it just read.
    let set = |round: usize, variant: usize, layer: usize| {
        &sets[(round * chain + variant + layer) % sets.len()]
    };
    let mut dense_run = |round: usize| -> candle_core::Result<()> {
        for layer in 0..chain {
            std::hint::black_box(set(round, 0, layer).0.forward(&x)?);
        }
        Ok(())
    };
    let mut sparse_run = |round: usize| -> candle_core::Result<()> {
        for layer in 0..chain {
            std::hint::black_box(set(round, 1, layer).1.forward(&x)?);
        }
        Ok(())
    };
    let mut auto_run = |round: usize| -> candle_core::Result<()> {
        for layer in 0..chain {
            std::hint::black_box(set(round, 2, layer).2.forward(&x)?);
        }
        Ok(())
    };
    take_stages();
    let t: Vec<f64> = interleaved_medians(
        &device,
        args.rounds,
        &mut [&mut dense_run, &mut sparse_run, &mut auto_run],
    )?
    .into_iter()
    .map(|call| call / chain as f64)
    .collect();
    let stages_ms = take_stages();
    let memory = MemoryProbe::start(&device)?;
    std::hint::black_box(sets[0].0.forward(&x)?);
    let dense_peak_bytes = memory.peak_extra()?;
    let memory = MemoryProbe::start(&device)?;
    std::hint::black_box(sets[0].1.forward(&x)?);
    let sparse_peak_bytes = memory.peak_extra()?;
    let memory = MemoryProbe::start(&device)?;
    std::hint::black_box(sets[0].2.forward(&x)?);
    let auto_peak_bytes = memory.peak_extra()?;
    let elem = dtype.size_in_bytes() as f64;
    let dense_bytes = 3.0 * (hidden * ffn) as f64 * elem;
    // With the int8 gate screen (host, few tokens) the gate costs one byte per
    // weight plus the f32 rows of the neurons that fire (a lower bound: the
    // screen's inactive candidates are not counted).
    let screened = sets[0].1.uses_gate_screen(m);
    let sparse_bytes = if screened {
        (hidden * ffn) as f64 + (union * 3 * hidden) as f64 * elem
    } else {
        ((hidden * ffn) + union * 2 * hidden) as f64 * elem
    };
    Ok(MlpRow {
        hidden,
        ffn,
        tokens: m,
        target_density: density,
        measured_density: nnz as f64 / (m * ffn) as f64,
        mean_l0: nnz as f64 / m as f64,
        dense_ms: t[0] * 1e3,
        sparse_ms: t[1] * 1e3,
        speedup: t[0] / t[1],
        auto_ms: t[2] * 1e3,
        auto_speedup: t[0] / t[2],
        auto_side: sets[0].2.last_side().map(twell::auto::Side::name),
        dense_gbps: dense_bytes / t[0] / 1e9,
        sparse_gbps: sparse_bytes / t[1] / 1e9,
        dense_gflops: 6.0 * (m * hidden * ffn) as f64 / t[0] / 1e9,
        dense_peak_bytes,
        sparse_peak_bytes,
        auto_peak_bytes,
        stages_ms,
    })
}

impl From<&MlpRow> for crate::chart::SpeedupPoint {
    fn from(r: &MlpRow) -> Self {
        Self {
            hidden: r.hidden,
            ffn: r.ffn,
            tokens: r.tokens,
            density: r.target_density,
            speedup: r.speedup,
        }
    }
}

/// The CUDA stage profile gathered since the last call, if profiling.
fn take_stages() -> Option<[f64; 4]> {
    #[cfg(feature = "cuda")]
    return twell::cuda::take_profile();
    #[cfg(not(feature = "cuda"))]
    None
}

pub fn print(report: &MlpReport) {
    println!(
        "device {} | dtype {} | {} threads | host read bandwidth {:.1} GB/s | {}",
        report.device,
        report.dtype,
        report.threads,
        report.host_read_gbps,
        if report.chain == 1 {
            "isolated calls".to_string()
        } else {
            format!(
                "{} layers back to back a call, times per layer",
                report.chain
            )
        }
    );
    println!(
        "{:>6} {:>6} {:>6} {:>8} {:>8} {:>7} {:>10} {:>10} {:>8} {:>6} {:>9} {:>9} {:>9}",
        "hidden",
        "d_ff",
        "M",
        "target",
        "density",
        "L0",
        "dense ms",
        "sparse ms",
        "speedup",
        "auto",
        "dense GB/s",
        "sparse GB/s",
        "dense GF/s"
    );
    for r in &report.rows {
        println!(
            "{:>6} {:>6} {:>6} {:>7.2}% {:>7.2}% {:>7.1} {:>10.3} {:>10.3} {:>7.2}x {:>5.2}x {:>9.1} {:>9.1} {:>9.1}",
            r.hidden,
            r.ffn,
            r.tokens,
            100.0 * r.target_density,
            100.0 * r.measured_density,
            r.mean_l0,
            r.dense_ms,
            r.sparse_ms,
            r.speedup,
            r.auto_speedup,
            r.dense_gbps,
            r.sparse_gbps,
            r.dense_gflops
        );
        if let (Some(dm), Some(sm), Some(am)) =
            (r.dense_peak_bytes, r.sparse_peak_bytes, r.auto_peak_bytes)
        {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "{:>20} peak extra memory: dense {:.1} MiB, sparse {:.1} MiB ({:.2}x), auto {:.1} MiB ({:.2}x)",
                "",
                mib(dm),
                mib(sm),
                sm as f64 / dm.max(1) as f64,
                mib(am),
                am as f64 / dm.max(1) as f64
            );
        }
        if let Some(st) = r.stages_ms {
            println!(
                "{:>20} stages ms: gate {:.4} | pack {:.4} | up {:.4} | down {:.4}",
                "", st[0], st[1], st[2], st[3]
            );
        }
    }
}
