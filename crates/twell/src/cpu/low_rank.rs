//! Quantized rows with low-rank adapters kept beside them, unmerged:
//! `y = m ⊙ (W·x + B·(A·x))` per output row.
//!
//! Merging a LoRA adapter into a GGUF's 4-bit weights changes every weight, so the
//! merged matrix has to be quantized again: to 4 bits it loses quality, to 8 bits it is
//! twice the bytes a decode step reads. Kept apart, `W` stays the file's own blocks
//! (exact) and the factors add `r·(in + out)` weights per matrix (rank 16 on a 576-wide
//! projection: about 5% of it).

use std::ops::Range;

use super::quant::{QuantFormat, QuantRows};
use crate::error::TwellError;
use candle_core::Result;

fn bad(detail: String) -> candle_core::Error {
    candle_core::Error::wrap(TwellError::Invalid(detail))
}

/// The factors of one adapted matrix, row-major f32: `y += scale · b · (a · x)`, then
/// `y *= row_scale`.
#[derive(Clone, Copy, Debug)]
pub struct LowRankFactors<'a> {
    /// `[rank, in]`.
    pub a: &'a [f32],
    /// `[out, rank]`.
    pub b: &'a [f32],
    pub rank: usize,
    /// LoRA's `alpha / r`.
    pub scale: f32,
    /// `[out]`, applied after the sum (1 where absent).
    pub row_scale: Option<&'a [f32]>,
}

/// The output rows one adapted matrix covers, within a stack of matrices.
#[derive(Clone, Debug)]
struct Segment {
    rows: Range<usize>,
    /// Where its rank's rows start in the stacked `a`.
    a_start: usize,
    rank: usize,
}

/// Several matrices' factors stacked to match matrices stacked by rows (as q, k and v
/// are fused into one): one `A·x` for all of them, then each row's own `b`.
#[derive(Clone, Debug)]
pub struct LowRankStack {
    /// Every matrix's `a`, stacked: `[Σ rank, in]`, int8 per block as the token is.
    a: QuantRows,
    /// Per output row, its segment's `rank` values of `scale · b` (none for rows of a
    /// matrix with no adapter).
    b: Vec<f32>,
    /// Where each output row's values start in `b`.
    b_start: Vec<usize>,
    segments: Vec<Segment>,
    /// `[out]`, or empty where every scale is 1.
    row_scale: Vec<f32>,
    rows: usize,
}

impl LowRankStack {
    /// From the matrices of a stack, top to bottom: each its row count and its
    /// factors, if it has any. `None` if none has.
    pub fn new(cols: usize, parts: &[(usize, Option<LowRankFactors>)]) -> Result<Option<Self>> {
        if parts.iter().all(|(_, f)| f.is_none()) {
            return Ok(None);
        }
        let rows: usize = parts.iter().map(|(r, _)| r).sum();
        let mut a = Vec::new();
        let mut b = Vec::new();
        let mut b_start = Vec::with_capacity(rows);
        let mut segments = Vec::new();
        let mut row_scale = Vec::new();
        let any_row_scale = parts
            .iter()
            .any(|(_, f)| f.is_some_and(|f| f.row_scale.is_some()));
        let mut row = 0;
        for (i, &(out, factors)) in parts.iter().enumerate() {
            let Some(f) = factors else {
                b_start.extend(std::iter::repeat_n(b.len(), out));
                if any_row_scale {
                    row_scale.extend(std::iter::repeat_n(1f32, out));
                }
                row += out;
                continue;
            };
            let wrong = |what: &str, len: usize, want: usize| {
                bad(format!(
                    "low-rank factors of matrix {i}: {what} has {len} values, expected {want}"
                ))
            };
            if f.a.len() != f.rank * cols {
                return Err(wrong("a", f.a.len(), f.rank * cols));
            }
            if f.b.len() != out * f.rank {
                return Err(wrong("b", f.b.len(), out * f.rank));
            }
            if let Some(s) = f.row_scale {
                if s.len() != out {
                    return Err(wrong("row_scale", s.len(), out));
                }
            }
            segments.push(Segment {
                rows: row..row + out,
                a_start: a.len() / cols,
                rank: f.rank,
            });
            a.extend_from_slice(f.a);
            for r in 0..out {
                b_start.push(b.len());
                b.extend(
                    f.b[r * f.rank..(r + 1) * f.rank]
                        .iter()
                        .map(|v| v * f.scale),
                );
            }
            if any_row_scale {
                match f.row_scale {
                    Some(s) => row_scale.extend_from_slice(s),
                    None => row_scale.extend(std::iter::repeat_n(1f32, out)),
                }
            }
            row += out;
        }
        let total_rank = a.len() / cols;
        Ok(Some(Self {
            a: QuantRows::quantize(&a, total_rank, cols, QuantFormat::Q8)?,
            b,
            b_start,
            segments,
            row_scale,
            rows,
        }))
    }

    /// Bytes held, for reports.
    pub fn bytes(&self) -> usize {
        self.a.bytes() + 4 * (self.b.len() + self.row_scale.len())
    }

    /// Adds the factors' term to `y = W·x` (`[m, rows]`) for tokens `x` (`[m, in]`) and
    /// applies the row scale.
    fn add_to(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        let ax = self.a.apply(x)?;
        let total_rank = self.a.rows();
        for (token, y) in ax
            .chunks_exact(total_rank)
            .zip(y.chunks_exact_mut(self.rows))
        {
            for s in &self.segments {
                let t = &token[s.a_start..s.a_start + s.rank];
                for r in s.rows.clone() {
                    let b = &self.b[self.b_start[r]..self.b_start[r] + s.rank];
                    y[r] += b.iter().zip(t).map(|(b, t)| b * t).sum::<f32>();
                }
            }
            if !self.row_scale.is_empty() {
                y.iter_mut().zip(&self.row_scale).for_each(|(y, s)| *y *= s);
            }
        }
        Ok(())
    }
}

/// Quantized rows `W`, with a stack of low-rank factors applied after them if given.
#[derive(Clone, Debug)]
pub struct AdaptedRows {
    base: QuantRows,
    adapter: Option<LowRankStack>,
}

impl AdaptedRows {
    pub fn new(base: QuantRows, adapter: Option<LowRankStack>) -> Result<Self> {
        if let Some(a) = &adapter {
            if a.rows != base.rows() || a.a.cols() != base.cols() {
                return Err(bad(format!(
                    "low-rank factors for [{}, {}] rows do not match the rows [{}, {}]",
                    a.rows,
                    a.a.cols(),
                    base.rows(),
                    base.cols()
                )));
            }
        }
        Ok(Self { base, adapter })
    }

    pub fn rows(&self) -> usize {
        self.base.rows()
    }

    pub fn cols(&self) -> usize {
        self.base.cols()
    }

    /// Bytes a pass reads: the rows and the factors.
    pub fn bytes(&self) -> usize {
        self.base.bytes() + self.adapter.as_ref().map_or(0, LowRankStack::bytes)
    }

    /// `x · W'ᵀ` for row-major f32 tokens `x` (`[m, cols]`): `[m, rows]`.
    pub fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        let mut y = self.base.apply(x)?;
        if let Some(a) = &self.adapter {
            a.add_to(x, &mut y)?;
        }
        Ok(y)
    }

    /// [`AdaptedRows::apply`] on an f32 CPU tensor `[.., cols]`.
    pub fn forward(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let flat = super::quant::f32_rows(x, self.cols(), "AdaptedRows::forward")?;
        let out = self.apply(&flat)?;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("checked rank") = self.rows();
        candle_core::Tensor::from_vec(out, dims, x.device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// The merged matrix `m ⊙ (W + s·B·A)` in f32, row-major `[out, in]`.
    fn merged(w: &[f32], f: &LowRankFactors, out: usize, cols: usize) -> Vec<f32> {
        let mut m = w.to_vec();
        for r in 0..out {
            for c in 0..cols {
                let d: f32 = (0..f.rank)
                    .map(|k| f.b[r * f.rank + k] * f.a[k * cols + c])
                    .sum();
                m[r * cols + c] += f.scale * d;
                m[r * cols + c] *= f.row_scale.map_or(1.0, |s| s[r]);
            }
        }
        m
    }

    #[test]
    fn unmerged_factors_match_the_merged_matrix() -> Result<()> {
        let cols = 64;
        let (q_rows, k_rows) = (48, 16);
        let rank = 4;
        let wq = values(q_rows * cols, 1);
        let wk = values(k_rows * cols, 2);
        let (aq, bq, sq) = (
            values(rank * cols, 3),
            values(q_rows * rank, 4),
            values(q_rows, 5),
        );
        let fq = LowRankFactors {
            a: &aq,
            b: &bq,
            rank,
            scale: 0.5,
            row_scale: Some(&sq),
        };
        // q adapted, k not: the stack's k rows are W's alone.
        let mut w = wq.clone();
        w.extend_from_slice(&wk);
        let base = QuantRows::quantize(&w, q_rows + k_rows, cols, QuantFormat::Q8)?;
        let stack = LowRankStack::new(cols, &[(q_rows, Some(fq)), (k_rows, None)])?;
        let rows = AdaptedRows::new(base.clone(), stack)?;
        let mut reference = merged(&base.dequantize()[..q_rows * cols], &fq, q_rows, cols);
        reference.extend_from_slice(&base.dequantize()[q_rows * cols..]);
        for m in [1, 3, 40] {
            let x = values(m * cols, 6 + m as u32);
            let got = rows.apply(&x)?;
            for t in 0..m {
                for r in 0..q_rows + k_rows {
                    let want: f32 = (0..cols)
                        .map(|c| reference[r * cols + c] * x[t * cols + c])
                        .sum();
                    let g = got[t * (q_rows + k_rows) + r];
                    assert!(
                        (g - want).abs() < 0.05 * (1.0 + want.abs()),
                        "m {m} token {t} row {r}: {g} vs {want}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn mismatched_factors_are_refused() {
        let a = values(4 * 32, 1);
        let b = values(8 * 4, 2);
        let f = LowRankFactors {
            a: &a,
            b: &b,
            rank: 4,
            scale: 1.0,
            row_scale: None,
        };
        assert!(LowRankStack::new(32, &[(9, Some(f))]).is_err());
        assert!(LowRankStack::new(64, &[(8, Some(f))]).is_err());
        let stack = LowRankStack::new(32, &[(8, Some(f))]).unwrap();
        let base = QuantRows::quantize(&values(16 * 32, 3), 16, 32, QuantFormat::Q8).unwrap();
        assert!(AdaptedRows::new(base, stack).is_err());
        assert!(LowRankStack::new(32, &[(8, None)]).unwrap().is_none());
    }
}
