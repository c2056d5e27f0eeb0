//! `twell bench tensor-parallel`: prefill of a random sparse model whose MLPs are split
//! over N processes (`Llama::shard_ffn`; with `--gpus`, one process a GPU), against the
//! whole model on the first process alone, in one run; and how far the split model's
//! logits are from the whole model's.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use sparse_llama::tensor_parallel::Ranks;
use sparse_llama::{Cache, Llama};
use twell_dist::{Communicator, SingleProcess};

use super::model::{parse_bxt, parse_shape, synthetic_source, SyntheticArgs};
use super::random_tokens;
use super::timing::median;
use crate::device::{DeviceSpec, DtypeArg};
use crate::launch::{Rank, RankArgs};

#[derive(clap::Args, Debug)]
pub struct TensorParallelBenchArgs {
    /// A random sparse model, HIDDENxFFNxLAYERS (FFN a multiple of the processes).
    #[arg(long, default_value = "2048x5632x28")]
    pub shape: String,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// Prefill sizes, BATCHxSEQ.
    #[arg(long, value_delimiter = ',', default_value = "1x2048")]
    pub prefill: Vec<String>,
    /// Processes the MLPs are split over (on the CPU they share its cores).
    #[arg(long, default_value_t = 2)]
    pub processes: usize,
    /// One process per GPU: --processes N on CUDA (cuda:0 to cuda:N-1, or from --device
    /// cuda:K on).
    #[arg(long, conflicts_with = "processes")]
    pub gpus: Option<usize>,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Default: bf16 on CUDA, f32 on the CPU.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seconds a process waits for the others before it gives up.
    #[arg(long, default_value = "300", value_parser = crate::launch::parse_peer_timeout)]
    pub peer_timeout: Duration,
    /// Write the report as JSON here (by the first process).
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub rank: RankArgs,
}

/// One prefill size: the whole model alone against the split one.
#[derive(Serialize, Debug, Clone)]
pub struct TensorParallelRow {
    pub batch: usize,
    pub seq: usize,
    pub whole_tokens_per_sec: f64,
    pub split_tokens_per_sec: f64,
    /// Split over whole.
    pub speedup: f64,
    /// `‖split − whole‖ / ‖whole‖` of the last position's logits.
    pub logits_relative_l2: f64,
}

#[derive(Serialize, Debug, Clone)]
pub struct TensorParallelReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub processes: usize,
    /// How the MLPs' sums travel between the processes.
    pub all_reduce: String,
    pub rows: Vec<TensorParallelRow>,
}

impl TensorParallelBenchArgs {
    fn world(&self) -> usize {
        self.gpus.unwrap_or(self.processes)
    }

    /// This process's device: --device, on CUDA moved to this rank's GPU.
    fn device_spec(&self, rank: Option<Rank>) -> DeviceSpec {
        crate::launch::rank_device(self.device, self.gpus, rank)
    }

    fn check(&self) -> Result<Vec<(usize, usize)>> {
        if self.world() == 0 {
            bail!("--processes and --gpus must be at least 1");
        }
        if self.reps == 0 {
            bail!("--reps must be at least 1");
        }
        let density = self.synthetic.density;
        if !(density > 0.0 && density < 1.0) {
            bail!("--density must be in (0, 1), got {density}");
        }
        if self.prefill.is_empty() {
            bail!("--prefill needs at least one BATCHxSEQ");
        }
        // Before any process starts: the split needs equal parts.
        let [_, ffn, _] = parse_shape(&self.shape)?;
        if !ffn.is_multiple_of(self.world()) {
            bail!("FFN {ffn} does not split into {} equal parts", self.world());
        }
        self.prefill.iter().map(|s| parse_bxt(s)).collect()
    }
}

/// Runs the benchmark: as the parent of `--processes` copies of itself, or as one of
/// them. Returns the report in the first process (or the only one), `None` elsewhere.
pub fn run(args: &TensorParallelBenchArgs) -> Result<Option<TensorParallelReport>> {
    let sizes = args.check()?;
    let world = args.world();
    let rank = args.rank.rank();
    if rank.is_none() && world > 1 {
        let on_cpu = args.device_spec(None) == DeviceSpec::Cpu;
        crate::launch::run_ranks(world, on_cpu)?;
        return Ok(None);
    }
    let lead = rank.is_none_or(|r| r.rank == 0);
    let device = args.device_spec(rank).open()?;
    let dtype = DtypeArg::or_default(args.dtype, &device);
    let (cfg, weights, what) = synthetic_source(&args.shape, &args.synthetic, dtype, &device)?;
    let load = || -> Result<Llama> {
        let vb = VarBuilder::from_tensors(weights.clone(), dtype, &device);
        let mut model = Llama::load(vb, &cfg)?;
        model.fuse_qkv()?;
        Ok(model)
    };
    let comm: Box<dyn Communicator> = match rank {
        Some(r) => crate::launch::communicator(r, &device, args.peer_timeout)?.0,
        None => Box::new(SingleProcess),
    };
    let comm: Arc<Mutex<dyn Communicator>> = Arc::new(Mutex::new(comm));
    let ranks = Ranks::new(comm.clone());
    let inputs: Vec<Tensor> = sizes
        .iter()
        .map(|&(b, t)| random_tokens(b, t, cfg.vocab_size, &device))
        .collect::<Result<_>>()?;

    // The whole model on the first process alone; the others wait.
    let mut whole = Vec::new();
    if lead {
        let model = load()?;
        for ids in &inputs {
            whole.push(time_prefill(&model, ids, args, &device)?);
        }
    }
    comm.lock()
        .map_err(|_| anyhow::anyhow!("communicator lock poisoned"))?
        .barrier()?;

    // Every process its share.
    let mut model = load()?;
    model.shard_ffn(ranks, None)?;
    let mut split = Vec::new();
    for ids in &inputs {
        split.push(time_prefill(&model, ids, args, &device)?);
    }
    if !lead {
        return Ok(None);
    }
    let rows = sizes
        .iter()
        .zip(whole.iter().zip(&split))
        .map(
            |(&(b, t), ((whole_ms, whole_logits), (split_ms, split_logits)))| -> Result<_> {
                let tokens = (b * t) as f64;
                let (w, s) = (tokens / whole_ms * 1e3, tokens / split_ms * 1e3);
                Ok(TensorParallelRow {
                    batch: b,
                    seq: t,
                    whole_tokens_per_sec: w,
                    split_tokens_per_sec: s,
                    speedup: s / w,
                    logits_relative_l2: fused_ops::compare::rel_l2(split_logits, whole_logits)?,
                })
            },
        )
        .collect::<Result<_>>()?;
    Ok(Some(TensorParallelReport {
        model: what,
        device: format!("{:?}", device.location()),
        dtype: format!("{dtype:?}"),
        processes: world,
        all_reduce: match world {
            1 => "none (one process)",
            _ if device.is_cpu() => "TCP on loopback",
            _ if cfg!(feature = "nccl") => "NCCL",
            _ => "host memory over TCP (a build with --features nccl reduces on the GPUs)",
        }
        .into(),
        rows,
    }))
}

/// The median ms of a prefill of `ids` (no KV cache) after `--warmup` runs, and the
/// last position's logits.
fn time_prefill(
    model: &Llama,
    ids: &Tensor,
    args: &TensorParallelBenchArgs,
    device: &Device,
) -> Result<(f64, Tensor)> {
    let cfg = model.config().clone();
    let run = || -> Result<Tensor> {
        let mut cache = Cache::new(false, model.dtype(), &cfg, device)?;
        Ok(model.forward(ids, 0, &mut cache)?)
    };
    for _ in 0..args.warmup {
        run()?;
    }
    device.synchronize()?;
    let mut ms = Vec::with_capacity(args.reps);
    let mut logits = None;
    for _ in 0..args.reps {
        let start = Instant::now();
        let out = run()?;
        device.synchronize()?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        logits = Some(out);
    }
    Ok((median(ms), logits.expect("--reps >= 1")))
}

pub fn print(report: &TensorParallelReport) {
    println!(
        "{} on {} ({}), MLPs split over {} processes; all-reduce: {}",
        report.model, report.device, report.dtype, report.processes, report.all_reduce
    );
    println!("prefill      whole tok/s    split tok/s   speed-up   logits rel. L2");
    for r in &report.rows {
        println!(
            "{:>4}x{:<6} {:>12.1} {:>14.1} {:>9.2}x   {:.2e}",
            r.batch,
            r.seq,
            r.whole_tokens_per_sec,
            r.split_tokens_per_sec,
            r.speedup,
            r.logits_relative_l2
        );
    }
}
