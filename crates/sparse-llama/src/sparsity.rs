//! Per-layer FFN sparsity over many forwards: L0, density, dead neurons, overflow.

use candle_core::Result;
use serde::Serialize;

use crate::model::Llama;

/// Running totals of one layer.
#[derive(Clone, Debug, Default)]
struct LayerTotals {
    tokens: u64,
    nnz: f64,
    overflow_tiles: u64,
    tiles: u64,
    /// Tokens that fired each neuron; empty when the path could not say (CUDA sparse).
    fired: Vec<u64>,
    fired_known: bool,
}

/// What one layer did over the evaluated text.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSparsity {
    pub layer: usize,
    pub tokens: u64,
    /// Mean nonzeros of `h` per token.
    pub mean_l0: f64,
    /// `mean_l0 / d_ff`.
    pub density: f64,
    /// Neurons that never fired over all evaluated tokens (`None` where unknown).
    pub dead_neurons: Option<usize>,
    pub dead_fraction: Option<f64>,
    /// Overflowing (token, tile) pairs over all (token, tile) pairs (sparse path only).
    pub tile_overflow_rate: Option<f64>,
}

/// Accumulates [`Llama::ffn_stats`] after each forward of a model that records them.
#[derive(Clone, Debug, Default)]
pub struct SparsityTracker {
    layers: Vec<LayerTotals>,
    tile_width: usize,
}

impl SparsityTracker {
    pub fn new(model: &Llama) -> Self {
        Self {
            layers: vec![
                LayerTotals {
                    fired_known: true,
                    ..Default::default()
                };
                model.config().num_hidden_layers
            ],
            tile_width: model.config().twell.tile(),
        }
    }

    /// Adds the statistics of the model's last forward.
    pub fn observe(&mut self, model: &Llama) -> Result<()> {
        for (totals, stats) in self.layers.iter_mut().zip(model.ffn_stats()?) {
            let Some(s) = stats else { continue };
            totals.tokens += s.tokens as u64;
            totals.nnz += s.mean_l0 * s.tokens as f64;
            if s.sparse {
                totals.overflow_tiles += s.overflow_tiles as u64;
                totals.tiles += (s.tokens * s.ffn.div_ceil(self.tile_width)) as u64;
            }
            if s.fired.len() == s.ffn {
                totals.fired.resize(s.ffn, 0);
                for (t, f) in totals.fired.iter_mut().zip(&s.fired) {
                    *t += *f as u64;
                }
            } else {
                totals.fired_known = false;
            }
        }
        Ok(())
    }

    pub fn report(&self, ffn: usize) -> Vec<LayerSparsity> {
        self.layers
            .iter()
            .enumerate()
            .map(|(layer, t)| {
                let mean_l0 = t.nnz / t.tokens.max(1) as f64;
                let dead = (t.fired_known && !t.fired.is_empty())
                    .then(|| t.fired.iter().filter(|&&c| c == 0).count());
                LayerSparsity {
                    layer,
                    tokens: t.tokens,
                    mean_l0,
                    density: mean_l0 / ffn as f64,
                    dead_neurons: dead,
                    dead_fraction: dead.map(|d| d as f64 / ffn as f64),
                    tile_overflow_rate: (t.tiles > 0)
                        .then(|| t.overflow_tiles as f64 / t.tiles as f64),
                }
            })
            .collect()
    }
}
