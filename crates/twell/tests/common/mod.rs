//! Shared helpers: a dense candle reference of the ReGLU MLP and an error metric.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;
use twell::density::gaussian;

pub use fused_ops::compare::rel_l2;

/// Gaussian tensor with a fixed seed.
pub fn randn(shape: (usize, usize), std: f64, seed: u64, dtype: DType) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    Tensor::from_vec(
        gaussian(&mut rng, shape.0 * shape.1, std),
        shape,
        &Device::Cpu,
    )?
    .to_dtype(dtype)
}

/// Deterministic values spread evenly over `[-half_width, half_width)` (an LCG, so the
/// tests need no RNG state), as an f32 tensor on the CPU.
pub fn uniform(shape: &[usize], seed: u64, half_width: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|i| {
            let x = (i as u64 + 1)
                .wrapping_mul(6364136223846793005)
                .wrapping_add(seed);
            ((x >> 33) as f32 / (1u64 << 31) as f32 * 2.0 - 1.0) * half_width
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).expect("a shape that holds the values")
}

/// [`uniform`] with the seed spread over all bits: nearby seeds there give nearly the
/// same values, here unrelated ones.
pub fn uniform_unrelated(shape: &[usize], seed: u64, half_width: f32) -> Tensor {
    uniform(shape, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), half_width)
}

/// Dense ReGLU MLP through plain candle ops: `(out [M, d], l1 [M])`.
pub fn dense_reglu(x: &Tensor, wg: &Tensor, wu: &Tensor, wd: &Tensor) -> Result<(Tensor, Tensor)> {
    let g = x.matmul(&wg.t()?)?.relu()?;
    let h = (g * x.matmul(&wu.t()?)?)?;
    let out = h.matmul(&wd.t()?)?;
    let l1 = h.abs()?.sum(1)?;
    Ok((out, l1))
}

/// A scalar loss that weights every output and L1 term differently, so each
/// gradient is exercised: `Σ out ⊙ R + Σ l1 ⊙ r`.
pub fn probe_loss(out: &Tensor, l1: &Tensor, seed: u64) -> Result<Tensor> {
    let (m, d) = out.dims2()?;
    let r_out = randn((m, d), 1.0, seed, DType::F32)?.to_dtype(out.dtype())?;
    let r_l1 = randn((m, 1), 1.0, seed + 1, DType::F32)?
        .to_dtype(l1.dtype())?
        .squeeze(1)?;
    (out * r_out)?.sum_all()? + (l1 * r_l1)?.sum_all()?
}

/// Trainable copies of the inputs.
pub struct Vars {
    pub x: Var,
    pub wg: Var,
    pub wu: Var,
    pub wd: Var,
}

impl Vars {
    pub fn new(x: &Tensor, wg: &Tensor, wu: &Tensor, wd: &Tensor) -> Result<Self> {
        Ok(Self {
            x: Var::from_tensor(x)?,
            wg: Var::from_tensor(wg)?,
            wu: Var::from_tensor(wu)?,
            wd: Var::from_tensor(wd)?,
        })
    }

    /// Gradients of `loss` for x, wg, wu, wd (zeros where none flowed).
    pub fn grads(&self, loss: &Tensor) -> Result<Vec<Tensor>> {
        let g = loss.backward()?;
        [&self.x, &self.wg, &self.wu, &self.wd]
            .iter()
            .map(|v| match g.get(v.as_tensor()) {
                Some(t) => Ok(t.clone()),
                None => v.as_tensor().zeros_like(),
            })
            .collect()
    }
}

/// A ReLU `SparseMlp` in `mode` on copies of `w`'s weights.
pub fn relu_mlp(w: &twell::density::MlpWeights, mode: twell::FfnMode) -> twell::SparseMlp {
    w.relu_mlp(mode).unwrap()
}
