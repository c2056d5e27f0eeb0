//! `twell_mlp`: the whole ReGLU MLP through TwELL in one op.
//!
//! `out = Σ_j relu(x · Wg_j) · (x · Wu_j) · Wd_j` over the active neurons only, with
//! each token's L1 term. The pattern and gate values found in the forward pass are
//! kept for the backward pass, so the gate GEMM runs once per training step.

use super::{mlp_result_len, Activity};
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::gate_pack::gate_and_pack;
use super::{
    contiguous_2d, cpu_storage, f32_vec, host, matrix_dims, same_dtype_and_device, shape_err,
    with_rows, MlpOutput,
};
use crate::cpu::float::Rows;
use crate::cpu::screen::GateScreen;
use crate::cpu::t2d::{self, GateGrad};
use crate::format::{check_size, TwellConfig, TwellPattern};

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
        backward: Option<Arc<crate::cuda::BackwardState>>,
    },
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
        let keep = self.keep_for_backward && crate::cuda::backward_supported(xl.dims()[1]);
        let (storage, shape, activity) =
            crate::cuda::twell_mlp_forward(xs, xl, gs, gl, ws, wl, self.config, keep)?;
        let (m, n_tiles) = (xl.dims()[0], self.config.n_tiles(gl.dims()[0]));
        let dev = xs.device.clone();
        let counts = Tensor::from_storage(
            candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(
                activity.counts,
                dev,
            )),
            (m, n_tiles),
            candle_core::op::BackpropOp::none(),
            false,
        );
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
        let trace = Trace::begin("backward", x.device())?;
        let grads = self.backward(x, gate_proj, w_ud, grad_res)?;
        if let Some(t) = trace {
            t.end(x.device())?;
        }
        Ok(grads)
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
            return device_backward(x, gate_proj, w_ud, grad_res, &counts, &state, self.config);
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
        let dx = super::tensor_from_f32(grads.dx, &[m, d], x.dtype(), x.device())?;
        let dwg =
            super::tensor_from_f32(grads.dgate, &[f, d], gate_proj.dtype(), gate_proj.device())?;
        let dw = super::tensor_from_f32(grads.dw_ud, &[f, 2 * d], w_ud.dtype(), w_ud.device())?;
        Ok((Some(dx), Some(dwg), Some(dw)))
    }
}

/// With `TWELL_TRACE` set, prints for each forward and backward how long it took to run
/// (host) or issue (device) and how long since the previous traced call ended: where a
/// whole model's step spends its time between the MLPs. With `TWELL_TRACE=sync` the
/// device is synchronised around each call, so the times are the device's as well.
struct Trace {
    what: &'static str,
    start: std::time::Instant,
}

fn trace_mode() -> Option<bool> {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| std::env::var("TWELL_TRACE").ok().map(|v| v == "sync"))
}

impl Trace {
    fn begin(what: &'static str, device: &candle_core::Device) -> Result<Option<Self>> {
        match trace_mode() {
            None => Ok(None),
            Some(sync) => {
                if sync {
                    device.synchronize()?;
                }
                Ok(Some(Self {
                    what,
                    start: std::time::Instant::now(),
                }))
            }
        }
    }

    fn end(self, device: &candle_core::Device) -> Result<()> {
        static LAST_END: Mutex<Option<std::time::Instant>> = Mutex::new(None);
        if trace_mode() == Some(true) {
            device.synchronize()?;
        }
        let mut last = LAST_END.lock().expect("trace lock");
        let gap = last.map_or(f64::NAN, |l| {
            self.start.duration_since(l).as_secs_f64() * 1e3
        });
        eprintln!(
            "twell-mlp {}: {:.3} ms, {gap:.3} ms after the previous call",
            self.what,
            self.start.elapsed().as_secs_f64() * 1e3
        );
        *last = Some(std::time::Instant::now());
        Ok(())
    }
}

/// The backward pass on the GPU, from what the device forward kept.
#[cfg(feature = "cuda")]
fn device_backward(
    x: &Tensor,
    gate_proj: &Tensor,
    w_ud: &Tensor,
    grad_res: &Tensor,
    counts: &Tensor,
    state: &crate::cuda::BackwardState,
    config: TwellConfig,
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
    let (dx, dwg, dw_ud) =
        crate::cuda::twell_mlp_backward(xs, xl, rs, rl, gs, gl, ws, wl, cs, cl, state, config)?;
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
    run(x, gate_proj, w_ud, config, None)
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
    run(x, gate_proj, w_ud, config, Some(screen))
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
) -> Result<MlpOutput> {
    let (m, d) = matrix_dims("x", x)?;
    let (f, dg) = matrix_dims("gate_proj", gate_proj)?;
    let (f2, dw) = matrix_dims("w_ud", w_ud)?;
    if dg != d || f2 != f || dw != 2 * d {
        return shape_err(
            "twell_mlp",
            format!(
                "x is [{m}, {d}]: want gate_proj [f, {d}] and w_ud [f, {}], got [{f}, {dg}] and [{f2}, {dw}]",
                2 * d
            ),
        );
    }
    same_dtype_and_device("twell_mlp", x, gate_proj)?;
    same_dtype_and_device("twell_mlp", x, w_ud)?;
    check_size("twell_mlp", m, f, config)?;
    let saved = Arc::new(Mutex::new(None));
    let op = TwellMlp {
        config,
        screen,
        keep_for_backward: x.track_op() || gate_proj.track_op() || w_ud.track_op(),
        saved: saved.clone(),
    };
    let trace = Trace::begin("forward", x.device())?;
    let joined = x
        .contiguous()?
        .apply_op3(&gate_proj.contiguous()?, &w_ud.contiguous()?, op)?;
    if let Some(t) = trace {
        t.end(x.device())?;
    }
    let kept = saved.lock().expect("saved lock").clone();
    let activity = match kept {
        Some(Saved::Host { pattern, gate }) => Activity::Host {
            pattern,
            gate: Some(gate),
        },
        Some(Saved::Device { counts, .. }) => Activity::Device { counts },
        None => candle_core::bail!("twell-mlp: forward produced no pattern"),
    };
    MlpOutput::split(joined, (m, d), activity, config, f)
}
