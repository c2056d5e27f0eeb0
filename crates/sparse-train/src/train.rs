//! L1 sparsity fine-tuning, top to bottom.
//!
//! The MLP gate runs ReLU, and the loss is
//!
//! ```text
//! loss = cross_entropy + λ · mean_layers( mean_tokens( penalty(h) ) )
//! ```
//!
//! with `h` the input of `down_proj` and the penalty `Σ_j |h_j|` or a smooth count of the
//! positive gates ([`crate::Penalty`]). λ can ramp up linearly over the first steps, or
//! be steered towards a target density ([`crate::L1Controller`]). With distillation the
//! cross-entropy is mixed with `KL(teacher ‖ student)` ([`fused_ops::kl_divergence`]):
//! the teacher's whole next-token distribution carries far more signal per token than a
//! one-hot target, and it keeps the student near the checkpoint it started as.
//! Text is packed into fixed-length sequences, shuffled deterministically per epoch
//! ([`crate::PackedData`]); AdamW (our own, so its state can be saved) with warm-up +
//! cosine decay, gradient clipping and accumulation; f32 master weights. Checkpoints are
//! HF directories plus the optimizer and trainer state, so a run can be resumed exactly.
//! With LoRA ([`crate::lora`]) the weights stay frozen and only low-rank factors train.
//! Data-parallel ([`Trainer::join`]): each process takes its share of every global batch,
//! the gradients are averaged over the processes ([`twell_dist`]) before the step, and
//! every process takes the same step.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};
use sparse_llama::adapter::LoraFactor;
use sparse_llama::checkpoint::save_hf;
use sparse_llama::model::{Cache, Llama};
use sparse_llama::Config;
use twell_dist::{all_reduce_mean, Communicator, SingleProcess, DEFAULT_BUCKET_BYTES};

use crate::config::TrainConfig;
use crate::data::PackedData;
use crate::lora::LoraState;
use crate::optim::{clip_scale, grad_norm, lr_at, AdamW, AdamWConfig};
use crate::penalty::L1Controller;

/// Mean next-token cross-entropy of `logits [b, t, V]` against `targets [b, t]`, in
/// f32 whatever the logits' dtype.
fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    fused_ops::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)
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

/// One micro-batch's loss terms, scalars on the device.
struct LossParts {
    ce: Tensor,
    l1: Tensor,
    kl: Option<Tensor>,
}

/// The loss terms summed over a step's micro-batches, on the host.
#[derive(Default)]
struct LossSums {
    ce: f64,
    l1: f64,
    kl: f64,
}

impl LossSums {
    fn add(&mut self, parts: &LossParts) -> Result<()> {
        self.ce += parts.ce.to_scalar::<f32>()? as f64;
        self.l1 += parts.l1.to_scalar::<f32>()? as f64;
        if let Some(kl) = &parts.kl {
            self.kl += kl.to_scalar::<f32>()? as f64;
        }
        Ok(())
    }
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
    /// With [`TrainConfig::lora`]: the frozen base the factors merge into.
    lora: Option<LoraState>,
    /// The processes of a data-parallel run ([`Trainer::join`]); a world of one.
    comm: Box<dyn Communicator>,
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
        // The TwELL path reads up and down as one neuron-major matrix: training that
        // matrix itself spares a copy and a split of it per layer and step. The dense
        // path keeps the HF weights (it would copy them out of the matrix instead).
        let fused_up_down = model_cfg.ffn_mode == twell::FfnMode::Sparse;
        if fused_up_down {
            masters = crate::fused_mlp::fuse_map(masters)?;
        }
        let dtype = cfg.dtype();
        // With LoRA the weights become the frozen base and the variables are the factors.
        let lora = match cfg.lora.clone() {
            Some(spec) => {
                if fused_up_down {
                    candle_core::bail!("LoRA trains through the dense FFN: use the dense FFN mode");
                }
                let (state, factors) = LoraState::new(spec, masters, dtype, cfg.seed)?;
                masters = factors;
                Some(state)
            }
            None => None,
        };
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().expect("varmap lock");
            for (name, t) in &masters {
                data.insert(name.clone(), Var::from_tensor(&t.to_dtype(dtype)?)?);
            }
        }
        let model = match &lora {
            Some(state) => {
                let factors = Self::variables(&varmap);
                Self::build_merged(state, &factors, &model_cfg, &cfg, device)?
            }
            None => Self::build(&varmap, &model_cfg, &cfg, device)?,
        };
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
            lora,
            comm: Box::new(SingleProcess),
        })
    }

    /// The variables by name, as tensors (still tracked: the merged weights of a LoRA
    /// step are differentiable in them).
    fn variables(varmap: &VarMap) -> HashMap<String, Tensor> {
        varmap
            .data()
            .lock()
            .expect("varmap lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// The model on the base with the adapters merged in, differentiable in the factors.
    fn build_merged(
        lora: &LoraState,
        factors: &HashMap<String, Tensor>,
        model_cfg: &Config,
        cfg: &TrainConfig,
        device: &Device,
    ) -> Result<Llama> {
        let vb = VarBuilder::from_tensors(lora.merged(factors, false)?, cfg.dtype(), device);
        let mut model = Llama::load(vb, model_cfg)?;
        model.record_ffn_stats(!cfg.no_activity_stats);
        model.set_l1_term(cfg.penalty.term());
        Ok(model)
    }

    /// With LoRA, rebuilds the model on the factors as they are now: the optimizer
    /// updates the factors in place, but the merged weights are a product of them.
    fn refresh_merged(&mut self) -> Result<()> {
        if let Some(lora) = &self.lora {
            let factors = Self::variables(&self.varmap);
            self.model =
                Self::build_merged(lora, &factors, &self.model_cfg, &self.cfg, &self.device)?;
        }
        Ok(())
    }

    /// The factors of a LoRA run (from the f32 masters in bf16 training), in f32 on the
    /// CPU; `None` for a run that trains every weight.
    pub fn lora_factors(&self) -> Result<Option<Vec<LoraFactor>>> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        lora.factors(&self.full_precision_variables()?).map(Some)
    }

    /// The variables at full precision: the optimizer's f32 masters in bf16 training,
    /// the variables themselves in f32.
    fn full_precision_variables(&self) -> Result<HashMap<String, Tensor>> {
        Ok(match self.opt.masters()? {
            Some(m) => m,
            None => Self::variables(&self.varmap)
                .into_iter()
                .map(|(k, v)| (k, v.detach()))
                .collect(),
        })
    }

    /// How a LoRA run changed the weights it trains fully ([`crate::LoraSpec::full`]),
    /// in f32 on the CPU; empty for other runs.
    pub fn lora_full_deltas(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(lora) = &self.lora else {
            return Ok(Vec::new());
        };
        lora.full_deltas(&self.full_precision_variables()?)
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
        model.set_l1_term(cfg.penalty.term());
        Ok(model)
    }

    pub fn step(&self) -> usize {
        self.step
    }

    /// Joins a data-parallel run through `comm` (after [`Trainer::resume`], when
    /// resuming): each following step takes this rank's share of every global batch of
    /// [`TrainConfig::batch_size`] sequences, and the gradients, the logged terms and the
    /// validation are averaged over the ranks, so that every rank takes the same step.
    /// Fails unless the batch splits evenly and every rank holds rank 0's weights, step
    /// and λ.
    pub fn join(&mut self, comm: Box<dyn Communicator>) -> Result<()> {
        let world = comm.world_size();
        if !self.cfg.batch_size.is_multiple_of(world) {
            candle_core::bail!(
                "a batch of {} sequences does not split evenly over {world} processes",
                self.cfg.batch_size
            );
        }
        self.comm = comm;
        let ours = self.fingerprint()?;
        let mut rank0s = ours.clone();
        self.comm.broadcast_f32(&mut rank0s)?;
        let same = ours
            .iter()
            .zip(&rank0s)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let mut differing = [f32::from(u8::from(!same))];
        self.comm.all_reduce_sum(&mut differing)?;
        if differing[0] > 0.0 {
            candle_core::bail!(
                "{} of {world} processes do not hold rank 0's weights, step and λ: every \
                 process must start from the same checkpoint",
                differing[0]
            );
        }
        Ok(())
    }

    /// The step, λ's factor and the sum of each variable at full precision: equal on
    /// ranks that start from the same point.
    fn fingerprint(&self) -> Result<Vec<f32>> {
        let variables = self.full_precision_variables()?;
        let mut names: Vec<&String> = variables.keys().collect();
        names.sort();
        let mut out = vec![
            self.step as f32,
            self.opt.steps_taken() as f32,
            self.l1_controller.scale as f32,
        ];
        for name in names {
            let sum = variables[name].sum_all()?.to_dtype(DType::F32)?;
            out.push(sum.to_scalar::<f32>()?);
        }
        Ok(out)
    }

    /// This process's rank in a data-parallel run (0 outside one).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The processes of the run (1 outside a data-parallel run).
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The run's communicator, for the caller's own agreements between ranks (when to
    /// stop, say).
    pub fn communicator(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
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
        let distill = self.cfg.distill;
        if distill > 0.0 && self.teacher.is_none() {
            candle_core::bail!(
                "a distillation weight ({distill}) without a teacher: call Trainer::set_teacher"
            );
        }
        let mut grads: Vec<Option<Tensor>> = vec![None; self.opt.params().len()];
        let mut sums = LossSums::default();
        let mut l0 = vec![0f64; self.model_cfg.num_hidden_layers];
        let mut fired = vec![vec![false; self.model_cfg.intermediate_size]; l0.len()];
        let device = self.device.clone();
        let mut clock = PhaseClock::start(&device, self.cfg.profile)?;
        let mut phases = PhaseMs::default();
        for micro in 0..self.cfg.grad_accum {
            let index = self.step * self.cfg.grad_accum + micro;
            let batch = data.batch(index, self.cfg.batch_size, self.cfg.seed, &self.device)?;
            let batch = self.shard(&batch)?;
            self.refresh_merged()?;
            let (loss, parts) = self.micro_batch_loss(&batch, l1_coefficient)?;
            phases.forward += clock.lap()?;
            self.accumulate_gradients(&loss, &mut grads)?;
            phases.backward += clock.lap()?;
            sums.add(&parts)?;
            if !self.cfg.no_activity_stats {
                self.observe_activity(&mut l0, &mut fired)?;
            }
            phases.stats += clock.lap()?;
        }
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(self.opt.params())
            .map(|(g, (_, v))| g.map_or_else(|| v.zeros_like(), Ok))
            .collect::<Result<_>>()?;
        // Data-parallel: the mean of the ranks' gradients is the global batch's gradient.
        let grads = all_reduce_mean(self.comm.as_mut(), &grads, DEFAULT_BUCKET_BYTES)?;
        let grad_norm = grad_norm(&grads)?;
        // Clipping rides along in the update: the scaled gradients are never written.
        self.opt
            .step_scaled(&grads, lr, clip_scale(grad_norm, self.cfg.clip_norm))?;
        phases.optimizer += clock.lap()?;
        self.gather_step_stats(&mut sums, &mut l0, &mut fired)?;
        self.note_fired(&fired);
        self.step += 1;

        let accum = self.cfg.grad_accum as f64;
        let (ce, l1) = (sums.ce / accum, sums.l1 / accum);
        let kl = (distill > 0.0).then_some(sums.kl / accum);
        let l0: Vec<f64> = l0.into_iter().map(|v| v / accum).collect();
        let mean_l0 = l0.iter().sum::<f64>() / l0.len().max(1) as f64;
        let l1_target = self.steer_l1(mean_l0 / self.model_cfg.intermediate_size as f64);
        let tokens = self.cfg.grad_accum * self.cfg.batch_size * self.cfg.seq_len;
        Ok(StepLog {
            step: self.step,
            ce,
            l1,
            l1_coefficient,
            l1_target,
            kl,
            loss: match kl {
                Some(kl) => (1.0 - distill) * ce + distill * kl,
                None => ce,
            } + l1_coefficient * l1,
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

    /// The loss of one micro-batch `[batch, seq_len + 1]` (scaled for accumulation), and
    /// its parts for the log.
    fn micro_batch_loss(
        &mut self,
        batch: &Tensor,
        l1_coefficient: f64,
    ) -> Result<(Tensor, LossParts)> {
        let distill = self.cfg.distill;
        let t = batch.dim(1)? - 1;
        let (inputs, targets) = (batch.narrow(1, 0, t)?, batch.narrow(1, 1, t)?);
        let out = self.model.forward_train(&inputs)?;
        let ce = cross_entropy(&out.logits, &targets)?;
        let ce_part = match distill > 0.0 {
            true => (&ce * (1.0 - distill))?,
            false => ce.clone(),
        };
        let mut loss = ((&out.l1 * l1_coefficient)? + ce_part)?;
        let mut kl = None;
        if let (Some(teacher), true) = (&mut self.teacher, distill > 0.0) {
            let teacher_logits = teacher.model.forward_all(&inputs, 0, &mut teacher.cache)?;
            let divergence = fused_ops::kl_divergence(&out.logits, &teacher_logits)?;
            loss = (loss + (&divergence * distill)?)?;
            kl = Some(divergence);
        }
        let loss = (loss / self.cfg.grad_accum as f64)?;
        Ok((loss, LossParts { ce, l1: out.l1, kl }))
    }

    /// Adds the gradients of `loss` to `grads` (one slot per optimizer parameter), in
    /// f32 when several micro-batches are summed (bf16 variables give bf16 gradients).
    fn accumulate_gradients(&self, loss: &Tensor, grads: &mut [Option<Tensor>]) -> Result<()> {
        let accumulate = self.cfg.grad_accum > 1;
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
        Ok(())
    }

    /// After a step that ran at `density` (on the training batches): moves λ towards the
    /// target density, when there is one and λ's ramp is over. Returns the density λ was
    /// steered towards.
    fn steer_l1(&mut self, density: f64) -> Option<f64> {
        if !self.cfg.no_activity_stats {
            self.l1_controller.note_training_density(density);
        }
        // Not during λ's ramp: the density is high then by design, and the factor
        // would compound against the ramp.
        let ramped = self.step > self.cfg.l1_warmup_steps;
        let (Some(target), true) = (self.cfg.l1_target_density, ramped) else {
            return None;
        };
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
        Some(goal)
    }

    /// Adds each layer's L0 of the last forward to `l0` and marks the neurons that fired
    /// in `fired`.
    fn observe_activity(&mut self, l0: &mut [f64], fired: &mut [Vec<bool>]) -> Result<()> {
        for (layer, stats) in self.model.ffn_stats()?.into_iter().enumerate() {
            let Some(s) = stats else { continue };
            l0[layer] += s.mean_l0;
            for (neuron, &count) in s.fired.iter().enumerate() {
                fired[layer][neuron] |= count > 0;
            }
        }
        Ok(())
    }

    /// Notes the neurons that fired in this step.
    fn note_fired(&mut self, fired: &[Vec<bool>]) {
        for (layer, neurons) in fired.iter().enumerate() {
            for (neuron, _) in neurons.iter().enumerate().filter(|(_, &f)| f) {
                self.last_fired[layer][neuron] = Some(self.step);
            }
        }
    }

    /// This rank's rows of a global batch: equal, consecutive parts, one per rank.
    fn shard(&self, batch: &Tensor) -> Result<Tensor> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        if world == 1 {
            return Ok(batch.clone());
        }
        let rows = batch.dim(0)? / world;
        batch.narrow(0, rank * rows, rows)
    }

    /// Data-parallel: the step's loss terms, L0 and fired neurons of the global batch
    /// (the mean of the ranks' means: their shards are the same size), on every rank, so
    /// that the log and λ's controller see the whole batch.
    fn gather_step_stats(
        &mut self,
        sums: &mut LossSums,
        l0: &mut [f64],
        fired: &mut [Vec<bool>],
    ) -> Result<()> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(());
        }
        let mut buf: Vec<f32> = [sums.ce, sums.l1, sums.kl]
            .iter()
            .chain(l0.iter())
            .map(|&v| v as f32)
            .chain(fired.iter().flatten().map(|&f| f32::from(u8::from(f))))
            .collect();
        self.comm.all_reduce_sum(&mut buf)?;
        let mean = |v: f32| v as f64 / world as f64;
        (sums.ce, sums.l1, sums.kl) = (mean(buf[0]), mean(buf[1]), mean(buf[2]));
        let (l0_sums, fired_counts) = buf[3..].split_at(l0.len());
        for (x, &v) in l0.iter_mut().zip(l0_sums) {
            *x = mean(v);
        }
        for (f, &count) in fired.iter_mut().flatten().zip(fired_counts) {
            *f = count > 0.0;
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
    /// target density read on validation text ([`crate::DensityText::Validation`]).
    pub fn validate(&mut self, data: &PackedData, batches: usize) -> Result<Validation> {
        // Without keys and values a cache holds only RoPE tables and masks: one serves
        // every batch.
        self.refresh_merged()?;
        let mut cache = Cache::new(false, self.cfg.dtype(), &self.model_cfg, &self.device)?;
        let (mut sum, mut n) = (0f64, 0usize);
        let (mut l0_sum, mut l0_n) = (0f64, 0usize);
        // Data-parallel: each rank takes every world-th batch, and the sums are added up.
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        for k in (rank..batches).step_by(world) {
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
        if world > 1 {
            let mut buf = [sum, n as f64, l0_sum, l0_n as f64].map(|v| v as f32);
            self.comm.all_reduce_sum(&mut buf)?;
            let [s, b, l, ln] = buf.map(f64::from);
            (sum, n, l0_sum, l0_n) = (s, b as usize, l, ln as usize);
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
        let values = self.full_precision_variables()?;
        match &self.lora {
            Some(lora) => lora.merged(&values, true),
            None => crate::fused_mlp::split_map(values),
        }
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
        if self.lora.is_some() {
            candle_core::bail!(
                "a LoRA run cannot resume: its checkpoints hold the merged weights, not the base; start it again"
            );
        }
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
