//! SparseMlp: every mode gives the dense answer, the Auto mode switches on density,
//! and loading by HF names works.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use common::{rel_l2, relu_mlp};
use twell::density::{synthetic_input, synthetic_mlp};
use twell::{Activation, FfnMode, L1Term, MlpBias, SparseMlp};

#[test]
fn sparse_and_auto_equal_dense_for_relu_and_batched_input() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(64, 384, 0.02, DType::F32, &dev, 1).unwrap();
    let x = synthetic_input(2 * 5, 64, DType::F32, &dev, 2)
        .unwrap()
        .reshape((2, 5, 64))
        .unwrap();
    let dense = relu_mlp(&w, FfnMode::Dense).forward(&x).unwrap();
    assert_eq!(dense.dims(), &[2, 5, 64]);
    for mode in [FfnMode::Sparse, FfnMode::Auto] {
        let (out, l1) = relu_mlp(&w, mode).forward_with_l1(&x).unwrap();
        assert_eq!(l1.dims(), &[2, 5]);
        assert!(rel_l2(&out, &dense).unwrap() < 1e-5, "{mode:?}");
    }
    // The sparse output is contiguous as it comes (a residual add or a matmul reads it
    // without a copy), and so is its L1 term.
    let sparse = relu_mlp(&w, FfnMode::Sparse);
    let module = sparse.forward(&x).unwrap();
    let (out, l1) = sparse.forward_with_l1(&x).unwrap();
    assert!(module.is_contiguous() && out.is_contiguous() && l1.is_contiguous());
    assert!(rel_l2(&module, &dense).unwrap() < 1e-5);
    let projected = module.matmul(
        &w.gate
            .t()
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .broadcast_as((2, 64, 384))
            .unwrap(),
    );
    assert_eq!(projected.unwrap().dims(), &[2, 5, 384]);
}

/// One token's density does not decide a many-token call: that call runs sparse and
/// measures, and only a measurement on enough rows sends the next one dense.
#[test]
fn auto_does_not_decide_many_tokens_by_one() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(32, 256, 0.3, DType::F32, &dev, 5).unwrap();
    let one = synthetic_input(1, 32, DType::F32, &dev, 6).unwrap();
    let many = synthetic_input(64, 32, DType::F32, &dev, 7).unwrap();
    let mlp = SparseMlp::new(w.gate, w.up, w.down, Activation::Relu, FfnMode::Auto)
        .unwrap()
        .with_break_even(0.1)
        .with_stats(true);
    let sparse_after = |x: &candle_core::Tensor| {
        mlp.forward(x).unwrap();
        mlp.last_stats().unwrap().unwrap().sparse
    };
    assert!(sparse_after(&one), "the first call probes the sparse path");
    assert!(
        sparse_after(&many),
        "a one-token density does not decide 64 tokens"
    );
    assert!(
        !sparse_after(&many),
        "measured on 64 tokens: above the break-even"
    );
    assert!(!sparse_after(&one), "a 64-token density decides one token");
}

#[test]
fn auto_goes_dense_above_break_even_and_stats_are_reported() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(32, 256, 0.3, DType::F32, &dev, 3).unwrap();
    let x = synthetic_input(64, 32, DType::F32, &dev, 4).unwrap();
    let mlp = SparseMlp::new(w.gate, w.up, w.down, Activation::Relu, FfnMode::Auto)
        .unwrap()
        .with_break_even(0.1)
        .with_stats(true);
    mlp.forward(&x).unwrap();
    let first = mlp.last_stats().unwrap().unwrap();
    assert!(first.sparse, "first call probes the sparse path");
    assert!((first.density - 0.3).abs() < 0.05, "{}", first.density);
    mlp.forward(&x).unwrap();
    let second = mlp.last_stats().unwrap().unwrap();
    assert!(!second.sparse, "density 0.3 > break-even 0.1 goes dense");
    assert_eq!(second.fired.len(), 256);
    assert!(
        (second.mean_l0 - first.mean_l0).abs() < 0.02 * first.mean_l0,
        "{} vs {}",
        second.mean_l0,
        first.mean_l0
    );
    assert_eq!(
        first.fired.iter().map(|&c| c as f64).sum::<f64>(),
        first.mean_l0 * 64.0
    );
}

#[test]
fn silu_dense_matches_swiglu_formula() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(16, 48, 0.5, DType::F32, &dev, 5).unwrap();
    let x = synthetic_input(3, 16, DType::F32, &dev, 6).unwrap();
    let mlp = SparseMlp::new(
        w.gate.clone(),
        w.up.clone(),
        w.down.clone(),
        Activation::Silu,
        FfnMode::Auto,
    )
    .unwrap();
    let want = (candle_nn::ops::silu(&x.matmul(&w.gate.t().unwrap()).unwrap()).unwrap()
        * x.matmul(&w.up.t().unwrap()).unwrap())
    .unwrap()
    .matmul(&w.down.t().unwrap())
    .unwrap();
    assert!(rel_l2(&mlp.forward(&x).unwrap(), &want).unwrap() < 1e-6);
}

#[test]
fn loads_hf_names_from_a_var_builder() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(16, 40, 0.1, DType::F32, &dev, 7).unwrap();
    let map: HashMap<String, Tensor> = [
        ("mlp.gate_proj.weight".to_string(), w.gate.clone()),
        ("mlp.up_proj.weight".to_string(), w.up.clone()),
        ("mlp.down_proj.weight".to_string(), w.down.clone()),
    ]
    .into_iter()
    .collect();
    let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
    let mlp = SparseMlp::load(vb.pp("mlp"), 16, 40, Activation::Relu, FfnMode::Sparse).unwrap();
    assert_eq!((mlp.hidden(), mlp.ffn()), (16, 40));
    let vb_bad = VarBuilder::from_tensors(HashMap::new(), DType::F32, &dev);
    assert!(SparseMlp::load(vb_bad.pp("mlp"), 16, 40, Activation::Relu, FfnMode::Sparse).is_err());
}

/// HF `mlp_bias`: `relu(x·Wgᵀ + bg)·(x·Wuᵀ + bu)·Wdᵀ + bd`, on the dense path under
/// `Auto` too (the TwELL kernels apply no biases, and `Sparse` is refused with a clear
/// error); the gate bias gets its gradient; bad shapes are refused.
#[test]
fn biased_mlp_matches_the_formula_and_stays_dense() {
    let dev = Device::Cpu;
    let (d, f) = (16, 48);
    let w = synthetic_mlp(d, f, 0.1, DType::F32, &dev, 9).unwrap();
    let x = synthetic_input(5, d, DType::F32, &dev, 10).unwrap();
    let ramp = |n: usize, scale: f32| {
        let v: Vec<f32> = (0..n)
            .map(|i| scale * (i as f32 - n as f32 / 2.0))
            .collect();
        Tensor::from_vec(v, n, &dev).unwrap()
    };
    let gate_bias = candle_core::Var::from_tensor(&ramp(f, 0.05)).unwrap();
    let bias = MlpBias {
        gate: gate_bias.as_tensor().clone(),
        up: ramp(f, -0.02),
        down: ramp(d, 0.1),
    };
    let want = (x
        .matmul(&w.gate.t().unwrap())
        .unwrap()
        .broadcast_add(&bias.gate)
        .unwrap()
        .relu()
        .unwrap()
        * x.matmul(&w.up.t().unwrap())
            .unwrap()
            .broadcast_add(&bias.up)
            .unwrap())
    .unwrap()
    .matmul(&w.down.t().unwrap())
    .unwrap()
    .broadcast_add(&bias.down)
    .unwrap();
    for mode in [FfnMode::Dense, FfnMode::Auto] {
        let mlp = relu_mlp(&w, mode).with_bias(bias.clone()).unwrap();
        let (out, l1) = mlp.forward_with_l1(&x).unwrap();
        assert!(rel_l2(&out, &want).unwrap() < 1e-6, "{mode:?}");
        assert_eq!(l1.dims(), [5]);
        let grads = out.sum_all().unwrap().backward().unwrap();
        let g = grads
            .get(gate_bias.as_tensor())
            .expect("gate bias gradient");
        assert!(
            g.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
    let mut auto = relu_mlp(&w, FfnMode::Auto).with_bias(bias.clone()).unwrap();
    let msg = auto.set_mode(FfnMode::Sparse).unwrap_err().to_string();
    assert!(msg.contains("mlp_bias"), "{msg}");
    let msg = relu_mlp(&w, FfnMode::Sparse)
        .with_bias(bias.clone())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("mlp_bias"), "{msg}");
    let short = MlpBias {
        down: ramp(d - 1, 0.1),
        ..bias
    };
    let msg = relu_mlp(&w, FfnMode::Dense)
        .with_bias(short)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("down_proj.bias"), "{msg}");
}

/// Decoding on the host goes through the int8 gate screen; the answer must not change,
/// at low density (screened) and at high density (where the screen is skipped).
#[test]
fn screened_decoding_equals_unscreened_and_dense() {
    let dev = Device::Cpu;
    for (density, seed) in [(0.01, 3u64), (0.4, 4)] {
        let w = synthetic_mlp(256, 1024, density, DType::F32, &dev, seed).unwrap();
        let make = |screen: bool, mode| relu_mlp(&w, mode).with_gate_screen(screen);
        let (screened, plain, dense) = (
            make(true, FfnMode::Sparse),
            make(false, FfnMode::Sparse),
            make(true, FfnMode::Dense),
        );
        for (m, xs) in [(1usize, seed + 10), (2, seed + 11), (1, seed + 12)] {
            let x = synthetic_input(m, 256, DType::F32, &dev, xs).unwrap();
            let a = screened.forward(&x).unwrap();
            let b = plain.forward(&x).unwrap();
            let d = dense.forward(&x).unwrap();
            assert!(rel_l2(&a, &b).unwrap() < 1e-6, "density {density} m {m}");
            assert!(rel_l2(&a, &d).unwrap() < 2e-5, "density {density} m {m}");
        }
    }
}

/// Rescaling a neuron (`Wg_j·a`, `Wu_j·b`, `Wd_j/(a·b)`) keeps the output: the plain L1
/// term moves with it, the smooth gate count does not (it reads each gate as a cosine);
/// the TwELL path refuses the count rather than return the plain term.
#[test]
fn the_gate_count_ignores_relu_rescaling_and_the_plain_l1_does_not() {
    let dev = Device::Cpu;
    let (d, f) = (32, 96);
    let w = synthetic_mlp(d, f, 0.2, DType::F32, &dev, 5).unwrap();
    let x = synthetic_input(7, d, DType::F32, &dev, 6).unwrap();
    // Neuron scales: a on the gate row, b on the up row, 1/(a·b) on the down column.
    let (a, b): (Vec<f32>, Vec<f32>) = (0..f)
        .map(|j| (0.25 + (j % 5) as f32, 0.5 + (j % 3) as f32))
        .unzip();
    let col = |v: &[f32]| Tensor::from_vec(v.to_vec(), (f, 1), &dev).unwrap();
    let row = |v: &[f32]| Tensor::from_vec(v.to_vec(), (1, f), &dev).unwrap();
    let inv: Vec<f32> = a.iter().zip(&b).map(|(a, b)| 1.0 / (a * b)).collect();
    let gate = w.gate.broadcast_mul(&col(&a)).unwrap();
    let up = w.up.broadcast_mul(&col(&b)).unwrap();
    let down = w.down.broadcast_mul(&row(&inv)).unwrap();
    let run = |g: &Tensor, u: &Tensor, dn: &Tensor, term: L1Term| {
        let mut mlp = SparseMlp::new(
            g.clone(),
            u.clone(),
            dn.clone(),
            Activation::Relu,
            FfnMode::Dense,
        )
        .unwrap();
        mlp.set_l1_term(term);
        mlp.forward_with_l1(&x).unwrap()
    };
    let (out0, plain0) = run(&w.gate, &w.up, &w.down, L1Term::Plain);
    let (out1, plain1) = run(&gate, &up, &down, L1Term::Plain);
    assert!(rel_l2(&out0, &out1).unwrap() < 1e-5);
    assert!(
        rel_l2(&plain0, &plain1).unwrap() > 0.1,
        "plain L1 should move"
    );
    let l0 = {
        let g = x.matmul(&w.gate.t().unwrap()).unwrap().relu().unwrap();
        let h = (g * x.matmul(&w.up.t().unwrap()).unwrap()).unwrap();
        h.ne(0f32)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum(1)
            .unwrap()
    };
    // The smooth gate count ignores per-neuron scales of the gate rows and stays
    // between 0 (only where no gate fires) and L0.
    let (_, count0) = run(&w.gate, &w.up, &w.down, L1Term::GateL0);
    let (_, count1) = run(&gate, &up, &down, L1Term::GateL0);
    assert!(rel_l2(&count0, &count1).unwrap() < 1e-5);
    let lv = l0.to_vec1::<f32>().unwrap();
    for (c, l) in count0.to_vec1::<f32>().unwrap().iter().zip(&lv) {
        assert!(
            *c >= 0.0 && *c <= l + 1e-3 && (*l == 0.0 || *c > 0.0),
            "count {c} against L0 {l}"
        );
    }
    let mut sparse =
        SparseMlp::new(w.gate, w.up, w.down, Activation::Relu, FfnMode::Sparse).unwrap();
    sparse.set_l1_term(L1Term::GateL0);
    let e = sparse
        .forward_with_l1(&x)
        .expect_err("the TwELL path has no gate count");
    assert!(format!("{e}").contains("dense path"), "{e}");
}

/// A fused trainable up/down matrix gives the same outputs and L1 terms as separate
/// weights on both paths, and its gradient is the two weights' gradients side by side.
#[test]
fn fused_up_down_matches_separate_weights_forward_and_backward() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(32, 300, 0.05, DType::F32, &dev, 21).unwrap();
    let x = synthetic_input(9, 32, DType::F32, &dev, 22).unwrap();
    let vars = [&w.gate, &w.up, &w.down].map(|t| candle_core::Var::from_tensor(t).unwrap());
    let fused =
        candle_core::Var::from_tensor(&twell::up_down_matrix(&w.up, &w.down).unwrap()).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (9, 32), &dev).unwrap();
    for mode in [FfnMode::Dense, FfnMode::Sparse] {
        let separate = SparseMlp::new(
            vars[0].as_tensor().clone(),
            vars[1].as_tensor().clone(),
            vars[2].as_tensor().clone(),
            Activation::Relu,
            mode,
        )
        .unwrap();
        let one = SparseMlp::from_up_down(
            vars[0].as_tensor().clone(),
            fused.as_tensor().clone(),
            Activation::Relu,
            mode,
        )
        .unwrap();
        let loss = |mlp: &SparseMlp| {
            let (out, l1) = mlp.forward_with_l1(&x).unwrap();
            ((out * &probe).unwrap().sum_all().unwrap() + l1.sum_all().unwrap()).unwrap()
        };
        let (a, b) = (loss(&separate), loss(&one));
        let (va, vb) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
        assert!(
            (va - vb).abs() <= 1e-5 * va.abs().max(1.0),
            "{mode:?}: {va} vs {vb}"
        );
        let (ga, gb) = (a.backward().unwrap(), b.backward().unwrap());
        let g_fused = gb.get(fused.as_tensor()).expect("fused gradient");
        let g_cat = twell::up_down_matrix(
            ga.get(vars[1].as_tensor()).unwrap(),
            ga.get(vars[2].as_tensor()).unwrap(),
        )
        .unwrap();
        assert!(rel_l2(g_fused, &g_cat).unwrap() < 1e-5, "{mode:?}");
        let (g0, g1) = (
            ga.get(vars[0].as_tensor()).unwrap(),
            gb.get(vars[0].as_tensor()).unwrap(),
        );
        assert!(rel_l2(g0, g1).unwrap() < 1e-5, "{mode:?}");
    }
    // A matrix of the wrong width is refused.
    let bad = Tensor::zeros((300, 63), DType::F32, &dev).unwrap();
    let e = SparseMlp::from_up_down(w.gate.clone(), bad, Activation::Relu, FfnMode::Sparse)
        .unwrap_err()
        .to_string();
    assert!(e.contains("up_down"), "{e}");
}

/// A VarBuilder that holds `mlp.up_down.weight` builds the fused module.
#[test]
fn loads_a_fused_up_down_matrix_from_a_var_builder() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(16, 40, 0.1, DType::F32, &dev, 8).unwrap();
    let x = synthetic_input(3, 16, DType::F32, &dev, 9).unwrap();
    let map: HashMap<String, Tensor> = [
        ("mlp.gate_proj.weight".to_string(), w.gate.clone()),
        (
            "mlp.up_down.weight".to_string(),
            twell::up_down_matrix(&w.up, &w.down).unwrap(),
        ),
    ]
    .into_iter()
    .collect();
    let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
    let mlp = SparseMlp::load(vb.pp("mlp"), 16, 40, Activation::Relu, FfnMode::Sparse).unwrap();
    let separate = SparseMlp::new(w.gate, w.up, w.down, Activation::Relu, FfnMode::Dense).unwrap();
    let e = rel_l2(&mlp.forward(&x).unwrap(), &separate.forward(&x).unwrap()).unwrap();
    assert!(e < 1e-5, "{e}");
}

#[test]
fn forward_add_norm_and_forward_sublayer_are_the_steps_they_fold() {
    // On the host (and wherever the one-launch CUDA kernel does not fold it) the call is
    // the MLP, then `add_rms_norm`: the same tensors.
    let dev = Device::Cpu;
    let w = synthetic_mlp(64, 384, 0.02, DType::F32, &dev, 5).unwrap();
    let mlp = relu_mlp(&w, FfnMode::Sparse);
    for rows in [1, 3] {
        let x = synthetic_input(rows, 64, DType::F32, &dev, 6).unwrap();
        let residual = Tensor::randn(0f32, 1.0, (rows, 64), &dev).unwrap();
        let alpha = Tensor::randn(1f32, 0.1, 64, &dev).unwrap();
        let (sum, normed) = mlp.forward_add_norm(&x, &residual, &alpha, 1e-5).unwrap();
        let out = mlp.forward(&x).unwrap();
        let (want_sum, want_normed) =
            fused_ops::add_rms_norm(&residual, &out, &alpha, 1e-5).unwrap();
        assert_eq!(sum.dims(), x.dims());
        assert!(rel_l2(&sum, &want_sum).unwrap() < 1e-6, "rows {rows}");
        assert!(rel_l2(&normed, &want_normed).unwrap() < 1e-6, "rows {rows}");
        // The whole sublayer from the attention's output y: add + norm, MLP, add + norm.
        let y = Tensor::randn(0f32, 1.0, (rows, 64), &dev).unwrap();
        let pre_alpha = Tensor::randn(1f32, 0.1, 64, &dev).unwrap();
        let (sum, normed) = mlp
            .forward_sublayer(&residual, &y, (&pre_alpha, 1e-5), (&alpha, 1e-6))
            .unwrap();
        let (h, hm) = fused_ops::add_rms_norm(&residual, &y, &pre_alpha, 1e-5).unwrap();
        let out = mlp.forward(&hm).unwrap();
        let (want_sum, want_normed) = fused_ops::add_rms_norm(&h, &out, &alpha, 1e-6).unwrap();
        assert_eq!(sum.dims(), y.dims());
        assert!(rel_l2(&sum, &want_sum).unwrap() < 1e-6, "rows {rows}");
        assert!(rel_l2(&normed, &want_normed).unwrap() < 1e-6, "rows {rows}");
        // Not the sublayer without its first norm.
        let (skipped, _) = mlp.forward_add_norm(&y, &residual, &alpha, 1e-6).unwrap();
        assert!(rel_l2(&skipped, &want_sum).unwrap() > 1e-3, "rows {rows}");
    }
    // The one-launch form itself is CUDA-only, and says what to use instead.
    let x = synthetic_input(1, 64, DType::F32, &dev, 7).unwrap();
    let residual = Tensor::zeros((1, 64), DType::F32, &dev).unwrap();
    let alpha = Tensor::ones(64, DType::F32, &dev).unwrap();
    let w_ud = twell::up_down_matrix(&w.up, &w.down).unwrap();
    assert!(!twell::add_norm_fuses(
        &x,
        256,
        twell::TwellConfig::default()
    ));
    let fold_err = |residual: &Tensor, pre: Option<(&Tensor, f64)>| {
        twell::twell_mlp_add_norm(
            &x,
            &w.gate,
            &w_ud,
            Default::default(),
            (residual, &alpha, 1e-5),
            pre,
        )
        .unwrap_err()
        .to_string()
    };
    let err = fold_err(&residual, None);
    assert!(
        err.contains("CUDA") && err.contains("add_rms_norm"),
        "{err}"
    );
    // Bad shapes are named.
    let err = fold_err(&alpha, None);
    assert!(err.contains("residual [m, d]"), "{err}");
    let err = fold_err(&residual, Some((&residual, 1e-5)));
    assert!(err.contains("pre_alpha"), "{err}");
    // The norm before the MLP folds for one token only.
    let rows = synthetic_input(3, 64, DType::F32, &dev, 8).unwrap();
    let err = twell::twell_mlp_add_norm(
        &rows,
        &w.gate,
        &w_ud,
        Default::default(),
        (
            &Tensor::zeros((3, 64), DType::F32, &dev).unwrap(),
            &alpha,
            1e-5,
        ),
        Some((&alpha, 1e-5)),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("m = 1 with a norm before the MLP"), "{err}");
}

/// `fold_pre_norm` then `forward_sublayer_from_sum` gives what the unfolded MLP gives
/// after `rms_norm(s) · alpha` (sparse and dense paths, one row and several); the fold
/// refuses a second call, trainable weights and a wrong shape, and the sublayer from the
/// sum needs the fold. The CUDA launch behind it says where it runs.
#[test]
fn a_folded_norm_weight_gives_the_unfolded_sublayer() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(64, 384, 0.05, DType::F32, &dev, 9).unwrap();
    let pre_alpha = Tensor::randn(1f32, 0.1, 64, &dev).unwrap();
    let alpha = Tensor::randn(1f32, 0.1, 64, &dev).unwrap();
    for mode in [FfnMode::Sparse, FfnMode::Dense] {
        let plain = relu_mlp(&w, mode);
        let mut folded = relu_mlp(&w, mode);
        let err = folded
            .forward_sublayer_from_sum(&pre_alpha.unsqueeze(0).unwrap(), 1e-5, (&alpha, 1e-6))
            .unwrap_err()
            .to_string();
        assert!(err.contains("fold_pre_norm"), "{err}");
        assert!(!folded.pre_norm_folded());
        folded.fold_pre_norm(&pre_alpha).unwrap();
        assert!(folded.pre_norm_folded());
        for rows in [1, 5] {
            let s = (synthetic_input(rows, 64, DType::F32, &dev, 10).unwrap() * 3.0).unwrap();
            let (sum, normed) = folded
                .forward_sublayer_from_sum(&s, 1e-5, (&alpha, 1e-6))
                .unwrap();
            let hm = fused_ops::rms_norm(&s, &pre_alpha, 1e-5).unwrap();
            let out = plain.forward(&hm).unwrap();
            let (want_sum, want_normed) = fused_ops::add_rms_norm(&s, &out, &alpha, 1e-6).unwrap();
            assert_eq!(sum.dims(), s.dims());
            let (e_sum, e_norm) = (
                rel_l2(&sum, &want_sum).unwrap(),
                rel_l2(&normed, &want_normed).unwrap(),
            );
            assert!(
                e_sum < 1e-5 && e_norm < 1e-5,
                "{mode:?}, rows {rows}: {e_sum} {e_norm}"
            );
            // Without the first norm the result is another.
            let (skipped, _) = plain.forward_add_norm(&s, &s, &alpha, 1e-6).unwrap();
            assert!(rel_l2(&skipped, &want_sum).unwrap() > 1e-3);
        }
        let err = folded.fold_pre_norm(&pre_alpha).unwrap_err().to_string();
        assert!(err.contains("folded in already"), "{err}");
    }
    let mut mlp = relu_mlp(&w, FfnMode::Sparse);
    let err = mlp
        .fold_pre_norm(&Tensor::ones(63, DType::F32, &dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected [64]"), "{err}");
    let gate = candle_core::Var::from_tensor(&w.gate).unwrap();
    let mut trainable = SparseMlp::new(
        gate.as_tensor().clone(),
        w.up.clone(),
        w.down.clone(),
        Activation::Relu,
        FfnMode::Sparse,
    )
    .unwrap();
    let err = trainable.fold_pre_norm(&pre_alpha).unwrap_err().to_string();
    assert!(err.contains("trainable"), "{err}");
    // The launch with both norms folded is CUDA-only and names the unfolded ops.
    let s = synthetic_input(100, 64, DType::F32, &dev, 11).unwrap();
    assert!(!twell::norm_add_norm_runs(&s, 256, Default::default()));
    let w_ud = twell::up_down_matrix(&w.up, &w.down).unwrap();
    let launch = |gate: &Tensor, alpha: &Tensor| {
        twell::twell_mlp_norm_add_norm(&s, gate, &w_ud, Default::default(), 1e-5, (alpha, 1e-5))
            .unwrap_err()
            .to_string()
    };
    let err = launch(&w.gate, &alpha);
    assert!(
        err.contains("CUDA") && err.contains("add_rms_norm"),
        "{err}"
    );
    let err = launch(&w.up.t().unwrap(), &alpha);
    assert!(err.contains("gate_proj [f, d]"), "{err}");
}

/// `residual_add_linear` off CUDA: candle's ops, `residual + y · Wᵀ`; bad shapes and
/// mixed dtypes are named. `rms_norm` off CUDA is candle's.
#[test]
fn the_residual_plus_a_linear_layer_and_the_norm_alone() {
    let dev = Device::Cpu;
    let residual = Tensor::randn(0f32, 1.0, (7, 48), &dev).unwrap();
    let y = Tensor::randn(0f32, 1.0, (7, 32), &dev).unwrap();
    let w = Tensor::randn(0f32, 0.2, (48, 32), &dev).unwrap();
    let want = (&residual + y.matmul(&w.t().unwrap()).unwrap()).unwrap();
    let got = fused_ops::residual_add_linear(residual.clone(), &y, &w).unwrap();
    assert!(rel_l2(&got, &want).unwrap() < 1e-6);
    let err = fused_ops::residual_add_linear(residual.clone(), &y, &w.t().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight [n, k]"), "{err}");
    let err =
        fused_ops::residual_add_linear(residual.clone(), &y.to_dtype(DType::BF16).unwrap(), &w)
            .unwrap_err()
            .to_string();
    assert!(err.contains("y is BF16"), "{err}");
    let alpha = Tensor::randn(1f32, 0.1, 48, &dev).unwrap();
    let normed = fused_ops::rms_norm(&residual, &alpha, 1e-5).unwrap();
    let candle = candle_nn::ops::rms_norm(&residual, &alpha, 1e-5).unwrap();
    assert!(rel_l2(&normed, &candle).unwrap() < 1e-6);
    let err = fused_ops::rms_norm(&residual, &alpha.to_dtype(DType::F64).unwrap(), 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("share a dtype"), "{err}");
}

/// `Auto` at inference times its candidates on the calls it serves and keeps the faster:
/// on the host, the dense MLP at 50% density (the sparse path does about twice the work
/// there) and the TwELL path at 0.5%. A shape no other test uses, so that no other test's
/// timings share its cells.
#[test]
fn auto_keeps_the_side_its_timings_find_faster() {
    let dev = Device::Cpu;
    for (density, want_sparse) in [(0.5, false), (0.005, true)] {
        let w = synthetic_mlp(576, 1600, density, DType::F32, &dev, 61).unwrap();
        let x = synthetic_input(256, 576, DType::F32, &dev, 62).unwrap();
        let auto = relu_mlp(&w, FfnMode::Auto).with_stats(true);
        auto.calibrate(&x).unwrap();
        candle_core::Module::forward(&auto, &x).unwrap();
        let stats = auto.last_stats().unwrap().expect("stats kept");
        assert_eq!(
            stats.sparse,
            want_sparse,
            "density {:.3}: Auto ran {} after calibrating",
            stats.density,
            if stats.sparse { "sparse" } else { "dense" }
        );
    }
}

#[test]
fn auto_rechecks_the_density_as_often_as_asked() {
    use twell::auto::Side;
    let dev = Device::Cpu;
    let w = synthetic_mlp(64, 512, 0.01, DType::F32, &dev, 71).unwrap();
    // Column 0 is the feature that carries the gate's threshold: -1 instead of 1 turns
    // the 1% density of these weights into 99%.
    let sparse_text = synthetic_input(8, 64, DType::F32, &dev, 72).unwrap();
    let flip = Tensor::from_vec(
        std::iter::once(-1f32)
            .chain(std::iter::repeat_n(1f32, 63))
            .collect(),
        64,
        &dev,
    )
    .unwrap();
    let dense_text = sparse_text.broadcast_mul(&flip).unwrap();
    for (recheck, third_side) in [(0, Side::Dense), (1, Side::Sparse)] {
        let auto = relu_mlp(&w, FfnMode::Auto)
            .with_break_even(0.1)
            .with_density_recheck(recheck);
        // The first call measures 99% and the second runs dense; only a recheck sees
        // that its text is at 1%.
        auto.forward(&dense_text).unwrap();
        auto.forward(&sparse_text).unwrap();
        assert_eq!(auto.last_side(), Some(Side::Dense));
        auto.forward(&sparse_text).unwrap();
        assert_eq!(
            auto.last_side(),
            Some(third_side),
            "recheck every {recheck}"
        );
    }
}

#[test]
fn calibrate_rejects_an_input_of_the_wrong_width() {
    let dev = Device::Cpu;
    let w = synthetic_mlp(64, 256, 0.05, DType::F32, &dev, 81).unwrap();
    let x = synthetic_input(4, 32, DType::F32, &dev, 82).unwrap();
    let auto = relu_mlp(&w, FfnMode::Auto);
    let e = auto.calibrate(&x).unwrap_err().to_string();
    assert!(
        e.contains("input has 32 features, the MLP expects 64"),
        "{e}"
    );
    assert_eq!(auto.last_side(), None, "nothing ran");
}
