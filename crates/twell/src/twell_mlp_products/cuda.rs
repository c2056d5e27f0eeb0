//! The launcher of `kernels/src/twell_mlp_products.cu`: the whole ReGLU MLP as three cuBLAS
//! GEMMs around one element-wise kernel, for inference at densities where the per-pair
//! kernels lose to tensor cores (see the kernel's header).
//!
//! `g = x · Wgᵀ` and `u = x · Wuᵀ` (cuBLAS), `h = relu(g) ⊙ u` with each tile's count of
//! positive gates and each row's L1 term (the kernel), `out = h · Wd` (cuBLAS). The
//! up and down weights are read in place from the neuron-major `w_ud [f, 2d]` (leading
//! dimension 2d), so the path needs no other copy of them.

use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Shape};
use half::bf16;

use fused_ops::cuda::{bf16_view, output_buffer, warp_launch};

use crate::cuda::gate_gemm;
use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::output::mlp_result_len;

const TWELL_MLP_PRODUCTS_PTX: &str = twell_kernels::TWELL_MLP_PRODUCTS;

/// Whether the path takes a shape: 16-byte rows of `h` (`f % 8 == 0`) and of `x` (`d
/// % 8 == 0`), and sizes cuBLAS's 32-bit dimensions hold.
pub fn products_take(m: usize, d: usize, f: usize) -> bool {
    d.is_multiple_of(8)
        && f.is_multiple_of(8)
        && [m, 2 * d, f].iter().all(|&v| v <= i32::MAX as usize)
}

/// The MLP of `x [m, d]` through `wg [f, d]` and `w_ud [f, 2d]` (bf16, contiguous):
/// the result `[mlp_result_len(m, d)]` (the output rows, then each row's L1 term) and
/// the per-(row, tile) counts of positive gates `[m, n_tiles]`.
pub fn twell_mlp_products(
    x: &CudaStorage,
    xl: &Layout,
    wg: &CudaStorage,
    wl: &Layout,
    w_ud: &CudaStorage,
    ul: &Layout,
    config: TwellConfig,
) -> Result<(CudaStorage, Shape, CudaSlice<u32>)> {
    let (m, d) = xl.shape().dims2()?;
    let f = wl.shape().dims2()?.0;
    if !products_take(m, d, f) {
        return err(TwellError::Invalid(format!(
            "twell_mlp_products needs hidden and d_ff multiples of 8, got [{m}, {d}] x [{f}, {d}]"
        )));
    }
    let dev = x.device.clone();
    let (xv, wgv, wudv) = (
        bf16_view("x", x, xl)?,
        bf16_view("gate_proj", wg, wl)?,
        bf16_view("w_ud", w_ud, ul)?,
    );
    let gate = gate_gemm::x_times_wt(&dev, &xv, &wgv, d, (m, d, f))?;
    // Wu is the first d columns of each 2d-wide row of w_ud.
    let mut up = gate_gemm::x_times_wt(&dev, &xv, &wudv, 2 * d, (m, d, f))?;

    let n_tiles = config.n_tiles(f);
    let len = mlp_result_len(m, d);
    // SAFETY: the kernel writes every count and the L1 terms, cuBLAS the rows.
    let mut counts = unsafe { dev.alloc::<u32>(m * n_tiles)? };
    let mut out = unsafe { output_buffer(&dev, len)? };
    let func = dev.get_or_load_custom_func(
        "twell_mlp_products_bf16",
        "twell_mlp_products",
        TWELL_MLP_PRODUCTS_PTX,
    )?;
    let (m_i, d_i, f_i) = (m as i32, d as i32, f as i32);
    let (tile_i, n_tiles_i) = (config.tile() as i32, n_tiles as i32);
    let mut b = func.builder();
    b.arg(&gate)
        .arg(&mut up)
        .arg(&mut counts)
        .arg(&mut out)
        .arg(&m_i)
        .arg(&d_i)
        .arg(&f_i)
        .arg(&tile_i)
        .arg(&n_tiles_i);
    // SAFETY: one warp per row, bounds checked in the kernel.
    unsafe { b.launch(warp_launch(m)?) }.w()?;

    // Row-major out [m, d] is column-major outᵀ [d, m] = Wdᵀ [d, f] · hᵀ [f, m]; Wd
    // [f, d] (the last d columns of w_ud's rows) is column-major Wdᵀ with ld 2d.
    let down_cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: d as i32,
        n: m as i32,
        k: f as i32,
        alpha: bf16::ONE,
        lda: (2 * d) as i32,
        ldb: f as i32,
        beta: bf16::ZERO,
        ldc: d as i32,
    };
    let wd = wudv.slice(d..);
    let mut rows = out.slice_mut(0..m * d);
    // SAFETY: shapes and leading dimensions match the buffers above.
    unsafe { dev.cublas_handle().gemm(down_cfg, &wd, &up, &mut rows) }.w()?;
    let storage = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((storage, Shape::from(len), counts))
}
