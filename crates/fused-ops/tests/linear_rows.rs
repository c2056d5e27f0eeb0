//! `linear_rows` off CUDA: candle's matmul, as `candle_nn::Linear` runs it, and its
//! bad-shape errors (the kernel itself is checked on a GPU by tests/gpu).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::Module;
use common::{rel_l2, uniform};
use fused_ops::linear_rows;

#[test]
fn off_cuda_it_is_the_linear_layers_product() {
    for (m, n, k) in [(1, 7, 16), (3, 33, 24), (9, 5, 8)] {
        let x = uniform(&[m, k], 1, 1.0);
        let w = uniform(&[n, k], 2, 1.0);
        let want = candle_nn::Linear::new(w.clone(), None).forward(&x).unwrap();
        let got = linear_rows(&x, &w).unwrap();
        assert_eq!(got.dims(), [m, n]);
        assert_eq!(rel_l2(&got, &want).unwrap(), 0.0, "{m}x{n}x{k}");
    }
}

#[test]
fn bad_shapes_are_refused_by_name() {
    let msg = |x: &Tensor, w: &Tensor| format!("{}", linear_rows(x, w).expect_err("an error"));
    let x = Tensor::zeros((2, 16), DType::F32, &Device::Cpu).unwrap();
    // Widths differ.
    let w = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(msg(&x, &w).contains("linear_rows"), "{}", msg(&x, &w));
    // Not matrices.
    let x3 = Tensor::zeros((1, 2, 16), DType::F32, &Device::Cpu).unwrap();
    let w16 = Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap();
    assert!(linear_rows(&x3, &w16).is_err());
    assert!(linear_rows(&x, &w16.flatten_all().unwrap()).is_err());
}
