//! Checkpoint IO: save/load round trips (single, sharded, bf16, hub cache), the
//! TwELL path on a ReLU checkpoint, and a clear error for every kind of bad input.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{rel_l2, tiny_checkpoint, tiny_config, tiny_tokenizer, tiny_weights};
use sparse_llama::checkpoint::{save_hf, Checkpoint, LoadOptions};
use sparse_llama::Cache;
use twell::FfnMode;

fn logits(model: &sparse_llama::Llama) -> Tensor {
    let mut cache = Cache::new(false, DType::F32, model.config(), &Device::Cpu).unwrap();
    let x = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]], &Device::Cpu).unwrap();
    model.forward_all(&x, 0, &mut cache).unwrap()
}

fn open_err(spec: &str) -> String {
    match Checkpoint::open(spec) {
        Ok(_) => panic!("'{spec}' opened but should not"),
        Err(e) => format!("{e}"),
    }
}

fn load_err(dir: &Path) -> String {
    let r = Checkpoint::open(dir.to_str().unwrap())
        .and_then(|ck| ck.load_model(DType::F32, &Device::Cpu, &LoadOptions::default()));
    match r {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => format!("{e}"),
    }
}

#[test]
fn saved_checkpoint_loads_back_with_equal_logits() {
    let (dir, cfg, w) = tiny_checkpoint("silu", 256, 1);
    let reference =
        sparse_llama::Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), &cfg)
            .unwrap();
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    let model = ck
        .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
        .unwrap();
    assert_eq!(rel_l2(&logits(&model), &logits(&reference)), 0.0);
    // config.json written back is a plain LlamaForCausalLM config with our block.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(json["architectures"][0], "LlamaForCausalLM");
    assert_eq!(json["hidden_act"], "silu");
    assert_eq!(json["torch_dtype"], "float32");
    // Tied embeddings: no lm_head tensor is stored.
    let st =
        candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(!st.contains_key("lm_head.weight"));
}

#[test]
fn bf16_save_round_trips_within_bf16_rounding() {
    let (_dir, cfg, w) = tiny_checkpoint("relu", 256, 2);
    let out = tempfile::tempdir().unwrap();
    save_hf(out.path(), &w, &cfg, &tiny_tokenizer(), None, DType::BF16).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(json["torch_dtype"], "bfloat16");
    assert_eq!(json["hidden_act"], "relu");
    let ck = Checkpoint::open(out.path().to_str().unwrap()).unwrap();
    let model = ck
        .load_model(
            DType::F32,
            &Device::Cpu,
            &LoadOptions {
                ffn_mode: Some(FfnMode::Dense),
                ..Default::default()
            },
        )
        .unwrap();
    let reference =
        sparse_llama::Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), &cfg)
            .unwrap();
    let e = rel_l2(&logits(&model), &logits(&reference));
    assert!(e < 3e-2, "{e}");
}

#[test]
fn sharded_checkpoints_load() {
    let cfg = tiny_config("silu", 256).into_config(false);
    let w = tiny_weights(&cfg, 4);
    let dir = tempfile::tempdir().unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let shard: HashMap<String, Tensor> =
            part.iter().map(|n| ((*n).clone(), w[*n].clone())).collect();
        candle_core::safetensors::save(&shard, dir.path().join(file)).unwrap();
        for n in part {
            map.insert((*n).clone(), serde_json::Value::String(file.into()));
        }
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&tiny_config("silu", 256)).unwrap(),
    )
    .unwrap();
    tiny_tokenizer()
        .save(dir.path().join("tokenizer.json"), false)
        .unwrap();
    let model = Checkpoint::open(dir.path().to_str().unwrap())
        .unwrap()
        .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
        .unwrap();
    let reference =
        sparse_llama::Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), &cfg)
            .unwrap();
    assert_eq!(rel_l2(&logits(&model), &logits(&reference)), 0.0);

    // A shard named in the index but missing is reported by name.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    assert!(open_err(dir.path().to_str().unwrap()).contains("model-00002-of-00002"));
}

#[test]
fn model_ids_resolve_from_the_hub_cache_offline() {
    let (src, _, _) = tiny_checkpoint("silu", 256, 5);
    let hub = tempfile::tempdir().unwrap();
    let repo = hub.path().join("models--tiny-org--tiny-llama");
    let snap = repo.join("snapshots").join("abc123");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc123").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.path().join(f), snap.join(f)).unwrap();
    }
    let ck = Checkpoint::open_hub_in(hub.path(), "tiny-org/tiny-llama").unwrap();
    assert_eq!(ck.config.hidden_size, 64);
    let e = Checkpoint::open_hub_in(hub.path(), "tiny-org/absent")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not in the hf-hub cache"), "{e}");
}

#[test]
fn twell_path_equals_dense_regl_on_a_relu_checkpoint() {
    // Tiny tiles (4 slots each) so that the overflow fallback is exercised too.
    for (tile, cf) in [(256, 8), (32, 8)] {
        let mut hf = tiny_config("relu", 300);
        hf.twell = Some(sparse_llama::SparseSettings {
            ffn_mode: twell::FfnMode::Sparse,
            tile,
            compression: cf,
            l1_coefficient: None,
        });
        let cfg = hf.into_config(false);
        let w = tiny_weights(&cfg, 6);
        let dir = tempfile::tempdir().unwrap();
        save_hf(dir.path(), &w, &cfg, &tiny_tokenizer(), None, DType::F32).unwrap();
        let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
        let mut model = ck
            .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
            .unwrap();
        assert_eq!(model.config().ffn_mode, FfnMode::Sparse);
        model.record_ffn_stats(true);
        let sparse = logits(&model);
        let stats = model.ffn_stats().unwrap();
        assert!(stats.iter().all(|s| s.as_ref().is_some_and(|s| s.sparse)));
        model.set_ffn_mode(FfnMode::Dense).unwrap();
        let dense = logits(&model);
        assert!(
            rel_l2(&sparse, &dense) < 1e-5,
            "tile {tile}: {}",
            rel_l2(&sparse, &dense)
        );
    }
}

#[test]
fn bad_paths_and_files_give_clear_errors() {
    assert!(open_err("/definitely/not/here").contains("neither a directory"));
    let empty = tempfile::tempdir().unwrap();
    assert!(open_err(empty.path().to_str().unwrap()).contains("config.json"));

    let bin = empty.path().join("model.bin");
    std::fs::write(&bin, b"xx").unwrap();
    assert!(open_err(bin.to_str().unwrap()).contains(".gguf"));

    let gguf = empty.path().join("broken.gguf");
    std::fs::write(&gguf, b"this is not a gguf file at all").unwrap();
    assert!(open_err(gguf.to_str().unwrap()).contains("not a readable GGUF"));
}

/// A valid tiny checkpoint with one file edited by `edit`.
fn broken(edit: impl FnOnce(&Path)) -> tempfile::TempDir {
    let (dir, _, _) = tiny_checkpoint("silu", 256, 7);
    edit(dir.path());
    dir
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

#[test]
fn bad_configs_are_rejected_with_the_reason() {
    let d = broken(|d| std::fs::write(d.join("config.json"), "{ not json").unwrap());
    assert!(load_err(d.path()).contains("not a valid Llama config.json"));
    let d = broken(|d| {
        edit_config(d, |v| {
            v["architectures"] = serde_json::json!(["MistralForCausalLM"])
        })
    });
    assert!(load_err(d.path()).contains("only LlamaForCausalLM"));
    let d = broken(|d| edit_config(d, |v| v["hidden_act"] = "gelu".into()));
    assert!(load_err(d.path()).contains("hidden_act"));
    let d = broken(|d| edit_config(d, |v| v["num_attention_heads"] = 5.into()));
    assert!(load_err(d.path()).contains("heads"));
    // Llama 3 RoPE scaling loads (tests/drop_in_program.rs runs it); an incomplete one
    // names the missing field, another scaling type names itself.
    let d = broken(|d| {
        edit_config(d, |v| {
            v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0})
        })
    });
    let e = load_err(d.path());
    assert!(e.contains("low_freq_factor"), "{e}");
    let d = broken(|d| {
        edit_config(d, |v| {
            v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64})
        })
    });
    let e = load_err(d.path());
    assert!(e.contains("yarn"), "{e}");
    let d = broken(|d| {
        edit_config(d, |v| {
            v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64})
        })
    });
    let e = load_err(d.path());
    assert!(e.contains("high_freq_factor > low_freq_factor"), "{e}");
    // A config that promises MLP biases the weights do not hold names the missing one.
    let d = broken(|d| edit_config(d, |v| v["mlp_bias"] = true.into()));
    assert!(load_err(d.path()).contains("mlp.gate_proj.bias"));
    let d = broken(|d| edit_config(d, |v| v["twell"] = serde_json::json!({"ffn_mode": "turbo"})));
    assert!(load_err(d.path()).contains("turbo"));
    let d = broken(|d| edit_config(d, |v| v["twell"] = serde_json::json!({"tile": 100})));
    assert!(load_err(d.path()).contains("tile width"));
    // SiLU weights cannot take the sparse path.
    let (dir, _, _) = tiny_checkpoint("silu", 256, 8);
    let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
    let e = ck
        .load_model(
            DType::F32,
            &Device::Cpu,
            &LoadOptions {
                ffn_mode: Some(FfnMode::Sparse),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("ReLU"), "{e}");
}

#[test]
fn bad_weights_and_tokenizers_are_rejected_with_the_reason() {
    let d = broken(|d| std::fs::remove_file(d.join("tokenizer.json")).unwrap());
    assert!(load_err(d.path()).contains("tokenizer.json"));
    let d = broken(|d| std::fs::write(d.join("tokenizer.json"), "[]").unwrap());
    assert!(load_err(d.path()).contains("not a valid tokenizer.json"));
    let d = broken(|d| std::fs::remove_file(d.join("model.safetensors")).unwrap());
    assert!(load_err(d.path()).contains("no model.safetensors"));
    let d = broken(|d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(load_err(d.path()).contains("not a valid safetensors"));
    // A weight of the wrong shape is named.
    let d = broken(|d| {
        let p = d.join("model.safetensors");
        let mut st = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        st.insert(
            "model.layers.1.mlp.up_proj.weight".into(),
            Tensor::zeros((255, 64), DType::F32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&st, &p).unwrap();
    });
    let e = load_err(d.path());
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    // A missing weight is named.
    let d = broken(|d| {
        let p = d.join("model.safetensors");
        let mut st = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        st.remove("model.layers.0.self_attn.k_proj.weight");
        candle_core::safetensors::save(&st, &p).unwrap();
    });
    let e = load_err(d.path());
    assert!(e.contains("model.layers.0.self_attn.k_proj.weight"), "{e}");
    // Integer weights are refused rather than converted.
    let d = broken(|d| {
        let p = d.join("model.safetensors");
        let mut st = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        st.insert(
            "model.norm.weight".into(),
            Tensor::zeros(64, DType::U32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&st, &p).unwrap();
    });
    assert!(load_err(d.path()).contains("float weights only"));
}
