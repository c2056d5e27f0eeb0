//! Launcher of `kernels/src/rope.cu`: rotary position embedding of `[b, t, heads, hd]` rows,
//! or of a range of heads of fused q | k | v rows.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::bf16_view;
use crate::error::{err, OpError};

const ROPE_PTX: &str = twell_kernels::ROPE;

/// Threads per block (`ROPE_THREADS` in the .cu).
const ROPE_THREADS: u32 = 256;

/// `x` (`[tokens, heads, hd]` in memory, any shape; `(t, heads, hd)` given) and `cos_sin
/// [t, hd]` (each position's cos, then its sin; bf16, contiguous, `hd % 16 == 0`):
/// returns heads `first..first + count` of each token as `[tokens, count, hd]`, those
/// below `rot_heads` turned, the others copied (`kernels/src/rope.cu`). `rot_heads = count =
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
        return err(OpError::Invalid(format!(
            "rope: {rot_heads} turned heads and heads {first}..{} of {heads}",
            first + count
        )));
    }
    if !hd.is_multiple_of(16) {
        return err(OpError::Invalid(format!(
            "rope on CUDA takes head sizes that are multiples of 16, got {hd}"
        )));
    }
    let (xv, cv) = (bf16_view("x", x, xl)?, bf16_view("cos_sin", cs, cl)?);
    let tokens = (xl.shape().elem_count() / (heads * hd)) as i64;
    let rows = tokens as usize * count;
    let threads = rows * (hd / 16);
    let blocks = threads.div_ceil(ROPE_THREADS as usize);
    if blocks > i32::MAX as usize {
        return err(OpError::Invalid(format!(
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
    let cfg = crate::cuda::grid_1d(blocks, ROPE_THREADS);
    // SAFETY: one thread per 8 pairs of a row, bounded in the kernel; shapes checked by
    // the op.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Turns the first `rot_heads` heads of each token row of `x` (`[tokens, heads, hd]` in
/// memory, contiguous bf16) in place by `cos_sin [t, hd]`; the other heads are left as
/// they are (`rope_in_place_bf16` in `kernels/src/rope.cu`).
pub fn rope_in_place(
    x: &mut CudaStorage,
    xl: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
    (t, heads, hd): (usize, usize, usize),
    rot_heads: usize,
) -> Result<()> {
    if rot_heads == 0 || rot_heads > heads || !hd.is_multiple_of(16) {
        return err(OpError::Invalid(format!(
            "rope in place: {rot_heads} turned heads of {heads}, head size {hd} (CUDA takes \
             multiples of 16)"
        )));
    }
    crate::cuda::check_dtype("rope in place: x", x, DType::BF16)?;
    let Some((a, b)) = xl.contiguous_offsets() else {
        return err(OpError::Invalid(
            "rope in place: x must be contiguous".into(),
        ));
    };
    let cv = bf16_view("cos_sin", cs, cl)?;
    let tokens = ((b - a) / (heads * hd)) as i64;
    let threads = tokens as usize * rot_heads * (hd / 16);
    let blocks = threads.div_ceil(ROPE_THREADS as usize);
    if blocks > i32::MAX as usize {
        return err(OpError::Invalid(format!(
            "rope in place: {threads} threads exceed one grid"
        )));
    }
    let dev = x.device().clone();
    let mut target = x.as_cuda_slice_mut::<bf16>()?.slice_mut(a..b);
    let func = dev.get_or_load_custom_func("rope_in_place_bf16", "rope", ROPE_PTX)?;
    let (t_i, heads_i, hd_i, rot_i) = (t as i32, heads as i32, hd as i32, rot_heads as i32);
    let mut builder = func.builder();
    builder
        .arg(&mut target)
        .arg(&cv)
        .arg(&tokens)
        .arg(&t_i)
        .arg(&heads_i)
        .arg(&hd_i)
        .arg(&rot_i);
    // SAFETY: one thread per 8 pairs of a turned head's row, bounded in the kernel, over
    // the contiguous range of x; shapes checked by the op.
    unsafe { builder.launch(crate::cuda::grid_1d(blocks, ROPE_THREADS)) }.w()?;
    Ok(())
}
