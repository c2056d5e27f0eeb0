//! `cross_entropy`: the language-model loss, softmax cross-entropy of `logits [N, V]`
//! against `targets [N]`, as one op with a backward.
//!
//! candle's `loss::cross_entropy` is `log_softmax` (max, subtract, exp, sum, log,
//! subtract) and a gather over f32 logits: with its backward some fifteen passes over
//! the largest tensor of a training step (`[tokens, vocab]`). The CUDA kernels
//! (`kernels/src/cross_entropy.cu`) read bf16 logits once forward and once backward.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::error::{err, OpError};
use crate::host::Rows;

/// The op behind [`cross_entropy`]: inputs `(logits [N, V], targets [N] u32)`, output
/// `[2, N]` f32: each row's loss, then its log-sum-exp (kept for the backward).
pub struct CrossEntropy;

/// `(N, V)` of a call, checked.
fn dims(logits: &Layout, targets: &Layout) -> Result<(usize, usize)> {
    let (n, v) = logits.shape().dims2()?;
    if targets.dims() != [n] || v == 0 {
        return err(OpError::ShapeMismatch {
            what: "cross_entropy",
            detail: format!(
                "logits {:?}, targets {:?}: want logits [N, V] with V > 0 and targets [N]",
                logits.dims(),
                targets.dims()
            ),
        });
    }
    Ok((n, v))
}

/// The targets of a CPU call, each checked against the vocabulary.
fn cpu_targets(s: &CpuStorage, l: &Layout, v: usize) -> Result<Vec<u32>> {
    let all = match s {
        CpuStorage::U32(t) => t,
        _ => {
            return err(OpError::Invalid(format!(
                "cross_entropy: targets must be u32, got {:?}",
                s.dtype()
            )))
        }
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        return err(OpError::Invalid(
            "cross_entropy: targets must be contiguous".into(),
        ));
    };
    let targets = all[a..b].to_vec();
    check_targets(targets.iter().copied().max(), v)?;
    Ok(targets)
}

/// The logits (as f32) and checked targets of a CPU call.
struct CpuInputs {
    n: usize,
    v: usize,
    targets: Vec<u32>,
    x: Vec<f32>,
    dtype: DType,
}

impl CpuInputs {
    fn read(xs: &CpuStorage, xl: &Layout, ts: &CpuStorage, tl: &Layout) -> Result<Self> {
        let (n, v) = dims(xl, tl)?;
        let targets = cpu_targets(ts, tl, v)?;
        let x = Rows::new("logits", xs, xl)?;
        Ok(Self {
            n,
            v,
            targets,
            dtype: x.dtype(),
            x: x.to_f32_vec(),
        })
    }
}

fn check_targets(max: Option<u32>, v: usize) -> Result<()> {
    match max {
        Some(t) if t as usize >= v => err(OpError::Invalid(format!(
            "cross_entropy: target {t} is outside the vocabulary of {v}"
        ))),
        _ => Ok(()),
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuInputs {
            n, v, targets, x, ..
        } = CpuInputs::read(xs, xl, ts, tl)?;
        let mut out = vec![0f32; 2 * n];
        let rows: Vec<(f32, f32)> = x
            .par_chunks(v)
            .zip(targets.par_iter())
            .map(|(row, &t)| {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
                let lse = max + row.iter().map(|&a| (a - max).exp()).sum::<f32>().ln();
                (lse - row[t as usize], lse)
            })
            .collect();
        for (i, (loss, lse)) in rows.into_iter().enumerate() {
            out[i] = loss;
            out[n + i] = lse;
        }
        Ok((CpuStorage::F32(out), Shape::from((2, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, v) = dims(xl, tl)?;
        let out = cuda::cross_entropy(xs, xl, ts, tl, (n, v))?;
        Ok((out, Shape::from((2, n))))
    }

    /// Only the losses reach the loss ([`cross_entropy`] returns no lse), so the
    /// gradient is `g · (softmax − onehot)` per row.
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let lse_grad = Tensor::cat(&[res.get(1)?, grad_res.get(0)?], 0)?;
        let grad = logits.apply_op3_no_bwd(targets, &lse_grad, &CrossEntropyBackward)?;
        Ok((Some(grad), None))
    }
}

/// The backward of [`CrossEntropy`]: inputs `(logits [N, V], targets [N], [lse | g] [2N]
/// f32)`, output `g · (softmax − onehot)` shaped and typed like the logits.
struct CrossEntropyBackward;

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuInputs {
            n,
            v,
            targets,
            x,
            dtype,
        } = CpuInputs::read(xs, xl, ts, tl)?;
        let lg = Rows::new("lse and grad", gs, gl)?.to_f32_vec();
        let mut out = vec![0f32; n * v];
        out.par_chunks_mut(v)
            .zip(x.par_chunks(v))
            .enumerate()
            .for_each(|(i, (o, row))| {
                let (lse, g) = (lg[i], lg[n + i]);
                for (oj, &a) in o.iter_mut().zip(row) {
                    *oj = g * (a - lse).exp();
                }
                o[targets[i] as usize] -= g;
            });
        Ok((
            crate::host::storage_from_f32(out, dtype)?,
            Shape::from((n, v)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, v) = dims(xl, tl)?;
        let out = cuda::cross_entropy_bwd(xs, xl, ts, tl, gs, gl, (n, v))?;
        Ok((out, Shape::from((n, v))))
    }
}

/// Mean softmax cross-entropy of `logits [N, V]` against `targets [N]` (u32), as a
/// scalar f32, differentiable in the logits. On CUDA in bf16 and on the CPU our op
/// (f32 math); CUDA in other dtypes takes candle's `loss::cross_entropy`. A target
/// outside the vocabulary is an error (on CUDA this reads the largest target back).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if targets.dtype() != DType::U32 {
        return err(OpError::Invalid(format!(
            "cross_entropy: targets must be u32, got {:?}",
            targets.dtype()
        )));
    }
    dims(logits.layout(), targets.layout())?;
    if logits.device().is_cuda() && logits.dtype() != DType::BF16 {
        return candle_nn::loss::cross_entropy(logits, targets);
    }
    if logits.device().is_cuda() {
        let v = logits.dim(1)?;
        check_targets(Some(targets.max(0)?.to_scalar::<u32>()?), v)?;
    }
    let both = logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)?;
    both.get(0)?.mean_all()
}
