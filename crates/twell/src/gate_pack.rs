//! `gate_pack`: the gate GEMM, its ReLU, and packing into TwELL, as one op (D2T).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use fused_ops::checks::{contiguous_2d, matrix_dims, same_dtype_and_device, shape_err};
use fused_ops::host::{f32_vec, host, with_rows, Float, Rows};

use crate::cpu::screen::{GateScreen, SCREEN_MAX_ROWS};
use crate::cpu::{gate, t2d};
use crate::format::{check_size, Twell, TwellConfig, TwellPattern};
use crate::output::with_values;

/// The op behind [`gate_pack`]. Its output is the TwELL value array; the pattern it
/// found is kept here for the backward pass and handed to the caller.
pub struct GatePack {
    config: TwellConfig,
    pattern: Arc<Mutex<Option<Arc<TwellPattern>>>>,
}

impl GatePack {
    fn pattern(&self) -> Result<Arc<TwellPattern>> {
        match self.pattern.lock().expect("pattern lock").clone() {
            Some(p) => Ok(p),
            None => candle_core::bail!("twell-gate-pack: backward called before forward"),
        }
    }
}

/// Computes `g = x · Wgᵀ` in f32 and packs `relu(g)` with values in `T`. With a
/// screen of `wg` and few tokens, only the neurons the screen cannot rule out are
/// computed (the result is the same).
pub(crate) fn gate_and_pack<T: Float>(
    x: Rows<'_>,
    wg: Rows<'_>,
    (m, d, f): (usize, usize, usize),
    config: TwellConfig,
    screen: Option<&GateScreen>,
) -> (TwellPattern, Vec<T>) {
    let x32 = x.to_f32_vec();
    let mut builder = crate::format::PackBuilder::<T>::new(f, config);
    for start in (0..m).step_by(gate::GATE_BLOCK_ROWS) {
        let rows = (m - start).min(gate::GATE_BLOCK_ROWS);
        let xs = &x32[start * d..(start + rows) * d];
        let g = match screen {
            Some(s) if rows <= SCREEN_MAX_ROWS => s.gate(xs, rows, wg).0,
            _ => gate::gate_gemm(xs, rows, d, wg, f),
        };
        builder.push(&g, rows);
    }
    builder.finish()
}

impl CustomOp2 for GatePack {
    fn name(&self) -> &'static str {
        "twell-gate-pack"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, d) = contiguous_2d("x", xl)?;
        let (f, _) = contiguous_2d("gate_proj", wl)?;
        let x = Rows::new("x", xs, xl)?;
        let wg = Rows::new("gate_proj", ws, wl)?;
        let (pattern, storage) = match xs {
            CpuStorage::F32(_) => {
                let (p, v) = gate_and_pack::<f32>(x, wg, (m, d, f), self.config, None);
                (p, CpuStorage::F32(v))
            }
            CpuStorage::BF16(_) => {
                let (p, v) = gate_and_pack::<half::bf16>(x, wg, (m, d, f), self.config, None);
                (p, CpuStorage::BF16(v))
            }
            _ => {
                let (p, v) = gate_and_pack::<half::f16>(x, wg, (m, d, f), self.config, None);
                (p, CpuStorage::F16(v))
            }
        };
        let n = pattern.values_len();
        *self.pattern.lock().expect("pattern lock") = Some(Arc::new(pattern));
        Ok((storage, Shape::from(n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        wg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let pattern = self.pattern()?;
        let (m, d) = x.dims2()?;
        let f = wg.dim(0)?;
        let dvalues = f32_vec(grad_res)?;
        let (hx, hw, hv) = (host(x)?, host(wg)?, host(res)?);
        let (dx, dwg) = with_rows("x", &hx, |x| {
            with_rows("gate_proj", &hw, |wg| {
                let (s, l) = hv.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*s else {
                    candle_core::bail!("host copy is not on the host")
                };
                Ok(with_values!(cpu, l, |g| t2d::gate_backward(
                    &pattern, g, &dvalues, x, wg, d
                )))
            })
        })?;
        let dx = fused_ops::host::tensor_from_f32(dx, &[m, d], x.dtype(), x.device())?;
        let dwg = fused_ops::host::tensor_from_f32(dwg, &[f, d], wg.dtype(), wg.device())?;
        Ok((Some(dx), Some(dwg)))
    }
}

/// `relu(x · Wgᵀ)` as TwELL, for `x [M, d]` and `gate_proj [f, d]` (HF layout).
/// Differentiable with respect to `x` and `gate_proj`; the gradient flows only
/// through the active entries (the ReLU mask).
pub fn gate_pack(x: &Tensor, gate_proj: &Tensor, config: TwellConfig) -> Result<Twell> {
    let (m, d) = matrix_dims("x", x)?;
    let (f, d2) = matrix_dims("gate_proj", gate_proj)?;
    if d2 != d {
        return shape_err(
            "gate_pack",
            format!("x is [{m}, {d}] but gate_proj is [{f}, {d2}] (want [f, {d}])"),
        );
    }
    same_dtype_and_device("gate_pack", x, gate_proj)?;
    check_size("gate_pack", m, f, config)?;
    let cell = Arc::new(Mutex::new(None));
    let op = GatePack {
        config,
        pattern: cell.clone(),
    };
    let values = x.contiguous()?.apply_op2(&gate_proj.contiguous()?, op)?;
    let pattern = cell.lock().expect("pattern lock").clone();
    match pattern {
        Some(p) => Ok(Twell::from_parts(p, values)),
        None => candle_core::bail!("twell-gate-pack: forward produced no pattern"),
    }
}
