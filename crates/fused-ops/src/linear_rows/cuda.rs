//! Launcher of `kernels/src/linear_rows.cu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Shape};

use crate::cuda::{bf16_view, context_key, grid_1d, multiprocessors, output_buffer, PerContext};
use crate::error::{err, OpError};

const LINEAR_ROWS_PTX: &str = twell_kernels::LINEAR_ROWS;

const THREADS: u32 = 256;
/// Warps a block: a warp streams rows of the weight.
const WARPS: usize = THREADS as usize / 32;

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
    // A warp a row up to one wave of blocks (as many as the multiprocessors hold at once);
    // past that the warps walk the rest, so no block waits in a second wave.
    static BLOCKS_PER_SM: PerContext = PerContext::new();
    let per_sm = BLOCKS_PER_SM.once((context_key(&dev), rows * 16 + vectors), || {
        let blocks = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
            .w()? as usize;
        Ok(blocks.max(1))
    })?;
    let blocks = n.div_ceil(WARPS).min(per_sm * multiprocessors(&dev)?);
    let mut b = func.builder();
    b.arg(&x).arg(&w).arg(&mut y).arg(&m_i).arg(&n_i).arg(&k_i);
    // SAFETY: x holds m·k and w n·k bf16 (checked views); the kernel's warps take rows
    // below n and vectors below k only.
    unsafe { b.launch(grid_1d(blocks, THREADS)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((m, n))))
}
