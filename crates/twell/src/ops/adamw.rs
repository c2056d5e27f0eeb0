//! `adamw_step`: one AdamW update of an f32 parameter, in place, as two ops.
//!
//! As candle ops an update is some seventeen elementwise passes over the parameter and
//! a copy into the variable; a 1.5 B-parameter model spent about 130 ms a training step
//! there on an H200. The ops here update the moments and then the parameter in place,
//! one pass each (`kernels/adamw.cu` on CUDA, rayon on the CPU), and take the gradient
//! clipping scale along, so the clipped gradient is never written either.

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::error::{err, TwellError};

/// The hyper-parameters of one step, bias corrections included.
#[derive(Clone, Copy, Debug)]
pub struct AdamwStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The step number, from 1 (for the bias corrections).
    pub step: usize,
    /// Multiplies the gradient first (global-norm clipping).
    pub grad_scale: f64,
}

/// `moment ← beta·moment + (1 − beta)·(scale·g)`, squared first with `square`.
struct AdamwMoment {
    beta: f32,
    scale: f32,
    square: bool,
}

/// `param ← param·decay − lr·(m·inv_c1) / (√(v·inv_c2) + eps)`.
#[derive(Clone, Copy)]
struct AdamwUpdate {
    lr: f32,
    decay: f32,
    inv_c1: f32,
    inv_c2: f32,
    eps: f32,
}

/// A contiguous f32 slice of a CPU storage.
fn cpu_f32<'a>(what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => err(TwellError::Invalid(format!(
            "adamw: {what} must be contiguous f32"
        ))),
    }
}

fn cpu_f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => err(TwellError::Invalid(
            "adamw: the updated tensor must be contiguous f32".into(),
        )),
    }
}

impl InplaceOp2 for AdamwMoment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        ms: &mut CpuStorage,
        ml: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        let g = cpu_f32("grad", gs, gl)?;
        let (beta, scale, square) = (self.beta, self.scale, self.square);
        cpu_f32_mut(ms, ml)?
            .par_iter_mut()
            .zip(g.par_iter())
            .for_each(|(m, &g)| {
                let g = if square {
                    (g * scale) * (g * scale)
                } else {
                    g * scale
                };
                *m = beta.mul_add(*m, (1.0 - beta) * g);
            });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ms: &mut candle_core::CudaStorage,
        ml: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        crate::cuda::adamw_moment(ms, ml, gs, gl, (self.beta, self.scale, self.square))
    }
}

impl InplaceOp3 for AdamwUpdate {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        ps: &mut CpuStorage,
        pl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let (m, v) = (cpu_f32("m", ms, ml)?, cpu_f32("v", vs, vl)?);
        let AdamwUpdate {
            lr,
            decay,
            inv_c1,
            inv_c2,
            eps,
        } = *self;
        cpu_f32_mut(ps, pl)?
            .par_iter_mut()
            .zip(m.par_iter().zip(v.par_iter()))
            .for_each(|(p, (&m, &v))| {
                *p = *p * decay - lr * ((m * inv_c1) / ((v * inv_c2).sqrt() + eps));
            });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ps: &mut candle_core::CudaStorage,
        pl: &Layout,
        ms: &candle_core::CudaStorage,
        ml: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<()> {
        let AdamwUpdate {
            lr,
            decay,
            inv_c1,
            inv_c2,
            eps,
        } = *self;
        crate::cuda::adamw_update(ps, pl, ms, ml, vs, vl, (lr, decay, inv_c1, inv_c2, eps))
    }
}

/// One AdamW step of `param` (f32, contiguous; a variable's tensor) with gradient
/// `grad` and moments `m`, `v` (f32, shaped like `param`), all three updated in place:
/// `m ← β1·m + (1−β1)·s·g`, `v ← β2·v + (1−β2)·(s·g)²`,
/// `param ← param·(1 − lr·wd) − lr·(m/c1)/(√(v/c2) + eps)` with `c_i = 1 − β_i^step`
/// and `s = grad_scale`. The gradient may be any float dtype (cast to f32 first).
pub fn adamw_step(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    hp: AdamwStep,
) -> Result<()> {
    for (what, t) in [("grad", grad), ("m", m), ("v", v)] {
        if t.dims() != param.dims() {
            return err(TwellError::ShapeMismatch {
                what: "adamw_step",
                detail: format!("param {:?}, {what} {:?}", param.dims(), t.dims()),
            });
        }
    }
    if [param, m, v]
        .iter()
        .any(|t| t.dtype() != DType::F32 || !t.is_contiguous())
    {
        return err(TwellError::Invalid(
            "adamw_step: param, m and v must be contiguous f32".into(),
        ));
    }
    if hp.step == 0 {
        return err(TwellError::Invalid("adamw_step: steps count from 1".into()));
    }
    let grad = grad.to_dtype(DType::F32)?.contiguous()?;
    let scale = hp.grad_scale as f32;
    m.inplace_op2(
        &grad,
        &AdamwMoment {
            beta: hp.beta1 as f32,
            scale,
            square: false,
        },
    )?;
    v.inplace_op2(
        &grad,
        &AdamwMoment {
            beta: hp.beta2 as f32,
            scale,
            square: true,
        },
    )?;
    let update = AdamwUpdate {
        lr: hp.lr as f32,
        decay: (1.0 - hp.lr * hp.weight_decay) as f32,
        inv_c1: (1.0 / (1.0 - hp.beta1.powi(hp.step as i32))) as f32,
        inv_c2: (1.0 / (1.0 - hp.beta2.powi(hp.step as i32))) as f32,
        eps: hp.eps as f32,
    };
    param.inplace_op3(m, v, &update)
}
