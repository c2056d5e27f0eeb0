//! The fused causal attention against the plain ops it replaces (materialised scores,
//! causal mask, softmax), with KV-cache offsets, grouped-query heads and bad input.

mod common;

use candle_core::{DType, Device, Tensor};
use twell::ops::{causal_attention, causal_attention_reference};

fn reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    causal_attention_reference(q, k, v).unwrap()
}

fn random(shape: (usize, usize, usize, usize), dtype: DType, seed: u64) -> Tensor {
    common::uniform(&[shape.0, shape.1, shape.2, shape.3], seed, 1.0)
        .to_dtype(dtype)
        .unwrap()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    common::rel_l2(a, b).unwrap()
}

#[test]
fn matches_plain_attention_with_cache_offsets_and_grouped_heads() {
    // (b, heads, t, kv_heads, T, hd)
    let cases = [
        (1, 1, 1, 1, 1, 4),
        (2, 4, 5, 2, 8, 8),
        (1, 9, 1, 3, 17, 64),
        (3, 2, 33, 2, 33, 16),
        (1, 6, 70, 1, 100, 64),
    ];
    for (k, &(b, heads, t, kv, total, hd)) in cases.iter().enumerate() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let q = random((b, heads, t, hd), dtype, 3 * k as u64);
            let kk = random((b, kv, total, hd), dtype, 3 * k as u64 + 1);
            let v = random((b, kv, total, hd), dtype, 3 * k as u64 + 2);
            let out = causal_attention(&q, &kk, &v).unwrap();
            assert_eq!(out.dims(), &[b, heads, t, hd]);
            assert_eq!(out.dtype(), dtype);
            let err = rel_err(&out, &reference(&q, &kk, &v));
            assert!(err < tol, "case {k} {dtype:?}: rel err {err}");
        }
    }
}

#[test]
fn bad_shapes_and_dtypes_are_rejected() {
    let q = random((1, 4, 3, 8), DType::F32, 1);
    let k = random((1, 2, 5, 8), DType::F32, 2);
    let msg = |r: candle_core::Result<Tensor>| format!("{}", r.expect_err("expected an error"));
    // Head sizes differ.
    let k4 = random((1, 2, 5, 4), DType::F32, 3);
    assert!(msg(causal_attention(&q, &k4, &k4)).contains("same b and hd"));
    // Heads not a multiple of the KV heads.
    let k3 = random((1, 3, 5, 8), DType::F32, 4);
    assert!(msg(causal_attention(&q, &k3, &k3)).contains("multiple"));
    // Fewer keys than queries.
    let short = random((1, 2, 2, 8), DType::F32, 5);
    assert!(msg(causal_attention(&q, &short, &short)).contains("T >= t"));
    // v unlike k.
    assert!(msg(causal_attention(
        &q,
        &k,
        &random((1, 2, 6, 8), DType::F32, 6)
    ))
    .contains("v is"));
    // Rank 3.
    let q3 = Tensor::zeros((4, 3, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(msg(causal_attention(&q3, &k, &k)).contains("rank"));
    // Mixed dtypes.
    let kb = k.to_dtype(DType::BF16).unwrap();
    assert!(msg(causal_attention(&q, &kb, &kb)).contains("dtype"));
}
