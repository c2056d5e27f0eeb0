//! `twell bench`: dense against sparse, side by side, in one run.

pub mod energy;
pub mod layers;
pub mod linear;
pub mod loss;
pub mod memory;
pub mod mlp;
pub mod mlp_train;
pub mod model;
pub mod serve;
pub mod shards;
pub mod sweep;
pub mod tensor_parallel;
pub mod timing;

use anyhow::Result;
use candle_core::{Device, Tensor};

/// `[b, t]` token ids spread over `0..vocab` by a multiplicative hash: the benchmarks'
/// timings do not depend on the ids, and the same call gives the same ids on every
/// device (the CPU's rng takes no seed).
pub fn random_tokens(b: usize, t: usize, vocab: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i as u64 * 2654435761) % vocab as u64) as u32)
        .collect();
    Ok(Tensor::from_vec(ids, (b, t), device)?)
}
