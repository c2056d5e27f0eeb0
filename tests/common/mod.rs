//! Shared test helpers: tiny synthetic Llama checkpoints and the default model.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use sparse_llama::{Config, LlamaConfig};
use tokenizers::Tokenizer;
use twell::density::gaussian;

/// The default model fetched by `scripts/setup.sh`. Under `CI=true` a missing model
/// fails the test; elsewhere the test is skipped with a note.
pub fn default_model() -> Option<PathBuf> {
    let dir = std::env::var_os("TWELL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "{} is missing: CI must run scripts/setup.sh first",
            path.display()
        );
    }
    eprintln!(
        "skipping: {} is missing (run scripts/setup.sh)",
        path.display()
    );
    None
}

pub fn corpus_dir() -> PathBuf {
    default_model()
        .map(|m| m.parent().unwrap().join("sotu"))
        .unwrap_or_default()
}

/// A tiny Llama config.json (2 layers, GQA, tied embeddings).
pub fn tiny_config(hidden_act: &str, ffn: usize) -> LlamaConfig {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": ffn,
        "vocab_size": 262,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": true,
        "hidden_act": hidden_act,
        "bos_token_id": 256,
        "eos_token_id": 257
    });
    serde_json::from_value(json).unwrap()
}

/// Random weights for `cfg`, HF names, f32.
pub fn tiny_weights(cfg: &Config, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = |shape: (usize, usize), std: f64| {
        Tensor::from_vec(
            gaussian(&mut rng, shape.0 * shape.1, std),
            shape,
            &Device::Cpu,
        )
        .unwrap()
    };
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    let mut m = HashMap::new();
    m.insert("model.embed_tokens.weight".into(), t((v, h), 1.0));
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        m.insert(format!("{p}.self_attn.q_proj.weight"), t((h, h), 0.1));
        m.insert(format!("{p}.self_attn.k_proj.weight"), t((kv, h), 0.1));
        m.insert(format!("{p}.self_attn.v_proj.weight"), t((kv, h), 0.1));
        m.insert(format!("{p}.self_attn.o_proj.weight"), t((h, h), 0.1));
        m.insert(format!("{p}.mlp.gate_proj.weight"), t((f, h), 0.1));
        m.insert(format!("{p}.mlp.up_proj.weight"), t((f, h), 0.1));
        m.insert(format!("{p}.mlp.down_proj.weight"), t((h, f), 0.1));
        m.insert(
            format!("{p}.input_layernorm.weight"),
            (t((1, h), 0.1) + 1.0).unwrap().squeeze(0).unwrap(),
        );
        m.insert(
            format!("{p}.post_attention_layernorm.weight"),
            (t((1, h), 0.1) + 1.0).unwrap().squeeze(0).unwrap(),
        );
    }
    m.insert(
        "model.norm.weight".into(),
        (t((1, h), 0.1) + 1.0).unwrap().squeeze(0).unwrap(),
    );
    m
}

/// A byte-level BPE over the 256 byte symbols (no merges) plus `<s>`, `</s>`.
pub fn tiny_tokenizer() -> Tokenizer {
    sparse_llama::tokenizer::byte_level_tokenizer().unwrap()
}

/// Writes a tiny checkpoint directory and returns it (kept alive by the TempDir).
pub fn tiny_checkpoint(
    hidden_act: &str,
    ffn: usize,
    seed: u64,
) -> (tempfile::TempDir, Config, HashMap<String, Tensor>) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(hidden_act, ffn).into_config(false);
    let w = tiny_weights(&cfg, seed);
    sparse_llama::checkpoint::save_hf(dir.path(), &w, &cfg, &tiny_tokenizer(), None, DType::F32)
        .unwrap();
    (dir, cfg, w)
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    fused_ops::compare::rel_l2(a, b).unwrap()
}
