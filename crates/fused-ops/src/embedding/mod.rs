//! `embedding`: a token embedding (a gather of weight rows) whose backward runs as one
//! kernel pass on CUDA.
//!
//! candle's `Embedding` differentiates through `index_select`, whose backward is an
//! `index_add` in bf16 that ran on two thread blocks: 4.3 ms of a 2B model's training
//! step on an H200 for 8,192 tokens. The CUDA backward here (`kernels/src/embedding.cu`)
//! adds the gradient rows into an f32 accumulator with atomics and rounds it once.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::error::{err, OpError};

/// The op behind [`embedding`]: inputs `(ids [n] u32, weight [vocab, d])`, output `[n,
/// d]`, the rows of `weight` at `ids`.
pub struct Embedding;

/// `(n, vocab, d)` of a call, checked.
fn dims(ids: &Layout, weight: &Layout) -> Result<(usize, usize, usize)> {
    match (ids.dims(), weight.dims()) {
        (&[n], &[vocab, d]) => Ok((n, vocab, d)),
        _ => err(OpError::ShapeMismatch {
            what: "embedding",
            detail: format!(
                "ids {:?}, weight {:?}: want ids [n] and weight [vocab, d]",
                ids.dims(),
                weight.dims()
            ),
        }),
    }
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        is: &CpuStorage,
        il: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, _, d) = dims(il, wl)?;
        Ok((ws.index_select(is, wl, il, 0)?, Shape::from((n, d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        is: &candle_core::CudaStorage,
        il: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, _, d) = dims(il, wl)?;
        Ok((ws.index_select(is, wl, il, 0)?, Shape::from((n, d))))
    }

    /// The weight's gradient: the rows of `grad` summed per id (a kernel on CUDA in
    /// bf16, candle's `index_add` in f32 elsewhere). The ids get none.
    fn bwd(
        &self,
        ids: &Tensor,
        weight: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, d) = weight.dims2()?;
        let grad = grad.contiguous()?;
        let dw = if grad.device().is_cuda() && grad.dtype() == DType::BF16 && d.is_multiple_of(8) {
            ids.apply_op2_no_bwd(&grad, &EmbeddingGrad { vocab })?
        } else {
            Tensor::zeros((vocab, d), DType::F32, grad.device())?
                .index_add(ids, &grad.to_dtype(DType::F32)?, 0)?
                .to_dtype(weight.dtype())?
        };
        Ok((None, Some(dw)))
    }
}

/// The CUDA backward of [`Embedding`]: inputs `(ids [n], grad [n, d])`, output `[vocab,
/// d]` bf16.
struct EmbeddingGrad {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    vocab: usize,
}

impl CustomOp2 for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        err(OpError::Invalid(
            "embedding's backward kernel is CUDA-only; the CPU takes candle's index_add".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        is: &candle_core::CudaStorage,
        il: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = gl.dims().last().copied().unwrap_or(0);
        let out = cuda::embedding_grad(is, il, gs, gl, self.vocab)?;
        Ok((out, Shape::from((self.vocab, d))))
    }
}

/// The rows of `weight [vocab, d]` at `ids` (u32, any shape): `[ids.dims(), d]`,
/// differentiable in `weight`. Ids at or past `vocab` are refused (one read-back of
/// their maximum), where a gather or a scatter would touch memory past the weight.
pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if ids.dtype() != DType::U32 {
        return err(OpError::Invalid(format!(
            "embedding: ids must be u32, got {:?}",
            ids.dtype()
        )));
    }
    let (vocab, d) = weight.dims2()?;
    let flat = ids.flatten_all()?;
    if flat.elem_count() > 0 {
        let max = flat.max(0)?.to_scalar::<u32>()? as usize;
        if max >= vocab {
            return err(OpError::Invalid(format!(
                "embedding: token id {max} is outside the vocabulary of {vocab}"
            )));
        }
    }
    let out = flat
        .contiguous()?
        .apply_op2(&weight.contiguous()?, Embedding)?;
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    crate::checks::reshaped(&out, &dims)
}
