//! Writes tiny random Llama checkpoints (ReLU and SiLU) with our saver, plus the logits
//! our model computes for a fixed token sequence, so `scripts/check_transformers.py`
//! can load them with transformers' LlamaForCausalLM and compare.
//!
//! Run: `cargo run --release --example export_tiny -- <out-dir>`

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_twell::sparse_llama::checkpoint::save_hf;
use candle_twell::sparse_llama::tokenizer::byte_level_tokenizer;
use candle_twell::sparse_llama::{Cache, Llama, LlamaConfig};
use candle_twell::twell::density::gaussian;
use rand::{rngs::StdRng, SeedableRng};

/// The text whose tokens (by our tokenizer) are scored; the Python side checks that
/// transformers' tokenizer gives the same ids.
const TEXT: &str = "Hello world!";

fn main() -> Result<()> {
    let out = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .context("usage: export_tiny <out-dir>")?,
    );
    for act in ["relu", "silu"] {
        let hf: LlamaConfig = serde_json::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 256, "vocab_size": 258,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
            "tie_word_embeddings": true, "hidden_act": act, "bos_token_id": 256, "eos_token_id": 257
        }))?;
        let cfg = hf.into_config(false);
        let mut rng = StdRng::seed_from_u64(7);
        let mut t = |shape: &[usize], std: f64, offset: f32| -> Result<Tensor> {
            let n = shape.iter().product();
            let v: Vec<f32> = gaussian(&mut rng, n, std)
                .into_iter()
                .map(|x| x + offset)
                .collect();
            Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
        };
        let (h, f, v, kv) = (64, 256, 258, 32);
        let mut w: HashMap<String, Tensor> = HashMap::new();
        w.insert("model.embed_tokens.weight".into(), t(&[v, h], 1.0, 0.0)?);
        w.insert("model.norm.weight".into(), t(&[h], 0.1, 1.0)?);
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            for (name, shape) in [
                ("self_attn.q_proj", [h, h]),
                ("self_attn.k_proj", [kv, h]),
                ("self_attn.v_proj", [kv, h]),
                ("self_attn.o_proj", [h, h]),
                ("mlp.gate_proj", [f, h]),
                ("mlp.up_proj", [f, h]),
                ("mlp.down_proj", [h, f]),
            ] {
                w.insert(format!("{p}.{name}.weight"), t(&shape, 0.1, 0.0)?);
            }
            w.insert(format!("{p}.input_layernorm.weight"), t(&[h], 0.1, 1.0)?);
            w.insert(
                format!("{p}.post_attention_layernorm.weight"),
                t(&[h], 0.1, 1.0)?,
            );
        }
        let dir = out.join(format!("tiny-{act}"));
        let tokenizer = byte_level_tokenizer()?;
        save_hf(&dir, &w, &cfg, &tokenizer, None, DType::F32)?;
        let tokens = tokenizer
            .encode(TEXT, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec();
        let model = Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), &cfg)?;
        let mut cache = Cache::new(false, DType::F32, &cfg, &Device::Cpu)?;
        let x = Tensor::new(tokens.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let logits = model
            .forward_all(&x, 0, &mut cache)?
            .squeeze(0)?
            .to_vec2::<f32>()?;
        let expected = serde_json::json!({ "text": TEXT, "tokens": tokens, "logits": logits });
        std::fs::write(dir.join("expected_logits.json"), expected.to_string())?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}
