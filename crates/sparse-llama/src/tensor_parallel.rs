//! A tensor-parallel sparse FFN: the MLP's neurons split across ranks (one a GPU), each
//! rank running the sparse MLP over its share and the ranks summing their outputs.
//!
//! A ReLU MLP is a sum over its neurons, `down · relu(gate x) ⊙ (up x) = Σ_j h_j · Wd_j`,
//! so a rank holding neurons `J` (their gate and up rows, their down columns) computes
//! the part of that sum over `J`, and an all-reduce adds the parts. Each rank packs and
//! walks only its own active neurons. A token's MLP waits for the rank with the most
//! active neurons; an order from calibration text ([`crate::sparsity::balanced_neuron_order`])
//! evens the ranks' loads over many tokens (docs/benchmarks.md, "Tensor-parallel parts
//! of the sparse default's FFN").

use std::sync::{Arc, Mutex};

use candle_core::{Module, Result, Tensor};
use twell::SparseMlp;
use twell_dist::Communicator;

use crate::error::LlamaError;

fn invalid(detail: String) -> candle_core::Error {
    LlamaError::Invalid(format!("tensor-parallel MLP: {detail}")).into()
}

/// The neurons rank `rank` of `world` holds: the `rank`-th of `world` equal contiguous
/// parts of `order` (a permutation of `0..order.len()`), sorted so the rank reads its
/// rows in memory order.
pub fn shard_neurons(order: &[usize], rank: usize, world: usize) -> Result<Vec<usize>> {
    let f = order.len();
    if world == 0 || rank >= world {
        return Err(invalid(format!("rank {rank} of a world of {world}")));
    }
    if !f.is_multiple_of(world) {
        return Err(invalid(format!(
            "{f} neurons do not split into {world} equal parts"
        )));
    }
    let mut seen = vec![false; f];
    for &j in order {
        if j >= f || std::mem::replace(&mut seen[j], true) {
            return Err(invalid(format!(
                "the neuron order is not a permutation of 0..{f} (neuron {j})"
            )));
        }
    }
    let size = f / world;
    let mut part = order[rank * size..(rank + 1) * size].to_vec();
    part.sort_unstable();
    Ok(part)
}

/// The processes a tensor-parallel model's MLPs sum their shares over: a shared handle
/// on this rank's communicator.
#[derive(Clone)]
pub struct Ranks(Arc<Mutex<dyn Communicator>>);

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank_and_world() {
            Ok((rank, world)) => write!(f, "Ranks(rank {rank} of {world})"),
            Err(_) => f.write_str("Ranks(poisoned)"),
        }
    }
}

impl Ranks {
    pub fn new(comm: Arc<Mutex<dyn Communicator>>) -> Self {
        Self(comm)
    }

    /// This process's rank and the number of ranks.
    pub fn rank_and_world(&self) -> Result<(usize, usize)> {
        let c = self
            .0
            .lock()
            .map_err(|_| invalid("communicator lock poisoned".into()))?;
        Ok((c.rank(), c.world_size()))
    }

    /// The element-wise sum of `t` over the ranks (the same bits on every rank), in
    /// `t`'s dtype. Every rank must call it with the same shape at the same point.
    pub fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let mut comm = self
            .0
            .lock()
            .map_err(|_| invalid("communicator lock poisoned".into()))?;
        comm.all_reduce_sum_tensor(t)?.to_dtype(t.dtype())
    }
}

/// `mlp` restricted to `neurons` (ascending): their gate and up rows and down columns,
/// with its activation, mode and TwELL settings. Refuses an MLP with biases (the down
/// bias would be added once a rank), quantized rows or a folded norm.
pub fn mlp_share(mlp: &SparseMlp, neurons: &[usize]) -> Result<SparseMlp> {
    if mlp.has_bias() || mlp.is_quantized() || mlp.pre_norm_folded() {
        return Err(invalid(
            "shares are cut from a plain MLP: no biases, no quantized rows, no folded norm".into(),
        ));
    }
    let f = mlp.ffn();
    if let Some(&j) = neurons.iter().find(|&&j| j >= f) {
        return Err(invalid(format!("neuron {j} of an MLP of {f}")));
    }
    let ids = Tensor::from_vec(
        neurons.iter().map(|&j| j as u32).collect::<Vec<_>>(),
        neurons.len(),
        mlp.gate_proj().device(),
    )?;
    Ok(SparseMlp::new(
        mlp.gate_proj().index_select(&ids, 0)?,
        mlp.up_proj().index_select(&ids, 0)?,
        mlp.down_proj().index_select(&ids, 1)?.contiguous()?,
        mlp.activation(),
        mlp.mode(),
    )?
    .with_twell_config(mlp.twell_config()))
}

/// Rank `rank` of `world`'s share of `whole`: the MLP over the neurons [`shard_neurons`]
/// gives it for `order` (the identity when `None`), and those neurons.
pub fn rank_share(
    whole: &SparseMlp,
    order: Option<&[usize]>,
    rank: usize,
    world: usize,
) -> Result<(SparseMlp, Vec<usize>)> {
    let f = whole.ffn();
    let neurons = match order {
        Some(o) if o.len() != f => {
            return Err(invalid(format!(
                "the neuron order has {} entries for {f} neurons",
                o.len()
            )))
        }
        Some(o) => shard_neurons(o, rank, world)?,
        None => shard_neurons(&(0..f).collect::<Vec<_>>(), rank, world)?,
    };
    Ok((mlp_share(whole, &neurons)?, neurons))
}

/// One rank's share of a sparse MLP, and the ranks that sum the shares.
///
/// Every rank must call [`ShardedMlp::forward`] on the same rows in the same order (the
/// same model, the same batch): each call is one all-reduce.
#[derive(Debug)]
pub struct ShardedMlp {
    part: SparseMlp,
    neurons: Vec<usize>,
    ranks: Ranks,
}

impl ShardedMlp {
    /// This rank's share of `whole` ([`rank_share`] at the rank and world size of
    /// `ranks`).
    pub fn new(whole: &SparseMlp, order: Option<&[usize]>, ranks: Ranks) -> Result<Self> {
        let (rank, world) = ranks.rank_and_world()?;
        let (part, neurons) = rank_share(whole, order, rank, world)?;
        Ok(Self {
            part,
            neurons,
            ranks,
        })
    }

    /// The neurons this rank holds, ascending.
    pub fn neurons(&self) -> &[usize] {
        &self.neurons
    }

    /// The MLP of `x [.., d]`: this rank's partial sum over its neurons, added over the
    /// ranks (every rank ends with the same values), in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.ranks.sum(&self.part.forward(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use twell::FfnMode;
    use twell_dist::SingleProcess;

    #[test]
    fn shares_cover_every_neuron_once() -> Result<()> {
        let order: Vec<usize> = (0..12).rev().collect();
        let parts: Vec<Vec<usize>> = (0..3)
            .map(|r| shard_neurons(&order, r, 3))
            .collect::<Result<_>>()?;
        assert_eq!(parts[0], vec![8, 9, 10, 11]);
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        assert_eq!(all, (0..12).collect::<Vec<_>>());
        Ok(())
    }

    #[test]
    fn bad_orders_and_worlds_are_refused() {
        let order: Vec<usize> = (0..12).collect();
        for (order, rank, world, needle) in [
            (order.clone(), 0, 5, "equal parts"),
            (order.clone(), 3, 3, "rank 3 of a world of 3"),
            (order.clone(), 0, 0, "world of 0"),
            (vec![0, 1, 2, 2], 0, 2, "not a permutation"),
            (vec![0, 1, 2, 9], 0, 2, "not a permutation"),
        ] {
            let e = shard_neurons(&order, rank, world).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn a_world_of_one_is_the_whole_mlp() -> Result<()> {
        let dev = Device::Cpu;
        let w = twell::density::synthetic_mlp(64, 96, 0.1, DType::F32, &dev, 3)?;
        let x = twell::density::synthetic_input(5, 64, DType::F32, &dev, 4)?;
        let whole_mlp = w.relu_mlp(FfnMode::Sparse)?;
        let whole = whole_mlp.forward(&x)?;
        let one = || Ranks::new(Arc::new(Mutex::new(SingleProcess)));
        let order: Vec<usize> = (0..96).rev().collect();
        let sharded = ShardedMlp::new(&whole_mlp, Some(&order), one())?;
        let diff = (sharded.forward(&x)? - &whole)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let e = ShardedMlp::new(&whole_mlp, Some(&order[..95]), one())
            .expect_err("a short order")
            .to_string();
        assert!(e.contains("95 entries for 96 neurons"), "{e}");
        let e = mlp_share(&whole_mlp, &[0, 96])
            .expect_err("a neuron past f")
            .to_string();
        assert!(e.contains("neuron 96 of an MLP of 96"), "{e}");
        Ok(())
    }

    /// A down bias would be added once per rank, and quantized rows are the host's own
    /// copy of the weights: neither is cut into shares.
    #[test]
    fn biased_and_quantized_mlps_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let w = twell::density::synthetic_mlp(64, 96, 0.1, DType::F32, &dev, 3)?;
        let bias = twell::MlpBias {
            gate: Tensor::zeros(96, DType::F32, &dev)?,
            up: Tensor::zeros(96, DType::F32, &dev)?,
            down: Tensor::zeros(64, DType::F32, &dev)?,
        };
        let biased = w.relu_mlp(FfnMode::Dense)?.with_bias(bias)?;
        let mut quantized = w.relu_mlp(FfnMode::Sparse)?;
        quantized.quantize_for_cpu(twell::cpu::quant::QuantFormat::Q8)?;
        for mlp in [biased, quantized] {
            let e = rank_share(&mlp, None, 0, 2)
                .expect_err("refused")
                .to_string();
            assert!(e.contains("no biases, no quantized rows"), "{e}");
        }
        Ok(())
    }
}
