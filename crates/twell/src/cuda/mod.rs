//! CUDA launchers of the TwELL kernels (`kernels/*.cu`, built to PTX by `build.rs`).
//!
//! Everything runs on candle's stream of the input's device, with no host
//! synchronisation: the gate GEMM through cuBLAS, then `gate_pack`, then the two
//! `gated_t2d` kernels; or, for a few rows of inference, the one `twell_mlp_decode`
//! kernel; or, for inference above the break-even density, `twell_mlp_products` (cuBLAS
//! GEMMs around one element-wise kernel). Scratch buffers come from the stream-ordered
//! pool.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape};
use half::bf16;

use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::knobs;
use crate::ops::mlp_result_len;

mod adamw;
mod add_rms_norm;
mod attention_softmax_grad;
mod attention_step;
mod cross_entropy;
mod embedding;
mod gate_gemm;
mod gate_l0;
mod kl_divergence;
mod residual_linear;
mod rope;
mod twell_mlp_decode;
mod twell_mlp_products;
pub use adamw::{adamw_mixed, adamw_moment, adamw_update, bf16_from_master, sum_squares};
pub use add_rms_norm::{add_rms_norm, rms_norm_bwd, MAX_HIDDEN as ADD_RMS_NORM_MAX_HIDDEN};
pub use attention_softmax_grad::{attention_row_dot, attention_softmax_grad};
pub use cross_entropy::{cross_entropy, cross_entropy_bwd};
pub use embedding::embedding_grad;
pub use gate_l0::{gate_l0, gate_l0_grad_gate, gate_l0_grad_norms};
pub use kl_divergence::{kl_divergence, kl_divergence_bwd};
pub use residual_linear::residual_add_linear;
pub use rope::{rope, rope_in_place};
use twell_mlp_decode::{twell_mlp_decode, use_fused_decode, AddNorm, PreNorm};
pub use twell_mlp_products::{products_take, twell_mlp_products};

const GATE_PACK_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_pack.ptx"));
const GATED_T2D_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_t2d.ptx"));
const TWELL_MLP_BWD_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_bwd.ptx"));
const CAUSAL_ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/causal_attention.ptx"));
/// `causal_attention.cu` built for sm_90a, with its wgmma kernel.
const CAUSAL_ATTENTION_SM90A_PTX: &str =
    include_str!(concat!(env!("OUT_DIR"), "/causal_attention_sm90a.ptx"));

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

/// Whether `m` token rows of hidden `d` take [`twell_mlp_add_norm`], the residual add
/// and norm after the MLP folded into its last launch: one row into the one-launch decode
/// kernel (not with `TWELL_DECODE_ADD_NORM=0`), prefill rows into the down row kernel's
/// epilogue (not with `TWELL_PREFILL_ADD_NORM=0`), to measure each against the separate
/// launches on one build.
pub fn add_norm_folds(m: usize, d: usize) -> bool {
    static DECODE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static PREFILL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = |cell: &std::sync::OnceLock<bool>, name: &str| {
        *cell.get_or_init(|| std::env::var(name).map_or(true, |v| v != "0"))
    };
    if !d.is_multiple_of(8) || d > ADD_RMS_NORM_MAX_HIDDEN {
        false
    } else if m == 1 {
        on(&DECODE, "TWELL_DECODE_ADD_NORM") && use_fused_decode(1, d, false)
    } else {
        on(&PREFILL, "TWELL_PREFILL_ADD_NORM") && folds_into_down_rows(m, d)
    }
}

/// Whether the forward of `m` rows of hidden `d` runs the prefill row kernels (whose
/// down kernel can fold the add and norm after it).
fn folds_into_down_rows(m: usize, d: usize) -> bool {
    m > decode_max_tokens().unwrap_or(DECODE_MAX_TOKENS) && row_vectors(d).is_some()
}

/// Whether the one-token launch of [`twell_mlp_add_norm`] also takes the add and norm
/// before the MLP when asked; not with `TWELL_DECODE_PRE_NORM=0`, to measure it against
/// a separate `add_rms_norm` launch on one build.
pub fn pre_norm_folds() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TWELL_DECODE_PRE_NORM").map_or(true, |v| v != "0"))
}

/// Shared memory a block may take without opting in to more.
const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// Values asked of the driver once per context and key (keyed by the context, so two
/// cards never share a value): every prefill forward asks for some of them.
type PerContext = std::sync::Mutex<Option<std::collections::HashMap<(usize, usize), usize>>>;

/// The value `cache` holds for `dev`'s context and `key`, from `ask` the first time.
fn per_context(
    cache: &PerContext,
    dev: &CudaDevice,
    key: usize,
    ask: impl FnOnce() -> Result<usize>,
) -> Result<usize> {
    let key = (dev.cuda_stream().context().cu_ctx() as usize, key);
    let mut guard = cache.lock().expect("per-context cache lock");
    let values = guard.get_or_insert_with(Default::default);
    if let Some(&value) = values.get(&key) {
        return Ok(value);
    }
    let value = ask()?;
    values.insert(key, value);
    Ok(value)
}

/// A device attribute, read from the driver once per context and attribute.
fn device_attribute(
    dev: &CudaDevice,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute,
) -> Result<usize> {
    static VALUES: PerContext = std::sync::Mutex::new(None);
    per_context(&VALUES, dev, attribute as usize, || {
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

/// Whether the device runs sm_90a code (compute capability 9.0, Hopper): its
/// architecture-specific instructions (wgmma) run there and nowhere else.
fn is_sm90(dev: &CudaDevice) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    Ok(
        device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? == 9
            && device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? == 0,
    )
}

/// How many consecutive warps share a token row in the prefill row kernels: the most of
/// 4 and 2 whose parts still fit one wave of the kernels (up to 528 and 1,056 tokens on
/// the H200), else one. With a warp per row and fewer rows than the card holds warps,
/// the loads in flight are few and the kernel lasts as long as its longest row. Measured
/// on the H200 (`docs/kernel-notes.md`): four warps a row took 128-512 tokens to
/// 0.06-0.14 ms from 0.10-0.25 with one, and two warps a row beat four at 768 and 1,024
/// tokens (0.09-0.24 ms against 0.10-0.25) and tied with one at 2,048.
/// `TWELL_ROW_SPLIT` (1, 2 or 4) fixes it, to measure them on one size. `v`: the row
/// kernels' vectors a lane for hidden `d` (`row_vectors`).
fn row_split(dev: &CudaDevice, m: usize, d: usize, v: usize) -> Result<usize> {
    static FIXED: knobs::Cell = knobs::Cell::new();
    let fixed = knobs::read_once(&FIXED, || {
        knobs::env_count("TWELL_ROW_SPLIT", "1, 2 or 4", knobs::is_row_split)
    })?;
    let split = match fixed {
        Some(split) => split,
        None => {
            let wave = multiprocessors(dev)? * row_kernel_warps_per_sm(dev, v)?;
            knobs::ROW_SPLITS
                .into_iter()
                .find(|&split| m * split <= wave)
                .unwrap_or(1)
        }
    };
    // The down kernel's parts meet in shared memory, which must fit a block.
    Ok(if down_split_bytes(split, d) <= DEFAULT_SHARED_BYTES {
        split
    } else {
        1
    })
}

/// Warps of the one-warp-a-row up kernel for rows of `v` vectors a lane (`row_vectors`)
/// that one multiprocessor holds at once, as the driver's occupancy calculator gives it
/// (two blocks of eight at the kernels' 124-128 registers on the H200): a split row's
/// parts should fit one such wave. Asked once per context and row width.
fn row_kernel_warps_per_sm(dev: &CudaDevice, v: usize) -> Result<usize> {
    static VALUES: PerContext = std::sync::Mutex::new(None);
    per_context(&VALUES, dev, v, || {
        let name = format!("gated_t2d_up_rows_bf16_v{v}_s1");
        let up = dev.get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
        let blocks = up
            .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, 0, None)
            .w()? as usize;
        Ok((blocks * (BLOCK_THREADS / 32) as usize).max(1))
    })
}

/// The dynamic shared memory the down row kernel needs for a row split `split` ways:
/// the f32 sums of parts 1.. of each of a block's rows.
fn down_split_bytes(split: usize, d: usize) -> usize {
    let rows_per_block = (BLOCK_THREADS / 32) as usize / split;
    rows_per_block * (split - 1) * d * std::mem::size_of::<f32>()
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

    /// The shape arguments of the pair-grouping kernels: all but d.
    fn push_pattern<'a>(
        &'a self,
        b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    ) {
        b.arg(&self.m)
            .arg(&self.f)
            .arg(&self.tile)
            .arg(&self.cap)
            .arg(&self.n_tiles);
    }

    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.m)
            .arg(&self.d)
            .arg(&self.f)
            .arg(&self.tile)
            .arg(&self.cap)
            .arg(&self.n_tiles);
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

/// Bytes of cuBLAS workspace: Hopper's fast GEMM kernels need one (NVIDIA recommends
/// 32 MiB), and a handle without one falls back to slower kernels.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Tunes a CUDA device for the dense and the sparse path alike:
/// * the stream-ordered memory pool keeps freed memory instead of unmapping it at
///   every synchronisation (as PyTorch's caching allocator does), so per-call
///   scratch costs no driver calls;
/// * candle's cuBLAS handle gets a workspace;
/// * cudarc's per-buffer event tracking is off (`TWELL_EVENT_TRACKING=1` keeps it): it
///   orders work between streams, candle has one, and its two events per allocation
///   cost 40% of a one-token decode step (docs/benchmarks.md).
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
    if std::env::var_os("TWELL_EVENT_TRACKING").is_none() {
        // SAFETY: candle and twell issue all their work on the device's one stream,
        // so the events cudarc records per buffer never order anything.
        unsafe { dev.disable_event_tracking() };
    }
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
            return err(TwellError::Invalid(format!(
                "cublasSetWorkspace: {status:?}"
            )));
        }
    }
    // The handle keeps using the workspace for the life of the process; cuBLASLt's gate
    // GEMM shares it.
    gate_gemm::keep_workspace(dev, workspace);
    Ok(())
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

/// Stages of the forward pass, for `TWELL_PROFILE=1`.
pub const STAGES: [&str; 4] = ["gate GEMM", "pack", "up", "down"];

static PROFILE: std::sync::Mutex<([f64; 4], usize)> = std::sync::Mutex::new(([0.0; 4], 0));

fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TWELL_PROFILE").is_some())
}

/// Mean milliseconds per call of each stage since the last reset (`TWELL_PROFILE=1`
/// only; profiling synchronises after every call).
pub fn take_profile() -> Option<[f64; 4]> {
    let mut p = PROFILE.lock().expect("profile lock");
    let (sums, n) = *p;
    *p = ([0.0; 4], 0);
    (n > 0).then(|| sums.map(|s| s / n as f64))
}

/// What the forward pass leaves on the device besides the output.
pub struct Activity {
    /// `[M, n_tiles]`: nonzeros of each (token, tile), true counts.
    pub counts: CudaSlice<u32>,
    /// Kept only when a backward pass may follow.
    pub backward: Option<BackwardState>,
}

/// What a device backward pass needs from the forward besides the counts: the
/// pattern's slot indices and the `g` and `u` of every listed slot, so the backward
/// recomputes neither gate nor up products (only overflowing tiles are recomputed).
pub struct BackwardState {
    /// `[M, n_tiles, cap]` tile-local neuron indices.
    pub indices: CudaSlice<u8>,
    /// `[M, n_tiles, cap]` gate values `g` of the listed slots.
    pub g_slots: CudaSlice<bf16>,
    /// `[M, n_tiles, cap]` up values `u = x · Wu_j` of the listed slots.
    pub u_slots: CudaSlice<bf16>,
}

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

/// Fills a bf16 buffer with a NaN pattern when `TWELL_POISON` is set, so tests can
/// see any output element a kernel failed to write.
fn poison(dev: &CudaDevice, buf: &mut CudaSlice<bf16>) -> Result<()> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("TWELL_POISON").is_some()) {
        return Ok(());
    }
    let func = dev.get_or_load_custom_func("twell_fill_u16", "twell_gate_pack", GATE_PACK_PTX)?;
    let n = buf.len() as i64;
    let bits: u16 = 0x7fc1;
    let mut b = func.builder();
    b.arg(buf);
    b.arg(&n);
    b.arg(&bits);
    // SAFETY: the kernel writes n u16 words of `buf`.
    unsafe { b.launch(warp_launch(1024 * 8)?) }.w()?;
    Ok(())
}

/// The MLP (`x [m, d]`, `wg [f, d]`, `w_ud [f, 2d]`, bf16) with the residual add and RMS
/// norm after it folded into its last launch: returns `[2 · m · d]`, the sums `residual +
/// mlp(x)` then their norms with weight `alpha [d]`, as `add_rms_norm` writes them. One
/// row runs as the one-launch decode kernel (see `use_fused_decode`); there, with `pre`
/// (a norm weight and its eps), `x` is the previous sublayer's output `y`: the MLP's
/// input is `rms_norm(residual + y)` and the sum adds to `residual + y` (see `PreNorm`).
/// Prefill rows (see [`add_norm_folds`]) fold it into the down row kernel. Inference only.
#[allow(clippy::too_many_arguments)]
pub fn twell_mlp_add_norm(
    (x, xl): (&CudaStorage, &Layout),
    (wg, wl): (&CudaStorage, &Layout),
    (w_ud, ul): (&CudaStorage, &Layout),
    (residual, rl): (&CudaStorage, &Layout),
    (alpha, al): (&CudaStorage, &Layout),
    config: TwellConfig,
    eps: f32,
    pre: Option<((&CudaStorage, &Layout), f32)>,
) -> Result<CudaStorage> {
    let (m, d) = xl.shape().dims2()?;
    let f = wl.shape().dims2()?.0;
    if m > 1 && pre.is_none() && d % 8 == 0 && folds_into_down_rows(m, d) {
        let fold = RowFold {
            residual: bf16_view("residual", residual, rl)?,
            alpha: bf16_view("alpha", alpha, al)?,
            eps,
            pre_norm_eps: None,
        };
        let (sum_normed, _, _) =
            mlp_forward((x, xl), (wg, wl), (w_ud, ul), config, false, Some(fold))?;
        return Ok(sum_normed);
    }
    if !use_fused_decode(m, d, false) || d % 8 != 0 {
        return err(TwellError::Invalid(format!(
            "twell_mlp_add_norm takes one token row whose hidden size the one-launch \
             decode kernel takes (the norm before the MLP folded in too, or not), or more \
             than {DECODE_MAX_TOKENS} rows of hidden up to 4096 (without it); got [{m}, {d}]"
        )));
    }
    let dev = x.device().clone();
    let dims = KernelDims::new(1, d, f, config);
    // SAFETY: the kernel's last block writes every element.
    let mut sum_normed = unsafe { dev.alloc::<bf16>(2 * d)? };
    poison(&dev, &mut sum_normed)?;
    let pre = match pre {
        Some(((s, l), eps)) => Some(PreNorm {
            alpha: bf16_view("pre_alpha", s, l)?,
            eps,
        }),
        None => None,
    };
    twell_mlp_decode(
        &dev,
        &bf16_view("x", x, xl)?,
        &bf16_view("gate_proj", wg, wl)?,
        &bf16_view("w_ud", w_ud, ul)?,
        None,
        false,
        &dims,
        Some(AddNorm {
            residual: bf16_view("residual", residual, rl)?,
            alpha: bf16_view("alpha", alpha, al)?,
            eps,
            sum_normed: &mut sum_normed,
            pre,
        }),
    )?;
    Ok(CudaStorage::wrap_cuda_slice(sum_normed, dev))
}

/// The prefill MLP sublayer from the residual sum `s [m, d]` with the norm before the MLP
/// folded in: `(s + mlp(rms_norm(s)), its norm · alpha)`, where `wg` and `w_ud`'s up half
/// already carry the pre-norm's weight (so the norm's own weight is one). The gate GEMM
/// reads `s` itself, and the up row kernel normalises its row in registers and scales the
/// gate by the norm's factor (`gated_t2d_up_rows_norm`): no normalised copy of `s` is
/// written or read. Prefill row kernels only ([`folds_into_down_rows`]).
pub fn twell_mlp_norm_add_norm(
    (s, sl): (&CudaStorage, &Layout),
    (wg, wl): (&CudaStorage, &Layout),
    (w_ud, ul): (&CudaStorage, &Layout),
    (alpha, al): (&CudaStorage, &Layout),
    config: TwellConfig,
    pre_eps: f32,
    eps: f32,
) -> Result<CudaStorage> {
    let (m, d) = sl.shape().dims2()?;
    if d % 8 != 0 || !folds_into_down_rows(m, d) {
        return err(TwellError::Invalid(format!(
            "twell_mlp_norm_add_norm takes more than {DECODE_MAX_TOKENS} rows of hidden up \
             to 4096 (a multiple of 8), got [{m}, {d}]"
        )));
    }
    let fold = RowFold {
        residual: bf16_view("s", s, sl)?,
        alpha: bf16_view("alpha", alpha, al)?,
        eps,
        pre_norm_eps: Some(pre_eps),
    };
    let (sum_normed, _, _) = mlp_forward((s, sl), (wg, wl), (w_ud, ul), config, false, Some(fold))?;
    Ok(sum_normed)
}

/// The whole ReGLU MLP for `x [m, d]`, `wg [f, d]`, `w_ud [f, 2d]` (bf16):
/// returns the result `[mlp_result_len(m, d)]` (the `[m, d]` outputs, then each token's
/// L1 term) and the counts,
/// plus, when `keep_for_backward`, what [`twell_mlp_backward`] needs.
#[allow(clippy::too_many_arguments)]
pub fn twell_mlp_forward(
    x: &CudaStorage,
    xl: &Layout,
    wg: &CudaStorage,
    wl: &Layout,
    w_ud: &CudaStorage,
    ul: &Layout,
    config: TwellConfig,
    keep_for_backward: bool,
) -> Result<(CudaStorage, Shape, Activity)> {
    mlp_forward(
        (x, xl),
        (wg, wl),
        (w_ud, ul),
        config,
        keep_for_backward,
        None,
    )
}

/// The residual add and RMS norm after the MLP, folded into the prefill down kernel's
/// epilogue (the `_norm` row kernels).
struct RowFold<'a> {
    residual: CudaView<'a, bf16>,
    alpha: CudaView<'a, bf16>,
    eps: f32,
    /// The norm before the MLP, folded into the up kernel: `x` is then the residual sum
    /// and the weights carry the norm's weight ([`twell_mlp_norm_add_norm`]).
    pre_norm_eps: Option<f32>,
}

/// [`twell_mlp_forward`]; with `fold` (prefill row kernels only) the result is `[2 · m ·
/// d]`, the sums and their norms as [`twell_mlp_add_norm`] returns them.
fn mlp_forward(
    (x, xl): (&CudaStorage, &Layout),
    (wg, wl): (&CudaStorage, &Layout),
    (w_ud, ul): (&CudaStorage, &Layout),
    config: TwellConfig,
    keep_for_backward: bool,
    fold: Option<RowFold<'_>>,
) -> Result<(CudaStorage, Shape, Activity)> {
    let (m, d) = xl.shape().dims2()?;
    let f = wl.shape().dims2()?.0;
    if d % 8 != 0 {
        return err(TwellError::Invalid(format!(
            "the CUDA TwELL kernels need hidden % 8 == 0 (16-byte rows), got hidden {d}"
        )));
    }
    let dev = x.device().clone();
    let (xv, wgv, wudv) = (
        bf16_view("x", x, xl)?,
        bf16_view("gate_proj", wg, wl)?,
        bf16_view("w_ud", w_ud, ul)?,
    );
    let cap = config.capacity();
    let n_tiles = config.n_tiles(f);
    let dims = KernelDims::new(m, d, f, config);

    if fold.is_none() && use_fused_decode(m, d, keep_for_backward) {
        let len = mlp_result_len(m, d);
        // SAFETY: the kernel's last block writes every element; `poison` lets the
        // tests check that.
        let mut out = unsafe { dev.alloc::<bf16>(len)? };
        poison(&dev, &mut out)?;
        let counts = twell_mlp_decode(&dev, &xv, &wgv, &wudv, Some(&mut out), true, &dims, None)?
            .expect("counts asked for");
        let storage = CudaStorage::wrap_cuda_slice(out, dev);
        let activity = Activity {
            counts,
            backward: None,
        };
        return Ok((storage, Shape::from(len), activity));
    }

    let stream = dev.cuda_stream();
    let mut marks = Vec::new();
    let mark = |marks: &mut Vec<_>| -> Result<()> {
        if profiling() {
            // Timing events: the default flags (cudarc disables timing when given None).
            marks.push(
                stream
                    .record_event(Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?,
            );
        }
        Ok(())
    };
    mark(&mut marks)?;
    // The mask kernels number their units in 32 bits: past that the plain GEMM and
    // pack take the gate.
    let mask_units = m * f.div_ceil(32).div_ceil(32);
    let mask_packs = mask_units <= u32::MAX as usize;
    let gate_gemm::Gate {
        values: mut gate,
        mask,
    } = gate_gemm::gate_gemm(&dev, &xv, &wgv, (m, d, f), mask_packs)?;
    mark(&mut marks)?;
    // SAFETY: gate_pack writes every count, and every slot the consumers read.
    let mut counts = unsafe { dev.alloc::<u32>(m * n_tiles)? };
    let mut indices = unsafe { dev.alloc::<u8>(m * n_tiles * cap)? };
    let mut values = unsafe { dev.alloc::<bf16>(m * n_tiles * cap)? };

    let (pack, pack_warps) = match &mask {
        // A lane per mask word: a warp takes MASK_UNITS (row, 32-word) units.
        Some(_) => ("twell_gate_pack_mask_bf16", mask_units.div_ceil(MASK_UNITS)),
        None => {
            // 16-byte loads need every row and tile start aligned: d_ff % 8 == 0. The
            // vector kernel splits its warp index into (row, tile) in 32 bits; the
            // scalar one in 64, so past 2^32 (row, tile) items it takes over. The
            // vector kernel takes PACK_UNITS (row, tile) units a warp, the scalar one.
            if f % 8 == 0 && m * n_tiles <= u32::MAX as usize {
                (
                    "twell_gate_pack_vec_bf16",
                    (m * n_tiles).div_ceil(PACK_UNITS),
                )
            } else {
                ("twell_gate_pack_bf16", m * n_tiles)
            }
        }
    };
    let pack = dev.get_or_load_custom_func(pack, "twell_gate_pack", GATE_PACK_PTX)?;
    let mut b = pack.builder();
    b.arg(&gate);
    if let Some((bits, _)) = &mask {
        b.arg(bits);
    }
    b.arg(&mut counts).arg(&mut indices).arg(&mut values);
    dims.push_pattern(&mut b);
    let words_per_row = mask.as_ref().map(|(_, words)| *words as i32);
    if let Some(words) = &words_per_row {
        b.arg(words);
    }
    // SAFETY: bounds checked in the kernel.
    unsafe { b.launch(warp_launch(pack_warps)?) }.w()?;
    // For a backward pass: the slots' g before `up` writes h over them, and a buffer
    // where `up` leaves each slot's u. A null pointer tells `up` not to.
    let mut kept = if keep_for_backward {
        let g_slots = stream.clone_dtod(&values).w()?;
        // SAFETY: `up` writes the u of every listed slot, the only ones read.
        let u_slots = unsafe { dev.alloc::<bf16>(values.len())? };
        Some((g_slots, u_slots))
    } else {
        None
    };
    let no_u: u64 = 0;
    mark(&mut marks)?;

    let len = match fold {
        Some(_) => 2 * m * d,
        None => mlp_result_len(m, d),
    };
    // SAFETY: the last kernel writes every element; `poison` lets the tests check that.
    let mut out = unsafe { dev.alloc::<bf16>(len)? };
    poison(&dev, &mut out)?;
    let decode = m <= decode_max_tokens()?;
    // Prefill rows that fit a warp's registers take the row kernels: a warp per row
    // computes h (x in registers), then a warp per row accumulates the down projection
    // (the output row in registers). Decode (or rows too wide for registers) spreads h
    // over a warp per slot (decode) or per tile, then the down projection, whose partial
    // sums meet in f32 atomics when rows are few.
    let row_kernels = if decode { None } else { row_vectors(d) };
    if fold.is_some() && row_kernels.is_none() {
        return err(TwellError::Invalid(format!(
            "the residual add and norm fold into the prefill row kernels only: more than \
             {DECODE_MAX_TOKENS} rows of hidden up to 4096, got [{m}, {d}]"
        )));
    }
    let slots_per_warp: usize = if decode { 1 } else { cap };
    let split = match row_kernels {
        Some(v) => row_split(&dev, m, d, v)?,
        None => 1,
    };
    let pre_norm_eps = fold.as_ref().and_then(|f| f.pre_norm_eps);
    let (up_name, up_warps) = match row_kernels {
        Some(v) => {
            let kind = if pre_norm_eps.is_some() { "_norm" } else { "" };
            (
                format!("gated_t2d_up_rows{kind}_bf16_v{v}_s{split}"),
                m * split,
            )
        }
        None => (
            "gated_t2d_up_bf16".to_string(),
            m * n_tiles * (cap / slots_per_warp),
        ),
    };
    // The row kernel stores each row's L1 term; the slot kernel adds into it.
    let mut l1 = match row_kernels {
        // SAFETY: up_rows writes every row's L1 term.
        Some(_) => unsafe { dev.alloc::<f32>(m)? },
        None => dev.alloc_zeros::<f32>(m)?,
    };
    let up = dev.get_or_load_custom_func(&up_name, "gated_t2d", GATED_T2D_PTX)?;
    let spw_i = slots_per_warp as i32;
    let mut b = up.builder();
    b.arg(&xv)
        .arg(&wudv)
        .arg(&counts)
        .arg(&indices)
        .arg(&mut values)
        .arg(&mut gate)
        .arg(&mut l1);
    match kept.as_mut() {
        Some((_, u_slots)) => b.arg(u_slots),
        None => b.arg(&no_u),
    };
    dims.push(&mut b);
    if row_kernels.is_none() {
        b.arg(&spw_i);
    }
    if let Some(pre_eps) = &pre_norm_eps {
        b.arg(pre_eps);
    }
    // SAFETY: `split` warps per row (row kernel; a divisor of the block's warps) or one
    // per (row, tile, slot group), bounds checked in the kernel.
    unsafe { b.launch(warp_launch(up_warps)?) }.w()?;
    mark(&mut marks)?;
    match row_kernels {
        Some(v) => {
            let kind = if fold.is_some() { "_norm" } else { "" };
            let down_name = format!("gated_t2d_down_rows{kind}_bf16_v{v}_s{split}");
            let down = dev.get_or_load_custom_func(&down_name, "gated_t2d", GATED_T2D_PTX)?;
            let mut b = down.builder();
            b.arg(&wudv)
                .arg(&counts)
                .arg(&indices)
                .arg(&values)
                .arg(&gate)
                .arg(&l1)
                .arg(&mut out);
            dims.push(&mut b);
            if let Some(fold) = &fold {
                b.arg(&fold.residual).arg(&fold.alpha).arg(&fold.eps);
            }
            let mut cfg = warp_launch(m * split)?;
            cfg.shared_mem_bytes = down_split_bytes(split, d) as u32;
            // SAFETY: `split` warps per row (a divisor of the block's warps, its shared
            // memory sized above), bounds checked in the kernel.
            unsafe { b.launch(cfg) }.w()?;
        }
        None => {
            let tile_groups = if decode { n_tiles } else { 1 };
            // The f32 partial sums exist only on the decode path.
            let mut acc = if decode {
                dev.alloc_zeros::<f32>(m * d)?
            } else {
                // SAFETY: a placeholder; with one tile group the kernel never reads it.
                unsafe { dev.alloc::<f32>(1)? }
            };
            let n_chunks = d.div_ceil(WARP_CHUNK);
            let tg_i = tile_groups as i32;
            let down =
                dev.get_or_load_custom_func("gated_t2d_down_bf16", "gated_t2d", GATED_T2D_PTX)?;
            let mut b = down.builder();
            b.arg(&wudv)
                .arg(&counts)
                .arg(&indices)
                .arg(&values)
                .arg(&gate)
                .arg(&l1)
                .arg(&mut acc)
                .arg(&mut out);
            dims.push(&mut b);
            b.arg(&tg_i);
            // SAFETY: one warp per (row, chunk, tile group), bounds checked in the kernel.
            unsafe { b.launch(warp_launch(m * n_chunks * tile_groups)?) }.w()?;
            if decode {
                let finish = dev.get_or_load_custom_func(
                    "gated_t2d_finish_bf16",
                    "gated_t2d",
                    GATED_T2D_PTX,
                )?;
                let mut b = finish.builder();
                b.arg(&acc).arg(&l1).arg(&mut out).arg(&dims.m).arg(&dims.d);
                let blocks = len.div_ceil(BLOCK_THREADS as usize).min(4096);
                let cfg = grid_1d(blocks, BLOCK_THREADS);
                // SAFETY: grid-stride loop over the `len` elements of `out`.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
    }
    mark(&mut marks)?;
    if profiling() {
        stream.synchronize().w()?;
        let mut p = PROFILE.lock().expect("profile lock");
        for k in 0..4 {
            p.0[k] += marks[k].elapsed_ms(&marks[k + 1]).w()? as f64;
        }
        p.1 += 1;
    }
    let storage = CudaStorage::wrap_cuda_slice(out, dev);
    let backward = kept.map(|(g_slots, u_slots)| BackwardState {
        indices,
        g_slots,
        u_slots,
    });
    Ok((storage, Shape::from(len), Activity { counts, backward }))
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
        // SAFETY: shapes and leading dimensions match the buffers; the first GEMM
        // writes every element of dx, the second adds to it.
        unsafe {
            blas.gemm(dx_gemm(d, bf16::ZERO), &wgv, &dg, &mut dx).w()?;
            blas.gemm(dx_gemm(2 * d, bf16::ONE), &wudv, &du, &mut dx)
                .w()?;
        }
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
        blas.gemm(weight_grad(d, d), &xv, &dg, &mut dwg).w()?;
        blas.gemm(weight_grad(d, 2 * d), &xv, &du, &mut dw_ud.slice_mut(0..))
            .w()?;
        // dres's first m · d elements are d(loss)/d(out) as [m, d].
        blas.gemm(weight_grad(d, 2 * d), &rv, &h, &mut dw_ud.slice_mut(d..))
            .w()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(dx, dev.clone()),
        CudaStorage::wrap_cuda_slice(dwg, dev.clone()),
        CudaStorage::wrap_cuda_slice(dw_ud, dev),
    ))
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
        .arg(&mut *dw_ud)
        .arg(&dims.d)
        .arg(&dims.f)
        .arg(&dims.tile)
        .arg(&dims.cap)
        .arg(&dims.n_tiles);
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
        .arg(dw_ud)
        .arg(&dims.d)
        .arg(&dims.f)
        .arg(&dims.tile)
        .arg(&dims.cap)
        .arg(&dims.n_tiles);
    // SAFETY: a block per neuron; the second half of every row of dw_ud is written.
    unsafe { b.launch(neuron_grid) }.w()?;
    Ok(())
}

/// (row, tile) units per warp of `twell_gate_pack_vec_bf16` (`PACK_UNITS` in the .cu).
const PACK_UNITS: usize = 4;
/// (row, 32-word) units per warp of `twell_gate_pack_mask_bf16` (`MASK_UNITS` there).
const MASK_UNITS: usize = 8;
/// Queries per block of the attention kernels (`ATT_QUERIES` in the .cu).
const ATTENTION_QUERIES: usize = 128;
/// Threads per block of the attention kernel (`ATT_WARPS` warps).
const ATTENTION_THREADS: u32 = 128;
/// Threads per block of its wgmma kernel (`ATT_WGMMA_WARPS` warps, two warpgroups).
const ATTENTION_WGMMA_THREADS: u32 = 256;
/// Threads per (batch, head) of the one-query attention kernel (`DECODE_THREADS`).
const ATTENTION_DECODE_THREADS: u32 = 256;

/// Element strides of a `[b, heads, positions, hd]` operand of the attention kernels
/// (`Strides` in the .cu): batch, head, position; the head dims are contiguous.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttentionStrides {
    b: i64,
    h: i64,
    t: i64,
}

// SAFETY: a plain `#[repr(C)]` struct of three i64, as the kernels declare it.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for AttentionStrides {}

/// The strides of a 4-d layout, if the kernels can read it: the last dim contiguous
/// and every row 16-byte aligned (their vector loads).
pub fn attention_strides(l: &Layout) -> Option<[usize; 3]> {
    match *l.stride() {
        [b, h, t, 1] if [b, h, t, l.start_offset()].iter().all(|s| s % 8 == 0) => Some([b, h, t]),
        _ => None,
    }
}

/// Whether the prefill attention runs its wgmma kernel (sm_90a, hd 64): on a compute
/// capability 9.0 card unless `TWELL_ATTENTION=mma` picks the portable mma.sync kernel,
/// to measure or check both on one card (`TWELL_ATTENTION=wgmma` insists, and fails
/// elsewhere).
fn attention_on_wgmma(dev: &CudaDevice) -> Result<bool> {
    static CHOICE: knobs::Cell = knobs::Cell::new();
    let choice = knobs::read_once(&CHOICE, || {
        knobs::env_choice("TWELL_ATTENTION", &["wgmma", "mma"])
    })?;
    let sm90 = is_sm90(dev)?;
    match choice {
        None => Ok(sm90),
        Some(0) if !sm90 => err(TwellError::Invalid(
            "TWELL_ATTENTION=wgmma needs a compute capability 9.0 card".to_string(),
        )),
        Some(choice) => Ok(choice == 0),
    }
}

/// The kernel [`causal_attention`] runs for `t` queries against `total` keys of head
/// size `hd` (`twell check-gpu` names it in its report).
pub fn prefill_attention_kernel(
    dev: &CudaDevice,
    t: usize,
    total: usize,
    hd: usize,
) -> Result<String> {
    Ok(if t == 1 && total <= crate::ops::CUDA_DECODE_MAX_KEYS {
        format!("causal_attention_decode_bf16_hd{hd}")
    } else if hd == 64 && attention_on_wgmma(dev)? {
        format!("causal_attention_wgmma_bf16_hd{hd}")
    } else {
        format!("causal_attention_bf16_hd{hd}")
    })
}

/// `causal_attention.cu`'s one-step kernel: `qkv [b, (heads + 2·kv_heads)·hd]` (one
/// token's fused projections, contiguous bf16), `cos_sin [1, hd]` (its position's
/// angles), and `cache [b, capacity, 2·kv_heads·hd]` (contiguous, `len` positions held,
/// `len < capacity`): writes the token's turned key and its value at position `len` of
/// every sequence's cache (the storage is written though it is borrowed: the kernel
/// runs on the stream after every earlier reader) and returns the attention rows `[b,
/// heads·hd]`.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_step(
    qkv: &CudaStorage,
    ql: &Layout,
    cs: &CudaStorage,
    cl: &Layout,
    cache: &CudaStorage,
    kl: &Layout,
    (b, heads, kv_heads, hd, len): (usize, usize, usize, usize, usize),
    scale: f32,
) -> Result<CudaStorage> {
    if !crate::ops::CUDA_HEAD_DIMS.contains(&hd) || len >= crate::ops::CUDA_DECODE_MAX_KEYS {
        return err(TwellError::Invalid(format!(
            "causal_attention_step on CUDA takes head sizes {:?} and fewer than {} keys, got \
             {hd} and {}",
            crate::ops::CUDA_HEAD_DIMS,
            crate::ops::CUDA_DECODE_MAX_KEYS,
            len + 1
        )));
    }
    if heads > 65535 || b > 65535 {
        return err(TwellError::Invalid(format!(
            "causal_attention_step on CUDA: batch {b} and heads {heads} must be at most 65535"
        )));
    }
    let (qv, cv, kv) = (
        bf16_view("qkv", qkv, ql)?,
        bf16_view("cos_sin", cs, cl)?,
        bf16_view("cache", cache, kl)?,
    );
    let cache_b = (kl.dims()[1] * kl.dims()[2]) as i64;
    let dev = qkv.device().clone();
    let split = crate::attention_split::plan(
        b * heads,
        len,
        multiprocessors(&dev)?,
        crate::attention_split::forced_splits()?,
    );
    // SAFETY: the kernel writes every output row.
    let mut out = unsafe { dev.alloc::<bf16>(b * heads * hd)? };
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, b as u32, split.splits as u32),
        block_dim: (ATTENTION_DECODE_THREADS, 1, 1),
        shared_mem_bytes: ((split.chunk + 1) * std::mem::size_of::<f32>()) as u32,
    };
    let name = format!("causal_attention_step_bf16_hd{hd}");
    let func = dev.get_or_load_custom_func(&name, "causal_attention", CAUSAL_ATTENTION_PTX)?;
    let (heads_i, kv_i, len_i, chunk_i) = (
        heads as i32,
        kv_heads as i32,
        len as i32,
        split.chunk as i32,
    );
    let part_len = b * heads * split.splits * (2 + hd);
    attention_step::with_scratch(&dev, part_len, b * heads, |scratch| {
        let mut builder = func.builder();
        builder
            .arg(&qv)
            .arg(&cv)
            // Read (the positions before `len`), then written (position `len`).
            .arg(&kv)
            .arg(&kv)
            .arg(&mut out)
            .arg(&heads_i)
            .arg(&kv_i)
            .arg(&len_i)
            .arg(&cache_b)
            .arg(&scale)
            .arg(&chunk_i)
            .arg(&mut scratch.part)
            .arg(&mut scratch.tickets);
        // SAFETY: a block per (head, batch, split); rows addressed within the shapes the
        // op checked (position `len` < capacity); the dynamic shared memory holds `chunk
        // + 1` scores; the scratch holds every split's partial sums and a ticket per
        // (head, batch).
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    })?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `causal_attention.cu` for `q [b, heads, t, hd]`, `k, v [b, kv_heads, T, hd]` (bf16,
/// any layout [`attention_strides`] accepts, hd in [`crate::ops::CUDA_HEAD_DIMS`]);
/// `dims` = (b, heads, t, kv_heads, T, hd). The output is `[b, t, heads, hd]`. With
/// `q_angles` (`cos_sin [t, hd]`, contiguous bf16) q is taken unturned and the kernel
/// applies RoPE to it as it stages it; the prefill kernels only (not one query).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
    dims: (usize, usize, usize, usize, usize, usize),
    scale: f32,
    q_angles: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let (b, heads, t, kv_heads, total, hd) = dims;
    if !crate::ops::CUDA_HEAD_DIMS.contains(&hd) {
        return err(TwellError::Invalid(format!(
            "causal_attention on CUDA takes head sizes {:?}, got {hd}",
            crate::ops::CUDA_HEAD_DIMS
        )));
    }
    if heads > 65535 || b > 65535 {
        return err(TwellError::Invalid(format!(
            "causal_attention on CUDA: batch {b} and heads {heads} must be at most 65535"
        )));
    }
    let strides = |what: &str, l: &Layout| -> Result<AttentionStrides> {
        match attention_strides(l) {
            Some([b, h, t]) => Ok(AttentionStrides {
                b: b as i64,
                h: h as i64,
                t: t as i64,
            }),
            None => err(TwellError::Invalid(format!(
                "causal_attention on CUDA: {what} needs contiguous head dims and 16-byte aligned \
                 rows, got strides {:?} at offset {}",
                l.stride(),
                l.start_offset()
            ))),
        }
    };
    let (qst, kst, vst) = (strides("q", ql)?, strides("k", kl)?, strides("v", vl)?);
    let dev = q.device().clone();
    let (qv, kv, vv) = (
        strided_bf16_view("q", q, ql)?,
        strided_bf16_view("k", k, kl)?,
        strided_bf16_view("v", v, vl)?,
    );
    // SAFETY: the kernel writes every output row.
    let mut out = unsafe { dev.alloc::<bf16>(b * heads * t * hd)? };
    // One query per (batch, head): a block per (batch, head) over the keys, whose scores
    // fit in shared memory. Otherwise ATTENTION_QUERIES queries a block.
    let one_query = t == 1 && total <= crate::ops::CUDA_DECODE_MAX_KEYS;
    let angles = match q_angles {
        None => None,
        Some(_) if one_query => {
            return err(TwellError::Invalid(
                "causal_attention on CUDA: one query per sequence takes q already turned".into(),
            ))
        }
        Some((cs, csl)) => {
            // 16-byte loads of each row's cos and sin.
            if csl.dims() != [t, hd] || !csl.is_contiguous() || csl.start_offset() % 8 != 0 {
                return err(TwellError::ShapeMismatch {
                    what: "causal_attention q_angles",
                    detail: format!(
                        "want contiguous [{t}, {hd}] starting 16-byte aligned, got {:?} at \
                         offset {}",
                        csl.dims(),
                        csl.start_offset()
                    ),
                });
            }
            Some(bf16_view("q_angles", cs, csl)?)
        }
    };
    let name = prefill_attention_kernel(&dev, t, total, hd)?;
    let wgmma = name.starts_with("causal_attention_wgmma");
    let cfg = if one_query {
        LaunchConfig {
            grid_dim: (heads as u32, b as u32, 1),
            block_dim: (ATTENTION_DECODE_THREADS, 1, 1),
            shared_mem_bytes: (total * std::mem::size_of::<f32>()) as u32,
        }
    } else {
        let threads = if wgmma {
            ATTENTION_WGMMA_THREADS
        } else {
            ATTENTION_THREADS
        };
        LaunchConfig {
            grid_dim: (t.div_ceil(ATTENTION_QUERIES) as u32, heads as u32, b as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    };
    let func = if wgmma {
        dev.get_or_load_custom_func(&name, "causal_attention_sm90a", CAUSAL_ATTENTION_SM90A_PTX)?
    } else {
        dev.get_or_load_custom_func(&name, "causal_attention", CAUSAL_ATTENTION_PTX)?
    };
    let (heads_i, kv_i, t_i, total_i) = (heads as i32, kv_heads as i32, t as i32, total as i32);
    let mut builder = func.builder();
    builder
        .arg(&qv)
        .arg(&kv)
        .arg(&vv)
        .arg(&mut out)
        .arg(&heads_i)
        .arg(&kv_i);
    // The one-query kernel has no query count (it is 1).
    if !one_query {
        builder.arg(&t_i);
    }
    builder
        .arg(&total_i)
        .arg(&scale)
        .arg(&qst)
        .arg(&kst)
        .arg(&vst);
    // The prefill kernels' last argument: q's angles, or a null pointer (q turned).
    let no_angles: u64 = 0;
    if !one_query {
        match &angles {
            Some(cs) => builder.arg(cs),
            None => builder.arg(&no_angles),
        };
    }
    // SAFETY: the grid covers every (batch, head) and query row, keys are bounded by
    // `total` and rows addressed through the strides checked above; the one-query
    // kernel's dynamic shared memory holds its `total` scores (at most
    // CUDA_DECODE_MAX_KEYS).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
