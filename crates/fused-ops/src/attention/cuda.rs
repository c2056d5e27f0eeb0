//! Launchers of `causal_attention.cu`: the prefill attention (mma.sync, or wgmma on
//! sm_90a), the one-query attention over a short cache, and the decode step that appends
//! a token's key and value to the cache as it attends.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};
use half::bf16;

use super::step_scratch;
use crate::cuda::{bf16_view, is_sm90, multiprocessors, strided_bf16_view};
use crate::error::{err, OpError};

const CAUSAL_ATTENTION_PTX: &str = twell_kernels::CAUSAL_ATTENTION;
/// `causal_attention.cu` built for sm_90a, with its wgmma kernel.
const CAUSAL_ATTENTION_SM90A_PTX: &str = twell_kernels::CAUSAL_ATTENTION_SM90A;

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

static PORTABLE_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs the prefill attention on its portable mma.sync kernel on every card, also where
/// the wgmma kernel would run: so that a Hopper card can check and time the kernel other
/// cards run. Process-wide; for tests and benchmarks.
pub fn set_portable_attention(on: bool) {
    PORTABLE_ONLY.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the prefill attention runs its wgmma kernel (sm_90a, hd 64): on a compute
/// capability 9.0 card, unless [`set_portable_attention`] says otherwise.
fn attention_on_wgmma(dev: &CudaDevice) -> Result<bool> {
    Ok(is_sm90(dev)? && !PORTABLE_ONLY.load(std::sync::atomic::Ordering::Relaxed))
}

/// The kernel [`causal_attention`] runs for `t` queries against `total` keys of head
/// size `hd` (the GPU tests name it in their reports).
pub fn prefill_attention_kernel(
    dev: &CudaDevice,
    t: usize,
    total: usize,
    hd: usize,
) -> Result<String> {
    Ok(if t == 1 && total <= crate::CUDA_DECODE_MAX_KEYS {
        format!("causal_attention_decode_bf16_hd{hd}")
    } else if hd == 64 && attention_on_wgmma(dev)? {
        format!("causal_attention_wgmma_bf16_hd{hd}")
    } else {
        format!("causal_attention_bf16_hd{hd}")
    })
}

/// The launch of a decode-step kernel: a block per (head, row, split), the scores of a
/// split's `chunk` positions and the new key in dynamic shared memory.
fn step_launch(heads: usize, rows: usize, splits: usize, chunk: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (heads as u32, rows as u32, splits as u32),
        block_dim: (ATTENTION_DECODE_THREADS, 1, 1),
        shared_mem_bytes: ((chunk + 1) * std::mem::size_of::<f32>()) as u32,
    }
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
    if !crate::CUDA_HEAD_DIMS.contains(&hd) || len >= crate::CUDA_DECODE_MAX_KEYS {
        return err(OpError::Invalid(format!(
            "causal_attention_step on CUDA takes head sizes {:?} and fewer than {} keys, got \
             {hd} and {}",
            crate::CUDA_HEAD_DIMS,
            crate::CUDA_DECODE_MAX_KEYS,
            len + 1
        )));
    }
    if heads > 65535 || b > 65535 {
        return err(OpError::Invalid(format!(
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
    let split = super::split::plan(b * heads, len, multiprocessors(&dev)?);
    // SAFETY: the kernel writes every output row.
    let mut out = unsafe { dev.alloc::<bf16>(b * heads * hd)? };
    let cfg = step_launch(heads, b, split.splits, split.chunk);
    let name = format!("causal_attention_step_bf16_hd{hd}");
    let func = dev.get_or_load_custom_func(&name, "causal_attention", CAUSAL_ATTENTION_PTX)?;
    let (heads_i, kv_i, len_i, chunk_i) = (
        heads as i32,
        kv_heads as i32,
        len as i32,
        split.chunk as i32,
    );
    let part_len = b * heads * split.splits * (2 + hd);
    step_scratch::with_scratch(&dev, part_len, b * heads, |scratch| {
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
/// any layout [`attention_strides`] accepts, hd in [`crate::CUDA_HEAD_DIMS`]);
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
    if !crate::CUDA_HEAD_DIMS.contains(&hd) {
        return err(OpError::Invalid(format!(
            "causal_attention on CUDA takes head sizes {:?}, got {hd}",
            crate::CUDA_HEAD_DIMS
        )));
    }
    if heads > 65535 || b > 65535 {
        return err(OpError::Invalid(format!(
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
            None => err(OpError::Invalid(format!(
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
    let one_query = t == 1 && total <= crate::CUDA_DECODE_MAX_KEYS;
    let angles = match q_angles {
        None => None,
        Some(_) if one_query => {
            return err(OpError::Invalid(
                "causal_attention on CUDA: one query per sequence takes q already turned".into(),
            ))
        }
        Some((cs, csl)) => {
            // 16-byte loads of each row's cos and sin.
            if csl.dims() != [t, hd] || !csl.is_contiguous() || csl.start_offset() % 8 != 0 {
                return err(OpError::ShapeMismatch {
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

fn u32_view<'a>(
    what: &str,
    (s, l): (&'a CudaStorage, &Layout),
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>> {
    crate::cuda::typed_view::<u32>(what, s, l, candle_core::DType::U32)
}

/// The operands of [`causal_attention_slots`], each a storage and its layout.
pub struct SlotStepArgs<'a> {
    pub qkv: (&'a CudaStorage, &'a Layout),
    pub cos_sin: (&'a CudaStorage, &'a Layout),
    pub cache: (&'a CudaStorage, &'a Layout),
    pub positions: (&'a CudaStorage, &'a Layout),
    pub slots: (&'a CudaStorage, &'a Layout),
    pub part: (&'a CudaStorage, &'a Layout),
    pub tickets: (&'a CudaStorage, &'a Layout),
}

/// `causal_attention.cu`'s step over a slotted cache (`super::SlotAttention`): `n` rows,
/// each at `positions[i]` of cache slot `slots[i]`; the cached positions split over
/// `splits` blocks of `chunk` positions planned for the cache's capacity. The shapes
/// were checked by the op.
pub fn causal_attention_slots(
    args: SlotStepArgs,
    (n, heads, kv_heads, hd): (usize, usize, usize, usize),
    (splits, chunk): (usize, usize),
) -> Result<CudaStorage> {
    let qv = bf16_view("qkv", args.qkv.0, args.qkv.1)?;
    let cv = bf16_view("cos_sin", args.cos_sin.0, args.cos_sin.1)?;
    let kv = bf16_view("cache", args.cache.0, args.cache.1)?;
    let pv = u32_view("positions", args.positions)?;
    let sv = u32_view("slots", args.slots)?;
    let part = crate::cuda::typed_view::<f32>(
        "scratch",
        args.part.0,
        args.part.1,
        candle_core::DType::F32,
    )?;
    let tickets = u32_view("tickets", args.tickets)?;
    let kl = args.cache.1;
    let cache_b = (kl.dims()[1] * kl.dims()[2]) as i64;
    let dev = args.qkv.0.device().clone();
    // SAFETY: the kernel writes every output row.
    let mut out = unsafe { dev.alloc::<bf16>(n * heads * hd)? };
    let cfg = step_launch(heads, n, splits, chunk);
    let name = format!("causal_attention_slots_bf16_hd{hd}");
    let func = dev.get_or_load_custom_func(&name, "causal_attention", CAUSAL_ATTENTION_PTX)?;
    let (heads_i, kv_i, chunk_i) = (heads as i32, kv_heads as i32, chunk as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut builder = func.builder();
    builder
        .arg(&qv)
        .arg(&cv)
        // Read (each row's positions before its own), then written (its position).
        .arg(&kv)
        .arg(&kv)
        .arg(&mut out)
        .arg(&heads_i)
        .arg(&kv_i)
        .arg(&cache_b)
        .arg(&scale)
        .arg(&chunk_i)
        .arg(&part)
        .arg(&tickets)
        .arg(&pv)
        .arg(&sv);
    // SAFETY: a block per (head, row, split); each row's position is below the capacity
    // and its slot below the cache's slots (the caller's contract, checked on its host);
    // the dynamic shared memory holds `chunk + 1` scores; the scratch holds every split's
    // partial sums and a ticket per (row, head), zero between launches.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
