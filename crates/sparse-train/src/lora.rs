//! Training low-rank adapters (LoRA) instead of every weight.
//!
//! The base weights stay frozen; each adapted projection `W` becomes
//! `m ⊙ (W + (alpha / r)·B·A)` with `A [r, in]`, `B [out, r]` and a scale per output row
//! `m [out]` the only trained tensors (`B` starts at zero and `m` at one, so step 0 is the
//! base model). The row scales matter for a ReLU conversion: a neuron's ReLU output is up
//! to twice its SiLU output, a per-neuron factor that a low-rank term cannot express. What a run produces is then a few MB of factors that
//! merge into the base ([`sparse_llama::adapter`]), small enough to ship in a
//! repository, where a full fine-tune is a second copy of the model.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sparse_llama::adapter::LoraFactor;

/// The projections of a Llama block an adapter can target (HF module names).
pub const LORA_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Which weights are adapted, and at what rank.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    /// The factor on `B·A` is `alpha / rank`.
    pub alpha: f64,
    /// Short module names, a subset of [`LORA_MODULES`].
    pub targets: Vec<String>,
    /// Train a scale per output row of each adapted weight too.
    #[serde(default)]
    pub row_scale: bool,
    /// Modules trained fully instead (short names, none of them in `targets`): for the
    /// weights a low rank cannot fix, such as the MLP gate of a ReLU conversion.
    #[serde(default)]
    pub full: Vec<String>,
}

impl LoraSpec {
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            candle_core::bail!("invalid training setting: the LoRA rank must be at least 1");
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            candle_core::bail!("invalid training setting: LoRA alpha must be a positive number");
        }
        if self.targets.is_empty() && self.full.is_empty() {
            candle_core::bail!("invalid training setting: LoRA needs at least one target module");
        }
        if let Some(t) = self.full.iter().find(|t| self.targets.contains(t)) {
            candle_core::bail!(
                "invalid training setting: '{t}' is both a LoRA target and trained fully"
            );
        }
        if let Some(t) = self
            .targets
            .iter()
            .chain(&self.full)
            .find(|t| !LORA_MODULES.contains(&t.as_str()))
        {
            candle_core::bail!(
                "invalid training setting: LoRA target '{t}' is not one of {}",
                LORA_MODULES.join(", ")
            );
        }
        Ok(())
    }

    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the HF weight `name` (e.g. `model.layers.3.mlp.up_proj.weight`) is a
    /// projection of one of `modules`.
    fn matches(name: &str, modules: &[String]) -> bool {
        let Some(module) = name.strip_suffix(".weight") else {
            return false;
        };
        name.starts_with("model.layers.")
            && modules
                .iter()
                .any(|t| module.rsplit('.').next() == Some(t.as_str()))
    }
}

/// The frozen base and the names of the adapted weights; the factors themselves are the
/// trainer's variables, `<weight>.lora_A` and `<weight>.lora_B`.
pub(crate) struct LoraState {
    pub spec: LoraSpec,
    /// f32, on the training device.
    base: HashMap<String, Tensor>,
    /// The base in the compute dtype (the same tensors when that is f32).
    base_compute: HashMap<String, Tensor>,
    /// Adapted weight names, sorted.
    pub adapted: Vec<String>,
    /// Weights trained fully (variables under their own names), sorted.
    pub full: Vec<String>,
}

pub(crate) fn a_name(weight: &str) -> String {
    format!("{weight}.lora_A")
}

pub(crate) fn b_name(weight: &str) -> String {
    format!("{weight}.lora_B")
}

pub(crate) fn scale_name(weight: &str) -> String {
    format!("{weight}.row_scale")
}

impl LoraState {
    /// Splits `weights` (f32, on the device) into the frozen base and fresh factors:
    /// `A` uniform in ±1/√in (as PEFT's default init), `B` zero. Returns the state and
    /// the factors' initial values (f32), keyed by variable name.
    pub fn new(
        spec: LoraSpec,
        weights: HashMap<String, Tensor>,
        dtype: DType,
        seed: u64,
    ) -> Result<(Self, HashMap<String, Tensor>)> {
        spec.validate()?;
        let select = |modules: &[String]| {
            let mut names: Vec<String> = weights
                .keys()
                .filter(|n| LoraSpec::matches(n, modules))
                .cloned()
                .collect();
            names.sort();
            names
        };
        let (adapted, full) = (select(&spec.targets), select(&spec.full));
        if adapted.is_empty() && full.is_empty() {
            candle_core::bail!(
                "no weight of the model matches the LoRA targets {:?}",
                spec.targets
            );
        }
        let mut rng = StdRng::seed_from_u64(seed ^ 0x4c6f_5241);
        let mut factors = HashMap::new();
        for name in &adapted {
            let w = &weights[name];
            let (out, inp) = w.dims2()?;
            let bound = 1.0 / (inp as f32).sqrt();
            let a: Vec<f32> = (0..spec.rank * inp)
                .map(|_| rng.random_range(-bound..bound))
                .collect();
            factors.insert(
                a_name(name),
                Tensor::from_vec(a, (spec.rank, inp), w.device())?,
            );
            factors.insert(
                b_name(name),
                Tensor::zeros((out, spec.rank), DType::F32, w.device())?,
            );
            if spec.row_scale {
                factors.insert(scale_name(name), Tensor::ones(out, DType::F32, w.device())?);
            }
        }
        for name in &full {
            factors.insert(name.clone(), weights[name].clone());
        }
        let base_compute = weights
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?)))
            .collect::<Result<_>>()?;
        Ok((
            Self {
                spec,
                base: weights,
                base_compute,
                adapted,
                full,
            },
            factors,
        ))
    }

    /// The model's weights with every adapted one merged, from `factors` (variable name
    /// → tensor): in the compute dtype, differentiable in the factors, for a step; in
    /// f32 from the f32 masters, for a checkpoint.
    pub fn merged(
        &self,
        factors: &HashMap<String, Tensor>,
        f32_base: bool,
    ) -> Result<HashMap<String, Tensor>> {
        let base = if f32_base {
            &self.base
        } else {
            &self.base_compute
        };
        let mut out = base.clone();
        let scale = self.spec.scale();
        for name in &self.adapted {
            let (a, b) = (&factors[&a_name(name)], &factors[&b_name(name)]);
            let w = &base[name];
            let delta = (b.to_dtype(w.dtype())?.matmul(&a.to_dtype(w.dtype())?)? * scale)?;
            let mut merged = (w + delta)?;
            if let Some(rows) = factors.get(&scale_name(name)) {
                merged = merged.broadcast_mul(&rows.to_dtype(w.dtype())?.unsqueeze(1)?)?;
            }
            out.insert(name.clone(), merged);
        }
        for name in &self.full {
            out.insert(name.clone(), factors[name].to_dtype(base[name].dtype())?);
        }
        Ok(out)
    }

    /// What training changed in each fully trained weight (trained minus base), HF
    /// names, in f32 on the CPU: stored as a delta, its quantization error is a small
    /// fraction of the change rather than of the weight.
    pub fn full_deltas(&self, factors: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>> {
        self.full
            .iter()
            .map(|name| {
                let delta = (factors[name].to_dtype(DType::F32)? - &self.base[name])?;
                Ok((name.clone(), delta.to_device(&Device::Cpu)?))
            })
            .collect()
    }

    /// The factors as an adapter's, in f32 on the CPU.
    pub fn factors(&self, factors: &HashMap<String, Tensor>) -> Result<Vec<LoraFactor>> {
        self.adapted
            .iter()
            .map(|name| {
                let get = |k: String| -> Result<Tensor> {
                    factors[&k].to_dtype(DType::F32)?.to_device(&Device::Cpu)
                };
                Ok(LoraFactor {
                    weight: name.clone(),
                    a: get(a_name(name))?,
                    b: get(b_name(name))?,
                    row_scale: match factors.contains_key(&scale_name(name)) {
                        true => Some(get(scale_name(name))?),
                        false => None,
                    },
                })
            })
            .collect()
    }
}
