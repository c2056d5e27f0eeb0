//! `rope`: rotary position embedding of `[b, t, heads, hd]` (or `[b·t, heads·hd]`)
//! rows, for the model's queries and keys.
//!
//! candle's `rope_thd` runs one element per thread with 2-byte loads; at prefill sizes
//! the CUDA kernel (`kernels/src/rope.cu`, 8 pairs per thread, 16-byte loads) takes a
//! fraction of its time. The output is a tensor of its own, so a KV cache that keeps
//! the keys holds nothing else. Its backward is the transposed rotation (the same kernel
//! with the sines negated), so training on the GPU takes it too.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::Rows;

/// The op behind [`rope`]: inputs `(x [b, t, heads, hd] or [b·t, heads·hd], cos_sin
/// [t, hd])`, output like `x`. It runs on the CPU too, so tests can hold it against
/// candle's `rope_thd`.
pub struct Rope;

/// `(t, heads, hd)` of a call, checked. Rows `[b·t, heads·hd]` (a model's projections
/// as they come) take `t` and `hd` from the table.
fn dims(x: &Layout, cs: &Layout) -> Result<(usize, usize, usize)> {
    let bad = || {
        err(OpError::ShapeMismatch {
            what: "rope",
            detail: format!(
                "x {:?}, cos_sin {:?}: want x [b, t, heads, hd] or [b · t, heads · hd] and \
                 cos_sin [t, hd] with hd even",
                x.dims(),
                cs.dims()
            ),
        })
    };
    let (t, heads, hd) = match (x.dims(), cs.dims()) {
        (&[_, t, heads, hd], _) => (t, heads, hd),
        (&[rows, width], &[t, hd]) if t > 0 && hd > 0 && rows % t == 0 && width % hd == 0 => {
            (t, width / hd, hd)
        }
        _ => return bad(),
    };
    if cs.dims() != [t, hd] || !hd.is_multiple_of(2) {
        return bad();
    }
    Ok((t, heads, hd))
}

impl CustomOp2 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        css: &CpuStorage,
        csl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (t, heads, hd) = dims(xl, csl)?;
        let out = turn_cpu(xs, xl, css, csl, (t, heads, hd), (heads, 0, heads))?;
        Ok((out, Shape::from(xl.dims())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        css: &candle_core::CudaStorage,
        csl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (t, heads, hd) = dims(xl, csl)?;
        let out = cuda::rope(xs, xl, css, csl, (t, heads, hd), (heads, 0, heads))?;
        Ok((out, Shape::from(xl.dims())))
    }

    /// The transposed map: the same rotation with the sines negated.
    fn bwd(
        &self,
        _x: &Tensor,
        cos_sin: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let half = cos_sin.dim(1)? / 2;
        let inverse = Tensor::cat(
            &[
                cos_sin.narrow(1, 0, half)?,
                cos_sin.narrow(1, half, half)?.neg()?,
            ],
            1,
        )?;
        let grad = grad_out.contiguous()?.apply_op2_no_bwd(&inverse, &Rope)?;
        Ok((Some(grad), None))
    }
}

/// One pair `(x[i], x[i + hd/2])` turned by its angle's cos and sin, in f32: the CPU
/// forms' one formula (rotate-half, as HF Llama).
fn turn_pair(x1: f32, x2: f32, cos: f32, sin: f32) -> (f32, f32) {
    (x1 * cos - x2 * sin, x1 * sin + x2 * cos)
}

/// The CPU form of `kernels/src/rope.cu`: heads `first..first + count` of each token row
/// as rows of their own, those below `rot_heads` turned, the others copied (`rot_heads =
/// count = heads`, `first = 0` is plain RoPE).
fn turn_cpu(
    xs: &CpuStorage,
    xl: &Layout,
    css: &CpuStorage,
    csl: &Layout,
    (t, heads, hd): (usize, usize, usize),
    (rot_heads, first, count): (usize, usize, usize),
) -> Result<CpuStorage> {
    let x = Rows::new("x", xs, xl)?;
    let dtype = x.dtype();
    let (x, cs) = (x.to_f32_vec(), Rows::new("cos_sin", css, csl)?.to_f32_vec());
    let half = hd / 2;
    let tokens = x.len() / (heads * hd);
    let mut out = vec![0f32; tokens * count * hd];
    // Output row `r` is token `r / count`, head `first + r % count`.
    out.par_chunks_mut(hd).enumerate().for_each(|(r, o)| {
        let (token, head) = (r / count, first + r % count);
        let x = &x[(token * heads + head) * hd..][..hd];
        if head >= rot_heads {
            o.copy_from_slice(x);
            return;
        }
        let angles = &cs[(token % t) * hd..][..hd];
        let (co, sn) = angles.split_at(half);
        for i in 0..half {
            (o[i], o[i + half]) = turn_pair(x[i], x[i + half], co[i], sn[i]);
        }
    });
    crate::host::storage_from_f32(out, dtype)
}

/// The op behind [`rope_qkv`]: input fused projection rows `[rows, (q_heads + 2 ·
/// kv_heads) · hd]` (queries, keys, values) and `cos_sin [t, hd]`; output one part of
/// them, the queries turned (`[rows, q_heads · hd]`) or the keys turned and the values
/// copied (`[rows, 2 · kv_heads · hd]`).
pub struct RopeQkv {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub part: QkvPart,
}

/// Which part of fused q | k | v rows a [`RopeQkv`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvPart {
    Queries,
    KeysValues,
}

impl RopeQkv {
    /// `(t, heads, hd)` of a call, checked, and the kernel's `(rot_heads, first, count)`:
    /// the queries and keys turn; the part's heads come out.
    #[allow(clippy::type_complexity)]
    fn dims(
        &self,
        x: &Layout,
        cs: &Layout,
    ) -> Result<((usize, usize, usize), (usize, usize, usize))> {
        let heads = self.q_heads + 2 * self.kv_heads;
        let rot_heads = self.q_heads + self.kv_heads;
        let (first, count) = match self.part {
            QkvPart::Queries => (0, self.q_heads),
            QkvPart::KeysValues => (self.q_heads, 2 * self.kv_heads),
        };
        match (x.dims(), cs.dims()) {
            (&[rows, width], &[t, hd])
                if self.q_heads > 0
                    && self.kv_heads > 0
                    && t > 0
                    && hd > 0
                    && hd.is_multiple_of(2)
                    && rows % t == 0
                    && width == heads * hd =>
            {
                Ok(((t, heads, hd), (rot_heads, first, count)))
            }
            _ => err(OpError::ShapeMismatch {
                what: "rope_qkv",
                detail: format!(
                    "x {:?}, cos_sin {:?}: want x [b · t, ({} + 2 · {}) · hd] and cos_sin \
                     [t, hd] with hd even",
                    x.dims(),
                    cs.dims(),
                    self.q_heads,
                    self.kv_heads
                ),
            }),
        }
    }

    /// The part's `[rows, count · hd]`.
    fn out_shape(x: &Layout, (_, _, hd): (usize, usize, usize), count: usize) -> Shape {
        Shape::from((x.dims()[0], count * hd))
    }
}

impl CustomOp2 for RopeQkv {
    fn name(&self) -> &'static str {
        "rope-qkv"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        css: &CpuStorage,
        csl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (dims, part) = self.dims(xl, csl)?;
        let out = turn_cpu(xs, xl, css, csl, dims, part)?;
        Ok((out, Self::out_shape(xl, dims, part.2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        css: &candle_core::CudaStorage,
        csl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (dims, part) = self.dims(xl, csl)?;
        let out = cuda::rope(xs, xl, css, csl, dims, part)?;
        Ok((out, Self::out_shape(xl, dims, part.2)))
    }
}

/// RoPE of fused projection rows `qkv [b·t, (q_heads + 2·kv_heads)·hd]` (queries, keys,
/// values, as one matrix product of the three weights gives them): returns the turned
/// queries `[b·t, q_heads·hd]` and keys | values `[b·t, 2·kv_heads·hd]` (the values
/// unchanged), each a tensor of its own, so a KV cache that keeps the second holds
/// nothing else and copies nothing. Two launches, each reading its part of the rows,
/// where the split projections take three products and two RoPE passes and a join. For
/// inference: no backward.
pub fn rope_qkv(
    qkv: &Tensor,
    angles: &RopeTable,
    q_heads: usize,
    kv_heads: usize,
) -> Result<(Tensor, Tensor)> {
    Ok((
        rope_qkv_part(qkv, angles, q_heads, kv_heads, QkvPart::Queries)?,
        rope_qkv_part(qkv, angles, q_heads, kv_heads, QkvPart::KeysValues)?,
    ))
}

/// One part of [`rope_qkv`]: the turned queries, or the turned keys with the values
/// (for an attention that turns its queries itself,
/// [`super::causal_attention_rows_turning_q`]). One launch; for inference.
pub fn rope_qkv_part(
    qkv: &Tensor,
    angles: &RopeTable,
    q_heads: usize,
    kv_heads: usize,
    part: QkvPart,
) -> Result<Tensor> {
    let cs = &angles.cos_sin;
    if qkv.dtype() != cs.dtype() {
        return err(OpError::Invalid(format!(
            "rope_qkv: qkv and cos_sin must share a dtype, got {:?} and {:?}",
            qkv.dtype(),
            cs.dtype()
        )));
    }
    let op = RopeQkv {
        q_heads,
        kv_heads,
        part,
    };
    let qkv = qkv.contiguous()?;
    let ((_, _, hd), _) = op.dims(qkv.layout(), cs.layout())?;
    if !kernel_runs(&qkv, hd) && !qkv.device().is_cpu() {
        // No kernel for this case: the split form (RoPE on each part, then one join).
        let q_width = q_heads * hd;
        let kv_width = kv_heads * hd;
        return match part {
            QkvPart::Queries => rope(&qkv.narrow(1, 0, q_width)?, angles),
            QkvPart::KeysValues => {
                let k = rope(&qkv.narrow(1, q_width, kv_width)?, angles)?;
                let v = qkv.narrow(1, q_width + kv_width, kv_width)?;
                Tensor::cat(&[&k, &v], 1)
            }
        };
    }
    qkv.apply_op2_no_bwd(&cs.contiguous()?, &op)
}

/// The op behind [`rope_keys_in_place`]: turns the first `rot_heads` heads of each row
/// of `x [rows, heads · hd]` (contiguous) in place by `cos_sin [t, hd]`.
struct RopeInPlace {
    rot_heads: usize,
}

impl RopeInPlace {
    /// `(t, heads, hd)` of a call, checked.
    fn dims(&self, x: &Layout, cs: &Layout) -> Result<(usize, usize, usize)> {
        let (t, heads, hd) = dims(x, cs)?;
        if x.dims().len() != 2 || self.rot_heads == 0 || self.rot_heads > heads {
            return err(OpError::ShapeMismatch {
                what: "rope_keys_in_place",
                detail: format!(
                    "x {:?}, cos_sin {:?}: want rows [b · t, heads · hd] with {} turned heads \
                     of at most heads",
                    x.dims(),
                    cs.dims(),
                    self.rot_heads
                ),
            });
        }
        Ok((t, heads, hd))
    }
}

/// Turns the first `rot_heads` heads of each `heads · hd` row of `x` in place, in f32
/// (as [`turn_cpu`] does).
fn turn_in_place_cpu<T: candle_core::WithDType>(
    x: &mut [T],
    cs: &[f32],
    (t, heads, hd): (usize, usize, usize),
    rot_heads: usize,
) {
    let half = hd / 2;
    x.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(token, row)| {
            let angles = &cs[(token % t) * hd..][..hd];
            let (co, sn) = angles.split_at(half);
            for head in row.chunks_mut(hd).take(rot_heads) {
                for i in 0..half {
                    let (x1, x2) = (head[i].to_f64() as f32, head[i + half].to_f64() as f32);
                    let (o1, o2) = turn_pair(x1, x2, co[i], sn[i]);
                    (head[i], head[i + half]) = (T::from_f64(o1 as f64), T::from_f64(o2 as f64));
                }
            }
        });
}

impl candle_core::InplaceOp2 for RopeInPlace {
    fn name(&self) -> &'static str {
        "rope-in-place"
    }

    fn cpu_fwd(
        &self,
        xs: &mut CpuStorage,
        xl: &Layout,
        css: &CpuStorage,
        csl: &Layout,
    ) -> Result<()> {
        let dims = self.dims(xl, csl)?;
        let cs = Rows::new("cos_sin", css, csl)?.to_f32_vec();
        let Some((a, b)) = xl.contiguous_offsets() else {
            return err(OpError::Invalid(
                "rope_keys_in_place: x must be contiguous".into(),
            ));
        };
        match xs {
            CpuStorage::BF16(v) => turn_in_place_cpu(&mut v[a..b], &cs, dims, self.rot_heads),
            CpuStorage::F16(v) => turn_in_place_cpu(&mut v[a..b], &cs, dims, self.rot_heads),
            CpuStorage::F32(v) => turn_in_place_cpu(&mut v[a..b], &cs, dims, self.rot_heads),
            CpuStorage::F64(v) => turn_in_place_cpu(&mut v[a..b], &cs, dims, self.rot_heads),
            other => {
                return err(OpError::Invalid(format!(
                    "rope_keys_in_place takes floats, got {:?}",
                    candle_core::backend::BackendStorage::dtype(&*other)
                )))
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &mut candle_core::CudaStorage,
        xl: &Layout,
        css: &candle_core::CudaStorage,
        csl: &Layout,
    ) -> Result<()> {
        let dims = self.dims(xl, csl)?;
        cuda::rope_in_place(xs, xl, css, csl, dims, self.rot_heads)
    }
}

/// RoPE of the keys of `kv [b·t, 2·kv_heads·hd]` rows (keys, then values, as the KV
/// cache keeps them), in place: the values are neither read nor copied. For a model
/// whose inference prefill projects q and `k | v` apart and whose attention turns q
/// itself ([`super::causal_attention_rows_turning_q`]). On CUDA outside the kernel's
/// cases (bf16, head sizes a multiple of 16) the keys are turned by [`rope`] and written
/// back. For inference: no backward.
pub fn rope_keys_in_place(kv: &Tensor, angles: &RopeTable, kv_heads: usize) -> Result<()> {
    let cs = &angles.cos_sin;
    if kv.dtype() != cs.dtype() {
        return err(OpError::Invalid(format!(
            "rope_keys_in_place: kv and cos_sin must share a dtype, got {:?} and {:?}",
            kv.dtype(),
            cs.dtype()
        )));
    }
    if !kv.is_contiguous() {
        return err(OpError::Invalid(
            "rope_keys_in_place: kv must be contiguous (it is written in place)".into(),
        ));
    }
    let op = RopeInPlace {
        rot_heads: kv_heads,
    };
    let (_, heads, hd) = op.dims(kv.layout(), cs.layout())?;
    if heads != 2 * kv_heads {
        return err(OpError::ShapeMismatch {
            what: "rope_keys_in_place",
            detail: format!(
                "kv {:?}: want rows of 2 · {kv_heads} heads (keys, then values)",
                kv.dims()
            ),
        });
    }
    if kv.device().is_cuda() && !kernel_runs(kv, hd) {
        let keys = rope(&kv.narrow(1, 0, kv_heads * hd)?, angles)?;
        return kv.slice_set(&keys, 1, 0);
    }
    kv.inplace_op2(&cs.contiguous()?, &op)
}

/// The RoPE angles of a run of positions, in both forms: candle's `cos, sin [positions,
/// hd / 2]`, and side by side as `cos_sin [positions, hd]` (each position's cos, then its
/// sin) for the CUDA kernel. Built once per table, narrowed per call (views).
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub cos: Tensor,
    pub sin: Tensor,
    pub cos_sin: Tensor,
}

impl RopeTable {
    pub fn new(cos: &Tensor, sin: &Tensor) -> Result<Self> {
        Ok(Self {
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            cos_sin: Tensor::cat(&[cos, sin], 1)?,
        })
    }

    /// The angles of positions `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(Self {
            cos: self.cos.narrow(0, start, len)?,
            sin: self.sin.narrow(0, start, len)?,
            cos_sin: self.cos_sin.narrow(0, start, len)?,
        })
    }
}

/// Whether `kernels/src/rope.cu` takes `x`: CUDA, bf16, head sizes a multiple of 16 (its
/// 8-pair vector loads on each half).
fn kernel_runs(x: &Tensor, hd: usize) -> bool {
    x.device().is_cuda() && x.dtype() == DType::BF16 && hd.is_multiple_of(16)
}

/// RoPE (rotate-half, as HF Llama) of `x [b, t, heads, hd]` (or its rows `[b·t,
/// heads·hd]`) at the `t` positions whose angles `angles` holds. On CUDA in bf16 our kernel (head sizes a multiple of 16);
/// elsewhere candle's `rope_thd`, or on the CPU, when `x` tracks gradients, the op's
/// own implementation. Returns a contiguous tensor of its own. Differentiable in `x`
/// except on CUDA outside the kernel's cases (candle's `rope_thd` has no backward).
pub fn rope(x: &Tensor, angles: &RopeTable) -> Result<Tensor> {
    let cs = &angles.cos_sin;
    if x.dtype() != cs.dtype() {
        return err(OpError::Invalid(format!(
            "rope: x and cos_sin must share a dtype, got {:?} and {:?}",
            x.dtype(),
            cs.dtype()
        )));
    }
    let x = x.contiguous()?;
    let (_, _, hd) = dims(x.layout(), cs.layout())?;
    // candle's `rope_thd` has no backward: on the CPU a pass that tracks gradients takes
    // the op's own implementation.
    if kernel_runs(&x, hd) || (x.device().is_cpu() && x.track_op()) {
        return x.apply_op2(&cs.contiguous()?, Rope);
    }
    let (t, heads, hd) = dims(x.layout(), cs.layout())?;
    let x4 = x.reshape(((), t, heads, hd))?;
    candle_nn::rotary_emb::rope_thd(&x4, &angles.cos, &angles.sin)?.reshape(x.dims())
}
