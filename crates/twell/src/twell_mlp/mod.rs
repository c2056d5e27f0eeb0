//! `twell_mlp`: the whole ReGLU MLP through TwELL in one op.
//!
//! `out = Σ_j relu(x · Wg_j) · (x · Wu_j) · Wd_j` over the active neurons only, with
//! each token's L1 term. The pattern and gate values found in the forward pass are
//! kept for the backward pass, so the gate GEMM runs once per training step.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use fused_ops::checks::{contiguous_2d, matrix_dims, same_dtype_and_device, shape_err};
use fused_ops::host::{f32_vec, host, with_rows, Rows};

use crate::cpu::screen::{GateScreen, SCREEN_MAX_ROWS};
use crate::cpu::t2d::{self, GateGrad};
use crate::cpu::warm;
use crate::error::{err, TwellError};
use crate::format::{check_size, StagedRows, TwellConfig, TwellPattern};
use crate::gate_pack::gate_and_pack;
use crate::output::{cpu_storage, mlp_result_len, Activity, MlpOutput};

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_backward;
#[cfg(feature = "cuda")]
mod cuda_decode;

/// What the forward pass leaves for the backward pass and the caller.
#[derive(Clone)]
enum Saved {
    /// The CPU pass: the pattern and the gate values in f32 (value layout).
    Host {
        pattern: Arc<TwellPattern>,
        gate: Arc<Vec<f32>>,
    },
    /// The CUDA pass: per-(token, tile) counts on the device, and what a device
    /// backward pass needs when one may follow.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device {
        counts: Tensor,
        #[cfg(feature = "cuda")]
        backward: Option<Arc<cuda::BackwardState>>,
    },
}

/// How a device backward forms dx and the three weight gradients. Per active (token,
/// neuron) pair the work scales with the nonzeros but reads about 8 KB for dx and 8 KB
/// for the weight gradients; cuBLAS GEMMs over the scattered dense `[M, d_ff]` dg, du
/// (and h) cost the same at any density. dx's GEMMs pay off first (at lower density).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardPath {
    /// dx and the weight gradients per pair (for the weights, tokens grouped by neuron).
    Sparse,
    /// dx by two GEMMs, the weight gradients per pair.
    DenseDx,
    /// dx and the weight gradients by GEMMs.
    Dense,
}

/// Above this measured density the CUDA backward forms dx by GEMMs. H200, hidden 2048 /
/// d_ff 5632, `twell bench mlp-train --backward ...` with each path forced: per pair and
/// by GEMMs cross at 0.60-0.63% for M = 16384 and 65536.
pub const CUDA_DENSE_DX_DENSITY: f64 = 0.0065;
/// Above this one the weight gradients too (the same runs cross at 1.1-1.4%).
pub const CUDA_DENSE_WEIGHT_GRADS_DENSITY: f64 = 0.0125;

impl BackwardPath {
    /// The choice for a pass at a measured density (`None`: not measured yet, when the
    /// sparse path runs because a low density is expected).
    pub fn for_density(density: Option<f64>) -> Self {
        match density {
            Some(d) if d > CUDA_DENSE_WEIGHT_GRADS_DENSITY => Self::Dense,
            Some(d) if d > CUDA_DENSE_DX_DENSITY => Self::DenseDx,
            _ => Self::Sparse,
        }
    }

    /// Whether dx is formed per pair.
    pub fn sparse_dx(self) -> bool {
        self == Self::Sparse
    }

    /// Whether the weight gradients are formed per pair.
    pub fn sparse_weight_grads(self) -> bool {
        self != Self::Dense
    }
}

/// The op behind [`twell_mlp`]: inputs `(x, gate_proj, w_ud)`, output
/// `[mlp_result_len(M, d)]`.
pub struct TwellMlp {
    config: TwellConfig,
    /// An int8 screen of `gate_proj` for few-token host passes (see `cpu::screen`).
    screen: Option<Arc<GateScreen>>,
    /// Whether a backward pass may follow (an input tracks gradients): only then
    /// does the device pass keep its slots' g and u.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keep_for_backward: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    backward_path: BackwardPath,
    saved: Arc<Mutex<Option<Saved>>>,
}

impl TwellMlp {
    fn saved(&self) -> Option<Saved> {
        self.saved.lock().expect("saved lock").clone()
    }
}

impl CustomOp3 for TwellMlp {
    fn name(&self) -> &'static str {
        "twell-mlp"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, d) = contiguous_2d("x", xl)?;
        let (f, _) = contiguous_2d("gate_proj", gl)?;
        contiguous_2d("w_ud", wl)?;
        let x = Rows::new("x", xs, xl)?;
        let wg = Rows::new("gate_proj", gs, gl)?;
        let w_ud = Rows::new("w_ud", ws, wl)?;
        let (pattern, gate) =
            gate_and_pack::<f32>(x, wg, (m, d, f), self.config, self.screen.as_deref());
        let out = t2d::forward(&pattern, &gate, x, w_ud, d);
        if self.screen.is_some() && m <= SCREEN_MAX_ROWS {
            // A decode call: the next one comes soon, keep the workers from sleeping.
            warm::keep_workers_warm(warm::warm_window());
        }
        *self.saved.lock().expect("saved lock") = Some(Saved::Host {
            pattern: Arc::new(pattern),
            gate: Arc::new(gate),
        });
        Ok((
            cpu_storage(out, x.dtype())?,
            Shape::from(mlp_result_len(m, d)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let keep = self.keep_for_backward && cuda_backward::backward_supported(xl.dims()[1]);
        let (storage, shape, activity) =
            cuda::twell_mlp_forward(xs, xl, gs, gl, ws, wl, self.config, keep)?;
        let (m, n_tiles) = (xl.dims()[0], self.config.n_tiles(gl.dims()[0]));
        let counts = crate::output::device_counts(activity.counts, xs.device.clone(), (m, n_tiles));
        *self.saved.lock().expect("saved lock") = Some(Saved::Device {
            counts,
            backward: activity.backward.map(Arc::new),
        });
        Ok((storage, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate_proj: &Tensor,
        w_ud: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, gate_proj, w_ud, grad_res)
    }
}

type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

impl TwellMlp {
    /// On the device kernels after a device forward that kept its slots, else on the
    /// host.
    fn backward(
        &self,
        x: &Tensor,
        gate_proj: &Tensor,
        w_ud: &Tensor,
        grad_res: &Tensor,
    ) -> Result<Grads3> {
        #[cfg(feature = "cuda")]
        if let Some(Saved::Device {
            counts,
            backward: Some(state),
        }) = self.saved()
        {
            return device_backward(
                x,
                gate_proj,
                w_ud,
                grad_res,
                &counts,
                &state,
                self.config,
                self.backward_path,
            );
        }
        let (m, d) = x.dims2()?;
        let f = w_ud.dim(0)?;
        let dout = f32_vec(grad_res)?;
        let (hx, hg, hw) = (host(x)?, host(gate_proj)?, host(w_ud)?);
        let grads = with_rows("x", &hx, |x| {
            with_rows("gate_proj", &hg, |wg| {
                with_rows("w_ud", &hw, |w| {
                    // The CPU pass kept its pattern; after a device pass it is
                    // recomputed here (the backward runs on the host for now).
                    let (pattern, gate) = match self.saved() {
                        Some(Saved::Host { pattern, gate }) => (pattern, gate),
                        _ => {
                            let (p, g) = gate_and_pack::<f32>(x, wg, (m, d, f), self.config, None);
                            (Arc::new(p), Arc::new(g))
                        }
                    };
                    Ok(t2d::backward(
                        &pattern,
                        &gate,
                        x,
                        w,
                        GateGrad::Weights(wg),
                        &dout,
                        d,
                    ))
                })
            })
        })?;
        let dx = fused_ops::host::tensor_from_f32(grads.dx, &[m, d], x.dtype(), x.device())?;
        let dwg = fused_ops::host::tensor_from_f32(
            grads.dgate,
            &[f, d],
            gate_proj.dtype(),
            gate_proj.device(),
        )?;
        let dw = fused_ops::host::tensor_from_f32(
            grads.dw_ud,
            &[f, 2 * d],
            w_ud.dtype(),
            w_ud.device(),
        )?;
        Ok((Some(dx), Some(dwg), Some(dw)))
    }
}

/// The backward pass on the GPU, from what the device forward kept.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn device_backward(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    grad_res: &Tensor,
    counts: &Tensor,
    state: &cuda::BackwardState,
    config: TwellConfig,
    path: BackwardPath,
) -> Result<Grads3> {
    use candle_core::{op::BackpropOp, Storage};
    let grad_res = grad_res.to_dtype(x.dtype())?.contiguous()?;
    let parts = [x, gate_proj, w_ud, &grad_res, counts].map(|t| t.storage_and_layout());
    let cuda = |i: usize| match &*parts[i].0 {
        Storage::Cuda(s) => Ok((s, parts[i].1)),
        _ => Err(candle_core::Error::Msg(
            "twell-mlp backward: a device forward needs device tensors".into(),
        )),
    };
    let ((xs, xl), (gs, gl), (ws, wl), (rs, rl), (cs, cl)) =
        (cuda(0)?, cuda(1)?, cuda(2)?, cuda(3)?, cuda(4)?);
    let (dx, dwg, dw_ud) = cuda_backward::twell_mlp_backward(
        xs,
        xl,
        rs,
        rl,
        gs,
        gl,
        ws,
        wl,
        cs,
        cl,
        state,
        config,
        path.sparse_dx(),
        path.sparse_weight_grads(),
    )?;
    let (m, d) = x.dims2()?;
    let f = w_ud.dim(0)?;
    let wrap = |s, shape: (usize, usize)| {
        Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
    };
    Ok((
        Some(wrap(dx, (m, d))),
        Some(wrap(dwg, (f, d))),
        Some(wrap(dw_ud, (f, 2 * d))),
    ))
}

/// The ReGLU MLP `down(relu(gate(x)) ⊙ up(x))` through TwELL, for `x [M, d]`,
/// `gate_proj [f, d]` and `w_ud [f, 2d]` ([`super::up_down_matrix`]).
/// Differentiable with respect to all three.
pub fn twell_mlp(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
) -> Result<MlpOutput> {
    run(x, gate_proj, w_ud, config, None, BackwardPath::Sparse)
}

/// [`twell_mlp`] with the device backward taking `backward_path` ([`twell_mlp`] takes
/// [`BackwardPath::Sparse`]).
pub fn twell_mlp_with_backward_path(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
    backward_path: BackwardPath,
) -> Result<MlpOutput> {
    run(x, gate_proj, w_ud, config, None, backward_path)
}

/// [`twell_mlp`] with an int8 screen of `gate_proj` ([`GateScreen::new`] on the same
/// weights): host passes of at most [`crate::cpu::screen::SCREEN_MAX_ROWS`] tokens read
/// the int8 rows and recompute only the neurons that may fire. Same result.
pub fn twell_mlp_screened(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
    screen: Arc<GateScreen>,
) -> Result<MlpOutput> {
    let (f, d) = matrix_dims("gate_proj", gate_proj)?;
    if screen.dims() != (f, d) {
        return shape_err(
            "twell_mlp_screened",
            format!(
                "the screen is for a [{}, {}] gate, gate_proj is [{f}, {d}]",
                screen.dims().0,
                screen.dims().1
            ),
        );
    }
    run(
        x,
        gate_proj,
        w_ud,
        config,
        Some(screen),
        BackwardPath::Sparse,
    )
}

/// The density [`StagedRows::Auto`] assumes for a CUDA forward that is given none (a call
/// of the op itself; [`crate::SparseMlp`] passes the density it measured).
pub const STAGED_ROWS_ASSUMED_DENSITY: f64 = 0.01;

/// Where the row kernels beat the slot kernels, in f32 atomic adds of the slot kernels
/// per neuron a row part of the row kernels waits on (see [`staged_rows_for`]).
pub const ROW_KERNELS_MIN_ADDS_PER_PAIR: f64 = 80_000.0;

/// The fewest rows the row kernels take under [`StagedRows::Auto`]: at 8 rows the slot
/// kernels won or tied in every measured cell.
pub const ROW_KERNELS_MIN_ROWS: usize = 16;

/// The widest hidden size the spread kernels take (the up kernel holds a row of x in a
/// warp's registers).
pub const SPREAD_KERNELS_MAX_HIDDEN: usize = 4096;

/// The most gate values the spread down kernel's blocks read, `m · f · ceil(d / 256)`
/// (each 256-column slice of a row scans the row's whole `h`), where
/// [`StagedRows::Auto`] takes the spread kernels. In replayed decode steps (H100,
/// 2026-12-07; docs/benchmarks.md, "H100: 2–64 rows spread over the card") they were the
/// fastest form in every measured cell of hidden 576 to 4096 at 2–64 rows, 0.5% and 3%,
/// up to 7.3M (32 rows of 4096 × 14336), and lost at 14.7M (64 rows of 4096 × 14336:
/// 0.96x / 0.53x of dense against the row kernels' 1.09x / 0.78x).
pub const SPREAD_KERNELS_MAX_GATE_READS: usize = 10_000_000;

/// [`StagedRows::Auto`] settled for a staged CUDA forward of `m` rows (up to 64) of hidden
/// `d` through `f` neurons in tiles of `tile` at `density`: the spread kernels where they
/// run (hidden up to [`SPREAD_KERNELS_MAX_HIDDEN`], `f` a multiple of 8) within
/// [`SPREAD_KERNELS_MAX_GATE_READS`], else [`row_or_slot_kernels`].
pub fn staged_rows_for(m: usize, d: usize, f: usize, tile: usize, density: f64) -> StagedRows {
    let spread_runs = d <= SPREAD_KERNELS_MAX_HIDDEN && f.is_multiple_of(8);
    if spread_runs && m * f * d.div_ceil(256) <= SPREAD_KERNELS_MAX_GATE_READS {
        StagedRows::SpreadKernels
    } else {
        row_or_slot_kernels(m, d, f, tile, density)
    }
}

/// The row kernels or the slot kernels for `m` rows of hidden `d` through `f` neurons in
/// tiles of `tile` at `density`, where the spread kernels do not run. The slot kernels' down launch
/// adds `m · d · n_tiles` f32 atomics; each part of a row in the row kernels (a row split
/// over up to eight warps) waits on about `density · tile · ceil(n_tiles / 8)` neurons'
/// rows one after another. In replayed decode steps (H100, 2026-12-07: 576 × 1536 to
/// 4096 × 14336 at 8–64 rows and 0.5–3%; docs/benchmarks.md, "H100: 2–64 rows on the row
/// kernels") the row kernels won from [`ROW_KERNELS_MIN_ROWS`] rows where the first is at
/// least [`ROW_KERNELS_MIN_ADDS_PER_PAIR`] times the second: many rows of wide shapes at
/// low density.
fn row_or_slot_kernels(m: usize, d: usize, f: usize, tile: usize, density: f64) -> StagedRows {
    let n_tiles = f.div_ceil(tile.max(1));
    let pairs_per_part = (density.clamp(0.0, 1.0) * (tile * n_tiles.div_ceil(8)) as f64).max(0.5);
    let adds = (m * d * n_tiles) as f64;
    if m >= ROW_KERNELS_MIN_ROWS && adds >= ROW_KERNELS_MIN_ADDS_PER_PAIR * pairs_per_part {
        StagedRows::RowKernels
    } else {
        StagedRows::SlotKernels
    }
}

/// Whether [`twell_mlp_add_norm`] runs for `x` through `ffn` neurons: CUDA, bf16, and one
/// token of a hidden size the one-launch decode kernel and its folded norm take, a few
/// rows the few-row decode kernel takes, or prefill rows the down row kernel takes.
pub fn add_norm_fuses(x: &Tensor, ffn: usize, config: TwellConfig) -> bool {
    cuda_bf16_rows(x).is_some_and(|(m, d)| {
        #[cfg(feature = "cuda")]
        return cuda::add_norm_folds(m, d, ffn, config);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (m, d, ffn, config);
            false
        }
    })
}

/// `x`'s rows and width where it is a bf16 tensor on a CUDA device of a nonzero width:
/// the tensors the folded launches take.
fn cuda_bf16_rows(x: &Tensor) -> Option<(usize, usize)> {
    let d = x.dims().last().copied().unwrap_or(0);
    (x.device().is_cuda() && x.dtype() == candle_core::DType::BF16 && d > 0)
        .then(|| (x.elem_count() / d, d))
}

/// The MLP (`x [m, d]`, `gate_proj [f, d]`, `w_ud [f, 2d]`) and the residual add and RMS
/// norm after it, `(residual + mlp(x), rms_norm(residual + mlp(x)) · alpha)`, with the add
/// and norm folded into the MLP's last CUDA launch: what `twell_mlp` then `add_rms_norm`
/// give (up to the order of the f32 sums of the MLP output, and of the squares), one
/// launch and a pass over `[m, d]` fewer per layer. One token runs as one launch; there,
/// with `pre_norm = Some((pre_alpha, pre_eps))`, the norm before the MLP is folded in
/// too: `x` is then the previous sublayer's output `y`, `h = residual + y`, and the
/// result is `(h + mlp(rms_norm(h) · pre_alpha), its norm)`, what `add_rms_norm`,
/// `twell_mlp` and `add_rms_norm` give. Inference only (no backward); the cases of
/// [`add_norm_fuses`], else an error.
pub fn twell_mlp_add_norm(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
    (residual, alpha, eps): (&Tensor, &Tensor, f64),
    pre_norm: Option<(&Tensor, f64)>,
) -> Result<(Tensor, Tensor)> {
    let (m, d) = matrix_dims("x", x)?;
    let (f, dg) = matrix_dims("gate_proj", gate_proj)?;
    let (f2, dw) = matrix_dims("w_ud", w_ud)?;
    if (pre_norm.is_some() && m != 1)
        || dg != d
        || f2 != f
        || dw != 2 * d
        || residual.dims() != [m, d]
        || alpha.dims() != [d]
        || pre_norm.is_some_and(|(a, _)| a.dims() != [d])
    {
        return shape_err(
            "twell_mlp_add_norm",
            format!(
                "want x [m, d] (m = 1 with a norm before the MLP), gate_proj [f, d], w_ud \
                 [f, 2d], residual [m, d] and alpha (and pre_alpha) [d], got {:?}, {:?}, \
                 {:?}, {:?}, {:?} and {:?}",
                x.dims(),
                gate_proj.dims(),
                w_ud.dims(),
                residual.dims(),
                alpha.dims(),
                pre_norm.map(|(a, _)| a.dims())
            ),
        );
    }
    let pre_alpha = pre_norm.map(|(a, _)| a);
    for t in [gate_proj, w_ud, residual, alpha]
        .into_iter()
        .chain(pre_alpha)
    {
        same_dtype_and_device("twell_mlp_add_norm", x, t)?;
    }
    check_size("twell_mlp_add_norm", m, f, config)?;
    if !add_norm_fuses(x, f, config) {
        return err(TwellError::Invalid(format!(
            "twell_mlp_add_norm runs on CUDA in bf16, for one token of a hidden size the \
             one-launch decode kernel takes, a few rows the few-row kernel takes, or for \
             prefill rows; got {:?} {:?} with {m} \
             rows of hidden {d} (elsewhere: twell_mlp, then add_rms_norm)",
            x.device().location(),
            x.dtype()
        )));
    }
    #[cfg(feature = "cuda")]
    {
        let inputs: Vec<&Tensor> = [x, gate_proj, w_ud, residual, alpha]
            .into_iter()
            .chain(pre_alpha)
            .collect();
        sums_and_norms_on_cuda("twell_mlp_add_norm", &inputs, (m, d), |c| {
            let pre = pre_norm.map(|(_, pre_eps)| (c[5], pre_eps as f32));
            cuda::twell_mlp_add_norm(c[0], c[1], c[2], c[3], c[4], config, eps as f32, pre)
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = eps;
        unreachable!("add_norm_fuses is false without the cuda feature")
    }
}

/// Whether [`twell_mlp_norm_add_norm`] runs for the residual sums `s` through `ffn`
/// neurons: CUDA, bf16, and rows the row kernels take (the one-launch decode kernels fold
/// the norm before the MLP at run time, for one row only).
pub fn norm_add_norm_runs(s: &Tensor, ffn: usize, config: TwellConfig) -> bool {
    cuda_bf16_rows(s).is_some_and(|(m, d)| {
        #[cfg(feature = "cuda")]
        return cuda::norm_add_norm_folds(m, d, ffn, config);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (m, d, ffn, config);
            false
        }
    })
}

/// The MLP sublayer from the residual sum `s [m, d]`, the norms on both sides folded in:
/// `(s + mlp(rms_norm(s)), rms_norm(s + mlp(rms_norm(s))) · alpha)`, where the norm before
/// the MLP has a weight of one because its weight was folded into `gate_proj` and
/// `w_ud`'s up half ([`crate::SparseMlp::fold_pre_norm`]). Its factor is positive, so it
/// leaves the ReLU mask as it is and scales each kept gate value: the gate GEMM reads `s`
/// itself and no normalised copy of `s` is written. What `rms_norm` (unit weight),
/// `twell_mlp` and `add_rms_norm` give up to bf16 rounding (the gate is rounded before
/// it is scaled). Inference only (no backward); the cases of [`norm_add_norm_runs`],
/// else an error.
pub fn twell_mlp_norm_add_norm(
    s: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
    pre_eps: f64,
    (alpha, eps): (&Tensor, f64),
) -> Result<(Tensor, Tensor)> {
    let (m, d) = matrix_dims("s", s)?;
    let (f, dg) = matrix_dims("gate_proj", gate_proj)?;
    let (f2, dw) = matrix_dims("w_ud", w_ud)?;
    if dg != d || f2 != f || dw != 2 * d || alpha.dims() != [d] {
        return shape_err(
            "twell_mlp_norm_add_norm",
            format!(
                "want s [m, d], gate_proj [f, d], w_ud [f, 2d] and alpha [d], got {:?}, \
                 {:?}, {:?} and {:?}",
                s.dims(),
                gate_proj.dims(),
                w_ud.dims(),
                alpha.dims()
            ),
        );
    }
    for t in [gate_proj, w_ud, alpha] {
        same_dtype_and_device("twell_mlp_norm_add_norm", s, t)?;
    }
    check_size("twell_mlp_norm_add_norm", m, f, config)?;
    if !norm_add_norm_runs(s, f, config) {
        return err(TwellError::Invalid(format!(
            "twell_mlp_norm_add_norm runs on CUDA in bf16 for the rows the row kernels take \
             (hidden up to 4096); got {:?} {:?} with {m} rows of hidden {d} (elsewhere: \
             rms_norm, twell_mlp, then add_rms_norm)",
            s.device().location(),
            s.dtype()
        )));
    }
    #[cfg(feature = "cuda")]
    {
        sums_and_norms_on_cuda(
            "twell_mlp_norm_add_norm",
            &[s, gate_proj, w_ud, alpha],
            (m, d),
            |c| {
                cuda::twell_mlp_norm_add_norm(
                    c[0],
                    c[1],
                    c[2],
                    c[3],
                    config,
                    pre_eps as f32,
                    eps as f32,
                )
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (pre_eps, eps);
        unreachable!("norm_add_norm_runs is false without the cuda feature")
    }
}

/// Runs `launch` on the CUDA storages of `inputs` (made contiguous) and splits the `[2m,
/// d]` it returns into the sums and their normalised rows, as the add + norm folds give
/// them.
#[cfg(feature = "cuda")]
fn sums_and_norms_on_cuda(
    what: &str,
    inputs: &[&Tensor],
    (m, d): (usize, usize),
    launch: impl FnOnce(&[(&candle_core::CudaStorage, &Layout)]) -> Result<candle_core::CudaStorage>,
) -> Result<(Tensor, Tensor)> {
    use candle_core::{op::BackpropOp, Storage};
    let ts = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let parts: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut cuda = Vec::with_capacity(parts.len());
    for (storage, layout) in &parts {
        match &**storage {
            Storage::Cuda(s) => cuda.push((s, *layout)),
            _ => {
                return Err(candle_core::Error::Msg(format!(
                    "{what}: every input must be on the CUDA device"
                )))
            }
        }
    }
    let both = launch(&cuda)?;
    let both = Tensor::from_storage(Storage::Cuda(both), (2 * m, d), BackpropOp::none(), false);
    Ok((both.narrow(0, 0, m)?, both.narrow(0, m, m)?))
}

/// Builds the int8 screen of a host `gate_proj [f, d]` for [`twell_mlp_screened`].
pub fn gate_screen(gate_proj: &Tensor) -> Result<GateScreen> {
    let (f, d) = matrix_dims("gate_proj", gate_proj)?;
    let host_gate = host(&gate_proj.contiguous()?)?;
    with_rows("gate_proj", &host_gate, |wg| Ok(GateScreen::new(wg, f, d)))
}

fn run(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
    screen: Option<Arc<GateScreen>>,
    backward_path: BackwardPath,
) -> Result<MlpOutput> {
    let (m, d, f) = mlp_dims("twell_mlp", x, gate_proj, w_ud, config)?;
    let saved = Arc::new(Mutex::new(None));
    let op = TwellMlp {
        config,
        screen,
        keep_for_backward: x.track_op() || gate_proj.track_op() || w_ud.track_op(),
        backward_path,
        saved: saved.clone(),
    };
    let (x, gate_proj, w_ud) = (x.contiguous()?, gate_proj.contiguous()?, w_ud.contiguous()?);
    // A pass that may be differentiated gives its output rows and L1 terms as two
    // nodes (see `TwellMlpL1`); inference takes views of the flat result.
    let (out, l1) = if op.keep_for_backward {
        let handoff = Arc::new(Mutex::new(Handoff::default()));
        let l1 = x.apply_op3(
            &gate_proj,
            &w_ud,
            TwellMlpL1 {
                inner: op,
                handoff: handoff.clone(),
            },
        )?;
        (l1.apply_op1(OutRows { handoff, d })?, l1)
    } else {
        MlpOutput::views(&x.apply_op3(&gate_proj, &w_ud, op)?, m, d)?
    };
    let kept = saved.lock().expect("saved lock").clone();
    let activity = match kept {
        Some(Saved::Host { pattern, gate }) => Activity::Host {
            pattern,
            gate: Some(gate),
        },
        Some(Saved::Device { counts, .. }) => Activity::Device { counts },
        None => candle_core::bail!("twell-mlp: forward produced no pattern"),
    };
    MlpOutput::new(out, l1, activity, config, f)
}

/// `(M, d, f)` of an MLP op's inputs `x [M, d]`, `gate_proj [f, d]` and `w_ud [f, 2d]`,
/// checked: matching shapes, one dtype and device, and a size TwELL can index.
pub(crate) fn mlp_dims(
    what: &'static str,
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    config: TwellConfig,
) -> Result<(usize, usize, usize)> {
    let (m, d) = matrix_dims("x", x)?;
    let (f, dg) = matrix_dims("gate_proj", gate_proj)?;
    let (f2, dw) = matrix_dims("w_ud", w_ud)?;
    if dg != d || f2 != f || dw != 2 * d {
        return shape_err(
            what,
            format!(
                "x is [{m}, {d}]: want gate_proj [f, {d}] and w_ud [f, {}], got [{f}, {dg}] and [{f2}, {dw}]",
                2 * d
            ),
        );
    }
    same_dtype_and_device(what, x, gate_proj)?;
    same_dtype_and_device(what, x, w_ud)?;
    check_size(what, m, f, config)?;
    Ok((m, d, f))
}

/// What the two nodes of a differentiable MLP pass hand each other: the forward's
/// output rows (for [`OutRows`] to return), and `d(loss)/d(out)` (for the backward of
/// [`TwellMlpL1`]).
#[derive(Default)]
struct Handoff {
    rows: Option<candle_core::Storage>,
    dout: Option<Tensor>,
}

/// [`TwellMlp`] as the node of the L1 terms `[M]`: its forward runs the whole MLP and
/// hands the `[M, d]` output rows to [`OutRows`], the node after it. candle's backward
/// reaches `OutRows` first (it depends on this node), which hands `d(loss)/d(out)` back.
/// One flat result split by two `narrow`s cost the backward a zeros tensor, a padded
/// copy and an add over the whole result for each half.
struct TwellMlpL1 {
    inner: TwellMlp,
    handoff: Arc<Mutex<Handoff>>,
}

impl TwellMlpL1 {
    fn hand_over(&self, rows: candle_core::Storage) {
        self.handoff.lock().expect("handoff lock").rows = Some(rows);
    }
}

/// The `m` values of a flat CPU result from `start` on.
fn cpu_tail(flat: &CpuStorage, start: usize, m: usize) -> Result<CpuStorage> {
    Ok(match flat {
        CpuStorage::F32(v) => CpuStorage::F32(v[start..start + m].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[start..start + m].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[start..start + m].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[start..start + m].to_vec()),
        _ => candle_core::bail!("twell-mlp: a float result was expected"),
    })
}

impl CustomOp3 for TwellMlpL1 {
    fn name(&self) -> &'static str {
        "twell-mlp-l1"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, d) = contiguous_2d("x", xl)?;
        let (flat, _) = self.inner.cpu_fwd(xs, xl, gs, gl, ws, wl)?;
        let l1 = cpu_tail(&flat, m * d, m)?;
        self.hand_over(candle_core::Storage::Cpu(flat));
        Ok((l1, Shape::from(m)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::WrapErr;
        let (m, d) = contiguous_2d("x", xl)?;
        let (flat, _) = self.inner.cuda_fwd(xs, xl, gs, gl, ws, wl)?;
        let dev = flat.device.clone();
        let tail = flat.as_cuda_slice::<half::bf16>()?.slice(m * d..m * d + m);
        let l1 = dev.cuda_stream().clone_dtod(&tail).w()?;
        self.hand_over(candle_core::Storage::Cuda(flat));
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(l1, dev),
            Shape::from(m),
        ))
    }

    /// The MLP's backward with `d(loss)/d(out)` from [`OutRows`] (zeros when the loss
    /// does not use the output rows) and `grad` as the L1 terms' gradient.
    fn bwd(
        &self,
        x: &Tensor,
        gate_proj: &Tensor,
        w_ud: &Tensor,
        l1: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dout = self.handoff.lock().expect("handoff lock").dout.take();
        let dout = match dout {
            Some(g) => g.contiguous()?.flatten_all()?,
            None => Tensor::zeros(x.elem_count(), l1.dtype(), l1.device())?,
        };
        let flat = Tensor::cat(&[&dout, &grad.to_dtype(dout.dtype())?.flatten_all()?], 0)?;
        self.inner.bwd(x, gate_proj, w_ud, l1, &flat)
    }
}

/// The `[M, d]` output rows of a [`TwellMlpL1`] pass, as the node after it: the forward
/// returns the rows that pass handed over; the backward hands `d(loss)/d(out)` back and
/// gives the L1 node a zero gradient of `M` values (so its backward always runs).
struct OutRows {
    handoff: Arc<Mutex<Handoff>>,
    d: usize,
}

impl OutRows {
    fn take_rows(&self) -> Result<candle_core::Storage> {
        match self.handoff.lock().expect("handoff lock").rows.take() {
            Some(rows) => Ok(rows),
            None => candle_core::bail!("twell-mlp: no output rows to hand over"),
        }
    }
}

impl candle_core::CustomOp1 for OutRows {
    fn name(&self) -> &'static str {
        "twell-mlp-out-rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match self.take_rows()? {
            candle_core::Storage::Cpu(rows) => Ok((rows, Shape::from((l.dims()[0], self.d)))),
            _ => candle_core::bail!("twell-mlp: output rows on another device"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.take_rows()? {
            candle_core::Storage::Cuda(rows) => Ok((rows, Shape::from((l.dims()[0], self.d)))),
            _ => candle_core::bail!("twell-mlp: output rows on another device"),
        }
    }

    fn bwd(&self, l1: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.handoff.lock().expect("handoff lock").dout = Some(grad.clone());
        Ok(Some(l1.zeros_like()?))
    }
}

#[cfg(test)]
mod tests {
    use super::{row_or_slot_kernels, staged_rows_for, BackwardPath};
    use crate::format::StagedRows;

    /// The spread kernels in every cell of their measurement (H100 decode steps) but 64
    /// rows of 4096 × 14336, where the row kernels won; past hidden 4096, or with a d_ff
    /// that is not a multiple of 8, the rule between the row and slot kernels.
    #[test]
    fn staged_rows_take_the_spread_kernels_where_they_won() {
        let rule = |m, d, f, density| staged_rows_for(m, d, f, 256, density);
        for (d, f) in [(576, 1536), (1536, 8960), (2048, 8192), (4096, 14336)] {
            for m in [2, 4, 8, 16, 32, 64] {
                for density in [0.005, 0.03] {
                    let want = if d == 4096 && m == 64 {
                        StagedRows::RowKernels
                    } else {
                        StagedRows::SpreadKernels
                    };
                    assert_eq!(rule(m, d, f, density), want, "{m} rows of {d}x{f}");
                }
            }
        }
        assert_eq!(rule(64, 2048, 5632, 0.005), StagedRows::SpreadKernels);
        assert_eq!(
            rule(16, 5120, 13824, 0.005),
            row_or_slot_kernels(16, 5120, 13824, 256, 0.005)
        );
        assert_eq!(rule(16, 2048, 5636, 0.03), StagedRows::SlotKernels);
    }

    /// The rule between the row and slot kernels against cells of its measurement (H100
    /// decode steps): the row kernels at many rows of wide shapes at low density, the slot
    /// kernels at few rows or high density, and more rows or a lower density never turn it
    /// back to the slots.
    #[test]
    fn row_or_slot_kernels_follow_rows_width_and_density() {
        let (rows, slots) = (StagedRows::RowKernels, StagedRows::SlotKernels);
        let rule = |m, d, f, density| row_or_slot_kernels(m, d, f, 256, density);
        assert_eq!(rule(64, 2048, 8192, 0.005), rows);
        assert_eq!(rule(16, 1536, 8960, 0.005), rows);
        assert_eq!(rule(64, 4096, 14336, 0.03), rows);
        assert_eq!(rule(16, 896, 4864, 0.005), slots);
        assert_eq!(rule(16, 896, 4864, 0.03), slots);
        assert_eq!(rule(32, 576, 1536, 0.03), slots);
        assert_eq!(rule(8, 2048, 8192, 0.03), slots);
        assert_eq!(rule(8, 4096, 14336, 0.005), slots);
        for (d, f) in [(576, 1536), (896, 4864), (2048, 5632), (4096, 14336)] {
            for density in [0.001, 0.005, 0.01, 0.03, 0.1, 0.5] {
                let mut seen_rows = false;
                for m in 2..=64 {
                    let kernels = rule(m, d, f, density);
                    assert!(
                        !(seen_rows && kernels == slots),
                        "{m} rows of {d}x{f} at {density}"
                    );
                    seen_rows |= kernels == rows;
                    if density < 0.5 && kernels == rows {
                        assert_eq!(rule(m, d, f, density / 2.0), rows, "{m} rows of {d}x{f}");
                    }
                }
            }
        }
        // No neurons fire: the rule still answers.
        assert_eq!(rule(64, 2048, 5632, 0.0), rows);
    }

    /// Below the break-even (or unmeasured) the pairs are cheaper than three GEMMs.
    #[test]
    fn backward_path_follows_the_measured_density() {
        let path = BackwardPath::for_density;
        assert_eq!(path(None), BackwardPath::Sparse);
        assert_eq!(path(Some(0.005)), BackwardPath::Sparse);
        assert_eq!(path(Some(0.01)), BackwardPath::DenseDx);
        assert_eq!(path(Some(0.03)), BackwardPath::Dense);
    }
}
