//! # twell: sparse feed-forward layers for Candle
//!
//! A ReLU-gated MLP trained with an L1 penalty leaves more than 99% of its hidden
//! activations at exactly zero. This crate turns those zeros into saved work:
//!
//! * [`mod@format`]: TwELL, a tile-wise ELLPACK layout that GPU tiles can fill and read,
//!   made lossless by a dense overflow block;
//! * [`SparseMlp`] ([`mlp`]): a `candle_nn::Module` that swaps for a dense MLP and runs
//!   dense, sparse, or whichever is faster for the call ([`FfnMode::Auto`]);
//! * the ops behind it, candle CustomOps with backward passes on the CPU and on CUDA:
//!   [`twell_mlp`] (the whole ReGLU MLP: gate GEMM, ReLU and pack, then the sparse up and
//!   down projections), [`twell_mlp_products`] (the same MLP at higher densities:
//!   cuBLAS GEMMs around one kernel), [`gate_pack`] and [`gated_t2d`] (its two halves,
//!   on the host), and [`gate_l0`] (the smooth count of positive gates a fine-tune can
//!   penalise);
//! * [`density`]: synthetic weights with a chosen activation density, for benchmarks.
//!
//! The CUDA kernels are in the `twell-kernels` crate; the transformer ops around the
//! MLP (attention, norms, RoPE, losses, AdamW) in `fused-ops`.

pub mod auto;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod density;
pub mod error;
pub mod format;
mod gate_l0;
mod gate_pack;
mod gated_t2d;
pub mod mlp;
mod output;
mod twell_mlp;
mod twell_mlp_products;

pub use cpu::screen::GateScreen;
pub use error::TwellError;
pub use format::{
    FewRows, GateGemm, KernelPaths, RowWalk, StagedRows, Twell, TwellConfig, TwellPattern,
    TwellStats,
};
pub use gate_l0::{gate_l0, gate_l0_reference, GateL0};
pub use gate_pack::{gate_pack, GatePack};
pub use gated_t2d::{gated_t2d, GatedT2d};
pub use mlp::{Activation, FfnMode, L1Term, MlpBias, MlpStats, Nonzeros, SparseMlp, GATE_L0_EPS};
pub use output::{mlp_result_len, up_down_matrix, MlpOutput};
pub use twell_mlp::{
    add_norm_fuses, gate_screen, norm_add_norm_runs, staged_rows_for, twell_mlp,
    twell_mlp_add_norm, twell_mlp_norm_add_norm, twell_mlp_screened, twell_mlp_with_backward_path,
    BackwardPath, TwellMlp, ROW_KERNELS_MIN_ADDS_PER_PAIR, ROW_KERNELS_MIN_ROWS,
    STAGED_ROWS_ASSUMED_DENSITY,
};
pub use twell_mlp_products::{products_run, twell_mlp_products};

/// How many backward passes of the TwELL MLP ran on the CUDA kernels (0 without the
/// `cuda` feature): benches and checks use it to show the device path ran, not the
/// host fallback.
pub fn device_backward_calls() -> usize {
    #[cfg(feature = "cuda")]
    return twell_mlp::cuda_backward::backward_calls();
    #[cfg(not(feature = "cuda"))]
    0
}
