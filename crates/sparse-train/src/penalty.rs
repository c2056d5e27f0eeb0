//! The sparsity term of the loss and how strong it is: which per-token term the MLPs
//! compute ([`Penalty`]), and λ steered towards a target FFN density ([`L1Controller`]).

use serde::{Deserialize, Serialize};

/// The sparsity term of the loss, per token and layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Penalty {
    /// `Σ_j |h_j|`, the paper's L1. Computed on the dense and the TwELL FFN alike.
    #[default]
    #[serde(alias = "plain")]
    L1,
    /// A smooth count of the positive gates, each read as a cosine
    /// ([`twell::L1Term::GateL0`]): scaling a neuron's weights cannot lower it, and it
    /// pulls hardest on the gates just above zero. The best trade-off measured
    /// (docs/finetuning.md). Needs the dense FFN while training.
    GateL0,
}

impl Penalty {
    /// The per-token term the model's MLPs compute for this penalty.
    pub fn term(self) -> twell::L1Term {
        match self {
            Self::L1 => twell::L1Term::Plain,
            Self::GateL0 => twell::L1Term::GateL0,
        }
    }
}

/// How fast [`L1Controller`] moves λ: the exponent on `density / target`.
pub const L1_TARGET_GAIN: f64 = 0.05;
/// How far [`L1Controller`] may take λ from its start, down and up.
pub const L1_SCALE_RANGE: (f64, f64) = (1e-4, 1e4);

/// λ steered towards a target FFN density ([`crate::TrainConfig::l1_target_density`]): a
/// multiplicative step in log space, so λ can travel orders of magnitude in a few hundred
/// steps, capped per step so one noisy batch cannot swing it.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct L1Controller {
    /// The factor on the configured λ (1 at the start).
    pub scale: f64,
    /// The density at the first steered step: where an annealed target starts.
    #[serde(default)]
    pub anneal_from: Option<f64>,
    /// Validation density over the training batches' mean density since the validation
    /// before, as the last validation measured it.
    #[serde(default)]
    pub calibration: Option<f64>,
    /// The training batches' densities since the last validation: sum and count.
    #[serde(default)]
    pub since_validation: (f64, usize),
}

impl Default for L1Controller {
    fn default() -> Self {
        Self {
            scale: 1.0,
            anneal_from: None,
            calibration: None,
            since_validation: (0.0, 0),
        }
    }
}

impl L1Controller {
    /// The density to steer to `steps_in` steps after steering began (1 at the first
    /// steered step): geometric from the density seen at that first step (`density`,
    /// remembered) down to `target` over `anneal_steps`, then `target`.
    pub fn annealed_target(
        &mut self,
        density: f64,
        target: f64,
        steps_in: usize,
        anneal_steps: usize,
    ) -> f64 {
        if anneal_steps == 0 {
            return target;
        }
        // Already sparser than the target (or nothing measured): nothing to anneal.
        let usable = density.is_finite() && density > target;
        let from = *self
            .anneal_from
            .get_or_insert(if usable { density } else { target });
        let progress = (steps_in.saturating_sub(1) as f64 / anneal_steps as f64).min(1.0);
        from * (target / from).powf(progress)
    }

    /// Notes a training step's density, for the next [`Self::calibrate`].
    pub fn note_training_density(&mut self, density: f64) {
        if density.is_finite() {
            self.since_validation.0 += density;
            self.since_validation.1 += 1;
        }
    }

    /// After a validation that measured `val_density`: the ratio to the training
    /// batches' mean density since the validation before (kept as it was when there is
    /// nothing to compare).
    pub fn calibrate(&mut self, val_density: f64) {
        let (sum, count) = std::mem::take(&mut self.since_validation);
        let train = sum / count.max(1) as f64;
        if count > 0 && train > 0.0 && val_density.is_finite() && val_density > 0.0 {
            self.calibration = Some(val_density / train);
        }
    }

    /// The density a step that ran at `density` on training text counts as, read on
    /// `text`: scaled by the last calibration for validation text (1 before the first).
    pub fn density_on(&self, density: f64, text: DensityText) -> f64 {
        match text {
            DensityText::Training => density,
            DensityText::Validation => density * self.calibration.unwrap_or(1.0),
        }
    }

    /// Updates the factor after a step that ran at `density`.
    pub fn observe(&mut self, density: f64, target: f64) {
        if !(density.is_finite() && density > 0.0) {
            // No active neuron at all: ease off as far as a step allows.
            self.scale *= 0.9;
            return;
        }
        let factor = (density / target).powf(L1_TARGET_GAIN).clamp(0.9, 1.1);
        // Bounded, so a target the model cannot reach does not run λ off to infinity.
        self.scale = (self.scale * factor).clamp(L1_SCALE_RANGE.0, L1_SCALE_RANGE.1);
    }
}

/// The text whose FFN density a target density steers ([`crate::TrainConfig::l1_target_text`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DensityText {
    /// The training batches, measured every step.
    #[default]
    Training,
    /// The validation split: the training batches' density scaled by the ratio the last
    /// validation measured between the two. Training text can be sparser than the text
    /// a model is judged on (sampled text is), and a target read there misses on it.
    Validation,
}

impl std::str::FromStr for DensityText {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "training" => Ok(Self::Training),
            "validation" => Ok(Self::Validation),
            other => Err(format!("'{other}': want training or validation")),
        }
    }
}
