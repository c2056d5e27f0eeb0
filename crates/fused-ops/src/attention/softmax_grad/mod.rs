//! `attention_softmax_grad`: the row-wise middle of [`super::causal_attention`]'s
//! backward, as one op.
//!
//! With the raw scores `s = q·kᵀ` and `dp = dO·vᵀ` recomputed as matrix products, each
//! row needs the causal softmax `p` again and the score gradient `ds = p ⊙ (dp − D)`
//! (`D = rowsum(dO ⊙ O)`). As candle ops that is a mask add, a softmax, casts to f32 and
//! three elementwise passes over `[b, heads, t, T]`, each a full sweep of the largest
//! tensors of a training step. The CUDA kernel (`kernels/src/attention_softmax_grad.cu`)
//! reads `s` twice and `dp` once and writes both results.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::Rows;

/// The op behind [`attention_softmax_grad`]: inputs `(s [.., t, T], dp like s, d [.., t,
/// 1] f32)`, output `[2, .., t, T]` in s's dtype: `p`, then `ds · scale`. It runs on the
/// CPU too, so tests can hold it against candle's ops.
pub struct AttentionSoftmaxGrad {
    scale: f32,
}

/// `(rows, t, T)` of a call, checked.
fn dims(s: &Layout, dp: &Layout, d: &Layout) -> Result<(usize, usize, usize)> {
    let shape = s.dims();
    let n = shape.len();
    if n < 2 || dp.dims() != shape || d.dims()[..] != [&shape[..n - 1], &[1]].concat()[..] {
        return err(OpError::ShapeMismatch {
            what: "attention_softmax_grad",
            detail: format!(
                "s {:?}, dp {:?}, d {:?}: want dp like s [.., t, T] and d [.., t, 1]",
                shape,
                dp.dims(),
                d.dims()
            ),
        });
    }
    let (t, total) = (shape[n - 2], shape[n - 1]);
    if t == 0 || total < t {
        return err(OpError::ShapeMismatch {
            what: "attention_softmax_grad",
            detail: format!("s {shape:?}: want T >= t >= 1"),
        });
    }
    Ok((s.shape().elem_count() / total, t, total))
}

impl CustomOp3 for AttentionSoftmaxGrad {
    fn name(&self) -> &'static str {
        "attention-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        dps: &CpuStorage,
        dpl: &Layout,
        ds: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, t, total) = dims(sl, dpl, dl)?;
        let s_rows = Rows::new("s", ss, sl)?;
        let dtype = s_rows.dtype();
        let (s, dp, d) = (
            s_rows.to_f32_vec(),
            Rows::new("dp", dps, dpl)?.to_f32_vec(),
            Rows::new("d", ds, dl)?.to_f32_vec(),
        );
        let mut out = vec![0f32; 2 * rows * total];
        let (p_out, g_out) = out.split_at_mut(rows * total);
        p_out
            .par_chunks_mut(total)
            .zip(g_out.par_chunks_mut(total))
            .enumerate()
            .for_each(|(row, (p, g))| {
                let visible = total - t + row % t + 1;
                let sr = &s[row * total..][..visible];
                let dr = &dp[row * total..][..visible];
                let max = sr
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &x| m.max(x * self.scale));
                let sum: f32 = sr.iter().map(|&x| (x * self.scale - max).exp()).sum();
                for j in 0..visible {
                    p[j] = (sr[j] * self.scale - max).exp() / sum;
                    g[j] = p[j] * (dr[j] - d[row]) * self.scale;
                }
            });
        let mut shape = vec![2];
        shape.extend_from_slice(sl.dims());
        Ok((
            crate::host::storage_from_f32(out, dtype)?,
            Shape::from(shape),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        dps: &candle_core::CudaStorage,
        dpl: &Layout,
        ds: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = dims(sl, dpl, dl)?;
        let out = cuda::attention_softmax_grad(ss, sl, dps, dpl, ds, dl, dims, self.scale)?;
        let mut shape = vec![2];
        shape.extend_from_slice(sl.dims());
        Ok((out, Shape::from(shape)))
    }
}

/// `(p, ds · scale)` of causal attention rows: `s` the raw scores `q·kᵀ [.., t, T]`
/// (query `i` sits at position `T − t + i` and sees keys up to it), `dp = dO·vᵀ` like
/// `s`, and `d = rowsum(dO ⊙ O)` as `[.., t, 1]` f32. Masked entries are 0 in both.
/// On CUDA it takes bf16; on the CPU any float dtype.
pub fn attention_softmax_grad(
    s: &Tensor,
    dp: &Tensor,
    d: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    if s.dtype() != dp.dtype() || d.dtype() != DType::F32 {
        return err(OpError::Invalid(format!(
            "attention_softmax_grad: s and dp must share a dtype and d be f32, got {:?}, {:?}, \
             {:?}",
            s.dtype(),
            dp.dtype(),
            d.dtype()
        )));
    }
    let op = AttentionSoftmaxGrad { scale };
    let both = s
        .contiguous()?
        .apply_op3_no_bwd(&dp.contiguous()?, &d.contiguous()?, &op)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// The op behind [`attention_row_dot`]: inputs `(grad, out)` as token rows `[b·t,
/// heads·hd]`, output `[b, heads, t, 1]` f32.
struct AttentionRowDot {
    batch: usize,
    head_dim: usize,
}

impl AttentionRowDot {
    /// `(b, t, heads, hd)` of a call, checked.
    fn dims(&self, g: &Layout, o: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (b, hd) = (self.batch, self.head_dim);
        match *g.dims() {
            [n, width]
                if o.dims() == g.dims() && b > 0 && hd > 0 && n % b == 0 && width % hd == 0 =>
            {
                Ok((b, n / b, width / hd, hd))
            }
            _ => err(OpError::ShapeMismatch {
                what: "attention_row_dot",
                detail: format!(
                    "grad {:?}, out {:?}: want equal [batch · t, heads · head_dim] rows with \
                     batch {b} and head_dim {hd}",
                    g.dims(),
                    o.dims()
                ),
            }),
        }
    }
}

impl candle_core::CustomOp2 for AttentionRowDot {
    fn name(&self) -> &'static str {
        "attention-row-dot"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        os: &CpuStorage,
        ol: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, t, heads, hd) = self.dims(gl, ol)?;
        let (g, o) = (
            Rows::new("grad", gs, gl)?.to_f32_vec(),
            Rows::new("out", os, ol)?.to_f32_vec(),
        );
        let d: Vec<f32> = (0..b * heads * t)
            .into_par_iter()
            .map(|r| {
                let (bi, h, i) = (r / (heads * t), (r / t) % heads, r % t);
                let at = ((bi * t + i) * heads + h) * hd;
                g[at..at + hd]
                    .iter()
                    .zip(&o[at..at + hd])
                    .map(|(x, y)| x * y)
                    .sum()
            })
            .collect();
        Ok((CpuStorage::F32(d), Shape::from((b, heads, t, 1))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        os: &candle_core::CudaStorage,
        ol: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, t, heads, hd) = self.dims(gl, ol)?;
        if !hd.is_multiple_of(8) {
            return err(OpError::Invalid(format!(
                "attention_row_dot on CUDA takes head sizes that are multiples of 8, got {hd}"
            )));
        }
        let d = cuda::attention_row_dot(gs, gl, os, ol, (t, heads, hd))?;
        Ok((d, Shape::from((b, heads, t, 1))))
    }
}

/// `D = rowsum(dO ⊙ O)` of causal attention per (batch, head, query), as `[b, heads, t,
/// 1]` f32 (the `d` of [`attention_softmax_grad`]), from the output and its gradient as
/// token rows `[b·t, heads·hd]`. One read of each on CUDA (bf16); the CPU takes any
/// float dtype. No gradient.
pub fn attention_row_dot(
    grad: &Tensor,
    out: &Tensor,
    batch: usize,
    head_dim: usize,
) -> Result<Tensor> {
    if grad.dtype() != out.dtype() {
        return err(OpError::Invalid(format!(
            "attention_row_dot: grad and out must share a dtype, got {:?} and {:?}",
            grad.dtype(),
            out.dtype()
        )));
    }
    grad.contiguous()?
        .apply_op2_no_bwd(&out.contiguous()?, &AttentionRowDot { batch, head_dim })
}
