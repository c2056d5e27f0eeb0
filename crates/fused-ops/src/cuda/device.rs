//! Device-wide settings both the dense and the sparse path run under (the memory pool
//! keeps what it frees, cuBLAS gets a workspace), and reads of the pool's usage for the
//! benchmarks' peak-memory figures.

use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};

use crate::error::{err, OpError};
use crate::per_key::PerKey;

/// Bytes of cuBLAS workspace: Hopper's fast GEMM kernels need one (NVIDIA recommends
/// 32 MiB), and a handle without one falls back to slower kernels.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Tunes a CUDA device for the dense and the sparse path alike:
/// * the stream-ordered memory pool keeps freed memory instead of unmapping it at
///   every synchronisation (as PyTorch's caching allocator does), so per-call
///   scratch costs no driver calls;
/// * candle's cuBLAS handle gets a workspace;
/// * cudarc's per-buffer event tracking is off: it orders work between streams, candle
///   has one, and its two events per allocation cost 40% of a one-token decode step
///   (docs/benchmarks.md).
///
/// Idempotent per device. Every CUDA entry point of `twell` (CLI, benches) calls it.
pub fn configure(dev: &CudaDevice) -> Result<()> {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static DONE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut done = DONE.lock().expect("configure lock");
    if !done.get_or_insert_with(HashSet::new).insert(ordinal) {
        return Ok(());
    }
    // Each step only tunes speed: a failure is reported and the device used as it is.
    if let Err(e) = keep_pool_memory(dev) {
        eprintln!("twell: could not set the memory pool's release threshold ({e}); continuing");
    }
    if let Err(e) = give_cublas_workspace(dev) {
        eprintln!("twell: could not give cuBLAS a workspace ({e}); continuing");
    }
    // SAFETY: candle and twell issue all their work on the device's one stream, so the
    // events cudarc records per buffer never order anything.
    unsafe { dev.disable_event_tracking() };
    Ok(())
}

fn keep_pool_memory(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    // SAFETY: plain driver calls on the live, current device; `threshold` outlives them.
    unsafe {
        let pool = driver::result::device::get_default_mem_pool(ctx.cu_device()).w()?;
        let mut threshold: u64 = u64::MAX;
        driver::result::mem_pool::set_attribute(
            pool,
            driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .w()?;
    }
    Ok(())
}

fn give_cublas_workspace(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas;
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let workspace = dev.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
    let blas = dev.cublas_handle();
    let stream = dev.cuda_stream();
    {
        let (ptr, _guard) = workspace.device_ptr(&stream);
        // SAFETY: the buffer is CUBLAS_WORKSPACE_BYTES long and never freed (below).
        let status = unsafe {
            cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                ptr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE_BYTES,
            )
        };
        if status != cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return err(OpError::Invalid(format!("cublasSetWorkspace: {status:?}")));
        }
    }
    // The handle keeps using the workspace for the life of the process; a cuBLASLt GEMM
    // on the same stream may share it ([`cublas_workspace`]).
    WORKSPACES.put(dev.cuda_stream().context().ordinal(), workspace);
    Ok(())
}

/// The cuBLAS workspace that [`configure`] gave each device (by ordinal).
static WORKSPACES: PerKey<usize, CudaSlice<u8>> = PerKey::new();

/// The address and size of the workspace [`configure`] gave the device's cuBLAS handle
/// (`(0, 0)` when none), for a cuBLASLt GEMM to share: both run on candle's one stream,
/// so never at once.
pub fn cublas_workspace(dev: &CudaDevice) -> (u64, usize) {
    let stream = dev.cuda_stream();
    WORKSPACES.peek(&stream.context().ordinal(), |w| {
        w.map_or((0, 0), |w| (w.device_ptr(&stream).0, w.len()))
    })
}

/// Memory of the device's stream-ordered pool (where candle's CUDA tensors live):
/// `(in use now, most in use since the last reset)` in bytes.
pub fn pool_usage(dev: &CudaDevice) -> Result<(u64, u64)> {
    use candle_core::cuda_backend::cudarc::driver;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    let mut current: u64 = 0;
    let mut high: u64 = 0;
    // SAFETY: driver queries on the live, current device into locals.
    unsafe {
        let pool = driver::result::device::get_default_mem_pool(ctx.cu_device()).w()?;
        driver::sys::cuMemPoolGetAttribute(
            pool,
            driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            &mut current as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .w()?;
        driver::sys::cuMemPoolGetAttribute(
            pool,
            driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut high as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .w()?;
    }
    Ok((current, high))
}

/// Resets the pool's high-water mark to what is in use now.
pub fn reset_pool_peak(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    // SAFETY: setting USED_MEM_HIGH takes a zero u64, per the driver API.
    unsafe {
        let pool = driver::result::device::get_default_mem_pool(ctx.cu_device()).w()?;
        let mut zero: u64 = 0;
        driver::result::mem_pool::set_attribute(
            pool,
            driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut zero as *mut u64 as *mut std::ffi::c_void,
        )
        .w()?;
    }
    Ok(())
}
