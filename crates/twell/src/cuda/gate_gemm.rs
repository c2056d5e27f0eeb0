//! The gate GEMM `g = x · Wgᵀ` of the sparse MLP, two ways:
//!
//! * cuBLASLt with its ReLU epilogue writing a bit mask of the positives beside the gate
//!   (`CUBLASLT_EPILOGUE_RELU_AUX`, one bit per value). The row kernels then walk the mask
//!   (or the pack reads it and only the positive values, not the whole `[m, f]` gate:
//!   that full read was the pack's time, 38 µs of a 4 × 2048 prefill layer on the H200).
//! * cuBLAS (`cublasGemmEx`): the plain gate. Used below [`MASK_MIN_ROWS`] rows (where
//!   cuBLAS's GEMM is the faster one) and where cuBLASLt has no algorithm for the shape.

use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use crate::error::{err, TwellError};
use crate::format::GateGemm;
use fused_ops::cuda::PerKey;

/// The gate, `[m, f]` bf16, and, from cuBLASLt, the mask of its positives.
pub(crate) struct Gate {
    pub values: CudaSlice<bf16>,
    /// `[m, words_per_row]` u32 words, bit j of row r set where `g[r, j] > 0`; `None` when
    /// the plain GEMM ran (then negative values are kept too).
    pub mask: Option<(CudaSlice<u32>, usize)>,
}

/// `g = x · Wgᵀ` (`x [m, d]`, `wg [f, d]`, bf16): through cuBLASLt with the mask (see the
/// module doc) as `choice` says, where a mask consumer can take the shape (`mask_fits`),
/// else plain cuBLAS.
pub(crate) fn gate_gemm(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    (m, d, f): (usize, usize, usize),
    mask_fits: bool,
    choice: GateGemm,
) -> Result<Gate> {
    let use_mask = mask_fits
        && match choice {
            GateGemm::Plain => false,
            GateGemm::Masked => true,
            GateGemm::Auto => m >= MASK_MIN_ROWS,
        };
    if use_mask {
        if let Some(gate) = gate_gemm_masked(dev, x, wg, (m, d, f))? {
            return Ok(gate);
        }
        if choice == GateGemm::Masked {
            return err(TwellError::Invalid(format!(
                "GateGemm::Masked: cuBLASLt has no ReLU-mask GEMM for [{m}, {d}] x [{f}, {d}]"
            )));
        }
    }
    Ok(Gate {
        values: gate_gemm_plain(dev, x, wg, (m, d, f))?,
        mask: None,
    })
}

/// From this many rows on the masked GEMM is the default. Measured on the H200 at
/// 2048 × 5632, 0.5%: the pack is 1.5–2x faster from the mask at every size, but the
/// masked GEMM, even with the fastest of cuBLASLt's candidates, runs up to 10% slower
/// than `cublasGemmEx` at 2048 rows and 0–5% slower above, so the two cancel at 8192
/// rows and the mask gains 1–1.4% of a 16 × 2048 prefill.
const MASK_MIN_ROWS: usize = 4096;

/// `g = x · Wgᵀ` into a fresh `[m, f]` bf16 buffer, through cuBLAS.
fn gate_gemm_plain(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    (m, d, f): (usize, usize, usize),
) -> Result<CudaSlice<bf16>> {
    x_times_wt(dev, x, wg, d, (m, d, f))
}

/// `x · Wᵀ` (`x [m, d]`, `W [f, d]` with its rows `w_stride` elements apart, bf16) into a
/// fresh `[m, f]` bf16 buffer through cuBLAS: the plain gate, and the up projection
/// read in place from `w_ud [f, 2d]` (stride 2d).
pub(crate) fn x_times_wt(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    w: &CudaView<bf16>,
    w_stride: usize,
    (m, d, f): (usize, usize, usize),
) -> Result<CudaSlice<bf16>> {
    // SAFETY: cuBLAS writes every element below.
    let mut out = unsafe { dev.alloc::<bf16>(m * f)? };
    // Row-major Y [m, f] is column-major Yᵀ [f, m] = W [f, d] · xᵀ [d, m].
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: f as i32,
        n: m as i32,
        k: d as i32,
        alpha: bf16::ONE,
        lda: w_stride as i32,
        ldb: d as i32,
        beta: bf16::ZERO,
        ldc: f as i32,
    };
    // SAFETY: shapes and leading dimensions match the buffers above.
    unsafe { dev.cublas_handle().gemm(cfg, w, x, &mut out) }.w()?;
    Ok(out)
}

/// u32 words of mask per token row: cuBLASLt wants the mask's leading dimension a
/// multiple of 128 bits.
pub(crate) fn mask_words_per_row(f: usize) -> usize {
    f.div_ceil(128) * 4
}

/// The cuBLASLt objects of one GEMM shape, made once: the descriptor (its mask pointer
/// set per call), the three layouts and the algorithm the heuristic picked.
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    c: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
    workspace_bytes: usize,
}

impl Plan {
    /// A plan that owns nothing yet: `make_plan` fills it in one object at a time, so an
    /// error part way drops (and destroys) only what was made.
    fn empty() -> Self {
        Self {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspace_bytes: 0,
        }
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each non-null object was created by `make_plan` for this plan alone.
        unsafe {
            for layout in [self.a, self.b, self.c] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A device's cuBLASLt handle and its plans by `(m, d, f)` (`None`: no algorithm).
struct LtDevice {
    handle: lt_sys::cublasLtHandle_t,
    plans: HashMap<(usize, usize, usize), Option<Plan>>,
}

// SAFETY: the raw cuBLASLt objects are only used under the `LT` lock, and cuBLASLt
// handles may be used from any thread.
unsafe impl Send for LtDevice {}

/// Each device's cuBLASLt handle and plans, by ordinal.
static LT: PerKey<usize, LtDevice> = PerKey::new();

/// The GEMM through cuBLASLt with the ReLU mask; `None` when cuBLASLt has no algorithm
/// for it.
fn gate_gemm_masked(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    wg: &CudaView<bf16>,
    (m, d, f): (usize, usize, usize),
) -> Result<Option<Gate>> {
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let words_per_row = mask_words_per_row(f);
    let make_handle = || {
        stream.context().bind_to_thread().w()?;
        Ok(LtDevice {
            handle: lt::create_handle().map_err(lt_error)?,
            plans: HashMap::new(),
        })
    };
    LT.with(
        ordinal,
        |_| true,
        make_handle,
        |lt_dev| {
            // A shape cuBLASLt was found to have no algorithm for needs no buffers.
            let key = (m, d, f);
            if matches!(lt_dev.plans.get(&key), Some(None)) {
                return Ok(None);
            }
            // SAFETY: cuBLASLt writes every value and, for rows of the mask, every bit the
            // consumers read (bits 0..f of each row). A new shape's plan times its
            // candidates on them.
            let mut gate = unsafe { dev.alloc::<bf16>(m * f)? };
            let mut mask = unsafe { dev.alloc::<u32>(m * words_per_row)? };
            let (workspace_ptr, workspace_bytes) = fused_ops::cuda::cublas_workspace(dev);
            let (mask_ptr, _mask_guard) = mask.device_ptr_mut(&stream);
            let handle = lt_dev.handle;
            let (x_ptr, _x_guard) = x.device_ptr(&stream);
            let (wg_ptr, _wg_guard) = wg.device_ptr(&stream);
            let (gate_ptr, _gate_guard) = gate.device_ptr_mut(&stream);
            let buffers = Buffers {
                wg: wg_ptr,
                x: x_ptr,
                gate: gate_ptr,
                mask: mask_ptr,
                workspace: workspace_ptr,
                workspace_bytes,
            };
            let plan = match lt_dev.plans.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(make_plan(handle, &stream, (m, d, f), &buffers)?)
                }
            };
            let Some(plan) = plan.as_ref() else {
                return Ok(None);
            };
            // SAFETY: the plan describes these buffers (see `launch`).
            unsafe {
                launch(
                    handle,
                    &stream,
                    plan,
                    &plan.algo,
                    plan.workspace_bytes,
                    &buffers,
                )?
            };
            drop((_mask_guard, _gate_guard));
            Ok(Some(Gate {
                values: gate,
                mask: Some((mask, words_per_row)),
            }))
        },
    )
}

/// Device addresses of one gate GEMM's operands.
struct Buffers {
    wg: u64,
    x: u64,
    gate: u64,
    mask: u64,
    workspace: u64,
    workspace_bytes: usize,
}

/// Enqueues the masked GEMM of `plan` with `algo` on `stream`.
///
/// # Safety
/// `buffers` must hold `wg [f, d]`, `x [m, d]`, `gate [m, f]` (row-major bf16) and a mask
/// of `m` rows of the plan's leading dimension, for the plan's `(m, d, f)`, and a
/// workspace of at least `workspace_bytes`.
unsafe fn launch(
    handle: lt_sys::cublasLtHandle_t,
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    plan: &Plan,
    algo: &lt_sys::cublasLtMatmulAlgo_t,
    workspace_bytes: usize,
    buffers: &Buffers,
) -> Result<()> {
    let (alpha, beta) = (1f32, 0f32);
    set_attr(
        plan.desc,
        lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
        &buffers.mask,
    )?;
    lt::matmul(
        handle,
        plan.desc,
        &alpha as *const f32 as *const _,
        &beta as *const f32 as *const _,
        buffers.wg as *const _,
        plan.a,
        buffers.x as *const _,
        plan.b,
        buffers.gate as *const _,
        plan.c,
        buffers.gate as *mut _,
        plan.c,
        algo,
        buffers.workspace as *mut _,
        workspace_bytes.min(buffers.workspace_bytes),
        stream.cu_stream() as *mut _,
    )
    .map_err(lt_error)
}

/// cuBLASLt candidates a plan is picked from.
const CANDIDATES: usize = 8;

/// From this many rows on, a new shape's plan times cuBLASLt's candidates (one host
/// synchronisation, once per shape) instead of taking its first: the first one ran
/// 5–8% slower than `cublasGemmEx` at prefill sizes on the H200, the fastest of eight
/// 0–10% faster than the first. Below it (only with [`GateGemm::Masked`]) a sync per new
/// shape costs more than it gains.
const TUNE_MIN_ROWS: usize = 1024;

/// Descriptor, layouts and algorithm of `Gᵀ [f, m] = Wg [f, d] · xᵀ [d, m]` in
/// column-major terms (row-major `wg`, `x`, `g`), with the ReLU and the mask's leading
/// dimension set; runs the GEMM into `buffers` while it times candidates.
fn make_plan(
    handle: lt_sys::cublasLtHandle_t,
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    (m, d, f): (usize, usize, usize),
    buffers: &Buffers,
) -> Result<Option<Plan>> {
    use lt_sys::cublasLtMatmulDescAttributes_t as Attr;
    let bf = lt_sys::cudaDataType_t::CUDA_R_16BF;
    let mut plan = Plan::empty();
    plan.desc = lt::create_matmul_desc(
        lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        lt_sys::cudaDataType_t::CUDA_R_32F,
    )
    .map_err(lt_error)?;
    plan.a = lt::create_matrix_layout(bf, d as u64, f as u64, d as i64).map_err(lt_error)?;
    plan.b = lt::create_matrix_layout(bf, d as u64, m as u64, d as i64).map_err(lt_error)?;
    plan.c = lt::create_matrix_layout(bf, f as u64, m as u64, f as i64).map_err(lt_error)?;
    let (desc, a, b, c) = (plan.desc, plan.a, plan.b, plan.c);
    let transpose: i32 = 1;
    let keep: i32 = 0;
    let mask_ld = (mask_words_per_row(f) * 32) as i64;
    // SAFETY: each attribute gets a value of the type the cuBLASLt docs give it.
    unsafe {
        set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &transpose)?;
        set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &keep)?;
        let relu_aux = lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_AUX;
        set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &relu_aux)?;
        set_attr(
            desc,
            Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &buffers.mask,
        )?;
        set_attr(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &mask_ld)?;
    }
    let wanted = CANDIDATES;
    let mut found: Vec<lt_sys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(wanted);
    let mut count: i32 = 0;
    let pref = lt::create_matmul_pref().map_err(lt_error)?;
    // SAFETY: the preference takes the workspace limit as a size_t; the heuristic writes
    // at most `wanted` results into `found`'s capacity and their number into `count`. The
    // preference is destroyed on every path before an error returns.
    unsafe {
        let limit = lt::set_matmul_pref_attribute(
            pref,
            lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &buffers.workspace_bytes as *const usize as *const _,
            std::mem::size_of::<usize>(),
        );
        let status = limit.is_ok().then(|| {
            lt_sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                a,
                b,
                c,
                c,
                pref,
                wanted as i32,
                found.as_mut_ptr(),
                &mut count,
            )
        });
        let destroyed = lt::destroy_matmul_pref(pref);
        limit.map_err(lt_error)?;
        destroyed.map_err(lt_error)?;
        if status == Some(lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS) {
            found.set_len(count.clamp(0, wanted as i32) as usize);
        }
    }
    found.retain(|h| h.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
    if found.is_empty() {
        // No algorithm for this shape: the plain GEMM takes it (the plan's
        // objects are destroyed as it drops).
        return Ok(None);
    }
    plan.algo = found[0].algo;
    plan.workspace_bytes = found[0].workspaceSize;
    if m >= TUNE_MIN_ROWS && found.len() > 1 {
        let best = fastest(handle, stream, &plan, &found, buffers)?;
        plan.algo = found[best].algo;
        plan.workspace_bytes = found[best].workspaceSize;
    }
    Ok(Some(plan))
}

/// The index of the fastest of `found` on `buffers`: each runs once to warm up, then
/// three times between two events; the median of those times decides.
fn fastest(
    handle: lt_sys::cublasLtHandle_t,
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    plan: &Plan,
    found: &[lt_sys::cublasLtMatmulHeuristicResult_t],
    buffers: &Buffers,
) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let mut times = Vec::with_capacity(found.len());
    for h in found {
        let mut runs = Vec::with_capacity(3);
        // SAFETY: as in `gate_gemm_masked`: the plan describes `buffers`.
        unsafe { launch(handle, stream, plan, &h.algo, h.workspaceSize, buffers)? };
        for _ in 0..3 {
            let start = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            // SAFETY: as above.
            unsafe { launch(handle, stream, plan, &h.algo, h.workspaceSize, buffers)? };
            let end = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            end.synchronize().w()?;
            runs.push(start.elapsed_ms(&end).w()?);
        }
        runs.sort_by(f32::total_cmp);
        times.push(runs[1]);
    }
    let best = (0..times.len())
        .min_by(|&i, &j| times[i].total_cmp(&times[j]))
        .expect("at least one candidate");
    Ok(best)
}

/// Sets one descriptor attribute to `value`.
///
/// # Safety
/// `T` must be the attribute's type.
unsafe fn set_attr<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const _,
        std::mem::size_of::<T>(),
    )
    .map_err(lt_error)
}

fn lt_error(e: lt::CublasError) -> candle_core::Error {
    TwellError::Invalid(format!("cuBLASLt: {e:?}")).into()
}
