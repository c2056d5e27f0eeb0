//! `causal_attention`: `softmax(q·kᵀ/√hd + causal mask)·v` without materialising the
//! scores, for the model around the sparse FFN.
//!
//! The plain-op attention (f32 scores `[b, heads, t, T]`, mask add, softmax) costs
//! far more than the MLP at prefill sizes on a GPU, so no FFN speed-up could show at
//! the model level. The CUDA kernel (`kernels/src/causal_attention.cu`) keeps the scores
//! in registers with an online softmax and runs both products on tensor cores.
//!
//! The backward recomputes the scores from q and k (nothing but the output is kept from
//! the forward) and runs as matrix products in the inputs' dtype, so training drops the
//! plain ops' f32 chain of some twenty passes over `[b, heads, t, T]` per layer
//! (mask add, max, exp, sum, division and each one's backward).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod slots;
pub mod softmax_grad;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod split;
#[cfg(feature = "cuda")]
mod step_scratch;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::Rows;

pub use slots::SlotAttention;

/// Head sizes the CUDA kernel is built for.
pub const CUDA_HEAD_DIMS: [usize; 1] = [64];

/// Keys up to which one query per (batch, head) (KV-cache decode) runs the CUDA kernel
/// that spreads the keys over a block: their scores sit in 32 KB of shared memory. Past
/// it, the prefill kernel takes it (one of a warp's 16 query rows busy).
pub const CUDA_DECODE_MAX_KEYS: usize = 8192;

/// The op behind [`causal_attention_rows`] (and [`causal_attention`]): inputs `q [b·t,
/// heads·hd]` and `k, v [b·T, kv_heads·hd]` as token rows (the projections' layout),
/// output `[b·t, heads·hd]`. Rows in and out, so a model's training graph has no
/// reshape or transpose nodes around the attention: candle's backward gives every node
/// a zeros tensor and an add over its size.
pub struct CausalAttention {
    scale: f32,
    batch: usize,
    head_dim: usize,
    /// q's RoPE angles (`cos_sin [t, hd]`) when q comes unturned and the CUDA prefill
    /// kernel turns it ([`causal_attention_rows_turning_q`]); inference only.
    q_angles: Option<Tensor>,
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

/// `(b, heads, t, kv_heads, T, hd)` of `[b, heads, t, hd]` and `[b, kv_heads, T, hd]`
/// shapes, checked.
fn dims(
    q: &[usize],
    k: &[usize],
    v: &[usize],
) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let rank4 = |what: &'static str, d: &[usize]| match *d {
        [a, b, c, e] => Ok((a, b, c, e)),
        _ => err(OpError::BadRank {
            what,
            expected: 4,
            got: d.to_vec(),
        }),
    };
    let (b, heads, t, hd) = rank4("q", q)?;
    let (bk, kv_heads, total, hdk) = rank4("k", k)?;
    if v != k {
        return err(OpError::ShapeMismatch {
            what: "causal_attention",
            detail: format!("v is {v:?}, k is {k:?}"),
        });
    }
    if bk != b || hdk != hd || kv_heads == 0 || heads % kv_heads != 0 || total < t || hd == 0 {
        return err(OpError::ShapeMismatch {
            what: "causal_attention",
            detail: format!(
                "q [b, heads, t, hd] = {q:?} and k [b, kv_heads, T, hd] = {k:?}: want the same b \
                 and hd, heads a multiple of kv_heads and T >= t"
            ),
        });
    }
    Ok((b, heads, t, kv_heads, total, hd))
}

impl CausalAttention {
    /// `[b, heads, t, hd]` of `[b·t, heads·hd]` rows, or of `[b, t, heads·hd]` (each
    /// sequence's rows, e.g. a KV cache's), checked.
    fn heads_shape(&self, what: &'static str, rows: &[usize]) -> Result<[usize; 4]> {
        let (b, hd) = (self.batch, self.head_dim);
        match *rows {
            [n, width] if b > 0 && hd > 0 && n % b == 0 && width % hd == 0 => {
                Ok([b, width / hd, n / b, hd])
            }
            [bb, n, width] if bb == b && b > 0 && hd > 0 && width % hd == 0 => {
                Ok([b, width / hd, n, hd])
            }
            _ => err(OpError::ShapeMismatch {
                what,
                detail: format!(
                    "want [batch · positions, heads · head_dim] or [batch, positions, heads · \
                     head_dim] rows with batch {b} and head_dim {hd}, got {rows:?}"
                ),
            }),
        }
    }

    /// `(b, heads, t, kv_heads, T, hd)` of a call.
    fn dims(
        &self,
        q: &Layout,
        k: &Layout,
        v: &Layout,
    ) -> Result<(usize, usize, usize, usize, usize, usize)> {
        dims(
            &self.heads_shape("causal_attention q", q.dims())?,
            &self.heads_shape("causal_attention k", k.dims())?,
            &self.heads_shape("causal_attention v", v.dims())?,
        )
    }

    /// The `[b, heads, positions, hd]` view of rows (`[b, positions, heads, hd]` in
    /// memory): contiguous, or strided as [`strided_rows`] accepts (a view of wider rows,
    /// or of a longer KV buffer).
    #[cfg(feature = "cuda")]
    fn heads_layout(&self, what: &'static str, l: &Layout) -> Result<Layout> {
        let [b, heads, n, hd] = self.heads_shape(what, l.dims())?;
        let (batch_stride, row_stride) = if l.is_contiguous() {
            (n * heads * hd, heads * hd)
        } else {
            match (strided_rows(l), l.stride()) {
                (true, &[rs, 1]) => (n * rs, rs),
                (true, &[bs, ts, 1]) => (bs, ts),
                _ => {
                    return err(OpError::Invalid(format!(
                        "{what} must be contiguous rows, or rows with a row stride (and a \
                         batch stride) that are multiples of 8"
                    )))
                }
            }
        };
        Ok(Layout::new(
            Shape::from((b, heads, n, hd)),
            vec![batch_stride, hd, row_stride, 1],
            l.start_offset(),
        ))
    }

    /// Rows `[b·n, heads·hd]` as `[b, heads, n, hd]` (a view).
    fn heads_view(&self, rows: &Tensor) -> Result<Tensor> {
        let [b, heads, n, hd] = self.heads_shape("causal_attention", rows.dims())?;
        rows.reshape((b, n, heads, hd))?.transpose(1, 2)
    }

    /// `[b, heads, n, hd]` back to contiguous rows `[b·n, heads·hd]`.
    fn rows_of(x: &Tensor) -> Result<Tensor> {
        let (b, heads, n, hd) = x.dims4()?;
        x.transpose(1, 2)?
            .contiguous()?
            .reshape((b * n, heads * hd))
    }
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
        if self.q_angles.is_some() {
            return err(OpError::Invalid(
                "causal_attention: queries turned inside the op run on CUDA only".into(),
            ));
        }
        let (b, heads, t, kv_heads, total, hd) = self.dims(ql, kl, vl)?;
        let q_rows = Rows::new("q", qs, ql)?;
        let dtype = q_rows.dtype();
        let q = q_rows.to_f32_vec();
        let width = kv_heads * hd;
        let (k, v) = (
            KvRows::new("k", ks, kl, b, total, width)?,
            KvRows::new("v", vs, vl, b, total, width)?,
        );
        let past = total - t;
        let group = heads / kv_heads;
        let mut out = vec![0f32; b * heads * t * hd];
        // Rows: query (bi, i, h) at ((bi·t + i)·heads + h)·hd, the key and value of head
        // kh at position j in row (bi, j) of k and v, and the output as the queries. A
        // task takes the `group` query heads that share one key head, so that each key
        // and value row is read once for all of them.
        let head_group = |task: usize| {
            let (bi, i, kh) = (
                task / (t * kv_heads),
                (task / kv_heads) % t,
                task % kv_heads,
            );
            let first_row = (bi * t + i) * heads + kh * group;
            HeadGroup {
                q: &q[first_row * hd..(first_row + group) * hd],
                k: &k,
                v: &v,
                batch: bi,
                head: kh * hd..(kh + 1) * hd,
                visible: past + i + 1,
                scale: self.scale,
            }
        };
        let tasks = b * t * kv_heads;
        let splits = key_splits(t, tasks, total);
        if splits == 1 {
            out.par_chunks_mut(group * hd)
                .enumerate()
                .for_each(|(task, o)| head_group(task).attend(o));
        } else {
            // A decode step has fewer tasks than threads (3 key heads on 2 threads left
            // one idle half the time): each task's keys go in `splits` ranges, merged
            // after by their maxima.
            let per = total.div_ceil(splits);
            let parts: Vec<Part> = (0..tasks * splits)
                .into_par_iter()
                .map(|u| {
                    let keys = (u % splits) * per..((u % splits + 1) * per).min(total);
                    let mut o = vec![0f32; group * hd];
                    let (max, sum) = head_group(u / splits).attend_range(keys, &mut o);
                    Part { o, max, sum }
                })
                .collect();
            for (o, parts) in out.chunks_exact_mut(group * hd).zip(parts.chunks(splits)) {
                merge_parts(parts, hd, o);
            }
        }
        Ok((
            crate::host::storage_from_f32(out, dtype)?,
            Shape::from(ql.dims()),
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
        let dims = self.dims(ql, kl, vl)?;
        let (q4, k4, v4) = (
            self.heads_layout("q", ql)?,
            self.heads_layout("k", kl)?,
            self.heads_layout("v", vl)?,
        );
        let out = match &self.q_angles {
            None => cuda::causal_attention(qs, &q4, ks, &k4, vs, &v4, dims, self.scale, None)?,
            Some(angles) => {
                let (storage, layout) = angles.storage_and_layout();
                let candle_core::Storage::Cuda(cs) = &*storage else {
                    return err(OpError::Invalid(
                        "causal_attention: q's angles must sit on the queries' CUDA device".into(),
                    ));
                };
                let angles = Some((cs, layout));
                cuda::causal_attention(qs, &q4, ks, &k4, vs, &v4, dims, self.scale, angles)?
            }
        };
        Ok((out, Shape::from(ql.dims())))
    }

    /// `(dq, dk, dv)` of `o = softmax(q·kᵀ·scale + causal mask)·v`. With `p` the
    /// probabilities, `dp = do·vᵀ` and `D = rowsum(do ⊙ o)`: `ds = p ⊙ (dp − D)`,
    /// `dq = ds·k·scale`, `dk = dsᵀ·q·scale`, `dv = pᵀ·do`; the key heads' gradients are
    /// summed over the query heads that share them. The scores are recomputed in the
    /// inputs' dtype (bf16 on the GPU, as cuBLAS writes them), where the forward kept
    /// them in f32. `D` comes from the rows in one pass ([`softmax_grad::attention_row_dot`]).
    /// Gradients come back as rows, like the inputs.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if self.q_angles.is_some() {
            return err(OpError::Invalid(
                "causal_attention: queries turned inside the op have no backward (inference)"
                    .into(),
            ));
        }
        // Gradients take their input's shape (`[b·T, width]` or `[b, T, width]`).
        let (k_dims, v_dims) = (k.dims().to_vec(), v.dims().to_vec());
        let (q, k, v) = (
            self.heads_view(q)?,
            self.heads_view(k)?,
            self.heads_view(v)?,
        );
        let (b, heads, _, hd) = q.dims4()?;
        let (_, kv_heads, total, _) = k.dims4()?;
        let group = heads / kv_heads;
        let dtype = q.dtype();
        let (kx, vx) = (repeat_heads(&k, heads)?, repeat_heads(&v, heads)?);
        let q = q.contiguous()?;
        let row_dot = softmax_grad::attention_row_dot(grad_out, out, self.batch, self.head_dim)?;
        // `[b, heads, t, hd]`, as q.
        let grad_out = self.heads_view(&grad_out.contiguous()?)?.contiguous()?;
        // Unscaled scores and `dp`, then one row-wise op for `p` and `ds · scale`.
        let scores = q.matmul(&kx.t()?)?;
        let dp = grad_out.matmul(&vx.t()?)?;
        let (p, ds) = softmax_grad::attention_softmax_grad(&scores, &dp, &row_dot, self.scale)?;
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
        Ok((
            Some(Self::rows_of(&dq)?),
            Some(Self::rows_of(&fold(dk)?)?.reshape(k_dims)?),
            Some(Self::rows_of(&fold(dv)?)?.reshape(v_dims)?),
        ))
    }
}

/// `Ok` when q, k and v share a dtype, else an error that names the three.
fn same_dtype(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return err(OpError::Invalid(format!(
            "causal_attention: q, k, v must share a dtype, got {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    Ok(())
}

/// The scores' scale, `1 / √hd`.
fn score_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim.max(1) as f32).sqrt()
}

/// Causal attention over token rows: `q [b·t, heads·hd]`, `k, v [b·T, kv_heads·hd]`
/// (or `[b, T, kv_heads·hd]`) with `T >= t` (the layout of a model's projections, `[b,
/// positions, heads, hd]` in memory). On CUDA the rows may be views: of wider rows
/// (keys and values side by side) or of a longer KV buffer per sequence, read in place.
/// Query `i` sits at position `T - t + i` (the keys before it are a KV cache)
/// and sees keys `0 ..= T - t + i`; grouped-query attention when `kv_heads < heads`.
/// Returns `[b·t, heads·hd]` rows in q's dtype. Differentiable in q, k and v.
pub fn causal_attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    head_dim: usize,
) -> Result<Tensor> {
    same_dtype(q, k, v)?;
    let op = CausalAttention {
        scale: score_scale(head_dim),
        batch,
        head_dim,
        q_angles: None,
    };
    let (q, k, v) = (readable(q)?, readable_kv(k)?, readable_kv(v)?);
    q.apply_op3(&k, &v, op)
}

/// [`causal_attention_rows`] of queries that still need their RoPE turn: `q [b·t,
/// heads·hd]` as the projection gave it (a view of fused q | k | v rows is read in
/// place) and `angles` the table of its `t` positions (as [`super::rope`] takes it);
/// `k` and `v` already turned, as the KV cache keeps them. The same as `rope(q)` then
/// [`causal_attention_rows`], bit for bit where the CUDA prefill kernels run: they turn
/// q as they stage it, so q is not read and written once more by a RoPE pass and no
/// turned copy is allocated. Elsewhere (CPU, one query per sequence, other dtypes or
/// head sizes) it is those two calls. For inference: no backward.
pub fn causal_attention_rows_turning_q(
    q: &Tensor,
    angles: &crate::RopeTable,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let cs = &angles.cos_sin;
    // One query a sequence takes the decode kernel, which reads q turned.
    let one_query = q.dim(0)? <= batch;
    if !kernel_takes(q, head_dim) || one_query || cs.dtype() != q.dtype() {
        let q = crate::rope(q, angles)?;
        return causal_attention_rows(&q, k, v, batch, head_dim);
    }
    same_dtype(q, k, v)?;
    let op = CausalAttention {
        scale: score_scale(head_dim),
        batch,
        head_dim,
        q_angles: Some(cs.contiguous()?),
    };
    let (q, k, v) = (readable(q)?, readable_kv(k)?, readable_kv(v)?);
    q.apply_op3_no_bwd(&k, &v, &op)
}

/// Causal attention of `q [b, heads, t, hd]` over `k, v [b, kv_heads, T, hd]` with
/// `T >= t`, as [`causal_attention_rows`] on the rows these views are (no copy when they
/// are transposed views of `[b, positions, heads, hd]`, as a model's projections are).
/// Returns `[b, heads, t, hd]` in q's dtype, a transposed view of contiguous `[b, t,
/// heads, hd]`. Differentiable in q, k and v.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, heads, t, _, _, hd) = dims(q.dims(), k.dims(), v.dims())?;
    let rows = CausalAttention::rows_of;
    causal_attention_rows(&rows(q)?, &rows(k)?, &rows(v)?, b, hd)?
        .reshape((b, t, heads, hd))?
        .transpose(1, 2)
}

/// Rows the CUDA kernel (and the CPU forward) reads in place though they are not
/// contiguous: `[n, width]` with a row stride (a view of wider rows, e.g. the keys of
/// fused key | value rows) or `[b, positions, width]` with a row and a batch stride (a
/// view of a longer KV buffer), every row 16-byte aligned.
fn strided_rows(l: &Layout) -> bool {
    let aligned = |xs: &[usize]| xs.iter().chain([&l.start_offset()]).all(|x| x % 8 == 0);
    match (l.dims(), l.stride()) {
        (&[_, width], &[rs, 1]) => rs >= width && aligned(&[rs]),
        (&[_, n, width], &[bs, ts, 1]) => (ts >= width || n == 1) && aligned(&[bs, ts]),
        _ => false,
    }
}

/// One CPU task of the attention: the query heads that share key head `head` (the
/// columns of k and v), for one query row of one sequence, over its `visible` keys.
struct HeadGroup<'a> {
    /// `[group, hd]`.
    q: &'a [f32],
    k: &'a KvRows<'a>,
    v: &'a KvRows<'a>,
    batch: usize,
    head: std::ops::Range<usize>,
    visible: usize,
    scale: f32,
}

/// The decode step's tasks (one query a sequence, fewer tasks than twice the threads) split
/// their keys into ranges of at least this many, so that every thread has work.
const MIN_KEYS_PER_SPLIT: usize = 128;

/// How many key ranges each task of [`CausalAttention::cpu_fwd`] takes: 1 but for decode
/// steps (`t == 1`) with fewer tasks than twice the threads and keys enough to share.
fn key_splits(t: usize, tasks: usize, keys: usize) -> usize {
    let threads = rayon::current_num_threads();
    if t != 1 || tasks == 0 || tasks >= 2 * threads {
        return 1;
    }
    (keys / MIN_KEYS_PER_SPLIT)
        .min((2 * threads).div_ceil(tasks))
        .max(1)
}

/// One key range's share of a [`HeadGroup`]: the outputs `[group, hd]` weighted by
/// `e^(score − max)` and not yet divided, each query's max score and the sum of its
/// weights.
struct Part {
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// Writes `Σ o_i·e^(max_i − M) / Σ sum_i·e^(max_i − M)` per query into `o`: the softmax
/// over the union of the parts' key ranges.
fn merge_parts(parts: &[Part], hd: usize, o: &mut [f32]) {
    for (g, og) in o.chunks_exact_mut(hd).enumerate() {
        let top = parts
            .iter()
            .map(|p| p.max[g])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for p in parts.iter().filter(|p| p.sum[g] > 0.0) {
            let w = (p.max[g] - top).exp();
            total += w * p.sum[g];
            og.iter_mut()
                .zip(&p.o[g * hd..(g + 1) * hd])
                .for_each(|(acc, x)| *acc += w * x);
        }
        og.iter_mut().for_each(|x| *x /= total);
    }
}

impl HeadGroup<'_> {
    /// Writes the group's outputs `[group, hd]` into `o` (zeros on entry).
    fn attend(&self, o: &mut [f32]) {
        let (_, sums) = self.attend_range(0..self.visible, o);
        for (og, sum) in o.chunks_exact_mut(self.head.len()).zip(&sums) {
            og.iter_mut().for_each(|x| *x /= sum);
        }
    }

    /// The group over keys `keys` (within its visible ones): adds the outputs weighted by
    /// `e^(score − max)`, not yet divided, into `o` (`[group, hd]`, zeros on entry) and
    /// returns each query's max score and the sum of its weights.
    fn attend_range(&self, keys: std::ops::Range<usize>, o: &mut [f32]) -> (Vec<f32>, Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { self.attend_range_avx2(keys, o) };
        }
        self.attend_range_portable(keys, o)
    }

    /// The same loops, compiled for AVX2: every key and value row feeds all the group's
    /// queries while it is in registers, and the loops over a head's 64 values are
    /// inlined and vectorised (a call per row and head cost more than the arithmetic).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn attend_range_avx2(
        &self,
        keys: std::ops::Range<usize>,
        o: &mut [f32],
    ) -> (Vec<f32>, Vec<f32>) {
        self.attend_range_portable(keys, o)
    }

    #[inline(always)]
    fn attend_range_portable(
        &self,
        keys: std::ops::Range<usize>,
        o: &mut [f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let hd = self.head.len();
        let (group, n) = (self.q.len() / hd, keys.len());
        let (mut maxes, mut sums) = (vec![f32::NEG_INFINITY; group], vec![0f32; group]);
        if n == 0 {
            return (maxes, sums);
        }
        let mut scores = vec![0f32; group * n];
        for (jj, j) in keys.clone().enumerate() {
            prefetch_row(self.k, self.batch, j + PREFETCH_AHEAD, keys.end, &self.head);
            let kr = &self.k.row(self.batch, j)[self.head.clone()];
            for (g, qr) in self.q.chunks_exact(hd).enumerate() {
                scores[g * n + jj] = self.scale * lanes_dot(qr, kr);
            }
        }
        for (g, sc) in scores.chunks_exact_mut(n).enumerate() {
            let max = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            sc.iter_mut().for_each(|s| *s -= max);
            crate::simd::exp_in_place(sc);
            maxes[g] = max;
            sums[g] = sc.iter().sum();
        }
        for (jj, j) in keys.clone().enumerate() {
            prefetch_row(self.v, self.batch, j + PREFETCH_AHEAD, keys.end, &self.head);
            let vr = &self.v.row(self.batch, j)[self.head.clone()];
            for (g, og) in o.chunks_exact_mut(hd).enumerate() {
                let p = scores[g * n + jj];
                og.iter_mut().zip(vr).for_each(|(acc, x)| *acc += p * x);
            }
        }
        (maxes, sums)
    }
}

/// Rows ahead of the one being read whose head slice is asked of the cache: each task
/// reads a 256-byte slice of every row of the cache, a stride the hardware prefetcher
/// follows late.
const PREFETCH_AHEAD: usize = 16;

/// Asks the cache hierarchy for row `j`'s `head` slice of `rows`, if `j < end`.
#[inline(always)]
fn prefetch_row(rows: &KvRows, batch: usize, j: usize, end: usize, head: &std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if j < end {
        let slice = &rows.row(batch, j)[head.clone()];
        for line in slice.chunks(16) {
            // SAFETY: a prefetch is a hint; the address is inside `slice`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    line.as_ptr() as *const i8
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (rows, batch, j, end, head);
}

/// `Σ a·b` in eight independent lanes, which the compiler vectorises (one running f32
/// sum cannot be reordered).
#[inline(always)]
fn lanes_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Keys or values as the CPU forward reads them: rows `(batch, position)` of `width`
/// f32, in place where the storage is f32 (contiguous, or a view of a wider row or a
/// longer KV buffer, as [`strided_rows`] accepts), widened otherwise. Reading the cache
/// in place matters at decode: a copy of every cached row per layer and token costs
/// more than the attention itself on long contexts.
struct KvRows<'a> {
    values: std::borrow::Cow<'a, [f32]>,
    batch_stride: usize,
    row_stride: usize,
    width: usize,
}

impl<'a> KvRows<'a> {
    fn new(
        what: &'static str,
        storage: &'a CpuStorage,
        l: &Layout,
        batch: usize,
        positions: usize,
        width: usize,
    ) -> Result<Self> {
        let (batch_stride, row_stride) = match (l.is_contiguous(), l.stride()) {
            (true, _) => (positions * width, width),
            (false, &[rs, 1]) if strided_rows(l) => (positions * rs, rs),
            (false, &[bs, ts, 1]) if strided_rows(l) => (bs, ts),
            _ => {
                return err(OpError::Invalid(format!(
                    "{what}: want contiguous rows or strided rows, got strides {:?}",
                    l.stride()
                )))
            }
        };
        let start = l.start_offset();
        let end = start + (batch - 1) * batch_stride + (positions - 1) * row_stride + width;
        let values = match storage {
            CpuStorage::F32(v) => std::borrow::Cow::Borrowed(&v[start..end]),
            CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
            CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
            other => {
                return err(OpError::BadDtype {
                    what,
                    dtype: other.dtype(),
                })
            }
        };
        Ok(Self {
            values,
            batch_stride,
            row_stride,
            width,
        })
    }

    #[inline]
    fn row(&self, batch: usize, position: usize) -> &[f32] {
        let at = batch * self.batch_stride + position * self.row_stride;
        &self.values[at..at + self.width]
    }
}

/// An input as the op reads it: contiguous rows, 16-byte aligned for the CUDA kernels'
/// vector loads. On CUDA strided rows ([`strided_rows`]) are read in place.
fn readable(t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && !t.is_contiguous() && strided_rows(t.layout()) {
        return Ok(t.clone());
    }
    let t = t.contiguous()?;
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && t.layout().start_offset() % 8 != 0 {
        return t.affine(1.0, 0.0);
    }
    Ok(t)
}

/// Keys and values as the op reads them: [`readable`], and on the CPU strided rows in
/// place as well ([`KvRows`]).
fn readable_kv(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cpu() && !t.is_contiguous() && strided_rows(t.layout()) {
        return Ok(t.clone());
    }
    readable(t)
}

/// The op behind [`causal_attention_step`]: inputs `qkv [b, (heads + 2·kv_heads)·hd]`,
/// `cos_sin [1, hd]` and the KV buffer `[b, capacity, 2·kv_heads·hd]`; output `[b,
/// heads·hd]`. CUDA only: it writes the buffer it reads, which candle's CPU storage
/// cannot lend.
pub struct CausalAttentionStep {
    heads: usize,
    kv_heads: usize,
    len: usize,
}

impl CausalAttentionStep {
    /// `(b, hd)` of a call, checked.
    fn dims(&self, qkv: &Layout, cs: &Layout, cache: &Layout) -> Result<(usize, usize)> {
        let (heads, kv_heads, len) = (self.heads, self.kv_heads, self.len);
        let hd = cs.dims().last().copied().unwrap_or(0);
        let width = (heads + 2 * kv_heads) * hd;
        let ok = kv_heads > 0
            && heads % kv_heads == 0
            && hd > 0
            && cs.dims() == [1, hd]
            && matches!(*qkv.dims(), [b, w] if w == width && b > 0)
            && matches!(*cache.dims(), [b, cap, w] if b == qkv.dims()[0] && w == 2 * kv_heads * hd && len < cap);
        if !ok {
            return err(OpError::ShapeMismatch {
                what: "causal_attention_step",
                detail: format!(
                    "qkv {:?}, cos_sin {:?}, cache {:?} with {heads} heads, {kv_heads} KV heads and \
                     {len} cached positions: want qkv [b, (heads + 2 · kv_heads) · hd], cos_sin \
                     [1, hd] and cache [b, capacity, 2 · kv_heads · hd] with capacity > {len}",
                    qkv.dims(),
                    cs.dims(),
                    cache.dims()
                ),
            });
        }
        Ok((qkv.dims()[0], hd))
    }
}

impl CustomOp3 for CausalAttentionStep {
    fn name(&self) -> &'static str {
        "causal-attention-step"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        ql: &Layout,
        _: &CpuStorage,
        cl: &Layout,
        _: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.dims(ql, cl, kl)?;
        err(OpError::Invalid(
            "causal_attention_step runs on CUDA only (elsewhere: rope_qkv, the cache append \
             and causal_attention_rows)"
                .into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, hd) = self.dims(ql, cl, kl)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let dims = (b, self.heads, self.kv_heads, hd, self.len);
        let out = cuda::causal_attention_step(qs, ql, cs, cl, ks, kl, dims, scale)?;
        Ok((out, Shape::from((b, self.heads * hd))))
    }
}

/// Whether [`causal_attention_step`] runs for a step of `qkv` rows over `len` cached
/// positions: CUDA, bf16, a head size in [`CUDA_HEAD_DIMS`], and the scores of `len + 1`
/// keys in shared memory.
pub fn step_on_device(qkv: &Tensor, head_dim: usize, len: usize) -> bool {
    kernel_takes(qkv, head_dim) && len < CUDA_DECODE_MAX_KEYS
}

/// Whether the CUDA attention kernels take `x`'s device, dtype and head size.
fn kernel_takes(x: &Tensor, head_dim: usize) -> bool {
    x.device().is_cuda() && x.dtype() == DType::BF16 && CUDA_HEAD_DIMS.contains(&head_dim)
}

/// One decode step's attention from its fused projections, in one launch: `qkv [b,
/// (heads + 2·kv_heads)·hd]` (one token per sequence, queries | keys | values) at the
/// position whose angles `angles` holds (one row); its query and key turned (RoPE, as
/// [`super::rope_qkv`]), the key and value written **into** `cache [b, capacity, 2·kv_heads·hd]`
/// at position `len` (each sequence's keys then values, as a model's KV cache keeps them),
/// and the query attending positions `0 ..= len`. Returns `[b, heads·hd]`. Where
/// RoPE, the cache append and the attention took three launches; the cache must hold
/// room for the row (`len < capacity`), and its holder counts it afterwards. CUDA only
/// ([`step_on_device`]); no backward (inference).
pub fn causal_attention_step(
    qkv: &Tensor,
    angles: &crate::RopeTable,
    cache: &Tensor,
    len: usize,
    heads: usize,
    kv_heads: usize,
) -> Result<Tensor> {
    let cs = &angles.cos_sin;
    if qkv.dtype() != DType::BF16 || cs.dtype() != DType::BF16 || cache.dtype() != DType::BF16 {
        return err(OpError::Invalid(format!(
            "causal_attention_step takes bf16, got qkv {:?}, cos_sin {:?}, cache {:?}",
            qkv.dtype(),
            cs.dtype(),
            cache.dtype()
        )));
    }
    if !cache.is_contiguous() {
        return err(OpError::Invalid(
            "causal_attention_step: the cache must be a whole contiguous buffer".into(),
        ));
    }
    let op = CausalAttentionStep {
        heads,
        kv_heads,
        len,
    };
    qkv.contiguous()?
        .apply_op3_no_bwd(&cs.contiguous()?, cache, &op)
}

/// Whether [`causal_attention`] runs its CUDA kernel for this query: a CUDA tensor in
/// bf16 with a head size in [`CUDA_HEAD_DIMS`].
pub fn fused_on_device(q: &Tensor) -> bool {
    q.dims().last().is_some_and(|&hd| kernel_takes(q, hd))
}

/// The CUDA kernel [`causal_attention`] launches for this query against `total` keys,
/// or `None` where it runs the plain ops; the GPU tests print it beside each case.
pub fn kernel_name(q: &Tensor, total: usize) -> Result<Option<String>> {
    if !fused_on_device(q) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = q.device() {
        let (_, _, t, hd) = q.dims4()?;
        return cuda::prefill_attention_kernel(dev, t, total, hd).map(Some);
    }
    let _ = total;
    Ok(None)
}

/// The plain-op form of [`causal_attention`] in f32: materialised scores, an explicit
/// causal mask and softmax, the KV heads repeated for grouped-query attention. The
/// reference the fused op and its backward are tested and checked against.
pub fn causal_attention_reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, heads, t, hd) = q.dims4()?;
    let (_, kv_heads, total, _) = k.dims4()?;
    if kv_heads == 0 || heads % kv_heads != 0 || total < t {
        return err(OpError::ShapeMismatch {
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
