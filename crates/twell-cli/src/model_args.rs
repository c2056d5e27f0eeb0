//! `--model`, `--ffn`, `--relu`, `--device`, `--dtype`: how every subcommand opens a model.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use sparse_llama::adapter::{self, LoraAdapter};
use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
use sparse_llama::{CpuQuantization, Llama, QuantFormat};
use twell::cpu::quant::BLOCK as QUANT_BLOCK;
use twell::{Activation, FfnMode};

use crate::device::{DeviceSpec, DtypeArg, FfnArg};

/// The default model's base, as fetched by `scripts/setup.sh`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The sparse default model: a LoRA adapter (ReLU gate, sparsity fine-tune) over
/// [`DEFAULT_MODEL_FILE`], which `scripts/setup.sh` installs from the repository's
/// `models/` into the data directory.
pub const DEFAULT_ADAPTER_DIR: &str = "smollm2-135m-sparse";

/// What a command runs when no --model is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultModel {
    /// The sparse default (base + adapter), unless --dense.
    Sparse,
    /// The base alone: what fine-tuning and sampling start from.
    Base,
}

/// The data directory: `$TWELL_DATA`, else `./data`.
pub fn data_dir() -> PathBuf {
    std::env::var_os("TWELL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("data"))
}

/// The default text: the State of the Union corpus in the data directory.
pub fn default_corpus() -> String {
    data_dir().join("sotu").to_string_lossy().into_owned()
}

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// An HF checkpoint directory, a .gguf file, or an org/name id in the hf-hub cache.
    /// Default: the SmolLM2-135M-Instruct GGUF in the data directory.
    #[arg(long)]
    pub model: Option<String>,
    /// Merge this LoRA adapter (a PEFT directory, as `finetune --lora-rank` writes)
    /// into --model's weights.
    #[arg(long, requires = "model")]
    pub adapter: Option<PathBuf>,
    /// Run the default model's dense original (SiLU, no adapter) instead of the sparse
    /// default: the comparison for the sparse one.
    #[arg(long, conflicts_with_all = ["model", "adapter"])]
    pub dense: bool,
    /// Feed-forward path (default: the one an adapter declares, as the sparse default
    /// model declares `sparse`; otherwise `auto`).
    #[arg(long, value_enum)]
    pub ffn: Option<FfnArg>,
    /// Run the MLP gate with ReLU instead of the checkpoint's activation (a
    /// ReLU-converted model; quality needs fine-tuning).
    #[arg(long)]
    pub relu: bool,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Compute dtype (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Inference on the CPU in f32 through quantized weight rows: every matrix (`all`:
    /// attention, MLP, head), the attention and the head at decode sizes (`attention`),
    /// the output head alone (`head`), or none (f32 weights throughout).
    #[arg(long, value_enum, default_value_t = QuantizeArg::All)]
    pub quantize: QuantizeArg,
    /// The rows' format: `auto` keeps a GGUF's own Q4_1 layers where the weights are the
    /// file's (the head, and anything merged or fine-tuned, in Q8); `q8` (int8 per block
    /// of 32) or `q4-1` everywhere but the head.
    #[arg(long, value_enum, default_value_t = QuantFormatArg::Auto)]
    pub quant_format: QuantFormatArg,
}

/// `--quantize`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeArg {
    All,
    Attention,
    Head,
    None,
}

/// `--quant-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormatArg {
    Auto,
    Q8,
    #[value(name = "q4-1")]
    Q4_1,
}

impl QuantizeArg {
    /// The plan for a checkpoint whose attention and MLP matrices are stored as
    /// `attention_block_type` and `mlp_block_type` (`None` where they are not a file's
    /// own blocks): `auto` keeps a file's Q4_1, else quantizes to Q8.
    pub fn plan(
        self,
        format: QuantFormatArg,
        attention_block_type: Option<candle_core::quantized::GgmlDType>,
        mlp_block_type: Option<candle_core::quantized::GgmlDType>,
    ) -> CpuQuantization {
        let pick = |stored: Option<candle_core::quantized::GgmlDType>| match format {
            QuantFormatArg::Q8 => QuantFormat::Q8,
            QuantFormatArg::Q4_1 => QuantFormat::Q4_1,
            QuantFormatArg::Auto => match stored {
                Some(candle_core::quantized::GgmlDType::Q4_1) => QuantFormat::Q4_1,
                _ => QuantFormat::Q8,
            },
        };
        let head = Some(QuantFormat::Q8);
        match self {
            Self::All => CpuQuantization {
                head,
                attention: Some(pick(attention_block_type)),
                mlp: Some(pick(mlp_block_type)),
            },
            Self::Attention => CpuQuantization {
                head,
                attention: Some(pick(attention_block_type)),
                mlp: None,
            },
            Self::Head => CpuQuantization {
                head,
                ..Default::default()
            },
            Self::None => CpuQuantization::default(),
        }
    }
}

/// The installed sparse default adapter, or an error saying how to install it.
fn default_adapter_dir() -> Result<PathBuf> {
    let dir = data_dir().join(DEFAULT_ADAPTER_DIR);
    if !dir.join(adapter::WEIGHTS_FILE).exists() {
        bail!(
            "the sparse default model's adapter {} is missing: run scripts/setup.sh first (or pass --dense for the dense original)",
            dir.display()
        );
    }
    Ok(dir)
}

impl ModelArgs {
    pub fn model_spec(&self) -> Result<String> {
        match &self.model {
            Some(m) => Ok(m.clone()),
            None => {
                let p = data_dir().join(DEFAULT_MODEL_FILE);
                if !p.exists() {
                    bail!(
                        "no --model given and the default model {} is missing: run scripts/setup.sh first",
                        p.display()
                    );
                }
                Ok(p.to_string_lossy().into_owned())
            }
        }
    }

    pub fn device(&self) -> Result<Device> {
        self.device.open()
    }

    pub fn dtype(&self, device: &Device) -> DType {
        crate::device::DtypeArg::or_default(self.dtype, device)
    }

    /// The FFN path asked for, `auto` when none is.
    pub fn ffn_mode(&self) -> FfnMode {
        self.ffn.map_or(FfnMode::Auto, FfnArg::mode)
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            activation: self.relu.then_some(Activation::Relu),
            ffn_mode: Some(self.ffn_mode()),
        }
    }

    /// The checkpoint: --model (with --adapter merged), else the sparse default, or its
    /// dense base with --dense.
    pub fn open(&self) -> Result<Checkpoint> {
        self.open_as(DefaultModel::Sparse)
    }

    /// The checkpoint, with `default` deciding what runs when no --model is given.
    pub fn open_as(&self, default: DefaultModel) -> Result<Checkpoint> {
        Ok(self.open_with_mode(default)?.0)
    }

    /// The checkpoint, and the FFN path to run it on: --ffn, else the merged adapter's
    /// own, else `auto`.
    fn open_with_mode(&self, default: DefaultModel) -> Result<(Checkpoint, FfnMode)> {
        let spec = self.model_spec()?;
        let adapter = match (&self.model, &self.adapter) {
            (Some(_), Some(dir)) => Some(dir.clone()),
            (Some(_), None) => None,
            (None, _) if self.dense || default == DefaultModel::Base => None,
            (None, _) => Some(default_adapter_dir()?),
        };
        let ck = Checkpoint::open(&spec).with_context(|| format!("opening model '{spec}'"))?;
        let Some(dir) = adapter else {
            return Ok((ck, self.ffn_mode()));
        };
        let adapter = LoraAdapter::load(&dir)
            .with_context(|| format!("loading the adapter {}", dir.display()))?;
        let declared = adapter.ffn_mode()?;
        let ck = ck
            .with_adapter(&adapter)
            .with_context(|| format!("merging the adapter {} into {spec}", dir.display()))?;
        let mode = match self.ffn {
            Some(f) => f.mode(),
            None => declared.unwrap_or(FfnMode::Auto),
        };
        Ok((ck, mode))
    }

    /// The checkpoint and its model on the chosen device and dtype, q, k and v fused
    /// (inference: `eval`, `generate`).
    pub fn open_for_inference(&self) -> Result<(Checkpoint, Llama)> {
        self.open_for_inference_as(DefaultModel::Sparse)
    }

    /// [`Self::open_for_inference`] with `default` deciding what runs without --model.
    pub fn open_for_inference_as(&self, default: DefaultModel) -> Result<(Checkpoint, Llama)> {
        let device = self.device()?;
        let dtype = self.dtype(&device);
        let (ck, mode) = self.open_with_mode(default)?;
        let options = LoadOptions {
            ffn_mode: Some(mode),
            ..self.load_options()
        };
        let mut plan = match device.is_cpu() && dtype == DType::F32 {
            true => self.quantize.plan(
                self.quant_format,
                ck.attention_block_type,
                ck.layer_block_type,
            ),
            false => CpuQuantization::default(),
        };
        let cfg = ck.runtime_config(&options)?;
        let widths = [
            ("hidden size", cfg.hidden_size),
            ("intermediate size", cfg.intermediate_size),
            ("attention width", cfg.num_attention_heads * cfg.head_dim()),
        ];
        if plan != CpuQuantization::default() {
            if let Some((what, n)) = widths.iter().find(|(_, n)| n % QUANT_BLOCK != 0) {
                eprintln!(
                    "note: the model's {what} ({n}) is not a multiple of {QUANT_BLOCK}, the \
                     quantized rows' block: running its f32 weights (--quantize none)"
                );
                plan = CpuQuantization::default();
            }
        }
        // Every matrix quantized: each layer as it loads, the f32 model never whole.
        if plan.attention.is_some() && plan.mlp.is_some() {
            let model = ck.load_model_quantized(&options, plan)?;
            model.prepare_inference()?;
            return Ok((ck, model));
        }
        let mut model = ck.load_model(dtype, &device, &options)?;
        model.fuse_qkv()?;
        // Folding the norms' weights into the MLPs would move a GGUF's weights off their
        // Q4_1 grid, and the quantized MLP has no use for it (the CUDA kernels do).
        if plan.mlp.is_none() {
            model.fold_mlp_norms()?;
        }
        model.prepare_inference()?;
        model.quantize_for_cpu(plan)?;
        Ok((ck, model))
    }
}
