//! The fused cross-entropy against candle's `loss::cross_entropy`, forward and
//! backward, and its bad-input errors.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use fused_ops::cross_entropy;

fn targets(n: usize, v: usize, seed: u32) -> Tensor {
    let t: Vec<u32> = (0..n as u32)
        .map(|i| (i * 7919 + seed) % v as u32)
        .collect();
    Tensor::from_vec(t, n, &Device::Cpu).unwrap()
}

/// The loss and the logits' gradient through `f`.
fn loss_and_grad(
    f: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    logits: &Tensor,
    targets: &Tensor,
) -> (f32, Tensor) {
    let var = Var::from_tensor(logits).unwrap();
    let loss = f(var.as_tensor(), targets).unwrap();
    let value = loss
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let grads = (loss * 3.0).unwrap().backward().unwrap();
    let grad = grads.get(var.as_tensor()).expect("a gradient").clone();
    (value, grad)
}

#[test]
fn matches_candle_cross_entropy_forward_and_backward() {
    // (N, V): one row, odd sizes, a vocabulary wider than a block's threads.
    for (k, &(n, v)) in [(1, 5), (7, 33), (16, 1000), (3, 3001)].iter().enumerate() {
        let logits = common::uniform(&[n, v], 10 + k as u64, 6.0);
        let t = targets(n, v, k as u32);
        let (want, want_grad) = loss_and_grad(candle_nn::loss::cross_entropy, &logits, &t);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let (got, grad) = loss_and_grad(cross_entropy, &logits.to_dtype(dtype).unwrap(), &t);
            assert!(
                ((got - want) / want).abs() < tol as f32,
                "({n}, {v}) {dtype:?}: loss {got} vs {want}"
            );
            assert_eq!(grad.dims(), &[n, v]);
            assert_eq!(grad.dtype(), dtype);
            let err = common::rel_l2(&grad.to_dtype(DType::F32).unwrap(), &want_grad).unwrap();
            assert!(err < tol, "({n}, {v}) {dtype:?}: gradient rel err {err}");
        }
    }
}

#[test]
fn bad_input_is_rejected() {
    let logits = common::uniform(&[4, 10], 1, 1.0);
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();
    // A target outside the vocabulary.
    let far = Tensor::new(&[1u32, 2, 10, 3], &Device::Cpu).unwrap();
    assert!(msg(cross_entropy(&logits, &far)).contains("outside the vocabulary"));
    // Targets not u32, of the wrong length, logits not a matrix.
    let as_f32 = targets(4, 10, 0).to_dtype(DType::F32).unwrap();
    assert!(msg(cross_entropy(&logits, &as_f32)).contains("u32"));
    assert!(msg(cross_entropy(&logits, &targets(3, 10, 0))).contains("targets [N]"));
    let cube = common::uniform(&[2, 2, 10], 2, 1.0);
    assert!(!msg(cross_entropy(&cube, &targets(2, 10, 0))).is_empty());
}
