//! Launcher of `kernels/rope.cu`: rotary position embedding of `[b, t, heads, hd]` rows,
//! or of a range of heads of fused q | k | v rows.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};
use half::bf16;

use super::bf16_view;
use crate::error::{err, TwellError};

const ROPE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"));

/// Threads per block (`ROPE_THREADS` in the .cu).
const ROPE_THREADS: u32 = 256;

/// `x` (`[tokens, heads, hd]` in memory, any shape; `(t, heads, hd)` given) and `cos_sin
/// [t, hd]` (each position's cos, then its sin; bf16, contiguous, `hd % 16 == 0`):
/// returns heads `first..first + count` of each token as `[tokens, count, hd]`, those
/// below `rot_heads` turned, the others copied (`kernels/rope.cu`). `rot_heads = count =
/// heads`, `first = 0` is plain RoPE.
pub fn rope(
    x: &CudaStorage,
    xl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
    (t, heads, hd): (usize, usize, usize),
    (rot_heads, first, count): (usize, usize, usize),
) -> Result<CudaStorage> {
    if rot_heads > heads || first + count > heads || count == 0 {
        return err(TwellError::Invalid(format!(
            "rope: {rot_heads} turned heads and heads {first}..{} of {heads}",
            first + count
        )));
    }
    if !hd.is_multiple_of(16) {
        return err(TwellError::Invalid(format!(
            "rope on CUDA takes head sizes that are multiples of 16, got {hd}"
        )));
    }
    let (xv, cv) = (bf16_view("x", x, xl)?, bf16_view("cos_sin", cs, cl)?);
    let tokens = (xl.shape().elem_count() / (heads * hd)) as i64;
    let rows = tokens as usize * count;
    let threads = rows * (hd / 16);
    let blocks = threads.div_ceil(ROPE_THREADS as usize);
    if blocks > i32::MAX as usize {
        return err(TwellError::Invalid(format!(
            "rope: {threads} threads exceed one grid"
        )));
    }
    let dev = x.device().clone();
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(rows * hd)? };
    let func = dev.get_or_load_custom_func("rope_bf16", "rope", ROPE_PTX)?;
    let (t_i, heads_i, hd_i) = (t as i32, heads as i32, hd as i32);
    let (rot_i, first_i, count_i) = (rot_heads as i32, first as i32, count as i32);
    let mut builder = func.builder();
    builder
        .arg(&xv)
        .arg(&cv)
        .arg(&mut out)
        .arg(&tokens)
        .arg(&t_i)
        .arg(&heads_i)
        .arg(&hd_i)
        .arg(&rot_i)
        .arg(&first_i)
        .arg(&count_i);
    let cfg = super::grid_1d(blocks, ROPE_THREADS);
    // SAFETY: one thread per 8 pairs of a row, bounded in the kernel; shapes checked by
    // the op.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
