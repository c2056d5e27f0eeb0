//! Launcher of `kernels/src/add_rms_norm.cu`: the residual add and the RMS norm after it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};
use half::bf16;

use crate::cuda::bf16_view;
use crate::error::{err, OpError};

const ADD_RMS_NORM_PTX: &str = twell_kernels::ADD_RMS_NORM;

/// Threads per row (`NORM_THREADS` in the .cu).
const NORM_THREADS: u32 = 256;
/// Widest row the kernel keeps in registers (`NORM_MAX_VECS` 16-byte vectors a thread).
pub const MAX_HIDDEN: usize = 256 * 4 * 8;

/// `x, y [m, d]` and `alpha [d]` (bf16, contiguous, `d % 8 == 0`, `d <= MAX_HIDDEN`):
/// returns `[2m, d]`, the sums `x + y` then the normalised sums. Without `y`, the norm
/// of `x` alone, `[m, d]`.
pub fn add_rms_norm(
    x: &CudaStorage,
    xl: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    alpha: &CudaStorage,
    al: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    let (m, d) = xl.shape().dims2()?;
    if !d.is_multiple_of(8) || d > MAX_HIDDEN || m > i32::MAX as usize {
        return err(OpError::Invalid(format!(
            "add_rms_norm on CUDA takes hidden % 8 == 0 and <= {MAX_HIDDEN}, got [{m}, {d}]"
        )));
    }
    let (xv, av) = (bf16_view("x", x, xl)?, bf16_view("alpha", alpha, al)?);
    let yv = match y {
        Some((y, yl)) => Some(bf16_view("y", y, yl)?),
        None => None,
    };
    let halves = if yv.is_some() { 2 } else { 1 };
    let dev = x.device().clone();
    // SAFETY: the kernel writes every row of each half.
    let mut out = unsafe { dev.alloc::<bf16>(halves * m * d)? };
    let func =
        dev.get_or_load_custom_func("add_rms_norm_bf16", "add_rms_norm", ADD_RMS_NORM_PTX)?;
    let (m_i, d_i) = (m as i32, d as i32);
    // A null y: the kernel normalises x alone.
    let no_y: u64 = 0;
    let mut b = func.builder();
    b.arg(&xv);
    match yv.as_ref() {
        Some(yv) => b.arg(yv),
        None => b.arg(&no_y),
    };
    b.arg(&av).arg(&mut out).arg(&m_i).arg(&d_i).arg(&eps);
    let cfg = crate::cuda::grid_1d(m, NORM_THREADS);
    // SAFETY: a block per row, columns bounded by d; shapes checked above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Rows each block of the backward walks: enough that dalpha's atomics (one per column
/// per block) stay few, few enough that a prefill's rows still fill the GPU.
const BWD_ROWS_PER_BLOCK: usize = 16;

/// The backward of the norm: `sum [m, d]` (its input), `grad [m, d]` (the gradient of
/// the normalised rows) and `alpha [d]`, all bf16 and contiguous. Returns `[m · d + d]`
/// bf16: the gradient of the sum as `m` rows, then alpha's.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    sum: &CudaStorage,
    sl: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    alpha: &CudaStorage,
    al: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    let (m, d) = sl.shape().dims2()?;
    if !d.is_multiple_of(8) || d > MAX_HIDDEN || m > i32::MAX as usize || gl.dims() != [m, d] {
        return err(OpError::Invalid(format!(
            "rms_norm backward on CUDA takes hidden % 8 == 0 and <= {MAX_HIDDEN} and a \
             gradient [{m}, {d}], got sums [{m}, {d}] and gradient {:?}",
            gl.dims()
        )));
    }
    let (sv, gv, av) = (
        bf16_view("sum", sum, sl)?,
        bf16_view("grad", grad, gl)?,
        bf16_view("alpha", alpha, al)?,
    );
    let dev = sum.device().clone();
    // SAFETY: the two kernels write every row and the tail.
    let mut out = unsafe { dev.alloc::<bf16>(m * d + d)? };
    let mut dalpha = dev.alloc_zeros::<f32>(d)?;
    let (m_i, d_i, rows_i) = (m as i32, d as i32, BWD_ROWS_PER_BLOCK as i32);
    let vectors = [1, 2, 4]
        .into_iter()
        .find(|&v| v * NORM_THREADS as usize * 8 >= d)
        .unwrap_or(4);
    let name = format!("add_rms_norm_bwd_v{vectors}_bf16");
    let func = dev.get_or_load_custom_func(&name, "add_rms_norm", ADD_RMS_NORM_PTX)?;
    let mut b = func.builder();
    b.arg(&sv)
        .arg(&gv)
        .arg(&av)
        .arg(&mut out)
        .arg(&mut dalpha)
        .arg(&m_i)
        .arg(&d_i)
        .arg(&eps)
        .arg(&rows_i);
    let cfg = crate::cuda::grid_1d(m.div_ceil(BWD_ROWS_PER_BLOCK), NORM_THREADS);
    // SAFETY: each block's rows bounded by m, columns by d; shapes checked above.
    unsafe { b.launch(cfg) }.w()?;
    let func =
        dev.get_or_load_custom_func("add_rms_norm_alpha_bf16", "add_rms_norm", ADD_RMS_NORM_PTX)?;
    let mut tail = out.slice_mut(m * d..);
    let mut b = func.builder();
    b.arg(&dalpha).arg(&mut tail).arg(&d_i);
    let cfg = crate::cuda::grid_1d(d.div_ceil(NORM_THREADS as usize), NORM_THREADS);
    // SAFETY: one thread per column, bounded by d.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
