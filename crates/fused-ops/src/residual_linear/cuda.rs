//! The CUDA form of `ops::residual_add_linear`: one cuBLAS GEMM with the residual as
//! both `C` and the output (beta = 1).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::cuda::{bf16_view, check_dtype};
use crate::error::{err, OpError};

/// `residual [m, n] += y [m, k] · weightᵀ` (`weight [n, k]`), bf16, contiguous.
pub fn residual_add_linear(
    residual: &mut CudaStorage,
    rl: &Layout,
    y: &CudaStorage,
    yl: &Layout,
    weight: &CudaStorage,
    wl: &Layout,
) -> Result<()> {
    check_dtype("residual_add_linear: residual", residual, DType::BF16)?;
    let (m, n) = rl.shape().dims2()?;
    let (my, k) = yl.shape().dims2()?;
    let (nw, kw) = wl.shape().dims2()?;
    let fits_i32 = [m, n, k].iter().all(|&v| v <= i32::MAX as usize);
    if my != m || nw != n || kw != k || !fits_i32 {
        return err(OpError::Invalid(format!(
            "residual_add_linear: residual [{m}, {n}], y [{my}, {k}], weight [{nw}, {kw}]"
        )));
    }
    let Some((a, b)) = rl.contiguous_offsets() else {
        return err(OpError::Invalid(
            "residual_add_linear: the residual must be contiguous".into(),
        ));
    };
    let (yv, wv) = (bf16_view("y", y, yl)?, bf16_view("weight", weight, wl)?);
    let dev = residual.device().clone();
    let mut target = residual.as_cuda_slice_mut::<bf16>()?.slice_mut(a..b);
    // Row-major R [m, n] is column-major Rᵀ [n, m] = W [n, k] · yᵀ [k, m] + Rᵀ.
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: bf16::ONE,
        ldc: n as i32,
    };
    // SAFETY: shapes and leading dimensions match the buffers checked above.
    unsafe { dev.cublas_handle().gemm(cfg, &wv, &yv, &mut target) }.w()?;
    Ok(())
}
