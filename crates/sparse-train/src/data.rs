//! Training text as fixed-length sequences: a token stream cut into `seq_len + 1`-token
//! windows (inputs and shifted targets), visited in a seeded random order per epoch.

use candle_core::{Device, Result, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Token stream cut into training sequences of `seq_len + 1` tokens (inputs and
/// shifted targets), visited in a seeded random order per epoch.
#[derive(Clone, Debug)]
pub struct PackedData {
    sequences: Vec<Vec<u32>>,
}

impl PackedData {
    pub fn new(tokens: &[u32], seq_len: usize) -> Result<Self> {
        let sequences: Vec<Vec<u32>> = tokens
            .windows(seq_len + 1)
            .step_by(seq_len)
            .map(|w| w.to_vec())
            .collect();
        if sequences.is_empty() {
            candle_core::bail!(
                "{} tokens do not fill one sequence of {} + 1",
                tokens.len(),
                seq_len
            );
        }
        Ok(Self { sequences })
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The `index`-th batch of the whole run (across epochs), `[batch, seq_len + 1]`.
    pub fn batch(&self, index: usize, batch: usize, seed: u64, device: &Device) -> Result<Tensor> {
        let per_epoch = (self.len() / batch).max(1);
        let (epoch, k) = (index / per_epoch, index % per_epoch);
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
            seed.wrapping_add(epoch as u64),
        ));
        let rows: Vec<u32> = (0..batch)
            .flat_map(|r| {
                self.sequences[order[(k * batch + r) % self.len()]]
                    .iter()
                    .copied()
            })
            .collect();
        Tensor::from_vec(rows, (batch, self.sequences[0].len()), device)
    }

    /// Batches in order, for validation.
    pub fn ordered_batch(
        &self,
        index: usize,
        batch: usize,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let start = index * batch;
        if start >= self.len() {
            return Ok(None);
        }
        let end = (start + batch).min(self.len());
        let rows: Vec<u32> = self.sequences[start..end]
            .iter()
            .flatten()
            .copied()
            .collect();
        Ok(Some(Tensor::from_vec(
            rows,
            (end - start, self.sequences[0].len()),
            device,
        )?))
    }
}
