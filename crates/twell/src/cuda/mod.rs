//! What the TwELL MLP's CUDA launchers share (the forward in `twell_mlp::cuda`, its
//! backward and the one-token kernel beside it, the products path, the gate GEMM): the
//! kernels' shape arguments and work splits. The launch plumbing every op shares
//! (device attributes, checked views, poisoned outputs) is `fused_ops::cuda`.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

use crate::format::TwellConfig;

pub(crate) mod gate_gemm;

pub use crate::twell_mlp::cuda::{set_stage_profiling, take_profile, STAGES};

/// Up to this many tokens the launches split each row's work across many warps
/// (decode); above it a warp owns a whole tile or row chunk (prefill).
pub const DECODE_MAX_TOKENS: usize = 64;
/// d-elements one warp covers in the down kernel (`WARP_CHUNK` in the .cu).
pub(crate) const WARP_CHUNK: usize = 256;

/// The prefill up kernel keeps a row of x in registers as `MAXV` 16-byte vectors per
/// lane; the instantiations are 1, 2, 4, 8 and 16 (d up to 4096).
pub(crate) fn row_vectors(d: usize) -> Option<usize> {
    let need = d.div_ceil(32 * 8);
    [1, 2, 4, 8, 16].into_iter().find(|&v| v >= need)
}

/// Shared memory a block may take without opting in to more.
pub(crate) const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// The shape arguments every `gated_t2d` kernel takes, in its parameter order.
pub(crate) struct KernelDims {
    pub(crate) m: i32,
    pub(crate) d: i32,
    pub(crate) f: i32,
    pub(crate) tile: i32,
    pub(crate) cap: i32,
    pub(crate) n_tiles: i32,
}

impl KernelDims {
    /// The shape arguments of `m` rows of hidden `d` through `f` neurons in `config`'s
    /// tiles.
    pub(crate) fn new(m: usize, d: usize, f: usize, config: TwellConfig) -> Self {
        Self {
            m: m as i32,
            d: d as i32,
            f: f as i32,
            tile: config.tile() as i32,
            cap: config.capacity() as i32,
            n_tiles: config.n_tiles(f) as i32,
        }
    }

    /// The shape arguments every `gated_t2d` kernel takes: m, d, f, tile, cap, n_tiles.
    pub(crate) fn push<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(
            b,
            [
                &self.m,
                &self.d,
                &self.f,
                &self.tile,
                &self.cap,
                &self.n_tiles,
            ],
        );
    }

    /// The shape arguments of the pair-grouping kernels: all but d.
    pub(crate) fn push_pattern<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.m, &self.f, &self.tile, &self.cap, &self.n_tiles]);
    }

    /// The shape arguments of the kernels that walk the gate's bit mask: all but cap.
    pub(crate) fn push_without_cap<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.m, &self.d, &self.f, &self.tile, &self.n_tiles]);
    }

    /// The shape arguments of the per-neuron weight-gradient kernels: all but m.
    pub(crate) fn push_neuron<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.d, &self.f, &self.tile, &self.cap, &self.n_tiles]);
    }
}

/// Pushes `fields` onto a launch's arguments, in order.
fn push_each<'a, B: PushKernelArg<&'a i32>, const N: usize>(b: &mut B, fields: [&'a i32; N]) {
    for field in fields {
        b.arg(field);
    }
}
