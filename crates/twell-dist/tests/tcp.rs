//! The TCP communicator on loopback, one thread per rank: sums against a serial sum,
//! broadcasts, barriers, gradient buckets, and the errors of ranks that disagree, time
//! out or exit.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use twell_dist::{all_reduce_mean, Communicator, DistError, TcpCommunicator, TcpOptions};

/// A loopback address with a port that was free a moment ago.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Runs `f` on each rank of a fresh loopback world of `n`, one thread each; the results
/// by rank.
fn on_ranks<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(TcpCommunicator) -> T + Sync,
) -> Vec<T> {
    let addr = free_addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let options = TcpOptions::new(rank, n, addr)
                        .with_connect_timeout(Duration::from_secs(20))
                        .with_timeout(timeout);
                    f(TcpCommunicator::connect(&options).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `rank`'s random buffer of `len` floats (the same on every call).
fn buffer(rank: usize, len: usize, integers: bool) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64((rank * 1_000_003 + len) as u64);
    (0..len)
        .map(|_| match integers {
            true => rng.random_range(-1000..1000) as f32,
            false => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..3)),
        })
        .collect()
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn all_reduce_matches_a_serial_sum_on_every_rank() {
    for n in [1, 2, 3, 4] {
        // Empty, shorter than the world, not divisible by it, and above the size that is
        // written from a second thread.
        let lengths = [0, 1, n + 1, 1000 + 3, 100_003];
        let results = on_ranks(n, LONG, |mut comm| {
            let mut out = Vec::new();
            for &len in &lengths {
                for integers in [true, false] {
                    let mut buf = buffer(comm.rank(), len, integers);
                    comm.all_reduce_sum(&mut buf).unwrap();
                    out.push(buf);
                }
            }
            out
        });
        let mut k = 0;
        for &len in &lengths {
            for integers in [true, false] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| buffer(r, len, integers)).collect();
                let serial: Vec<f64> = (0..len)
                    .map(|i| inputs.iter().map(|b| b[i] as f64).sum())
                    .collect();
                for (rank, result) in results.iter().enumerate() {
                    let got = &result[k];
                    assert_eq!(got.len(), len);
                    // Bit-identical on every rank.
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(&results[0][k]),
                        "n {n} len {len} rank {rank}"
                    );
                    for (g, want) in got.iter().zip(&serial) {
                        if integers {
                            assert_eq!(*g as f64, *want, "n {n} len {len}");
                        } else {
                            let scale = (0..n).map(|_| 10.0).sum::<f64>();
                            assert!((*g as f64 - want).abs() <= 1e-6 * scale, "n {n} len {len}");
                        }
                    }
                }
                k += 1;
            }
        }
    }
}

#[test]
fn the_same_inputs_give_the_same_bits_on_every_run() {
    let run = || {
        on_ranks(3, LONG, |mut comm| {
            let mut buf = buffer(comm.rank(), 10_007, false);
            comm.all_reduce_sum(&mut buf).unwrap();
            buf
        })
    };
    let (a, b) = (run(), run());
    assert!(a[0]
        .iter()
        .zip(&b[0])
        .all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn broadcast_copies_rank_0s_bytes_everywhere() {
    for n in [1, 2, 3] {
        let results = on_ranks(n, LONG, |mut comm| {
            let mut out = Vec::new();
            for len in [0usize, 5, 1 << 20] {
                let mut buf: Vec<u8> = (0..len).map(|i| (i * 7 + comm.rank()) as u8).collect();
                comm.broadcast(&mut buf).unwrap();
                out.push(buf);
            }
            let mut f = vec![comm.rank() as f32 + 0.5, f32::NAN];
            comm.broadcast_f32(&mut f).unwrap();
            (out, f[0], f[1].to_bits())
        });
        for (out, f, nan) in &results {
            for (buf, len) in out.iter().zip([0usize, 5, 1 << 20]) {
                let want: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
                assert!(*buf == want, "n {n} len {len}");
            }
            assert_eq!((*f, *nan), (0.5, f32::NAN.to_bits()));
        }
    }
}

#[test]
fn no_rank_leaves_a_barrier_before_the_last_arrives() {
    let start = Instant::now();
    let results = on_ranks(3, LONG, |mut comm| {
        // Rank 2 arrives 300 ms late.
        std::thread::sleep(Duration::from_millis(100 * comm.rank() as u64 * 3 / 2));
        let arrived = start.elapsed();
        comm.barrier().unwrap();
        (arrived, start.elapsed())
    });
    let last_arrival = results.iter().map(|r| r.0).max().unwrap();
    for (rank, (_, left)) in results.iter().enumerate() {
        assert!(
            *left >= last_arrival,
            "rank {rank} left at {left:?}, before {last_arrival:?}"
        );
    }
}

#[test]
fn gradient_buckets_average_over_the_ranks() {
    let shapes: [&[usize]; 4] = [&[3, 5], &[7], &[2, 2, 2], &[1000]];
    let tensors = |rank: usize| -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(k, shape)| {
                let len = shape.iter().product();
                Tensor::from_vec(buffer(rank * 10 + k, len, false), *shape, &Device::Cpu).unwrap()
            })
            .collect()
    };
    let n = 3;
    // 64-byte buckets: the small tensors share one, the large one has its own.
    let results = on_ranks(n, LONG, |mut comm| {
        let mine = tensors(comm.rank());
        all_reduce_mean(&mut comm, &mine, 64).unwrap()
    });
    for (k, shape) in shapes.iter().enumerate() {
        let mut want = tensors(0)[k].clone();
        for r in 1..n {
            want = (want + &tensors(r)[k]).unwrap();
        }
        let want = (want / n as f64).unwrap();
        for result in &results {
            assert_eq!(result[k].dims(), *shape);
            let diff = (&result[k] - &want).unwrap().abs().unwrap();
            let diff = diff.flatten_all().unwrap().max(0).unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        }
    }
}

#[test]
fn mismatched_lengths_fail_on_every_rank_and_leave_it_broken() {
    let errors = on_ranks(3, LONG, |mut comm| {
        let len = if comm.rank() == 1 { 5 } else { 4 };
        let err = comm.all_reduce_sum(&mut vec![1.0; len]).unwrap_err();
        let again = comm.barrier().unwrap_err();
        (err, again)
    });
    for (err, again) in &errors {
        assert!(matches!(again, DistError::Broken { .. }), "{again}");
        let _ = err.to_string();
    }
    let mismatch = errors
        .iter()
        .find_map(|(e, _)| match e {
            DistError::LengthMismatch { ours, theirs, .. } => Some((*ours, *theirs)),
            _ => None,
        })
        .expect("a rank reports the lengths");
    assert!(mismatch == (4, 5) || mismatch == (5, 4), "{mismatch:?}");
    let text = errors.iter().map(|e| e.0.to_string()).collect::<Vec<_>>();
    assert!(
        text.iter()
            .any(|t| t.contains("every rank must pass the same length")),
        "{text:?}"
    );
}

#[test]
fn different_collectives_are_reported_as_out_of_step() {
    let errors = on_ranks(2, LONG, |mut comm| match comm.rank() {
        0 => comm.barrier().unwrap_err().to_string(),
        _ => comm.all_reduce_sum(&mut [1.0]).unwrap_err().to_string(),
    });
    assert!(
        errors
            .iter()
            .any(|e| e.contains("a barrier") && e.contains("an all-reduce")),
        "{errors:?}"
    );
}

#[test]
fn a_peer_that_exits_is_an_error_not_a_hang() {
    let started = Instant::now();
    // A timeout far beyond the test's bound: the error must come from the closed socket.
    let errors = on_ranks(3, Duration::from_secs(120), |mut comm| {
        if comm.rank() == 2 {
            drop(comm);
            return None;
        }
        let mut buf = vec![1.0; 100_000];
        Some(comm.all_reduce_sum(&mut buf).unwrap_err())
    });
    assert!(started.elapsed() < Duration::from_secs(20));
    let texts: Vec<String> = errors.iter().flatten().map(|e| e.to_string()).collect();
    assert_eq!(texts.len(), 2);
    assert!(
        texts
            .iter()
            .any(|t| t.contains("rank 2 closed its connection")),
        "{texts:?}"
    );
}

#[test]
fn a_peer_that_stops_answering_times_out() {
    let errors = on_ranks(2, Duration::from_millis(300), |mut comm| {
        if comm.rank() == 1 {
            // Alive, but in no collective until the other rank has given up.
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let started = Instant::now();
        let err = comm.all_reduce_sum(&mut [1.0, 2.0]).unwrap_err();
        Some((err, started.elapsed()))
    });
    let (err, after) = errors[0].as_ref().unwrap();
    assert!(matches!(err, DistError::Timeout { peer: 1, .. }), "{err}");
    assert!(err.to_string().contains("is it still running?"), "{err}");
    assert!(*after < Duration::from_secs(5), "{after:?}");
}

#[test]
fn a_bad_rendezvous_is_refused_with_a_reason() {
    let addr = free_addr();
    let quick = |rank, world| {
        TcpOptions::new(rank, world, addr).with_connect_timeout(Duration::from_millis(500))
    };
    // Nobody at the rendezvous.
    let err = TcpCommunicator::connect(&quick(1, 2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no rank 0"), "{err}");
    // Rank 0 alone, nobody joins.
    let err = TcpCommunicator::connect(&quick(0, 2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("did not join"), "{err}");
    // Bad options.
    let err = TcpCommunicator::connect(&quick(2, 2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not below the world size"), "{err}");
    let unspecified = TcpOptions::new(0, 2, "0.0.0.0:1234".parse().unwrap());
    let err = TcpCommunicator::connect(&unspecified)
        .unwrap_err()
        .to_string();
    assert!(err.contains("names no host"), "{err}");
    // Ranks that disagree on the world size: rank 0 says why to the rank that joined.
    let errors = std::thread::scope(|s| {
        let zero = s.spawn(|| {
            TcpCommunicator::connect(&quick(0, 2).with_connect_timeout(Duration::from_secs(10)))
        });
        let one = s.spawn(|| {
            TcpCommunicator::connect(&quick(1, 3).with_connect_timeout(Duration::from_secs(10)))
        });
        [
            zero.join().unwrap().unwrap_err(),
            one.join().unwrap().unwrap_err(),
        ]
        .map(|e| e.to_string())
    });
    for e in &errors {
        assert!(e.contains("world of 3"), "{errors:?}");
    }
}

/// A world of one needs no rendezvous, and its collectives leave buffers alone.
#[test]
fn a_world_of_one_is_a_no_op() {
    let mut comm = TcpCommunicator::connect(&TcpOptions::new(0, 1, free_addr())).unwrap();
    let mut buf = vec![1.5, -2.0];
    comm.all_reduce_sum(&mut buf).unwrap();
    comm.barrier().unwrap();
    assert_eq!(buf, [1.5, -2.0]);
    let mut single = twell_dist::SingleProcess;
    single.all_reduce_sum(&mut buf).unwrap();
    assert_eq!(
        (single.rank(), single.world_size(), buf),
        (0, 1, vec![1.5, -2.0])
    );
}
