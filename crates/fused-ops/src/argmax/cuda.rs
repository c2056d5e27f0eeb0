//! Launcher of `kernels/src/argmax.cu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use crate::cuda::{grid_1d, typed_view};

const ARGMAX_PTX: &str = twell_kernels::ARGMAX;
const THREADS: u32 = 1024;

/// `x [rows, n]` f32, contiguous (checked by the op's function): `[rows]` u32.
pub fn argmax_rows(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let (rows, n) = l.shape().dims2()?;
    let x = typed_view::<f32>("argmax_rows: x", s, l, DType::F32)?;
    let dev = s.device().clone();
    // SAFETY: the kernel writes one index per row, every row a block.
    let mut out = unsafe { dev.alloc::<u32>(rows)? };
    let func = dev.get_or_load_custom_func("argmax_rows_f32", "argmax", ARGMAX_PTX)?;
    let n_i = n as i32;
    let mut b = func.builder();
    b.arg(&x).arg(&mut out).arg(&n_i);
    // SAFETY: block r reads row r's n values of x and writes out[r].
    unsafe { b.launch(grid_1d(rows, THREADS)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
}
