//! The CUDA kernels on a GPU, each against an f32 reference on the same inputs: shapes,
//! token counts (1, odd, past 65,536), densities, overflowing tiles, and every output
//! buffer poisoned with NaN before its kernel runs.
//!
//! Built with the `cuda` feature and run on a machine with a CUDA GPU:
//! `cargo test --release --features cuda --test gpu -- --test-threads 1` (one test at a
//! time: they share the card and the process-wide switches of `fused_ops::cuda`).
#![cfg(feature = "cuda")]
// The checks' result structs are read through their `Debug` output, which the dead-code
// lint does not count.
#![allow(dead_code)]

/// Prints every result of a check and fails with those whose `pass` is false.
macro_rules! assert_all_pass {
    ($results:expr) => {{
        let failed: Vec<_> = $results
            .into_iter()
            .inspect(|r| eprintln!("{r:?}"))
            .filter(|r| !r.pass)
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }};
}

mod attention;
mod mlp;
mod model;
mod ops;

use candle_core::{Device, Tensor};

/// bf16 inputs, f32 reference: the relative L2 error bf16 rounding allows.
const TOLERANCE: f64 = 2e-2;

/// The first CUDA device, tuned as the `twell` command tunes it, with poisoned outputs.
fn gpu() -> Device {
    let dev = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    if let Device::Cuda(cuda) = &dev {
        fused_ops::cuda::configure(cuda).expect("tuning the device");
    }
    fused_ops::cuda::set_poison_outputs(true);
    dev
}

fn rel_l2(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    Ok(fused_ops::compare::rel_l2(a, b)?)
}
