//! Gated TwELL-to-dense (T2D) on the CPU: the sparse up and down projections.
//!
//! For each token `i` and each active neuron `j` (gate `g_ij > 0`):
//! `u_ij = x_i · Wu_j`, `h_ij = g_ij · u_ij`, `out_i += h_ij · Wd_j`, `l1_i += |h_ij|`.
//! Work and bytes scale with the nonzeros, never with d_ff.
//!
//! The loops run neuron-major inside blocks of tokens: each active neuron's weight
//! row `[Wu_j | Wd_j]` (one contiguous row of `w_ud`) is read once per block and used
//! for every token of the block that activates it. Threads own disjoint neuron
//! ranges, balanced by pair count, and accumulate token rows into private partial
//! buffers that are summed at the end of the block. Weight gradients need no
//! reduction at all: a neuron's gradient row belongs to one thread.

use std::ops::Range;

use rayon::prelude::*;

use super::simd::{add_assign, axpy, dot};
use crate::format::TwellPattern;
use crate::output::mlp_result_len;
use fused_ops::host::{Float, Rows};

/// Tokens per block: large enough that hot neurons are reused, small enough that
/// the per-thread partial outputs stay in cache.
pub const TOKEN_BLOCK: usize = 256;

/// The active `(token, value position)` pairs of a token block, grouped by neuron.
struct BlockPairs {
    rows: Range<usize>,
    /// `[f + 1]`: offsets of each neuron's pairs.
    ptr: Vec<u32>,
    /// `(token - rows.start, position in the value array)`.
    pairs: Vec<(u32, u32)>,
}

fn block_pairs<T: Float>(pattern: &TwellPattern, values: &[T], rows: Range<usize>) -> BlockPairs {
    let f = pattern.cols();
    let mut per_row: Vec<Vec<(u32, u32)>> = Vec::with_capacity(rows.len());
    let mut counts = vec![0u32; f + 1];
    for r in rows.clone() {
        let mut list = Vec::new();
        pattern.for_each_in_row(r, values, |e| {
            counts[e.col + 1] += 1;
            list.push((e.col as u32, e.pos as u32));
        });
        per_row.push(list);
    }
    for j in 0..f {
        counts[j + 1] += counts[j];
    }
    let mut fill = counts.clone();
    let mut pairs = vec![(0u32, 0u32); counts[f] as usize];
    for (local, list) in per_row.into_iter().enumerate() {
        for (col, pos) in list {
            let slot = &mut fill[col as usize];
            pairs[*slot as usize] = (local as u32, pos);
            *slot += 1;
        }
    }
    BlockPairs {
        rows,
        ptr: counts,
        pairs,
    }
}

/// Cuts `[0, f)` into at most `parts` contiguous neuron ranges with about equal pair
/// counts, so a few hot neurons do not leave the other threads idle.
fn balanced_ranges(ptr: &[u32], parts: usize) -> Vec<Range<usize>> {
    let f = ptr.len() - 1;
    let total = ptr[f] as usize;
    let mut ranges = Vec::with_capacity(parts);
    let mut start = 0;
    for p in 1..=parts {
        let target = (total * p).div_ceil(parts) as u32;
        let mut end = start;
        while end < f && (ptr[end] < target || p == parts) {
            end += 1;
        }
        if end > start {
            ranges.push(start..end);
            start = end;
        }
    }
    if start < f {
        match ranges.last_mut() {
            Some(last) => last.end = f,
            None => ranges.push(0..f),
        }
    }
    ranges
}

/// Splits a neuron-major `[f, width]` buffer into the rows of each range.
fn split_rows<'a>(
    mut buf: &'a mut [f32],
    ranges: &[Range<usize>],
    width: usize,
) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut at = 0;
    for r in ranges {
        let (_, rest) = buf.split_at_mut((r.start - at) * width);
        let (mine, rest) = rest.split_at_mut(r.len() * width);
        out.push(mine);
        buf = rest;
        at = r.end;
    }
    out
}

fn parts() -> usize {
    2 * rayon::current_num_threads()
}

/// The token rows of `x` for a block, as f32 (borrowed when x is f32).
fn x_block<'a>(
    x: &'a Rows<'a>,
    rows: &Range<usize>,
    d: usize,
    scratch: &'a mut Vec<f32>,
) -> &'a [f32] {
    x.f32_range(rows.start * d, rows.len() * d, scratch)
}

/// Forward: returns `[mlp_result_len(M, d)]` f32: the `[M, d]` rows `out_i`, then each
/// token's `l1_i = Σ_j |h_ij|`.
pub fn forward<T: Float>(
    pattern: &TwellPattern,
    g: &[T],
    x: Rows<'_>,
    w_ud: Rows<'_>,
    d: usize,
) -> Vec<f32> {
    let m = pattern.rows();
    let mut out = vec![0f32; mlp_result_len(m, d)];
    let mut xs = Vec::new();
    for start in (0..m).step_by(TOKEN_BLOCK) {
        let rows = start..(start + TOKEN_BLOCK).min(m);
        let blk = block_pairs(pattern, g, rows.clone());
        let xb = x_block(&x, &rows, d, &mut xs);
        let ranges = balanced_ranges(&blk.ptr, parts());
        let partials: Vec<Vec<f32>> = ranges
            .par_iter()
            .map_init(Vec::new, |scratch, range| {
                // This block's rows, then its L1 terms (the result's layout, local).
                let mut part = vec![0f32; mlp_result_len(rows.len(), d)];
                for j in range.clone() {
                    let (lo, hi) = (blk.ptr[j] as usize, blk.ptr[j + 1] as usize);
                    if lo == hi {
                        continue;
                    }
                    let w = w_ud.f32_range(j * 2 * d, 2 * d, scratch);
                    let (wu, wd) = w.split_at(d);
                    let (part_rows, part_l1) = part.split_at_mut(rows.len() * d);
                    for &(i, pos) in &blk.pairs[lo..hi] {
                        let i = i as usize;
                        let h = g[pos as usize].to_f32() * dot(&xb[i * d..(i + 1) * d], wu);
                        axpy(h, wd, &mut part_rows[i * d..(i + 1) * d]);
                        part_l1[i] += h.abs();
                    }
                }
                part
            })
            .collect();
        let (out_rows, out_l1) = out.split_at_mut(m * d);
        let n = blk.rows.len();
        for p in &partials {
            let (p_rows, p_l1) = p.split_at(n * d);
            add_assign(&mut out_rows[blk.rows.start * d..blk.rows.end * d], p_rows);
            add_assign(&mut out_l1[blk.rows.clone()], p_l1);
        }
    }
    out
}

/// What a backward sweep computes besides `dx` and `dw_ud`.
pub enum GateGrad<'a> {
    /// The gate values are a leaf of this op: return `∂L/∂g` per value position.
    Values,
    /// The gate was computed from `wg` inside the op: fold `∂L/∂g` into `dx` and `dwg`.
    Weights(Rows<'a>),
}

/// Gradients of the gated T2D (and, with `GateGrad::Weights`, of the gate GEMM).
pub struct T2dGrads {
    /// `[M, d]`.
    pub dx: Vec<f32>,
    /// `[f, 2d]`: rows `[dWu_j | dWd_j]`.
    pub dw_ud: Vec<f32>,
    /// `[values_len]` for `GateGrad::Values`, `[f, d]` for `GateGrad::Weights`.
    pub dgate: Vec<f32>,
}

/// One thread's share of a block's backward: its partial `dx` rows and the
/// `(value position, ∂L/∂g)` pairs it found.
type ChunkGrads = (Vec<f32>, Vec<(u32, f32)>);

/// Backward of `forward`. `dout` is laid out as `forward`'s result: the `[M, d]` output
/// gradient, then the gradient of each token's L1 term.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Float>(
    pattern: &TwellPattern,
    g: &[T],
    x: Rows<'_>,
    w_ud: Rows<'_>,
    gate: GateGrad<'_>,
    dout: &[f32],
    d: usize,
) -> T2dGrads {
    let (m, f) = (pattern.rows(), pattern.cols());
    let (dout_rows, dout_l1) = dout.split_at(m * d);
    let mut dx = vec![0f32; m * d];
    let mut dw_ud = vec![0f32; f * 2 * d];
    let fused = matches!(gate, GateGrad::Weights(_));
    let mut dgate = if fused {
        vec![0f32; f * d]
    } else {
        vec![0f32; g.len()]
    };
    let mut xs = Vec::new();
    for start in (0..m).step_by(TOKEN_BLOCK) {
        let rows = start..(start + TOKEN_BLOCK).min(m);
        let blk = block_pairs(pattern, g, rows.clone());
        let xb = x_block(&x, &rows, d, &mut xs);
        let db = &dout_rows[rows.start * d..rows.end * d];
        let dl1 = &dout_l1[rows.clone()];
        let ranges = balanced_ranges(&blk.ptr, parts());
        let dw_parts = split_rows(&mut dw_ud, &ranges, 2 * d);
        let dwg_parts: Vec<Option<&mut [f32]>> = if fused {
            split_rows(&mut dgate, &ranges, d)
                .into_iter()
                .map(Some)
                .collect()
        } else {
            ranges.iter().map(|_| None).collect()
        };
        let results: Vec<ChunkGrads> = ranges
            .par_iter()
            .zip(dw_parts)
            .zip(dwg_parts)
            .map_init(
                || (Vec::new(), Vec::new()),
                |(scratch, scratch_g), ((range, dw), mut dwg)| {
                    let mut dx_part = vec![0f32; rows.len() * d];
                    let mut dvalues = Vec::new();
                    for j in range.clone() {
                        let (lo, hi) = (blk.ptr[j] as usize, blk.ptr[j + 1] as usize);
                        if lo == hi {
                            continue;
                        }
                        let w = w_ud.f32_range(j * 2 * d, 2 * d, scratch);
                        let (wu, wd) = w.split_at(d);
                        let wg = match &gate {
                            GateGrad::Weights(wg) => Some(wg.f32_range(j * d, d, scratch_g)),
                            GateGrad::Values => None,
                        };
                        let local = j - range.start;
                        let (dwu, dwd) = dw[local * 2 * d..(local + 1) * 2 * d].split_at_mut(d);
                        for &(i, pos) in &blk.pairs[lo..hi] {
                            let i = i as usize;
                            let xi = &xb[i * d..(i + 1) * d];
                            let di = &db[i * d..(i + 1) * d];
                            let gv = g[pos as usize].to_f32();
                            let u = dot(xi, wu);
                            let h = gv * u;
                            let dh = dot(di, wd) + dl1[i] * sign(h);
                            axpy(h, di, dwd);
                            let (du, dg) = (dh * gv, dh * u);
                            axpy(du, xi, dwu);
                            let dxi = &mut dx_part[i * d..(i + 1) * d];
                            axpy(du, wu, dxi);
                            match (wg, dwg.as_deref_mut()) {
                                (Some(wg), Some(dwg)) => {
                                    axpy(dg, wg, dxi);
                                    axpy(dg, xi, &mut dwg[local * d..(local + 1) * d]);
                                }
                                _ => dvalues.push((pos, dg)),
                            }
                        }
                    }
                    (dx_part, dvalues)
                },
            )
            .collect();
        let dst = &mut dx[rows.start * d..rows.end * d];
        for (part, dvalues) in results {
            add_assign(dst, &part);
            for (pos, v) in dvalues {
                dgate[pos as usize] = v;
            }
        }
    }
    T2dGrads { dx, dw_ud, dgate }
}

/// Backward of the gate GEMM + ReLU + pack alone: given `∂L/∂g` at each stored value,
/// `dx = Σ_j dg_ij Wg_j` and `dWg_j = Σ_i dg_ij x_i`, over the active pairs only.
pub fn gate_backward<T: Float>(
    pattern: &TwellPattern,
    g: &[T],
    dvalues: &[f32],
    x: Rows<'_>,
    wg: Rows<'_>,
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (m, f) = (pattern.rows(), pattern.cols());
    let mut dx = vec![0f32; m * d];
    let mut dwg = vec![0f32; f * d];
    let mut xs = Vec::new();
    for start in (0..m).step_by(TOKEN_BLOCK) {
        let rows = start..(start + TOKEN_BLOCK).min(m);
        let blk = block_pairs(pattern, g, rows.clone());
        let xb = x_block(&x, &rows, d, &mut xs);
        let ranges = balanced_ranges(&blk.ptr, parts());
        let dwg_parts = split_rows(&mut dwg, &ranges, d);
        let partials: Vec<Vec<f32>> = ranges
            .par_iter()
            .zip(dwg_parts)
            .map_init(Vec::new, |scratch, (range, dw)| {
                let mut dx_part = vec![0f32; rows.len() * d];
                for j in range.clone() {
                    let (lo, hi) = (blk.ptr[j] as usize, blk.ptr[j + 1] as usize);
                    if lo == hi {
                        continue;
                    }
                    let wg_j = wg.f32_range(j * d, d, scratch);
                    let local = j - range.start;
                    let dwg_j = &mut dw[local * d..(local + 1) * d];
                    for &(i, pos) in &blk.pairs[lo..hi] {
                        let i = i as usize;
                        let dg = dvalues[pos as usize];
                        axpy(dg, wg_j, &mut dx_part[i * d..(i + 1) * d]);
                        axpy(dg, &xb[i * d..(i + 1) * d], dwg_j);
                    }
                }
                dx_part
            })
            .collect();
        let dst = &mut dx[rows.start * d..rows.end * d];
        for p in &partials {
            add_assign(dst, p);
        }
    }
    (dx, dwg)
}

#[inline]
fn sign(v: f32) -> f32 {
    if v > 0.0 {
        1.0
    } else if v < 0.0 {
        -1.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_ranges_cover_every_neuron_once() {
        let ptr: Vec<u32> = vec![0, 0, 5, 5, 6, 30, 30, 31];
        for parts in 1..6 {
            let r = balanced_ranges(&ptr, parts);
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, 7);
            for w in r.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(r.len() <= parts);
        }
    }
}
