//! The embedding op against candle's `Embedding`: the gathered rows, the weight's
//! gradient (repeated ids included) in f32 and bf16, and its bad-input errors.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Module;
use common::rel_l2;
use common::uniform;
use fused_ops::embedding;

#[test]
fn rows_and_weight_gradient_match_candle_embedding() {
    let (vocab, d) = (11, 16);
    // Repeated ids: their gradient rows must add up.
    let ids = Tensor::new(&[[3u32, 7, 3, 0], [10, 3, 7, 1]], &Device::Cpu).unwrap();
    let probe = uniform(&[2, 4, d], 5, 1.0);
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let w = Var::from_tensor(&uniform(&[vocab, d], 4, 1.0).to_dtype(dtype).unwrap()).unwrap();
        let ours = embedding(&ids, w.as_tensor()).unwrap();
        let theirs = candle_nn::Embedding::new(w.as_tensor().clone(), d)
            .forward(&ids)
            .unwrap();
        assert_eq!(ours.dims(), [2, 4, d]);
        assert_eq!(rel_l2(&ours, &theirs).unwrap(), 0.0);
        let grad = |out: Tensor| {
            let loss = (out.to_dtype(DType::F32).unwrap() * &probe)
                .unwrap()
                .sum_all()
                .unwrap();
            let g = loss.backward().unwrap();
            g.get(w.as_tensor()).expect("a weight gradient").clone()
        };
        let (a, b) = (grad(ours), grad(theirs));
        assert_eq!(a.dims(), [vocab, d]);
        let e = rel_l2(&a, &b).unwrap();
        assert!(e < tol, "{dtype:?}: rel err {e}");
    }
}

#[test]
fn bad_ids_and_shapes_are_rejected() {
    let w = uniform(&[5, 8], 1, 1.0);
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();
    let past = Tensor::new(&[1u32, 5], &Device::Cpu).unwrap();
    assert!(msg(embedding(&past, &w)).contains("outside the vocabulary of 5"));
    let floats = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    assert!(msg(embedding(&floats, &w)).contains("u32"));
    let ids = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
    assert!(msg(embedding(&ids, &w.flatten_all().unwrap())).contains("rank"));
}
