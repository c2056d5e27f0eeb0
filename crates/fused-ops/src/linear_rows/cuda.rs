//! Launcher of `kernels/src/linear_rows.cu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Shape};

use crate::cuda::{bf16_view, grid_1d, output_buffer};
use crate::error::{err, OpError};

const LINEAR_ROWS_PTX: &str = twell_kernels::LINEAR_ROWS;

const THREADS: u32 = 256;
/// Weight rows a block takes: 8 warps of 2 rows (`LINEAR_ROWS_R` in the kernel).
const ROWS_PER_BLOCK: usize = 16;

/// `x [m, k]` (1 ≤ m ≤ 8) times `weight [n, k]ᵀ`, both bf16 and contiguous, k a
/// multiple of 8 (checked by the op): `[m, n]` bf16.
pub fn linear_rows(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let ((m, k), (n, kw)) = (xl.shape().dims2()?, wl.shape().dims2()?);
    if k != kw || !k.is_multiple_of(8) || m == 0 || m > super::LINEAR_ROWS_MAX || n == 0 {
        return err(OpError::Invalid(format!(
            "linear_rows: x {:?}, weight {:?}: want 1..=8 rows and k a multiple of 8",
            xl.dims(),
            wl.dims()
        )));
    }
    let (x, w) = (
        bf16_view("linear_rows: x", xs, xl)?,
        bf16_view("linear_rows: weight", ws, wl)?,
    );
    let dev = xs.device().clone();
    let rows = [1, 2, 4, 8].into_iter().find(|&r| m <= r).unwrap_or(8);
    // Vectors a lane loads per row and chunk: the chunk covers k where it can (one round
    // trip), up to 8 vectors (2,048 columns) a lane.
    let vectors = match k / 8 {
        v if v <= 64 => 2,
        v if v <= 128 => 4,
        _ => 8,
    };
    let name = format!("linear_rows_bf16_m{rows}_u{vectors}");
    let func = dev.get_or_load_custom_func(&name, "linear_rows", LINEAR_ROWS_PTX)?;
    // SAFETY: the kernel writes every element of y ([m, n]).
    let mut y = unsafe { output_buffer(&dev, m * n)? };
    let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
    let mut b = func.builder();
    b.arg(&x).arg(&w).arg(&mut y).arg(&m_i).arg(&n_i).arg(&k_i);
    // SAFETY: x holds m·k and w n·k bf16 (checked views); a warp's rows past n and
    // vectors past k are skipped in the kernel.
    unsafe { b.launch(grid_1d(n.div_ceil(ROWS_PER_BLOCK), THREADS)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((m, n))))
}
