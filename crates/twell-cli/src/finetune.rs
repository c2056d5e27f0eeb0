//! `twell finetune`: L1 sparsity fine-tuning of a checkpoint (ReLU gate + λ·L1).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use indicatif::{ProgressBar, ProgressStyle};
use sparse_llama::adapter::{self, LoraAdapter, TwellAdapterInfo};
use sparse_llama::checkpoint::LoadOptions;
use sparse_llama::corpus::Corpus;
use sparse_llama::Llama;
use sparse_train::{DensityText, LoraSpec, PackedData, Penalty, StepLog, TrainConfig, Trainer};
use twell::{Activation, FfnMode};

use crate::corpus_args::CorpusArgs;
use crate::device::DeviceSpec;
use crate::launch::{Rank, RankArgs};
use crate::model_args::{DefaultModel, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct FinetuneArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub corpus: CorpusArgs,
    /// More training text, all of it trained on and none held out (e.g. the texts of
    /// `twell sample`): a directory of .txt files, a file, or dir/*.txt.
    #[arg(long)]
    pub extra_data: Option<String>,
    /// Use at most this many tokens of the training documents (0: all); --extra-data
    /// comes on top.
    #[arg(long, default_value_t = 0)]
    pub max_train_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// λ: the L1 coefficient (0 for a plain ReLU fine-tune).
    #[arg(long, default_value_t = 2e-5)]
    pub l1: f64,
    /// Ramp λ up linearly over this many steps.
    #[arg(long, default_value_t = 0)]
    pub l1_warmup: usize,
    /// Steer λ towards this mean FFN density (a fraction, e.g. 0.03) instead of holding
    /// it: --l1 is where λ starts, and each step scales it by (density / target)^0.05,
    /// by at most 10%.
    #[arg(long)]
    pub l1_target_density: Option<f64>,
    /// Lower the target gradually: from the density when steering begins (after
    /// --l1-warmup) geometrically down to --l1-target-density over this many steps.
    #[arg(long, default_value_t = 0)]
    pub l1_target_anneal: usize,
    /// The text --l1-target-density is read on: the training batches, every step, or the
    /// validation split (the training batches' density scaled by the ratio between the
    /// validation split's and theirs at the last --eval-every validation; needs
    /// --eval-every > 0). Sampled training text can be sparser than held-out text.
    #[arg(long, value_enum, default_value_t = TargetTextArg::Training)]
    pub l1_target_text: TargetTextArg,
    /// The sparsity term λ weighs.
    #[arg(long, visible_alias = "l1-penalty", value_enum, default_value_t = PenaltyArg::L1)]
    pub penalty: PenaltyArg,
    /// Distill from a teacher (--teacher, else the --model checkpoint as loaded: its own
    /// activation, dense, frozen, the same one when resuming): the loss becomes
    /// (1 - α)·CE + α·KL(teacher ‖ student) + λ·L1. α in [0, 1]; 0 is off.
    #[arg(long, default_value_t = 0.0)]
    pub distill: f64,
    /// The model to distill from (an HF directory, a .gguf file or a hub id), when it is
    /// not --model: e.g. the original model while fine-tuning an already sparse one. It
    /// must share the tokenizer's vocabulary.
    #[arg(long)]
    pub teacher: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Validate every N steps (0: only at the end).
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    #[arg(long, default_value_t = 4)]
    pub eval_batches: usize,
    /// Checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// Output directory (checkpoints, train_log.jsonl).
    #[arg(long)]
    pub out: PathBuf,
    /// Time the phases of every step (forward, backward, statistics, optimizer) into
    /// the log; synchronises the device between phases.
    #[arg(long)]
    pub profile: bool,
    /// Continue a run from a checkpoint directory it wrote (weights, optimizer, step).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Train rank-R low-rank adapters (LoRA) over frozen weights instead of every
    /// weight: each checkpoint also holds them as a PEFT adapter (`adapter/`), a few MB
    /// that `--adapter` merges back into the base. Needs --ffn dense; cannot --resume.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// LoRA's alpha: B·A is scaled by alpha / rank (default: the rank, a scale of 1).
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// The projections the adapters target (comma-separated HF module names).
    #[arg(
        long,
        value_delimiter = ',',
        requires = "lora_rank",
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    pub lora_targets: Vec<String>,
    /// With --lora-rank, train these projections fully instead of through factors
    /// (comma-separated; taken out of --lora-targets): the adapter stores what training
    /// added to them, in Q4_0 blocks.
    #[arg(long, value_delimiter = ',', requires = "lora_rank")]
    pub lora_full: Vec<String>,
    /// With --lora-rank, also train a scale per output row of each adapted weight
    /// (per neuron for gate and up): what a ReLU conversion needs and low rank cannot
    /// give, for 0.3% more parameters.
    #[arg(long, requires = "lora_rank", default_value_t = true, action = clap::ArgAction::Set)]
    pub lora_row_scale: bool,
    /// Stop after the step that passes this many seconds of training, saving a
    /// checkpoint (`step-N`) to resume from: a run longer than one job's time slot.
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Data-parallel: run N processes, each on its share of every batch (--batch is the
    /// global batch, which must split evenly), averaging their gradients before each
    /// step; only the first writes the log and checkpoints. With --device cuda process r
    /// runs on cuda:r (from cuda:K, on K + r); on the CPU they share its cores.
    #[arg(long, default_value_t = 1)]
    pub processes: usize,
    /// One process per GPU: --processes N on CUDA (cuda:0 to cuda:N-1, or from --device
    /// cuda:K).
    #[arg(long, conflicts_with = "processes")]
    pub gpus: Option<usize>,
    /// How long a process of a data-parallel run waits for the others (to join, or for
    /// their next bytes) before it stops the run, in seconds.
    #[arg(long, default_value = "600", value_parser = crate::launch::parse_peer_timeout)]
    pub peer_timeout: std::time::Duration,
    #[command(flatten)]
    pub rank: RankArgs,
}

/// `--penalty`: [`sparse_train::Penalty`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PenaltyArg {
    /// Σ|h_j|, the paper's L1; on either FFN path.
    #[value(alias = "plain")]
    L1,
    /// A smooth count of the positive gates, each as a cosine (the recipe of
    /// docs/finetuning.md); needs --ffn dense.
    GateL0,
}

/// `--l1-target-text`: [`sparse_train::DensityText`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetTextArg {
    Training,
    Validation,
}

impl FinetuneArgs {
    /// The run's settings, checked.
    fn train_config(&self, dtype: DType) -> Result<TrainConfig> {
        let cfg = TrainConfig {
            seq_len: self.seq_len,
            batch_size: self.batch,
            grad_accum: self.accum,
            steps: self.steps,
            lr: self.lr,
            min_lr_ratio: self.min_lr_ratio,
            warmup_steps: self.warmup,
            weight_decay: self.weight_decay,
            clip_norm: self.clip,
            l1: self.l1,
            l1_warmup_steps: self.l1_warmup,
            penalty: match self.penalty {
                PenaltyArg::L1 => Penalty::L1,
                PenaltyArg::GateL0 => Penalty::GateL0,
            },
            seed: self.seed,
            dead_window_steps: 50,
            bf16: dtype == DType::BF16,
            profile: self.profile,
            no_activity_stats: false,
            l1_target_density: self.l1_target_density,
            l1_target_anneal_steps: self.l1_target_anneal,
            l1_target_text: match self.l1_target_text {
                TargetTextArg::Training => DensityText::Training,
                TargetTextArg::Validation => DensityText::Validation,
            },
            distill: self.distill,
            lora: self.lora_rank.map(|rank| LoraSpec {
                rank,
                alpha: self.lora_alpha.unwrap_or(rank as f64),
                targets: self
                    .lora_targets
                    .iter()
                    .filter(|t| !self.lora_full.contains(t))
                    .cloned()
                    .collect(),
                row_scale: self.lora_row_scale,
                full: self.lora_full.clone(),
            }),
        };
        cfg.validate()?;
        if cfg.l1_target_text == DensityText::Validation && self.eval_every == 0 {
            bail!(
                "--l1-target-text validation reads the density at each validation: give \
                 --eval-every > 0"
            );
        }
        Ok(cfg)
    }

    /// The number of processes of the run.
    fn world(&self) -> usize {
        self.gpus.unwrap_or(self.processes)
    }

    /// This process's device: --device, on CUDA moved to this rank's GPU.
    fn device_spec(&self, rank: Option<Rank>) -> DeviceSpec {
        crate::launch::rank_device(self.model.device, self.gpus, rank)
    }

    /// The checks that need no file.
    fn check(&self) -> Result<()> {
        let world = self.world();
        if world == 0 {
            bail!("--processes and --gpus must be at least 1");
        }
        if !self.batch.is_multiple_of(world) {
            bail!(
                "--batch {} does not split evenly over {world} processes: --batch is the \
                 global batch",
                self.batch
            );
        }
        if self.corpus.holdout == 0 {
            bail!("--holdout must be at least 1: validation needs held-out text");
        }
        if self.eval_batches == 0 {
            bail!("--eval-batches must be at least 1");
        }
        if self.lr == 0.0 {
            bail!("--lr 0 would train nothing: give a positive learning rate");
        }
        if self.teacher.is_some() && self.distill == 0.0 {
            bail!("--teacher is only read with --distill α > 0");
        }
        if let Some(limit) = self.time_limit {
            if !(limit > 0.0 && limit.is_finite()) {
                bail!("--time-limit must be a positive number of seconds, not {limit}");
            }
        }
        if self.lora_rank.is_some() {
            if self.model.ffn_mode() != FfnMode::Dense {
                bail!("--lora-rank trains through the dense FFN: add --ffn dense");
            }
            if self.resume.is_some() {
                bail!(
                    "--lora-rank cannot --resume: a checkpoint holds the merged weights, not the base; start the run again"
                );
            }
        }
        if self.penalty == PenaltyArg::GateL0 && self.model.ffn_mode() != FfnMode::Dense {
            bail!("--penalty gate-l0 is computed on the dense FFN: add --ffn dense");
        }
        Ok(())
    }

    /// The frozen, dense model to distill from: --teacher, else --model itself (not the
    /// checkpoint being resumed).
    fn teacher(&self, dtype: DType, device: &candle_core::Device) -> Result<Llama> {
        let mut teacher_args = self.model.clone();
        if let Some(t) = &self.teacher {
            teacher_args.model = Some(t.clone());
        }
        let options = LoadOptions {
            activation: None,
            ffn_mode: Some(FfnMode::Dense),
        };
        teacher_args
            .open_as(DefaultModel::Base)?
            .load_model(dtype, device, &options)
            .context("loading the distillation teacher")
    }
}

pub fn run(args: &FinetuneArgs) -> Result<()> {
    args.check()?;
    let rank = args.rank.rank();
    if rank.is_none() && args.world() > 1 {
        let on_cpu = args.device_spec(None) == DeviceSpec::Cpu;
        return crate::launch::run_ranks(args.world(), on_cpu);
    }
    // Only the first process (or the only one) writes and reports.
    let lead = rank.is_none_or(|r| r.rank == 0);
    let device = args.device_spec(rank).open()?;
    let dtype = args.model.dtype(&device);
    let cfg = args.train_config(dtype)?;
    // Resuming reads the weights from the checkpoint being resumed.
    let mut model_args = args.model.clone();
    if let Some(r) = &args.resume {
        model_args.model = Some(r.to_string_lossy().into_owned());
    }
    let ck = model_args.open_as(DefaultModel::Base)?;
    let ffn = args.model.ffn_mode();
    let mut model_cfg = ck.runtime_config(&LoadOptions {
        activation: Some(Activation::Relu),
        ffn_mode: Some(ffn),
    })?;
    model_cfg.ffn_mode = ffn;
    // Opened before the corpus is read, so a bad --teacher fails fast.
    let teacher = match args.distill > 0.0 {
        true => Some(args.teacher(dtype, &device)?),
        false => None,
    };
    let eos = model_cfg.eos_ids().first().copied();
    let (train, val) = training_text(args, &ck.tokenizer, eos, lead)?;

    let d_ff = model_cfg.intermediate_size;
    let mut trainer = Trainer::new(model_cfg, ck.tensors(DType::F32, &device)?, cfg, &device)?;
    if let Some(teacher) = teacher {
        trainer.set_teacher(teacher)?;
    }
    if let Some(r) = &args.resume {
        trainer.resume(r)?;
        if lead {
            eprintln!(
                "finetune: resumed {} at step {}",
                r.display(),
                trainer.step()
            );
        }
    }
    if let Some(r) = rank {
        join_run(&mut trainer, r, args, &device)
            .with_context(|| format!("process {} of {}", r.rank, r.world))?;
    }
    let log_path = args.out.join("train_log.jsonl");
    let (mut log, bar) = match lead {
        true => {
            std::fs::create_dir_all(&args.out)
                .with_context(|| format!("creating {}", args.out.display()))?;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .with_context(|| format!("opening {}", log_path.display()))?;
            let bar = ProgressBar::new(args.steps as u64).with_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
                    .expect("static progress template"),
            );
            (Some(log), bar)
        }
        false => (None, ProgressBar::hidden()),
    };
    bar.set_position(trainer.step() as u64);
    let save_dtype = if dtype == DType::F32 {
        DType::F32
    } else {
        DType::BF16
    };
    let adapter_info = match args.lora_rank {
        Some(_) => Some(adapter_info(&ck.source)?),
        None => None,
    };
    let save = |trainer: &Trainer, dir: &std::path::Path| -> Result<()> {
        trainer.save(dir, &ck.tokenizer, ck.chat_template.as_deref(), save_dtype)?;
        if let (Some(factors), Some(info), Some(spec)) =
            (trainer.lora_factors()?, &adapter_info, &trainer.cfg.lora)
        {
            let targets: Vec<&str> = spec.targets.iter().map(String::as_str).collect();
            let base = info.base_file.clone().unwrap_or_default();
            let config = adapter::peft_config(spec.rank, spec.alpha, &targets, &base);
            let full = trainer.lora_full_deltas()?;
            LoraAdapter::save(
                &dir.join("adapter"),
                &config,
                info,
                &factors,
                &full,
                DType::F16,
            )?;
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    while trainer.step() < args.steps {
        let mut entry = trainer.train_step(&train)?;
        let step = trainer.step();
        if (args.eval_every > 0 && step % args.eval_every == 0) || step == args.steps {
            let v = trainer.validate(&val, args.eval_batches)?;
            (entry.val_ce, entry.val_l0) = (Some(v.ce), v.mean_l0);
        }
        if let Some(log) = &mut log {
            writeln!(log, "{}", serde_json::to_string(&entry)?)?;
        }
        bar.set_message(progress_line(&entry, d_ff));
        bar.set_position(step as u64);
        let mut out_of_time = args
            .time_limit
            .is_some_and(|limit| started.elapsed().as_secs_f64() >= limit);
        if args.time_limit.is_some() {
            // The first process's clock decides for all of them.
            let mut flag = [u8::from(out_of_time)];
            trainer.communicator().broadcast(&mut flag)?;
            out_of_time = flag[0] == 1;
        }
        let scheduled = args.save_every > 0 && step % args.save_every == 0;
        if (scheduled || out_of_time) && step < args.steps {
            let dir = args.out.join(format!("step-{step}"));
            if lead {
                save(&trainer, &dir)?;
            }
            if out_of_time {
                bar.abandon();
                if !lead {
                    return Ok(());
                }
                eprintln!(
                    "finetune: --time-limit reached at step {step} of {}; continue with --resume {}",
                    args.steps,
                    dir.display()
                );
                return Ok(());
            }
        }
    }
    bar.finish();
    if !lead {
        return Ok(());
    }
    let final_dir = args.out.join("final");
    save(&trainer, &final_dir)?;
    let curve_path = args.out.join("train_curve.svg");
    crate::chart::training_curves(&curve_path, &[crate::curves::read(&log_path, None)?])?;
    eprintln!(
        "finetune: wrote {}, {} and {}",
        final_dir.display(),
        log_path.display(),
        curve_path.display()
    );
    Ok(())
}

/// Joins this process to the run: over TCP, and on a GPU of a build with `nccl`, then
/// through NCCL (its unique id sent over TCP).
fn join_run(
    trainer: &mut Trainer,
    rank: Rank,
    args: &FinetuneArgs,
    device: &candle_core::Device,
) -> Result<()> {
    let (comm, how) = crate::launch::communicator(rank, device, args.peer_timeout)?;
    if rank.rank == 0 {
        eprintln!(
            "finetune: {} processes, each on {} of every {} sequences{how}",
            rank.world,
            args.batch / rank.world,
            args.batch
        );
    }
    trainer.join(comm)?;
    Ok(())
}

/// What an adapter records of its base: the file it merges into, by name and SHA-256
/// (a directory checkpoint records neither), and the ReLU its merged model runs.
fn adapter_info(base: &std::path::Path) -> Result<TwellAdapterInfo> {
    let (base_sha256, base_file) = match base.is_file() {
        true => (
            Some(adapter::sha256_file(base)?),
            base.file_name().map(|n| n.to_string_lossy().into_owned()),
        ),
        false => (None, None),
    };
    Ok(TwellAdapterInfo {
        hidden_act: Activation::Relu.hf_name().into(),
        base_sha256,
        base_file,
        ffn_mode: None,
    })
}

/// The training and validation sequences: the corpus' training documents (at most
/// --max-train-tokens of them) and --extra-data, which may never include a held-out
/// document; the held-out documents for validation.
fn training_text(
    args: &FinetuneArgs,
    tokenizer: &tokenizers::Tokenizer,
    eos: Option<u32>,
    report: bool,
) -> Result<(PackedData, PackedData)> {
    let (train_docs, val_docs) = args.corpus.split()?;
    let mut train_tokens = train_docs.tokenize(tokenizer, eos)?;
    if args.max_train_tokens > 0 {
        train_tokens.truncate(args.max_train_tokens);
    }
    let mut extra_docs = 0;
    if let Some(spec) = &args.extra_data {
        let extra = Corpus::open(spec).with_context(|| format!("opening --extra-data {spec}"))?;
        let held_out: std::collections::HashSet<_> = val_docs
            .files
            .iter()
            .filter_map(|v| std::fs::canonicalize(v).ok())
            .collect();
        if let Some(f) = extra
            .files
            .iter()
            .find(|f| std::fs::canonicalize(f).is_ok_and(|f| held_out.contains(&f)))
        {
            bail!(
                "--extra-data includes {}, a held-out document: validation text must never be trained on",
                f.display()
            );
        }
        extra_docs = extra.files.len();
        if let Some(e) = eos {
            train_tokens.push(e);
        }
        train_tokens.extend(extra.tokenize(tokenizer, eos)?);
    }
    let train = PackedData::new(&train_tokens, args.seq_len)?;
    let val = PackedData::new(&val_docs.tokenize(tokenizer, eos)?, args.seq_len)?;
    if !report {
        return Ok((train, val));
    }
    eprintln!(
        "finetune: {} training sequences of {} tokens ({} documents, {} of them --extra-data), {} validation sequences ({} documents)",
        train.len(),
        args.seq_len,
        train_docs.files.len() + extra_docs,
        extra_docs,
        val.len(),
        val_docs.files.len()
    );
    Ok((train, val))
}

/// The progress bar's message after a step.
fn progress_line(entry: &StepLog, d_ff: usize) -> String {
    let kl = entry.kl.map(|v| format!(" kl {v:.3}")).unwrap_or_default();
    // The steered target as an L0, to read against the one measured.
    let target = entry
        .l1_target
        .map(|t| format!(" (target {:.1})", t * d_ff as f64))
        .unwrap_or_default();
    let val = entry
        .val_ce
        .map(|v| format!(" val {v:.3}"))
        .unwrap_or_default()
        + &entry
            .val_l0
            .map(|v| format!(" (L0 {v:.1})"))
            .unwrap_or_default();
    format!(
        "ce {:.3}{kl} l1 {:.1} λ {:.1e} L0 {:.1}{target} dead {:.1}% lr {:.1e} {:.0} tok/s{val}",
        entry.ce,
        entry.l1,
        entry.l1_coefficient,
        entry.mean_l0,
        100.0 * entry.dead_fraction,
        entry.lr,
        entry.tokens_per_sec,
    )
}
