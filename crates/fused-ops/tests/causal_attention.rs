//! The fused causal attention against the plain ops it replaces (materialised scores,
//! causal mask, softmax), with KV-cache offsets, grouped-query heads and bad input.

mod common;

use candle_core::{DType, Device, Tensor};
use fused_ops::{attention_row_dot, causal_attention, causal_attention_reference};

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
        // Decode steps with long caches: the CPU splits each head group's keys into
        // ranges and merges them.
        (1, 9, 1, 3, 700, 64),
        (1, 4, 1, 1, 300, 32),
        (2, 2, 1, 1, 1000, 16),
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
fn split_decode_keys_merge_to_the_softmax_of_peaked_scores() {
    // Large queries make the softmax peak on a few keys, each in one key range: the
    // merge must weight the ranges by their maxima, not average them.
    for (heads, kv, total, seed) in [(4, 1, 513, 40u64), (9, 3, 2048, 41)] {
        let q = (random((1, heads, 1, 64), DType::F32, seed) * 40.0).unwrap();
        let k = random((1, kv, total, 64), DType::F32, seed + 1);
        let v = random((1, kv, total, 64), DType::F32, seed + 2);
        let err = rel_err(
            &causal_attention(&q, &k, &v).unwrap(),
            &reference(&q, &k, &v),
        );
        assert!(err < 1e-5, "{heads} heads over {total} keys: rel err {err}");
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

/// `(dq, dk, dv)` of `Σ out ⊙ probe` through `attention`, the inputs as variables.
fn gradients(
    attention: fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    probe: &Tensor,
) -> [Tensor; 3] {
    let vars = [q, k, v].map(|x| candle_core::Var::from_tensor(x).unwrap());
    let out = attention(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    )
    .unwrap();
    let loss = (out.to_dtype(DType::F32).unwrap() * probe)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    vars.map(|x| {
        grads
            .get(x.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {:?}", x.dims()))
            .clone()
    })
}

#[test]
fn backward_matches_plain_attention_autograd() {
    // (b, heads, t, kv_heads, T, hd): training shapes (T = t), grouped heads, one
    // token, and queries after a KV cache.
    let cases = [
        (1, 1, 1, 1, 1, 4),
        (2, 4, 7, 2, 7, 8),
        (1, 6, 33, 2, 33, 16),
        (2, 3, 5, 3, 12, 8),
        (1, 9, 64, 3, 64, 64),
    ];
    for (n, &(b, heads, t, kv, total, hd)) in cases.iter().enumerate() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let seed = 10 * n as u64;
            let q = random((b, heads, t, hd), dtype, seed);
            let k = random((b, kv, total, hd), dtype, seed + 1);
            let v = random((b, kv, total, hd), dtype, seed + 2);
            let probe = common::uniform(&[b, heads, t, hd], seed + 3, 1.0);
            let fused = gradients(causal_attention, (&q, &k, &v), &probe);
            // The reference in f32 from the same (rounded) inputs.
            let f32_inputs = [&q, &k, &v].map(|x| x.to_dtype(DType::F32).unwrap());
            let plain = gradients(
                causal_attention_reference,
                (&f32_inputs[0], &f32_inputs[1], &f32_inputs[2]),
                &probe,
            );
            for (name, (a, r)) in ["dq", "dk", "dv"].iter().zip(fused.iter().zip(&plain)) {
                assert_eq!(a.dims(), r.dims(), "case {n} {name}");
                assert_eq!(a.dtype(), dtype, "case {n} {name}");
                let err = rel_err(&a.to_dtype(DType::F32).unwrap(), r);
                assert!(err < tol, "case {n} {dtype:?} {name}: rel err {err}");
            }
        }
    }
}

#[test]
fn backward_flows_through_strided_views() {
    // The model passes `[b, t, heads, hd]` projections seen as `[b, heads, t, hd]`.
    let (b, t, heads, hd) = (2, 9, 4, 8);
    let q = random((b, t, heads, hd), DType::F32, 40);
    let k = random((b, t, heads, hd), DType::F32, 41);
    let v = random((b, t, heads, hd), DType::F32, 42);
    let probe = common::uniform(&[b, heads, t, hd], 43, 1.0);
    let transposed = |a: &Tensor, b: &Tensor, c: &Tensor| {
        causal_attention(
            &a.transpose(1, 2)?,
            &b.transpose(1, 2)?,
            &c.transpose(1, 2)?,
        )
    };
    let reference = |a: &Tensor, b: &Tensor, c: &Tensor| {
        let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        causal_attention_reference(&heads(a)?, &heads(b)?, &heads(c)?)
    };
    let fused = gradients(transposed, (&q, &k, &v), &probe);
    let plain = gradients(reference, (&q, &k, &v), &probe);
    for (a, r) in fused.iter().zip(&plain) {
        assert_eq!(a.dims(), &[b, t, heads, hd]);
        assert!(rel_err(a, r) < 1e-4);
    }
}

#[test]
fn softmax_grad_op_matches_candle_ops() {
    use fused_ops::attention_softmax_grad;
    // (rows before t, t, T): training rows, and queries after a cache.
    for &(lead, t, total) in &[(3, 1, 1), (2, 5, 5), (4, 3, 11), (1, 40, 40)] {
        let scale = 0.37f32;
        let s = common::uniform(&[lead, t, total], 50, 4.0);
        let dp = common::uniform(&[lead, t, total], 51, 1.0);
        let d = common::uniform(&[lead, t, 1], 52, 1.0);
        let past = total - t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, total), &Device::Cpu).unwrap();
        let p_want = candle_nn::ops::softmax_last_dim(
            &(&s * scale as f64).unwrap().broadcast_add(&mask).unwrap(),
        )
        .unwrap();
        let ds_want = ((dp.broadcast_sub(&d).unwrap() * &p_want).unwrap() * scale as f64).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let (p, ds) = attention_softmax_grad(
                &s.to_dtype(dtype).unwrap(),
                &dp.to_dtype(dtype).unwrap(),
                &d,
                scale,
            )
            .unwrap();
            assert_eq!(p.dims(), s.dims());
            assert_eq!(ds.dtype(), dtype);
            let ep = rel_err(&p.to_dtype(DType::F32).unwrap(), &p_want);
            let eg = rel_err(&ds.to_dtype(DType::F32).unwrap(), &ds_want);
            assert!(
                ep < tol && eg < tol,
                "{lead}x{t}x{total} {dtype:?}: p {ep}, ds {eg}"
            );
        }
    }
}

#[test]
fn softmax_grad_op_rejects_bad_input() {
    use fused_ops::attention_softmax_grad;
    let s = common::uniform(&[2, 3, 4], 60, 1.0);
    let d = common::uniform(&[2, 3, 1], 61, 1.0);
    let msg =
        |r: candle_core::Result<(Tensor, Tensor)>| r.expect_err("expected an error").to_string();
    // dp unlike s; d of the wrong shape; d not f32; fewer keys than queries.
    assert!(msg(attention_softmax_grad(
        &s,
        &s.narrow(2, 0, 3).unwrap(),
        &d,
        1.0
    ))
    .contains("want dp like s"));
    assert!(msg(attention_softmax_grad(&s, &s, &s, 1.0)).contains("d [.., t, 1]"));
    let d16 = d.to_dtype(DType::BF16).unwrap();
    assert!(msg(attention_softmax_grad(&s, &s, &d16, 1.0)).contains("f32"));
    let wide = common::uniform(&[2, 5, 4], 62, 1.0);
    let dw = common::uniform(&[2, 5, 1], 63, 1.0);
    assert!(msg(attention_softmax_grad(&wide, &wide, &dw, 1.0)).contains("T >= t"));
}

/// `rowsum(dO ⊙ O)` from token rows, in the `[b, heads, t, 1]` order of the score rows,
/// against candle's ops on the `[b, heads, t, hd]` views.
#[test]
fn row_dot_matches_candle_ops_and_checks_shapes() {
    let (b, t, heads, hd) = (2, 5, 3, 4);
    let rows = |seed: u64| {
        random((b, t, heads, hd), DType::F32, seed)
            .reshape((b * t, heads * hd))
            .unwrap()
    };
    let (grad, out) = (rows(31), rows(32));
    let view = |r: &Tensor| {
        r.reshape((b, t, heads, hd))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let want = (view(&grad) * view(&out)).unwrap().sum_keepdim(3).unwrap();
    let got = attention_row_dot(&grad, &out, b, hd).unwrap();
    assert_eq!(got.dims(), [b, heads, t, 1]);
    assert!(rel_err(&got, &want) < 1e-6);
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();
    assert!(msg(attention_row_dot(&grad, &out, 3, hd)).contains("batch 3"));
    assert!(msg(attention_row_dot(&grad, &out, b, 5)).contains("head_dim 5"));
    let short = grad.narrow(1, 0, heads * hd - hd).unwrap();
    assert!(msg(attention_row_dot(&grad, &short, b, hd)).contains("equal"));
}

#[test]
fn per_sequence_rows_of_a_longer_buffer_read_as_plain_rows() {
    use fused_ops::causal_attention_rows;
    // A KV cache's view: [b, T, width] of a [b, capacity, width] buffer.
    let (b, heads, kv, t, total, cap, hd) = (3, 4, 2, 1, 7, 16, 8);
    for dtype in [DType::F32, DType::BF16] {
        let q = common::uniform(&[b * t, heads * hd], 11, 1.0)
            .to_dtype(dtype)
            .unwrap();
        let kb = common::uniform(&[b, cap, kv * hd], 12, 1.0)
            .to_dtype(dtype)
            .unwrap();
        let vb = common::uniform(&[b, cap, kv * hd], 13, 1.0)
            .to_dtype(dtype)
            .unwrap();
        let (k3, v3) = (
            kb.narrow(1, 0, total).unwrap(),
            vb.narrow(1, 0, total).unwrap(),
        );
        assert!(!k3.is_contiguous());
        let rows = |x: &Tensor| {
            x.contiguous()
                .unwrap()
                .reshape((b * total, kv * hd))
                .unwrap()
        };
        let out = causal_attention_rows(&q, &k3, &v3, b, hd).unwrap();
        let want = causal_attention_rows(&q, &rows(&k3), &rows(&v3), b, hd).unwrap();
        assert_eq!(out.dims(), &[b * t, heads * hd]);
        let err = rel_err(&out, &want);
        assert!(err < 1e-6, "{dtype:?}: rel err {err}");
    }
    // The batch of the rows must be the call's.
    let q = common::uniform(&[2, heads * hd], 14, 1.0);
    let k = common::uniform(&[3, total, kv * hd], 15, 1.0);
    let msg = format!("{}", causal_attention_rows(&q, &k, &k, 2, hd).unwrap_err());
    assert!(msg.contains("batch"), "{msg}");
}

#[test]
fn keys_and_values_read_from_wider_rows() {
    use fused_ops::causal_attention_rows;
    // Keys and values side by side in one `[b·T, 2·kv·hd]` tensor, as the fused
    // projections give them: the op takes the narrowed views.
    let (b, heads, kv, t, hd) = (2, 4, 2, 5, 8);
    let q = common::uniform(&[b * t, heads * hd], 21, 1.0);
    let both = common::uniform(&[b * t, 2 * kv * hd], 22, 1.0);
    let (k, v) = (
        both.narrow(1, 0, kv * hd).unwrap(),
        both.narrow(1, kv * hd, kv * hd).unwrap(),
    );
    assert!(!k.is_contiguous() && !v.is_contiguous());
    let out = causal_attention_rows(&q, &k, &v, b, hd).unwrap();
    let want = causal_attention_rows(
        &q,
        &k.contiguous().unwrap(),
        &v.contiguous().unwrap(),
        b,
        hd,
    )
    .unwrap();
    assert!(rel_err(&out, &want) < 1e-6);
}

#[test]
fn one_step_attention_checks_its_input_and_runs_on_cuda_only() {
    use fused_ops::{causal_attention_step, RopeTable};
    let (b, heads, kv, hd) = (2, 4, 2, 8);
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let qkv = bf(common::uniform(&[b, (heads + 2 * kv) * hd], 31, 1.0));
    let angles = RopeTable::new(
        &bf(common::uniform(&[1, hd / 2], 32, 1.0)),
        &bf(common::uniform(&[1, hd / 2], 33, 1.0)),
    )
    .unwrap();
    let cache = bf(common::uniform(&[b, 8, 2 * kv * hd], 34, 1.0));
    let msg = |r: candle_core::Result<Tensor>| format!("{}", r.unwrap_err());
    // Right shapes: the CPU says where the step runs.
    let m = msg(causal_attention_step(&qkv, &angles, &cache, 3, heads, kv));
    assert!(m.contains("CUDA only"), "{m}");
    // A full cache, rows of other heads, another batch, another dtype: each named.
    let m = msg(causal_attention_step(&qkv, &angles, &cache, 8, heads, kv));
    assert!(m.contains("capacity > 8"), "{m}");
    let m = msg(causal_attention_step(
        &qkv,
        &angles,
        &cache,
        3,
        heads + 1,
        kv,
    ));
    assert!(m.contains("causal_attention_step"), "{m}");
    let m = msg(causal_attention_step(
        &qkv.narrow(0, 0, 1).unwrap(),
        &angles,
        &cache,
        3,
        heads,
        kv,
    ));
    assert!(m.contains("cache [2, 8, 32]"), "{m}");
    let m = msg(causal_attention_step(
        &qkv.to_dtype(DType::F32).unwrap(),
        &angles,
        &cache,
        3,
        heads,
        kv,
    ));
    assert!(m.contains("bf16"), "{m}");
}
