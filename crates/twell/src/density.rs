//! Synthetic MLP weights and inputs with a chosen activation density.
//!
//! A trained sparse model is not needed to measure kernels: give `x` a constant
//! feature (`x[:, 0] = 1`) and set that column of `Wg` to a negative bias `b`. With
//! the other inputs and weights Gaussian, each gate pre-activation is
//! `N(b, σ_w² (d − 1))`, so `b = −Φ⁻¹(1 − p) · σ_w · √(d − 1)` makes every neuron fire
//! with probability `p`, independently: a uniform density `p`.

use candle_core::{DType, Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{err, TwellError};

/// Dense MLP weights in HF layout: `gate [f, d]`, `up [f, d]`, `down [d, f]`.
#[derive(Clone, Debug)]
pub struct MlpWeights {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

impl MlpWeights {
    /// A ReLU [`crate::SparseMlp`] in `mode` on copies of these weights: how benches and
    /// checks build the MLP they time or compare.
    pub fn relu_mlp(&self, mode: crate::FfnMode) -> Result<crate::SparseMlp> {
        crate::SparseMlp::new(
            self.gate.clone(),
            self.up.clone(),
            self.down.clone(),
            crate::Activation::Relu,
            mode,
        )
    }
}

/// Standard deviation of the synthetic weights (the scale of a typical init).
pub const WEIGHT_STD: f64 = 0.02;

/// Weights whose gate fires with probability `density` on [`synthetic_input`]s.
pub fn synthetic_mlp(
    hidden: usize,
    ffn: usize,
    density: f64,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<MlpWeights> {
    if !(density > 0.0 && density < 1.0) {
        return err(TwellError::Invalid(format!(
            "density must be in (0, 1), got {density}"
        )));
    }
    if hidden < 2 || ffn == 0 {
        return err(TwellError::Invalid(format!(
            "need hidden >= 2 and ffn >= 1, got {hidden} and {ffn}"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let bias = -inverse_normal_cdf(1.0 - density) * WEIGHT_STD * ((hidden - 1) as f64).sqrt();
    let mut gate = gaussian(&mut rng, ffn * hidden, WEIGHT_STD);
    for j in 0..ffn {
        gate[j * hidden] = bias as f32;
    }
    let up = gaussian(&mut rng, ffn * hidden, WEIGHT_STD);
    let down = gaussian(&mut rng, hidden * ffn, WEIGHT_STD);
    let make = |v: Vec<f32>, shape: (usize, usize)| -> Result<Tensor> {
        Tensor::from_vec(v, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    };
    Ok(MlpWeights {
        gate: make(gate, (ffn, hidden))?,
        up: make(up, (ffn, hidden))?,
        down: make(down, (hidden, ffn))?,
    })
}

/// Inputs `[rows, hidden]`: column 0 is the constant feature 1, the rest `N(0, 1)`.
pub fn synthetic_input(
    rows: usize,
    hidden: usize,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x = gaussian(&mut rng, rows * hidden, 1.0);
    for r in 0..rows {
        x[r * hidden] = 1.0;
    }
    Tensor::from_vec(x, (rows, hidden), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// `n` samples of `N(0, std²)` (Box–Muller), reproducible from the rng's seed. Chunks
/// get their own seeds, drawn in order, and fill in parallel: a 2B-shape model needs
/// 1.5 billion samples, a minute on one core.
pub fn gaussian(rng: &mut StdRng, n: usize, std: f64) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let seeds: Vec<u64> = (0..n.div_ceil(CHUNK)).map(|_| rng.random()).collect();
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK)
        .zip(seeds)
        .for_each(|(chunk, seed)| {
            let mut rng = StdRng::seed_from_u64(seed);
            for pair in chunk.chunks_mut(2) {
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let t = std::f64::consts::TAU * u2;
                pair[0] = (r * t.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (r * t.sin()) as f32;
                }
            }
        });
    out
}

/// Φ⁻¹(p), the standard normal quantile (Acklam's rational approximation, relative
/// error below 1.2e-9 over (0, 1)).
pub fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383_577_518_672_69e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    const P_LOW: f64 = 0.02425;
    if p <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if p >= 1.0 {
        return f64::INFINITY;
    }
    if p < P_LOW {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - P_LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -inverse_normal_cdf(1.0 - p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_match_known_values() {
        assert!((inverse_normal_cdf(0.5)).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.975) - 1.959963984540054).abs() < 1e-8);
        assert!((inverse_normal_cdf(0.01) + 2.326347874040841).abs() < 1e-8);
        assert!((inverse_normal_cdf(0.995) - 2.575829303548901).abs() < 1e-8);
    }

    /// Chunked in parallel, the samples must still be reproducible, of the asked length
    /// (odd, past one chunk) and distributed as N(0, std²).
    #[test]
    fn gaussian_samples_are_reproducible_and_normal() {
        let n = 3 * (1 << 16) + 7;
        let a = gaussian(&mut StdRng::seed_from_u64(5), n, 2.0);
        let b = gaussian(&mut StdRng::seed_from_u64(5), n, 2.0);
        let c = gaussian(&mut StdRng::seed_from_u64(6), n, 2.0);
        assert_eq!(a.len(), n);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let var = a.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.02, "std {}", var.sqrt());
        let beyond_two_std = a.iter().filter(|&&v| v.abs() > 4.0).count() as f64 / n as f64;
        assert!(
            (beyond_two_std - 0.0455).abs() < 0.003,
            "tail {beyond_two_std}"
        );
    }
}
