//! Launchers of `kernels/src/cross_entropy.cu`: per-row softmax cross-entropy and its
//! backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::bf16_view;

const CROSS_ENTROPY_PTX: &str = twell_kernels::CROSS_ENTROPY;

/// Threads per row (`CE_THREADS` in the .cu).
const THREADS: u32 = 256;

fn row_launch(n: usize) -> candle_core::cuda_backend::cudarc::driver::LaunchConfig {
    crate::cuda::grid_1d(n, THREADS)
}

/// `logits [n, v]` bf16 and `targets [n]` u32 (every one below v, checked by the op):
/// returns `[2, n]` f32, the losses then each row's log-sum-exp.
pub fn cross_entropy(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
    (n, v): (usize, usize),
) -> Result<CudaStorage> {
    let xv = bf16_view("logits", logits, ll)?;
    let tv = crate::cuda::typed_view::<u32>("cross_entropy: targets", targets, tl, DType::U32)?;
    let dev = logits.device().clone();
    // SAFETY: the kernel writes both floats of every row.
    let mut out = unsafe { dev.alloc::<f32>(2 * n)? };
    let func =
        dev.get_or_load_custom_func("cross_entropy_fwd_bf16", "cross_entropy", CROSS_ENTROPY_PTX)?;
    let (n_i, v_i) = (n as i32, v as i32);
    let mut b = func.builder();
    b.arg(&xv).arg(&tv).arg(&mut out).arg(&n_i).arg(&v_i);
    // SAFETY: a block per row, columns bounded by v; shapes checked by the op.
    unsafe { b.launch(row_launch(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The backward: `logits [n, v]` bf16, `targets [n]` u32, `lse [n]` and `grad [n]` f32
/// (the gradient of each row's loss): returns `grad · (softmax − onehot)` as `[n, v]`
/// bf16.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_bwd(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
    lse_grad: &CudaStorage,
    gl: &Layout,
    (n, v): (usize, usize),
) -> Result<CudaStorage> {
    let xv = bf16_view("logits", logits, ll)?;
    let tv = crate::cuda::typed_view::<u32>("cross_entropy: targets", targets, tl, DType::U32)?;
    let lg =
        crate::cuda::typed_view::<f32>("cross_entropy: lse and grad", lse_grad, gl, DType::F32)?;
    let (lse, grad) = (lg.slice(0..n), lg.slice(n..2 * n));
    let dev = logits.device().clone();
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(n * v)? };
    let func =
        dev.get_or_load_custom_func("cross_entropy_bwd_bf16", "cross_entropy", CROSS_ENTROPY_PTX)?;
    let (n_i, v_i) = (n as i32, v as i32);
    let mut b = func.builder();
    b.arg(&xv)
        .arg(&tv)
        .arg(&lse)
        .arg(&grad)
        .arg(&mut out)
        .arg(&n_i)
        .arg(&v_i);
    // SAFETY: a block per row, columns bounded by v; shapes checked by the op.
    unsafe { b.launch(row_launch(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
