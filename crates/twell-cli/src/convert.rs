//! `twell convert`: a GGUF (or any loadable checkpoint) to an HF checkpoint directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::Device;
use sparse_llama::checkpoint::{save_hf, LoadOptions};

use crate::model_args::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Output directory (created).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &ConvertArgs) -> Result<()> {
    let ck = args.model.open()?;
    let dtype = args.model.dtype(&Device::Cpu);
    let opts = LoadOptions {
        activation: args.model.relu.then_some(twell::Activation::Relu),
        ffn_mode: None,
    };
    let cfg = ck.runtime_config(&opts)?;
    let tensors = ck.tensors(dtype, &Device::Cpu)?;
    save_hf(
        &args.out,
        &tensors,
        &cfg,
        &ck.tokenizer,
        ck.chat_template.as_deref(),
        dtype,
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote {} ({} tensors, {:?})",
        args.out.display(),
        tensors.len(),
        dtype
    );
    Ok(())
}
