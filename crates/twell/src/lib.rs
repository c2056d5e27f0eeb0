//! # twell: sparse feed-forward layers for Candle
//!
//! A ReLU-gated MLP trained with an L1 penalty leaves more than 99% of its hidden
//! activations at exactly zero. This crate turns those zeros into saved work:
//!
//! * [`mod@format`]: TwELL, a tile-wise ELLPACK layout that GPU tiles can fill and read,
//!   made lossless by a dense overflow block;
//! * [`ops`]: candle CustomOps (forward and backward) for the gate GEMM + ReLU + pack,
//!   the sparse up/down projections, and the whole MLP;
//! * [`mlp`]: [`SparseMlp`], a `candle_nn::Module` that swaps for a dense MLP;
//! * [`density`]: synthetic weights with a chosen activation density, for benchmarks.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod attention_split;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod density;
pub mod error;
pub mod format;
// Its count knobs are read by the CUDA launchers only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod knobs;
pub mod mlp;
pub mod ops;
// Used by the CUDA launchers only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod per_key;

pub use cpu::screen::GateScreen;
pub use error::TwellError;
pub use format::{Twell, TwellConfig, TwellPattern, TwellStats};
pub use mlp::{Activation, FfnMode, L1Term, MlpBias, MlpStats, SparseMlp, GATE_L0_EPS};
pub use ops::{
    gate_pack, gated_t2d, mlp_result_len, twell_mlp, twell_mlp_products, twell_mlp_screened,
    twell_mlp_with_backward_path, up_down_matrix, BackwardPath, MlpOutput,
};

/// How many backward passes of the TwELL MLP ran on the CUDA kernels (0 without the
/// `cuda` feature): benches and checks use it to show the device path ran, not the
/// host fallback.
pub fn device_backward_calls() -> usize {
    #[cfg(feature = "cuda")]
    return cuda::backward_calls();
    #[cfg(not(feature = "cuda"))]
    0
}
