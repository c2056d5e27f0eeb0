//! `--model`, `--ffn`, `--relu`, `--device`, `--dtype`: how every subcommand opens a model.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
use sparse_llama::Llama;
use twell::{Activation, FfnMode};

use crate::device::{DeviceSpec, DtypeArg, FfnArg};

/// The default model, as fetched by `scripts/setup.sh`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

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
    /// Feed-forward path.
    #[arg(long, value_enum, default_value_t = FfnArg::Auto)]
    pub ffn: FfnArg,
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
        match self.dtype {
            Some(d) => d.dtype(),
            None if device.is_cuda() => DType::BF16,
            None => DType::F32,
        }
    }

    pub fn ffn_mode(&self) -> FfnMode {
        self.ffn.mode()
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            activation: self.relu.then_some(Activation::Relu),
            ffn_mode: Some(self.ffn_mode()),
        }
    }

    pub fn open(&self) -> Result<Checkpoint> {
        let spec = self.model_spec()?;
        Checkpoint::open(&spec).with_context(|| format!("opening model '{spec}'"))
    }

    /// The checkpoint and its model on the chosen device and dtype, q, k and v fused
    /// (inference: `eval`, `generate`, `sample`).
    pub fn open_for_inference(&self) -> Result<(Checkpoint, Llama)> {
        let device = self.device()?;
        let dtype = self.dtype(&device);
        let ck = self.open()?;
        let mut model = ck.load_model(dtype, &device, &self.load_options())?;
        model.fuse_qkv()?;
        model.fold_mlp_norms()?;
        Ok((ck, model))
    }
}
