//! The tensor-parallel sparse MLP on loopback TCP, one thread a rank: every rank's sum of
//! the shares equals the whole MLP (f32), the ranks agree bit for bit, and a balanced
//! neuron order gives the same result as the identity.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use sparse_llama::sparsity::balanced_neuron_order;
use sparse_llama::tensor_parallel::ShardedMlp;
use twell::density::{synthetic_input, synthetic_mlp, MlpWeights};
use twell::{Activation, FfnMode};
use twell_dist::{Communicator, TcpCommunicator, TcpOptions};

/// A loopback address with a port that was free a moment ago.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Each rank's output of the sharded MLP over `x`, by rank, for a world of `world`.
fn sharded_outputs(
    w: &MlpWeights,
    x: &Tensor,
    mode: FfnMode,
    order: Option<&[usize]>,
    world: usize,
) -> Vec<Vec<f32>> {
    let addr = free_addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let options = TcpOptions::new(rank, world, addr)
                        .with_connect_timeout(Duration::from_secs(20))
                        .with_timeout(Duration::from_secs(20));
                    let comm: Arc<Mutex<dyn Communicator>> =
                        Arc::new(Mutex::new(TcpCommunicator::connect(&options).unwrap()));
                    let mlp = ShardedMlp::new(
                        &w.gate,
                        &w.up,
                        &w.down,
                        Activation::Relu,
                        mode,
                        order,
                        comm,
                    )
                    .unwrap();
                    assert_eq!(mlp.neurons().len(), w.gate.dim(0).unwrap() / world);
                    mlp.forward(x)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn relative_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn the_ranks_shares_add_up_to_the_whole_mlp() {
    let dev = Device::Cpu;
    let (hidden, ffn) = (64, 192);
    for (world, rows, density) in [(2, 1, 0.05), (2, 33, 0.1), (3, 7, 0.3), (4, 70, 0.02)] {
        let w = synthetic_mlp(hidden, ffn, density, DType::F32, &dev, world as u64).unwrap();
        let x = synthetic_input(rows, hidden, DType::F32, &dev, rows as u64).unwrap();
        let whole = w
            .relu_mlp(FfnMode::Dense)
            .unwrap()
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // A neuron order from made-up loads: the heaviest neurons spread over the ranks.
        let load: Vec<u64> = (0..ffn as u64).map(|j| (j * 7919) % 101).collect();
        let balanced = balanced_neuron_order(&load, world).unwrap();
        for mode in [FfnMode::Sparse, FfnMode::Dense] {
            for order in [None, Some(balanced.as_slice())] {
                let outputs = sharded_outputs(&w, &x, mode, order, world);
                for (rank, out) in outputs.iter().enumerate() {
                    let e = relative_l2(out, &whole);
                    assert!(
                        e < 1e-5,
                        "world {world}, {rows} rows, {density}, {mode:?}, rank {rank}: {e}"
                    );
                    assert_eq!(out, &outputs[0], "rank {rank} differs from rank 0");
                }
            }
        }
    }
}
