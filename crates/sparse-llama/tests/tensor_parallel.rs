//! The tensor-parallel sparse MLP on loopback TCP, one thread a rank: every rank's sum of
//! the shares equals the whole MLP (f32), the ranks agree bit for bit, and a balanced
//! neuron order gives the same result as the identity.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use sparse_llama::sparsity::balanced_neuron_order;
use sparse_llama::tensor_parallel::{Ranks, ShardedMlp};
use twell::density::{synthetic_input, synthetic_mlp, MlpWeights};
use twell::FfnMode;
use twell_dist::{Communicator, TcpCommunicator, TcpOptions};

/// A loopback address with a port that was free a moment ago.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Runs `f` on each rank of a fresh loopback world of `world`, one thread each, given
/// that rank's handle on the world; the results by rank.
fn on_ranks<T: Send>(world: usize, f: impl Fn(Ranks) -> T + Sync) -> Vec<T> {
    let addr = free_addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let options = TcpOptions::new(rank, world, addr)
                        .with_connect_timeout(Duration::from_secs(20))
                        .with_timeout(Duration::from_secs(20));
                    let comm: Arc<Mutex<dyn Communicator>> =
                        Arc::new(Mutex::new(TcpCommunicator::connect(&options).unwrap()));
                    f(Ranks::new(comm))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Each rank's output of the sharded MLP over `x`, by rank, for a world of `world`.
fn sharded_outputs(
    w: &MlpWeights,
    x: &Tensor,
    mode: FfnMode,
    order: Option<&[usize]>,
    world: usize,
) -> Vec<Vec<f32>> {
    on_ranks(world, |ranks| {
        let whole = w.relu_mlp(mode).unwrap();
        let mlp = ShardedMlp::new(&whole, order, ranks).unwrap();
        assert_eq!(mlp.neurons().len(), w.gate.dim(0).unwrap() / world);
        mlp.forward(x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
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

/// Greedy decoding of a synthetic sparse model: the prompt's logits, then `steps`
/// one-token steps through a KV cache (`Llama::forward`) and the same steps through the
/// batched host decode (`Llama::forward_decode_batch`), every logit in order.
fn decode_logits(model: &sparse_llama::Llama, prompt: &[u32], steps: usize) -> Vec<f32> {
    use sparse_llama::model::Cache;
    let dev = model.device().clone();
    let cfg = model.config().clone();
    let mut cache = Cache::new(true, DType::F32, &cfg, &dev).unwrap();
    let mut batch_cache = Cache::new(true, DType::F32, &cfg, &dev).unwrap();
    let ids = Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap();
    let mut logits = model.forward(&ids, 0, &mut cache).unwrap();
    model.forward(&ids, 0, &mut batch_cache).unwrap();
    let mut all = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for step in 0..steps {
        let next = logits.argmax(candle_core::D::Minus1).unwrap();
        let token = next.flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
        let position = prompt.len() + step;
        let ids = Tensor::new(&[token], &dev).unwrap().unsqueeze(0).unwrap();
        logits = model.forward(&ids, position, &mut cache).unwrap();
        let batched = model
            .forward_decode_batch(&[token], &[position], &mut [&mut batch_cache])
            .unwrap();
        all.extend(logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        all.extend(batched.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    all
}

/// A sparse model sharded over 2 and 3 ranks (`Llama::shard_ffn`, in the identity and
/// in a balanced neuron order) decodes with the whole model's logits, prefill and steps,
/// and every rank holds the same logits bit for bit; a sharded model refuses training,
/// folding and a second sharding, and a wrong number of orders.
#[test]
fn a_sharded_model_decodes_with_the_whole_models_logits() {
    use sparse_llama::{synthetic, Llama};
    let dev = Device::Cpu;
    let cfg = synthetic::config(64, 192, 2, 4, 2, 300).unwrap();
    let mut weights = synthetic::weights(&cfg, 0.1, 5, DType::F32, &dev).unwrap();
    // The random model's MLPs write little into the residual stream; make them count, so
    // a share missing from the sum shows in the logits.
    for (name, w) in weights.iter_mut() {
        if name.contains("down_proj") {
            *w = (&*w * 20.0).unwrap();
        }
    }
    let load = || {
        let vb = candle_nn::VarBuilder::from_tensors(weights.clone(), DType::F32, &dev);
        Llama::load(vb, &cfg).unwrap()
    };
    let prompt = [3u32, 41, 7, 99, 250, 12];
    let whole = decode_logits(&load(), &prompt, 6);
    for (world, balanced) in [(2, false), (3, true)] {
        let orders: Vec<Vec<usize>> = (0..2)
            .map(|l| {
                let load: Vec<u64> = (0..192u64).map(|j| (j * 31 + l * 7) % 53).collect();
                balanced_neuron_order(&load, world).unwrap()
            })
            .collect();
        let outputs = on_ranks(world, |ranks| {
            let mut model = load();
            let order = balanced.then_some(orders.as_slice());
            model.shard_ffn(ranks, order).unwrap();
            assert!(model.is_tensor_parallel());
            decode_logits(&model, &prompt, 6)
        });
        for (rank, out) in outputs.iter().enumerate() {
            assert_eq!(out.len(), whole.len());
            let e = relative_l2(out, &whole);
            assert!(e < 1e-5, "world {world}, rank {rank}: {e}");
            assert_eq!(
                out, &outputs[0],
                "world {world}: rank {rank} differs from rank 0"
            );
        }
    }
    // What a sharded model refuses.
    let mut model = load();
    let one = || Ranks::new(Arc::new(Mutex::new(twell_dist::SingleProcess)));
    model.shard_ffn(one(), None).unwrap();
    let ids = Tensor::new(&prompt, &dev).unwrap().unsqueeze(0).unwrap();
    for e in [
        model.forward_train(&ids).err().map(|e| e.to_string()),
        model.fold_mlp_norms().err().map(|e| e.to_string()),
        model.shard_ffn(one(), None).err().map(|e| e.to_string()),
    ] {
        let e = e.expect("refused");
        assert!(
            e.contains("tensor-parallel") || e.contains("sharded already"),
            "{e}"
        );
    }
    let mut fresh = load();
    let e = fresh
        .shard_ffn(one(), Some(&[vec![0usize; 192]][..]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 neuron orders for 2 layers"), "{e}");
}
