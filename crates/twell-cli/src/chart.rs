//! SVG charts of benchmark results (plotters).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use sparse_llama::sparsity::LayerSparsity;

/// A drawing area of an SVG in memory.
type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Draws an SVG of `size` (on white) through `draw` and writes it to `path` whole
/// ([`crate::output::write`]): a failed chart leaves no half-drawn file.
fn svg_file(path: &Path, size: (u32, u32), draw: impl FnOnce(&Area) -> Result<()>) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        draw(&root)?;
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    crate::output::write(path, svg)
}

/// One run's points: `(step, validation perplexity)`, `(step, mean L0)` of the training
/// batches and `(step, mean L0)` of the validation batches (logs that have it).
pub struct Curve {
    pub label: String,
    pub perplexity: Vec<(f64, f64)>,
    pub l0: Vec<(f64, f64)>,
    pub val_l0: Vec<(f64, f64)>,
}

/// One measured layer for [`speedup_vs_density`].
pub struct SpeedupPoint {
    pub hidden: usize,
    pub ffn: usize,
    pub tokens: usize,
    /// Fraction of d_ff.
    pub density: f64,
    pub speedup: f64,
}

/// Speed-up over dense against density, one line per (shape, tokens).
pub fn speedup_vs_density(path: &Path, title: &str, rows: &[SpeedupPoint]) -> Result<()> {
    svg_file(path, (900, 560), |root| {
        let max_density = rows.iter().map(|r| r.density * 100.0).fold(0.1, f64::max);
        let max_speedup = rows.iter().map(|r| r.speedup).fold(1.5, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..max_density * 1.05, 0.0..max_speedup)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("activation density (% of d_ff)")
            .y_desc("dense time / sparse time")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        let mut keys: Vec<(usize, usize, usize)> =
            rows.iter().map(|r| (r.hidden, r.ffn, r.tokens)).collect();
        keys.dedup();
        keys.sort();
        keys.dedup();
        for (k, key) in keys.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| (r.hidden, r.ffn, r.tokens) == *key)
                .map(|r| (r.density * 100.0, r.speedup))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(format!("{}x{} M={}", key.0, key.1, key.2))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|e| anyhow!("{e}"))?;
        }
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, 1.0), (max_density * 1.05, 1.0)],
                BLACK.stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

/// FFN density (% of d_ff) of each layer, as bars.
pub fn density_per_layer(path: &Path, layers: &[LayerSparsity]) -> Result<()> {
    svg_file(path, (900, 480), |root| {
        let top = layers.iter().map(|l| 100.0 * l.density).fold(1.0, f64::max) * 1.1;
        let n = layers.len().max(1);
        let mut chart = ChartBuilder::on(root)
            .caption("FFN density per layer", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..n as f64, 0.0..top)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("active neurons per token (% of d_ff)")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(layers.iter().map(|l| {
                let x = l.layer as f64;
                Rectangle::new(
                    [(x + 0.1, 0.0), (x + 0.9, 100.0 * l.density)],
                    BLUE.mix(0.7).filled(),
                )
            }))
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

/// Sparse/dense throughput ratio of each model measurement, as bars.
pub fn model_speedups(path: &Path, report: &crate::bench::model::ModelReport) -> Result<()> {
    let rows: Vec<(String, f64)> = report
        .measurements
        .iter()
        .filter(|m| m.ffn == "sparse" && m.phase != "decode-prefill")
        .filter_map(|m| {
            let dense = report.measurements.iter().find(|d| {
                d.ffn == "dense" && d.phase == m.phase && d.batch == m.batch && d.seq == m.seq
            })?;
            let ratio = m.tokens_per_sec / dense.tokens_per_sec;
            // A rate that could not be measured (not a number) has no bar.
            ratio
                .is_finite()
                .then(|| (format!("{} {}x{}", m.phase, m.batch, m.seq), ratio))
        })
        .collect();
    svg_file(path, (900, 480), |root| {
        let top = rows.iter().map(|r| r.1).fold(1.5, f64::max) * 1.1;
        let n = rows.len().max(1);
        let mut chart = ChartBuilder::on(root)
            .caption(
                "TwELL FFN: whole-model speed-up over dense",
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(60)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..n as f64, 0.0..top)
            .map_err(|e| anyhow!("{e}"))?;
        let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .x_labels(n)
            .x_label_formatter(&|x| labels.get(x.floor() as usize).cloned().unwrap_or_default())
            .y_desc("sparse tokens/s over dense tokens/s")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                Rectangle::new(
                    [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, r.1)],
                    BLUE.mix(0.7).filled(),
                )
            }))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, 1.0), (n as f64, 1.0)],
                BLACK.stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

/// Validation perplexity (top, log scale) and mean L0 (bottom) against step, one line
/// per run.
pub fn training_curves(path: &Path, curves: &[Curve]) -> Result<()> {
    svg_file(path, (900, 720), |root| {
        let (top, bottom) = root.split_vertically(360);
        let max_step = curves
            .iter()
            .flat_map(|c| c.l0.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let ppl: Vec<f64> = curves
            .iter()
            .flat_map(|c| c.perplexity.iter().map(|p| p.1))
            .filter(|v| v.is_finite())
            .collect();
        let (lo, hi) = (
            ppl.iter().copied().fold(f64::MAX, f64::min).min(10.0),
            ppl.iter().copied().fold(0.0, f64::max).max(20.0),
        );
        let mut chart = ChartBuilder::on(&top)
            .caption("validation perplexity", ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_step, (lo * 0.9..hi * 1.1).log_scale())
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for (k, c) in curves.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            chart
                .draw_series(LineSeries::new(c.perplexity.clone(), color.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(c.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        let max_l0 = curves
            .iter()
            .flat_map(|c| c.l0.iter().chain(&c.val_l0).map(|p| p.1))
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(&bottom)
            .caption(
                "mean L0 (active FFN neurons per token): training batches, dots validation",
                ("sans-serif", 20),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_step, 0.0..max_l0 * 1.05)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for (k, c) in curves.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            chart
                .draw_series(LineSeries::new(c.l0.clone(), color.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .draw_series(
                    c.val_l0
                        .iter()
                        .map(|&point| Circle::new(point, 3, color.filled())),
                )
                .map_err(|e| anyhow!("{e}"))?;
        }
        Ok(())
    })
}
