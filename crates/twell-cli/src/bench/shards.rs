//! `twell bench shards`: how evenly a real model's active neurons fall across the GPUs of
//! a tensor-parallel FFN (d_ff split in equal, contiguous parts), in the original neuron
//! order and in the order [`balanced_neuron_order`] computes from calibration text. Each
//! token's MLP waits for the part with the most active neurons, so the figure is the
//! per-token most-loaded part over the mean. The permutation is fitted on the first half
//! of the captured rows and measured on the second, so it is not judged on its own data.

use anyhow::{bail, Result};
use candle_core::DType;
use serde::Serialize;
use sparse_llama::sparsity::{balanced_neuron_order, row_imbalance};

use super::layers::{capture_mlp_inputs, CapturedText};

#[derive(clap::Args, Debug)]
pub struct ShardsArgs {
    #[command(flatten)]
    pub input: CapturedText,
    /// Parts d_ff is split into (GPUs of the tensor-parallel FFN).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub shards: Vec<usize>,
    /// Token rows through the model: half fit the permutation, half measure it.
    #[arg(long, default_value_t = 4096)]
    pub rows: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One split: the held-out rows' mean and 99th-percentile per-token imbalance, in the
/// model's neuron order and in the balanced one, over all layers.
#[derive(Serialize, Debug)]
pub struct ShardsRow {
    pub shards: usize,
    pub contiguous_mean: f64,
    pub contiguous_p99: f64,
    pub balanced_mean: f64,
    pub balanced_p99: f64,
    /// The layer whose contiguous parts are least even, and its mean.
    pub worst_layer: (usize, f64),
}

#[derive(Serialize, Debug)]
pub struct ShardsReport {
    pub model: String,
    pub ffn: usize,
    pub layers: usize,
    pub fit_rows: usize,
    pub measured_rows: usize,
    pub mean_density: f64,
    pub rows: Vec<ShardsRow>,
}

pub fn run(args: &ShardsArgs) -> Result<ShardsReport> {
    if args.shards.is_empty() || args.shards.contains(&0) {
        bail!("--shards: part counts must be at least 1");
    }
    if args.rows < 2 {
        bail!("--rows must be at least 2 (half fit, half measure)");
    }
    let (ck, model, inputs) = capture_mlp_inputs(&args.input, args.rows)?;
    let ffn = model.config().intermediate_size;
    if let Some(&s) = args.shards.iter().find(|&&s| !ffn.is_multiple_of(s)) {
        bail!("--shards {s}: d_ff {ffn} does not split into {s} equal parts");
    }
    // Each layer's active neurons per row: the ReLU gate's positives.
    let mut active: Vec<Vec<Vec<bool>>> = Vec::new();
    for (x, mlp) in inputs.iter().zip(model.mlps()) {
        let x = x.to_dtype(DType::F32)?;
        let gate = x.matmul(&mlp.gate_proj().to_dtype(DType::F32)?.t()?)?;
        let positive: Vec<Vec<u8>> = gate.gt(0f64)?.to_dtype(DType::U8)?.to_vec2()?;
        active.push(
            positive
                .into_iter()
                .map(|r| r.into_iter().map(|v| v > 0).collect())
                .collect(),
        );
    }
    let rows = active[0].len();
    let fit = rows / 2;
    let nnz: usize = active
        .iter()
        .flatten()
        .map(|r| r.iter().filter(|&&a| a).count())
        .sum();
    // Each layer's calibration load: how many of the first half's rows fired each neuron.
    let loads: Vec<Vec<u64>> = active
        .iter()
        .map(|rows_active| {
            let mut load = vec![0u64; ffn];
            for row in &rows_active[..fit] {
                for (l, &a) in load.iter_mut().zip(row) {
                    *l += u64::from(a);
                }
            }
            load
        })
        .collect();
    let identity: Vec<usize> = (0..ffn).collect();
    let mut report_rows = Vec::new();
    for &shards in &args.shards {
        let (mut contiguous, mut balanced) = (Vec::new(), Vec::new());
        let mut worst_layer = (0, 0.0);
        for (layer, (rows_active, load)) in active.iter().zip(&loads).enumerate() {
            let order = balanced_neuron_order(load, shards)?;
            let before: Vec<f64> = rows_active[fit..]
                .iter()
                .map(|r| row_imbalance(r, &identity, shards))
                .collect();
            let mean = before.iter().sum::<f64>() / before.len().max(1) as f64;
            if mean > worst_layer.1 {
                worst_layer = (layer, mean);
            }
            contiguous.extend(before);
            balanced.extend(
                rows_active[fit..]
                    .iter()
                    .map(|r| row_imbalance(r, &order, shards)),
            );
        }
        let stats = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            let p99 = v
                .get((v.len() * 99 / 100).min(v.len().saturating_sub(1)))
                .copied()
                .unwrap_or(1.0);
            (mean, p99)
        };
        let (contiguous_mean, contiguous_p99) = stats(contiguous);
        let (balanced_mean, balanced_p99) = stats(balanced);
        report_rows.push(ShardsRow {
            shards,
            contiguous_mean,
            contiguous_p99,
            balanced_mean,
            balanced_p99,
            worst_layer,
        });
    }
    let report = ShardsReport {
        model: ck.source.display().to_string(),
        ffn,
        layers: active.len(),
        fit_rows: fit,
        measured_rows: rows - fit,
        mean_density: nnz as f64 / (active.len() * rows * ffn) as f64,
        rows: report_rows,
    };
    if let Some(path) = &args.json {
        crate::output::write_json(path, &report)?;
    }
    Ok(report)
}

pub fn print(report: &ShardsReport) {
    println!(
        "{} | d_ff {} x {} layers | {} rows fit the order, {} measured | mean density {:.2}%",
        report.model,
        report.ffn,
        report.layers,
        report.fit_rows,
        report.measured_rows,
        100.0 * report.mean_density
    );
    println!("most-loaded part over the mean, per token (1.00 is even):");
    println!(
        "{:>7} {:>16} {:>16} {:>16} {:>16} {:>18}",
        "shards",
        "contiguous mean",
        "contiguous p99",
        "balanced mean",
        "balanced p99",
        "worst layer"
    );
    for r in &report.rows {
        println!(
            "{:>7} {:>16.3} {:>16.3} {:>16.3} {:>16.3} {:>12} {:.3}",
            r.shards,
            r.contiguous_mean,
            r.contiguous_p99,
            r.balanced_mean,
            r.balanced_p99,
            r.worst_layer.0,
            r.worst_layer.1
        );
    }
}
