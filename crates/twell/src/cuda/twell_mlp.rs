//! The TwELL MLP's forward on the device: the gate GEMM (`gate_gemm`), the pack
//! (`gate_pack.cu`), then the up and down kernels of `gated_t2d.cu`, as a warp (or a few)
//! per row for prefill or spread over slots and tiles for a few rows; one row of
//! inference takes the one-launch `twell_mlp_decode` kernel instead. With the residual
//! add and norm after it folded into its last launch for inference. Under
//! `TWELL_MASK_ROWS=on` a prefill skips the pack: the up and down row kernels read each
//! row's neurons from a bit mask of the gate (cuBLASLt's, or a sign kernel's).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaView, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

use super::launch::{overlap_launches, Args};
use super::twell_mlp_decode::{twell_mlp_decode, use_fused_decode, AddNorm, PreNorm};
use super::{
    bf16_view, decode_max_tokens, gate_gemm, grid_1d, multiprocessors, output_buffer, per_key,
    row_vectors, warp_launch, KernelDims, PerContext, ADD_RMS_NORM_MAX_HIDDEN, BLOCK_THREADS,
    DECODE_MAX_TOKENS, DEFAULT_SHARED_BYTES, GATE_PACK_PTX, GATE_PACK_SM90_PTX, WARP_CHUNK,
};
use crate::error::{err, TwellError};
use crate::format::TwellConfig;
use crate::knobs;
use crate::ops::mlp_result_len;

const GATED_T2D_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_t2d.ptx"));
/// The same kernels built for compute_90, with their waits for the kernel ahead compiled
/// in (`launch`).
const GATED_T2D_SM90_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_t2d_sm90.ptx"));

/// (row, tile) units per warp of `twell_gate_pack_vec_bf16` (`PACK_UNITS` in the .cu).
const PACK_UNITS: usize = 4;
/// (row, 32-word) units per warp of `twell_gate_pack_mask_bf16` (`MASK_UNITS` there).
const MASK_UNITS: usize = 8;
/// (row, 256-column) units per warp of `twell_gate_sign_mask_bf16` (`SIGN_UNITS` there).
const SIGN_UNITS: usize = 4;
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
    static VALUES: PerContext = PerContext::new();
    VALUES.once((per_key::context_key(dev), v), || {
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

/// Stages of the forward pass, for `TWELL_PROFILE=1`.
pub const STAGES: [&str; 4] = ["gate GEMM", "pack", "up", "down"];

static PROFILE: std::sync::Mutex<([f64; 4], usize)> = std::sync::Mutex::new(([0.0; 4], 0));

fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TWELL_PROFILE").is_some())
}

/// Adds the times between the five events of one forward (`TWELL_PROFILE=1`; none
/// otherwise) to the stages' sums.
fn record_profile(
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    marks: &[candle_core::cuda_backend::cudarc::driver::CudaEvent],
) -> Result<()> {
    if !profiling() {
        return Ok(());
    }
    stream.synchronize().w()?;
    let mut p = PROFILE.lock().expect("profile lock");
    for k in 0..4 {
        p.0[k] += marks[k].elapsed_ms(&marks[k + 1]).w()? as f64;
    }
    p.1 += 1;
    Ok(())
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
    let mut sum_normed = unsafe { output_buffer(&dev, 2 * d)? };
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
        // SAFETY: the kernel's last block writes every element.
        let mut out = unsafe { output_buffer(&dev, len)? };
        let counts = twell_mlp_decode(&dev, &xv, &wgv, &wudv, Some(&mut out), true, &dims, None)?
            .expect("counts asked for");
        let storage = CudaStorage::wrap_cuda_slice(out, dev);
        let activity = Activity {
            counts,
            backward: None,
        };
        return Ok((storage, Shape::from(len), activity));
    }

    let len = match fold {
        Some(_) => 2 * m * d,
        None => mlp_result_len(m, d),
    };
    // SAFETY: the last kernel writes every element. Made before the gate GEMM, so that
    // under `TWELL_POISON` the fill runs first and the GEMM, pack, up and down follow one
    // another as they do unpoisoned (their overlapped launches are what is checked).
    let mut out = unsafe { output_buffer(&dev, len)? };
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
        mut mask,
    } = gate_gemm::gate_gemm(&dev, &xv, &wgv, (m, d, f), mask_packs)?;
    mark(&mut marks)?;
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
    let split = match row_kernels {
        Some(v) => row_split(&dev, m, d, v)?,
        None => 1,
    };
    // Overlapped launches (`launch`) for the pack, and the row kernels of an inference
    // pass: with a copy between the pack and up (training), up waits as before.
    let overlap = overlap_launches(&dev)? && !profiling();
    // SAFETY: gate_pack (or the mask up kernel) writes every count, and every slot the
    // consumers read.
    let mut counts = unsafe { dev.alloc::<u32>(m * n_tiles)? };
    // The row kernels walk a bit mask of the gate instead of slots where asked: cuBLASLt's,
    // or one made from the plain gate by a sign kernel (16-byte rows, units in 32 bits).
    let walk_mask = match row_kernels {
        Some(v) if split == 1 && !keep_for_backward && mask_rows_wanted()? => {
            if mask.is_none() && f % 8 == 0 && m * f.div_ceil(256) <= u32::MAX as usize {
                mask = Some(sign_mask(&dev, &gate, (m, f), overlap)?);
            }
            mask.as_ref().map(|_| v)
        }
        _ => None,
    };
    if let (Some(v), Some((bits, words_per_row))) = (walk_mask, &mask) {
        mark(&mut marks)?; // the sign kernel, or nothing, in place of the pack
        let kernels = MaskRowKernels {
            dev: &dev,
            overlap,
            v,
            fold: fold.as_ref(),
        };
        // SAFETY: up writes every row's L1 term.
        let mut l1 = unsafe { dev.alloc::<f32>(m)? };
        let operands = MaskRowOperands {
            x: &xv,
            w_ud: &wudv,
            mask: bits,
            words_per_row: *words_per_row as i32,
        };
        kernels.up(&operands, &mut counts, &mut gate, &mut l1, &dims)?;
        mark(&mut marks)?;
        kernels.down(&operands, &gate, &l1, &mut out, &dims)?;
        mark(&mut marks)?;
        record_profile(&stream, &marks)?;
        let storage = CudaStorage::wrap_cuda_slice(out, dev);
        let activity = Activity {
            counts,
            backward: None,
        };
        return Ok((storage, Shape::from(len), activity));
    }
    // SAFETY: the pack writes every slot the consumers read.
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
    let pack = gate_pack_kernel(&dev, pack, overlap)?;
    let mut b = Args::new(&stream);
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
    unsafe { b.launch(&pack, warp_launch(pack_warps)?, overlap) }?;
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

    let slots_per_warp: usize = if decode { 1 } else { cap };
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
    let overlap_rows = overlap && kept.is_none() && row_kernels.is_some();
    let up = gated_t2d_kernel(&dev, &up_name, overlap_rows)?;
    let spw_i = slots_per_warp as i32;
    let mut b = Args::new(&stream);
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
    unsafe { b.launch(&up, warp_launch(up_warps)?, overlap_rows) }?;
    mark(&mut marks)?;
    match row_kernels {
        Some(v) => {
            let kind = if fold.is_some() { "_norm" } else { "" };
            let down_name = format!("gated_t2d_down_rows{kind}_bf16_v{v}_s{split}");
            let down = gated_t2d_kernel(&dev, &down_name, overlap_rows)?;
            let mut b = Args::new(&stream);
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
            unsafe { b.launch(&down, cfg, overlap_rows) }?;
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
    record_profile(&stream, &marks)?;
    let storage = CudaStorage::wrap_cuda_slice(out, dev);
    let backward = kept.map(|(g_slots, u_slots)| BackwardState {
        indices,
        g_slots,
        u_slots,
    });
    Ok((storage, Shape::from(len), Activity { counts, backward }))
}

/// `TWELL_MASK_ROWS=on`: where the prefill row kernels take a warp a row, the up and down
/// kernels read each row's active neurons from a bit mask of the gate (`walk_mask_row` in
/// `twell_common.cuh`) instead of TwELL slots, and h is left in the gate. The mask is the
/// one cuBLASLt's ReLU epilogue wrote (from 4,096 rows: the pack launch goes), or one a
/// sign kernel makes from the plain gate (`twell_gate_sign_mask_bf16`: no ranking and no
/// slots, a fraction of the pack while the gate is still in L2). Inference only
/// (training's backward reads the slots). Off by default until measured (`off` names the
/// default in an A/B run).
fn mask_rows_wanted() -> Result<bool> {
    static KNOB: knobs::Cell = knobs::Cell::new();
    let set = knobs::read_once(&KNOB, || {
        knobs::env_choice("TWELL_MASK_ROWS", &["off", "on"])
    })?;
    Ok(set == Some(1))
}

/// The up and down kernels that walk the gate's bit mask, as `mlp_forward` picked them:
/// `v` 16-byte vectors a lane for a row, the folds of an add-norm sublayer, overlapped
/// launches or not.
struct MaskRowKernels<'a> {
    dev: &'a CudaDevice,
    overlap: bool,
    v: usize,
    fold: Option<&'a RowFold<'a>>,
}

/// What both mask kernels read: x and the weights, the mask `[m, words_per_row]`.
struct MaskRowOperands<'a> {
    x: &'a CudaView<'a, bf16>,
    w_ud: &'a CudaView<'a, bf16>,
    mask: &'a CudaSlice<u32>,
    words_per_row: i32,
}

impl MaskRowKernels<'_> {
    /// h of each row's active neurons over their gate values, the tile counts, the L1
    /// terms.
    fn up(
        &self,
        ops: &MaskRowOperands,
        counts: &mut CudaSlice<u32>,
        gate: &mut CudaSlice<bf16>,
        l1: &mut CudaSlice<f32>,
        dims: &KernelDims,
    ) -> Result<()> {
        let pre_norm_eps = self.fold.and_then(|f| f.pre_norm_eps);
        let kind = if pre_norm_eps.is_some() { "_norm" } else { "" };
        let name = format!("gated_t2d_up_mask_rows{kind}_bf16_v{}", self.v);
        let up = gated_t2d_kernel(self.dev, &name, self.overlap)?;
        let stream = self.dev.cuda_stream();
        let mut b = Args::new(&stream);
        b.arg(ops.x)
            .arg(ops.w_ud)
            .arg(ops.mask)
            .arg(counts)
            .arg(gate)
            .arg(l1);
        dims.push_without_cap(&mut b);
        b.arg(&ops.words_per_row);
        if let Some(eps) = &pre_norm_eps {
            b.arg(eps);
        }
        // SAFETY: a warp a row, bounds checked in the kernel.
        unsafe { b.launch(&up, warp_launch(dims.m as usize)?, self.overlap) }
    }

    /// The down projection of the h that `up` left in the gate; with a fold, the residual
    /// add and norm after it.
    fn down(
        &self,
        ops: &MaskRowOperands,
        gate: &CudaSlice<bf16>,
        l1: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
        dims: &KernelDims,
    ) -> Result<()> {
        let kind = if self.fold.is_some() { "_norm" } else { "" };
        let name = format!("gated_t2d_down_mask_rows{kind}_bf16_v{}", self.v);
        let down = gated_t2d_kernel(self.dev, &name, self.overlap)?;
        let stream = self.dev.cuda_stream();
        let mut b = Args::new(&stream);
        b.arg(ops.w_ud).arg(ops.mask).arg(gate).arg(l1).arg(out);
        dims.push_without_cap(&mut b);
        b.arg(&ops.words_per_row);
        if let Some(fold) = self.fold {
            b.arg(&fold.residual).arg(&fold.alpha).arg(&fold.eps);
        }
        // SAFETY: a warp a row, bounds checked in the kernel.
        unsafe { b.launch(&down, warp_launch(dims.m as usize)?, self.overlap) }
    }
}

/// The bit mask of the plain gate's positives, `[m, words_per_row]` in cuBLASLt's layout
/// (`twell_gate_sign_mask_bf16`), for the row kernels that walk a mask.
fn sign_mask(
    dev: &CudaDevice,
    gate: &CudaSlice<bf16>,
    (m, f): (usize, usize),
    overlap: bool,
) -> Result<(CudaSlice<u32>, usize)> {
    let words_per_row = gate_gemm::mask_words_per_row(f);
    // SAFETY: the kernel writes every word of every row.
    let mut mask = unsafe { dev.alloc::<u32>(m * words_per_row)? };
    let func = gate_pack_kernel(dev, "twell_gate_sign_mask_bf16", overlap)?;
    let stream = dev.cuda_stream();
    let (m_i, f_i, words_i) = (m as i32, f as i32, words_per_row as i32);
    let mut b = Args::new(&stream);
    b.arg(gate).arg(&mut mask).arg(&m_i).arg(&f_i).arg(&words_i);
    let units = m * f.div_ceil(256);
    // SAFETY: SIGN_UNITS (row, 256-column) units a warp, bounds checked in the kernel.
    unsafe { b.launch(&func, warp_launch(units.div_ceil(SIGN_UNITS))?, overlap) }?;
    Ok((mask, words_per_row))
}

/// A kernel of `gate_pack.cu`; with `overlap`, from its compute_90 build, where the waits
/// of an overlapped launch (`launch`) are compiled in.
fn gate_pack_kernel(dev: &CudaDevice, name: &str, overlap: bool) -> Result<CudaFunction> {
    let func = if overlap {
        dev.get_or_load_custom_func(name, "twell_gate_pack_sm90", GATE_PACK_SM90_PTX)?
    } else {
        dev.get_or_load_custom_func(name, "twell_gate_pack", GATE_PACK_PTX)?
    };
    Ok(func.into_cuda_function())
}

/// A kernel of `gated_t2d.cu`, as [`gate_pack_kernel`] picks its build.
fn gated_t2d_kernel(dev: &CudaDevice, name: &str, overlap: bool) -> Result<CudaFunction> {
    let func = if overlap {
        dev.get_or_load_custom_func(name, "gated_t2d_sm90", GATED_T2D_SM90_PTX)?
    } else {
        dev.get_or_load_custom_func(name, "gated_t2d", GATED_T2D_PTX)?
    };
    Ok(func.into_cuda_function())
}
