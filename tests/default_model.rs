//! The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from scripts/setup.sh):
//! tokenizer, greedy "Paris", perplexity, GGUF → HF conversion, and the TwELL path
//! on the ReLU-converted model. Under CI=true a missing model fails these tests.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{corpus_dir, default_model, rel_l2};
use sparse_llama::checkpoint::{save_hf, Checkpoint, LoadOptions};
use sparse_llama::corpus::Corpus;
use sparse_llama::generate::{generate, GenerationConfig};
use sparse_llama::Cache;
use twell::{Activation, FfnMode};

const PROMPT: &str = "The capital of France is";

fn open() -> Option<Checkpoint> {
    default_model().map(|p| Checkpoint::open(p.to_str().unwrap()).unwrap())
}

#[test]
fn tokenizer_rebuilt_from_gguf_matches_upstream_ids() {
    let Some(ck) = open() else { return };
    let ids = ck
        .tokenizer
        .encode(PROMPT, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids, vec![504, 3575, 282, 4649, 314]);
    assert_eq!(ck.tokenizer.decode(&ids, false).unwrap(), PROMPT);
    assert_eq!(ck.tokenizer.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(ck.config.num_hidden_layers, 30);
    assert_eq!(ck.config.tie_word_embeddings, Some(true));
    let chat = ck.chat_format().unwrap().prompt(None, "Hi");
    assert!(
        chat.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"),
        "{chat}"
    );
    assert!(chat.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
}

#[test]
fn greedy_generation_says_paris() {
    let Some(ck) = open() else { return };
    let mut model = ck
        .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
        .unwrap();
    let prompt = ck
        .tokenizer
        .encode(PROMPT, false)
        .unwrap()
        .get_ids()
        .to_vec();
    let cfg = GenerationConfig {
        max_new_tokens: 3,
        ..Default::default()
    };
    let mut text = String::new();
    let (tokens, stats) = generate(
        &mut model,
        &ck.tokenizer,
        &prompt,
        &[2],
        &cfg,
        &Device::Cpu,
        |t| text.push_str(t),
    )
    .unwrap();
    assert_eq!(ck.tokenizer.decode(&tokens[..1], false).unwrap(), " Paris");
    assert!(text.starts_with(" Paris"), "{text}");
    assert_eq!(stats.prompt_tokens, 5);
    // And with probability close to the reference dequantizer's 0.77.
    let mut cache = Cache::new(true, DType::F32, model.config(), &Device::Cpu).unwrap();
    let x = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let p = candle_nn::ops::softmax_last_dim(&model.forward(&x, 0, &mut cache).unwrap()).unwrap();
    let paris = p
        .squeeze(0)
        .unwrap()
        .get(tokens[0] as usize)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!((paris - 0.77).abs() < 0.02, "p(Paris) = {paris}");
}

#[test]
fn perplexity_on_held_out_speeches_matches_reference() {
    let Some(ck) = open() else { return };
    let model = ck
        .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
        .unwrap();
    let corpus = Corpus::open(corpus_dir().to_str().unwrap()).unwrap();
    assert_eq!(corpus.files.len(), 233);
    let tokens = corpus.last(5).tokenize(&ck.tokenizer, Some(2)).unwrap();
    let ppl =
        sparse_llama::perplexity::perplexity(&model, &tokens, 512, 4, &Device::Cpu, |_, _| Ok(()))
            .unwrap();
    assert!(
        (ppl.perplexity / 22.7 - 1.0).abs() < 0.02,
        "perplexity {}",
        ppl.perplexity
    );
}

#[test]
fn relu_converted_model_twell_path_equals_dense_reglu() {
    let Some(ck) = open() else { return };
    let load = |mode| {
        ck.load_model(
            DType::F32,
            &Device::Cpu,
            &LoadOptions {
                activation: Some(Activation::Relu),
                ffn_mode: Some(mode),
            },
        )
        .unwrap()
    };
    let text = "It is a great honor to stand here tonight and report on the state of our union.";
    let ids = ck.tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let run = |model: &sparse_llama::Llama| {
        let mut cache = Cache::new(false, DType::F32, model.config(), &Device::Cpu).unwrap();
        model.forward_all(&x, 0, &mut cache).unwrap()
    };
    let mut sparse = load(FfnMode::Sparse);
    sparse.record_ffn_stats(true);
    let dense = load(FfnMode::Dense);
    let (ls, ld) = (run(&sparse), run(&dense));
    let e = rel_l2(&ls, &ld);
    assert!(e < 1e-4, "rel err {e}");
    let stats = sparse.ffn_stats().unwrap();
    assert_eq!(stats.len(), 30);
    assert!(stats.iter().all(|s| s
        .as_ref()
        .is_some_and(|s| s.sparse && s.density > 0.0 && s.density < 1.0)));
}

#[test]
fn gguf_converts_to_an_hf_directory_with_equal_logits() {
    let Some(ck) = open() else { return };
    let out = tempfile::tempdir().unwrap();
    let cfg = ck.runtime_config(&LoadOptions::default()).unwrap();
    let tensors = ck.tensors(DType::F32, &Device::Cpu).unwrap();
    save_hf(
        out.path(),
        &tensors,
        &cfg,
        &ck.tokenizer,
        ck.chat_template.as_deref(),
        DType::F32,
    )
    .unwrap();
    let hf = Checkpoint::open(out.path().to_str().unwrap()).unwrap();
    assert!(hf.chat_template.is_some());
    let ids = ck
        .tokenizer
        .encode(PROMPT, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(
        hf.tokenizer.encode(PROMPT, false).unwrap().get_ids(),
        ids.as_slice()
    );
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = |ck: &Checkpoint| {
        let m = ck
            .load_model(DType::F32, &Device::Cpu, &LoadOptions::default())
            .unwrap();
        let mut cache = Cache::new(false, DType::F32, m.config(), &Device::Cpu).unwrap();
        m.forward(&x, 0, &mut cache).unwrap()
    };
    assert_eq!(rel_l2(&logits(&hf), &logits(&ck)), 0.0);
}
