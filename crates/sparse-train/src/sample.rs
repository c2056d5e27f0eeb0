//! Many continuations at once, for text to train on: a batch of equal-length prompts
//! decoded together through one KV cache, every row drawn from the model's own
//! distribution at a temperature (no top-k or top-p, no repeat penalty: text meant
//! for distillation should follow the teacher's distribution, not a reshaped one).

use candle_core::{DType, Device, IndexOp, Result, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use sparse_llama::model::{Cache, Llama};
use sparse_llama::LlamaError;

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
    if len
        .checked_add(cfg.max_new_tokens)
        .is_none_or(|end| end > max_pos)
    {
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
        let quantiles: Vec<f64> = (0..rows)
            .map(|row| {
                let stream = row_seed(cfg.seed, cfg.first_row + row, step);
                StdRng::seed_from_u64(stream).random::<f64>()
            })
            .collect();
        let next = draw_rows(&logits.reshape((rows, vocab))?, cfg.temperature, &quantiles)?;
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

/// Vocabulary entries whose weights [`draw_rows`] sums on the device, a block at a time.
const DRAW_BLOCK: usize = 256;

/// [`draw`] for every row of `logits` `[rows, vocab]` at its quantile, with the work on
/// the logits' device: the weights are formed and summed there by blocks of
/// `DRAW_BLOCK` (256), and only the block sums and the one block a row falls in come to the
/// host (a batch of 256 rows of a 49,152-token vocabulary was 50 MB of logits a step,
/// and 12.6M exponentials on the host). Weights in f32 instead of [`draw`]'s f64: the
/// same token but where a quantile falls within rounding of a boundary. A row whose
/// largest logit is not finite goes to [`draw`] whole.
pub fn draw_rows(logits: &Tensor, temperature: f64, quantiles: &[f64]) -> Result<Vec<u32>> {
    let (rows, vocab) = logits.dims2()?;
    if quantiles.len() != rows {
        return Err(LlamaError::Invalid(format!(
            "{} quantiles for {rows} rows of logits",
            quantiles.len()
        ))
        .into());
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(LlamaError::Invalid(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        ))
        .into());
    }
    let device = logits.device();
    let logits = logits.to_dtype(DType::F32)?;
    // A NaN logit is never chosen: -inf instead.
    let not_nan = logits.eq(&logits)?;
    // One -inf broadcast over the rows (stride 0), not a [rows, vocab] buffer per step.
    let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?.broadcast_as((rows, vocab))?;
    let clean = not_nan.where_cond(&logits, &neg_inf)?;
    let max = clean.max_keepdim(D::Minus1)?;
    let max_host: Vec<f32> = max.flatten_all()?.to_vec1()?;
    let whole_row = |row: usize| -> Result<u32> {
        let l: Vec<f32> = logits.i(row)?.to_vec1()?;
        Ok(draw(&l, temperature, quantiles[row]))
    };
    if temperature == 0.0 {
        let best: Vec<u32> = clean.argmax(D::Minus1)?.to_vec1()?;
        return (0..rows)
            .map(|row| match max_host[row].is_finite() {
                true => Ok(best[row]),
                false => whole_row(row),
            })
            .collect();
    }
    let weights = (clean.broadcast_sub(&max)? / temperature)?.exp()?;
    let blocks_per_row = vocab.div_ceil(DRAW_BLOCK);
    let pad = blocks_per_row * DRAW_BLOCK - vocab;
    let weights = match pad {
        0 => weights,
        _ => Tensor::cat(
            &[&weights, &Tensor::zeros((rows, pad), DType::F32, device)?],
            1,
        )?,
    };
    let blocks = weights.reshape((rows * blocks_per_row, DRAW_BLOCK))?;
    let sums: Vec<f32> = blocks.sum(1)?.to_vec1()?;
    // Each row's block, and how far into it the quantile falls.
    let mut chosen = vec![0u32; rows];
    let mut into_block = vec![0f64; rows];
    for row in 0..rows {
        if !max_host[row].is_finite() {
            continue;
        }
        let row_sums = &sums[row * blocks_per_row..(row + 1) * blocks_per_row];
        let (block, into) = pick(row_sums, quantiles[row]);
        chosen[row] = (row * blocks_per_row + block) as u32;
        into_block[row] = into;
    }
    let picked: Vec<f32> = blocks
        .index_select(&Tensor::new(chosen.as_slice(), device)?, 0)?
        .flatten_all()?
        .to_vec1()?;
    (0..rows)
        .map(|row| {
            if !max_host[row].is_finite() {
                return whole_row(row);
            }
            let block = chosen[row] as usize - row * blocks_per_row;
            let w = &picked[row * DRAW_BLOCK..(row + 1) * DRAW_BLOCK];
            let (at, _) = passing(w.iter().map(|&w| f64::from(w)), into_block[row]);
            Ok((block * DRAW_BLOCK + at) as u32)
        })
        .collect()
}

/// The block of `sums` that quantile `u` falls in (never one of weight 0) and how far
/// into that block's weight it falls.
fn pick(sums: &[f32], u: f64) -> (usize, f64) {
    let total: f64 = sums.iter().map(|&w| f64::from(w)).sum();
    let target = u * total;
    let (block, before) = passing(sums.iter().map(|&w| f64::from(w)), target);
    (block, target - before)
}

/// The index where the running sum of `weights` first passes `target` (never one of
/// weight 0; the last possible one when rounding leaves the sum short of it), and the
/// sum of the weights before that index. The one walk of [`draw`], [`pick`] and
/// [`draw_rows`]' last step, so the device draws land where the host's do.
fn passing(weights: impl IntoIterator<Item = f64>, target: f64) -> (usize, f64) {
    let mut before = 0.0;
    let mut last_possible = (0, 0.0);
    for (k, w) in weights.into_iter().enumerate() {
        if w > 0.0 {
            last_possible = (k, before);
            if before + w > target {
                return last_possible;
            }
        }
        before += w;
    }
    last_possible
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
    passing(logits.iter().map(|&l| weight(l)), u * total).0 as u32
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

    /// Logits of `rows` rows over `vocab` entries, spread like a language model's.
    fn random_logits(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..rows * vocab)
            .map(|_| 6.0 * rng.random::<f32>() - 3.0 + 8.0 * rng.random::<f32>().powi(40))
            .collect()
    }

    #[test]
    fn device_draws_match_host_draws() {
        // A vocabulary that is not a multiple of the block, rows of ordinary logits, and
        // rows with NaN, infinite and all-impossible entries.
        let (rows, vocab) = (40, 1000);
        let mut logits = random_logits(rows, vocab, 3);
        logits[vocab + 7] = f32::NAN;
        logits[2 * vocab + 999] = f32::INFINITY;
        logits[2 * vocab + 5] = f32::INFINITY;
        for l in &mut logits[3 * vocab..4 * vocab] {
            *l = f32::NEG_INFINITY;
        }
        logits[3 * vocab + 600] = 0.5;
        for l in &mut logits[4 * vocab..5 * vocab] {
            *l = f32::NEG_INFINITY;
        }
        let tensor = Tensor::from_vec(logits.clone(), (rows, vocab), &Device::Cpu).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        for temperature in [0.0, 0.8, 1.0, 3.0] {
            let us: Vec<f64> = (0..rows).map(|_| rng.random::<f64>()).collect();
            let device = draw_rows(&tensor, temperature, &us).unwrap();
            for row in 0..rows {
                let l = &logits[row * vocab..(row + 1) * vocab];
                assert_eq!(
                    device[row],
                    draw(l, temperature, us[row]),
                    "row {row} at temperature {temperature}, quantile {}",
                    us[row]
                );
            }
        }
        // The row with one possible entry always draws it; the NaN is never drawn.
        let us = vec![0.999_999; rows];
        let device = draw_rows(&tensor, 1.0, &us).unwrap();
        assert_eq!(device[3], 600);
        assert_ne!(device[1], 7);
    }

    #[test]
    fn device_draws_follow_the_distribution() {
        // Two blocks and a bit: weights 1 : 2 : 4 placed in different blocks.
        let vocab = 2 * DRAW_BLOCK + 3;
        let mut logits = vec![f32::NEG_INFINITY; vocab];
        logits[10] = 0.0;
        logits[DRAW_BLOCK + 1] = 2f32.ln();
        logits[2 * DRAW_BLOCK + 2] = 4f32.ln();
        let n = 7_000;
        let tensor = Tensor::from_vec(logits.repeat(n), (n, vocab), &Device::Cpu).unwrap();
        let us: Vec<f64> = (0..n).map(|k| (k as f64 + 0.5) / n as f64).collect();
        let drawn = draw_rows(&tensor, 1.0, &us).unwrap();
        let count = |t: usize| drawn.iter().filter(|&&d| d as usize == t).count();
        assert_eq!(count(10), 1_000);
        assert_eq!(count(DRAW_BLOCK + 1), 2_000);
        assert_eq!(count(2 * DRAW_BLOCK + 2), 4_000);
    }

    #[test]
    fn device_draws_reject_bad_arguments() {
        let tensor = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(draw_rows(&tensor, 1.0, &[0.5]).is_err());
        assert!(draw_rows(&tensor, -1.0, &[0.5, 0.5]).is_err());
        assert!(draw_rows(&tensor, f64::NAN, &[0.5, 0.5]).is_err());
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
