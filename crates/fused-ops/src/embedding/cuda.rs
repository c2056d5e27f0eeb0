//! Launcher of `kernels/src/embedding.cu`: the gradient of a token embedding's weight.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::{bf16_view, grid_1d, typed_view};
use crate::error::{err, OpError};

const EMBEDDING_PTX: &str = twell_kernels::EMBEDDING;

const THREADS: u32 = 256;
/// Blocks of the grid-stride rounding pass.
const MAX_BLOCKS: usize = 132 * 16;

/// `ids [tokens]` (u32, each below `vocab`, checked by the op) and `grad [tokens, d]`
/// (bf16, contiguous, `d % 8 == 0`): returns `[vocab, d]` bf16, the rows of `grad`
/// summed per id.
pub fn embedding_grad(
    ids: &CudaStorage,
    il: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    vocab: usize,
) -> Result<CudaStorage> {
    let (tokens, d) = gl.shape().dims2()?;
    if !d.is_multiple_of(8) {
        return err(OpError::Invalid(format!(
            "embedding backward on CUDA takes widths that are multiples of 8, got {d}"
        )));
    }
    let iv = typed_view::<u32>("embedding: ids", ids, il, DType::U32)?;
    let gv = bf16_view("embedding: grad", grad, gl)?;
    let dev = grad.device().clone();
    let mut acc = dev.alloc_zeros::<f32>(vocab * d)?;
    let threads = tokens * (d / 8);
    let (tokens_i, d_i) = (tokens as i64, d as i32);
    let func =
        dev.get_or_load_custom_func("embedding_grad_accumulate_bf16", "embedding", EMBEDDING_PTX)?;
    let mut b = func.builder();
    b.arg(&iv).arg(&gv).arg(&mut acc).arg(&tokens_i).arg(&d_i);
    // SAFETY: a thread per (token, 8 columns), bounded in the kernel; ids below vocab
    // (checked by the op) address rows of `acc`.
    unsafe { b.launch(grid_1d(threads.div_ceil(THREADS as usize), THREADS)) }.w()?;
    // SAFETY: the rounding pass writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(vocab * d)? };
    let n = (vocab * d) as i64;
    let func = dev.get_or_load_custom_func("embedding_grad_to_bf16", "embedding", EMBEDDING_PTX)?;
    let mut b = func.builder();
    b.arg(&acc).arg(&mut out).arg(&n);
    let blocks = (vocab * d).div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    // SAFETY: a grid-stride loop bounded by n over both buffers of n values.
    unsafe { b.launch(grid_1d(blocks, THREADS)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
