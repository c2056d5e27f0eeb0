//! The gate GEMM `g = x · Wgᵀ` on the CPU, in f32.
//!
//! Two regimes. With few tokens the product is a matrix-vector product bound by the
//! bytes of `Wg`; a general GEMM spends most of its time packing there, so we stream
//! each weight row once and dot it with every token. With many tokens the product is
//! compute-bound and the `gemm` crate (candle's own CPU matmul engine) does it.
//! Rows are processed in blocks so the dense f32 gate never exceeds a few MB.

use rayon::prelude::*;

use super::simd::{dot, dot_2x4};
use fused_ops::host::Rows;

/// Up to this many tokens the weight-streaming GEMV beats `gemm` (measured by
/// `twell bench --cpu`: at 16 tokens and d=2048 it is still bandwidth-bound).
pub const GEMV_MAX_ROWS: usize = 24;

/// Rows per block of the dense gate: bounds the f32 scratch to `GATE_BLOCK_ROWS · f`.
pub const GATE_BLOCK_ROWS: usize = 256;

/// `g [m, f] = x [m, d] · wgᵀ` with `wg [f, d]`, row-major f32 output.
pub fn gate_gemm(x: &[f32], m: usize, d: usize, wg: Rows<'_>, f: usize) -> Vec<f32> {
    if m <= GEMV_MAX_ROWS {
        gate_gemv(x, m, d, wg, f)
    } else {
        let wg_f32;
        let w: &[f32] = match wg {
            Rows::F32(w) => w,
            other => {
                wg_f32 = other.to_f32_vec();
                &wg_f32
            }
        };
        let mut g = vec![0f32; m * f];
        // SAFETY: every pointer/stride pair describes a live, correctly sized buffer:
        // dst [m, f] row-major, lhs x [m, d] row-major, rhs wgᵀ viewed as [d, f] with
        // element (k, j) at w[j·d + k].
        unsafe {
            gemm::gemm(
                m,
                f,
                d,
                g.as_mut_ptr(),
                1,
                f as isize,
                false,
                x.as_ptr(),
                1,
                d as isize,
                w.as_ptr(),
                d as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            );
        }
        g
    }
}

/// Weight-streaming GEMV for a handful of tokens: pairs of weight rows against
/// groups of four tokens (register-blocked), the leftovers one dot at a time.
fn gate_gemv(x: &[f32], m: usize, d: usize, wg: Rows<'_>, f: usize) -> Vec<f32> {
    const NEURONS_PER_TASK: usize = 64;
    let token = |i: usize| &x[i * d..(i + 1) * d];
    // Neuron-major result [f, m]: each task owns a contiguous run of neurons.
    let mut gt = vec![0f32; f * m];
    gt.par_chunks_mut(NEURONS_PER_TASK * m)
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(s0, s1), (chunk, out)| {
                let j0 = chunk * NEURONS_PER_TASK;
                let n = out.len() / m;
                let mut jj = 0;
                while jj + 2 <= n {
                    let w0 = wg.f32_range((j0 + jj) * d, d, s0);
                    let w1 = wg.f32_range((j0 + jj + 1) * d, d, s1);
                    let mut i = 0;
                    while i + 4 <= m {
                        let r = dot_2x4(
                            [w0, w1],
                            [token(i), token(i + 1), token(i + 2), token(i + 3)],
                        );
                        for t in 0..4 {
                            out[jj * m + i + t] = r[2 * t];
                            out[(jj + 1) * m + i + t] = r[2 * t + 1];
                        }
                        i += 4;
                    }
                    for i in i..m {
                        out[jj * m + i] = dot(token(i), w0);
                        out[(jj + 1) * m + i] = dot(token(i), w1);
                    }
                    jj += 2;
                }
                if jj < n {
                    let w = wg.f32_range((j0 + jj) * d, d, s0);
                    for i in 0..m {
                        out[jj * m + i] = dot(token(i), w);
                    }
                }
            },
        );
    token_major(gt, m, f)
}

/// `[f, m]` neuron-major (how the few-token gates are computed, one task per run of
/// neurons) to `[m, f]` token-major (what packing reads).
pub(crate) fn token_major(gt: Vec<f32>, m: usize, f: usize) -> Vec<f32> {
    if m == 1 {
        return gt;
    }
    let mut g = vec![0f32; m * f];
    for j in 0..f {
        for i in 0..m {
            g[i * f + j] = gt[j * m + i];
        }
    }
    g
}
