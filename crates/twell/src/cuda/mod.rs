//! CUDA launchers of the TwELL kernels (`kernels/*.cu`, built to PTX by `build.rs`).
//!
//! Everything runs on candle's stream of the input's device, with no host
//! synchronisation; scratch buffers come from the stream-ordered pool. One module per
//! kernel file (the MLP's forward in `twell_mlp`, its backward in `twell_mlp_bwd`, the
//! attention in `causal_attention`, ...); this one holds what they share: device
//! attributes, launch shapes and checked views of candle's storages.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use half::bf16;

use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::knobs;

mod adamw;
mod add_rms_norm;
mod attention_softmax_grad;
mod attention_step;
mod causal_attention;
mod cross_entropy;
mod device;
mod embedding;
mod gate_gemm;
mod gate_l0;
mod kl_divergence;
mod launch;
mod per_key;
mod residual_linear;
mod rope;
mod twell_mlp;
mod twell_mlp_bwd;
mod twell_mlp_decode;
mod twell_mlp_products;
pub use adamw::{adamw_mixed, adamw_moment, adamw_update, bf16_from_master, sum_squares};
pub use add_rms_norm::{add_rms_norm, rms_norm_bwd, MAX_HIDDEN as ADD_RMS_NORM_MAX_HIDDEN};
pub use attention_softmax_grad::{attention_row_dot, attention_softmax_grad};
pub use causal_attention::{
    attention_strides, causal_attention, causal_attention_step, prefill_attention_kernel,
};
pub use cross_entropy::{cross_entropy, cross_entropy_bwd};
pub use device::{configure, pool_usage, reset_pool_peak};
pub use embedding::embedding_grad;
pub use gate_l0::{gate_l0, gate_l0_grad_gate, gate_l0_grad_norms};
pub use kl_divergence::{kl_divergence, kl_divergence_bwd};
pub use residual_linear::residual_add_linear;
pub use rope::{rope, rope_in_place};
pub use twell_mlp::{
    add_norm_folds, pre_norm_folds, take_profile, twell_mlp_add_norm, twell_mlp_forward,
    twell_mlp_norm_add_norm, Activity, BackwardState, STAGES,
};
pub use twell_mlp_bwd::{backward_calls, backward_supported, twell_mlp_backward};
pub use twell_mlp_products::{products_take, twell_mlp_products};

const GATE_PACK_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_pack.ptx"));
/// The same kernels built for compute_90, where their waits for the kernel ahead
/// (`launch`) are compiled in.
const GATE_PACK_SM90_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_pack_sm90.ptx"));

/// Threads per block of the warp-per-item kernels.
const BLOCK_THREADS: u32 = 256;
/// Up to this many tokens the launches split each row's work across many warps
/// (decode); above it a warp owns a whole tile or row chunk (prefill).
pub const DECODE_MAX_TOKENS: usize = 64;
/// d-elements one warp covers in the down kernel (`WARP_CHUNK` in the .cu).
const WARP_CHUNK: usize = 256;

/// [`DECODE_MAX_TOKENS`], or `TWELL_DECODE_MAX_TOKENS` when set (to measure both
/// work splits at one size).
fn decode_max_tokens() -> Result<usize> {
    static N: knobs::Cell = knobs::Cell::new();
    let set = knobs::read_once(&N, || {
        knobs::env_count("TWELL_DECODE_MAX_TOKENS", "a token count", |_| true)
    })?;
    Ok(set.unwrap_or(DECODE_MAX_TOKENS))
}

/// The prefill up kernel keeps a row of x in registers as `MAXV` 16-byte vectors per
/// lane; the instantiations are 1, 2, 4, 8 and 16 (d up to 4096).
fn row_vectors(d: usize) -> Option<usize> {
    let need = d.div_ceil(32 * 8);
    [1, 2, 4, 8, 16].into_iter().find(|&v| v >= need)
}

/// Shared memory a block may take without opting in to more.
const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// Values asked of the driver once per context and key (keyed by the context, so two
/// cards never share a value): every prefill forward asks for some of them.
type PerContext = per_key::PerKey<(usize, usize), usize>;

/// A device attribute, read from the driver once per context and attribute.
fn device_attribute(
    dev: &CudaDevice,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute,
) -> Result<usize> {
    static VALUES: PerContext = PerContext::new();
    VALUES.once((per_key::context_key(dev), attribute as usize), || {
        Ok(dev.cuda_stream().context().attribute(attribute).w()?.max(0) as usize)
    })
}

/// The device's multiprocessor count.
fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    Ok(device_attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?
    .max(1))
}

/// The device's compute capability, major version.
fn compute_major(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
}

/// Whether the device runs sm_90a code (compute capability 9.0, Hopper): its
/// architecture-specific instructions (wgmma) run there and nowhere else.
fn is_sm90(dev: &CudaDevice) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    Ok(compute_major(dev)? == 9
        && device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? == 0)
}

/// The shape arguments every `gated_t2d` kernel takes, in its parameter order.
struct KernelDims {
    m: i32,
    d: i32,
    f: i32,
    tile: i32,
    cap: i32,
    n_tiles: i32,
}

impl KernelDims {
    /// The shape arguments of `m` rows of hidden `d` through `f` neurons in `config`'s
    /// tiles.
    fn new(m: usize, d: usize, f: usize, config: TwellConfig) -> Self {
        Self {
            m: m as i32,
            d: d as i32,
            f: f as i32,
            tile: config.tile() as i32,
            cap: config.capacity() as i32,
            n_tiles: config.n_tiles(f) as i32,
        }
    }

    /// The shape arguments every `gated_t2d` kernel takes: m, d, f, tile, cap, n_tiles.
    /// (`b` is cudarc's launch builder or [`launch::Args`].)
    fn push<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(
            b,
            [
                &self.m,
                &self.d,
                &self.f,
                &self.tile,
                &self.cap,
                &self.n_tiles,
            ],
        );
    }

    /// The shape arguments of the pair-grouping kernels: all but d.
    fn push_pattern<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.m, &self.f, &self.tile, &self.cap, &self.n_tiles]);
    }

    /// The shape arguments of the kernels that walk the gate's bit mask: all but cap.
    fn push_without_cap<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.m, &self.d, &self.f, &self.tile, &self.n_tiles]);
    }

    /// The shape arguments of the per-neuron weight-gradient kernels: all but m.
    fn push_neuron<'a, B: PushKernelArg<&'a i32>>(&'a self, b: &mut B) {
        push_each(b, [&self.d, &self.f, &self.tile, &self.cap, &self.n_tiles]);
    }
}

/// Pushes `fields` onto a launch's arguments, in order.
fn push_each<'a, B: PushKernelArg<&'a i32>, const N: usize>(b: &mut B, fields: [&'a i32; N]) {
    for field in fields {
        b.arg(field);
    }
}

fn warp_launch(warps: usize) -> Result<LaunchConfig> {
    let warps_per_block = (BLOCK_THREADS / 32) as usize;
    let blocks = warps.div_ceil(warps_per_block);
    if blocks > i32::MAX as usize {
        return err(TwellError::Invalid(format!(
            "{warps} warps exceed one CUDA grid"
        )));
    }
    Ok(grid_1d(blocks, BLOCK_THREADS))
}

/// A 1-D grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
fn grid_1d(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `Ok` when the storage holds `dtype`, else an error that names the input.
fn check_dtype(what: &str, s: &CudaStorage, dtype: DType) -> Result<()> {
    if s.dtype() != dtype {
        return err(TwellError::Invalid(format!(
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
fn typed_view<'a, T: candle_core::cuda_backend::CudaDType>(
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
    dtype: DType,
) -> Result<CudaView<'a, T>> {
    check_dtype(what, s, dtype)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => err(TwellError::Invalid(format!(
            "{what}: input must be contiguous"
        ))),
    }
}

/// A contiguous bf16 view of a CUDA storage.
fn bf16_view<'a>(what: &'static str, s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, bf16>> {
    typed_view(what, s, l, DType::BF16)
}

/// A bf16 view of a CUDA storage from a layout's start to its last element, for
/// kernels that address the elements through the layout's strides.
fn strided_bf16_view<'a>(
    what: &'static str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, bf16>> {
    check_dtype(what, s, DType::BF16)?;
    let dims = l.dims();
    if dims.contains(&0) {
        return err(TwellError::Invalid(format!(
            "{what}: empty tensor {dims:?}"
        )));
    }
    let last: usize = dims.iter().zip(l.stride()).map(|(d, s)| (d - 1) * s).sum();
    Ok(s.as_cuda_slice::<bf16>()?
        .slice(l.start_offset()..l.start_offset() + last + 1))
}

/// A bf16 output buffer of `len` elements, filled with a NaN pattern when `TWELL_POISON`
/// is set, so tests can see any element a kernel failed to write.
///
/// # Safety
/// The buffer is uninitialised otherwise: the caller's kernels must write every element
/// before it is read.
unsafe fn output_buffer(dev: &CudaDevice, len: usize) -> Result<CudaSlice<bf16>> {
    let mut buf = dev.alloc::<bf16>(len)?;
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("TWELL_POISON").is_some()) {
        return Ok(buf);
    }
    let func = dev.get_or_load_custom_func("twell_fill_u16", "twell_gate_pack", GATE_PACK_PTX)?;
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
