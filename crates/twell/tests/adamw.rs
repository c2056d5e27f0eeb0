//! The in-place AdamW step: one step by hand, and its bad-input errors.

use candle_core::{DType, Device, Tensor, Var};
use twell::ops::{adamw_step, AdamwStep};

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
