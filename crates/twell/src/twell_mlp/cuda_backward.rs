//! The TwELL MLP's backward on the device (`twell_mlp_bwd.cu`): dg and du per listed
//! slot from the forward's pattern, then dx and the weight gradients per active pair or
//! through cuBLAS GEMMs over the scattered dense matrices.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};
use half::bf16;

use fused_ops::cuda::{bf16_view, grid_1d, warp_launch};

use super::cuda::BackwardState;
use crate::cuda::{row_vectors, KernelDims};
use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::output::mlp_result_len;

const TWELL_MLP_BWD_PTX: &str = twell_kernels::TWELL_MLP_BWD;

static BACKWARD_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many backward passes ran on the device kernels (tests check the device path
/// ran, not the host fallback).
pub fn backward_calls() -> usize {
    BACKWARD_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The device backward keeps a row of dout in registers: hidden up to 4096.
pub fn backward_supported(d: usize) -> bool {
    d.is_multiple_of(8) && row_vectors(d).is_some()
}

/// Gradients of the TwELL MLP from the forward's pattern: `dres [mlp_result_len(m, d)]`
/// holds d(loss)/d(out) `[m, d]`, then d(loss)/d(L1 term) per token. Returns
/// `(dx [m, d], d gate_proj [f, d], d w_ud [f, 2d])`, all bf16.
///
/// The `grads` row kernel (`twell_mlp_bwd.cu`) forms dg and du per listed slot. dx
/// comes per active pair (the `dx` row kernel) with `sparse_dx`, else from two cuBLAS
/// GEMMs; the weight gradients per active pair with `sparse_weight_grads` (tokens
/// grouped by neuron, [`sparse_weight_grads_into`]), else from three GEMMs. The GEMMs
/// read h, dg and du scattered into dense `[m, f]` matrices.
#[allow(clippy::too_many_arguments)]
pub fn twell_mlp_backward(
    x: &CudaStorage,
    xl: &Layout,
    dres: &CudaStorage,
    rl: &Layout,
    wg: &CudaStorage,
    wl: &Layout,
    w_ud: &CudaStorage,
    ul: &Layout,
    counts: &CudaStorage,
    cl: &Layout,
    state: &BackwardState,
    config: TwellConfig,
    sparse_dx: bool,
    sparse_weight_grads: bool,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let (m, d) = xl.shape().dims2()?;
    let f = wl.shape().dims2()?.0;
    let len = mlp_result_len(m, d);
    let cap = config.capacity();
    let n_tiles = config.n_tiles(f);
    if rl.shape().dims() != [len] || cl.shape().dims2()? != (m, n_tiles) {
        return err(TwellError::Invalid(format!(
            "twell-mlp backward: want dres [{len}] and counts [{m}, {n_tiles}], got {:?} and {:?}",
            rl.shape(),
            cl.shape()
        )));
    }
    let Some(v) = row_vectors(d).filter(|_| d.is_multiple_of(8)) else {
        return err(TwellError::Invalid(format!(
            "the CUDA TwELL backward takes hidden % 8 == 0 and <= 4096, got {d}"
        )));
    };
    BACKWARD_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dev = x.device().clone();
    let (xv, rv, wgv, wudv) = (
        bf16_view("x", x, xl)?,
        bf16_view("grad", dres, rl)?,
        bf16_view("gate_proj", wg, wl)?,
        bf16_view("w_ud", w_ud, ul)?,
    );
    let countv = match cl.contiguous_offsets() {
        Some((a, b)) => counts.as_cuda_slice::<u32>()?.slice(a..b),
        None => {
            return err(TwellError::Invalid(
                "twell-mlp backward: counts must be contiguous".into(),
            ))
        }
    };
    let dims = KernelDims::new(m, d, f, config);
    // The pair lists index slots with u32.
    let sparse_weight_grads = sparse_weight_grads && m * n_tiles * (cap + 1) < u32::MAX as usize;
    // The dense h, dg and du: GEMMs read them whole (zeroed, every pair scattered in);
    // the per-pair kernels read only overflowing tiles, which `grads` writes whole.
    let any_gemm = !sparse_dx || !sparse_weight_grads;
    let dense = |dev: &CudaDevice| -> Result<CudaSlice<bf16>> {
        if !any_gemm {
            // SAFETY: only overflowing tiles are read, and `grads` writes them whole.
            unsafe { dev.alloc::<bf16>(m * f) }
        } else {
            dev.alloc_zeros::<bf16>(m * f)
        }
    };
    let (mut h, mut dg, mut du) = (dense(&dev)?, dense(&dev)?, dense(&dev)?);
    let dense_all = i32::from(any_gemm);
    // SAFETY: the row kernel writes every row of dx, and `grads` every listed slot
    // of dg_slots and du_slots (the only ones `dx` reads).
    let mut dx = unsafe { dev.alloc::<bf16>(m * d)? };
    let mut dg_slots = unsafe { dev.alloc::<bf16>(state.g_slots.len())? };
    let mut du_slots = unsafe { dev.alloc::<bf16>(state.g_slots.len())? };
    let grads = dev.get_or_load_custom_func(
        &format!("twell_mlp_bwd_grads_bf16_v{v}"),
        "twell_mlp_bwd",
        TWELL_MLP_BWD_PTX,
    )?;
    let mut b = grads.builder();
    b.arg(&xv)
        .arg(&rv)
        .arg(&wgv)
        .arg(&wudv)
        .arg(&countv)
        .arg(&state.indices)
        .arg(&state.g_slots)
        .arg(&state.u_slots)
        .arg(&mut h)
        .arg(&mut dg)
        .arg(&mut du)
        .arg(&mut dg_slots)
        .arg(&mut du_slots)
        .arg(&dense_all);
    dims.push(&mut b);
    // SAFETY: one warp per row, bounds checked in the kernel.
    unsafe { b.launch(warp_launch(m)?) }.w()?;
    if sparse_dx {
        let dx_rows = dev.get_or_load_custom_func(
            &format!("twell_mlp_bwd_dx_bf16_v{v}"),
            "twell_mlp_bwd",
            TWELL_MLP_BWD_PTX,
        )?;
        let mut b = dx_rows.builder();
        b.arg(&wgv)
            .arg(&wudv)
            .arg(&countv)
            .arg(&state.indices)
            .arg(&dg_slots)
            .arg(&du_slots)
            .arg(&dg)
            .arg(&du)
            .arg(&mut dx);
        dims.push(&mut b);
        // SAFETY: one warp per row, bounds checked in the kernel.
        unsafe { b.launch(warp_launch(m)?) }.w()?;
    } else {
        dx_by_gemms(&dev, (m, d, f), (&wgv, &wudv), (&dg, &du), &mut dx)?;
    }

    // SAFETY: the GEMMs or the sparse kernels below write every element.
    let mut dwg = unsafe { dev.alloc::<bf16>(f * d)? };
    let mut dw_ud = unsafe { dev.alloc::<bf16>(f * 2 * d)? };
    if sparse_weight_grads {
        let pattern = PairPattern {
            counts: &countv,
            indices: &state.indices,
            dims: &dims,
        };
        let coefficients = PairCoefficients {
            g_slots: &state.g_slots,
            u_slots: &state.u_slots,
            dg_slots: &dg_slots,
            du_slots: &du_slots,
            h: &h,
            dg: &dg,
            du: &du,
        };
        sparse_weight_grads_into(&dev, &xv, &rv, pattern, coefficients, &mut dwg, &mut dw_ud)?;
        return Ok((
            CudaStorage::wrap_cuda_slice(dx, dev.clone()),
            CudaStorage::wrap_cuda_slice(dwg, dev.clone()),
            CudaStorage::wrap_cuda_slice(dw_ud, dev),
        ));
    }
    weight_grads_by_gemms(
        &dev,
        (m, d, f),
        (&xv, &rv),
        (&dg, &du, &h),
        (&mut dwg, &mut dw_ud),
    )?;
    Ok((
        CudaStorage::wrap_cuda_slice(dx, dev.clone()),
        CudaStorage::wrap_cuda_slice(dwg, dev.clone()),
        CudaStorage::wrap_cuda_slice(dw_ud, dev),
    ))
}

/// `dx = dG · Wg + dU · Wu` by two cuBLAS GEMMs over the dense `dg`, `du` `[m, f]`.
fn dx_by_gemms(
    dev: &CudaDevice,
    (m, d, f): (usize, usize, usize),
    (wg, w_ud): (&CudaView<bf16>, &CudaView<bf16>),
    (dg, du): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    dx: &mut CudaSlice<bf16>,
) -> Result<()> {
    // Row-major dx [m, d] = dG [m, f] · Wg [f, d] + dU [m, f] · Wu [f, d] is
    // column-major dxᵀ = Wgᵀ · dGᵀ + Wuᵀ · dUᵀ, each weight read as column-major
    // [d, f] (Wu's rows are the first halves of w_ud's, ld 2d).
    let dx_gemm = |lda: usize, beta: bf16| GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: d as i32,
        n: m as i32,
        k: f as i32,
        alpha: bf16::ONE,
        lda: lda as i32,
        ldb: f as i32,
        beta,
        ldc: d as i32,
    };
    let blas = dev.cublas_handle();
    // SAFETY: shapes and leading dimensions match the buffers; the first GEMM writes
    // every element of dx, the second adds to it.
    unsafe {
        blas.gemm(dx_gemm(d, bf16::ZERO), wg, dg, dx).w()?;
        blas.gemm(dx_gemm(2 * d, bf16::ONE), w_ud, du, dx).w()?;
    }
    Ok(())
}

/// `dWg = dGᵀ · x`, `dWu = dUᵀ · x` and `dWd = hᵀ · dout` by three cuBLAS GEMMs over the
/// dense `dg`, `du` and `h` `[m, f]` (`dres`'s first `m · d` elements are `dout`).
fn weight_grads_by_gemms(
    dev: &CudaDevice,
    (m, d, f): (usize, usize, usize),
    (x, dres): (&CudaView<bf16>, &CudaView<bf16>),
    (dg, du, h): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    (dwg, dw_ud): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
) -> Result<()> {
    let blas = dev.cublas_handle();
    // Row-major dW [f, ldc] = Mᵀ [f, m] · A [m, d] is column-major dWᵀ = Aᵀ · M:
    // A read as column-major [d, m] (lda its row length), M as [f, m] transposed.
    let weight_grad = |lda: usize, ldc: usize| GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_T,
        m: d as i32,
        n: f as i32,
        k: m as i32,
        alpha: bf16::ONE,
        lda: lda as i32,
        ldb: f as i32,
        beta: bf16::ZERO,
        ldc: ldc as i32,
    };
    // SAFETY: shapes and leading dimensions match the buffers above.
    unsafe {
        blas.gemm(weight_grad(d, d), x, dg, dwg).w()?;
        blas.gemm(weight_grad(d, 2 * d), x, du, &mut dw_ud.slice_mut(0..))
            .w()?;
        blas.gemm(weight_grad(d, 2 * d), dres, h, &mut dw_ud.slice_mut(d..))
            .w()?;
    }
    Ok(())
}

/// Tokens per chunk of the pair-grouping kernels (`PAIR_CHUNK` in the .cu).
const PAIR_CHUNK: usize = 128;
/// Threads of the one-block column scan (`SCAN_THREADS` in the .cu).
const SCAN_THREADS: u32 = 1024;

/// The forward's pattern, as the pair-grouping kernels read it.
struct PairPattern<'a, 'b> {
    counts: &'a CudaView<'b, u32>,
    indices: &'a CudaSlice<u8>,
    dims: &'a KernelDims,
}

/// Where the weight gradients' coefficients are: per listed slot (g, u from the
/// forward, dg, du from `grads`), and in the dense matrices for overflowing tiles.
struct PairCoefficients<'a> {
    g_slots: &'a CudaSlice<bf16>,
    u_slots: &'a CudaSlice<bf16>,
    dg_slots: &'a CudaSlice<bf16>,
    du_slots: &'a CudaSlice<bf16>,
    h: &'a CudaSlice<bf16>,
    dg: &'a CudaSlice<bf16>,
    du: &'a CudaSlice<bf16>,
}

/// The three weight gradients per active (token, neuron) pair: the pairs are grouped by
/// neuron (a counting sort over chunks of tokens, `twell_wgrad_pair_*` and the two
/// scans), then a block per neuron sums `dg x` and `du x` over its tokens' rows of x,
/// and another `h dout` over their rows of dout: two rows, 2 · 2d bytes, read per pair,
/// where the three GEMMs cost 6 · M · d · f FLOP at any density.
fn sparse_weight_grads_into(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    dres: &CudaView<bf16>,
    pattern: PairPattern<'_, '_>,
    c: PairCoefficients<'_>,
    dwg: &mut CudaSlice<bf16>,
    dw_ud: &mut CudaSlice<bf16>,
) -> Result<()> {
    let dims = pattern.dims;
    let (m, d, f) = (dims.m as usize, dims.d as usize, dims.f as usize);
    let (cap, n_tiles) = (dims.cap as usize, dims.n_tiles as usize);
    let n_cols = f + n_tiles;
    let n_chunks = m.div_ceil(PAIR_CHUNK);
    let (n_cols_i, n_chunks_i) = (n_cols as i32, n_chunks as i32);
    let load = |name: &str| dev.get_or_load_custom_func(name, "twell_mlp_bwd", TWELL_MLP_BWD_PTX);
    let pair_grid = LaunchConfig {
        grid_dim: (n_chunks as u32, n_tiles as u32, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY (all allocations below): each kernel writes every element it is given to
    // write before any is read: the counts every (chunk, column), the scans every total
    // and start, the places every pair slot up to the last start.
    let mut chunk_counts = unsafe { dev.alloc::<u32>(n_chunks * n_cols)? };
    let mut totals = unsafe { dev.alloc::<u32>(n_cols)? };
    let mut starts = unsafe { dev.alloc::<u32>(n_cols + 1)? };
    let mut pairs = unsafe { dev.alloc::<u32>(m * n_tiles * (cap + 1))? };

    let func = load("twell_wgrad_pair_counts")?;
    let mut b = func.builder();
    b.arg(pattern.counts)
        .arg(pattern.indices)
        .arg(&mut chunk_counts);
    dims.push_pattern(&mut b);
    // SAFETY: one warp per (chunk, tile), bounds checked in the kernel.
    unsafe { b.launch(pair_grid) }.w()?;

    let func = load("twell_wgrad_scan_chunks")?;
    let mut b = func.builder();
    b.arg(&mut chunk_counts)
        .arg(&mut totals)
        .arg(&n_chunks_i)
        .arg(&n_cols_i);
    // SAFETY: a thread per column, bounds checked in the kernel.
    unsafe { b.launch(grid_1d(n_cols.div_ceil(256), 256)) }.w()?;

    let func = load("twell_wgrad_scan_columns")?;
    let mut b = func.builder();
    b.arg(&totals).arg(&mut starts).arg(&n_cols_i);
    // SAFETY: one block; each thread's columns are bounds checked in the kernel.
    unsafe { b.launch(grid_1d(1, SCAN_THREADS)) }.w()?;

    let func = load("twell_wgrad_pair_places")?;
    let mut b = func.builder();
    b.arg(pattern.counts)
        .arg(pattern.indices)
        .arg(&chunk_counts)
        .arg(&starts)
        .arg(&mut pairs);
    dims.push_pattern(&mut b);
    // SAFETY: as the counting launch; every place is below the last start.
    unsafe { b.launch(pair_grid) }.w()?;

    // A thread per 8 columns of d, up to 256 (wider rows loop over column chunks).
    let threads = (d.div_ceil(8).div_ceil(32) * 32).min(256) as u32;
    let neuron_grid = grid_1d(f, threads);
    let func = load("twell_wgrad_gate_up_bf16")?;
    let mut b = func.builder();
    b.arg(x)
        .arg(&pairs)
        .arg(&starts)
        .arg(c.dg_slots)
        .arg(c.du_slots)
        .arg(c.dg)
        .arg(c.du)
        .arg(dwg)
        .arg(&mut *dw_ud);
    dims.push_neuron(&mut b);
    // SAFETY: a block per neuron; every row of dwg and the first half of every row of
    // dw_ud is written.
    unsafe { b.launch(neuron_grid) }.w()?;
    let func = load("twell_wgrad_down_bf16")?;
    let mut b = func.builder();
    // dres's first m · d elements are d(loss)/d(out) as [m, d].
    b.arg(dres)
        .arg(&pairs)
        .arg(&starts)
        .arg(c.g_slots)
        .arg(c.u_slots)
        .arg(c.h)
        .arg(dw_ud);
    dims.push_neuron(&mut b);
    // SAFETY: a block per neuron; the second half of every row of dw_ud is written.
    unsafe { b.launch(neuron_grid) }.w()?;
    Ok(())
}
