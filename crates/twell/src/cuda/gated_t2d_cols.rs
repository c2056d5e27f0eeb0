//! The launcher of `kernels/gated_t2d_cols.cu`: the prefill down projection with `Wd`
//! held in shared memory, a block per slice of output columns, every token streamed past
//! it (see the kernel's header for why). It takes over from the row kernel's down launch
//! when enough tokens pay for loading the slices, and gives the same output to the bit.

use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::{device_attribute, multiprocessors, warp_launch, KernelDims};
use crate::down_kernel::{self, DownKernel};
use crate::knobs;

const GATED_T2D_COLS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_t2d_cols.ptx"));

/// Tokens from which the forward takes the column kernel: each of its blocks loads a
/// whole slice of `Wd` (f · C · 2 bytes) before its first token, which few tokens do not
/// repay.
const COLS_MIN_TOKENS: usize = 1024;
/// Shared memory the runtime keeps per block beside the dynamic part.
const RESERVED_SHARED_BYTES: usize = 1024;
/// The neuron index of a list entry is 16 bits.
const MAX_NEURONS: usize = 1 << 16;

/// How one forward runs the column kernel.
pub(super) struct ColsPlan {
    /// Output columns a block owns (the kernel's `C`).
    columns: usize,
    threads: u32,
    /// Token groups (the grid's y): enough blocks to fill the card when the column
    /// blocks alone do not.
    groups: usize,
    shared_bytes: usize,
}

/// Which down kernel a prefill forward takes when one is fixed: by
/// [`down_kernel::force`], else by `TWELL_DOWN=rows` or `=cols`, to measure both on one
/// build.
fn fixed_choice() -> Result<Option<DownKernel>> {
    static CHOICE: knobs::Cell = knobs::Cell::new();
    if let Some(kernel) = down_kernel::forced() {
        return Ok(Some(kernel));
    }
    let knob = knobs::read_once(&CHOICE, || {
        knobs::env_choice("TWELL_DOWN", &["rows", "cols"])
    })?;
    Ok(knob.map(|i| {
        if i == 0 {
            DownKernel::Rows
        } else {
            DownKernel::Columns
        }
    }))
}

/// The plan for `m` rows of hidden `d` through `f` neurons, or `None` where the row
/// kernel runs: few tokens, a slice that does not fit a block's shared memory, more
/// neurons than a list entry names, or `TWELL_DOWN=rows`.
pub(super) fn plan(dev: &CudaDevice, m: usize, d: usize, f: usize) -> Result<Option<ColsPlan>> {
    let wanted = match fixed_choice()? {
        Some(DownKernel::Rows) => false,
        Some(DownKernel::Columns) => true,
        None => m >= COLS_MIN_TOKENS,
    };
    if !wanted || f > MAX_NEURONS {
        return Ok(None);
    }
    let block_max = device_attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let sm_shared = device_attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    )?;
    let slice_bytes = |c: usize| f * c * std::mem::size_of::<bf16>();
    let Some(columns) = [16, 8]
        .into_iter()
        .find(|&c| d.is_multiple_of(c) && slice_bytes(c) <= block_max)
    else {
        return Ok(None);
    };
    let shared_bytes = slice_bytes(columns);
    let per_sm = (sm_shared / (shared_bytes + RESERVED_SHARED_BYTES)).max(1);
    // One block an SM takes 1,024 threads; several share the SM's 2,048.
    let (threads, per_sm) = if per_sm == 1 {
        (1024u32, 1)
    } else {
        (512u32, per_sm.min(4))
    };
    let column_blocks = d / columns;
    let groups = (multiprocessors(dev)? * per_sm / column_blocks)
        .clamp(1, m.div_ceil(threads as usize).max(1));
    Ok(Some(ColsPlan {
        columns,
        threads,
        groups,
        shared_bytes,
    }))
}

/// The TwELL h of a forward, as `gated_t2d`'s up kernel leaves it.
pub(super) struct Activations<'a> {
    pub counts: &'a CudaSlice<u32>,
    pub indices: &'a CudaSlice<u8>,
    pub values: &'a CudaSlice<bf16>,
    /// The dense gate, where overflowing tiles hold their h.
    pub gate: &'a CudaSlice<bf16>,
    pub l1: &'a CudaSlice<f32>,
}

/// `out = h · Wd` and the L1 terms after the rows (`[mlp_result_len(m, d)]`), from the
/// forward's h and `w_ud [f, 2d]`.
pub(super) fn down_cols(
    dev: &CudaDevice,
    plan: &ColsPlan,
    w_ud: &CudaView<'_, bf16>,
    h: Activations<'_>,
    out: &mut CudaSlice<bf16>,
    dims: &KernelDims,
) -> Result<()> {
    let (m, d) = (dims.m as usize, dims.d as usize);
    // Rows of the list start 16-byte aligned.
    let stride = (dims.n_tiles as usize * dims.cap as usize).next_multiple_of(4);
    let stride_i = stride as i32;
    // SAFETY: the list kernel writes every row's length and the entries up to it (padded
    // to a multiple of 4); the down kernel reads no more.
    // Lists of 32 tokens are interleaved, so the last block of 32 is whole.
    let mut list = unsafe { dev.alloc::<u32>(m.next_multiple_of(32) * stride)? };
    let mut list_len = unsafe { dev.alloc::<u32>(m)? };
    let pack = dev.get_or_load_custom_func(
        "gated_t2d_cols_list_bf16",
        "gated_t2d_cols",
        GATED_T2D_COLS_PTX,
    )?;
    let mut b = pack.builder();
    b.arg(h.counts)
        .arg(h.indices)
        .arg(h.values)
        .arg(h.gate)
        .arg(&mut list)
        .arg(&mut list_len);
    dims.push_pattern(&mut b);
    b.arg(&stride_i);
    // SAFETY: a warp per row, bounds checked in the kernel.
    unsafe { b.launch(warp_launch(m)?) }.w()?;

    let name = format!("gated_t2d_cols_down_bf16_c{}", plan.columns);
    let down = dev.get_or_load_custom_func(&name, "gated_t2d_cols", GATED_T2D_COLS_PTX)?;
    down.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        plan.shared_bytes as i32,
    )
    .w()?;
    let mut b = down.builder();
    b.arg(w_ud)
        .arg(&list)
        .arg(&list_len)
        .arg(h.counts)
        .arg(h.indices)
        .arg(h.values)
        .arg(h.gate)
        .arg(h.l1)
        .arg(out);
    dims.push(&mut b);
    b.arg(&stride_i);
    let cfg = LaunchConfig {
        grid_dim: ((d / plan.columns) as u32, plan.groups as u32, 1),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    // SAFETY: d / C column blocks of C columns each (C divides d); every token row of
    // each is visited by the grid-stride loop over y, bounds checked in the kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
