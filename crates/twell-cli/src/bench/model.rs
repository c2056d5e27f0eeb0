//! `twell bench model`: a whole model, dense FFN against TwELL FFN on the same weights,
//! for prefill, decode and a training step; tokens/s, peak GPU memory, energy per
//! token, and the FFN density measured during the run.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sparse_llama::checkpoint::LoadOptions;
use sparse_llama::{synthetic, Cache, Config, DecodeOptions, DecodeRow, Llama, SlotDecoder};
use sparse_train::{PackedData, TrainConfig, Trainer};
use twell::FfnMode;

use super::energy::EnergyMeter;
use super::memory::MemoryProbe;
use super::mlp::{FewRowsArg, StagedRowsArg};
use super::random_tokens;
use super::timing::median;
use crate::device::FfnArg;
use crate::model_args::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Random-init model instead of --model: HIDDENxFFNxLAYERS (e.g. 2048x5632x28).
    #[arg(long)]
    pub shape: Option<String>,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// Prefill batches as BATCHxSEQ; empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "1x512,4x512")]
    pub prefill: Vec<String>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub decode_batch: Vec<usize>,
    /// Context held in the KV cache while decoding.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// Training steps as BATCHxSEQ (forward + backward + AdamW); empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "1x256")]
    pub train: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seconds of repeated runs per phase (decode: each of its two runs) and FFN mode
    /// over which energy is read, after the timed repetitions: NVML's counter moves in
    /// steps, so short regions misread it. 0 reads it over the timed repetitions instead.
    #[arg(long, default_value_t = 2.0)]
    pub energy_secs: f64,
    /// Keep each layer's q, k, v projections split, as loaded (the inference phases
    /// otherwise stack them into one product, as `generate` and `eval` do), to measure
    /// one form against the other.
    #[arg(long)]
    pub split_qkv: bool,
    /// Skip the decode steps replayed as CUDA graphs (`decode-graph`: launched back to
    /// back; `graph-synced`: each step's tokens read back before the next, as `generate`
    /// and `serve` run them); the op-by-op decode (`decode`) runs either way.
    #[arg(long)]
    pub no_graph: bool,
    /// The CUDA kernel of the sparse MLP at 2 to 16 rows (`twell::FewRows`).
    #[arg(long, value_enum, default_value_t = FewRowsArg::Auto)]
    pub few_rows: FewRowsArg,
    /// The CUDA staged kernels of the sparse MLP at 2 to 64 rows (`twell::StagedRows`).
    #[arg(long, value_enum, default_value_t = StagedRowsArg::Auto)]
    pub staged_rows: StagedRowsArg,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// SVG chart of the sparse/dense speed-up per measurement.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// FFN paths to run: some of dense, sparse and auto (`SparseMlp`'s own choice per
    /// call); one alone, to profile or trace it.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "dense,sparse"
    )]
    pub ffn_paths: Vec<FfnArg>,
}

/// The rest of a random `--shape` model: its heads, vocabulary and FFN density.
#[derive(clap::Args, Debug, Clone)]
pub struct SyntheticArgs {
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// KV heads (default: = heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long, default_value_t = 49152)]
    pub vocab: usize,
    /// FFN density of a --shape model (constant feature + gate bias).
    #[arg(long, default_value_t = 0.005)]
    pub density: f64,
}

#[derive(Serialize, Debug, Clone)]
pub struct Measurement {
    pub phase: String,
    pub batch: usize,
    pub seq: usize,
    pub ffn: String,
    pub tokens_per_sec: f64,
    pub ms: f64,
    /// Most device memory in use above the weights during the region (CUDA).
    pub peak_extra_bytes: Option<u64>,
    pub mj_per_token: Option<f64>,
    /// Training: where one extra, synchronised step spends its time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_ms: Option<sparse_train::train::PhaseMs>,
    /// Training: MLP backward passes of the timed steps that ran on the CUDA kernels
    /// (the rest fell back to the host).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_backward_passes: Option<usize>,
    /// Training: mean FFN density (L0 / d_ff over layers) of the timed steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_density: Option<f64>,
    /// Decode: the host's time to enqueue one step (ms, median of the timed runs), the
    /// steps running without a sync between them. Near `ms` the host bounds the step;
    /// well under it, the GPU does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_ms: Option<f64>,
    /// Decode graphs: the replayed graph's nodes by kind (kernel, memset, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_nodes: Option<Vec<(String, usize)>>,
}

#[derive(Serialize, Debug)]
pub struct ModelReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub parameters: usize,
    /// Mean FFN density per layer in a prefill of the first shape (sparse path).
    pub density_per_layer: Vec<f64>,
    /// Whether the inference phases ran one q, k, v product per layer (`--split-qkv`
    /// off).
    pub fused_qkv: bool,
    pub measurements: Vec<Measurement>,
}

pub(crate) fn parse_bxt(s: &str) -> Result<(usize, usize)> {
    let (b, t) = s
        .split_once('x')
        .with_context(|| format!("'{s}' is not BATCHxSEQ"))?;
    let (b, t): (usize, usize) = (
        b.parse().context("bad batch")?,
        t.parse().context("bad sequence length")?,
    );
    if b == 0 || t < 2 {
        bail!("'{s}': need batch >= 1 and sequence >= 2");
    }
    Ok((b, t))
}

pub fn run(args: &ModelBenchArgs) -> Result<ModelReport> {
    let modes = ffn_paths(&args.ffn_paths)?;
    if args.svg.is_some() && modes.len() < 2 {
        bail!("--svg charts sparse against dense: run both --ffn-paths");
    }
    if args.reps == 0 || args.decode_steps == 0 {
        bail!("--reps and --decode-steps must be at least 1");
    }
    if !(args.energy_secs.is_finite() && args.energy_secs >= 0.0) {
        bail!(
            "--energy-secs {}: want seconds >= 0 (0 reads energy over the timed repetitions)",
            args.energy_secs
        );
    }
    let prefill = args
        .prefill
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| parse_bxt(s))
        .collect::<Result<Vec<_>>>()?;
    let train = args
        .train
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| parse_bxt(s))
        .collect::<Result<Vec<_>>>()?;
    if args.decode_batch.contains(&0) {
        bail!("--decode-batch sizes must be at least 1");
    }
    let device = args.model.device()?;
    let dtype = args.model.dtype(&device);
    let (mut cfg, weights, name) = model_source(args, dtype, &device)?;
    cfg.twell = cfg.twell.with_paths(twell::KernelPaths {
        few_rows: args.few_rows.paths(),
        staged_rows: args.staged_rows.paths(),
        ..cfg.twell.paths()
    });
    let mut model = Llama::load(
        VarBuilder::from_tensors(weights.clone(), dtype, &device),
        &cfg,
    )?;
    if !args.split_qkv {
        model.fuse_qkv()?;
    }
    model.fold_mlp_norms()?;
    let meter = EnergyMeter::new(match &device {
        Device::Cuda(_) => Some(0),
        _ => None,
    });
    let total = prefill.len() + args.decode_batch.len() + train.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .expect("static progress template"),
    );

    // Density actually seen, per layer, on the first prefill shape.
    model.set_ffn_mode(FfnMode::Sparse)?;
    model.record_ffn_stats(true);
    let (b0, t0) = prefill.first().copied().unwrap_or((1, 128));
    let mut cache = Cache::new(false, dtype, &cfg, &device)?;
    model.forward(
        &random_tokens(b0, t0, cfg.vocab_size, &device)?,
        0,
        &mut cache,
    )?;
    let density_per_layer: Vec<f64> = model
        .ffn_stats()?
        .into_iter()
        .map(|s| s.map_or(0.0, |s| s.density))
        .collect();
    model.record_ffn_stats(false);

    let mut measurements = Vec::new();
    let mut bench = Bench {
        args,
        model,
        modes,
        device: device.clone(),
        meter,
        cfg: cfg.clone(),
        dtype,
    };
    for &(b, t) in &prefill {
        bar.set_message(format!("prefill {b}x{t}"));
        let x = random_tokens(b, t, bench.cfg.vocab_size, &device)?;
        let (cfg, dev) = (bench.cfg.clone(), device.clone());
        let mut run = |model: &Llama| -> candle_core::Result<()> {
            let mut cache = Cache::new(true, dtype, &cfg, &dev)?;
            model.forward(&x, 0, &mut cache)?;
            Ok(())
        };
        measurements.extend(bench.measure("prefill", (b, t), b * t, &mut run)?);
        bar.inc(1);
    }
    for &b in &args.decode_batch {
        bar.set_message(format!("decode batch {b} at context {}", args.context));
        measurements.extend(decode_phase(&mut bench, b)?);
        if device.is_cuda() && !args.no_graph {
            measurements.extend(graph_decode_phase(&mut bench, b)?);
        }
        bar.inc(1);
    }
    for &(b, t) in &train {
        bar.set_message(format!("train {b}x{t}"));
        measurements.extend(train_phase(&bench, &weights, b, t)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(ModelReport {
        model: name,
        device: crate::device::device_name(&device),
        dtype: format!("{dtype:?}"),
        parameters: cfg.num_parameters(),
        density_per_layer,
        fused_qkv: !args.split_qkv,
        measurements,
    })
}

/// The model to time: a random one of `--shape` at `--density`, or `--model`'s checkpoint
/// with its MLPs on ReLU. Returns its config, weights and a name for the report.
fn model_source(
    args: &ModelBenchArgs,
    dtype: DType,
    device: &Device,
) -> Result<(Config, HashMap<String, Tensor>, String)> {
    Ok(match &args.shape {
        Some(shape) => synthetic_source(shape, &args.synthetic, dtype, device)?,
        None => {
            let ck = args.model.open()?;
            let opts = LoadOptions {
                activation: Some(twell::Activation::Relu),
                ffn_mode: Some(FfnMode::Sparse),
            };
            let cfg = ck.runtime_config(&opts)?;
            (
                cfg,
                ck.tensors(dtype, device)?,
                ck.source.display().to_string(),
            )
        }
    })
}

/// `--shape`'s `HIDDENxFFNxLAYERS`.
pub(crate) fn parse_shape(shape: &str) -> Result<[usize; 3]> {
    let parts: Vec<usize> = shape
        .split('x')
        .map(|p| p.parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("--shape '{shape}' is not HIDDENxFFNxLAYERS"))?;
    match parts[..] {
        [h, f, l] => Ok([h, f, l]),
        _ => bail!("--shape '{shape}' is not HIDDENxFFNxLAYERS"),
    }
}

/// A random model of `shape` (`HIDDENxFFNxLAYERS`) with `rest`'s heads and vocabulary,
/// its MLPs at about `rest.density` (a constant feature and a gate bias), the same on
/// every call: its config, weights and a line that names it.
pub(crate) fn synthetic_source(
    shape: &str,
    rest: &SyntheticArgs,
    dtype: DType,
    device: &Device,
) -> Result<(Config, HashMap<String, Tensor>, String)> {
    let [h, f, l] = parse_shape(shape)?;
    let (heads, density) = (rest.heads, rest.density);
    let cfg = synthetic::config(h, f, l, heads, rest.kv_heads.unwrap_or(heads), rest.vocab)?;
    let w = synthetic::weights(&cfg, density, 0, dtype, device)?;
    let what = format!("random {shape} (density {density} by constant feature + gate bias)");
    Ok((cfg, w, what))
}

/// What every phase of the benchmark times with: the model, the FFN paths, the device and
/// its energy meter.
struct Bench<'a> {
    args: &'a ModelBenchArgs,
    model: Llama,
    modes: Vec<(FfnMode, &'static str)>,
    device: Device,
    meter: EnergyMeter,
    cfg: Config,
    dtype: DType,
}

impl Bench<'_> {
    /// [`measure`] of `run` on every FFN path.
    fn measure(
        &mut self,
        phase: &str,
        (b, t): (usize, usize),
        tokens: usize,
        run: &mut dyn FnMut(&Llama) -> candle_core::Result<()>,
    ) -> Result<Vec<Measurement>> {
        measure(
            &mut self.model,
            &self.modes,
            self.args,
            &self.device,
            &self.meter,
            phase,
            b,
            t,
            tokens,
            true,
            run,
        )
    }
}

/// Decode at batch `b`: `--decode-steps` one-token steps after a `--context` prefill,
/// timed as (prefill + steps) less the prefill alone, with the host's enqueue time.
fn decode_phase(bench: &mut Bench, b: usize) -> Result<Vec<Measurement>> {
    let (args, dtype) = (bench.args, bench.dtype);
    let (cfg, device) = (bench.cfg.clone(), bench.device.clone());
    let mut measurements = Vec::new();
    let ctx = random_tokens(b, args.context, cfg.vocab_size, &device)?;
    let step_tokens = random_tokens(b, 1, cfg.vocab_size, &device)?;
    let steps = args.decode_steps;
    // The host's time to enqueue the steps, one entry per call of `run`.
    let host_secs = std::cell::RefCell::new(Vec::new());
    // Decode time is (context prefill + steps) minus the context prefill alone, both
    // measured the same way: the cache must be rebuilt for every repetition.
    let mut run = |model: &Llama| -> candle_core::Result<()> {
        let mut cache = Cache::new(true, dtype, &cfg, &device)?;
        model.forward(&ctx, 0, &mut cache)?;
        device.synchronize()?;
        let t0 = Instant::now();
        for s in 0..steps {
            model.forward(&step_tokens, args.context + s, &mut cache)?;
        }
        host_secs.borrow_mut().push(t0.elapsed().as_secs_f64());
        Ok(())
    };
    let mut prefill_only = |model: &Llama| -> candle_core::Result<()> {
        let mut cache = Cache::new(true, dtype, &cfg, &device)?;
        model.forward(&ctx, 0, &mut cache)?;
        Ok(())
    };
    let with = bench.measure("decode", (b, args.context), b * steps, &mut run)?;
    let without = bench.measure("decode-prefill", (b, args.context), b, &mut prefill_only)?;
    let host_secs = host_secs.into_inner();
    for (k, (w, p)) in with.into_iter().zip(without).enumerate() {
        let ms = decode_ms(w.ms, p.ms);
        let host_ms = timed_runs_of(&host_secs, bench.modes.len(), k, args.warmup, args.reps)
            .map(|runs| 1e3 * median(runs) / steps.max(1) as f64);
        if ms.is_nan() {
            eprintln!(
                "warning: decode batch {b} ({}): {steps} steps took no measurable time \
                 beyond the {}-token context prefill ({:.3} against {:.3} ms); raise \
                 --decode-steps or --reps",
                w.ffn, args.context, w.ms, p.ms
            );
        }
        let mj_per_token = decode_mj_per_token(w.mj_per_token, p.mj_per_token, b, steps);
        measurements.push(Measurement {
            tokens_per_sec: (b * steps) as f64 / (ms / 1e3),
            ms: ms / steps as f64,
            mj_per_token,
            phase_ms: None,
            device_backward_passes: None,
            train_density: None,
            host_ms,
            ..w
        });
    }
    Ok(measurements)
}

/// Decode at batch `b` through the slot decoder, each step one CUDA graph replayed:
/// `--decode-steps` steps after a `--context` prefill of every slot, per FFN path (its
/// graph captured on the first step, outside the timing), paths interleaved per
/// repetition. Steps are enqueued back to back, as in `decode`, with the host's share.
fn graph_decode_phase(bench: &mut Bench, b: usize) -> Result<Vec<Measurement>> {
    if let Some(why) = SlotDecoder::unsupported(&bench.model) {
        eprintln!("note: no decode-graph rows: {why}");
        return Ok(Vec::new());
    }
    let args = bench.args;
    let (ctx_len, steps) = (args.context, args.decode_steps);
    let vocab = bench.cfg.vocab_size as u32;
    let context =
        random_tokens(b, ctx_len, bench.cfg.vocab_size, &bench.device)?.to_vec2::<u32>()?;
    let options = DecodeOptions {
        slots: b,
        context: ctx_len + steps + 1,
        graphs: true,
    };
    let rows_at = |s: usize| -> Vec<DecodeRow> {
        (0..b)
            .map(|i| DecodeRow {
                slot: i,
                token: (i as u32 * 7919 + 13) % vocab,
                position: ctx_len + s,
            })
            .collect()
    };
    let mut decoders = Vec::new();
    for &(mode, _) in &bench.modes {
        bench.model.set_ffn_mode(mode)?;
        let mut decoder = SlotDecoder::new(&bench.model, options)?;
        for (slot, prompt) in context.iter().enumerate() {
            decoder.prefill(&bench.model, slot, prompt)?;
        }
        // The first step captures the graph(s): not timed.
        decoder.step(&mut bench.model, &rows_at(0))?;
        decoders.push(decoder);
    }
    let mut times = vec![Vec::new(); decoders.len()];
    let mut host = vec![Vec::new(); decoders.len()];
    let mut synced = vec![Vec::new(); decoders.len()];
    for round in 0..args.warmup + args.reps {
        for (k, decoder) in decoders.iter_mut().enumerate() {
            bench.model.set_ffn_mode(bench.modes[k].0)?;
            bench.device.synchronize()?;
            let t0 = Instant::now();
            for s in 0..steps {
                decoder.step(&mut bench.model, &rows_at(s))?;
            }
            let enqueued = t0.elapsed().as_secs_f64();
            bench.device.synchronize()?;
            let back_to_back = t0.elapsed().as_secs_f64();
            // The same steps as `generate` and `serve` run them: each step's tokens read
            // back before the next is launched, so the host's launch time adds to the
            // step's.
            let t0 = Instant::now();
            for s in 0..steps {
                decoder.step(&mut bench.model, &rows_at(s))?;
                decoder.greedy_tokens()?;
            }
            if round >= args.warmup {
                times[k].push(back_to_back);
                host[k].push(enqueued);
                synced[k].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let graph_nodes = decoders
        .iter()
        .map(|d| d.graph_nodes(b))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    for (k, &(_, label)) in bench.modes.iter().enumerate() {
        if let Some(why) = decoders[k].graph_failure() {
            eprintln!("warning: decode-graph batch {b} ({label}): {why}");
        }
        let ffn = match decoders[k].side(b) {
            Some(side) if label == "auto" => format!("auto:{}", side.name()),
            _ => label.into(),
        };
        for (phase, secs) in [
            ("decode-graph", median(times[k].clone())),
            ("graph-synced", median(synced[k].clone())),
        ] {
            let back_to_back = phase == "decode-graph";
            rows.push(Measurement {
                phase: phase.into(),
                batch: b,
                seq: ctx_len,
                ffn: ffn.clone(),
                tokens_per_sec: (b * steps) as f64 / secs,
                ms: 1e3 * secs / steps as f64,
                peak_extra_bytes: None,
                mj_per_token: None,
                phase_ms: None,
                device_backward_passes: None,
                train_density: None,
                host_ms: back_to_back.then(|| 1e3 * median(host[k].clone()) / steps as f64),
                graph_nodes: if back_to_back {
                    graph_nodes[k].clone()
                } else {
                    None
                },
            });
        }
    }
    Ok(rows)
}

/// A training step on batches of `b × t` tokens (forward, backward and AdamW at a zero
/// learning rate, so the density holds) on every FFN path, each through its own trainer.
fn train_phase(
    bench: &Bench,
    weights: &HashMap<String, Tensor>,
    b: usize,
    t: usize,
) -> Result<Vec<Measurement>> {
    let (args, dtype, cfg, device, meter) = (
        bench.args,
        bench.dtype,
        &bench.cfg,
        &bench.device,
        &bench.meter,
    );
    let mut measurements = Vec::new();
    let tokens: Vec<u32> = (0..(b * (t + 1) * 4))
        .map(|i| ((i as u64 * 40503) % cfg.vocab_size as u64) as u32)
        .collect();
    let data = PackedData::new(&tokens, t)?;
    let tc = TrainConfig {
        seq_len: t,
        batch_size: b,
        steps: 1_000_000,
        warmup_steps: 1,
        // bf16 compute on f32 masters where the model runs in bf16 (the CUDA
        // kernels take bf16).
        bf16: dtype == DType::BF16,
        // A zero learning rate keeps the weights, and so the density, as set: AdamW
        // still does all its work, but a real rate moves a random model's gate
        // biases within a few steps, and the FFN goes dense under the timer.
        lr: 0.0,
        ..Default::default()
    };
    for &(mode, label) in &bench.modes {
        // A trainer per path, as `twell finetune --ffn` builds it: the sparse one
        // trains each layer's fused up/down matrix (`sparse_llama::fused_mlp`).
        let mut mode_cfg = cfg.clone();
        mode_cfg.ffn_mode = mode;
        let mut trainer = Trainer::new(mode_cfg, weights.clone(), tc.clone(), device)?;
        for _ in 0..args.warmup {
            trainer.train_step(&data)?;
        }
        device.synchronize()?;
        let probe = MemoryProbe::start(device)?;
        let e0 = meter.read_mj();
        let calls = twell::device_backward_calls();
        let mut times = Vec::new();
        // The timed steps are forward + backward + AdamW alone: the fine-tuning
        // loop's activity statistics (the dense FFN counts fired neurons over
        // `[tokens, d_ff]` each step) are off, and the density is read after them.
        trainer.set_activity_stats(false);
        for _ in 0..args.reps {
            let t0 = Instant::now();
            trainer.train_step(&data)?;
            device.synchronize()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        trainer.set_activity_stats(true);
        let e1 = meter.read_mj();
        let device_backward_passes = Some(twell::device_backward_calls() - calls);
        let peak_extra_bytes = probe.peak_extra()?;
        // One more step, synchronised between phases, to show where the time goes
        // and at what density the FFN ran (the weights do not move: learning rate 0).
        trainer.set_profile(true);
        let probe_step = trainer.train_step(&data)?;
        trainer.set_profile(false);
        let phase_ms = probe_step.phase_ms;
        let train_density = probe_step.mean_l0 / cfg.intermediate_size as f64;
        let tokens = (b * t * args.reps) as f64;
        let secs = median(times);
        measurements.push(Measurement {
            phase: "train".into(),
            batch: b,
            seq: t,
            ffn: label.into(),
            tokens_per_sec: (b * t) as f64 / secs,
            ms: secs * 1e3,
            peak_extra_bytes,
            mj_per_token: e0.zip(e1).map(|(a, z)| (z - a) as f64 / tokens),
            phase_ms,
            device_backward_passes,
            train_density: Some(train_density),
            host_ms: None,
            graph_nodes: None,
        });
    }
    Ok(measurements)
}

/// The `--ffn-paths` list as FFN modes with their labels, in the order dense, sparse,
/// auto (`Auto` picks per call, as `SparseMlp` does for a user who leaves it to it).
fn ffn_paths(paths: &[FfnArg]) -> Result<Vec<(FfnMode, &'static str)>> {
    const PATHS: [(FfnArg, &str); 3] = [
        (FfnArg::Dense, "dense"),
        (FfnArg::Sparse, "sparse"),
        (FfnArg::Auto, "auto"),
    ];
    let modes: Vec<_> = PATHS
        .into_iter()
        .filter(|(arg, _)| paths.contains(arg))
        .map(|(arg, label)| (arg.mode(), label))
        .collect();
    if modes.is_empty() {
        bail!("--ffn-paths: name at least one of dense, sparse, auto");
    }
    Ok(modes)
}

/// Time of a decode run's steps: the run with them (`with_ms`) less the context prefill
/// alone (`prefill_ms`). Steps lost in the prefill's timing noise give no time (not a
/// number, null in the JSON), never a made-up one.
fn decode_ms(with_ms: f64, prefill_ms: f64) -> f64 {
    if with_ms > prefill_ms {
        with_ms - prefill_ms
    } else {
        f64::NAN
    }
}

/// Energy per generated token of a decode run, measured as its time is: a run with the
/// `steps` tokens of each of `batch` sequences (`with_mj` per token of those) less the
/// context prefill alone (`prefill_mj` per sequence). `None` without NVML.
fn decode_mj_per_token(
    with_mj: Option<f64>,
    prefill_mj: Option<f64>,
    batch: usize,
    steps: usize,
) -> Option<f64> {
    let generated = (batch * steps) as f64;
    with_mj.zip(prefill_mj).map(|(with_mj, prefill_mj)| {
        (with_mj * generated - prefill_mj * batch as f64).max(0.0) / generated
    })
}

/// Times `run` under each FFN mode, modes interleaved per repetition; median time,
/// peak extra device memory and energy per token of each mode. With `long_energy` the
/// energy comes from `--energy-secs` of further runs per mode instead of the timed ones.
#[allow(clippy::too_many_arguments)]
fn measure(
    model: &mut Llama,
    modes: &[(FfnMode, &str)],
    args: &ModelBenchArgs,
    device: &Device,
    meter: &EnergyMeter,
    phase: &str,
    batch: usize,
    seq: usize,
    tokens: usize,
    long_energy: bool,
    run: &mut dyn FnMut(&Llama) -> candle_core::Result<()>,
) -> Result<Vec<Measurement>> {
    let mut times = vec![Vec::new(); modes.len()];
    let mut peaks = vec![None; modes.len()];
    let mut energy = vec![0u64; modes.len()];
    let mut energy_ok = meter.read_mj().is_some();
    for round in 0..args.warmup + args.reps {
        for (k, &(mode, _)) in modes.iter().enumerate() {
            model.set_ffn_mode(mode)?;
            device.synchronize()?;
            let probe = MemoryProbe::start(device)?;
            let e0 = meter.read_mj();
            let t0 = Instant::now();
            run(model)?;
            device.synchronize()?;
            let dt = t0.elapsed().as_secs_f64();
            let e1 = meter.read_mj();
            if round >= args.warmup {
                times[k].push(dt);
                peaks[k] = probe.peak_extra()?.max(peaks[k]);
                match e0.zip(e1) {
                    Some((a, z)) => energy[k] += z.saturating_sub(a),
                    None => energy_ok = false,
                }
            }
        }
    }
    let mut tokens_measured = vec![tokens * args.reps; modes.len()];
    if long_energy && energy_ok && args.energy_secs > 0.0 {
        // Two halves, the second in reverse order, so no mode always follows the other.
        energy = vec![0; modes.len()];
        tokens_measured = vec![0; modes.len()];
        let order: Vec<usize> = (0..modes.len()).chain((0..modes.len()).rev()).collect();
        for k in order {
            model.set_ffn_mode(modes[k].0)?;
            let per_run = median(times[k].clone()).max(1e-6);
            let runs = ((args.energy_secs / 2.0) / per_run).ceil().max(1.0) as usize;
            device.synchronize()?;
            let e0 = meter.read_mj();
            for _ in 0..runs {
                run(model)?;
            }
            device.synchronize()?;
            match e0.zip(meter.read_mj()) {
                Some((a, z)) => energy[k] += z.saturating_sub(a),
                None => energy_ok = false,
            }
            tokens_measured[k] += runs * tokens;
        }
    }
    Ok(modes
        .iter()
        .enumerate()
        .map(|(k, &(_, label))| {
            let secs = median(times[k].clone());
            Measurement {
                phase: phase.into(),
                batch,
                seq,
                ffn: label.into(),
                tokens_per_sec: tokens as f64 / secs,
                ms: secs * 1e3,
                peak_extra_bytes: peaks[k],
                mj_per_token: energy_ok
                    .then(|| energy[k] as f64 / tokens_measured[k].max(1) as f64),
                phase_ms: None,
                device_backward_passes: None,
                train_density: None,
                host_ms: None,
                graph_nodes: None,
            }
        })
        .collect())
}

/// The entries of mode `k` in the timed rounds of [`measure`], from a record with one
/// entry per call of its `run` (rounds of `n_modes` calls, `warmup` rounds first; the
/// energy runs after them are left out); `None` if the record is short.
fn timed_runs_of(
    record: &[f64],
    n_modes: usize,
    k: usize,
    warmup: usize,
    reps: usize,
) -> Option<Vec<f64>> {
    (warmup..warmup + reps)
        .map(|round| record.get(round * n_modes + k).copied())
        .collect()
}

pub fn print(report: &ModelReport) {
    println!(
        "model {} | {} parameters | {} {}",
        report.model, report.parameters, report.device, report.dtype
    );
    let d = &report.density_per_layer;
    if !d.is_empty() {
        println!(
            "FFN density per layer (sparse prefill): mean {:.2}%, min {:.2}%, max {:.2}%",
            100.0 * d.iter().sum::<f64>() / d.len() as f64,
            100.0 * d.iter().cloned().fold(f64::INFINITY, f64::min),
            100.0 * d.iter().cloned().fold(0.0, f64::max)
        );
    }
    println!(
        "{:>15} {:>6} {:>6} {:>7} {:>12} {:>10} {:>12} {:>10} {:>8}",
        "phase", "batch", "seq", "ffn", "tokens/s", "ms", "peak extra", "mJ/token", "speedup"
    );
    let rows: Vec<&Measurement> = report
        .measurements
        .iter()
        .filter(|m| m.phase != "decode-prefill")
        .collect();
    for m in &rows {
        let dense = rows.iter().find(|o| {
            o.phase == m.phase && o.batch == m.batch && o.seq == m.seq && o.ffn == "dense"
        });
        let speedup = dense
            .map(|d| m.tokens_per_sec / d.tokens_per_sec)
            .unwrap_or(f64::NAN);
        println!(
            "{:>15} {:>6} {:>6} {:>7} {:>12.1} {:>10.3} {:>12} {:>10} {:>7.2}x",
            m.phase,
            m.batch,
            m.seq,
            m.ffn,
            m.tokens_per_sec,
            m.ms,
            m.peak_extra_bytes
                .map(|b| format!("{:.1} MB", b as f64 / 1e6))
                .unwrap_or_else(|| "n/a".into()),
            m.mj_per_token
                .map(|e| format!("{e:.3}"))
                .unwrap_or_else(|| "n/a".into()),
            speedup
        );
        if let Some(p) = &m.phase_ms {
            println!(
                "{:>15} one synchronised step, ms: forward {:.1} | backward {:.1} | stats {:.1} | optimizer {:.1} | MLP backward passes on the GPU: {}",
                "", p.forward, p.backward, p.stats, p.optimizer,
                m.device_backward_passes.unwrap_or(0)
            );
        }
        if let Some(host) = m.host_ms {
            println!(
                "{:>15} the host enqueues a step in {:.3} ms ({:.0}% of the step)",
                "",
                host,
                100.0 * host / m.ms
            );
        }
        if let Some(nodes) = &m.graph_nodes {
            let kinds: Vec<String> = nodes.iter().map(|(k, n)| format!("{n} {k}")).collect();
            println!("{:>15} graph nodes: {}", "", kinds.join(", "));
        }
        if let Some(density) = m.train_density {
            println!(
                "{:>15} FFN density of a training step (after the timed ones, same weights): {:.2}%",
                "",
                100.0 * density
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::decode_mj_per_token;

    #[test]
    fn timed_runs_are_picked_by_round_and_mode() {
        // Two modes, one warm-up round, two timed rounds, then two energy runs.
        let record = [0.0, 0.1, 1.0, 1.1, 2.0, 2.1, 9.0, 9.0];
        assert_eq!(
            super::timed_runs_of(&record, 2, 0, 1, 2),
            Some(vec![1.0, 2.0])
        );
        assert_eq!(
            super::timed_runs_of(&record, 2, 1, 1, 2),
            Some(vec![1.1, 2.1])
        );
        assert_eq!(super::timed_runs_of(&record[..4], 2, 1, 1, 2), None);
    }

    #[test]
    fn ffn_paths_come_in_a_fixed_order() {
        use crate::device::FfnArg::{Auto, Dense, Sparse};
        let labels = |v: &[crate::device::FfnArg]| {
            super::ffn_paths(v)
                .unwrap()
                .into_iter()
                .map(|(_, l)| l)
                .collect::<Vec<_>>()
        };
        assert_eq!(labels(&[Auto, Dense]), ["dense", "auto"]);
        assert_eq!(labels(&[Sparse, Auto, Dense]), ["dense", "sparse", "auto"]);
        assert!(super::ffn_paths(&[]).is_err());
    }

    #[test]
    fn decode_steps_lost_in_the_prefill_noise_have_no_time() {
        assert_eq!(super::decode_ms(12.5, 10.0), 2.5);
        assert!(super::decode_ms(10.0, 10.0).is_nan());
        assert!(super::decode_ms(9.9, 10.0).is_nan());
        // ... and so no rate: NaN tokens/s, not billions.
        assert!((64.0 / (super::decode_ms(9.9, 10.0) / 1e3)).is_nan());
    }

    #[test]
    fn decode_energy_is_the_steps_less_the_prefill() {
        // 4 sequences, 16 steps: a run of 640 mJ with the steps (10 per generated
        // token), of which the context prefill alone takes 4 × 40 = 160 mJ.
        let mj = decode_mj_per_token(Some(10.0), Some(40.0), 4, 16).unwrap();
        assert!((mj - 480.0 / 64.0).abs() < 1e-12, "{mj}");
        assert_eq!(decode_mj_per_token(None, Some(40.0), 4, 16), None);
        assert_eq!(decode_mj_per_token(Some(10.0), None, 4, 16), None);
        // A noisy reading below the prefill's is clamped, never negative.
        assert_eq!(decode_mj_per_token(Some(1.0), Some(40.0), 1, 16), Some(0.0));
    }
}
