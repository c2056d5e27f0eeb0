//! The one-launch decode MLP (`kernels/src/twell_mlp_decode.cu`): one token row's gate,
//! ReLU, up and down in one kernel, for inference. Its sums (fixed point in 64-bit
//! integers, so that they do not depend on the order of the atomics) live in a scratch
//! buffer kept per stream, that every launch leaves zeroed: a decode step's MLP then
//! costs one launch and two output allocations.

use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaView, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use fused_ops::cuda::{stream_key, PerStream};

use crate::cuda::KernelDims;
use crate::output::mlp_result_len;

const TWELL_MLP_DECODE_PTX: &str = twell_kernels::TWELL_MLP_DECODE;

/// `DECODE_THREADS` in the kernel: one block is one norm block of `rms_norm_row.cuh`, for
/// the folded norms.
const BLOCK_THREADS: u32 = 256;

/// Whether a forward of `m` rows takes the fused kernel: one row (each active neuron
/// adds `d` atomics per row, so with more rows the staged kernels win,
/// docs/design.md), inference only (it keeps nothing for a backward pass), a
/// hidden size whose row fits the warp's registers.
pub fn use_fused_decode(m: usize, d: usize, keep_for_backward: bool) -> bool {
    m == 1 && !keep_for_backward && crate::cuda::row_vectors(d).is_some()
}

/// The zeroed sums, L1 term, tile counts and ticket of one stream, grown to the
/// largest hidden size and tile count seen.
struct Scratch {
    acc: CudaSlice<u64>,
    l1: CudaSlice<f32>,
    tile_counts: CudaSlice<u32>,
    ticket: CudaSlice<u32>,
    /// Blocks of one wave, per kernel (its name).
    grids: HashMap<&'static str, u32>,
}

impl Scratch {
    fn new(dev: &CudaDevice, d: usize, n_tiles: usize) -> Result<Self> {
        Ok(Self {
            acc: dev.alloc_zeros::<u64>(d)?,
            l1: dev.alloc_zeros::<f32>(1)?,
            tile_counts: dev.alloc_zeros::<u32>(n_tiles)?,
            ticket: dev.alloc_zeros::<u32>(1)?,
            grids: HashMap::new(),
        })
    }

    fn fits(&self, d: usize, n_tiles: usize) -> bool {
        self.acc.len() >= d && self.tile_counts.len() >= n_tiles
    }
}

/// The entry point for a row of `v` 16-byte vectors a lane, named without formatting a
/// string on every decode step.
fn kernel_name(folds_pre: bool, v: usize) -> &'static str {
    const PLAIN: [&str; 5] = [
        "twell_mlp_decode_bf16_v1",
        "twell_mlp_decode_bf16_v2",
        "twell_mlp_decode_bf16_v4",
        "twell_mlp_decode_bf16_v8",
        "twell_mlp_decode_bf16_v16",
    ];
    const NORM: [&str; 5] = [
        "twell_mlp_decode_norm_bf16_v1",
        "twell_mlp_decode_norm_bf16_v2",
        "twell_mlp_decode_norm_bf16_v4",
        "twell_mlp_decode_norm_bf16_v8",
        "twell_mlp_decode_norm_bf16_v16",
    ];
    let i = v.trailing_zeros() as usize;
    match folds_pre {
        true => NORM[i],
        false => PLAIN[i],
    }
}

/// Blocks of one wave: as many as the multiprocessors hold at once. The warps loop
/// over the neurons, so a warp loads its row of x once for several of them, and no
/// partial last wave idles the card.
fn one_wave(dev: &CudaDevice, func: &CudaFunction) -> Result<u32> {
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, 0, None)
        .w()?;
    Ok(fused_ops::cuda::multiprocessors(dev)? as u32 * per_sm.max(1))
}

static SCRATCH: PerStream<Scratch> = PerStream::new();

/// The residual add and RMS norm that a launch may fold into its epilogue: `residual
/// [1, d]`, the norm's weight `alpha [d]` and `eps`, into `sum_normed [2, d]` (the sum,
/// then the normalised row), as `add_rms_norm` would write them.
pub struct AddNorm<'a> {
    pub residual: CudaView<'a, bf16>,
    pub alpha: CudaView<'a, bf16>,
    pub eps: f32,
    pub sum_normed: &'a mut CudaSlice<bf16>,
    /// The norm before the MLP, folded in too.
    pub pre: Option<PreNorm<'a>>,
}

/// The residual add and RMS norm before the MLP: the launch's `x` is then the previous
/// sublayer's output `y`, the MLP's input `rms_norm(residual + y) · alpha`, and the add
/// after the MLP adds to `residual + y`. A decode step's MLP sublayer is then one launch.
pub struct PreNorm<'a> {
    pub alpha: CudaView<'a, bf16>,
    pub eps: f32,
}

// Hidden sizes the folded add + norm takes: those of `add_rms_norm.cu`, whose partition
// of the row (256 threads, at most four 16-byte vectors each) it repeats.
use fused_ops::cuda::ADD_RMS_NORM_MAX_HIDDEN as ADD_NORM_MAX_HIDDEN;

/// Runs the fused MLP of the row `x [1, d]` into `out [mlp_result_len(1, d)]` (and, with
/// `add_norm`, the residual add and norm after it) and returns the `[1, n_tiles]` true
/// nonzero counts. With `add_norm`, the MLP row and the counts are written only where
/// asked for (`out`, `want_counts`): a decode step reads neither, and each is an
/// allocation a layer.
#[allow(clippy::too_many_arguments)]
pub fn twell_mlp_decode(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    w_ud: &CudaView<bf16>,
    out: Option<&mut CudaSlice<bf16>>,
    want_counts: bool,
    dims: &KernelDims,
    add_norm: Option<AddNorm<'_>>,
) -> Result<Option<CudaSlice<u32>>> {
    let (d, f, n_tiles) = (dims.d as usize, dims.f as usize, dims.n_tiles as usize);
    if add_norm.is_none() && (out.is_none() || !want_counts) {
        return crate::error::err(crate::error::TwellError::Invalid(
            "twell_mlp_decode: without a folded add + norm the MLP row and counts are the \
             results, so both must be asked for"
                .into(),
        ));
    }
    if let Some(o) = &out {
        debug_assert_eq!(o.len(), mlp_result_len(1, d));
    }
    let mut add_norm = add_norm;
    if let Some(a) = &add_norm {
        if d > ADD_NORM_MAX_HIDDEN
            || a.residual.len() != d
            || a.alpha.len() != d
            || a.sum_normed.len() != 2 * d
            || a.pre.as_ref().is_some_and(|p| p.alpha.len() != d)
        {
            return crate::error::err(crate::error::TwellError::Invalid(format!(
                "twell_mlp_decode: the folded add + norm takes hidden <= {ADD_NORM_MAX_HIDDEN}, \
                 a residual and norm weights of {d} and a result of {}, got {}, {}, {:?} and {}",
                2 * d,
                a.residual.len(),
                a.alpha.len(),
                a.pre.as_ref().map(|p| p.alpha.len()),
                a.sum_normed.len()
            )));
        }
    }
    let v = crate::cuda::row_vectors(d).expect("use_fused_decode checked the hidden size");
    // SAFETY: the kernel's last block writes every count.
    let mut counts = match want_counts {
        true => Some(unsafe { dev.alloc::<u32>(n_tiles)? }),
        false => None,
    };
    SCRATCH.with(
        stream_key(dev),
        |s| s.fits(d, n_tiles),
        || Scratch::new(dev, d, n_tiles),
        |s| {
            // The norm before the MLP has entry points of its own (`_norm`).
            let folds_pre = add_norm.as_ref().is_some_and(|a| a.pre.is_some());
            let name = kernel_name(folds_pre, v);
            let func =
                dev.get_or_load_custom_func(name, "twell_mlp_decode", TWELL_MLP_DECODE_PTX)?;
            let wave = match s.grids.get(name) {
                Some(&g) => g,
                None => {
                    let g = one_wave(dev, &func)?;
                    s.grids.insert(name, g);
                    g
                }
            };
            // Null pointers tell the kernel there is no row, counts or add + norm to write.
            let null: u64 = 0;
            let no_eps = 0f32;
            let mut b = func.builder();
            b.arg(x)
                .arg(wg)
                .arg(w_ud)
                .arg(&mut s.acc)
                .arg(&mut s.l1)
                .arg(&mut s.tile_counts)
                .arg(&mut s.ticket);
            match out {
                Some(o) => b.arg(o),
                None => b.arg(&null),
            };
            match counts.as_mut() {
                Some(c) => b.arg(c),
                None => b.arg(&null),
            };
            b.arg(&dims.d)
                .arg(&dims.f)
                .arg(&dims.tile)
                .arg(&dims.n_tiles);
            match add_norm.as_mut() {
                Some(a) => {
                    b.arg(&a.residual)
                        .arg(&a.alpha)
                        .arg(&mut *a.sum_normed)
                        .arg(&a.eps);
                    match &a.pre {
                        Some(p) => b.arg(&p.alpha).arg(&p.eps),
                        None => b.arg(&null).arg(&no_eps),
                    };
                }
                None => {
                    b.arg(&null)
                        .arg(&null)
                        .arg(&null)
                        .arg(&no_eps)
                        .arg(&null)
                        .arg(&no_eps);
                }
            }
            let warps_per_block = (BLOCK_THREADS / 32) as usize;
            let cfg = fused_ops::cuda::grid_1d(
                f.div_ceil(warps_per_block).min(wave as usize),
                BLOCK_THREADS,
            );
            // SAFETY: a warp per neuron (grid-stride), every index bounded by d, f and n_tiles;
            // the scratch is at least as large as they need; a block's neuron list is bounded
            // by DECODE_LIST in the kernel.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        },
    )?;
    Ok(counts)
}
