//! AdamW with decoupled weight decay, global-norm gradient clipping, and a state that
//! can be saved and restored (candle-nn's AdamW keeps its moments private, and a
//! resumed fine-tune must continue with them).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor, Var};
use fused_ops::AdamwStep;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The weight decay of parameter `name`: none for biases, whose decay would pull the
/// MLP's gate thresholds back to zero, against the sparsity they are there for, nor for
/// LoRA's row scales, which start at 1 and would be pulled towards 0.
fn decay_for(name: &str, weight_decay: f64) -> f64 {
    if name.ends_with(".bias") || name.ends_with(".row_scale") {
        0.0
    } else {
        weight_decay
    }
}

/// AdamW over named variables: f32 variables updated in place, or bf16 variables on
/// f32 master weights that the optimizer keeps (mixed precision).
pub struct AdamW {
    params: Vec<(String, Var)>,
    state: State,
    step: usize,
    cfg: AdamWConfig,
}

/// What the optimizer keeps per parameter.
enum State {
    /// The moments of f32 variables.
    F32 { m: Vec<Tensor>, v: Vec<Tensor> },
    /// Of bf16 variables: the f32 master and the moments as one `[3, n]` tensor (master,
    /// m, v), which one kernel pass updates.
    Mixed(Vec<Tensor>),
}

/// The rows of a mixed state, in order.
const MIXED_ROWS: [&str; 3] = ["master", "m", "v"];

impl AdamW {
    /// `params` (f32) sorted by name, so the state files are stable.
    pub fn new(mut params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, p)) = params.iter().find(|(_, p)| p.dtype() != DType::F32) {
            candle_core::bail!(
                "AdamW: '{name}' is {:?}; f32 variables, or AdamW::new_mixed for bf16 ones",
                p.dtype()
            );
        }
        let zeros = |params: &[(String, Var)]| {
            params
                .iter()
                .map(|(_, p)| p.zeros_like())
                .collect::<Result<Vec<_>>>()
        };
        Ok(Self {
            state: State::F32 {
                m: zeros(&params)?,
                v: zeros(&params)?,
            },
            params,
            step: 0,
            cfg,
        })
    }

    /// Mixed precision: `params` are bf16 variables, `masters` their full-precision
    /// values by name (any float dtype, kept as f32). The model computes on the bf16
    /// variables; each step updates the masters and writes them back rounded.
    pub fn new_mixed(
        mut params: Vec<(String, Var)>,
        masters: &HashMap<String, Tensor>,
        cfg: AdamWConfig,
    ) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let state = params
            .iter()
            .map(|(name, p)| {
                if p.dtype() != DType::BF16 {
                    candle_core::bail!("AdamW::new_mixed: '{name}' is {:?}, not bf16", p.dtype());
                }
                let Some(master) = masters.get(name) else {
                    candle_core::bail!("AdamW::new_mixed: no master weights for '{name}'");
                };
                if master.dims() != p.dims() {
                    candle_core::bail!(
                        "AdamW::new_mixed: master '{name}' is {:?}, the variable {:?}",
                        master.dims(),
                        p.dims()
                    );
                }
                let master = master
                    .to_dtype(DType::F32)?
                    .to_device(p.device())?
                    .flatten_all()?;
                let zeros = master.zeros_like()?;
                Tensor::stack(&[&master, &zeros, &zeros], 0)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            params,
            state: State::Mixed(state),
            step: 0,
            cfg,
        })
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// The f32 master weights by name (mixed precision), or `None` (f32 variables are
    /// their own masters).
    pub fn masters(&self) -> Result<Option<HashMap<String, Tensor>>> {
        let State::Mixed(state) = &self.state else {
            return Ok(None);
        };
        self.params
            .iter()
            .zip(state)
            .map(|((name, p), s)| Ok((name.clone(), s.get(0)?.reshape(p.dims())?)))
            .collect::<Result<HashMap<_, _>>>()
            .map(Some)
    }

    /// One update with `grads` (one per parameter, in `params()` order) at `lr`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.step_scaled(grads, lr, 1.0)
    }

    /// [`AdamW::step`] with every gradient multiplied by `grad_scale` first (the
    /// clipping factor of [`clip_scale`]), without writing the scaled gradients: each
    /// parameter's update is `fused_ops::adamw_step` (two passes, in place) or, mixed,
    /// `fused_ops::adamw_step_mixed` (one pass, then the bf16 write).
    pub fn step_scaled(&mut self, grads: &[Tensor], lr: f64, grad_scale: f64) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!(
                "AdamW: {} gradients for {} parameters",
                grads.len(),
                self.params.len()
            );
        }
        self.step += 1;
        let hp = AdamwStep {
            lr,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            step: self.step,
            grad_scale,
        };
        for (k, ((name, p), g)) in self.params.iter().zip(grads).enumerate() {
            let hp = AdamwStep {
                weight_decay: decay_for(name, hp.weight_decay),
                ..hp
            };
            match &self.state {
                State::F32 { m, v } => fused_ops::adamw_step(p.as_tensor(), g, &m[k], &v[k], hp)?,
                State::Mixed(state) => {
                    fused_ops::adamw_step_mixed(p.as_tensor(), g, &state[k], hp)?
                }
            }
        }
        Ok(())
    }

    /// Saves the state (safetensors: the moments, and mixed, the masters) beside a JSON
    /// with the step count.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut t = HashMap::new();
        for (k, (name, p)) in self.params.iter().enumerate() {
            let rows: Vec<(&str, Tensor)> = match &self.state {
                State::F32 { m, v } => vec![("m", m[k].clone()), ("v", v[k].clone())],
                State::Mixed(state) => MIXED_ROWS
                    .iter()
                    .enumerate()
                    .map(|(r, prefix)| Ok((*prefix, state[k].get(r)?.reshape(p.dims())?)))
                    .collect::<Result<_>>()?,
            };
            for (prefix, x) in rows {
                t.insert(format!("{prefix}.{name}"), x.to_device(&Device::Cpu)?);
            }
        }
        candle_core::safetensors::save(&t, dir.join("optimizer.safetensors"))?;
        let meta = serde_json::json!({ "step": self.step, "config": self.cfg });
        std::fs::write(dir.join("optimizer.json"), meta.to_string())?;
        Ok(())
    }

    /// Restores what [`AdamW::save`] wrote; every parameter must have its state. Mixed,
    /// the bf16 variables are set from the restored masters.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.load_with(dir, Ok)
    }

    /// [`AdamW::load`], with the saved state tensors (named `<row>.<parameter>`) passed
    /// through `convert` first: the trainer turns a checkpoint's parameter layout into
    /// its own there.
    pub fn load_with(
        &mut self,
        dir: &Path,
        convert: impl FnOnce(HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>>,
    ) -> Result<()> {
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("optimizer.json"))?)
                .map_err(|e| candle_core::Error::Msg(format!("optimizer.json: {e}")))?;
        self.step = meta["step"].as_u64().unwrap_or(0) as usize;
        let mut t = convert(candle_core::safetensors::load(
            dir.join("optimizer.safetensors"),
            &Device::Cpu,
        )?)?;
        let mut take = |prefix: &str, name: &str, p: &Var| -> Result<Tensor> {
            let key = format!("{prefix}.{name}");
            let Some(s) = t.remove(&key) else {
                candle_core::bail!("optimizer state has no '{key}'");
            };
            if s.dims() != p.dims() {
                candle_core::bail!(
                    "optimizer state '{key}' has shape {:?}, parameter has {:?}",
                    s.dims(),
                    p.dims()
                );
            }
            s.to_dtype(DType::F32)?.to_device(p.device())
        };
        for (k, (name, p)) in self.params.iter().enumerate() {
            match &mut self.state {
                State::F32 { m, v } => {
                    m[k] = take("m", name, p)?;
                    v[k] = take("v", name, p)?;
                }
                State::Mixed(state) => {
                    let rows = MIXED_ROWS
                        .iter()
                        .map(|prefix| take(prefix, name, p)?.flatten_all())
                        .collect::<Result<Vec<_>>>()?;
                    state[k] = Tensor::stack(&rows, 0)?;
                    p.set(&rows[0].reshape(p.dims())?.to_dtype(DType::BF16)?)?;
                }
            }
        }
        Ok(())
    }
}

/// The global L2 norm of `grads` (bf16 or f32).
pub fn grad_norm(grads: &[Tensor]) -> Result<f64> {
    // One read per gradient (`fused_ops::sum_squares`, where candle's ops would cast,
    // square and reduce in three passes), and one read-back for all of them: a
    // read-back per tensor stalls a GPU queue hundreds of times a step.
    let squares = grads
        .iter()
        .map(fused_ops::sum_squares)
        .collect::<Result<Vec<_>>>()?;
    if squares.is_empty() {
        return Ok(0.0);
    }
    Ok((Tensor::cat(&squares, 0)?.sum_all()?.to_scalar::<f32>()? as f64).sqrt())
}

/// The factor that brings gradients of global norm `norm` to at most `max_norm` (1 when
/// they are within it, or when `max_norm` is 0: no clipping).
pub fn clip_scale(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-12)
    } else {
        1.0
    }
}

/// Scales `grads` so their global L2 norm is at most `max_norm`; returns the norm
/// before clipping.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let norm = grad_norm(grads)?;
    let scale = clip_scale(norm, max_norm);
    if scale < 1.0 {
        for g in grads.iter_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}

/// Linear warm-up to `peak`, then cosine decay to `peak · min_ratio` at `total` steps.
pub fn lr_at(step: usize, total: usize, warmup: usize, peak: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    peak * (min_ratio + (1.0 - min_ratio) * cosine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        assert!((lr_at(0, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(10, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!(lr_at(55, 100, 10, 1.0, 0.1) < 0.6);
    }

    #[test]
    fn fused_step_matches_the_adamw_formula() {
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..Default::default()
        };
        let init = Tensor::new(&[[0.5f32, -1.0, 2.0], [0.0, 3.0, -0.25]], &Device::Cpu).unwrap();
        let p = Var::from_tensor(&init).unwrap();
        let mut opt = AdamW::new(vec![("p".into(), p.clone())], cfg.clone()).unwrap();
        let (mut want, mut m, mut v) = (
            init.clone(),
            init.zeros_like().unwrap(),
            init.zeros_like().unwrap(),
        );
        for step in 1..=4 {
            let g = Tensor::new(
                &[[0.3f32, -0.2, 0.1 * step as f32], [1.0, -2.0, 0.05]],
                &Device::Cpu,
            )
            .unwrap();
            let (lr, scale) = (0.01, 0.5);
            opt.step_scaled(std::slice::from_ref(&g), lr, scale)
                .unwrap();
            // The formula as candle ops.
            let gs = (&g * scale).unwrap();
            m = ((&m * cfg.beta1).unwrap() + (&gs * (1.0 - cfg.beta1)).unwrap()).unwrap();
            v = ((&v * cfg.beta2).unwrap() + (gs.sqr().unwrap() * (1.0 - cfg.beta2)).unwrap())
                .unwrap();
            let c1 = 1.0 - cfg.beta1.powi(step);
            let c2 = 1.0 - cfg.beta2.powi(step);
            let update = ((&m / c1).unwrap()
                / ((&v / c2).unwrap().sqrt().unwrap() + cfg.eps).unwrap())
            .unwrap();
            want = ((&want * (1.0 - lr * cfg.weight_decay)).unwrap() - (update * lr).unwrap())
                .unwrap();
            let diff = (p.as_tensor() - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-6, "step {step}");
        }
        // A gradient list of the wrong length is refused.
        assert!(opt.step(&[], 0.01).is_err());
    }

    /// With no gradient, a step is the decay alone: weights shrink, biases do not.
    #[test]
    fn biases_take_no_weight_decay() {
        let cfg = AdamWConfig {
            weight_decay: 0.5,
            ..Default::default()
        };
        let init = Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap();
        let (w, b) = (
            Var::from_tensor(&init).unwrap(),
            Var::from_tensor(&init).unwrap(),
        );
        let params = vec![
            ("mlp.gate_proj.weight".into(), w.clone()),
            ("mlp.gate_proj.bias".into(), b.clone()),
        ];
        let mut opt = AdamW::new(params, cfg).unwrap();
        let zero = init.zeros_like().unwrap();
        opt.step(&[zero.clone(), zero], 0.1).unwrap();
        let values = |v: &Var| v.as_tensor().to_vec1::<f32>().unwrap();
        assert_eq!(values(&w), [0.95, -1.9]);
        assert_eq!(values(&b), [1.0, -2.0]);
    }

    #[test]
    fn adamw_minimises_a_quadratic_and_clipping_bounds_the_norm() {
        let x = Var::from_tensor(&Tensor::new(&[3f32, -2.0], &Device::Cpu).unwrap()).unwrap();
        let mut opt = AdamW::new(vec![("x".into(), x.clone())], AdamWConfig::default()).unwrap();
        for _ in 0..300 {
            let loss = x.as_tensor().sqr().unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            let mut grads = vec![g.get(x.as_tensor()).unwrap().clone()];
            clip_grad_norm(&mut grads, 1.0).unwrap();
            let n = grads[0]
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt();
            assert!(n <= 1.0 + 1e-5);
            opt.step(&grads, 0.05).unwrap();
        }
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|a| a.abs() < 0.1), "{v:?}");
    }
}
