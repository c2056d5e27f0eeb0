//! `kl_divergence`: the distillation loss, mean over positions of `KL(p ‖ q)` with `p`
//! and `q` the softmaxes of a teacher's and a student's logits `[N, V]`, as one op with
//! a backward.
//!
//! As candle ops ([`kl_divergence_reference`]: two log-softmaxes, exp, subtract,
//! multiply, sum) the loss and its backward make some twenty-five f32 passes over
//! `[tokens, vocab]` tensors and keep several of them alive for the backward, in a step
//! where the vocabulary is the widest axis (49,152 for SmolLM2). The op reads both
//! logits once forward and once backward, and keeps three floats per row. The GPU tests
//! (`tests/gpu/ops.rs`) check its CUDA kernel against the reference.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::{storage_from_f32, Rows};

/// The op behind [`kl_divergence`]: inputs `(student [N, V], teacher [N, V])`, the
/// teacher in the student's dtype or in f32, output `[3, N]` f32: each row's KL (never below 0, where rounding would put
/// it), then the student's and the teacher's log-sum-exps (kept for the backward). Only
/// the student gets a gradient.
pub struct KlDivergence;

/// `(N, V)` of a call, checked.
fn dims(student: &Layout, teacher: &Layout) -> Result<(usize, usize)> {
    let (n, v) = student.shape().dims2()?;
    if teacher.dims() != [n, v] || n == 0 || v == 0 {
        return err(OpError::ShapeMismatch {
            what: "kl_divergence",
            detail: format!(
                "student {:?}, teacher {:?}: want two non-empty [N, V] logits of one shape",
                student.dims(),
                teacher.dims()
            ),
        });
    }
    Ok((n, v))
}

/// `log Σ exp(x)` of a row in f64, shifted by its maximum so `exp` stays finite.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a)) as f64;
    max + row
        .iter()
        .map(|&a| (a as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// The logits of a CPU call, widened to f32.
struct CpuInputs {
    n: usize,
    v: usize,
    student: Vec<f32>,
    teacher: Vec<f32>,
    dtype: DType,
}

impl CpuInputs {
    fn read(ss: &CpuStorage, sl: &Layout, ts: &CpuStorage, tl: &Layout) -> Result<Self> {
        let (n, v) = dims(sl, tl)?;
        let student = Rows::new("kl_divergence: student logits", ss, sl)?;
        let teacher = Rows::new("kl_divergence: teacher logits", ts, tl)?;
        Ok(Self {
            n,
            v,
            dtype: student.dtype(),
            student: student.to_f32_vec(),
            teacher: teacher.to_f32_vec(),
        })
    }
}

impl CustomOp2 for KlDivergence {
    fn name(&self) -> &'static str {
        "kl-divergence"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuInputs {
            n,
            v,
            student,
            teacher,
            ..
        } = CpuInputs::read(ss, sl, ts, tl)?;
        let rows: Vec<[f32; 3]> = student
            .par_chunks(v)
            .zip(teacher.par_chunks(v))
            .map(|(s, t)| {
                let (lse_s, lse_t) = (log_sum_exp(s), log_sum_exp(t));
                // In f64: near a student that matches its teacher the terms cancel to a
                // KL of 1e-7 and less, which f32 sums can round below zero. A p that
                // underflows to 0 meets a finite log p, so its terms are 0.
                let kl: f64 = s
                    .iter()
                    .zip(t)
                    .map(|(&a, &b)| {
                        let log_p = b as f64 - lse_t;
                        log_p.exp() * (log_p - (a as f64 - lse_s))
                    })
                    .sum();
                let (kl, lse_s, lse_t) = (kl.max(0.0) as f32, lse_s as f32, lse_t as f32);
                [kl, lse_s, lse_t]
            })
            .collect();
        let mut out = vec![0f32; 3 * n];
        for (i, row) in rows.iter().enumerate() {
            for (k, &value) in row.iter().enumerate() {
                out[k * n + i] = value;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((3, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, v) = dims(sl, tl)?;
        let out = cuda::kl_divergence((ss, sl), (ts, tl), (n, v))?;
        Ok((out, Shape::from((3, n))))
    }

    /// Only the KL rows reach the loss, so the student's gradient is `g · (q − p)` per
    /// row; the teacher is a target and gets none.
    fn bwd(
        &self,
        student: &Tensor,
        teacher: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let aux = Tensor::cat(&[res.get(1)?, res.get(2)?, grad_res.get(0)?], 0)?;
        let grad = student.apply_op3_no_bwd(teacher, &aux, &KlDivergenceBackward)?;
        Ok((Some(grad), None))
    }
}

/// The backward of [`KlDivergence`]: inputs `(student, teacher, [lse_s | lse_t | g]
/// [3N] f32)`, output `g · (q − p)` shaped and typed like the student's logits.
struct KlDivergenceBackward;

impl CustomOp3 for KlDivergenceBackward {
    fn name(&self) -> &'static str {
        "kl-divergence-backward"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuInputs {
            n,
            v,
            student,
            teacher,
            dtype,
        } = CpuInputs::read(ss, sl, ts, tl)?;
        let aux = Rows::new("kl_divergence: lse and gradient", xs, xl)?.to_f32_vec();
        let mut out = vec![0f32; n * v];
        out.par_chunks_mut(v)
            .zip(student.par_chunks(v).zip(teacher.par_chunks(v)))
            .enumerate()
            .for_each(|(i, (o, (s, t)))| {
                let (lse_s, lse_t, g) = (aux[i], aux[n + i], aux[2 * n + i]);
                for ((oj, &a), &b) in o.iter_mut().zip(s).zip(t) {
                    *oj = g * ((a - lse_s).exp() - (b - lse_t).exp());
                }
            });
        Ok((storage_from_f32(out, dtype)?, Shape::from((n, v))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, v) = dims(sl, tl)?;
        let out = cuda::kl_divergence_bwd((ss, sl), (ts, tl), (xs, xl), (n, v))?;
        Ok((out, Shape::from((n, v))))
    }
}

/// The student's and the teacher's logits as `[positions, vocab]`, checked: one shape,
/// nothing empty.
fn as_rows(student: &Tensor, teacher: &Tensor) -> Result<(Tensor, Tensor)> {
    if student.dims() != teacher.dims() {
        return err(OpError::ShapeMismatch {
            what: "kl_divergence",
            detail: format!(
                "student logits {:?} and teacher logits {:?} differ in shape",
                student.dims(),
                teacher.dims()
            ),
        });
    }
    let vocab = student.dim(D::Minus1)?;
    let positions = student.elem_count() / vocab.max(1);
    if positions == 0 || vocab == 0 {
        return err(OpError::Invalid(format!(
            "kl_divergence: empty logits {:?}",
            student.dims()
        )));
    }
    Ok((
        student.reshape((positions, vocab))?,
        teacher.detach().reshape((positions, vocab))?,
    ))
}

/// Mean over positions of `KL(p ‖ q)`, `p = softmax(teacher)`, `q = softmax(student)`,
/// from logits of any leading shape (`[.., vocab]`), as a scalar f32. Differentiable in
/// `student` only: its gradient per position is `(q − p) / positions`. The op
/// ([`kl_divergence_fused`]) wherever it has a kernel: the CPU, and CUDA for bf16
/// student logits; [`kl_divergence_reference`] for other dtypes on CUDA.
pub fn kl_divergence(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    if student.device().is_cuda() && student.dtype() != DType::BF16 {
        return kl_divergence_reference(student, teacher);
    }
    kl_divergence_fused(student, teacher)
}

/// [`kl_divergence`] as one op on any device: f64 sums on the CPU, the kernels of
/// `kernels/src/kl_divergence.cu` on CUDA (a bf16 student; other dtypes there are an
/// error). An f32 teacher is read as it is (rounding a peaked teacher to bf16 moves its
/// probabilities by a few percent); any other is read in the student's dtype.
pub fn kl_divergence_fused(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    let (student, teacher) = as_rows(student, teacher)?;
    let teacher = match teacher.dtype() {
        DType::F32 => teacher,
        _ => teacher.to_dtype(student.dtype())?,
    }
    .contiguous()?;
    let rows = student.contiguous()?.apply_op2(&teacher, KlDivergence)?;
    rows.get(0)?.mean_all()
}

/// The same loss as candle ops in f32: what [`kl_divergence`] is checked against.
pub fn kl_divergence_reference(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    let (student, teacher) = as_rows(student, teacher)?;
    let log_q = log_softmax_rows(&student.to_dtype(DType::F32)?)?;
    let log_p = log_softmax_rows(&teacher.to_dtype(DType::F32)?)?.detach();
    let p = log_p.exp()?;
    // A p that underflows to 0 meets a finite log p, so its terms are 0, never NaN.
    (p * (log_p - log_q)?)?.sum(1)?.mean(0)
}

/// `log softmax` of each row, shifted by the row's detached maximum (the shift cancels
/// out of the value and the gradient, and keeps `exp` finite).
fn log_softmax_rows(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(1)?.detach())?;
    let log_sum = shifted.exp()?.sum_keepdim(1)?.log()?;
    shifted.broadcast_sub(&log_sum)
}
