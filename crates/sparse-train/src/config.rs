//! What shapes a fine-tuning run ([`TrainConfig`], saved with each checkpoint).

use candle_core::{DType, Result};
use serde::{Deserialize, Serialize};

use crate::lora::LoraSpec;
use crate::penalty::{DensityText, Penalty};

/// Everything that shapes a run (saved with each checkpoint).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainConfig {
    pub seq_len: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub steps: usize,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub clip_norm: f64,
    /// λ, the L1 coefficient.
    pub l1: f64,
    /// λ ramps linearly from 0 over this many steps.
    pub l1_warmup_steps: usize,
    /// The sparsity term λ weighs ([`Penalty`]).
    #[serde(default, alias = "l1_penalty")]
    pub penalty: Penalty,
    pub seed: u64,
    /// Neurons that fired in none of the last this many steps count as dead.
    pub dead_window_steps: usize,
    /// Compute dtype: f32, or bf16 forward/backward on f32 master weights.
    pub bf16: bool,
    /// Time the phases of each step ([`PhaseMs`]); synchronises the device between
    /// them, so it costs a little speed.
    #[serde(default)]
    pub profile: bool,
    /// Skip the per-step activity statistics (L0 per layer, dead neurons): a benchmark
    /// of the step alone, whose dense FFN would otherwise count its fired neurons over
    /// `[tokens, d_ff]` every step. The logged L0 is 0 then.
    #[serde(default)]
    pub no_activity_stats: bool,
    /// Steer λ towards this mean FFN density (a fraction of d_ff) instead of holding it:
    /// after each step past λ's ramp, λ is multiplied by `(density / target)^
    /// L1_TARGET_GAIN`, at most ×1.1 or ×0.9 a step, from `l1` as its start
    /// ([`crate::penalty::L1Controller`]). Needs the activity statistics.
    #[serde(default)]
    pub l1_target_density: Option<f64>,
    /// Lower the target gradually: from the density at which steering begins (the end of
    /// λ's ramp) geometrically down to [`Self::l1_target_density`] over this many steps
    /// (0: the final target at once). A target that moves slowly lets the weights follow
    /// instead of λ overshooting and silencing neurons for good.
    #[serde(default)]
    pub l1_target_anneal_steps: usize,
    /// The text whose density [`Self::l1_target_density`] is read on.
    #[serde(default)]
    pub l1_target_text: DensityText,
    /// α of knowledge distillation: the loss is `(1 - α)·CE + α·KL(teacher ‖ student)
    /// + λ·L1` ([`crate::distill`]); 0 trains on the corpus' cross-entropy alone. Needs
    /// a teacher ([`crate::Trainer::set_teacher`]).
    #[serde(default)]
    pub distill: f64,
    /// Train low-rank adapters over frozen weights instead of every weight
    /// ([`crate::lora`]); needs the dense FFN.
    #[serde(default)]
    pub lora: Option<LoraSpec>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seq_len: 256,
            batch_size: 8,
            grad_accum: 1,
            steps: 1000,
            lr: 1e-4,
            min_lr_ratio: 0.1,
            warmup_steps: 50,
            weight_decay: 0.0,
            clip_norm: 1.0,
            l1: 2e-5,
            l1_warmup_steps: 0,
            penalty: Penalty::L1,
            seed: 0,
            dead_window_steps: 50,
            bf16: false,
            profile: false,
            no_activity_stats: false,
            l1_target_density: None,
            l1_target_anneal_steps: 0,
            l1_target_text: DensityText::Training,
            distill: 0.0,
            lora: None,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| {
            Err(candle_core::Error::Msg(format!(
                "invalid training setting: {what}"
            )))
        };
        if self.seq_len < 2 || self.batch_size == 0 || self.grad_accum == 0 || self.steps == 0 {
            return bad("seq_len >= 2, batch_size, grad_accum and steps >= 1");
        }
        // A zero rate is allowed: benchmarks time steps that leave the weights as set.
        let lr_ok = self.lr >= 0.0 && self.lr.is_finite();
        if !lr_ok || !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad("lr >= 0 and min_lr_ratio in [0, 1]");
        }
        if self.l1 < 0.0 || !self.l1.is_finite() || self.weight_decay < 0.0 || self.clip_norm < 0.0
        {
            return bad("l1, weight_decay and clip_norm >= 0");
        }
        if let Some(lora) = &self.lora {
            lora.validate()?;
        }
        if !(0.0..=1.0).contains(&self.distill) {
            return bad("the distillation weight must be in [0, 1]");
        }
        if let Some(target) = self.l1_target_density {
            if !(target > 0.0 && target < 1.0) {
                return bad("the target density must be in (0, 1)");
            }
            if self.l1 <= 0.0 {
                return bad("a target density needs a starting l1 > 0 to scale");
            }
            if self.no_activity_stats {
                return bad("a target density needs the activity statistics (L0 per step)");
            }
        } else if self.l1_target_anneal_steps > 0 {
            return bad("annealing the target density needs a target density");
        } else if self.l1_target_text == DensityText::Validation {
            return bad("reading the target density on validation text needs a target density");
        }
        Ok(())
    }

    /// The compute dtype: bf16 (on f32 masters) or f32.
    pub fn dtype(&self) -> DType {
        if self.bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// λ at `step`.
    pub fn l1_at(&self, step: usize) -> f64 {
        if self.l1_warmup_steps == 0 {
            self.l1
        } else {
            self.l1 * ((step + 1) as f64 / self.l1_warmup_steps as f64).min(1.0)
        }
    }
}
