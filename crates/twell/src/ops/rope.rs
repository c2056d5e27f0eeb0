//! `rope`: rotary position embedding of `[b, t, heads, hd]` (or `[b·t, heads·hd]`)
//! rows, for the model's queries and keys.
//!
//! candle's `rope_thd` runs one element per thread with 2-byte loads; at prefill sizes
//! the CUDA kernel (`kernels/rope.cu`, 8 pairs per thread, 16-byte loads) takes a
//! fraction of its time. The output is a tensor of its own, so a KV cache that keeps
//! the keys holds nothing else. Its backward is the transposed rotation (the same kernel
//! with the sines negated), so training on the GPU takes it too.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu::float::Rows;
use crate::error::{err, TwellError};

/// The op behind [`rope`]: inputs `(x [b, t, heads, hd] or [b·t, heads·hd], cos_sin
/// [t, hd])`, output like `x`. It runs on the CPU too, so tests can hold it against
/// candle's `rope_thd`.
pub struct Rope;

/// `(t, heads, hd)` of a call, checked. Rows `[b·t, heads·hd]` (a model's projections
/// as they come) take `t` and `hd` from the table.
fn dims(x: &Layout, cs: &Layout) -> Result<(usize, usize, usize)> {
    let bad = || {
        err(TwellError::ShapeMismatch {
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
        let out = crate::cuda::rope(xs, xl, css, csl, (t, heads, hd), (heads, 0, heads))?;
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

/// The CPU form of `kernels/rope.cu`: heads `first..first + count` of each token row
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
            o[i] = x[i] * co[i] - x[i + half] * sn[i];
            o[i + half] = x[i] * sn[i] + x[i + half] * co[i];
        }
    });
    crate::cpu::float::storage_from_f32(out, dtype)
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
            _ => err(TwellError::ShapeMismatch {
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
        let out = crate::cuda::rope(xs, xl, css, csl, dims, part)?;
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
    let cs = &angles.cos_sin;
    if qkv.dtype() != cs.dtype() {
        return err(TwellError::Invalid(format!(
            "rope_qkv: qkv and cos_sin must share a dtype, got {:?} and {:?}",
            qkv.dtype(),
            cs.dtype()
        )));
    }
    let op = |part| RopeQkv {
        q_heads,
        kv_heads,
        part,
    };
    let qkv = qkv.contiguous()?;
    let ((_, _, hd), _) = op(QkvPart::Queries).dims(qkv.layout(), cs.layout())?;
    if !kernel_runs(&qkv, hd) && !qkv.device().is_cpu() {
        // No kernel for this case: the split form (RoPE on each part, then one join).
        let q_width = q_heads * hd;
        let q = rope(&qkv.narrow(1, 0, q_width)?, angles)?;
        let k = rope(&qkv.narrow(1, q_width, kv_heads * hd)?, angles)?;
        let v = qkv.narrow(1, q_width + kv_heads * hd, kv_heads * hd)?;
        return Ok((q, Tensor::cat(&[&k, &v], 1)?));
    }
    let cs = cs.contiguous()?;
    Ok((
        qkv.apply_op2_no_bwd(&cs, &op(QkvPart::Queries))?,
        qkv.apply_op2_no_bwd(&cs, &op(QkvPart::KeysValues))?,
    ))
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

/// Whether `kernels/rope.cu` takes `x`: CUDA, bf16, head sizes a multiple of 16 (its
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
        return err(TwellError::Invalid(format!(
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
