//! The TwELL MLP's forward on the device: the gate GEMM (`gate_gemm`), the pack
//! (`gate_pack.cu`), then the up and down kernels of `gated_t2d.cu`, as a warp (or a few)
//! per row for prefill or spread over slots and tiles for a few rows; one row of
//! inference takes the one-launch `twell_mlp_decode` kernel instead. With the residual
//! add and norm after it folded into its last launch for inference. An inference prefill
//! whose rows take a warp each skips the pack: the up and down row kernels read each row's
//! neurons from a bit mask of the gate (cuBLASLt's, or a sign kernel's), and `h` stays in
//! the gate buffer (`RowWalk::Mask`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

use fused_ops::cuda::{
    bf16_view, context_key, grid_1d, multiprocessors, output_buffer, warp_launch, PerContext,
    ADD_RMS_NORM_MAX_HIDDEN, BLOCK_THREADS,
};

use super::cuda_decode::{
    twell_mlp_decode, use_few_rows_decode, use_fused_decode, AddNorm, PreNorm, FEW_ROWS_MAX,
};
use crate::cuda::{
    gate_gemm, row_vectors, KernelDims, DECODE_MAX_TOKENS, DEFAULT_SHARED_BYTES, WARP_CHUNK,
};
use crate::error::{err, TwellError};
use crate::format::{RowWalk, StagedRows, TwellConfig};
use crate::output::mlp_result_len;

const GATED_T2D_PTX: &str = twell_kernels::GATED_T2D;

/// (row, tile) units per warp of `twell_gate_pack_vec_bf16` (`PACK_UNITS` in the .cu).
const PACK_UNITS: usize = 4;
/// (row, 32-word) units per warp of `twell_gate_pack_mask_bf16` (`MASK_UNITS` there).
const MASK_UNITS: usize = 8;
/// (row, 256-column) units per warp of `twell_gate_sign_mask_bf16` (`SIGN_UNITS` there).
const SIGN_UNITS: usize = 4;
/// Whether `m` token rows of hidden `d` (and `f` neurons) take [`twell_mlp_add_norm`], the residual add
/// and norm after the MLP folded into its last launch: one row or a few into the
/// one-launch decode kernels, other rows into the down row kernel's epilogue.
pub fn add_norm_folds(m: usize, d: usize, f: usize, config: TwellConfig) -> bool {
    if !d.is_multiple_of(8) || d > ADD_RMS_NORM_MAX_HIDDEN {
        false
    } else if m == 1 {
        use_fused_decode(1, d, false)
    } else {
        use_few_rows_decode(m, d, f, false, config.paths().few_rows)
            || folds_into_down_rows(m, d, f, config)
    }
}

/// Whether `m` rows of hidden `d` (and `f` neurons) take [`twell_mlp_norm_add_norm`], both
/// norms folded in: the rows of the row kernels, whose up kernel normalises its row in
/// registers (the one-launch decode kernels fold the norm before the MLP for one row only,
/// at run time, and the few-row kernel not at all).
pub fn norm_add_norm_folds(m: usize, d: usize, f: usize, config: TwellConfig) -> bool {
    d.is_multiple_of(8)
        && d <= ADD_RMS_NORM_MAX_HIDDEN
        && !use_few_rows_decode(m, d, f, false, config.paths().few_rows)
        && folds_into_down_rows(m, d, f, config)
}

/// Whether an inference forward of `m` rows of hidden `d`, past the one-launch decode
/// kernels, runs the row kernels or the spread kernels (whose down kernels can fold the
/// add and norm after them, and whose up kernels the norm before).
fn folds_into_down_rows(m: usize, d: usize, f: usize, config: TwellConfig) -> bool {
    m > 1
        && (row_kernels_for(m, d, f, config, false).is_some()
            || spread_kernels_for(m, d, f, config, false).is_some())
}

/// The row kernels' vectors a lane (`row_vectors`) where they take a staged forward of
/// `m` rows of hidden `d` through `f` neurons: always past [`DECODE_MAX_TOKENS`] rows; at
/// or below it at inference where `config` asks for them or its `Auto` finds them faster
/// ([`crate::staged_rows_for`] at [`crate::STAGED_ROWS_ASSUMED_DENSITY`]). Why rows at
/// decode sizes at all: in a replayed decode step only the device's time counts, and
/// there the slot kernels' warps per slot and per tile (most with nothing to do, their
/// sums meeting in atomics) cost more than the gate GEMM at wide shapes and many rows.
fn row_kernels_for(
    m: usize,
    d: usize,
    f: usize,
    config: TwellConfig,
    keep_for_backward: bool,
) -> Option<usize> {
    let slots = keep_for_backward || staged_form(m, d, f, config) != StagedRows::RowKernels;
    if m <= DECODE_MAX_TOKENS && slots {
        return None;
    }
    row_vectors(d)
}

/// The staged kernels' form a forward of `m` rows at decode sizes asks for: `config`'s,
/// with `Auto` settled at [`crate::STAGED_ROWS_ASSUMED_DENSITY`] (a [`crate::SparseMlp`]
/// settles it with the density it measured before it gets here).
fn staged_form(m: usize, d: usize, f: usize, config: TwellConfig) -> StagedRows {
    match config.paths().staged_rows {
        StagedRows::Auto => {
            let density = crate::STAGED_ROWS_ASSUMED_DENSITY;
            crate::staged_rows_for(m, d, f, config.tile(), density)
        }
        form => form,
    }
}

/// The row vectors a lane (`row_vectors`) of the spread kernels where they take an
/// inference forward of `m` rows (2 to [`DECODE_MAX_TOKENS`]) of hidden `d` through `f`
/// neurons: where `config` asks for them, the row fits the up kernel's registers (hidden
/// up to 4096), and `f` is a multiple of 8 (16-byte rows of `h`).
fn spread_kernels_for(
    m: usize,
    d: usize,
    f: usize,
    config: TwellConfig,
    keep_for_backward: bool,
) -> Option<usize> {
    let asked = (2..=DECODE_MAX_TOKENS).contains(&m)
        && !keep_for_backward
        && f.is_multiple_of(8)
        && staged_form(m, d, f, config) == StagedRows::SpreadKernels;
    asked.then(|| row_vectors(d)).flatten()
}

/// The most warps the spread up kernel launches: it takes chunks of 32, 64, 128 or 256
/// neurons a warp, the smallest whose warps stay within this. Fewer neurons a warp means
/// fewer positives it waits on one after another; more warps, more that find none.
const SPREAD_UP_MAX_WARPS: usize = 4096;

/// Neurons a lane of the spread up kernel takes (its `NPL`) for `m` rows of `f` neurons.
fn spread_neurons_per_lane(m: usize, f: usize) -> usize {
    [1, 2, 4, 8]
        .into_iter()
        .find(|npl| m * f.div_ceil(32 * npl) <= SPREAD_UP_MAX_WARPS)
        .unwrap_or(8)
}

/// How many consecutive warps share a token row in the prefill row kernels: the most of
/// 4 and 2 whose parts still fit one wave of the kernels (up to 528 and 1,056 tokens on
/// the H200), else one. With a warp per row and fewer rows than the card holds warps,
/// the loads in flight are few and the kernel lasts as long as its longest row. Measured
/// on the H200: four warps a row took 128-512 tokens to
/// 0.06-0.14 ms from 0.10-0.25 with one, and two warps a row beat four at 768 and 1,024
/// tokens (0.09-0.24 ms against 0.10-0.25) and tied with one at 2,048. `v`: the row
/// kernels' vectors a lane for hidden `d` (`row_vectors`).
fn row_split(dev: &CudaDevice, m: usize, d: usize, v: usize) -> Result<usize> {
    let wave = multiprocessors(dev)? * row_kernel_warps_per_sm(dev, v)?;
    if m <= DECODE_MAX_TOKENS {
        // Decode sizes: the most warps a row, its parts' sums in shared memory past the
        // default where the device lets a block opt in to more.
        let most = max_shared_bytes(dev)?;
        return Ok(DECODE_ROW_SPLITS
            .into_iter()
            .find(|&split| m * split <= wave && down_split_bytes(split, d) <= most)
            .unwrap_or(1));
    }
    let split = ROW_SPLITS
        .into_iter()
        .find(|&split| m * split <= wave)
        .unwrap_or(1);
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
    VALUES.once((context_key(dev), v), || {
        let name = format!("gated_t2d_up_rows_bf16_v{v}_s1");
        let up = dev.get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
        let blocks = up
            .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, 0, None)
            .w()? as usize;
        Ok((blocks * (BLOCK_THREADS / 32) as usize).max(1))
    })
}

/// The splits the prefill row kernels take besides one warp a row, most first
/// (their `SPLIT`: `_s4`, `_s2`; each divides a block's 8 warps).
const ROW_SPLITS: [usize; 2] = [4, 2];

/// The same for 2 to [`DECODE_MAX_TOKENS`] rows, where a row's pairs are few and its
/// parts' round trips to L2 are what a step waits on (`_s8`: a block a row).
const DECODE_ROW_SPLITS: [usize; 3] = [8, 4, 2];

/// The most dynamic shared memory a block may opt in to on `dev`.
fn max_shared_bytes(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    Ok(fused_ops::cuda::device_attribute(
        dev,
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?
    .max(DEFAULT_SHARED_BYTES))
}

/// The dynamic shared memory the down row kernel needs for a row split `split` ways:
/// the f32 sums of parts 1.. of each of a block's rows.
fn down_split_bytes(split: usize, d: usize) -> usize {
    let rows_per_block = (BLOCK_THREADS / 32) as usize / split;
    rows_per_block * (split - 1) * d * std::mem::size_of::<f32>()
}

/// Stages of the forward pass, as [`set_stage_profiling`] times them (with the mask walk,
/// "pack" is the sign kernel where one runs, else nothing).
pub const STAGES: [&str; 4] = ["gate GEMM", "pack", "up", "down"];

static PROFILE: std::sync::Mutex<([f64; 4], usize)> = std::sync::Mutex::new(([0.0; 4], 0));
static PROFILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Times each stage of every prefill forward with events, synchronising after each call,
/// until turned off: for `twell bench mlp --stages`. Process-wide.
pub fn set_stage_profiling(on: bool) {
    PROFILING.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn profiling() -> bool {
    PROFILING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Adds the times between the five events of one forward (while profiling; none
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

/// Mean milliseconds per call of each stage since the last call (while profiling only).
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
/// row (or 2 to 16 rows, without `pre`) runs as the one-launch decode kernel (see
/// `use_fused_decode`, `use_few_rows_decode`); there, with `pre`
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
    let few_rows = use_few_rows_decode(m, d, f, false, config.paths().few_rows);
    if m > 1 && pre.is_none() && d % 8 == 0 && !few_rows && folds_into_down_rows(m, d, f, config) {
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
    let decodes = use_fused_decode(m, d, false) || (pre.is_none() && few_rows);
    if !decodes || d % 8 != 0 {
        return err(TwellError::Invalid(format!(
            "twell_mlp_add_norm takes one token row whose hidden size the one-launch \
             decode kernel takes (the norm before the MLP folded in too, or not), 2 to \
             {FEW_ROWS_MAX} rows the few-row kernel takes ({:?}) or \
             rows the row kernels take (hidden up to 4096, {:?}; without it); got \
             [{m}, {d}] and d_ff {f}",
            config.paths().few_rows,
            config.paths().staged_rows
        )));
    }
    let dev = x.device().clone();
    let dims = KernelDims::new(m, d, f, config);
    // SAFETY: the kernel's last block writes every element.
    let mut sum_normed = unsafe { output_buffer(&dev, 2 * m * d)? };
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
        config.paths().few_rows,
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
/// written or read. The row kernels only ([`norm_add_norm_folds`]).
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
    let f = wl.shape().dims2()?.0;
    if !norm_add_norm_folds(m, d, f, config) {
        return err(TwellError::Invalid(format!(
            "twell_mlp_norm_add_norm takes the rows the row kernels take (hidden up to \
             4096, a multiple of 8; {:?}) and the few-row kernel does not ({:?}), got [{m}, \
             {d}] and d_ff {f}",
            config.paths().staged_rows,
            config.paths().few_rows
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

/// [`twell_mlp_forward`]; with `fold` (the row kernels only) the result is `[2 · m ·
/// d]`, the sums and their norms as [`twell_mlp_add_norm`] returns them.
///
/// One row of inference, or 2 to 16 rows of hidden up to 2048, runs a one-launch decode
/// kernel. Otherwise: the gate GEMM, then
/// either the mask walk (inference, a warp a row: [`forward_mask_rows`]) or the pack into
/// TwELL slots and the up and down kernels over them ([`forward_slots`]).
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
    let ops = Operands {
        x: bf16_view("x", x, xl)?,
        wg: bf16_view("gate_proj", wg, wl)?,
        w_ud: bf16_view("w_ud", w_ud, ul)?,
        dims: KernelDims::new(m, d, f, config),
        config,
    };
    if fold.is_none()
        && (use_fused_decode(m, d, keep_for_backward)
            || use_few_rows_decode(m, d, f, keep_for_backward, config.paths().few_rows))
    {
        return forward_decode_rows(&dev, &ops);
    }
    let len = match fold {
        Some(_) => 2 * m * d,
        None => mlp_result_len(m, d),
    };
    // SAFETY: the last kernel writes every element. Made before the gate GEMM, so that
    // with poisoned outputs the fill runs first and the GEMM, pack, up and down follow one
    // another as they do unpoisoned.
    let out = unsafe { output_buffer(&dev, len)? };
    let mut stages = StageMarks::start(&dev)?;
    // The mask kernels number their units in 32 bits: past that the plain GEMM and pack
    // take the gate.
    let mask_fits = m * f.div_ceil(32).div_ceil(32) <= u32::MAX as usize;
    let gate = gate_gemm::gate_gemm(
        &dev,
        &ops.x,
        &ops.wg,
        (m, d, f),
        mask_fits,
        config.paths().gate,
    )?;
    stages.mark()?;
    if let Some(v) = spread_kernels_for(m, d, f, config, keep_for_backward) {
        let forward = Forward {
            dev: &dev,
            ops: &ops,
            fold: fold.as_ref(),
            out,
        };
        let (out, activity) = forward_spread(forward, gate, v, &mut stages)?;
        stages.finish()?;
        return Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(len),
            activity,
        ));
    }
    // Rows that fit a warp's registers take the row kernels (`row_kernels_for`): a warp
    // (or a few) per row computes h (x in registers), then accumulates the down
    // projection (the output row in registers). Rows too wide for registers, and the
    // slot kernels where asked for, spread h over a warp per slot (few rows) or per tile,
    // then the down projection, whose partial sums meet in f32 atomics when rows are few.
    let row_kernels = row_kernels_for(m, d, f, config, keep_for_backward);
    if fold.is_some() && row_kernels.is_none() {
        return err(TwellError::Invalid(format!(
            "the residual add and norm fold into the row kernels only: hidden up to 4096, \
             and at most {DECODE_MAX_TOKENS} rows only with StagedRows::RowKernels or Auto; \
             got [{m}, {d}] ({:?})",
            config.paths().staged_rows
        )));
    }
    let split = match row_kernels {
        Some(v) => row_split(&dev, m, d, v)?,
        None => 1,
    };
    // At inference, where a warp takes a row, the row kernels walk a bit mask of the gate
    // instead of slots (`RowWalk`): cuBLASLt's, or one a sign kernel makes from the plain
    // gate (16-byte rows, units in 32 bits).
    let mut gate = gate;
    let walk = match row_kernels {
        Some(v) if split == 1 && !keep_for_backward && config.paths().walk == RowWalk::Mask => {
            if gate.mask.is_none() && f % 8 == 0 && m * f.div_ceil(256) <= u32::MAX as usize {
                gate.mask = Some(sign_mask(&dev, &gate.values, (m, f))?);
            }
            gate.mask.as_ref().map(|_| v)
        }
        _ => None,
    };
    let forward = Forward {
        dev: &dev,
        ops: &ops,
        fold: fold.as_ref(),
        out,
    };
    let (out, activity) = match walk {
        Some(v) => forward_mask_rows(forward, gate, v, &mut stages)?,
        None => forward_slots(
            forward,
            gate,
            row_kernels,
            split,
            keep_for_backward,
            &mut stages,
        )?,
    };
    stages.finish()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(len),
        activity,
    ))
}

/// The inputs of one forward, as the kernels take them.
struct Operands<'a> {
    x: CudaView<'a, bf16>,
    wg: CudaView<'a, bf16>,
    w_ud: CudaView<'a, bf16>,
    dims: KernelDims,
    config: TwellConfig,
}

/// One forward past its gate GEMM: where it runs, what it reads, the result it fills.
struct Forward<'a> {
    dev: &'a CudaDevice,
    ops: &'a Operands<'a>,
    fold: Option<&'a RowFold<'a>>,
    out: CudaSlice<bf16>,
}

/// One row or a few rows of inference: the one-launch decode kernels.
fn forward_decode_rows(dev: &CudaDevice, ops: &Operands) -> Result<(CudaStorage, Shape, Activity)> {
    let len = mlp_result_len(ops.dims.m as usize, ops.dims.d as usize);
    // SAFETY: the kernel's last block writes every element.
    let mut out = unsafe { output_buffer(dev, len)? };
    let counts = twell_mlp_decode(
        dev,
        &ops.x,
        &ops.wg,
        &ops.w_ud,
        Some(&mut out),
        true,
        &ops.dims,
        ops.config.paths().few_rows,
        None,
    )?
    .expect("counts asked for");
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    let activity = Activity {
        counts,
        backward: None,
    };
    Ok((storage, Shape::from(len), activity))
}

/// The up and down row kernels (`v` vectors a lane) over the bit mask of the gate's
/// positives that `gate` carries; h is left in the gate.
fn forward_mask_rows(
    forward: Forward,
    gate: gate_gemm::Gate,
    v: usize,
    stages: &mut StageMarks,
) -> Result<(CudaSlice<bf16>, Activity)> {
    let Forward {
        dev,
        ops,
        fold,
        mut out,
    } = forward;
    let (m, f) = (ops.dims.m as usize, ops.dims.f as usize);
    let gate_gemm::Gate {
        values: mut gate_values,
        mask,
    } = gate;
    let Some((bits, words_per_row)) = &mask else {
        return err(TwellError::Invalid(
            "the mask walk needs the gate's bit mask".to_string(),
        ));
    };
    stages.mark()?; // the sign kernel, or nothing, in place of the pack
    let kernels = MaskRowKernels { dev, v, fold };
    // SAFETY: up writes every count and every row's L1 term.
    let mut counts = unsafe { dev.alloc::<u32>(m * ops.config.n_tiles(f))? };
    let mut l1 = unsafe { dev.alloc::<f32>(m)? };
    let operands = MaskRowOperands {
        x: &ops.x,
        w_ud: &ops.w_ud,
        mask: bits,
        words_per_row: *words_per_row as i32,
    };
    kernels.up(&operands, &mut counts, &mut gate_values, &mut l1, &ops.dims)?;
    stages.mark()?;
    kernels.down(&operands, &gate_values, &l1, &mut out, &ops.dims)?;
    stages.mark()?;
    let activity = Activity {
        counts,
        backward: None,
    };
    Ok((out, activity))
}

/// The spread kernels (2 to 64 rows at inference, `v` vectors a lane): up, a warp per
/// chunk of a row's neurons, writes `h [m, f]` (zeros where the gate is not positive);
/// down, a block per 256-column slice of a row, adds the active neurons' `Wd` slices and
/// writes the rows, and from the first slice each row's L1 term and tile counts. With
/// `fold`, the norm before the MLP runs in up (where `fold` says) and the residual add
/// and norm after it in the last slice of each row to finish. `v` (from
/// [`spread_kernels_for`]) bounds the hidden size at 4096, the widest row the folded
/// norm's `SPREAD_NORM_VECS` vectors a thread cover.
fn forward_spread(
    forward: Forward,
    gate: gate_gemm::Gate,
    v: usize,
    stages: &mut StageMarks,
) -> Result<(CudaSlice<bf16>, Activity)> {
    let Forward {
        dev,
        ops,
        fold,
        mut out,
    } = forward;
    let dims = &ops.dims;
    let (m, d, f) = (dims.m as usize, dims.d as usize, dims.f as usize);
    stages.mark()?; // no pack
    let npl = spread_neurons_per_lane(m, f);
    let pre_norm_eps = fold.and_then(|fold| fold.pre_norm_eps);
    let kind = if pre_norm_eps.is_some() { "_norm" } else { "" };
    let up = dev.get_or_load_custom_func(
        &format!("gated_t2d_up_spread{kind}_bf16_v{v}_n{npl}"),
        "gated_t2d",
        GATED_T2D_PTX,
    )?;
    // SAFETY: up writes every element of h.
    let mut h = unsafe { dev.alloc::<bf16>(m * f)? };
    let mut b = up.builder();
    b.arg(&ops.x)
        .arg(&ops.w_ud)
        .arg(&gate.values)
        .arg(&mut h)
        .arg(&dims.d)
        .arg(&dims.f);
    if let Some(eps) = &pre_norm_eps {
        b.arg(eps);
    }
    let warps_a_row = f.div_ceil(32 * npl);
    let up_grid = LaunchConfig {
        grid_dim: (warps_a_row.div_ceil(SPREAD_WARPS) as u32, m as u32, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: SPREAD_WARPS warps a block, one per chunk (those past f return), a block
    // row per token row.
    unsafe { b.launch(up_grid) }.w()?;
    stages.mark()?;
    // SAFETY: the first slice's blocks write every count.
    let mut counts = unsafe { dev.alloc::<u32>(m * ops.config.n_tiles(f))? };
    let name = match fold {
        Some(_) => "gated_t2d_down_spread_norm_bf16",
        None => "gated_t2d_down_spread_bf16",
    };
    let down = dev.get_or_load_custom_func(name, "gated_t2d", GATED_T2D_PTX)?;
    let down_grid = LaunchConfig {
        grid_dim: (d.div_ceil(WARP_CHUNK) as u32, m as u32, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // The folded form's staging rows and this stream's zeroed tickets, a row each.
    let mut launch = |fold_buffers: Option<(&mut CudaSlice<bf16>, &mut CudaSlice<u32>)>| {
        let mut b = down.builder();
        b.arg(&ops.w_ud)
            .arg(&h)
            .arg(&mut counts)
            .arg(&mut out)
            .arg(&dims.m)
            .arg(&dims.d)
            .arg(&dims.f)
            .arg(&dims.tile)
            .arg(&dims.n_tiles);
        if let (Some(fold), Some((staging, tickets))) = (fold, fold_buffers) {
            b.arg(&fold.residual)
                .arg(&fold.alpha)
                .arg(&fold.eps)
                .arg(staging)
                .arg(tickets);
        }
        // SAFETY: a block per (256-column slice, row), bounds checked in the kernel; the
        // last slice of a row to finish zeroes its ticket again.
        unsafe { b.launch(down_grid) }.w().map(|_| ())
    };
    match fold {
        Some(_) => {
            // SAFETY: every slice writes its part of each row before the last reads it.
            let mut staging = unsafe { dev.alloc::<bf16>(m * d)? };
            with_fold_tickets(dev, m, |tickets| launch(Some((&mut staging, tickets))))?;
        }
        None => launch(None)?,
    }
    stages.mark()?;
    Ok((
        out,
        Activity {
            counts,
            backward: None,
        },
    ))
}

/// Warps a block of the spread kernels (`SPREAD_WARPS` in the .cu).
const SPREAD_WARPS: usize = 8;

/// The zeroed tickets of one stream's folded spread down launches, a row each (the
/// kernel leaves them zero), so that a decode step allocates and zeroes nothing.
static FOLD_TICKETS: fused_ops::cuda::PerStream<CudaSlice<u32>> = fused_ops::cuda::PerStream::new();

/// Runs `launch` with this stream's zeroed tickets, at least `rows` of them.
fn with_fold_tickets(
    dev: &CudaDevice,
    rows: usize,
    launch: impl FnOnce(&mut CudaSlice<u32>) -> Result<()>,
) -> Result<()> {
    FOLD_TICKETS.with(
        fused_ops::cuda::stream_key(dev),
        |t| t.len() >= rows,
        || dev.alloc_zeros::<u32>(DECODE_MAX_TOKENS.max(rows)),
        launch,
    )
}

/// The pack into TwELL slots, then the up and down kernels over them: the row kernels
/// (`row_kernels`: their vectors a lane, `split` warps a row), or for few rows or wide
/// ones the slot and chunk kernels. With `keep_for_backward`, the slots' g and u are kept.
fn forward_slots(
    forward: Forward,
    gate: gate_gemm::Gate,
    row_kernels: Option<usize>,
    split: usize,
    keep_for_backward: bool,
    stages: &mut StageMarks,
) -> Result<(CudaSlice<bf16>, Activity)> {
    let Forward {
        dev,
        ops,
        fold,
        mut out,
    } = forward;
    let dims = &ops.dims;
    let f = dims.f as usize;
    let (cap, n_tiles) = (ops.config.capacity(), ops.config.n_tiles(f));
    let gate_gemm::Gate {
        values: mut gate,
        mask,
    } = gate;
    let Slots {
        counts,
        indices,
        mut values,
    } = pack(dev, &gate, mask.as_ref(), dims, (cap, n_tiles))?;
    // For a backward pass: the slots' g before `up` writes h over them, and a buffer
    // where `up` leaves each slot's u.
    let mut kept = match keep_for_backward {
        true => {
            let g_slots = dev.cuda_stream().clone_dtod(&values).w()?;
            // SAFETY: `up` writes the u of every listed slot, the only ones read.
            let u_slots = unsafe { dev.alloc::<bf16>(values.len())? };
            Some((g_slots, u_slots))
        }
        false => None,
    };
    stages.mark()?;
    let slot_rows = SlotRows {
        counts: &counts,
        indices: &indices,
    };
    let l1 = up_slots(
        dev,
        ops,
        &slot_rows,
        (&mut values, &mut gate),
        kept.as_mut().map(|(_, u)| u),
        (row_kernels, split),
        fold.and_then(|fold| fold.pre_norm_eps),
    )?;
    stages.mark()?;
    let written = (&values, &gate, &l1);
    match row_kernels {
        Some(v) => down_slot_rows(dev, ops, &slot_rows, written, &mut out, (v, split), fold)?,
        None => down_slot_chunks(dev, ops, &slot_rows, written, &mut out)?,
    }
    stages.mark()?;
    let backward = kept.map(|(g_slots, u_slots)| BackwardState {
        indices,
        g_slots,
        u_slots,
    });
    Ok((out, Activity { counts, backward }))
}

/// The TwELL pattern of a forward: true counts `[m, n_tiles]`, and the slots' tile-local
/// indices and values `[m, n_tiles, cap]`.
struct Slots {
    counts: CudaSlice<u32>,
    indices: CudaSlice<u8>,
    values: CudaSlice<bf16>,
}

/// The pattern the up and down slot kernels read.
struct SlotRows<'a> {
    counts: &'a CudaSlice<u32>,
    indices: &'a CudaSlice<u8>,
}

/// The gate's positives packed into TwELL slots: from cuBLASLt's mask where the gate GEMM
/// wrote one (only the flagged values are read), else from the whole plain gate.
fn pack(
    dev: &CudaDevice,
    gate: &CudaSlice<bf16>,
    mask: Option<&(CudaSlice<u32>, usize)>,
    dims: &KernelDims,
    (cap, n_tiles): (usize, usize),
) -> Result<Slots> {
    let (m, f) = (dims.m as usize, dims.f as usize);
    // SAFETY: the pack writes every count, and every slot the consumers read.
    let mut counts = unsafe { dev.alloc::<u32>(m * n_tiles)? };
    let mut indices = unsafe { dev.alloc::<u8>(m * n_tiles * cap)? };
    let mut values = unsafe { dev.alloc::<bf16>(m * n_tiles * cap)? };
    let (name, warps) = match mask {
        // A lane per mask word: a warp takes MASK_UNITS (row, 32-word) units.
        Some(_) => {
            let units = m * f.div_ceil(32).div_ceil(32);
            ("twell_gate_pack_mask_bf16", units.div_ceil(MASK_UNITS))
        }
        // 16-byte loads need every row and tile start aligned: d_ff % 8 == 0. The vector
        // kernel splits its warp index into (row, tile) in 32 bits; the scalar one in 64,
        // so past 2^32 (row, tile) items it takes over. The vector kernel takes PACK_UNITS
        // (row, tile) units a warp, the scalar one.
        None if f % 8 == 0 && m * n_tiles <= u32::MAX as usize => (
            "twell_gate_pack_vec_bf16",
            (m * n_tiles).div_ceil(PACK_UNITS),
        ),
        None => ("twell_gate_pack_bf16", m * n_tiles),
    };
    let func = dev.get_or_load_custom_func(name, "twell_gate_pack", twell_kernels::GATE_PACK)?;
    let mut b = func.builder();
    b.arg(gate);
    if let Some((bits, _)) = mask {
        b.arg(bits);
    }
    b.arg(&mut counts).arg(&mut indices).arg(&mut values);
    dims.push_pattern(&mut b);
    let words_per_row = mask.map(|(_, words)| *words as i32);
    if let Some(words) = &words_per_row {
        b.arg(words);
    }
    // SAFETY: bounds checked in the kernel.
    unsafe { b.launch(warp_launch(warps)?) }.w()?;
    Ok(Slots {
        counts,
        indices,
        values,
    })
}

/// The up kernel over the slots: `h = relu(g)·u` of every listed pair written over the
/// slot's value (and the dense gate for overflowing tiles), each row's L1 term, and with
/// `u_slots` each slot's u. Returns the L1 terms.
fn up_slots(
    dev: &CudaDevice,
    ops: &Operands,
    slots: &SlotRows,
    (values, gate): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    u_slots: Option<&mut CudaSlice<bf16>>,
    (row_kernels, split): (Option<usize>, usize),
    pre_norm_eps: Option<f32>,
) -> Result<CudaSlice<f32>> {
    let dims = &ops.dims;
    let (m, f) = (dims.m as usize, dims.f as usize);
    let (cap, n_tiles) = (ops.config.capacity(), ops.config.n_tiles(f));
    let slots_per_warp: usize = if m <= DECODE_MAX_TOKENS { 1 } else { cap };
    let (name, warps) = match row_kernels {
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
        None => fused_ops::cuda::zeroed::<f32>(dev, m)?,
    };
    // A null pointer tells `up` not to keep u.
    let no_u: u64 = 0;
    let spw_i = slots_per_warp as i32;
    let up = dev.get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
    let mut b = up.builder();
    b.arg(&ops.x)
        .arg(&ops.w_ud)
        .arg(slots.counts)
        .arg(slots.indices)
        .arg(values)
        .arg(gate)
        .arg(&mut l1);
    match u_slots {
        Some(u_slots) => b.arg(u_slots),
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
    unsafe { b.launch(warp_launch(warps)?) }.w()?;
    Ok(l1)
}

/// What the up kernel wrote: h in the slots (and the gate), and the L1 terms.
type UpWritten<'a> = (&'a CudaSlice<bf16>, &'a CudaSlice<bf16>, &'a CudaSlice<f32>);

/// The down row kernel over the slots (`v` vectors a lane, `split` warps a row), with the
/// residual add and norm after it where `fold` says.
fn down_slot_rows(
    dev: &CudaDevice,
    ops: &Operands,
    slots: &SlotRows,
    (values, gate, l1): UpWritten,
    out: &mut CudaSlice<bf16>,
    (v, split): (usize, usize),
    fold: Option<&RowFold>,
) -> Result<()> {
    let dims = &ops.dims;
    let (m, d) = (dims.m as usize, dims.d as usize);
    let kind = if fold.is_some() { "_norm" } else { "" };
    let name = format!("gated_t2d_down_rows{kind}_bf16_v{v}_s{split}");
    let down = dev.get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
    let mut b = down.builder();
    b.arg(&ops.w_ud)
        .arg(slots.counts)
        .arg(slots.indices)
        .arg(values)
        .arg(gate)
        .arg(l1)
        .arg(out);
    dims.push(&mut b);
    if let Some(fold) = fold {
        b.arg(&fold.residual).arg(&fold.alpha).arg(&fold.eps);
    }
    let shared = down_split_bytes(split, d);
    if shared > DEFAULT_SHARED_BYTES {
        // Past the default a block's dynamic shared memory is opted in to (`row_split`
        // checked the device's limit). Set at every launch: each `CudaDevice` loads its
        // own copy of the module, so a value kept per context would miss a new one.
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute as F;
        down.set_attribute(
            F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .w()?;
    }
    let mut cfg = warp_launch(m * split)?;
    cfg.shared_mem_bytes = shared as u32;
    // SAFETY: `split` warps per row (a divisor of the block's warps, its shared memory
    // sized above), bounds checked in the kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The down projection for few rows or wide ones: a warp per (row, 256-column chunk,
/// tile group); for decode sizes the tiles' partial sums meet in f32 atomics and a finish
/// kernel writes the rows.
fn down_slot_chunks(
    dev: &CudaDevice,
    ops: &Operands,
    slots: &SlotRows,
    (values, gate, l1): UpWritten,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let dims = &ops.dims;
    let (m, d) = (dims.m as usize, dims.d as usize);
    let n_tiles = ops.config.n_tiles(dims.f as usize);
    // Decode rows split each row's tiles over warps whose partial sums meet in f32 (then
    // the finish kernel); with one tile (d_ff up to a tile) a warp writes its row itself.
    let tile_groups = if m <= DECODE_MAX_TOKENS { n_tiles } else { 1 };
    let decode = tile_groups > 1;
    let mut acc = if decode {
        fused_ops::cuda::zeroed::<f32>(dev, m * d)?
    } else {
        // SAFETY: a placeholder; with one tile group the kernel never reads it.
        unsafe { dev.alloc::<f32>(1)? }
    };
    let n_chunks = d.div_ceil(WARP_CHUNK);
    let tg_i = tile_groups as i32;
    let down = dev.get_or_load_custom_func("gated_t2d_down_bf16", "gated_t2d", GATED_T2D_PTX)?;
    let mut b = down.builder();
    b.arg(&ops.w_ud)
        .arg(slots.counts)
        .arg(slots.indices)
        .arg(values)
        .arg(gate)
        .arg(l1)
        .arg(&mut acc)
        .arg(&mut *out);
    dims.push(&mut b);
    b.arg(&tg_i);
    // SAFETY: one warp per (row, chunk, tile group), bounds checked in the kernel.
    unsafe { b.launch(warp_launch(m * n_chunks * tile_groups)?) }.w()?;
    if decode {
        let len = mlp_result_len(m, d);
        let finish =
            dev.get_or_load_custom_func("gated_t2d_finish_bf16", "gated_t2d", GATED_T2D_PTX)?;
        let mut b = finish.builder();
        b.arg(&acc).arg(l1).arg(out).arg(&dims.m).arg(&dims.d);
        let blocks = len.div_ceil(BLOCK_THREADS as usize).min(4096);
        // SAFETY: grid-stride loop over the `len` elements of `out`.
        unsafe { b.launch(grid_1d(blocks, BLOCK_THREADS)) }.w()?;
    }
    Ok(())
}

/// Device events between the stages of one forward while profiling
/// ([`set_stage_profiling`]); nothing otherwise.
struct StageMarks {
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    marks: Vec<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

impl StageMarks {
    /// The first mark, before the gate GEMM.
    fn start(dev: &CudaDevice) -> Result<Self> {
        let mut stages = Self {
            stream: dev.cuda_stream(),
            marks: Vec::new(),
        };
        stages.mark()?;
        Ok(stages)
    }

    /// Marks the end of a stage.
    fn mark(&mut self) -> Result<()> {
        if profiling() {
            // Timing events: the default flags (cudarc disables timing when given None).
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let event = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            self.marks.push(event);
        }
        Ok(())
    }

    /// Adds the stages' times to the profile.
    fn finish(self) -> Result<()> {
        record_profile(&self.stream, &self.marks)
    }
}

/// The up and down kernels that walk the gate's bit mask, as `mlp_forward` picked them:
/// `v` 16-byte vectors a lane for a row, the folds of an add-norm sublayer.
struct MaskRowKernels<'a> {
    dev: &'a CudaDevice,
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
        let up = self
            .dev
            .get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
        let mut b = up.builder();
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
        unsafe { b.launch(warp_launch(dims.m as usize)?) }.w()?;
        Ok(())
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
        let down = self
            .dev
            .get_or_load_custom_func(&name, "gated_t2d", GATED_T2D_PTX)?;
        let mut b = down.builder();
        b.arg(ops.w_ud).arg(ops.mask).arg(gate).arg(l1).arg(out);
        dims.push_without_cap(&mut b);
        b.arg(&ops.words_per_row);
        if let Some(fold) = self.fold {
            b.arg(&fold.residual).arg(&fold.alpha).arg(&fold.eps);
        }
        // SAFETY: a warp a row, bounds checked in the kernel.
        unsafe { b.launch(warp_launch(dims.m as usize)?) }.w()?;
        Ok(())
    }
}

/// The bit mask of the plain gate's positives, `[m, words_per_row]` in cuBLASLt's layout
/// (`twell_gate_sign_mask_bf16`), for the row kernels that walk a mask.
fn sign_mask(
    dev: &CudaDevice,
    gate: &CudaSlice<bf16>,
    (m, f): (usize, usize),
) -> Result<(CudaSlice<u32>, usize)> {
    let words_per_row = gate_gemm::mask_words_per_row(f);
    // SAFETY: the kernel writes every word of every row.
    let mut mask = unsafe { dev.alloc::<u32>(m * words_per_row)? };
    let func = dev.get_or_load_custom_func(
        "twell_gate_sign_mask_bf16",
        "twell_gate_pack",
        twell_kernels::GATE_PACK,
    )?;
    let (m_i, f_i, words_i) = (m as i32, f as i32, words_per_row as i32);
    let mut b = func.builder();
    b.arg(gate).arg(&mut mask).arg(&m_i).arg(&f_i).arg(&words_i);
    let units = m * f.div_ceil(256);
    // SAFETY: SIGN_UNITS (row, 256-column) units a warp, bounds checked in the kernel.
    unsafe { b.launch(warp_launch(units.div_ceil(SIGN_UNITS))?) }.w()?;
    Ok((mask, words_per_row))
}
