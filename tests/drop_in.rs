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
    let ours_cfg = hf.clone().into_config(false).unwrap();
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
    // attention turn q.
    for (fused, path) in [
        (false, AttentionPath::Auto),
        (true, AttentionPath::Auto),
        (true, AttentionPath::Fused),
    ] {
        let mut ours = sparse_llama::Llama::load(
            VarBuilder::from_tensors(w.clone(), DType::F32, &dev),
            &ours_cfg,
        )
        .unwrap();
        if fused {
            ours.fuse_qkv().unwrap();
        }
        ours.set_attention_path(path);
        assert_eq!(ours.is_qkv_fused(), fused);
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
