//! "Drop-in": with a dense SwiGLU config, SparseLlama gives the logits of
//! candle-transformers' Llama on the same weights, for prefill and cached decode, with
//! its q, k, v projections split (as loaded) or fused for inference (`fuse_qkv`).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama as candle_llama;
use common::{rel_l2, tiny_config, tiny_weights};
use sparse_llama::AttentionPath;

#[test]
fn same_logits_as_candle_transformers_llama() {
    let dev = Device::Cpu;
    let hf = tiny_config("silu", 256);
    let ours_cfg = hf.clone().into_config(false);
    let w = tiny_weights(&ours_cfg, 1);
    let theirs_cfg: candle_llama::LlamaConfig =
        serde_json::from_value(serde_json::to_value(&hf).unwrap()).unwrap();
    let theirs_cfg = theirs_cfg.into_config(false);

    let theirs = candle_llama::Llama::load(
        VarBuilder::from_tensors(w.clone(), DType::F32, &dev),
        &theirs_cfg,
    )
    .unwrap();
    // Split or fused projections; the fused ones also with our fused ops' CPU forms
    // (`AttentionPath::Fused`), whose prefill turns the keys in place and lets the
    // attention turn q; and that with each MLP's norm weight folded into its weights
    // (`fold_mlp_norms`), whose prefill adds the output projection to the residual
    // (`residual_add_linear`) and starts the MLP sublayer from the sum.
    for (fused, path, fold) in [
        (false, AttentionPath::Auto, false),
        (true, AttentionPath::Auto, false),
        (true, AttentionPath::Fused, false),
        (true, AttentionPath::Fused, true),
    ] {
        let mut ours = sparse_llama::Llama::load(
            VarBuilder::from_tensors(w.clone(), DType::F32, &dev),
            &ours_cfg,
        )
        .unwrap();
        if fused {
            ours.fuse_qkv().unwrap();
        }
        if fold {
            ours.fold_mlp_norms().unwrap();
        }
        ours.set_attention_path(path);
        assert_eq!(ours.is_qkv_fused(), fused);
        assert_eq!(ours.are_mlp_norms_folded(), fold);
        let mut cache_theirs =
            candle_llama::Cache::new(true, DType::F32, &theirs_cfg, &dev).unwrap();
        let mut cache_ours = sparse_llama::Cache::new(true, DType::F32, &ours_cfg, &dev).unwrap();

        let prompt = Tensor::new(&[[5u32, 17, 99, 3, 250, 42, 7, 7, 1, 200]], &dev).unwrap();
        let a = theirs.forward(&prompt, 0, &mut cache_theirs).unwrap();
        let b = ours.forward(&prompt, 0, &mut cache_ours).unwrap();
        assert_eq!(a.dims(), b.dims());
        assert!(
            rel_l2(&b, &a) < 1e-5,
            "fused {fused}, prefill: {}",
            rel_l2(&b, &a)
        );
        // Two more tokens at once, then single steps: the cache moves into its buffer.
        let pair = Tensor::new(&[[11u32, 12]], &dev).unwrap();
        let a = theirs.forward(&pair, 10, &mut cache_theirs).unwrap();
        let b = ours.forward(&pair, 10, &mut cache_ours).unwrap();
        assert!(rel_l2(&b, &a) < 1e-5, "fused {fused}, two tokens");
        for (step, tok) in [13u32, 14, 15].into_iter().enumerate() {
            let x = Tensor::new(&[[tok]], &dev).unwrap();
            let a = theirs.forward(&x, 12 + step, &mut cache_theirs).unwrap();
            let b = ours.forward(&x, 12 + step, &mut cache_ours).unwrap();
            assert!(
                rel_l2(&b, &a) < 1e-5,
                "fused {fused}, decode step {step}: {}",
                rel_l2(&b, &a)
            );
        }
        assert_eq!(cache_ours.len(), 15);
        // A fused model refuses to train: its gradients would reach no variable.
        if fused {
            let err = ours.forward_train(&prompt).err().expect("refused");
            assert!(err.to_string().contains("fuse_qkv"), "{err}");
        }
    }
}

/// `fold_mlp_norms` moves each MLP norm's weight into the MLP's gate and up weights: a
/// ReLU model on the TwELL path gives the same logits folded or not (prefill, a chunk,
/// a decode step), on the plain and on the fused attention, and a folded model refuses
/// to train.
#[test]
fn folded_mlp_norms_keep_a_sparse_models_logits() {
    let dev = Device::Cpu;
    let cfg = tiny_config("relu", 256).into_config(false);
    let w = tiny_weights(&cfg, 2);
    let load = |fold: bool, path: AttentionPath| {
        let mut model =
            sparse_llama::Llama::load(VarBuilder::from_tensors(w.clone(), DType::F32, &dev), &cfg)
                .unwrap();
        model.set_ffn_mode(twell::FfnMode::Sparse).unwrap();
        model.fuse_qkv().unwrap();
        if fold {
            model.fold_mlp_norms().unwrap();
            // A second call leaves the weights as they are.
            model.fold_mlp_norms().unwrap();
        }
        model.set_attention_path(path);
        model
    };
    let run = |model: &sparse_llama::Llama| {
        let mut cache = sparse_llama::Cache::new(true, DType::F32, &cfg, &dev).unwrap();
        let prompt = Tensor::new(&[[5u32, 17, 99, 3, 250, 42, 7, 7, 1, 200]], &dev).unwrap();
        let a = model.forward_all(&prompt, 0, &mut cache).unwrap();
        let pair = Tensor::new(&[[11u32, 12]], &dev).unwrap();
        let b = model.forward_all(&pair, 10, &mut cache).unwrap();
        let one = Tensor::new(&[[13u32]], &dev).unwrap();
        let c = model.forward_all(&one, 12, &mut cache).unwrap();
        Tensor::cat(&[a, b, c], 1).unwrap()
    };
    for path in [AttentionPath::Plain, AttentionPath::Fused] {
        let want = run(&load(false, path));
        let got = run(&load(true, path));
        assert_eq!(got.dims(), want.dims());
        let err = rel_l2(&got, &want);
        assert!(err < 1e-5, "{path:?}: {err}");
    }
    let mut folded =
        sparse_llama::Llama::load(VarBuilder::from_tensors(w.clone(), DType::F32, &dev), &cfg)
            .unwrap();
    folded.fold_mlp_norms().unwrap();
    let tokens = Tensor::new(&[[5u32, 17, 99]], &dev).unwrap();
    let err = folded.forward_train(&tokens).err().expect("refused");
    assert!(err.to_string().contains("fold_mlp_norms"), "{err}");
}

/// `quantize_for_cpu` runs the attention, the MLPs and the head through quantized rows:
/// the logits stay within the rounding of the f32 model's (prefill and a decode step),
/// the greedy token of each position nearly always the same, on the dense (SiLU) and the
/// sparse (ReLU) MLP; Q4_1 rows reproduce weights already on the Q4_1 grid (a GGUF's),
/// leaving only the tokens' int8 rounding; a model so prepared refuses to train.
#[test]
fn quantized_rows_keep_the_logits_within_their_rounding() {
    use sparse_llama::{CpuQuantization, QuantFormat};
    let dev = Device::Cpu;
    let all = |f: QuantFormat| CpuQuantization {
        head: Some(QuantFormat::Q8),
        attention: Some(f),
        mlp: Some(f),
    };
    for (act, sparse, format) in [
        ("silu", false, QuantFormat::Q8),
        ("relu", true, QuantFormat::Q8),
        ("silu", false, QuantFormat::Q4_1),
        ("relu", true, QuantFormat::Q4_1),
    ] {
        let cfg = tiny_config(act, 256).into_config(false);
        let mut w = tiny_weights(&cfg, 3);
        if format == QuantFormat::Q4_1 {
            // The layers' matrices on the Q4_1 grid, as a GGUF stores them.
            for (name, t) in w.iter_mut() {
                if name.starts_with("model.layers.") && t.rank() == 2 {
                    let q = candle_core::quantized::QTensor::quantize(
                        t,
                        candle_core::quantized::GgmlDType::Q4_1,
                    )
                    .unwrap();
                    *t = q.dequantize(&dev).unwrap();
                }
            }
        }
        let load = || {
            let mut m = sparse_llama::Llama::load(
                VarBuilder::from_tensors(w.clone(), DType::F32, &dev),
                &cfg,
            )
            .unwrap();
            if sparse {
                m.set_ffn_mode(twell::FfnMode::Sparse).unwrap();
            }
            m
        };
        let run = |model: &sparse_llama::Llama| {
            let mut cache = sparse_llama::Cache::new(true, DType::F32, &cfg, &dev).unwrap();
            let prompt = Tensor::new(&[[5u32, 17, 99, 3, 250, 42, 7, 7, 1, 200]], &dev).unwrap();
            let a = model.forward_all(&prompt, 0, &mut cache).unwrap();
            let one = Tensor::new(&[[13u32]], &dev).unwrap();
            let b = model.forward_all(&one, 10, &mut cache).unwrap();
            Tensor::cat(&[a, b], 1).unwrap()
        };
        let want = run(&load());
        let mut quantized = load();
        let e = quantized
            .quantize_for_cpu(all(format))
            .unwrap_err()
            .to_string();
        assert!(e.contains("fuse_qkv"), "{e}");
        quantized.fuse_qkv().unwrap();
        quantized.quantize_for_cpu(all(format)).unwrap();
        assert!(quantized.mlps().all(|m| m.is_quantized()));
        let got = run(&quantized);
        let err = rel_l2(&got, &want);
        assert!(err > 0.0 && err < 2e-2, "{act} {format:?}: rel err {err}");
        let argmax = |t: &Tensor| -> Vec<u32> {
            t.squeeze(0).unwrap().argmax(1).unwrap().to_vec1().unwrap()
        };
        let same = argmax(&got)
            .iter()
            .zip(argmax(&want))
            .filter(|(a, b)| **a == *b)
            .count();
        assert!(
            same >= 10,
            "{act} {format:?}: {same} of 11 greedy tokens kept"
        );
        let tokens = Tensor::new(&[[5u32, 17, 99]], &dev).unwrap();
        let err = quantized.forward_train(&tokens).err().expect("refused");
        assert!(
            err.to_string().contains("fuse_qkv") || err.to_string().contains("quantize_for_cpu"),
            "{err}"
        );
    }
}
