//! One candle-examples-style Llama program (tests/drop_in_program/program.rs), compiled
//! twice: once importing candle-transformers' llama module, once `candle_twell::
//! sparse_llama`, the import being the only difference. On a tiny checkpoint in the
//! Llama 3.2 layout (tied embeddings, llama3 RoPE scaling, several end-of-sequence
//! ids, a BOS-adding tokenizer) both generate the same tokens.

mod common;

mod candle_program {
    use candle_transformers::models::llama as model;
    include!("drop_in_program/program.rs");
}

mod twell_program {
    use candle_twell::sparse_llama as model;
    include!("drop_in_program/program.rs");
}

use candle_core::{DType, Device};
use sparse_llama::LlamaConfig;

/// A Llama 3.2-style checkpoint (random weights) in `dir`: config.json with
/// `rope_scaling` type llama3 and three end-of-sequence ids, model.safetensors,
/// tokenizer.json.
fn llama32_checkpoint(dir: &std::path::Path) {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 192,
        "vocab_size": 262,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3"
        },
        "max_position_embeddings": 256,
        "tie_word_embeddings": true,
        "hidden_act": "silu",
        "bos_token_id": 256,
        "eos_token_id": [257, 258, 259],
        "torch_dtype": "float32"
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let hf: LlamaConfig = serde_json::from_value(json).unwrap();
    let cfg = hf.into_config(false);
    let w = common::tiny_weights(&cfg, 32);
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    let tok = sparse_llama::tokenizer::byte_level_tokenizer().unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
}

#[test]
fn the_same_program_generates_the_same_tokens_with_either_import() {
    let dir = tempfile::tempdir().unwrap();
    llama32_checkpoint(dir.path());
    // Long enough that positions pass the scaled RoPE's original context (64).
    let prompt = "The state of the union is strong, and the work goes on. ".repeat(2);
    let theirs = candle_program::generate(dir.path(), &prompt, 40).unwrap();
    let ours = twell_program::generate(dir.path(), &prompt, 40).unwrap();
    assert!(!theirs.is_empty());
    assert_eq!(ours, theirs);
}

#[test]
fn input_embeddings_give_the_logits_of_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    llama32_checkpoint(dir.path());
    let tokens: Vec<u32> = (0..90).map(|i| (i * 37 % 250) as u32).collect();
    let (ours_embed, ours_direct) = twell_program::logits_both_ways(dir.path(), &tokens).unwrap();
    let (theirs_embed, theirs_direct) =
        candle_program::logits_both_ways(dir.path(), &tokens).unwrap();
    let rel = |a: &[f32], b: &[f32]| {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    };
    assert!(rel(&ours_embed, &ours_direct) < 1e-6);
    assert!(
        rel(&ours_direct, &theirs_direct) < 1e-4,
        "{}",
        rel(&ours_direct, &theirs_direct)
    );
    assert!(rel(&ours_embed, &theirs_embed) < 1e-4);
}

#[test]
fn the_module_exports_what_candle_transformers_does() {
    assert_eq!(twell_program::constants(), candle_program::constants());
}

#[test]
fn unsupported_configs_are_refused_when_the_model_is_built() {
    let mut hf = common::tiny_config("gelu_pytorch_tanh", 128);
    let cfg = hf.clone().into_config(false);
    let vb = candle_nn::VarBuilder::zeros(DType::F32, &Device::Cpu);
    let e = sparse_llama::Llama::load(vb.clone(), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gelu"), "{e}");
    hf.hidden_act = "silu".into();
    let cfg = hf.into_config(true);
    let e = sparse_llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("flash attention"), "{e}");
}
