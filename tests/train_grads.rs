//! The differentiable path: every parameter receives a gradient, training logits
//! equal inference logits, and the TwELL path's gradients equal the dense ones.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{rel_l2, tiny_config, tiny_weights};
use twell::FfnMode;

fn model_with_vars(mode: FfnMode) -> (sparse_llama::Llama, VarMap) {
    let mut hf = tiny_config("relu", 300);
    hf.twell = Some(sparse_llama::SparseSettings {
        ffn_mode: twell::FfnMode::Sparse,
        tile: 32,
        compression: 8,
        l1_coefficient: None,
    });
    let mut cfg = hf.into_config(false);
    cfg.ffn_mode = mode;
    let w = tiny_weights(&cfg, 3);
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (k, v) in w {
            data.insert(k, Var::from_tensor(&v).unwrap());
        }
    }
    let model = sparse_llama::Llama::load(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        &cfg,
    )
    .unwrap();
    (model, varmap)
}

fn tokens() -> Tensor {
    Tensor::new(
        &[[1u32, 20, 30, 40, 50, 60, 70, 80], [9, 8, 7, 6, 5, 4, 3, 2]],
        &Device::Cpu,
    )
    .unwrap()
}

fn loss(model: &sparse_llama::Llama) -> (Tensor, Tensor) {
    let x = tokens();
    let out = model.forward_train(&x).unwrap();
    let (b, t, v) = out.logits.dims3().unwrap();
    let logits = out
        .logits
        .narrow(1, 0, t - 1)
        .unwrap()
        .reshape((b * (t - 1), v))
        .unwrap();
    let targets = x.narrow(1, 1, t - 1).unwrap().flatten_all().unwrap();
    let ce = candle_nn::loss::cross_entropy(&logits, &targets).unwrap();
    ((ce + (out.l1.clone() * 1e-2).unwrap()).unwrap(), out.logits)
}

#[test]
fn every_parameter_gets_a_gradient_on_both_paths() {
    for mode in [FfnMode::Dense, FfnMode::Sparse] {
        let (model, varmap) = model_with_vars(mode);
        let (l, _) = loss(&model);
        let grads = l.backward().unwrap();
        let data = varmap.data().lock().unwrap();
        assert_eq!(data.len(), 2 * 9 + 2);
        for (name, var) in data.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{mode:?}: no gradient for {name}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{mode:?}: zero gradient for {name}"
            );
        }
    }
}

#[test]
fn sparse_gradients_equal_dense_gradients() {
    let (dense, vm_d) = model_with_vars(FfnMode::Dense);
    let (sparse, vm_s) = model_with_vars(FfnMode::Sparse);
    let (ld, logits_d) = loss(&dense);
    let (ls, logits_s) = loss(&sparse);
    assert!(rel_l2(&logits_s, &logits_d) < 1e-5);
    assert!(rel_l2(&ls, &ld) < 1e-5);
    let (gd, gs) = (ld.backward().unwrap(), ls.backward().unwrap());
    let (dd, ds) = (vm_d.data().lock().unwrap(), vm_s.data().lock().unwrap());
    for (name, vd) in dd.iter() {
        let vs = &ds[name];
        let e = rel_l2(
            gs.get(vs.as_tensor()).unwrap(),
            gd.get(vd.as_tensor()).unwrap(),
        );
        assert!(e < 1e-4, "{name}: gradient rel err {e}");
    }
}

#[test]
fn training_logits_equal_inference_logits() {
    let (model, _) = model_with_vars(FfnMode::Sparse);
    let train = model.forward_train(&tokens()).unwrap().logits;
    let cfg = model.config().clone();
    let mut cache = sparse_llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
    let infer = model.forward_all(&tokens(), 0, &mut cache).unwrap();
    assert!(rel_l2(&train, &infer) < 1e-5, "{}", rel_l2(&train, &infer));
}

#[test]
fn cached_chunks_equal_one_training_pass() {
    // The plumbing the GPU tests (`tests/gpu/model.rs`) use to check the fused attention in a whole model:
    // two chunks through the KV cache give the logits of one plain pass.
    let (model, _) = model_with_vars(FfnMode::Sparse);
    let x = tokens();
    let t = x.dim(1).unwrap();
    let split = t / 2;
    let train = model.forward_train(&x).unwrap().logits;
    let cfg = model.config().clone();
    let mut cache = sparse_llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let first = model
        .forward_all(&x.narrow(1, 0, split).unwrap(), 0, &mut cache)
        .unwrap();
    let second = model
        .forward_all(&x.narrow(1, split, t - split).unwrap(), split, &mut cache)
        .unwrap();
    let infer = candle_core::Tensor::cat(&[first, second], 1).unwrap();
    assert!(rel_l2(&train, &infer) < 1e-5, "{}", rel_l2(&train, &infer));
}

#[test]
fn fused_training_path_equals_plain_path() {
    // The GPU's training path (fused attention, RoPE and residual add + norm with their
    // backward passes) run on the CPU's reference implementations, against plain ops.
    for mode in [FfnMode::Dense, FfnMode::Sparse] {
        let (plain, vm_p) = model_with_vars(mode);
        let (mut fused, vm_f) = model_with_vars(mode);
        fused.set_attention_path(sparse_llama::AttentionPath::Fused);
        let (lp, logits_p) = loss(&plain);
        let (lf, logits_f) = loss(&fused);
        assert!(rel_l2(&logits_f, &logits_p) < 1e-5, "{mode:?}: logits");
        assert!(rel_l2(&lf, &lp) < 1e-5, "{mode:?}: loss");
        let (gp, gf) = (lp.backward().unwrap(), lf.backward().unwrap());
        let (dp, df) = (vm_p.data().lock().unwrap(), vm_f.data().lock().unwrap());
        for (name, vp) in dp.iter() {
            let e = rel_l2(
                gf.get(df[name].as_tensor()).unwrap_or_else(|| {
                    panic!("{mode:?}: no gradient for {name} on the fused path")
                }),
                gp.get(vp.as_tensor()).unwrap(),
            );
            assert!(e < 1e-4, "{mode:?} {name}: gradient rel err {e}");
        }
    }
}
