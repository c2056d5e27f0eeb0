//! Data-parallel fine-tuning on a tiny synthetic model, one thread per rank on loopback:
//! two ranks at a global batch train as one process on the same batch does, and ranks
//! that cannot train together are refused.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use candle_core::Device;
use common::{rel_l2, tiny_config, tiny_tokenizer, tiny_weights};
use sparse_train::{PackedData, StepLog, TrainConfig, Trainer};
use twell::FfnMode;
use twell_dist::{TcpCommunicator, TcpOptions};

fn corpus() -> PackedData {
    let text =
        "we the people of the united states, in order to form a more perfect union. ".repeat(30);
    let ids = tiny_tokenizer().encode(text.as_str(), false).unwrap();
    PackedData::new(ids.get_ids(), 16).unwrap()
}

/// The tiny ReLU model's trainer: a global batch of 4, two micro-batches a step, λ
/// steered towards a density (so the controller must see the same L0 on every rank).
fn trainer(ffn: FfnMode, weight_seed: u64) -> Trainer {
    let mut cfg = tiny_config("silu", 256).into_config(false);
    cfg.ffn_mode = ffn;
    let tc = TrainConfig {
        seq_len: 16,
        batch_size: 4,
        grad_accum: 2,
        steps: 4,
        lr: 3e-3,
        warmup_steps: 1,
        l1: 0.01,
        l1_target_density: Some(0.2),
        dead_window_steps: 1,
        ..Default::default()
    };
    let w = tiny_weights(&cfg, weight_seed);
    Trainer::new(cfg, w, tc, &Device::Cpu).unwrap()
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Each of `world` ranks (threads) joins with its trainer from `make(rank)` and runs
/// `steps` steps and a validation; each rank's logs, validation CE and trainer.
fn data_parallel(
    world: usize,
    steps: usize,
    make: impl Fn(usize) -> Trainer + Sync,
) -> Vec<candle_core::Result<(Vec<StepLog>, f64, Trainer)>> {
    let (data, addr) = (corpus(), free_addr());
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (make, data) = (&make, &data);
                s.spawn(move || {
                    let options =
                        TcpOptions::new(rank, world, addr).with_timeout(Duration::from_secs(60));
                    let comm = TcpCommunicator::connect(&options).unwrap();
                    let mut t = make(rank);
                    t.join(Box::new(comm))?;
                    let logs = (0..steps)
                        .map(|_| t.train_step(data))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    let val = t.validate(data, 3)?.ce;
                    Ok((logs, val, t))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn two_ranks_train_as_one_process_on_the_same_global_batch() {
    for ffn in [FfnMode::Sparse, FfnMode::Dense] {
        let data = corpus();
        let mut single = trainer(ffn, 3);
        let want: Vec<StepLog> = (0..4).map(|_| single.train_step(&data).unwrap()).collect();
        let want_val = single.validate(&data, 3).unwrap().ce;
        let ranks = data_parallel(2, 4, |_| trainer(ffn, 3));
        for (rank, result) in ranks.into_iter().enumerate() {
            let (logs, val, t) = result.unwrap();
            assert_eq!((t.rank(), t.world_size()), (rank, 2));
            for (a, b) in logs.iter().zip(&want) {
                let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * (1.0 + y.abs());
                let pairs = [
                    (a.ce, b.ce),
                    (a.l1, b.l1),
                    (a.loss, b.loss),
                    (a.grad_norm, b.grad_norm),
                    (a.mean_l0, b.mean_l0),
                    (a.l1_coefficient, b.l1_coefficient),
                    (a.dead_fraction, b.dead_fraction),
                ];
                assert!(
                    pairs.iter().all(|&(x, y)| close(x, y)),
                    "{ffn:?} rank {rank}: {a:?}\nagainst one process: {b:?}"
                );
            }
            assert!((val - want_val).abs() < 1e-5, "{val} against {want_val}");
            let (ours, theirs) = (t.weights().unwrap(), single.weights().unwrap());
            for (name, w) in &theirs {
                let e = rel_l2(&ours[name], w);
                assert!(e < 1e-5, "{ffn:?} rank {rank}: {name} differs by {e}");
            }
        }
    }
}

#[test]
fn ranks_that_cannot_train_together_are_refused() {
    // Different starting weights: every rank is told.
    for result in data_parallel(2, 1, |rank| trainer(FfnMode::Dense, rank as u64)) {
        let err = result.err().expect("refused").to_string();
        assert!(err.contains("do not hold rank 0's weights"), "{err}");
    }
    // A global batch of 4 over 3 ranks.
    for result in data_parallel(3, 1, |_| trainer(FfnMode::Dense, 1)) {
        let err = result.err().expect("refused").to_string();
        assert!(
            err.contains("does not split evenly over 3 processes"),
            "{err}"
        );
    }
}
