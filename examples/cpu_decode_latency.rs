//! One-token latency of the sparse MLP on the CPU, depending on what ran just before:
//! nothing (threads awake, weights partly cached), a 5 ms pause (threads asleep), a
//! 200 MB sweep (caches cold), or candle's dense MLP (both). `twell bench mlp` times its
//! variants interleaved, so its M = 1 figure is the cold one.
//!
//! `cargo run --release --example cpu_decode_latency [-- SETS CALLS]`

use candle_core::{DType, Device, Module};
use twell::density::{synthetic_input, synthetic_mlp};
use twell::FfnMode;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let sets = args.next().transpose()?.unwrap_or(3).max(1);
    let calls = args.next().transpose()?.unwrap_or(500).max(1);
    let dev = Device::Cpu;
    let (mut sparse, mut dense) = (Vec::new(), Vec::new());
    for k in 0..sets {
        let w = synthetic_mlp(2048, 5632, 0.01, DType::F32, &dev, 1000 + k as u64)?;
        sparse.push(w.relu_mlp(FfnMode::Sparse)?);
        dense.push(w.relu_mlp(FfnMode::Dense)?);
    }
    let x = synthetic_input(1, 2048, DType::F32, &dev, 7)?;
    // The first sparse call builds the int8 gate screen; keep it out of the timing.
    for mlp in &sparse {
        for _ in 0..3 {
            mlp.forward(&x)?;
        }
    }
    let sweep = vec![1u8; 200 << 20];
    println!(
        "hidden 2048, d_ff 5632, 1% density, f32, {} threads, {sets} weight sets",
        candle_core::utils::get_num_threads()
    );
    for before in ["nothing", "5 ms pause", "200 MB sweep", "dense MLP"] {
        let mut total = 0.0;
        for i in 0..calls {
            match before {
                "5 ms pause" => std::thread::sleep(std::time::Duration::from_millis(5)),
                "200 MB sweep" => {
                    std::hint::black_box(
                        sweep.iter().step_by(64).map(|&b| u64::from(b)).sum::<u64>(),
                    );
                }
                "dense MLP" => {
                    std::hint::black_box(dense[(i + 1) % sets].forward(&x)?);
                }
                _ => {}
            }
            let t0 = std::time::Instant::now();
            std::hint::black_box(sparse[i % sets].forward(&x)?);
            total += t0.elapsed().as_secs_f64();
        }
        println!(
            "after {before:>12}: {:.3} ms per sparse call",
            total * 1e3 / calls as f64
        );
    }
    Ok(())
}
