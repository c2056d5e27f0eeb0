//! `causal_attention`: `softmax(q·kᵀ/√hd + causal mask)·v` without materialising the
//! scores, for the model around the sparse FFN.
//!
//! The plain-op attention (f32 scores `[b, heads, t, T]`, mask add, softmax) costs
//! far more than the MLP at prefill sizes on a GPU, so no FFN speed-up could show at
//! the model level. The CUDA kernel (`kernels/causal_attention.cu`) keeps the scores
//! in registers with an online softmax and runs both products on tensor cores.
//!
//! The backward recomputes the scores from q and k (nothing but the output is kept from
//! the forward) and runs as matrix products in the inputs' dtype, so training drops the
//! plain ops' f32 chain of some twenty passes over `[b, heads, t, T]` per layer
//! (mask add, max, exp, sum, division and each one's backward).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu::float::Rows;
use crate::error::{err, TwellError};

/// Head sizes the CUDA kernel is built for.
pub const CUDA_HEAD_DIMS: [usize; 1] = [64];

/// Keys up to which one query per (batch, head) (KV-cache decode) runs the CUDA kernel
/// that spreads the keys over a block: their scores sit in 32 KB of shared memory. Past
/// it, the prefill kernel takes it (one of a warp's 16 query rows busy).
pub const CUDA_DECODE_MAX_KEYS: usize = 8192;

/// The op behind [`causal_attention`]: inputs `(q, k, v)`, output `[b, t, heads, hd]`.
pub struct CausalAttention {
    scale: f32,
}

/// Keys or values `[b, kv_heads, T, hd]` with each head repeated for the query heads
/// that share it: `[b, heads, T, hd]`, contiguous.
fn repeat_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kv_heads, total, hd) = x.dims4()?;
    if kv_heads == heads {
        return x.contiguous();
    }
    x.unsqueeze(2)?
        .expand((b, kv_heads, heads / kv_heads, total, hd))?
        .reshape((b, heads, total, hd))
}

/// `(b, heads, t, kv_heads, T, hd)` of a call, checked.
fn dims(q: &Layout, k: &Layout, v: &Layout) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let rank4 = |what: &'static str, l: &Layout| match l.dims() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        d => err(TwellError::BadRank {
            what,
            expected: 4,
            got: d.to_vec(),
        }),
    };
    let (b, heads, t, hd) = rank4("q", q)?;
    let (bk, kv_heads, total, hdk) = rank4("k", k)?;
    if v.dims() != k.dims() {
        return err(TwellError::ShapeMismatch {
            what: "causal_attention",
            detail: format!("v is {:?}, k is {:?}", v.dims(), k.dims()),
        });
    }
    if bk != b || hdk != hd || kv_heads == 0 || heads % kv_heads != 0 || total < t || hd == 0 {
        return err(TwellError::ShapeMismatch {
            what: "causal_attention",
            detail: format!(
                "q [b, heads, t, hd] = {:?} and k [b, kv_heads, T, hd] = {:?}: want the same b and \
                 hd, heads a multiple of kv_heads and T >= t",
                q.dims(),
                k.dims()
            ),
        });
    }
    Ok((b, heads, t, kv_heads, total, hd))
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, heads, t, kv_heads, total, hd) = dims(ql, kl, vl)?;
        let q_rows = Rows::new("q", qs, ql)?;
        let dtype = q_rows.dtype();
        let (q, k, v) = (
            q_rows.to_f32_vec(),
            Rows::new("k", ks, kl)?.to_f32_vec(),
            Rows::new("v", vs, vl)?.to_f32_vec(),
        );
        let past = total - t;
        let group = heads / kv_heads;
        let mut out = vec![0f32; b * heads * t * hd];
        // The output is [b, t, heads, hd], as the CUDA kernel writes it.
        out.par_chunks_mut(hd).enumerate().for_each(|(row, o)| {
            let (bi, i, h) = (row / (t * heads), (row / heads) % t, row % heads);
            let kv = (bi * kv_heads + h / group) * total * hd;
            let q_row = (bi * heads + h) * t + i;
            let qr = &q[q_row * hd..(q_row + 1) * hd];
            let visible = past + i + 1;
            let scores: Vec<f32> = (0..visible)
                .map(|j| {
                    let kr = &k[kv + j * hd..kv + (j + 1) * hd];
                    self.scale * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (j, s) in scores.iter().enumerate() {
                let p = (s - max).exp();
                sum += p;
                let vr = &v[kv + j * hd..kv + (j + 1) * hd];
                for (acc, x) in o.iter_mut().zip(vr) {
                    *acc += p * x;
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
        });
        Ok((
            crate::cpu::float::storage_from_f32(out, dtype)?,
            Shape::from((b, t, heads, hd)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = dims(ql, kl, vl)?;
        let (b, heads, t, _, _, hd) = dims;
        let out = crate::cuda::causal_attention(qs, ql, ks, kl, vs, vl, dims, self.scale)?;
        Ok((out, Shape::from((b, t, heads, hd))))
    }

    /// `(dq, dk, dv)` of `o = softmax(q·kᵀ·scale + causal mask)·v`, with `o` and its
    /// gradient as the op wrote them (`[b, t, heads, hd]`). With `p` the probabilities,
    /// `dp = do·vᵀ` and `D = rowsum(do ⊙ o)`: `ds = p ⊙ (dp − D)`, `dq = ds·k·scale`,
    /// `dk = dsᵀ·q·scale`, `dv = pᵀ·do`; the key heads' gradients are summed over the
    /// query heads that share them. The scores are recomputed in the inputs' dtype (bf16
    /// on the GPU, as cuBLAS writes them), where the forward kept them in f32.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, heads, _, hd) = q.dims4()?;
        let (_, kv_heads, total, _) = k.dims4()?;
        let group = heads / kv_heads;
        let dtype = q.dtype();
        let (kx, vx) = (repeat_heads(k, heads)?, repeat_heads(v, heads)?);
        let q = q.contiguous()?;
        // `[b, heads, t, hd]`, as q.
        let grad_out = grad_out.transpose(1, 2)?.contiguous()?;
        let out = out.transpose(1, 2)?;
        // Unscaled scores and `dp`, then one row-wise op for `p` and `ds · scale`.
        let scores = q.matmul(&kx.t()?)?;
        let dp = grad_out.matmul(&vx.t()?)?;
        let row_dot =
            (grad_out.to_dtype(DType::F32)? * out.to_dtype(DType::F32)?)?.sum_keepdim(3)?;
        let (p, ds) = super::attention_softmax_grad(&scores, &dp, &row_dot, self.scale)?;
        let dq = ds.matmul(&kx)?;
        let dk = ds.t()?.matmul(&q)?;
        let dv = p.t()?.matmul(&grad_out)?;
        // Sum over each key head's query heads.
        let fold = |x: Tensor| -> Result<Tensor> {
            if group == 1 {
                return Ok(x);
            }
            x.reshape((b, kv_heads, group, total, hd))?
                .to_dtype(DType::F32)?
                .sum(2)?
                .to_dtype(dtype)
        };
        Ok((Some(dq), Some(fold(dk)?), Some(fold(dv)?)))
    }
}

/// Causal attention of `q [b, heads, t, hd]` over `k, v [b, kv_heads, T, hd]` with
/// `T >= t`: query `i` sits at position `T - t + i` (the keys before it are a KV cache)
/// and sees keys `0 ..= T - t + i`. Grouped-query attention when `kv_heads < heads`.
/// Returns `[b, heads, t, hd]` in q's dtype, as a transposed view of a contiguous
/// `[b, t, heads, hd]`: `.transpose(1, 2)` gives the rows the output projection reads
/// without a copy. Differentiable in q, k and v.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return err(TwellError::Invalid(format!(
            "causal_attention: q, k, v must share a dtype, got {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    let hd = q.dims().last().copied().unwrap_or(0);
    let op = CausalAttention {
        scale: 1.0 / (hd.max(1) as f32).sqrt(),
    };
    let (q, k, v) = (readable(q)?, readable(k)?, readable(v)?);
    // The op writes [b, t, heads, hd]; this view of it is [b, heads, t, hd].
    q.apply_op3(&k, &v, op)?.transpose(1, 2)
}

/// An input as the op reads it. The CUDA kernels take strided views as they are (a
/// model's `[b, t, heads, hd]` projections seen as `[b, heads, t, hd]`), as long as the
/// head dims are contiguous and every row starts 16-byte aligned, as their vector loads
/// need; anything else is copied. The CPU op reads contiguous rows.
fn readable(t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        if crate::cuda::attention_strides(t.layout()).is_some() {
            return Ok(t.clone());
        }
        let t = t.contiguous()?;
        if t.layout().start_offset() % 8 != 0 {
            return t.affine(1.0, 0.0);
        }
        return Ok(t);
    }
    t.contiguous()
}

/// Whether [`causal_attention`] runs its CUDA kernel for this query: a CUDA tensor in
/// bf16 with a head size in [`CUDA_HEAD_DIMS`].
pub fn fused_on_device(q: &Tensor) -> bool {
    q.device().is_cuda()
        && q.dtype() == DType::BF16
        && q.dims()
            .last()
            .is_some_and(|hd| CUDA_HEAD_DIMS.contains(hd))
}

/// The plain-op form of [`causal_attention`] in f32: materialised scores, an explicit
/// causal mask and softmax, the KV heads repeated for grouped-query attention. The
/// reference the fused op and its backward are tested and checked against.
pub fn causal_attention_reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, heads, t, hd) = q.dims4()?;
    let (_, kv_heads, total, _) = k.dims4()?;
    if kv_heads == 0 || heads % kv_heads != 0 || total < t {
        return err(TwellError::ShapeMismatch {
            what: "causal_attention_reference",
            detail: format!("q {:?}, k {:?}", q.dims(), k.dims()),
        });
    }
    let past = total - t;
    let f32 = |x: &Tensor| x.to_dtype(DType::F32);
    let (k, v) = (
        repeat_heads(&f32(k)?, heads)?,
        repeat_heads(&f32(v)?, heads)?,
    );
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, total), q.device())?;
    let scores =
        (q.to_dtype(DType::F32)?.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
    // The composite softmax, which candle can differentiate (its fused one cannot).
    candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?.matmul(&v)
}
