//! `gated_t2d`: the sparse up and down projections of a packed gate (gated T2D).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use fused_ops::checks::{contiguous_2d, matrix_dims, same_dtype_and_device, shape_err};
use fused_ops::host::{f32_vec, host, with_rows, Rows};

use crate::cpu::t2d::{self, GateGrad};
use crate::format::{Twell, TwellPattern};
use crate::output::{cpu_storage, mlp_result_len, with_values, Activity, MlpOutput};

/// The op behind [`gated_t2d`]: inputs `(gate values, x, w_ud)`, output
/// `[mlp_result_len(M, d)]`.
pub struct GatedT2d {
    pattern: Arc<TwellPattern>,
}

impl CustomOp3 for GatedT2d {
    fn name(&self) -> &'static str {
        "twell-gated-t2d"
    }

    fn cpu_fwd(
        &self,
        vs: &CpuStorage,
        vl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, d) = contiguous_2d("x", xl)?;
        contiguous_2d("w_ud", wl)?;
        let x = Rows::new("x", xs, xl)?;
        let w_ud = Rows::new("w_ud", ws, wl)?;
        let out = with_values!(vs, vl, |g| t2d::forward(&self.pattern, g, x, w_ud, d));
        Ok((
            cpu_storage(out, x.dtype())?,
            Shape::from(mlp_result_len(m, d)),
        ))
    }

    fn bwd(
        &self,
        values: &Tensor,
        x: &Tensor,
        w_ud: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (m, d) = x.dims2()?;
        let f = w_ud.dim(0)?;
        let dout = f32_vec(grad_res)?;
        let (hv, hx, hw) = (host(values)?, host(x)?, host(w_ud)?);
        let grads = with_rows("x", &hx, |x| {
            with_rows("w_ud", &hw, |w| {
                let (s, l) = hv.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*s else {
                    candle_core::bail!("host copy is not on the host")
                };
                Ok(with_values!(cpu, l, |g| t2d::backward(
                    &self.pattern,
                    g,
                    x,
                    w,
                    GateGrad::Values,
                    &dout,
                    d
                )))
            })
        })?;
        let n = values.elem_count();
        let dvalues =
            fused_ops::host::tensor_from_f32(grads.dgate, &[n], values.dtype(), values.device())?;
        let dx = fused_ops::host::tensor_from_f32(grads.dx, &[m, d], x.dtype(), x.device())?;
        let dw = fused_ops::host::tensor_from_f32(
            grads.dw_ud,
            &[f, 2 * d],
            w_ud.dtype(),
            w_ud.device(),
        )?;
        Ok((Some(dvalues), Some(dx), Some(dw)))
    }
}

/// The MLP output for a packed gate: `h_j = g_j · (x · Wu_j)` for the active neurons
/// only, then `out = Σ_j h_j · Wd_j`, plus each token's `Σ_j |h_j|`.
/// `w_ud [f, 2d]` is [`super::up_down_matrix`]. Differentiable with respect to the
/// gate values, `x` and `w_ud`.
pub fn gated_t2d(gate: &Twell, x: &Tensor, w_ud: &Tensor) -> Result<MlpOutput> {
    let (m, d) = matrix_dims("x", x)?;
    let (f, d2) = matrix_dims("w_ud", w_ud)?;
    if d2 != 2 * d {
        return shape_err(
            "gated_t2d",
            format!(
                "x is [{m}, {d}] so w_ud must be [f, {}], got [{f}, {d2}]",
                2 * d
            ),
        );
    }
    if gate.rows() != m || gate.cols() != f {
        return shape_err(
            "gated_t2d",
            format!(
                "gate is {} x {} but x has {m} rows and w_ud {f} neurons",
                gate.rows(),
                gate.cols()
            ),
        );
    }
    same_dtype_and_device("gated_t2d", x, w_ud)?;
    same_dtype_and_device("gated_t2d", x, gate.values())?;
    let pattern = gate.pattern().clone();
    let op = GatedT2d {
        pattern: pattern.clone(),
    };
    let joined =
        gate.values()
            .contiguous()?
            .apply_op3(&x.contiguous()?, &w_ud.contiguous()?, op)?;
    MlpOutput::split(
        joined,
        (m, d),
        Activity::Host {
            pattern,
            gate: None,
        },
        gate.config(),
        f,
    )
}
