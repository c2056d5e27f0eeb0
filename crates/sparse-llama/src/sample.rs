//! Many continuations at once, for text to train on: a batch of equal-length prompts
//! decoded together through one KV cache, every row drawn from the model's own
//! distribution at a temperature (no top-k or top-p, no repeat penalty: text meant
//! for distillation should follow the teacher's distribution, not a reshaped one).

use candle_core::{Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::error::LlamaError;
use crate::model::{Cache, Llama};

/// How a batch is sampled.
#[derive(Clone, Debug)]
pub struct BatchSampling {
    pub max_new_tokens: usize,
    /// 0 is greedy; 1 samples the model's distribution as it is.
    pub temperature: f64,
    /// Each (row, step) draws from its own generator seeded from this, so a row's
    /// text does not depend on the batch size or on the other rows.
    pub seed: u64,
    /// The index of the batch's first row among all rows drawn with this seed: rows
    /// of later batches get streams of their own.
    pub first_row: usize,
}

/// Continues every prompt (all the same length) by `cfg.max_new_tokens` tokens;
/// returns each row's new tokens, cut before the first of `eos_ids`.
pub fn sample_batch(
    model: &Llama,
    prompts: &[Vec<u32>],
    eos_ids: &[u32],
    cfg: &BatchSampling,
    device: &Device,
) -> Result<Vec<Vec<u32>>> {
    let invalid = |msg: String| -> Result<Vec<Vec<u32>>> { Err(LlamaError::Invalid(msg).into()) };
    let Some(first) = prompts.first() else {
        return invalid("no prompts to sample from".into());
    };
    let len = first.len();
    if len == 0 || prompts.iter().any(|p| p.len() != len) {
        return invalid(format!(
            "the prompts of a batch must be non-empty and of one length (the first has {len})"
        ));
    }
    if !(cfg.temperature.is_finite() && cfg.temperature >= 0.0) {
        return invalid(format!(
            "temperature must be a finite number >= 0, got {}",
            cfg.temperature
        ));
    }
    let max_pos = model.config().max_position_embeddings;
    if len + cfg.max_new_tokens > max_pos {
        return invalid(format!(
            "prompt ({len}) + new tokens ({}) exceeds the model's {max_pos} positions",
            cfg.max_new_tokens
        ));
    }
    let vocab = model.config().vocab_size;
    let dtype = model.dtype();
    let mut cache = Cache::new(true, dtype, model.config(), device)?;
    let rows = prompts.len();
    let mut out: Vec<Vec<u32>> = vec![Vec::with_capacity(cfg.max_new_tokens); rows];
    let mut input = Tensor::new(prompts.concat(), device)?.reshape((rows, len))?;
    let mut position = 0;
    for step in 0..cfg.max_new_tokens {
        let logits = model.forward(&input, position, &mut cache)?;
        position += input.dim(1)?;
        // `forward` gives f32 logits.
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let next: Vec<u32> = logits
            .par_chunks(vocab)
            .enumerate()
            .map(|(row, l)| {
                let stream = row_seed(cfg.seed, cfg.first_row + row, step);
                let u = StdRng::seed_from_u64(stream).random::<f64>();
                draw(l, cfg.temperature, u)
            })
            .collect();
        for (row, &token) in next.iter().enumerate() {
            out[row].push(token);
        }
        input = Tensor::new(next, device)?.reshape((rows, 1))?;
    }
    for row in &mut out {
        if let Some(end) = row.iter().position(|t| eos_ids.contains(t)) {
            row.truncate(end);
        }
    }
    Ok(out)
}

/// A seed per (row, step), mixed so that nearby rows and steps get unrelated streams.
fn row_seed(seed: u64, row: usize, step: usize) -> u64 {
    let mut z = seed ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((step as u64) << 32);
    // splitmix64's finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The token at quantile `u` in `[0, 1)` of `softmax(logits / temperature)` (the
/// arg-max when the temperature is 0). A NaN logit is never chosen.
pub fn draw(logits: &[f32], temperature: f64, u: f64) -> u32 {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if temperature == 0.0 || max == f32::INFINITY {
        let best = logits.iter().position(|&l| l == max).unwrap_or(0);
        return best as u32;
    }
    let weight = |l: f32| -> f64 {
        if l.is_nan() {
            0.0
        } else {
            ((f64::from(l) - f64::from(max)) / temperature).exp()
        }
    };
    let total: f64 = logits.iter().map(|&l| weight(l)).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last_possible = 0;
    for (token, &l) in logits.iter().enumerate() {
        let w = weight(l);
        if w > 0.0 {
            last_possible = token;
        }
        cumulative += w;
        if cumulative > target && w > 0.0 {
            return token as u32;
        }
    }
    // `u` at the very top, past the summed weights by rounding.
    last_possible as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draw_follows_the_quantiles() {
        // Weights 1 : 2 : 1 at temperature 1 (logits 0, ln 2, 0).
        let logits = [0.0, 2f32.ln(), 0.0];
        assert_eq!(draw(&logits, 1.0, 0.0), 0);
        assert_eq!(draw(&logits, 1.0, 0.24), 0);
        assert_eq!(draw(&logits, 1.0, 0.26), 1);
        assert_eq!(draw(&logits, 1.0, 0.74), 1);
        assert_eq!(draw(&logits, 1.0, 0.76), 2);
        assert_eq!(draw(&logits, 1.0, 0.999_999), 2);
        // Greedy, and a low temperature that is all but greedy.
        assert_eq!(draw(&logits, 0.0, 0.9), 1);
        assert_eq!(draw(&logits, 0.01, 0.9), 1);
    }

    #[test]
    fn draw_never_picks_an_impossible_token() {
        let logits = [f32::NEG_INFINITY, 1.0, f32::NAN, f32::NEG_INFINITY];
        for u in [0.0, 0.5, 0.999_999_999] {
            assert_eq!(draw(&logits, 1.0, u), 1);
        }
        assert_eq!(draw(&logits, 0.0, 0.5), 1);
    }

    #[test]
    fn draw_matches_the_distribution_over_many_quantiles() {
        let logits = [0.5f32, -1.0, 2.0, 0.0];
        let weights: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let total: f64 = weights.iter().sum();
        let n = 100_000;
        let mut counts = [0usize; 4];
        for k in 0..n {
            counts[draw(&logits, 1.0, (k as f64 + 0.5) / n as f64) as usize] += 1;
        }
        for (c, w) in counts.iter().zip(&weights) {
            let expected = w / total;
            assert!((*c as f64 / n as f64 - expected).abs() < 1e-4, "{counts:?}");
        }
    }

    #[test]
    fn row_seeds_differ_across_rows_and_steps() {
        let mut seen = std::collections::HashSet::new();
        for row in 0..64 {
            for step in 0..64 {
                assert!(seen.insert(row_seed(7, row, step)));
            }
        }
    }
}
