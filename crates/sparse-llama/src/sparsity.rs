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

/// An order of a layer's `load.len()` neurons for a tensor-parallel split into `shards`
/// equal, contiguous parts, with the parts' summed loads (say, how often each neuron fired
/// on calibration text) as even as a greedy pass makes them: the heaviest neuron first,
/// each to the part with the least load that still has room. A sparse FFN's GPUs wait for
/// the one with the most active neurons, and the active neurons of a fine-tuned model
/// cluster in index ranges, so contiguous parts of the original order fall out of balance.
/// Part `s` is `order[s * n / shards .. (s + 1) * n / shards]`, each part in index order.
pub fn balanced_neuron_order(load: &[u64], shards: usize) -> Result<Vec<usize>> {
    let n = load.len();
    if shards == 0 || !n.is_multiple_of(shards) {
        candle_core::bail!("{n} neurons do not split into {shards} equal parts");
    }
    let size = n / shards;
    let mut by_load: Vec<usize> = (0..n).collect();
    by_load.sort_by_key(|&j| (std::cmp::Reverse(load[j]), j));
    let mut parts: Vec<Vec<usize>> = vec![Vec::with_capacity(size); shards];
    let mut sums = vec![0u64; shards];
    for j in by_load {
        let s = (0..shards)
            .filter(|&s| parts[s].len() < size)
            .min_by_key(|&s| (sums[s], s))
            .expect("a part with room remains while neurons do");
        parts[s].push(j);
        sums[s] += load[j];
    }
    Ok(parts
        .into_iter()
        .flat_map(|mut p| {
            p.sort_unstable();
            p
        })
        .collect())
}

/// For one token row's active neurons (`active[j]`), the most active neurons any of the
/// `shards` contiguous parts of `order` holds over their mean: 1.0 is even, `shards` is
/// all in one part. A row with no active neuron counts as even.
pub fn row_imbalance(active: &[bool], order: &[usize], shards: usize) -> f64 {
    let size = order.len() / shards.max(1);
    let counts: Vec<usize> = order
        .chunks(size.max(1))
        .map(|part| part.iter().filter(|&&j| active[j]).count())
        .collect();
    let total: usize = counts.iter().sum();
    if total == 0 {
        return 1.0;
    }
    let max = *counts.iter().max().expect("at least one part") as f64;
    max * shards as f64 / total as f64
}

#[cfg(test)]
mod shard_tests {
    use super::*;

    #[test]
    fn balanced_order_is_a_permutation_with_even_parts() -> Result<()> {
        // The first quarter of the neurons carries all the load, as clustered neurons do.
        let load: Vec<u64> = (0..64)
            .map(|j| if j < 16 { 10 + j as u64 } else { 0 })
            .collect();
        let order = balanced_neuron_order(&load, 4)?;
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..64).collect::<Vec<_>>());
        let sums: Vec<u64> = order
            .chunks(16)
            .map(|p| p.iter().map(|&j| load[j]).sum())
            .collect();
        let (min, max) = (*sums.iter().min().unwrap(), *sums.iter().max().unwrap());
        assert!(max - min <= 25, "{sums:?}");
        // Contiguous parts of the original order put it all in the first.
        let identity: Vec<usize> = (0..64).collect();
        let active: Vec<bool> = load.iter().map(|&l| l > 0).collect();
        assert_eq!(row_imbalance(&active, &identity, 4), 4.0);
        assert_eq!(row_imbalance(&active, &order, 4), 1.0);
        Ok(())
    }

    #[test]
    fn uneven_splits_are_refused_and_empty_rows_are_even() {
        assert!(balanced_neuron_order(&[1, 2, 3], 2).is_err());
        assert!(balanced_neuron_order(&[1, 2], 0).is_err());
        assert_eq!(
            row_imbalance(&[false; 8], &(0..8).collect::<Vec<_>>(), 2),
            1.0
        );
    }
}
