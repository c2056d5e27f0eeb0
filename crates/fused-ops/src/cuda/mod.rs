//! What the CUDA launchers share: device attributes, launch shapes, checked views of
//! candle's storages, output buffers the tests can poison, and the device's tuning
//! ([`configure`]).
//!
//! Everything runs on candle's stream of the input's device, with no host
//! synchronisation; scratch buffers come from the stream-ordered pool.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::error::{err, OpError};

mod device;

pub use crate::add_rms_norm::cuda::MAX_HIDDEN as ADD_RMS_NORM_MAX_HIDDEN;
pub use crate::attention::cuda::set_portable_attention;
pub use device::{configure, cublas_workspace, pool_usage, reset_pool_peak};

pub use crate::per_key::PerKey;

/// Scratch per stream ([`stream_key`]): a launch that needs scratch of a size known
/// before it runs takes it from here instead of allocating it each call, and two candle
/// devices, which have streams of their own, never share one; a replaced buffer is kept
/// (see [`PerKey`]), since a captured CUDA graph may still use it.
pub type PerStream<T> = PerKey<usize, T>;

/// The key of `dev`'s stream.
pub fn stream_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().cu_stream() as usize
}

/// The key of `dev`'s context: two cards never share a value asked of the driver.
pub fn context_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().context().cu_ctx() as usize
}

/// Threads per block of the warp-per-item kernels.
pub const BLOCK_THREADS: u32 = 256;

/// Values asked of the driver once per context and key (keyed by the context, so two
/// cards never share a value): every prefill forward asks for some of them.
pub type PerContext = PerKey<(usize, usize), usize>;

/// A device attribute, read from the driver once per context and attribute.
pub fn device_attribute(
    dev: &CudaDevice,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute,
) -> Result<usize> {
    static VALUES: PerContext = PerContext::new();
    VALUES.once((context_key(dev), attribute as usize), || {
        Ok(dev.cuda_stream().context().attribute(attribute).w()?.max(0) as usize)
    })
}

/// The device's multiprocessor count.
pub fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    Ok(device_attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?
    .max(1))
}

/// The device's compute capability, major version.
pub fn compute_major(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
}

/// Whether the device runs sm_90a code (compute capability 9.0, Hopper): its
/// architecture-specific instructions (wgmma) run there and nowhere else.
pub fn is_sm90(dev: &CudaDevice) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    Ok(compute_major(dev)? == 9
        && device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? == 0)
}

/// A launch of `warps` warps in blocks of [`BLOCK_THREADS`].
pub fn warp_launch(warps: usize) -> Result<LaunchConfig> {
    let warps_per_block = (BLOCK_THREADS / 32) as usize;
    let blocks = warps.div_ceil(warps_per_block);
    if blocks > i32::MAX as usize {
        return err(OpError::Invalid(format!(
            "{warps} warps exceed one CUDA grid"
        )));
    }
    Ok(grid_1d(blocks, BLOCK_THREADS))
}

/// A 1-D grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
pub fn grid_1d(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `Ok` when the storage holds `dtype`, else an error that names the input.
pub fn check_dtype(what: &str, s: &CudaStorage, dtype: DType) -> Result<()> {
    if s.dtype() != dtype {
        return err(OpError::Invalid(format!(
            "{what}: the CUDA kernels take {dtype:?}, got {:?}{}",
            s.dtype(),
            if dtype == DType::BF16 {
                " (load the model in bf16)"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// A contiguous view of a CUDA storage holding `dtype` (whose element type is `T`).
pub fn typed_view<'a, T: candle_core::cuda_backend::CudaDType>(
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
    dtype: DType,
) -> Result<CudaView<'a, T>> {
    check_dtype(what, s, dtype)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => err(OpError::Invalid(format!(
            "{what}: input must be contiguous"
        ))),
    }
}

/// A contiguous bf16 view of a CUDA storage.
pub fn bf16_view<'a>(
    what: &'static str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, bf16>> {
    typed_view(what, s, l, DType::BF16)
}

/// A bf16 view of a CUDA storage from a layout's start to its last element, for
/// kernels that address the elements through the layout's strides.
pub fn strided_bf16_view<'a>(
    what: &'static str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, bf16>> {
    check_dtype(what, s, DType::BF16)?;
    let dims = l.dims();
    if dims.contains(&0) {
        return err(OpError::Invalid(format!("{what}: empty tensor {dims:?}")));
    }
    let last: usize = dims.iter().zip(l.stride()).map(|(d, s)| (d - 1) * s).sum();
    Ok(s.as_cuda_slice::<bf16>()?
        .slice(l.start_offset()..l.start_offset() + last + 1))
}

/// A buffer of `len` zeroed 4-byte elements (f32, u32, i32), zeroed by a kernel on the
/// stream. cudarc's `alloc_zeros` issues a memset, which a captured CUDA graph holds as a
/// memset node: replaying a decode step with 60 of them cost the host 0.7–1 ms a launch
/// (H100), where its kernel nodes cost next to nothing.
pub fn zeroed<T: candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<T>> {
    assert_eq!(std::mem::size_of::<T>(), 4, "zeroed fills 4-byte elements");
    // SAFETY: the kernel below writes every element before anything reads it.
    let mut buf = unsafe { dev.alloc::<T>(len)? };
    if len == 0 {
        return Ok(buf);
    }
    let func = dev.get_or_load_custom_func("twell_zero_u32", "fill", twell_kernels::FILL)?;
    let n = len as i64;
    let mut b = func.builder();
    b.arg(&mut buf);
    b.arg(&n);
    // SAFETY: the kernel writes n 4-byte words of `buf` (grid-stride).
    unsafe {
        b.launch(grid_1d(
            len.div_ceil(BLOCK_THREADS as usize).min(1024),
            BLOCK_THREADS,
        ))
    }
    .w()?;
    Ok(buf)
}

static POISON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Fills every bf16 output buffer of the CUDA ops with a NaN pattern before their kernels
/// run, so a check sees any element a kernel failed to write. Process-wide; for tests.
pub fn set_poison_outputs(on: bool) {
    POISON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// A bf16 output buffer of `len` elements, filled with a NaN pattern while
/// [`set_poison_outputs`] is on.
///
/// # Safety
/// The buffer is uninitialised otherwise: the caller's kernels must write every element
/// before it is read.
pub unsafe fn output_buffer(dev: &CudaDevice, len: usize) -> Result<CudaSlice<bf16>> {
    let mut buf = dev.alloc::<bf16>(len)?;
    if !POISON.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(buf);
    }
    let func = dev.get_or_load_custom_func("twell_fill_u16", "fill", twell_kernels::FILL)?;
    let n = buf.len() as i64;
    let bits: u16 = 0x7fc1;
    let mut b = func.builder();
    b.arg(&mut buf);
    b.arg(&n);
    b.arg(&bits);
    // SAFETY: the kernel writes n u16 words of `buf`.
    b.launch(warp_launch(1024 * 8)?).w()?;
    Ok(buf)
}
