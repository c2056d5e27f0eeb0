//! Shared helpers: deterministic inputs and the error metric.
#![allow(dead_code)]

use candle_core::{Device, Tensor};

pub use fused_ops::compare::rel_l2;

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
