//! `adamw_step`: one AdamW update of an f32 parameter, in place, as two ops.
//!
//! As candle ops an update is some seventeen elementwise passes over the parameter and
//! a copy into the variable; a 1.5 B-parameter model spent about 130 ms a training step
//! there on an H200. The ops here update the moments and then the parameter in place,
//! one pass each (`kernels/src/adamw.cu` on CUDA, rayon on the CPU), and take the gradient
//! clipping scale along, so the clipped gradient is never written either.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};

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

/// One moment's update with the (scaled, possibly squared) gradient `g`.
fn moment(beta: f32, m: f32, g: f32) -> f32 {
    beta.mul_add(m, (1.0 - beta) * g)
}

impl AdamwUpdate {
    /// The parameter after the step, from its moments.
    fn apply(&self, p: f32, m: f32, v: f32) -> f32 {
        p * self.decay - self.lr * ((m * self.inv_c1) / ((v * self.inv_c2).sqrt() + self.eps))
    }
}

/// A contiguous f32 slice of a CPU storage.
fn cpu_f32<'a>(what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => err(OpError::Invalid(format!(
            "adamw: {what} must be contiguous f32"
        ))),
    }
}

fn cpu_f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => err(OpError::Invalid(
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
                *m = moment(beta, *m, g);
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
        cuda::adamw_moment(ms, ml, gs, gl, (self.beta, self.scale, self.square))
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
        cpu_f32_mut(ps, pl)?
            .par_iter_mut()
            .zip(m.par_iter().zip(v.par_iter()))
            .for_each(|(p, (&m, &v))| *p = self.apply(*p, m, v));
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
        cuda::adamw_update(ps, pl, ms, ml, vs, vl, (lr, decay, inv_c1, inv_c2, eps))
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
            return err(OpError::ShapeMismatch {
                what: "adamw_step",
                detail: format!("param {:?}, {what} {:?}", param.dims(), t.dims()),
            });
        }
    }
    if [param, m, v]
        .iter()
        .any(|t| t.dtype() != DType::F32 || !t.is_contiguous())
    {
        return err(OpError::Invalid(
            "adamw_step: param, m and v must be contiguous f32".into(),
        ));
    }
    if hp.step == 0 {
        return err(OpError::Invalid("adamw_step: steps count from 1".into()));
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
    param.inplace_op3(m, v, &AdamwUpdate::of(&hp))
}

impl AdamwUpdate {
    /// The update's constants at step `hp.step`, bias corrections included.
    fn of(hp: &AdamwStep) -> Self {
        Self {
            lr: hp.lr as f32,
            decay: (1.0 - hp.lr * hp.weight_decay) as f32,
            inv_c1: (1.0 / (1.0 - hp.beta1.powi(hp.step as i32))) as f32,
            inv_c2: (1.0 / (1.0 - hp.beta2.powi(hp.step as i32))) as f32,
            eps: hp.eps as f32,
        }
    }
}

/// The mixed-precision step: `state [3, n]` (f32 master, m, v) updated in place from a
/// bf16 or f32 gradient, one pass.
struct AdamwMixed {
    beta1: f32,
    beta2: f32,
    scale: f32,
    update: AdamwUpdate,
}

impl InplaceOp2 for AdamwMixed {
    fn name(&self) -> &'static str {
        "adamw-mixed"
    }

    fn cpu_fwd(
        &self,
        ss: &mut CpuStorage,
        sl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        let g: Vec<f32> = match (gs, gl.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => v[a..b].to_vec(),
            (CpuStorage::BF16(v), Some((a, b))) => v[a..b].iter().map(|x| x.to_f32()).collect(),
            _ => {
                return err(OpError::Invalid(
                    "adamw: the gradient must be contiguous f32 or bf16".into(),
                ))
            }
        };
        let state = cpu_f32_mut(ss, sl)?;
        let n = g.len();
        if state.len() != 3 * n {
            return err(OpError::ShapeMismatch {
                what: "adamw_step_mixed",
                detail: format!("state holds {} values, want 3 x {n}", state.len()),
            });
        }
        let (master, moments) = state.split_at_mut(n);
        let (m, v) = moments.split_at_mut(n);
        let AdamwMixed {
            beta1,
            beta2,
            scale,
            update: u,
        } = *self;
        master
            .par_iter_mut()
            .zip(m.par_iter_mut().zip(v.par_iter_mut()))
            .zip(g.par_iter())
            .for_each(|((p, (m, v)), &g)| {
                let g = g * scale;
                *m = moment(beta1, *m, g);
                *v = moment(beta2, *v, g * g);
                *p = u.apply(*p, *m, *v);
            });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &mut candle_core::CudaStorage,
        sl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let u = self.update;
        let hp = [
            self.beta1, self.beta2, self.scale, u.lr, u.decay, u.inv_c1, u.inv_c2, u.eps,
        ];
        cuda::adamw_mixed(ss, sl, gs, gl, hp)
    }
}

/// `param (bf16) ← round(master)`, the master being the first row of the state.
struct Bf16FromMaster;

impl InplaceOp2 for Bf16FromMaster {
    fn name(&self) -> &'static str {
        "bf16-from-master"
    }

    fn cpu_fwd(
        &self,
        ps: &mut CpuStorage,
        pl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let state = cpu_f32("state", ss, sl)?;
        match (ps, pl.contiguous_offsets()) {
            (CpuStorage::BF16(p), Some((a, b))) if state.len() == 3 * (b - a) => {
                p[a..b]
                    .par_iter_mut()
                    .zip(state[..b - a].par_iter())
                    .for_each(|(p, &w)| *p = half::bf16::from_f32(w));
                Ok(())
            }
            _ => err(OpError::Invalid(
                "adamw: the variable must be contiguous bf16 with a [3, n] state".into(),
            )),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ps: &mut candle_core::CudaStorage,
        pl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        cuda::bf16_from_master(ps, pl, ss, sl)
    }
}

/// One AdamW step with mixed precision: `param` is a bf16 variable, `state [3, n]` its
/// f32 master weights and moments (rows master, m, v; `n` the element count of `param`),
/// `grad` a bf16 or f32 gradient. The state takes the step of [`adamw_step`] in one
/// pass, then `param` is written as the rounded master. Beside that two-pass update
/// of an f32 variable, the model then computes on bf16 variables directly: no bf16 copy
/// of each weight per step in the autograd graph, and gradients that land as bf16.
pub fn adamw_step_mixed(
    param: &Tensor,
    grad: &Tensor,
    state: &Tensor,
    hp: AdamwStep,
) -> Result<()> {
    let n = param.elem_count();
    if grad.elem_count() != n || state.dims() != [3, n] {
        return err(OpError::ShapeMismatch {
            what: "adamw_step_mixed",
            detail: format!(
                "param {:?}, grad {:?}, state {:?}: want grad like param and state [3, {n}]",
                param.dims(),
                grad.dims(),
                state.dims()
            ),
        });
    }
    if param.dtype() != DType::BF16
        || state.dtype() != DType::F32
        || !matches!(grad.dtype(), DType::BF16 | DType::F32)
        || !param.is_contiguous()
        || !state.is_contiguous()
    {
        return err(OpError::Invalid(format!(
            "adamw_step_mixed: want a contiguous bf16 param, a bf16 or f32 grad and a \
             contiguous f32 state, got {:?}, {:?}, {:?}",
            param.dtype(),
            grad.dtype(),
            state.dtype()
        )));
    }
    if hp.step == 0 {
        return err(OpError::Invalid("adamw_step: steps count from 1".into()));
    }
    let op = AdamwMixed {
        beta1: hp.beta1 as f32,
        beta2: hp.beta2 as f32,
        scale: hp.grad_scale as f32,
        update: AdamwUpdate::of(&hp),
    };
    state.inplace_op2(&grad.contiguous()?, &op)?;
    param.inplace_op2(state, &Bf16FromMaster)
}

/// The op behind [`sum_squares`].
struct SumSquares;

impl candle_core::CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, candle_core::Shape)> {
        let Some((a, b)) = l.contiguous_offsets() else {
            return err(OpError::Invalid(
                "sum_squares: input must be contiguous".into(),
            ));
        };
        let total: f64 = match s {
            CpuStorage::F32(v) => v[a..b].par_iter().map(|&x| (x as f64) * (x as f64)).sum(),
            CpuStorage::BF16(v) => v[a..b]
                .par_iter()
                .map(|x| (x.to_f64()) * (x.to_f64()))
                .sum(),
            _ => {
                return err(OpError::Invalid(
                    "sum_squares: input must be f32 or bf16".into(),
                ))
            }
        };
        Ok((
            CpuStorage::F32(vec![total as f32]),
            candle_core::Shape::from(1),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        Ok((cuda::sum_squares(s, l)?, candle_core::Shape::from(1)))
    }
}

/// `Σ x²` of a bf16 or f32 tensor as a one-element f32 tensor, in one read of `x` (for
/// the global norm that gradient clipping needs; no gradient).
pub fn sum_squares(x: &Tensor) -> Result<Tensor> {
    if !matches!(x.dtype(), DType::BF16 | DType::F32) {
        return err(OpError::Invalid(format!(
            "sum_squares: input must be f32 or bf16, got {:?}",
            x.dtype()
        )));
    }
    x.contiguous()?.apply_op1_no_bwd(&SumSquares)
}
