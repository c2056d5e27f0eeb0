//! The in-place AdamW steps (f32, and mixed precision): one step by hand, the mixed
//! step against the f32 one, and their bad-input errors.

use candle_core::{DType, Device, Tensor, Var};
use fused_ops::{adamw_step, adamw_step_mixed, sum_squares, AdamwStep};

fn hp(step: usize) -> AdamwStep {
    AdamwStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.5,
        step,
        grad_scale: 2.0,
    }
}

#[test]
fn first_step_by_hand() {
    let p = Var::from_tensor(&Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap()).unwrap();
    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
    let g = Tensor::new(&[0.25f32, -1.0], &Device::Cpu).unwrap();
    adamw_step(p.as_tensor(), &g, &m, &v, hp(1)).unwrap();
    // s·g = [0.5, -2]; m = 0.1·s·g, v = 0.01·(s·g)²; after the bias corrections the
    // update is sign(g) (up to eps), so p = p·(1 − 0.05) − 0.1·sign(g).
    let m = m.to_vec1::<f32>().unwrap();
    let v = v.to_vec1::<f32>().unwrap();
    assert!(
        (m[0] - 0.05).abs() < 1e-7 && (m[1] + 0.2).abs() < 1e-7,
        "{m:?}"
    );
    assert!(
        (v[0] - 0.0025).abs() < 1e-7 && (v[1] - 0.04).abs() < 1e-7,
        "{v:?}"
    );
    let p = p.as_tensor().to_vec1::<f32>().unwrap();
    assert!((p[0] - (0.95 - 0.1)).abs() < 1e-6, "{p:?}");
    assert!((p[1] - (-1.9 + 0.1)).abs() < 1e-6, "{p:?}");
}

#[test]
fn bad_input_is_rejected() {
    let p = Var::from_tensor(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
    let g = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let msg = |r: candle_core::Result<()>| r.expect_err("expected an error").to_string();
    let short = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    assert!(msg(adamw_step(p.as_tensor(), &short, &m, &v, hp(1))).contains("grad"));
    let m16 = m.to_dtype(DType::BF16).unwrap();
    assert!(msg(adamw_step(p.as_tensor(), &g, &m16, &v, hp(1))).contains("f32"));
    assert!(msg(adamw_step(p.as_tensor(), &g, &m, &v, hp(0))).contains("from 1"));
    // A bf16 gradient is cast, not refused.
    adamw_step(
        p.as_tensor(),
        &g.to_dtype(DType::BF16).unwrap(),
        &m,
        &v,
        hp(1),
    )
    .unwrap();
}

/// The mixed-precision step takes the same update as the f32 one on its master row,
/// keeps the moments beside it, and writes the rounded master into the bf16 variable.
#[test]
fn mixed_step_matches_the_f32_step_and_rounds_into_the_variable() {
    let init = Tensor::new(&[1f32, -2.0, 0.3, 1e-3], &Device::Cpu).unwrap();
    let p32 = Var::from_tensor(&init).unwrap();
    let (m, v) = (p32.zeros_like().unwrap(), p32.zeros_like().unwrap());
    let p16 = Var::from_tensor(&init.to_dtype(DType::BF16).unwrap()).unwrap();
    let zeros = init.zeros_like().unwrap();
    let state = Tensor::stack(&[&init, &zeros, &zeros], 0).unwrap();
    for step in 1..=3 {
        let g = Tensor::new(&[0.25f32, -1.0, 0.1 * step as f32, 3.0], &Device::Cpu).unwrap();
        // Once with an f32 gradient, otherwise bf16; the f32 step sees the same values.
        let g_mixed = if step == 2 {
            g
        } else {
            g.to_dtype(DType::BF16).unwrap()
        };
        adamw_step(p32.as_tensor(), &g_mixed, &m, &v, hp(step)).unwrap();
        adamw_step_mixed(p16.as_tensor(), &g_mixed, &state, hp(step)).unwrap();
    }
    let rows = state.to_vec2::<f32>().unwrap();
    let close = |a: &[f32], b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6);
    assert!(
        close(&rows[0], p32.as_tensor().to_vec1().unwrap()),
        "{rows:?}"
    );
    assert!(close(&rows[1], m.to_vec1().unwrap()), "{rows:?}");
    assert!(close(&rows[2], v.to_vec1().unwrap()), "{rows:?}");
    let rounded = state
        .get(0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_vec1::<half::bf16>()
        .unwrap();
    assert_eq!(p16.as_tensor().to_vec1::<half::bf16>().unwrap(), rounded);
}

#[test]
fn mixed_step_rejects_bad_input() {
    let p16 = Var::from_tensor(&Tensor::zeros(4, DType::BF16, &Device::Cpu).unwrap()).unwrap();
    let state = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
    let g = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let msg = |r: candle_core::Result<()>| r.expect_err("expected an error").to_string();
    let short_state = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(msg(adamw_step_mixed(p16.as_tensor(), &g, &short_state, hp(1))).contains("[3, 4]"));
    let short = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    assert!(msg(adamw_step_mixed(p16.as_tensor(), &short, &state, hp(1))).contains("grad"));
    let p32 = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    assert!(msg(adamw_step_mixed(&p32, &g, &state, hp(1))).contains("bf16"));
    let g16 = g.to_dtype(DType::F16).unwrap();
    assert!(msg(adamw_step_mixed(p16.as_tensor(), &g16, &state, hp(1))).contains("grad"));
    assert!(msg(adamw_step_mixed(p16.as_tensor(), &g, &state, hp(0))).contains("from 1"));
}

#[test]
fn sum_squares_matches_candle_ops_and_refuses_other_dtypes() {
    let x = Tensor::new(&[[0.5f32, -2.0, 3.0], [1e-3, 0.0, -0.75]], &Device::Cpu).unwrap();
    let want = x
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    for t in [x.clone(), x.to_dtype(DType::BF16).unwrap(), x.t().unwrap()] {
        let got = sum_squares(&t).unwrap();
        assert_eq!(got.dims(), [1]);
        let got = got.to_vec1::<f32>().unwrap()[0];
        assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
    }
    let err = sum_squares(&x.to_dtype(DType::F16).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32 or bf16"), "{err}");
}
