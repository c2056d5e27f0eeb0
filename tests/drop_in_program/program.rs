// A candle-examples-style Llama program (as candle-examples/examples/llama/main.rs):
// config.json → `into_config` → `Llama::load` → a cached greedy loop that stops at any
// of `LlamaEosToks`. It names the model only through `model::`, the import of the file
// that includes it; nothing here knows which implementation it runs.

use std::path::Path;

use anyhow::{Error as E, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::generation::{LogitsProcessor, Sampling};
use model::{Llama, LlamaConfig};

const EOS_TOKEN: &str = "</s>";

/// Greedy generation of up to `sample_len` tokens after `prompt`, as the example does.
pub fn generate(dir: &Path, prompt: &str, sample_len: usize) -> Result<Vec<u32>> {
    let device = Device::Cpu;
    let dtype = DType::F32;
    let config: LlamaConfig = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    let config = config.into_config(false);
    let tokenizer =
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(E::msg)?;
    // SAFETY: the files are not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], dtype, &device)?
    };
    let llama = Llama::load(vb, &config)?;
    let mut cache = model::Cache::new(true, dtype, &config, &device)?;
    let eos_token_id = config
        .eos_token_id
        .clone()
        .or_else(|| tokenizer.token_to_id(EOS_TOKEN).map(model::LlamaEosToks::Single));
    let mut tokens = tokenizer
        .encode(prompt, true)
        .map_err(E::msg)?
        .get_ids()
        .to_vec();
    let mut logits_processor = LogitsProcessor::from_sampling(299792458, Sampling::ArgMax);
    let mut index_pos = 0;
    let mut generated = Vec::new();
    for index in 0..sample_len {
        let (context_size, context_index) = if cache.use_kv_cache && index > 0 {
            (1, index_pos)
        } else {
            (tokens.len(), 0)
        };
        let ctxt = &tokens[tokens.len().saturating_sub(context_size)..];
        let input = Tensor::new(ctxt, &device)?.unsqueeze(0)?;
        let logits = llama.forward(&input, context_index, &mut cache)?;
        let logits = logits.squeeze(0)?;
        index_pos += ctxt.len();
        let next_token = logits_processor.sample(&logits)?;
        tokens.push(next_token);
        generated.push(next_token);
        match eos_token_id {
            Some(model::LlamaEosToks::Single(eos_tok_id)) if next_token == eos_tok_id => break,
            Some(model::LlamaEosToks::Multiple(ref eos_ids)) if eos_ids.contains(&next_token) => {
                break
            }
            _ => (),
        }
    }
    Ok(generated)
}

/// The last position's logits through `embed` + `forward_input_embed` (as LLaVA feeds
/// the model), and through `forward` on the same tokens.
pub fn logits_both_ways(dir: &Path, tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
    let device = Device::Cpu;
    let config: LlamaConfig = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    let config = config.into_config(false);
    // SAFETY: the files are not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &device)?
    };
    let llama = Llama::load(vb, &config)?;
    let input = Tensor::new(tokens, &device)?.unsqueeze(0)?;
    let mut cache = model::Cache::new(false, DType::F32, &config, &device)?;
    let via_embed = llama.forward_input_embed(&llama.embed(&input)?, 0, &mut cache)?;
    let mut cache = model::Cache::new(false, DType::F32, &config, &device)?;
    let direct = llama.forward(&input, 0, &mut cache)?;
    Ok((via_embed.i(0)?.to_vec1()?, direct.i(0)?.to_vec1()?))
}

/// What the module exports beside the model, as candle-transformers' llama does.
pub fn constants() -> (usize, usize) {
    let cfg = model::Config::config_7b_v2(false);
    let rope = model::Llama3RopeConfig {
        rope_type: model::Llama3RopeType::Llama3,
        ..Default::default()
    };
    let _ = rope;
    (model::DEFAULT_MAX_SEQ_LEN, cfg.intermediate_size)
}
