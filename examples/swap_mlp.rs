//! An existing candle Llama program, switched to the sparse-FFN model.
//!
//! The dense program started with
//!
//! ```ignore
//! use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
//! ```
//!
//! and is otherwise this file: the switch is the import below. The model then runs its
//! MLPs through TwELL whenever they are ReLU-gated, and can report their density
//! (tests/drop_in_program.rs holds a whole candle-examples-style program to both
//! imports).
//!
//! Run: `cargo run --release --example swap_mlp -- <hf-checkpoint-dir>`
//! (make one from the default GGUF with `twell convert --relu --out data/smollm2-relu`).

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_twell::sparse_llama::{Cache, Llama, LlamaConfig};

fn main() -> Result<()> {
    let dir = std::env::args()
        .nth(1)
        .context("usage: swap_mlp <hf-checkpoint-dir>")?;
    let dir = std::path::Path::new(&dir);
    let device = Device::Cpu;

    let config: LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let config = config.into_config(false);
    let tokenizer =
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    // SAFETY: the checkpoint is not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &device)?
    };
    let mut model = Llama::load(vb, &config)?;
    model.record_ffn_stats(true); // not in candle-transformers: per-layer FFN density

    let mut cache = Cache::new(true, DType::F32, &config, &device)?;
    let mut tokens = tokenizer
        .encode("The capital of France is", false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    let mut index_pos = 0;
    for _ in 0..8 {
        let input = &tokens[index_pos..];
        let x = Tensor::new(input, &device)?.unsqueeze(0)?;
        let logits = model.forward(&x, index_pos, &mut cache)?;
        index_pos += input.len();
        tokens.push(logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?);
    }
    println!(
        "{}",
        tokenizer
            .decode(&tokens, false)
            .map_err(anyhow::Error::msg)?
    );
    let densities: Vec<f64> = model
        .ffn_stats()?
        .into_iter()
        .flatten()
        .map(|s| s.density)
        .collect();
    if !densities.is_empty() {
        let mean = densities.iter().sum::<f64>() / densities.len() as f64;
        println!("mean FFN density of the last token: {:.2}%", 100.0 * mean);
    }
    Ok(())
}
