//! The one-launch decode MLP (`kernels/src/twell_mlp_decode.cu`): the gate, ReLU, up and
//! down of one token row, or of a few rows (a batched decode step), in one kernel, for
//! inference. Its sums (fixed point in 64-bit integers, so that they do not depend on the
//! order of the atomics) live in a scratch buffer kept per stream, that every launch
//! leaves zeroed: a decode step's MLP then costs one launch and two output allocations.

use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaView, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use fused_ops::cuda::{stream_key, PerStream};

use crate::cuda::KernelDims;
use crate::format::FewRows;
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

/// The most rows the few-row kernel takes (`twell_mlp_decode_rows16_*`).
pub const FEW_ROWS_MAX: usize = 16;

/// The most gate multiply-adds (`m · d · f`) the few-row kernel takes under
/// `FewRows::Auto`. It computes the rows' gates on the CUDA cores, each gate row converted
/// once a row, so its time grows with them where the staged kernels' cuBLAS gate stays
/// flat. In replayed decode steps (H100, 2026-12-07, docs/benchmarks.md "H100: 2–64 rows
/// on the row kernels") it won at 2–4 rows of 576 × 1536, 960 × 2560 and 896 × 4864 (up
/// to 17M), tied at 8 rows of 576 × 1536 (7M) and lost at 8 rows of 960 × 2560 (20M) and
/// 2 rows of 2048 × 5632 (23M).
pub const FEW_ROWS_MAX_GATE_MACS: usize = 18 << 20;

/// The most rows the few-row kernel takes under `FewRows::Auto`. In replayed decode steps
/// of the SmolLM2 shape (576 × 1536 × 30, H100, 2026-12-07, docs/benchmarks.md "H100:
/// 2–64 rows spread over the card") it took 1.25x of dense at 2 rows against the spread
/// kernels' 1.20x / 1.11x (0.5% / 3%), 1.16x / 1.14x at 4 against 1.19x / 1.09x, and
/// 0.91x / 0.89x at 8 against 1.18x / 1.08x.
pub const FEW_ROWS_AUTO_MAX: usize = 4;

/// The widest hidden size the tensor-core few-row kernel takes (its last block finishes
/// a row in four 16-byte vectors a thread).
pub const FEW_ROWS_TC_MAX_HIDDEN: usize = 8192;

/// The two one-launch kernels of 2 to [`FEW_ROWS_MAX`] rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FewRowsKernel {
    /// The rows' gates on the CUDA cores, x in shared memory: hidden up to 2048.
    CudaCores,
    /// The rows' gates as m16n8k16 products: hidden a multiple of 32 up to
    /// [`FEW_ROWS_TC_MAX_HIDDEN`].
    TensorCores,
}

/// Which one-launch kernel a forward of `m` rows takes under `choice`, if any: 2 to
/// [`FEW_ROWS_MAX`] rows (a batched decode step, a short prompt), inference only. `Auto`
/// takes the CUDA-core kernel up to [`FEW_ROWS_AUTO_MAX`] rows within
/// [`FEW_ROWS_MAX_GATE_MACS`] (hidden up to 2048: 8 vectors a lane, as the rows' gates and
/// two gate rows in flight fill the registers).
pub fn few_rows_kernel(
    m: usize,
    d: usize,
    f: usize,
    keep_for_backward: bool,
    choice: FewRows,
) -> Option<FewRowsKernel> {
    if !(2..=FEW_ROWS_MAX).contains(&m) || keep_for_backward {
        return None;
    }
    let cuda_cores = crate::cuda::row_vectors(d).is_some_and(|v| v <= 8);
    let tensor_cores = d.is_multiple_of(32) && d <= FEW_ROWS_TC_MAX_HIDDEN;
    match choice {
        FewRows::Auto => {
            (cuda_cores && m <= FEW_ROWS_AUTO_MAX && m * d * f <= FEW_ROWS_MAX_GATE_MACS)
                .then_some(FewRowsKernel::CudaCores)
        }
        FewRows::CudaCores => cuda_cores.then_some(FewRowsKernel::CudaCores),
        FewRows::TensorCores => tensor_cores.then_some(FewRowsKernel::TensorCores),
        FewRows::Staged => None,
    }
}

/// Whether a forward of `m` rows takes a one-launch few-row kernel ([`few_rows_kernel`]).
pub fn use_few_rows_decode(
    m: usize,
    d: usize,
    f: usize,
    keep_for_backward: bool,
    choice: FewRows,
) -> bool {
    few_rows_kernel(m, d, f, keep_for_backward, choice).is_some()
}

/// The zeroed sums, L1 terms, tile counts and ticket of one stream, for up to
/// [`FEW_ROWS_MAX`] rows, grown to the largest hidden size and tile count seen.
struct Scratch {
    acc: CudaSlice<u64>,
    l1: CudaSlice<f32>,
    tile_counts: CudaSlice<u32>,
    ticket: CudaSlice<u32>,
    /// Blocks of one wave, per kernel (its name) and hidden size (the few-row kernels'
    /// shared memory grows with it).
    grids: HashMap<(&'static str, usize), u32>,
}

impl Scratch {
    fn new(dev: &CudaDevice, d: usize, n_tiles: usize) -> Result<Self> {
        Ok(Self {
            acc: dev.alloc_zeros::<u64>(FEW_ROWS_MAX * d)?,
            l1: dev.alloc_zeros::<f32>(FEW_ROWS_MAX)?,
            tile_counts: dev.alloc_zeros::<u32>(FEW_ROWS_MAX * n_tiles)?,
            ticket: dev.alloc_zeros::<u32>(1)?,
            grids: HashMap::new(),
        })
    }

    fn fits(&self, d: usize, n_tiles: usize) -> bool {
        self.acc.len() >= FEW_ROWS_MAX * d && self.tile_counts.len() >= FEW_ROWS_MAX * n_tiles
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

/// The few-row entry point for `m` rows (its row bound: 4, 8 or 16) of `v` vectors a
/// lane (1 to 8), and that bound.
fn rows_kernel_name(m: usize, v: usize) -> (&'static str, usize) {
    const ROWS: [[&str; 4]; 3] = [
        [
            "twell_mlp_decode_rows4_bf16_v1",
            "twell_mlp_decode_rows4_bf16_v2",
            "twell_mlp_decode_rows4_bf16_v4",
            "twell_mlp_decode_rows4_bf16_v8",
        ],
        [
            "twell_mlp_decode_rows8_bf16_v1",
            "twell_mlp_decode_rows8_bf16_v2",
            "twell_mlp_decode_rows8_bf16_v4",
            "twell_mlp_decode_rows8_bf16_v8",
        ],
        [
            "twell_mlp_decode_rows16_bf16_v1",
            "twell_mlp_decode_rows16_bf16_v2",
            "twell_mlp_decode_rows16_bf16_v4",
            "twell_mlp_decode_rows16_bf16_v8",
        ],
    ];
    let (k, bound) = match m {
        0..=4 => (0, 4),
        5..=8 => (1, 8),
        _ => (2, 16),
    };
    (ROWS[k][v.trailing_zeros() as usize], bound)
}

/// The tensor-core few-row entry point for `m` rows (up to 8 or 16) of hidden `d` (up to
/// 2048, 4096 or 8192).
fn tc_kernel_name(m: usize, d: usize) -> &'static str {
    const TC: [[&str; 3]; 2] = [
        [
            "twell_mlp_decode_rows_tc1_bf16_nv1",
            "twell_mlp_decode_rows_tc1_bf16_nv2",
            "twell_mlp_decode_rows_tc1_bf16_nv4",
        ],
        [
            "twell_mlp_decode_rows_tc2_bf16_nv1",
            "twell_mlp_decode_rows_tc2_bf16_nv2",
            "twell_mlp_decode_rows_tc2_bf16_nv4",
        ],
    ];
    let nv = match d {
        0..=2048 => 0,
        2049..=4096 => 1,
        _ => 2,
    };
    TC[usize::from(m > 8)][nv]
}

/// Neurons a block of the tensor-core kernel takes at a time (`TC_NEURONS`).
const TC_NEURONS: usize = 16;

/// Blocks of one wave: as many as the multiprocessors hold at once. The warps loop
/// over the neurons, so a warp loads its row of x once for several of them, and no
/// partial last wave idles the card.
fn one_wave(dev: &CudaDevice, func: &CudaFunction, shared_bytes: usize) -> Result<u32> {
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, shared_bytes, None)
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

/// Runs the fused MLP of the rows `x [m, d]` (`dims.m`: one row, or 2 to
/// [`FEW_ROWS_MAX`]) into `out [mlp_result_len(m, d)]` (and, with `add_norm`, the residual
/// add and norm after it) and returns the `[m, n_tiles]` true nonzero counts. With
/// `add_norm`, the MLP rows and the counts are written only where asked for (`out`,
/// `want_counts`): a decode step reads neither, and each is an allocation a layer. The
/// norm before the MLP folds in for one row only.
#[allow(clippy::too_many_arguments)]
pub fn twell_mlp_decode(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    w_ud: &CudaView<bf16>,
    out: Option<&mut CudaSlice<bf16>>,
    want_counts: bool,
    dims: &KernelDims,
    few_rows: FewRows,
    add_norm: Option<AddNorm<'_>>,
) -> Result<Option<CudaSlice<u32>>> {
    let (m, d, f, n_tiles) = (
        dims.m as usize,
        dims.d as usize,
        dims.f as usize,
        dims.n_tiles as usize,
    );
    let invalid = |what: String| crate::error::err(crate::error::TwellError::Invalid(what));
    let rows_kernel = few_rows_kernel(m, d, f, false, few_rows);
    if !(use_fused_decode(m, d, false) || rows_kernel.is_some()) {
        return invalid(format!(
            "twell_mlp_decode takes one row of hidden up to 4096, or 2 to {FEW_ROWS_MAX} rows \
             that the few-row kernel {few_rows:?} takes (on the CUDA cores: hidden up to 2048; \
             on the tensor cores: hidden a multiple of 32 up to {FEW_ROWS_TC_MAX_HIDDEN}), got \
             [{m}, {d}] and d_ff {f}"
        ));
    }
    if add_norm.is_none() && (out.is_none() || !want_counts) {
        return invalid(
            "twell_mlp_decode: without a folded add + norm the MLP rows and counts are the \
             results, so both must be asked for"
                .into(),
        );
    }
    if x.len() != m * d {
        return invalid(format!(
            "twell_mlp_decode: x holds {} values, [{m}, {d}] needs {}",
            x.len(),
            m * d
        ));
    }
    if let Some(o) = &out {
        debug_assert_eq!(o.len(), mlp_result_len(m, d));
    }
    let mut add_norm = add_norm;
    if let Some(a) = &add_norm {
        if d > ADD_NORM_MAX_HIDDEN
            || a.residual.len() != m * d
            || a.alpha.len() != d
            || a.sum_normed.len() != 2 * m * d
            || a.pre.as_ref().is_some_and(|p| m > 1 || p.alpha.len() != d)
        {
            return invalid(format!(
                "twell_mlp_decode: the folded add + norm takes hidden <= {ADD_NORM_MAX_HIDDEN}, \
                 a residual of {m} x {d}, norm weights of {d} (the one before the MLP for one \
                 row only) and a result of {}, got {}, {}, {:?} and {}",
                2 * m * d,
                a.residual.len(),
                a.alpha.len(),
                a.pre.as_ref().map(|p| p.alpha.len()),
                a.sum_normed.len()
            ));
        }
    }
    // Vectors a lane for the kernels that hold a row in registers (the tensor-core kernel
    // takes hidden sizes past them).
    let v = crate::cuda::row_vectors(d);
    // SAFETY: the kernel's last block writes every count.
    let mut counts = match want_counts {
        true => Some(unsafe { dev.alloc::<u32>(m * n_tiles)? }),
        false => None,
    };
    SCRATCH.with(
        stream_key(dev),
        |s| s.fits(d, n_tiles),
        || Scratch::new(dev, d, n_tiles),
        |s| {
            // One row: the norm before the MLP has entry points of its own (`_norm`).
            // Rows: each row of x in shared memory, as many bytes as the row bound takes
            // (the occupancy of one wave is worked out for them).
            // The tensor-core kernel reads x from L2 and takes TC_NEURONS neurons a block
            // at a time; the others a neuron a warp.
            let (name, shared_bytes, neurons_per_block) = match rows_kernel {
                None => (
                    kernel_name(
                        add_norm.as_ref().is_some_and(|a| a.pre.is_some()),
                        v.expect("use_fused_decode checked the hidden size"),
                    ),
                    0,
                    BLOCK_THREADS as usize / 32,
                ),
                Some(FewRowsKernel::CudaCores) => {
                    let (name, bound) =
                        rows_kernel_name(m, v.expect("few_rows_kernel checked the hidden size"));
                    (
                        name,
                        bound * d * std::mem::size_of::<bf16>(),
                        BLOCK_THREADS as usize / 32,
                    )
                }
                Some(FewRowsKernel::TensorCores) => (tc_kernel_name(m, d), 0, TC_NEURONS),
            };
            let func =
                dev.get_or_load_custom_func(name, "twell_mlp_decode", TWELL_MLP_DECODE_PTX)?;
            let wave = match s.grids.get(&(name, d)) {
                Some(&g) => g,
                None => {
                    if shared_bytes > 0 {
                        func.set_attribute(
                            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            shared_bytes as i32,
                        )
                        .w()?;
                    }
                    let g = one_wave(dev, &func, shared_bytes)?;
                    s.grids.insert((name, d), g);
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
            if m > 1 {
                b.arg(&dims.m);
            }
            b.arg(&dims.d)
                .arg(&dims.f)
                .arg(&dims.tile)
                .arg(&dims.n_tiles);
            // The one-row kernels take the norm before the MLP last.
            match add_norm.as_mut() {
                Some(a) => {
                    b.arg(&a.residual)
                        .arg(&a.alpha)
                        .arg(&mut *a.sum_normed)
                        .arg(&a.eps);
                    match (m, &a.pre) {
                        (1, Some(p)) => b.arg(&p.alpha).arg(&p.eps),
                        (1, None) => b.arg(&null).arg(&no_eps),
                        _ => &mut b,
                    };
                }
                None => {
                    b.arg(&null).arg(&null).arg(&null).arg(&no_eps);
                    if m == 1 {
                        b.arg(&null).arg(&no_eps);
                    }
                }
            }
            let mut cfg = fused_ops::cuda::grid_1d(
                f.div_ceil(neurons_per_block).min(wave as usize),
                BLOCK_THREADS,
            );
            cfg.shared_mem_bytes = shared_bytes as u32;
            // SAFETY: a warp (or, on the tensor cores, a block) per neuron or group of
            // neurons (grid-stride), every index bounded by m, d, f and n_tiles; the scratch
            // holds FEW_ROWS_MAX rows of the largest d and n_tiles; x's rows fit the dynamic
            // shared memory given; a block's neuron list is bounded by DECODE_LIST in the
            // kernel; the tensor-core kernel reads whole 32-column chunks (d % 32 == 0).
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        },
    )?;
    Ok(counts)
}
