//! `twell bench sweep`: one MLP layer over the shapes of the Llama-family models people
//! run, every size from one token to a long prefill, and a range of densities: the TwELL
//! path and `Auto` against candle's dense MLP in every cell, and per shape the worst
//! `Auto` ratio and where it falls.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;

use super::mlp::{FewRowsArg, GateArg, MlpBenchArgs, MlpRow, StagedRowsArg, WalkArg};
use super::timing::Rounds;
use crate::device::{DeviceArg, DtypeArg};

/// The MLP shapes (hidden × d_ff) of SmolLM2-135M, Qwen2.5-0.5B and 1.5B, Llama 3.2 1B
/// and 3B, Qwen2.5-7B, Llama 2 7B, Llama 3.1 8B and Mistral 7B, Llama 2 13B, Llama 3 70B.
pub const LLAMA_FAMILY_SHAPES: &str =
    "576x1536,896x4864,1536x8960,2048x8192,3072x8192,3584x18944,4096x11008,4096x14336,5120x13824,8192x28672";

/// A ratio `Auto` must reach in every cell: noise allowed, no more.
pub const AUTO_FLOOR: f64 = 0.97;

#[derive(clap::Args, Debug)]
pub struct SweepArgs {
    /// MLP shapes as HIDDENxFFN, comma separated (default: the Llama family's).
    #[arg(long, value_delimiter = ',', default_value = LLAMA_FAMILY_SHAPES)]
    pub shape: Vec<String>,
    /// Token counts M.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256,512,1024,2048,8192,32768"
    )]
    pub tokens: Vec<usize>,
    /// Target activation densities (fraction of d_ff), set through a gate bias.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.001,0.005,0.01,0.03,0.1,0.5"
    )]
    pub density: Vec<f64>,
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    pub dtype: DtypeArg,
    #[command(flatten)]
    pub device: DeviceArg,
    #[command(flatten)]
    pub rounds: Rounds,
    /// Weight sets rotated between rounds and variants.
    #[arg(long, default_value_t = 2)]
    pub weight_sets: usize,
    /// `Auto` re-measures the density every this many calls (0: only when unknown).
    #[arg(long, default_value_t = twell::auto::AUTO_RECHECK_CALLS)]
    pub auto_recheck: usize,
    /// The CUDA kernel of the sparse side at 2 to 16 rows (`twell::FewRows`).
    #[arg(long, value_enum, default_value_t = FewRowsArg::Auto)]
    pub few_rows: FewRowsArg,
    /// The CUDA staged kernels of the sparse side at 2 to 64 rows (`twell::StagedRows`).
    #[arg(long, value_enum, default_value_t = StagedRowsArg::Auto)]
    pub staged_rows: StagedRowsArg,
    /// Write every cell and the per-shape summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The worst cells of one shape.
#[derive(Serialize, Debug)]
pub struct ShapeSummary {
    pub hidden: usize,
    pub ffn: usize,
    /// `Auto` over dense in its worst cell, and that cell's tokens and target density.
    pub worst_auto: (f64, usize, f64),
    /// The same for the TwELL path.
    pub worst_sparse: (f64, usize, f64),
    /// Cells where `Auto` reads under [`AUTO_FLOOR`].
    pub auto_below_floor: usize,
    pub cells: usize,
}

#[derive(Serialize, Debug)]
pub struct SweepReport {
    pub device: String,
    pub dtype: String,
    pub shapes: Vec<ShapeSummary>,
    pub rows: Vec<MlpRow>,
}

pub fn run(args: &SweepArgs) -> Result<SweepReport> {
    // Every flag is checked before the first shape runs, not when its turn comes.
    super::mlp::check_sweep(&args.shape, &args.density, &args.tokens)?;
    args.rounds.check()?;
    let mut shapes = Vec::new();
    let mut rows = Vec::new();
    let mut device = String::new();
    for shape in &args.shape {
        let mlp = MlpBenchArgs {
            shape: vec![shape.clone()],
            tokens: args.tokens.clone(),
            density: args.density.clone(),
            dtype: args.dtype,
            device: args.device.clone(),
            rounds: args.rounds,
            no_screen: false,
            weight_sets: args.weight_sets,
            chain: 1,
            json: None,
            svg: None,
            stages: false,
            gate: GateArg::Auto,
            walk: WalkArg::Mask,
            few_rows: args.few_rows,
            staged_rows: args.staged_rows,
            auto_recheck: args.auto_recheck,
        };
        let report = super::mlp::run(&mlp).with_context(|| format!("shape {shape}"))?;
        device = report.device.clone();
        let summary = summarize(&report.rows).with_context(|| format!("shape {shape}"))?;
        print_summary(&summary);
        print_misses(&report.rows);
        shapes.push(summary);
        rows.extend(report.rows);
    }
    let report = SweepReport {
        device,
        dtype: args.dtype.to_string(),
        shapes,
        rows,
    };
    if let Some(path) = &args.json {
        crate::output::write_json(path, &report)?;
    }
    Ok(report)
}

/// The worst cells of one shape's rows.
pub fn summarize(rows: &[MlpRow]) -> Result<ShapeSummary> {
    let first = rows.first().context("no cells measured")?;
    let worst = |ratio: fn(&MlpRow) -> f64| {
        rows.iter()
            .min_by(|a, b| ratio(a).total_cmp(&ratio(b)))
            .map(|r| (ratio(r), r.tokens, r.target_density))
            .expect("at least one row")
    };
    Ok(ShapeSummary {
        hidden: first.hidden,
        ffn: first.ffn,
        worst_auto: worst(|r| r.auto_speedup),
        worst_sparse: worst(|r| r.speedup),
        auto_below_floor: rows.iter().filter(|r| r.auto_speedup < AUTO_FLOOR).count(),
        cells: rows.len(),
    })
}

fn print_summary(s: &ShapeSummary) {
    let (auto, auto_m, auto_d) = s.worst_auto;
    let (sparse, sparse_m, sparse_d) = s.worst_sparse;
    println!(
        "{}x{}: Auto worst {auto:.2}x (M {auto_m}, {:.1}%), under {AUTO_FLOOR}x in {} of {} \
         cells | TwELL worst {sparse:.2}x (M {sparse_m}, {:.1}%)",
        s.hidden,
        s.ffn,
        100.0 * auto_d,
        s.auto_below_floor,
        s.cells,
        100.0 * sparse_d
    );
}

/// Each cell where `Auto` fell under [`AUTO_FLOOR`], with the side it ran and the times
/// of the fixed modes, so that a miss says whether the choice or the side was slow.
fn print_misses(rows: &[MlpRow]) {
    for r in rows.iter().filter(|r| r.auto_speedup < AUTO_FLOOR) {
        println!(
            "  miss: M {} at {:.1}%: Auto on {} {:.3} ms, dense {:.3} ms, TwELL {:.3} ms",
            r.tokens,
            100.0 * r.target_density,
            r.auto_side.unwrap_or("?"),
            r.auto_ms,
            r.dense_ms,
            r.sparse_ms
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_shapes_parse() {
        for shape in super::LLAMA_FAMILY_SHAPES.split(',') {
            let (h, f) = super::super::mlp::parse_shape(shape).unwrap();
            assert!(h >= 576 && f >= 1536, "{shape}");
        }
    }
}
