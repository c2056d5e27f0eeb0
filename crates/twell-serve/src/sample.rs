//! Sampling on the host. A decode step's logits come back in one transfer for every row,
//! and each sequence samples from its own row with its own seeded generator (sampling
//! each row through device ops was a synchronisation and four launches a sequence).

use candle_core::{DType, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Candidates first taken for nucleus (top-p) sampling; eight times more while their
/// probabilities sum to less than `p`. A sorted prefix of the most likely tokens is all
/// the nucleus needs, so a full sort of the vocabulary is rarely paid.
const NUCLEUS_FIRST_CANDIDATES: usize = 64;

/// A step's logits `[rows, vocabulary]` on the host, in one transfer for every row (the
/// model's logits are f32).
pub fn read_logits(logits: &Tensor) -> candle_core::Result<Vec<Vec<f32>>> {
    logits.to_dtype(DType::F32)?.to_vec2()
}

/// One sequence's sampler: temperature, nucleus and repeat penalty, as a request asks.
pub struct Sampler {
    rng: StdRng,
    /// 0 or below is greedy.
    temperature: f64,
    /// Kept only where it cuts: in (0, 1).
    top_p: Option<f64>,
    repeat_penalty: f32,
    /// Reused between tokens: the weights of a row.
    weights: Vec<f32>,
    candidates: Vec<u32>,
}

impl Sampler {
    pub fn new(seed: u64, temperature: f64, top_p: Option<f64>, repeat_penalty: f32) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            temperature,
            top_p: top_p.filter(|p| *p > 0.0 && *p < 1.0),
            repeat_penalty,
            weights: Vec::new(),
            candidates: Vec::new(),
        }
    }

    /// True where the step's own argmax is this sampler's answer.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.repeat_penalty == 1.0
    }

    /// The next token from one row of logits. `context` is the text so far, whose last
    /// 64 tokens the repeat penalty reads (as llama.cpp's default window).
    pub fn sample(&mut self, logits: &[f32], context: &[u32]) -> u32 {
        self.weights.clear();
        self.weights.extend_from_slice(logits);
        if self.repeat_penalty != 1.0 {
            let start = context.len().saturating_sub(64);
            penalize_repeats(&mut self.weights, &context[start..], self.repeat_penalty);
        }
        if self.temperature <= 0.0 {
            return argmax(&self.weights);
        }
        softmax_weights(&mut self.weights, self.temperature);
        match self.top_p {
            Some(p) => self.sample_nucleus(p),
            None => {
                let total: f64 = self.weights.iter().map(|&w| w as f64).sum();
                let r = self.rng.random::<f64>() * total;
                pick(self.weights.iter().copied().enumerate(), r)
            }
        }
    }

    /// Samples among the most likely tokens whose probabilities first reach `p` (the
    /// token that crosses `p` included), as candle's and vLLM's top-p do.
    fn sample_nucleus(&mut self, p: f64) -> u32 {
        let w = &self.weights;
        let total: f64 = w.iter().map(|&x| x as f64).sum();
        let target = p * total;
        let by_weight = |a: &u32, b: &u32| w[*b as usize].total_cmp(&w[*a as usize]);
        let mut k = NUCLEUS_FIRST_CANDIDATES.min(w.len());
        loop {
            self.candidates.clear();
            self.candidates.extend(0..w.len() as u32);
            if k < w.len() {
                self.candidates.select_nth_unstable_by(k - 1, by_weight);
                self.candidates.truncate(k);
            }
            self.candidates.sort_unstable_by(by_weight);
            let mut sum = 0.0;
            let mut kept = None;
            for (i, &c) in self.candidates.iter().enumerate() {
                sum += w[c as usize] as f64;
                if sum >= target {
                    kept = Some((i + 1, sum));
                    break;
                }
            }
            // The whole vocabulary always reaches p (rounding aside): keep it all.
            let (n, mass) = match kept {
                Some(found) => found,
                None if k == w.len() => (k, sum),
                None => {
                    k = (k * 8).min(w.len());
                    continue;
                }
            };
            let r = self.rng.random::<f64>() * mass;
            let nucleus = self.candidates[..n]
                .iter()
                .map(|&c| (c as usize, w[c as usize]));
            return pick(nucleus, r);
        }
    }
}

/// The index of the largest logit (the first, on ties).
fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// Divides positive logits of tokens in `context` by `penalty` and multiplies negative
/// ones (each token once, however often it appears), as candle's `apply_repeat_penalty`.
fn penalize_repeats(logits: &mut [f32], context: &[u32], penalty: f32) {
    let mut seen: Vec<u32> = context.to_vec();
    seen.sort_unstable();
    seen.dedup();
    for t in seen {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l >= 0.0 {
                *l / penalty
            } else {
                *l * penalty
            };
        }
    }
}

/// Logits to unnormalised probabilities `e^((l - max) / temperature)`.
fn softmax_weights(xs: &mut [f32], temperature: f64) {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = (1.0 / temperature) as f32;
    xs.iter_mut().for_each(|x| *x = (*x - max) * scale);
    fused_ops::simd::exp_in_place(xs);
}

/// The first token whose running weight passes `r`; the last one if rounding leaves `r`
/// past them all.
fn pick(weights: impl Iterator<Item = (usize, f32)>, r: f64) -> u32 {
    let mut sum = 0.0;
    let mut last = 0;
    for (i, w) in weights {
        sum += w as f64;
        last = i;
        if r < sum {
            return i as u32;
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-8.0f32..8.0)).collect()
    }

    /// The nucleus by a full sort, as the definition reads.
    fn nucleus_by_sort(logits: &[f32], temperature: f64, p: f64) -> Vec<u32> {
        let mut w = logits.to_vec();
        softmax_weights(&mut w, temperature);
        let total: f64 = w.iter().map(|&x| x as f64).sum();
        let mut order: Vec<u32> = (0..w.len() as u32).collect();
        order.sort_by(|a, b| w[*b as usize].total_cmp(&w[*a as usize]));
        let mut sum = 0.0;
        let mut kept = Vec::new();
        for t in order {
            kept.push(t);
            sum += w[t as usize] as f64;
            if sum >= p * total {
                break;
            }
        }
        kept
    }

    #[test]
    fn greedy_takes_the_largest_logit_after_the_penalty() {
        let l = vec![1.0, 5.0, 4.0, -2.0];
        assert_eq!(Sampler::new(0, 0.0, None, 1.0).sample(&l, &[]), 1);
        // 5 / 2 = 2.5 falls under 4.
        assert_eq!(Sampler::new(0, 0.0, None, 2.0).sample(&l, &[1, 1]), 2);
        // Negative logits are multiplied: -2 * 2 stays last.
        let mut w = l.clone();
        penalize_repeats(&mut w, &[3, 1, 3], 2.0);
        assert_eq!(w, vec![1.0, 2.5, 4.0, -4.0]);
    }

    #[test]
    fn the_same_seed_samples_the_same_tokens() {
        let l = logits(49_152, 1);
        let run = |seed| {
            let mut s = Sampler::new(seed, 0.8, Some(0.9), 1.1);
            (0..32).map(|_| s.sample(&l, &[3, 4])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn nucleus_samples_only_inside_the_nucleus_of_a_full_sort() {
        for (n, temperature, p, seed) in [
            (49_152, 0.7, 0.9, 1),
            (49_152, 1.5, 0.99, 2),
            (1_000, 1.0, 0.5, 3),
            (100, 10.0, 0.95, 4),
            (7, 1.0, 0.3, 5),
        ] {
            let l = logits(n, seed);
            let nucleus = nucleus_by_sort(&l, temperature, p);
            let mut s = Sampler::new(seed, temperature, Some(p), 1.0);
            let mut seen = std::collections::HashSet::new();
            for _ in 0..2_000 {
                let t = s.sample(&l, &[]);
                assert!(nucleus.contains(&t), "n {n}: token {t} outside the nucleus");
                seen.insert(t);
            }
            // A wide nucleus gets more than its first few tokens sampled.
            if nucleus.len() >= 8 {
                assert!(seen.len() >= 4, "n {n}: only {} tokens seen", seen.len());
            }
        }
    }

    #[test]
    fn sampling_follows_the_softmax() {
        // Two tokens at e^1 : e^0 under temperature 1: about 73% : 27%.
        let l = vec![1.0, 0.0, -100.0];
        let mut s = Sampler::new(3, 1.0, None, 1.0);
        let draws = 20_000;
        let first = (0..draws).filter(|_| s.sample(&l, &[]) == 0).count();
        let share = first as f64 / draws as f64;
        let expected = 1.0f64.exp() / (1.0f64.exp() + 1.0);
        assert!(
            (share - expected).abs() < 0.015,
            "share {share}, expected {expected}"
        );
        // The same through the nucleus with p = 1 - tiny: both tokens, same shares.
        let mut s = Sampler::new(3, 1.0, Some(0.999_999), 1.0);
        let first = (0..draws).filter(|_| s.sample(&l, &[]) == 0).count();
        assert!((first as f64 / draws as f64 - expected).abs() < 0.015);
    }

    #[test]
    fn a_narrow_nucleus_is_the_top_token() {
        let l = vec![0.0, 9.0, 1.0, 2.0];
        let mut s = Sampler::new(0, 1.0, Some(0.5), 1.0);
        assert!((0..100).all(|_| s.sample(&l, &[]) == 1));
    }
}
