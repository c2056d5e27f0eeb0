//! The gate GEMM `g = x · Wgᵀ` on the CPU, in f32.
//!
//! Two regimes. With few tokens the product is a matrix-vector product bound by the
//! bytes of `Wg`; a general GEMM spends most of its time packing there, so we stream
//! each weight row once and dot it with every token. With many tokens the product is
//! compute-bound and the `gemm` crate (candle's own CPU matmul engine) does it.
//! Rows are processed in blocks so the dense f32 gate never exceeds a few MB.

use rayon::prelude::*;

use super::float::Rows;
use super::simd::dot;

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

/// Weight-streaming GEMV for a handful of tokens.
fn gate_gemv(x: &[f32], m: usize, d: usize, wg: Rows<'_>, f: usize) -> Vec<f32> {
    const NEURONS_PER_TASK: usize = 64;
    // Neuron-major result [f, m]: each task owns a contiguous run of neurons.
    let mut gt = vec![0f32; f * m];
    gt.par_chunks_mut(NEURONS_PER_TASK * m)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (chunk, out)| {
            let j0 = chunk * NEURONS_PER_TASK;
            for (jj, out_j) in out.chunks_mut(m).enumerate() {
                let w = wg.f32_range((j0 + jj) * d, d, scratch);
                for (i, o) in out_j.iter_mut().enumerate() {
                    *o = dot(&x[i * d..(i + 1) * d], w);
                }
            }
        });
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
