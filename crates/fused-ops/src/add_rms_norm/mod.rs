//! `add_rms_norm`: a residual add and the RMS norm that follows it, as one op.
//!
//! Each sublayer of a Llama block ends in `x = x + y` and the next begins with
//! `rms_norm(x)`. As two candle ops that is two launches and two passes over `[M, d]`; at
//! one token per step (decode) the launches are the cost, at prefill sizes the passes.
//! The CUDA kernel (`kernels/src/add_rms_norm.cu`) does both in one pass for inference.
//! Training takes the sum as candle's add and the norm as [`RmsNorm`], whose backward
//! is one more kernel pass: as differentiable candle ops the norm alone is some eight f32
//! passes forward and twice that backward. (One op with both results would hand them
//! out as halves of one tensor, and candle's backward of each half pads its gradient
//! with zeros to the whole and adds it: four passes over `[2M, d]` per norm.)

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::Rows;

/// The op behind [`add_rms_norm`] in inference: inputs `(x [M, d], y [M, d], alpha
/// [d])`, output `[2M, d]` (the sums, then the normalised sums: each half one contiguous
/// `narrow`). Forward only; it runs on the CPU too, so tests can hold it against
/// candle's ops.
pub struct AddRmsNorm {
    eps: f32,
}

impl AddRmsNorm {
    pub fn new(eps: f64) -> Self {
        Self { eps: eps as f32 }
    }
}

/// The norm of training's [`add_rms_norm`]: inputs `(s [M, d], alpha [d])`, output
/// `s · rsqrt(mean(s²) + eps) · alpha`, with a backward (a kernel on CUDA, candle's ops
/// on the CPU).
pub struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    pub fn new(eps: f64) -> Self {
        Self { eps: eps as f32 }
    }
}

/// `(M, d)` of a call, checked.
fn dims(x: &Layout, y: &Layout, alpha: &Layout) -> Result<(usize, usize)> {
    let (m, d) = x.shape().dims2()?;
    if y.dims() != x.dims() || alpha.dims() != [d] {
        return err(OpError::ShapeMismatch {
            what: "add_rms_norm",
            detail: format!(
                "x {:?}, y {:?}, alpha {:?}: want y like x and alpha [{d}]",
                x.dims(),
                y.dims(),
                alpha.dims()
            ),
        });
    }
    Ok((m, d))
}

/// `v` as the dtype would store it.
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
        als: &CpuStorage,
        al: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, d) = dims(xl, yl, al)?;
        let x = Rows::new("x", xs, xl)?;
        let dtype = x.dtype();
        let y = Rows::new("y", ys, yl)?.to_f32_vec();
        let sums: Vec<f32> = x
            .to_f32_vec()
            .iter()
            .zip(&y)
            .map(|(a, b)| round_to(dtype, a + b))
            .collect();
        let alpha = Rows::new("alpha", als, al)?.to_f32_vec();
        let mut out = sums.clone();
        out.extend(normalise(&sums, &alpha, d, self.eps));
        Ok((
            crate::host::storage_from_f32(out, dtype)?,
            Shape::from((2 * m, d)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        als: &candle_core::CudaStorage,
        al: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, d) = dims(xl, yl, al)?;
        let out = cuda::add_rms_norm(xs, xl, Some((ys, yl)), als, al, self.eps)?;
        Ok((out, Shape::from((2 * m, d))))
    }
}

/// Each row of `s [.., d]` times `rsqrt(mean(row²) + eps) · alpha`, in f32.
fn normalise(s: &[f32], alpha: &[f32], d: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; s.len()];
    out.par_chunks_mut(d)
        .zip(s.par_chunks(d))
        .for_each(|(n, row)| {
            let mean = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let scale = 1.0 / (mean + eps).sqrt();
            for ((o, v), a) in n.iter_mut().zip(row).zip(alpha) {
                *o = scale * v * a;
            }
        });
    out
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        als: &CpuStorage,
        al: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, d) = dims(sl, sl, al)?;
        let s = Rows::new("s", ss, sl)?;
        let dtype = s.dtype();
        let alpha = Rows::new("alpha", als, al)?.to_f32_vec();
        let out = normalise(&s.to_f32_vec(), &alpha, d, self.eps);
        Ok((
            crate::host::storage_from_f32(out, dtype)?,
            Shape::from(sl.dims()),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        als: &candle_core::CudaStorage,
        al: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        dims(sl, sl, al)?;
        let out = cuda::add_rms_norm(ss, sl, None, als, al, self.eps)?;
        Ok((out, Shape::from(sl.dims())))
    }

    fn bwd(
        &self,
        s: &Tensor,
        alpha: &Tensor,
        _normed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (m, d) = s.dims2()?;
        let (ds, dalpha) = if s.device().is_cuda() {
            let flat = s.apply_op3_no_bwd(
                &grad.contiguous()?,
                alpha,
                &RmsNormBackward { eps: self.eps },
            )?;
            (
                flat.narrow(0, 0, m * d)?.reshape((m, d))?,
                flat.narrow(0, m * d, d)?,
            )
        } else {
            self.backward_with_candle_ops(s, grad, alpha)?
        };
        Ok((Some(ds), Some(dalpha)))
    }
}

impl RmsNorm {
    /// `(ds, dalpha)` as candle ops in f32, where no kernel runs (the CPU). With
    /// `r = rsqrt(mean(s²) + eps)`: `ds = r·alpha⊙g_n − s·r³·mean(alpha⊙g_n⊙s)`,
    /// `dalpha = Σ_rows g_n ⊙ s·r`.
    fn backward_with_candle_ops(
        &self,
        sum: &Tensor,
        grad_normed: &Tensor,
        alpha: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let dtype = sum.dtype();
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let (s, gn, a) = (f32(sum)?, f32(grad_normed)?, f32(alpha)?);
        let r = (s.sqr()?.mean_keepdim(1)? + self.eps as f64)?
            .sqrt()?
            .recip()?;
        let a_gn = gn.broadcast_mul(&a)?;
        let c = (&a_gn * &s)?.mean_keepdim(1)?;
        let ds = (a_gn.broadcast_mul(&r)? - s.broadcast_mul(&(r.powf(3.0)? * c)?)?)?;
        let dalpha = (gn * s.broadcast_mul(&r)?)?.sum(0)?;
        Ok((ds.to_dtype(dtype)?, dalpha.to_dtype(dtype)?))
    }
}

/// The CUDA backward of [`RmsNorm`]: inputs `(s [M, d], grad [M, d], alpha [d])`,
/// output `[M · d + d]`: the rows of `ds`, then `dalpha`.
struct RmsNormBackward {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    eps: f32,
}

impl CustomOp3 for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms-norm-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        err(OpError::Invalid(
            "rms_norm's backward kernel is CUDA-only; the CPU takes candle's ops".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        als: &candle_core::CudaStorage,
        al: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, d) = dims(sl, sl, al)?;
        let out = cuda::rms_norm_bwd(ss, sl, gs, gl, als, al, self.eps)?;
        Ok((out, Shape::from(m * d + d)))
    }
}

/// `rms_norm(x) · alpha` for `x [.., d]` and `alpha [d]`: on CUDA in bf16 (hidden sizes
/// as [`add_rms_norm`]) the same kernel with no second input ([`RmsNorm`], which has a
/// backward), 16-byte loads where candle's norm reads an element at a time; elsewhere
/// candle's ops (their differentiable form when an input tracks gradients).
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() != alpha.dtype() {
        return err(OpError::Invalid(format!(
            "rms_norm: x and alpha must share a dtype, got {:?} and {:?}",
            x.dtype(),
            alpha.dtype()
        )));
    }
    let d = x.dims().last().copied().unwrap_or(0);
    let tracked = x.track_op() || alpha.track_op();
    if !fused_on_device(x) || !d.is_multiple_of(8) || d == 0 {
        return if tracked {
            candle_nn::ops::rms_norm_slow(x, alpha, eps as f32)
        } else {
            candle_nn::ops::rms_norm(x, alpha, eps as f32)
        };
    }
    let rows = crate::checks::reshaped(x, &[x.elem_count() / d, d])?.contiguous()?;
    let normed = rows.apply_op2(&alpha.contiguous()?, RmsNorm::new(eps))?;
    crate::checks::reshaped(&normed, x.dims())
}

/// `(x + y, rms_norm(x + y) · alpha)` for `x, y [.., d]` and `alpha [d]`, as a Llama
/// block's residual add and the norm after it compute them (the sum rounded to the
/// dtype before it is normalised). On CUDA in bf16 (hidden sizes up to 8,192, a
/// multiple of 8) one kernel does both, or, when an input tracks gradients, candle's add
/// and [`RmsNorm`] (a kernel each way); elsewhere candle's ops (their differentiable
/// forms when an input tracks gradients).
pub fn add_rms_norm(x: &Tensor, y: &Tensor, alpha: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if x.dtype() != y.dtype() || x.dtype() != alpha.dtype() {
        return err(OpError::Invalid(format!(
            "add_rms_norm: x, y, alpha must share a dtype, got {:?}, {:?}, {:?}",
            x.dtype(),
            y.dtype(),
            alpha.dtype()
        )));
    }
    if x.dims() != y.dims() {
        return err(OpError::ShapeMismatch {
            what: "add_rms_norm",
            detail: format!("x is {:?}, y is {:?}", x.dims(), y.dims()),
        });
    }
    let dims = x.dims().to_vec();
    let d = *dims.last().unwrap_or(&0);
    if !fused_on_device(x) || !d.is_multiple_of(8) || d == 0 {
        let sum = (x + y)?;
        // candle's fused norm has no backward; its plain-op form has.
        let normed = if [x, y, alpha].iter().any(|t| t.track_op()) {
            candle_nn::ops::rms_norm_slow(&sum, alpha, eps as f32)?
        } else {
            candle_nn::ops::rms_norm(&sum, alpha, eps as f32)?
        };
        return Ok((sum, normed));
    }
    // Rows as they come when they are rows already: every reshape is an autograd node.
    let m = x.elem_count() / d;
    let rows = |t: &Tensor| crate::checks::reshaped(t, &[m, d])?.contiguous();
    if [x, y, alpha].iter().any(|t| t.track_op()) {
        let sum = (rows(x)? + rows(y)?)?;
        let normed = sum.apply_op2(&alpha.contiguous()?, RmsNorm::new(eps))?;
        return Ok((
            crate::checks::reshaped(&sum, &dims)?,
            crate::checks::reshaped(&normed, &dims)?,
        ));
    }
    let both = rows(x)?.apply_op3_no_bwd(&rows(y)?, &alpha.contiguous()?, &AddRmsNorm::new(eps))?;
    Ok((
        crate::checks::reshaped(&both.narrow(0, 0, m)?, &dims)?,
        crate::checks::reshaped(&both.narrow(0, m, m)?, &dims)?,
    ))
}

/// Whether [`add_rms_norm`] runs its CUDA kernel for `x`: a CUDA tensor in bf16 whose
/// rows fit the kernel.
fn fused_on_device(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        x.device().is_cuda()
            && x.dtype() == DType::BF16
            && x.dims()
                .last()
                .is_some_and(|&d| d <= crate::cuda::ADD_RMS_NORM_MAX_HIDDEN)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}
