//! The shipped sparse default model: models/smollm2-135m-sparse, a LoRA adapter over the
//! default SmolLM2-135M-Instruct GGUF with a ReLU gate. Its files check out, it merges
//! onto its base only, it runs the TwELL path at about 5% mean FFN density, and it
//! answers the README's question and part of the chat prompts of
//! tests/data/chat-prompts.json. It answers fewer of them than the dense original (8 of
//! 20 against 16 when measured, docs/finetuning.md): this test guards that level, not
//! the "about as well". Under CI=true a missing model fails these tests.

mod common;

use std::path::{Path, PathBuf};

use candle_core::Device;
use sparse_llama::adapter::{self, LoraAdapter};
use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
use sparse_llama::generate::{generate, GenerationConfig};
use sparse_llama::{CpuQuantization, QuantFormat};
use twell::{Activation, FfnMode};

fn shipped_adapter() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-sparse")
}

struct ChatPrompt {
    prompt: String,
    /// Any of these words in the answer makes it right.
    any: Vec<String>,
}

fn chat_prompts() -> Vec<ChatPrompt> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat-prompts.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|p| ChatPrompt {
            prompt: p["prompt"].as_str().unwrap().to_string(),
            any: p["any"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_str().unwrap().to_string())
                .collect(),
        })
        .collect()
}

/// Greedy answers (at most `max` tokens) to each prompt in the model's chat template, and
/// the mean FFN density of the decode steps where recorded.
fn answers(
    ck: &Checkpoint,
    model: &mut sparse_llama::Llama,
    max: usize,
) -> (Vec<String>, Option<f64>) {
    let chat = ck.chat_format().unwrap();
    let end = ck.tokenizer.token_to_id("<|im_end|>").unwrap();
    let cfg = GenerationConfig {
        max_new_tokens: max,
        ..Default::default()
    };
    let mut densities = Vec::new();
    let texts = chat_prompts()
        .iter()
        .map(|p| {
            let text = chat.prompt(None, &p.prompt);
            let ids = ck
                .tokenizer
                .encode(text.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec();
            let (tokens, stats) = generate(
                model,
                &ck.tokenizer,
                &ids,
                &[end],
                &cfg,
                &Device::Cpu,
                |_| {},
            )
            .unwrap();
            densities.extend(stats.mean_ffn_density);
            ck.tokenizer.decode(&tokens, true).unwrap()
        })
        .collect();
    let mean =
        (!densities.is_empty()).then(|| densities.iter().sum::<f64>() / densities.len() as f64);
    (texts, mean)
}

fn hits(texts: &[String]) -> Vec<bool> {
    chat_prompts()
        .iter()
        .zip(texts)
        .map(|(p, t)| p.any.iter().any(|w| t.contains(w.as_str())))
        .collect()
}

#[test]
fn sparse_default_answers_paris_and_part_of_the_chat_prompts() {
    let Some(gguf) = common::default_model() else {
        return;
    };
    // As the main job runs them on the CPU: through quantized rows, the dense default
    // in its GGUF's Q4_1, the sparse default (merged weights) in Q8.
    let plan = |layers| CpuQuantization {
        head: Some(QuantFormat::Q8),
        attention: Some(layers),
        mlp: Some(layers),
    };
    let dense_ck = Checkpoint::open(gguf.to_str().unwrap()).unwrap();
    let mut dense = dense_ck
        .load_model_quantized(&LoadOptions::default(), plan(QuantFormat::Q4_1))
        .unwrap();
    let adapter = LoraAdapter::load(&shipped_adapter()).unwrap();
    let sparse_ck = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .with_adapter(&adapter)
        .unwrap();
    let mut sparse = sparse_ck
        .load_model_quantized(
            &LoadOptions {
                activation: None,
                ffn_mode: Some(FfnMode::Sparse),
            },
            plan(QuantFormat::Q8),
        )
        .unwrap();
    assert_eq!(sparse.config().activation, Activation::Relu);
    sparse.record_ffn_stats(true);

    let (dense_texts, _) = answers(&dense_ck, &mut dense, 32);
    let (sparse_texts, density) = answers(&sparse_ck, &mut sparse, 32);
    let (dense_hits, sparse_hits) = (hits(&dense_texts), hits(&sparse_texts));
    for ((p, d), s) in chat_prompts().iter().zip(&dense_texts).zip(&sparse_texts) {
        eprintln!(
            "Q: {}\n  dense:  {}\n  sparse: {}",
            p.prompt,
            d.replace('\n', " "),
            s.replace('\n', " ")
        );
    }
    let count = |h: &[bool]| h.iter().filter(|&&x| x).count();
    eprintln!(
        "right answers: dense {} / {}, sparse {} / {}",
        count(&dense_hits),
        dense_hits.len(),
        count(&sparse_hits),
        sparse_hits.len()
    );
    // The README's question, and at least the share of the list it answers on this
    // path (6 of 20; 8 with f32 weights), less a margin for rounding on other hosts;
    // the dense default, as a check of the harness, most of the list (15; 16 in f32).
    assert!(sparse_hits[0], "no Paris: {}", sparse_texts[0]);
    assert!(
        count(&sparse_hits) >= 5,
        "sparse {} right against dense {}",
        count(&sparse_hits),
        count(&dense_hits)
    );
    assert!(
        count(&dense_hits) >= 12,
        "dense {} right",
        count(&dense_hits)
    );
    // Held-out speeches read 5.00% (docs/finetuning.md); chat answers run a little
    // denser (5.3% here when it shipped).
    let density = density.expect("the sparse model records its density");
    assert!(density <= 0.06, "mean FFN density {density}");
}

#[test]
fn the_shipped_adapter_checks_out_and_refuses_damage() {
    let dir = shipped_adapter();
    adapter::verify_checksums(&dir).unwrap();
    // It runs the TwELL path at every call unless --ffn says otherwise.
    let shipped = LoraAdapter::load(&dir).unwrap();
    assert_eq!(shipped.ffn_mode().unwrap(), Some(FfnMode::Sparse));
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    let weights = copy.path().join(adapter::WEIGHTS_FILE);
    let bytes = std::fs::read(&weights).unwrap();
    // Truncated: named, with the checksum it fails.
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let e = format!("{:#}", LoraAdapter::load(copy.path()).unwrap_err());
    assert!(
        e.contains("checksum mismatch") && e.contains(adapter::WEIGHTS_FILE),
        "{e}"
    );
    // Missing.
    std::fs::remove_file(&weights).unwrap();
    let e = format!("{:#}", LoraAdapter::load(copy.path()).unwrap_err());
    assert!(e.contains("missing"), "{e}");
    // Onto another base: refused by its recorded checksum.
    std::fs::write(&weights, &bytes).unwrap();
    let a = LoraAdapter::load(copy.path()).unwrap();
    let other = copy.path().join("other.gguf");
    std::fs::write(&other, b"not the base").unwrap();
    let e = format!("{:#}", a.check_base(&other).unwrap_err());
    assert!(e.contains("was trained on a base"), "{e}");
}

/// Runs `scripts/setup.sh` of the repository copy `repo` with `TWELL_DATA=data`.
fn run_setup(repo: &Path, data: &Path) -> (bool, String) {
    let out = std::process::Command::new("bash")
        .arg(repo.join("scripts/setup.sh"))
        .env("TWELL_DATA", data)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn truncate(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    std::fs::write(path, &bytes[..bytes.len() / 2]).unwrap();
}

#[test]
fn setup_installs_the_adapter_whole_and_refuses_a_damaged_one() {
    let Some(gguf) = common::default_model() else {
        return;
    };
    let data_dir = gguf.parent().unwrap();
    // Beside the real data, so the GGUF can be hard-linked (setup checks its size and
    // checksum and fetches nothing).
    let tmp = tempfile::tempdir_in(data_dir).unwrap();
    let (repo, data) = (tmp.path().join("repo"), tmp.path().join("data"));
    std::fs::create_dir_all(repo.join("scripts")).unwrap();
    std::fs::create_dir_all(repo.join("models/smollm2-135m-sparse")).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(root.join("scripts/setup.sh"), repo.join("scripts/setup.sh")).unwrap();
    for entry in std::fs::read_dir(shipped_adapter()).unwrap() {
        let entry = entry.unwrap();
        let to = repo
            .join("models/smollm2-135m-sparse")
            .join(entry.file_name());
        std::fs::copy(entry.path(), to).unwrap();
    }
    std::fs::hard_link(&gguf, data.join(gguf.file_name().unwrap())).unwrap();
    std::os::unix::fs::symlink(data_dir.join("sotu"), data.join("sotu")).unwrap();
    let installed = data.join("smollm2-135m-sparse");

    let (ok, log) = run_setup(&repo, &data);
    assert!(ok, "{log}");
    adapter::verify_checksums(&installed).unwrap();

    // A damaged installed copy is replaced.
    truncate(&installed.join(adapter::FULL_DELTAS_FILE));
    let (ok, log) = run_setup(&repo, &data);
    assert!(ok, "{log}");
    adapter::verify_checksums(&installed).unwrap();

    // A damaged shipped copy is refused, and nothing is installed from it.
    std::fs::remove_dir_all(&installed).unwrap();
    truncate(
        &repo
            .join("models/smollm2-135m-sparse")
            .join(adapter::WEIGHTS_FILE),
    );
    let (ok, log) = run_setup(&repo, &data);
    assert!(!ok, "setup passed a damaged adapter:\n{log}");
    assert!(log.contains("damaged") && log.contains("checksum"), "{log}");
    assert!(!installed.exists());
    assert!(!data.join("smollm2-135m-sparse.part").exists());
}
