//! L1 sparsity fine-tuning, top to bottom.
//!
//! The MLP gate runs ReLU, and the loss is
//!
//! ```text
//! loss = cross_entropy + λ · mean_layers( mean_tokens( Σ_j |h_j| ) )
//! ```
//!
//! with `h` the input of `down_proj`. λ can ramp up linearly over the first steps, or
//! be steered towards a target density. With distillation the cross-entropy is mixed
//! with `KL(teacher ‖ student)` ([`crate::distill`]).
//! Text is packed into fixed-length sequences, shuffled deterministically per epoch;
//! AdamW (our own, so its state can be saved) with warm-up + cosine decay, gradient
//! clipping and accumulation; f32 master weights. Checkpoints are HF directories plus
//! the optimizer and trainer state, so a run can be resumed exactly.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::checkpoint::save_hf;
use crate::config::Config;
use crate::model::{Cache, Llama};
use crate::optim::{clip_scale, grad_norm, lr_at, AdamW, AdamWConfig};

/// The L1 term of the loss, per token and layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum L1Penalty {
    /// `Σ_j |h_j|`, as in the paper.
    #[default]
    Plain,
    /// `Σ_j |h_j|·‖Wd_j‖₂`: unchanged when a neuron's up/gate rows shrink and its
    /// down column grows to match, so only switching neurons off lowers it
    /// ([`twell::L1Term::DownNorm`]). Needs the dense FFN while training.
    DownNorm,
    /// `(Σ_j |h_j|)² / Σ_j h_j²` per token: a common scale of `h` cancels out of it
    /// ([`twell::L1Term::Hoyer`]). Needs the dense FFN while training.
    Hoyer,
    /// A smooth count of the positive gates, each measured as a cosine
    /// ([`twell::L1Term::GateL0`]). Needs the dense FFN while training.
    GateL0,
}

impl L1Penalty {
    /// The per-token term the model's MLPs compute for this penalty.
    pub fn term(self) -> twell::L1Term {
        match self {
            Self::Plain => twell::L1Term::Plain,
            Self::DownNorm => twell::L1Term::DownNorm,
            Self::Hoyer => twell::L1Term::Hoyer,
            Self::GateL0 => twell::L1Term::GateL0,
        }
    }
}

impl std::str::FromStr for L1Penalty {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "plain" => Ok(Self::Plain),
            "down-norm" => Ok(Self::DownNorm),
            "hoyer" => Ok(Self::Hoyer),
            "gate-l0" => Ok(Self::GateL0),
            other => Err(format!(
                "'{other}': want plain, down-norm, hoyer or gate-l0"
            )),
        }
    }
}

/// The text whose FFN density a target density steers ([`TrainConfig::l1_target_text`]).
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
    /// What the L1 term sums: `|h_j|`, or `|h_j|·‖Wd_j‖` (rescaling-proof).
    #[serde(default)]
    pub l1_penalty: L1Penalty,
    /// ε of the `gate-l0` term's smooth count ([`twell::SparseMlp::set_gate_l0_eps`]).
    #[serde(default = "default_gate_l0_eps")]
    pub gate_l0_eps: f64,
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
    /// ([`L1Controller`]). Needs the activity statistics.
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
    /// a teacher ([`Trainer::set_teacher`]).
    #[serde(default)]
    pub distill: f64,
    /// β of residual distillation: `β · mean over layers and tokens of ‖s - t‖² / ‖t‖²`
    /// between the student's and the teacher's residual stream after each block
    /// ([`crate::distill::residual_distance`]) joins the loss. 0 is off; needs a teacher
    /// of the student's depth and width.
    #[serde(default)]
    pub distill_residual: f64,
    /// Give the MLP projections biases (HF `mlp_bias`), starting at zero, when the
    /// checkpoint has none: the gate bias is a per-neuron threshold the sparsity term
    /// can lower directly. Biases take no weight decay.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The gradient window below the ReLU's zero, in units of each layer's mean |gate|
    /// ([`twell::SparseMlp::set_relu_grad_window`]): the loss's gradient reaches the
    /// neurons just off, as if they were on, so it can ask for one. 0 is the plain ReLU.
    #[serde(default)]
    pub relu_grad_window: f64,
}

fn default_gate_l0_eps() -> f64 {
    twell::GATE_L0_EPS
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
            l1_penalty: L1Penalty::Plain,
            gate_l0_eps: twell::GATE_L0_EPS,
            seed: 0,
            dead_window_steps: 50,
            bf16: false,
            profile: false,
            no_activity_stats: false,
            l1_target_density: None,
            l1_target_anneal_steps: 0,
            l1_target_text: DensityText::Training,
            distill: 0.0,
            distill_residual: 0.0,
            mlp_bias: false,
            relu_grad_window: 0.0,
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
        if !(0.0..=1.0).contains(&self.distill) {
            return bad("the distillation weight must be in [0, 1]");
        }
        if !(self.distill_residual >= 0.0 && self.distill_residual.is_finite()) {
            return bad("the residual distillation weight must be a number >= 0");
        }
        if !(self.relu_grad_window >= 0.0 && self.relu_grad_window.is_finite()) {
            return bad("the ReLU's gradient window must be a number >= 0");
        }
        if !(self.gate_l0_eps > 0.0 && self.gate_l0_eps.is_finite()) {
            return bad("the gate-l0 term's ε must be a positive number");
        }
        if self.gate_l0_eps != twell::GATE_L0_EPS && self.l1_penalty != L1Penalty::GateL0 {
            return bad("ε is a setting of the gate-l0 term only");
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

/// How fast [`L1Controller`] moves λ: the exponent on `density / target`.
pub const L1_TARGET_GAIN: f64 = 0.05;
/// How far [`L1Controller`] may take λ from its start, down and up.
pub const L1_SCALE_RANGE: (f64, f64) = (1e-4, 1e4);

/// λ steered towards a target FFN density ([`TrainConfig::l1_target_density`]): a
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

/// Token stream cut into training sequences of `seq_len + 1` tokens (inputs and
/// shifted targets), visited in a seeded random order per epoch.
#[derive(Clone, Debug)]
pub struct PackedData {
    sequences: Vec<Vec<u32>>,
}

impl PackedData {
    pub fn new(tokens: &[u32], seq_len: usize) -> Result<Self> {
        let sequences: Vec<Vec<u32>> = tokens
            .windows(seq_len + 1)
            .step_by(seq_len)
            .map(|w| w.to_vec())
            .collect();
        if sequences.is_empty() {
            candle_core::bail!(
                "{} tokens do not fill one sequence of {} + 1",
                tokens.len(),
                seq_len
            );
        }
        Ok(Self { sequences })
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The `index`-th batch of the whole run (across epochs), `[batch, seq_len + 1]`.
    pub fn batch(&self, index: usize, batch: usize, seed: u64, device: &Device) -> Result<Tensor> {
        let per_epoch = (self.len() / batch).max(1);
        let (epoch, k) = (index / per_epoch, index % per_epoch);
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
            seed.wrapping_add(epoch as u64),
        ));
        let rows: Vec<u32> = (0..batch)
            .flat_map(|r| {
                self.sequences[order[(k * batch + r) % self.len()]]
                    .iter()
                    .copied()
            })
            .collect();
        Tensor::from_vec(rows, (batch, self.sequences[0].len()), device)
    }

    /// Batches in order, for validation.
    pub fn ordered_batch(
        &self,
        index: usize,
        batch: usize,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let start = index * batch;
        if start >= self.len() {
            return Ok(None);
        }
        let end = (start + batch).min(self.len());
        let rows: Vec<u32> = self.sequences[start..end]
            .iter()
            .flatten()
            .copied()
            .collect();
        Ok(Some(Tensor::from_vec(
            rows,
            (end - start, self.sequences[0].len()),
            device,
        )?))
    }
}

/// Mean next-token cross-entropy of `logits [b, t, V]` against `targets [b, t]`, in
/// f32 whatever the logits' dtype.
fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    twell::ops::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)
}

/// One step's record (a line of the JSON log).
#[derive(Clone, Debug, Serialize)]
pub struct StepLog {
    pub step: usize,
    pub ce: f64,
    pub l1: f64,
    pub l1_coefficient: f64,
    /// The density λ was steered towards after this step, with a target density.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub l1_target: Option<f64>,
    /// `KL(teacher ‖ student)` per token, when distilling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// The residual streams' relative squared distance, when distilling them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub residual_distance: Option<f64>,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Mean nonzeros of `h` per token, per layer.
    pub l0: Vec<f64>,
    pub mean_l0: f64,
    /// Fraction of neurons (all layers) that fired in none of the last window steps.
    pub dead_fraction: f64,
    pub tokens_per_sec: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_ce: Option<f64>,
    /// Mean nonzeros of `h` per token on the validation batches (mean over layers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_l0: Option<f64>,
    /// Where the step's time went, with [`TrainConfig::profile`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_ms: Option<PhaseMs>,
}

/// Milliseconds per phase of one optimizer step (summed over micro-batches).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseMs {
    /// Forward pass and loss.
    pub forward: f64,
    /// `loss.backward()` and gradient accumulation.
    pub backward: f64,
    /// Loss read-back and FFN activity statistics.
    pub stats: f64,
    /// Gradient clipping and the AdamW update.
    pub optimizer: f64,
}

/// A stopwatch that, when profiling, waits for the device before each reading.
struct PhaseClock<'a> {
    device: &'a Device,
    last: Option<Instant>,
}

impl<'a> PhaseClock<'a> {
    /// A running clock when `profile`, after the device has finished earlier work.
    fn start(device: &'a Device, profile: bool) -> Result<Self> {
        if profile {
            device.synchronize()?;
        }
        Ok(Self {
            device,
            last: profile.then(Instant::now),
        })
    }

    /// Milliseconds since the previous lap (0 when not profiling).
    fn lap(&mut self) -> Result<f64> {
        let Some(last) = self.last else {
            return Ok(0.0);
        };
        self.device.synchronize()?;
        let now = Instant::now();
        self.last = Some(now);
        Ok((now - last).as_secs_f64() * 1e3)
    }
}

/// What [`Trainer::validate`] measured.
#[derive(Clone, Copy, Debug)]
pub struct Validation {
    /// Mean next-token cross-entropy.
    pub ce: f64,
    /// Mean nonzeros of `h` per token (mean over layers), with the activity statistics.
    pub mean_l0: Option<f64>,
}

/// Where a run is, to resume it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: usize,
    pub config: TrainConfig,
    /// Where [`TrainConfig::l1_target_density`] had taken λ.
    #[serde(default)]
    pub l1_controller: L1Controller,
    /// Per layer, per neuron: the last step it fired, so that the dead fraction after a
    /// resume counts the same window as before it (not every neuron dead until it fires).
    #[serde(default)]
    pub last_fired: Vec<Vec<Option<usize>>>,
}

/// Zero biases for every layer's three MLP projections (HF names), beside the weights.
fn add_zero_mlp_biases(
    weights: &mut std::collections::HashMap<String, Tensor>,
    model_cfg: &Config,
) -> Result<()> {
    let (d, f) = (model_cfg.hidden_size, model_cfg.intermediate_size);
    for layer in 0..model_cfg.num_hidden_layers {
        let mlp = format!("model.layers.{layer}.mlp");
        let Some(gate) = weights.get(&format!("{mlp}.gate_proj.weight")) else {
            candle_core::bail!("--mlp-bias: no {mlp}.gate_proj.weight in the checkpoint");
        };
        let (dtype, device) = (gate.dtype(), gate.device().clone());
        for (name, n) in [("gate_proj", f), ("up_proj", f), ("down_proj", d)] {
            let zeros = Tensor::zeros(n, dtype, &device)?;
            weights.insert(format!("{mlp}.{name}.bias"), zeros);
        }
    }
    Ok(())
}

/// A fine-tuning run: the trainable weights, the model built on them, the optimizer.
pub struct Trainer {
    pub cfg: TrainConfig,
    model_cfg: Config,
    varmap: VarMap,
    model: Llama,
    opt: AdamW,
    device: Device,
    step: usize,
    /// Per layer, per neuron: the last step it fired.
    last_fired: Vec<Vec<Option<usize>>>,
    /// Whether each layer's up and down weights are one trainable `[f, 2d]` matrix
    /// ([`crate::fused_mlp`]): when the TwELL FFN is what trains.
    fused_up_down: bool,
    l1_controller: L1Controller,
    /// The model distilled from ([`TrainConfig::distill`]): frozen, dense.
    teacher: Option<Teacher>,
}

/// The distillation teacher and the cache its forward passes reuse (no keys and values
/// are kept, so only its RoPE tables and masks, built once instead of every step).
struct Teacher {
    model: Llama,
    cache: Cache,
}

impl Trainer {
    /// Starts from HF-named weights; the MLP gate is switched to ReLU.
    pub fn new(
        mut model_cfg: Config,
        weights: std::collections::HashMap<String, Tensor>,
        cfg: TrainConfig,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        model_cfg.activation = twell::Activation::Relu;
        model_cfg.l1_coefficient = Some(cfg.l1);
        // The full-precision weights: the variables themselves in f32, or in bf16 the
        // optimizer's masters behind bf16 variables.
        let mut masters = std::collections::HashMap::new();
        for (name, t) in weights {
            if model_cfg.tie_word_embeddings && name == "lm_head.weight" {
                continue;
            }
            masters.insert(name, t.to_dtype(DType::F32)?.to_device(device)?);
        }
        if cfg.mlp_bias && !model_cfg.mlp_bias {
            add_zero_mlp_biases(&mut masters, &model_cfg)?;
            model_cfg.mlp_bias = true;
        }
        // The TwELL path reads up and down as one neuron-major matrix: training that
        // matrix itself spares a copy and a split of it per layer and step. The dense
        // path keeps the HF weights (it would copy them out of the matrix instead).
        let fused_up_down = model_cfg.ffn_mode == twell::FfnMode::Sparse;
        if fused_up_down {
            masters = crate::fused_mlp::fuse_map(masters)?;
        }
        let dtype = cfg.dtype();
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().expect("varmap lock");
            for (name, t) in &masters {
                data.insert(name.clone(), Var::from_tensor(&t.to_dtype(dtype)?)?);
            }
        }
        let model = Self::build(&varmap, &model_cfg, &cfg, device)?;
        let params = varmap
            .data()
            .lock()
            .expect("varmap lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let opt_cfg = AdamWConfig {
            weight_decay: cfg.weight_decay,
            ..Default::default()
        };
        let opt = if cfg.bf16 {
            AdamW::new_mixed(params, &masters, opt_cfg)?
        } else {
            AdamW::new(params, opt_cfg)?
        };
        let layers = model_cfg.num_hidden_layers;
        let ffn = model_cfg.intermediate_size;
        Ok(Self {
            cfg,
            model_cfg,
            varmap,
            model,
            opt,
            device: device.clone(),
            step: 0,
            last_fired: vec![vec![None; ffn]; layers],
            fused_up_down,
            l1_controller: L1Controller::default(),
            teacher: None,
        })
    }

    /// The model on the variables (f32, or bf16 on the optimizer's f32 masters). Built
    /// once: the optimizer updates the variables in place.
    fn build(
        varmap: &VarMap,
        model_cfg: &Config,
        cfg: &TrainConfig,
        device: &Device,
    ) -> Result<Llama> {
        let dtype = cfg.dtype();
        let vb = VarBuilder::from_varmap(varmap, dtype, device);
        let mut model = Llama::load(vb, model_cfg)?;
        model.record_ffn_stats(!cfg.no_activity_stats);
        model.set_l1_term(cfg.l1_penalty.term());
        model.set_gate_l0_eps(cfg.gate_l0_eps)?;
        model.set_relu_grad_window(cfg.relu_grad_window)?;
        Ok(model)
    }

    pub fn step(&self) -> usize {
        self.step
    }

    /// Turns per-phase timing of the following steps on or off (see `TrainConfig::profile`).
    pub fn set_profile(&mut self, on: bool) {
        self.cfg.profile = on;
    }

    /// Turns the per-step activity statistics off or on (see
    /// [`TrainConfig::no_activity_stats`]).
    pub fn set_activity_stats(&mut self, on: bool) {
        self.cfg.no_activity_stats = !on;
        self.model.record_ffn_stats(on);
    }

    /// Switches the feed-forward path (dense or TwELL) for the following steps.
    pub fn set_ffn_mode(&mut self, mode: twell::FfnMode) -> Result<()> {
        self.model_cfg.ffn_mode = mode;
        self.model.set_ffn_mode(mode)
    }

    /// The model to distill from when [`TrainConfig::distill`] > 0: usually the
    /// checkpoint the run started from, with its own activation. Its weights are not
    /// trained; it must share the student's vocabulary.
    pub fn set_teacher(&mut self, mut teacher: Llama) -> Result<()> {
        let (want, got) = (self.model_cfg.vocab_size, teacher.config().vocab_size);
        if want != got {
            candle_core::bail!("the teacher's vocabulary ({got}) is not the student's ({want})");
        }
        let shape = |c: &Config| (c.num_hidden_layers, c.hidden_size);
        let (want, got) = (shape(&self.model_cfg), shape(teacher.config()));
        if self.cfg.distill_residual > 0.0 && want != got {
            candle_core::bail!(
                "residual distillation needs a teacher of the student's (layers, hidden) \
                 {want:?}, not {got:?}"
            );
        }
        // It only runs inference passes.
        teacher.fuse_qkv()?;
        let cache = Cache::new(false, self.cfg.dtype(), teacher.config(), &self.device)?;
        self.teacher = Some(Teacher {
            model: teacher,
            cache,
        });
        Ok(())
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn model_config(&self) -> &Config {
        &self.model_cfg
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub fn train_step(&mut self, data: &PackedData) -> Result<StepLog> {
        let t0 = Instant::now();
        let l1_coefficient = self.cfg.l1_at(self.step) * self.l1_controller.scale;
        let lr = lr_at(
            self.step,
            self.cfg.steps,
            self.cfg.warmup_steps,
            self.cfg.lr,
            self.cfg.min_lr_ratio,
        );
        let n = self.opt.params().len();
        let mut grads: Vec<Option<Tensor>> = vec![None; n];
        let (distill, beta) = (self.cfg.distill, self.cfg.distill_residual);
        if (distill > 0.0 || beta > 0.0) && self.teacher.is_none() {
            candle_core::bail!(
                "distillation weights (α {distill}, β {beta}) without a teacher: call \
                 Trainer::set_teacher"
            );
        }
        let (mut ce_sum, mut l1_sum, mut kl_sum, mut rd_sum) = (0f64, 0f64, 0f64, 0f64);
        let mut l0 = vec![0f64; self.model_cfg.num_hidden_layers];
        let device = self.device.clone();
        let mut clock = PhaseClock::start(&device, self.cfg.profile)?;
        let mut phases = PhaseMs::default();
        // Gradients summed over micro-batches in f32 (bf16 variables give bf16 ones).
        let accumulate = self.cfg.grad_accum > 1;
        for micro in 0..self.cfg.grad_accum {
            let index = self.step * self.cfg.grad_accum + micro;
            let batch = data.batch(index, self.cfg.batch_size, self.cfg.seed, &self.device)?;
            let t = batch.dim(1)? - 1;
            let (inputs, targets) = (batch.narrow(1, 0, t)?, batch.narrow(1, 1, t)?);
            let out = self.model.forward_train(&inputs)?;
            let ce = cross_entropy(&out.logits, &targets)?;
            let ce_part = match distill > 0.0 {
                true => (&ce * (1.0 - distill))?,
                false => ce.clone(),
            };
            let mut loss = ((&out.l1 * l1_coefficient)? + ce_part)?;
            let (mut kl_value, mut rd_value) = (None, None);
            if let (Some(teacher), true) = (&mut self.teacher, distill > 0.0 || beta > 0.0) {
                // The teacher's logits only when they are distilled: its output head and
                // the f32 `[tokens, vocab]` copy are the largest part of its pass.
                let (teacher_logits, teacher_residuals) = match distill > 0.0 {
                    true => {
                        let (logits, residuals) = teacher.model.forward_all_with_residuals(
                            &inputs,
                            0,
                            &mut teacher.cache,
                            beta > 0.0,
                        )?;
                        (Some(logits), residuals)
                    }
                    false => (
                        None,
                        teacher.model.residuals(&inputs, 0, &mut teacher.cache)?,
                    ),
                };
                if let Some(teacher_logits) = teacher_logits {
                    let kl = crate::distill::kl_divergence(&out.logits, &teacher_logits)?;
                    loss = (loss + (&kl * distill)?)?;
                    kl_value = Some(kl);
                }
                if beta > 0.0 {
                    let rd = crate::distill::residual_distance(&out.residuals, &teacher_residuals)?;
                    loss = (loss + (&rd * beta)?)?;
                    rd_value = Some(rd);
                }
            }
            let loss = (loss / self.cfg.grad_accum as f64)?;
            phases.forward += clock.lap()?;
            let store = loss.backward()?;
            for (k, (_, var)) in self.opt.params().iter().enumerate() {
                if let Some(g) = store.get(var.as_tensor()) {
                    let g = if accumulate {
                        g.to_dtype(DType::F32)?
                    } else {
                        g.clone()
                    };
                    grads[k] = Some(match grads[k].take() {
                        Some(acc) => (acc + g)?,
                        None => g,
                    });
                }
            }
            phases.backward += clock.lap()?;
            ce_sum += ce.to_scalar::<f32>()? as f64;
            l1_sum += out.l1.to_scalar::<f32>()? as f64;
            if let Some(kl) = kl_value {
                kl_sum += kl.to_scalar::<f32>()? as f64;
            }
            if let Some(rd) = rd_value {
                rd_sum += rd.to_scalar::<f32>()? as f64;
            }
            if !self.cfg.no_activity_stats {
                self.observe_activity(&mut l0)?;
            }
            phases.stats += clock.lap()?;
        }
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(self.opt.params())
            .map(|(g, (_, v))| g.map_or_else(|| v.zeros_like(), Ok))
            .collect::<Result<_>>()?;
        let grad_norm = grad_norm(&grads)?;
        // Clipping rides along in the update: the scaled gradients are never written.
        self.opt
            .step_scaled(&grads, lr, clip_scale(grad_norm, self.cfg.clip_norm))?;
        phases.optimizer += clock.lap()?;
        self.step += 1;

        let accum = self.cfg.grad_accum as f64;
        let (ce, l1) = (ce_sum / accum, l1_sum / accum);
        let kl = (distill > 0.0).then_some(kl_sum / accum);
        let residual_distance = (beta > 0.0).then_some(rd_sum / accum);
        let l0: Vec<f64> = l0.into_iter().map(|v| v / accum).collect();
        let mean_l0 = l0.iter().sum::<f64>() / l0.len().max(1) as f64;
        // Not during λ's ramp: the density is high then by design, and the factor
        // would compound against the ramp.
        let ramped = self.step > self.cfg.l1_warmup_steps;
        let mut l1_target = None;
        let density = mean_l0 / self.model_cfg.intermediate_size as f64;
        if !self.cfg.no_activity_stats {
            self.l1_controller.note_training_density(density);
        }
        if let (Some(target), true) = (self.cfg.l1_target_density, ramped) {
            let density = self
                .l1_controller
                .density_on(density, self.cfg.l1_target_text);
            let goal = self.l1_controller.annealed_target(
                density,
                target,
                self.step - self.cfg.l1_warmup_steps,
                self.cfg.l1_target_anneal_steps,
            );
            self.l1_controller.observe(density, goal);
            l1_target = Some(goal);
        }
        let tokens = self.cfg.grad_accum * self.cfg.batch_size * self.cfg.seq_len;
        Ok(StepLog {
            step: self.step,
            ce,
            l1,
            l1_coefficient,
            l1_target,
            kl,
            residual_distance,
            loss: match kl {
                Some(kl) => (1.0 - distill) * ce + distill * kl,
                None => ce,
            } + l1_coefficient * l1
                + beta * residual_distance.unwrap_or(0.0),
            lr,
            grad_norm,
            mean_l0,
            l0,
            dead_fraction: self.dead_fraction(),
            tokens_per_sec: tokens as f64 / t0.elapsed().as_secs_f64(),
            val_ce: None,
            val_l0: None,
            phase_ms: self.cfg.profile.then_some(phases),
        })
    }

    /// Adds each layer's L0 of the last forward to `l0` and notes which neurons fired.
    fn observe_activity(&mut self, l0: &mut [f64]) -> Result<()> {
        for (layer, stats) in self.model.ffn_stats()?.into_iter().enumerate() {
            let Some(s) = stats else { continue };
            l0[layer] += s.mean_l0;
            for (neuron, &count) in s.fired.iter().enumerate() {
                if count > 0 {
                    self.last_fired[layer][neuron] = Some(self.step);
                }
            }
        }
        Ok(())
    }

    fn dead_fraction(&self) -> f64 {
        let window = self.cfg.dead_window_steps;
        let (mut dead, mut total) = (0usize, 0usize);
        for layer in &self.last_fired {
            for last in layer {
                total += 1;
                let alive = last.is_some_and(|s| s + window >= self.step);
                dead += usize::from(!alive);
            }
        }
        dead as f64 / total.max(1) as f64
    }

    /// Mean cross-entropy over up to `batches` validation batches (no gradients), and
    /// their mean L0 when the activity statistics are on; the L0 also calibrates a
    /// target density read on validation text ([`DensityText::Validation`]).
    pub fn validate(&mut self, data: &PackedData, batches: usize) -> Result<Validation> {
        // Without keys and values a cache holds only RoPE tables and masks: one serves
        // every batch.
        let mut cache = Cache::new(false, self.cfg.dtype(), &self.model_cfg, &self.device)?;
        let (mut sum, mut n) = (0f64, 0usize);
        let (mut l0_sum, mut l0_n) = (0f64, 0usize);
        for k in 0..batches {
            let Some(batch) = data.ordered_batch(k, self.cfg.batch_size, &self.device)? else {
                break;
            };
            let t = batch.dim(1)? - 1;
            let logits = self
                .model
                .forward_all(&batch.narrow(1, 0, t)?, 0, &mut cache)?;
            let ce = cross_entropy(&logits.detach(), &batch.narrow(1, 1, t)?)?;
            sum += ce.to_scalar::<f32>()? as f64;
            n += 1;
            if !self.cfg.no_activity_stats {
                let layers: Vec<f64> = self
                    .model
                    .ffn_stats()?
                    .into_iter()
                    .flatten()
                    .map(|s| s.mean_l0)
                    .collect();
                if !layers.is_empty() {
                    l0_sum += layers.iter().sum::<f64>() / layers.len() as f64;
                    l0_n += 1;
                }
            }
        }
        if n == 0 {
            candle_core::bail!("no validation batches");
        }
        let mean_l0 = (l0_n > 0).then(|| l0_sum / l0_n as f64);
        if let Some(l0) = mean_l0 {
            self.l1_controller
                .calibrate(l0 / self.model_cfg.intermediate_size as f64);
        }
        Ok(Validation {
            ce: sum / n as f64,
            mean_l0,
        })
    }

    /// The trained weights, HF-named, in f32 (with bf16 training, the optimizer's
    /// masters).
    pub fn weights(&self) -> Result<std::collections::HashMap<String, Tensor>> {
        let weights = match self.opt.masters()? {
            Some(masters) => masters,
            None => self
                .varmap
                .data()
                .lock()
                .expect("varmap lock")
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
                .collect(),
        };
        crate::fused_mlp::split_map(weights)
    }

    /// Writes an HF checkpoint (loadable by `twell generate`/`eval` and transformers)
    /// plus the optimizer and trainer state.
    pub fn save(
        &self,
        dir: &Path,
        tokenizer: &tokenizers::Tokenizer,
        chat_template: Option<&str>,
        dtype: DType,
    ) -> Result<()> {
        save_hf(
            dir,
            &self.weights()?,
            &self.model_cfg,
            tokenizer,
            chat_template,
            dtype,
        )?;
        self.opt.save(dir)?;
        let state = TrainerState {
            step: self.step,
            config: self.cfg.clone(),
            l1_controller: self.l1_controller,
            last_fired: self.last_fired.clone(),
        };
        let text = serde_json::to_string_pretty(&state)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        std::fs::write(dir.join("trainer_state.json"), text)?;
        Ok(())
    }

    /// Continues from a directory written by [`Trainer::save`] (its weights must have
    /// been loaded into this trainer): restores the optimizer, the step and where a
    /// target density had taken λ.
    pub fn resume(&mut self, dir: &Path) -> Result<()> {
        let text = std::fs::read_to_string(dir.join("trainer_state.json")).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{}: {e} (not a fine-tune checkpoint?)",
                dir.display()
            ))
        })?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::Msg(format!("trainer_state.json: {e}")))?;
        // The optimizer state is in the layout of the run that saved it: fused when
        // that run trained the TwELL FFN.
        let fused = self.fused_up_down;
        self.opt.load_with(dir, |t| {
            if fused {
                crate::fused_mlp::fuse_map(t)
            } else {
                crate::fused_mlp::split_map(t)
            }
        })?;
        self.step = state.step;
        self.l1_controller = state.l1_controller;
        // Checkpoints from before this was saved, or of another shape, start afresh.
        let same_shape = state.last_fired.len() == self.last_fired.len()
            && state
                .last_fired
                .iter()
                .zip(&self.last_fired)
                .all(|(a, b)| a.len() == b.len());
        if same_shape {
            self.last_fired = state.last_fired;
        }
        Ok(())
    }

    /// The factor a target density has put on λ (1 without one).
    pub fn l1_scale(&self) -> f64 {
        self.l1_controller.scale
    }
}
