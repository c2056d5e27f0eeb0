//! Launcher of `kernels/src/attention_softmax_grad.cu`: the row-wise middle of causal
//! attention's backward (probabilities and score gradients from recomputed scores).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::bf16_view;
use crate::error::{err, OpError};

const SOFTMAX_GRAD_PTX: &str = twell_kernels::ATTENTION_SOFTMAX_GRAD;

/// Threads per block (`SOFTMAX_GRAD_THREADS` in the .cu); one warp per row.
const THREADS: u32 = 256;
const ROWS_PER_BLOCK: usize = THREADS as usize / 32;

/// `s, dp [rows, total]` (bf16, contiguous), `d [rows]` (f32): returns `[2, rows, total]`
/// bf16, the probabilities then the score gradients (times `scale`). Row `r` is query
/// `r % t` of its (batch, head), at position `total − t + r % t`.
#[allow(clippy::too_many_arguments)]
pub fn attention_softmax_grad(
    s: &CudaStorage,
    sl: &Layout,
    dp: &CudaStorage,
    dpl: &Layout,
    d: &CudaStorage,
    dl: &Layout,
    (rows, t, total): (usize, usize, usize),
    scale: f32,
) -> Result<CudaStorage> {
    let (sv, dpv) = (bf16_view("scores", s, sl)?, bf16_view("dp", dp, dpl)?);
    if d.dtype() != DType::F32 {
        return err(OpError::Invalid(format!(
            "attention_softmax_grad: d must be f32, got {:?}",
            d.dtype()
        )));
    }
    let dv = match dl.contiguous_offsets() {
        Some((a, b)) => d.as_cuda_slice::<f32>()?.slice(a..b),
        None => {
            return err(OpError::Invalid(
                "attention_softmax_grad: d must be contiguous".into(),
            ))
        }
    };
    let blocks = rows.div_ceil(ROWS_PER_BLOCK);
    if blocks > i32::MAX as usize || total > i32::MAX as usize {
        return err(OpError::Invalid(format!(
            "attention_softmax_grad: {rows} rows of {total} exceed one grid"
        )));
    }
    let dev = s.device().clone();
    // SAFETY: the kernel writes every element of both halves.
    let mut out = unsafe { dev.alloc::<bf16>(2 * rows * total)? };
    let func = dev.get_or_load_custom_func(
        "attention_softmax_grad_bf16",
        "attention_softmax_grad",
        SOFTMAX_GRAD_PTX,
    )?;
    let (rows_i, t_i, total_i) = (rows as i64, t as i32, total as i32);
    let mut builder = func.builder();
    builder
        .arg(&sv)
        .arg(&dpv)
        .arg(&dv)
        .arg(&mut out)
        .arg(&rows_i)
        .arg(&t_i)
        .arg(&total_i)
        .arg(&scale);
    let cfg = crate::cuda::grid_1d(blocks, THREADS);
    // SAFETY: one warp per row, bounded in the kernel; shapes checked by the op.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `D [b, heads, t]` (f32) = rowsum(dO ⊙ O) per (batch, head, query), from `grad` and
/// `out` as contiguous bf16 token rows `[b·t, heads·hd]` (`hd % 8 == 0`).
pub fn attention_row_dot(
    grad: &CudaStorage,
    gl: &Layout,
    out: &CudaStorage,
    ol: &Layout,
    (t, heads, hd): (usize, usize, usize),
) -> Result<CudaStorage> {
    let (gv, ov) = (bf16_view("grad", grad, gl)?, bf16_view("out", out, ol)?);
    let rows = gl.shape().elem_count() / hd;
    let blocks = rows.div_ceil(THREADS as usize);
    if blocks > i32::MAX as usize {
        return err(OpError::Invalid(format!(
            "attention_row_dot: {rows} rows exceed one grid"
        )));
    }
    let dev = grad.device().clone();
    // SAFETY: the kernel writes every row's sum.
    let mut d = unsafe { dev.alloc::<f32>(rows)? };
    let func = dev.get_or_load_custom_func(
        "attention_row_dot_bf16",
        "attention_softmax_grad",
        SOFTMAX_GRAD_PTX,
    )?;
    let (rows_i, t_i, heads_i, hd_i) = (rows as i64, t as i32, heads as i32, hd as i32);
    let mut builder = func.builder();
    builder
        .arg(&gv)
        .arg(&ov)
        .arg(&mut d)
        .arg(&rows_i)
        .arg(&t_i)
        .arg(&heads_i)
        .arg(&hd_i);
    // SAFETY: a thread per row, bounded in the kernel; both inputs hold rows · hd values
    // (checked by the op).
    unsafe { builder.launch(crate::cuda::grid_1d(blocks, THREADS)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(d, dev))
}
