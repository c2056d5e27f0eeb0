//! `twell bench linear`: a decode step's projections at a few rows, the few-row kernel
//! (`fused_ops::linear_rows`) against candle's matmul (cuBLAS) on the same weights, in one
//! run. Each timed call runs the product `--calls` times back to back, so the host's
//! synchronisation does not hide a kernel of a few microseconds.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;

use super::timing::{interleaved_medians, Rounds};
use crate::device::DeviceArg;

#[derive(clap::Args, Debug)]
pub struct LinearBenchArgs {
    /// Weights as OUTxIN (`[out, in]`, a linear layer's weight), comma separated. By
    /// default the projections and head of SmolLM2-135M and of a 1.5B Llama shape.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "960x576,576x576,49152x576,6144x2048,2048x2048,49152x2048"
    )]
    pub shapes: Vec<String>,
    /// Rows of x, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub rows: Vec<usize>,
    /// Products per timed call.
    #[arg(long, default_value_t = 50)]
    pub calls: usize,
    #[command(flatten)]
    pub device: DeviceArg,
    #[command(flatten)]
    pub rounds: Rounds,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize, Debug, Clone)]
pub struct LinearRow {
    pub out_features: usize,
    pub in_features: usize,
    pub rows: usize,
    /// Microseconds a product, and the weight's bytes over that time.
    pub cublas_us: f64,
    pub kernel_us: f64,
    pub cublas_gb_s: f64,
    pub kernel_gb_s: f64,
    pub speedup: f64,
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (o, i) = s
        .split_once('x')
        .with_context(|| format!("--shapes {s}: want OUTxIN, e.g. 6144x2048"))?;
    let (o, i): (usize, usize) = (o.trim().parse()?, i.trim().parse()?);
    if o == 0 || i == 0 {
        bail!("--shapes {s}: both sizes must be at least 1");
    }
    Ok((o, i))
}

pub fn run(args: &LinearBenchArgs) -> Result<Vec<LinearRow>> {
    if args.rows.is_empty() || args.rows.contains(&0) {
        bail!("--rows: row counts must be at least 1");
    }
    if args.calls == 0 {
        bail!("--calls must be at least 1");
    }
    args.rounds.check()?;
    let shapes = args
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    let device = args.device.device()?;
    if !device.is_cuda() {
        bail!("bench linear times the CUDA kernel: pass --device cuda");
    }
    let mut out = Vec::new();
    for (n, k) in shapes {
        let w = Tensor::randn(0f32, 1.0, (n, k), &device)?.to_dtype(DType::BF16)?;
        let wt = w.t()?;
        for &m in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &device)?.to_dtype(DType::BF16)?;
            let mut cublas = |_: usize| -> candle_core::Result<()> {
                for _ in 0..args.calls {
                    std::hint::black_box(x.matmul(&wt)?);
                }
                Ok(())
            };
            let mut kernel = |_: usize| -> candle_core::Result<()> {
                for _ in 0..args.calls {
                    std::hint::black_box(fused_ops::linear_rows(&x, &w)?);
                }
                Ok(())
            };
            let t = interleaved_medians(&device, args.rounds, &mut [&mut cublas, &mut kernel])?;
            let us = |s: f64| s * 1e6 / args.calls as f64;
            let gb_s = |s: f64| (n * k * 2) as f64 / (s / args.calls as f64) / 1e9;
            out.push(LinearRow {
                out_features: n,
                in_features: k,
                rows: m,
                cublas_us: us(t[0]),
                kernel_us: us(t[1]),
                cublas_gb_s: gb_s(t[0]),
                kernel_gb_s: gb_s(t[1]),
                speedup: t[0] / t[1],
            });
        }
    }
    Ok(out)
}

pub fn print(rows: &[LinearRow]) {
    println!(
        "{:>7} {:>6} {:>5} {:>10} {:>10} {:>9} {:>9} {:>8}",
        "out", "in", "rows", "cublas us", "kernel us", "cub GB/s", "ker GB/s", "speedup"
    );
    for r in rows {
        println!(
            "{:>7} {:>6} {:>5} {:>10.2} {:>10.2} {:>9.0} {:>9.0} {:>7.2}x",
            r.out_features,
            r.in_features,
            r.rows,
            r.cublas_us,
            r.kernel_us,
            r.cublas_gb_s,
            r.kernel_gb_s,
            r.speedup
        );
    }
}
