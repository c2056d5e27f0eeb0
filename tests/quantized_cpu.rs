//! CPU inference through quantized rows on the real default model: a GGUF read tensor
//! by tensor (with the shipped adapter merged into each as it is read) equals the eager
//! read and merge; a model quantized as it loads equals one quantized after loading;
//! and the quantized path's logits stay close to the f32 model's.

mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use sparse_llama::adapter::LoraAdapter;
use sparse_llama::checkpoint::{Checkpoint, LoadOptions};
use sparse_llama::{Cache, CpuQuantization, Llama, QuantFormat};

fn shipped_adapter() -> LoraAdapter {
    LoraAdapter::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-sparse"))
        .unwrap()
}

fn plan(layers: QuantFormat) -> CpuQuantization {
    CpuQuantization {
        head: Some(QuantFormat::Q8),
        attention: Some(layers),
        mlp: Some(layers),
    }
}

/// Logits of a 12-token prompt and one decode step after it.
fn logits(model: &Llama) -> Tensor {
    let cfg = model.config().clone();
    let mut cache = Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let prompt: Vec<u32> = vec![504, 3458, 282, 4649, 314, 216, 30, 1117, 253, 1789, 11, 339];
    let x = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let a = model.forward_all(&x, 0, &mut cache).unwrap();
    let one = Tensor::new(&[[1345u32]], &Device::Cpu).unwrap();
    let b = model.forward_all(&one, prompt.len(), &mut cache).unwrap();
    Tensor::cat(&[a, b], 1).unwrap()
}

#[test]
fn a_gguf_read_tensor_by_tensor_with_the_adapter_equals_the_eager_merge() {
    let Some(gguf) = common::default_model() else {
        return;
    };
    let adapter = shipped_adapter();
    let mut eager = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .tensors(DType::F32, &Device::Cpu)
        .unwrap();
    adapter.merge_into(&mut eager).unwrap();
    let lazy = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .with_adapter(&adapter)
        .unwrap()
        .tensors(DType::F32, &Device::Cpu)
        .unwrap();
    assert_eq!(lazy.len(), eager.len());
    for name in [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ] {
        let diff = (&lazy[name] - &eager[name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0, "{name}");
    }
    // A second adapter on top is refused, not merged twice.
    let twice = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .with_adapter(&adapter)
        .unwrap()
        .with_adapter(&adapter);
    assert!(twice.is_err());
}

#[test]
fn a_model_quantized_as_it_loads_equals_one_quantized_after_and_tracks_f32() {
    let Some(gguf) = common::default_model() else {
        return;
    };
    let ck = Checkpoint::open(gguf.to_str().unwrap()).unwrap();
    assert_eq!(
        ck.layer_block_type,
        Some(candle_core::quantized::GgmlDType::Q4_1)
    );
    let opts = LoadOptions::default();
    let streamed = ck
        .load_model_quantized(&opts, plan(QuantFormat::Q4_1))
        .unwrap();
    let mut after = ck.load_model(DType::F32, &Device::Cpu, &opts).unwrap();
    let f32_logits = logits(&after);
    after.fuse_qkv().unwrap();
    after.quantize_for_cpu(plan(QuantFormat::Q4_1)).unwrap();
    let (a, b) = (logits(&streamed), logits(&after));
    // The same rows; only the embeddings differ, read from the Q8 head (the GGUF's
    // Q8_0 table, so equal up to the last bit of a scale).
    let same = common::rel_l2(&a, &b);
    assert!(same < 1e-4, "streamed vs after: {same}");
    // Against f32: the tokens' int8 rounding (the weights are the GGUF's own blocks).
    let err = common::rel_l2(&a, &f32_logits);
    assert!(err > 0.0 && err < 0.05, "quantized vs f32: {err}");
    let last = |t: &Tensor| -> u32 {
        t.squeeze(0)
            .unwrap()
            .get(12)
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    assert_eq!(last(&a), last(&f32_logits));
    let tokens = Tensor::new(&[[5u32, 17, 99]], &Device::Cpu).unwrap();
    let e = streamed
        .forward_train(&tokens)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("load_quantized"), "{e}");
}

#[test]
fn the_sparse_default_quantized_as_it_loads_runs_the_sparse_path() {
    let Some(gguf) = common::default_model() else {
        return;
    };
    let ck = Checkpoint::open(gguf.to_str().unwrap())
        .unwrap()
        .with_adapter(&shipped_adapter())
        .unwrap();
    assert_eq!(
        ck.layer_block_type, None,
        "merged weights are off the GGUF's grid"
    );
    assert_eq!(
        ck.attention_block_type,
        Some(candle_core::quantized::GgmlDType::Q4_1),
        "the attention's low-rank factors run beside the GGUF's own blocks"
    );
    let opts = LoadOptions {
        ffn_mode: Some(twell::FfnMode::Sparse),
        ..Default::default()
    };
    let quantized = CpuQuantization {
        attention: Some(QuantFormat::Q4_1),
        ..plan(QuantFormat::Q8)
    };
    let mut streamed = ck.load_model_quantized(&opts, quantized).unwrap();
    streamed.record_ffn_stats(true);
    let mut f32_model = ck.load_model(DType::F32, &Device::Cpu, &opts).unwrap();
    f32_model.record_ffn_stats(true);
    let (a, b) = (logits(&streamed), logits(&f32_model));
    let err = common::rel_l2(&a, &b);
    assert!(err < 0.05, "quantized sparse vs f32 sparse: {err}");
    for mlp in streamed.mlps() {
        assert!(mlp.is_quantized());
        assert_eq!(mlp.last_side(), Some(twell::auto::Side::Sparse));
        let d = mlp.last_stats().unwrap().unwrap().density;
        assert!(d > 0.0 && d < 0.3, "density {d}");
    }
}
