//! RoPE of `[b, t, heads, hd]` rows against candle's `rope_thd`, and bad input.

mod common;

use candle_core::{DType, Tensor};
use fused_ops::{rope, Rope, RopeTable};

fn random(shape: &[usize], seed: u64) -> Tensor {
    common::uniform(shape, seed, 1.0)
}

#[test]
fn op_matches_rope_thd() {
    // (b, t, heads, hd): one token, several positions and batches, the default model's
    // 9 query and 3 key heads.
    for &(b, t, heads, hd) in &[(1, 1, 4, 16), (2, 5, 2, 32), (1, 7, 9, 64), (1, 7, 3, 64)] {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let x = random(&[b, t, heads, hd], 1).to_dtype(dtype).unwrap();
            // Angles of positions 0..t, in [-1, 1] like cos and sin.
            let cos = random(&[t, hd / 2], 3).to_dtype(dtype).unwrap();
            let sin = random(&[t, hd / 2], 4).to_dtype(dtype).unwrap();
            let table = RopeTable::new(&cos, &sin).unwrap();
            let want = candle_nn::rotary_emb::rope_thd(&x, &cos, &sin).unwrap();
            let got = x.apply_op2_no_bwd(&table.cos_sin, &Rope).unwrap();
            assert_eq!(got.dims(), x.dims());
            let err = common::rel_l2(&got, &want).unwrap();
            assert!(err < tol, "{:?} {dtype:?}: rel err {err:.2e}", x.dims());
            // The public function gives the same (candle's kernel on the CPU).
            let public = rope(&x, &table).unwrap();
            assert!(common::rel_l2(&public, &want).unwrap() < tol);
        }
    }
}

#[test]
fn bad_shapes_and_dtypes_are_rejected() {
    let x = random(&[1, 3, 2, 8], 1);
    let table = |t: usize, seed: u64| {
        RopeTable::new(&random(&[t, 4], seed), &random(&[t, 4], seed + 1)).unwrap()
    };
    let short = table(2, 4);
    let err = rope(&x, &short).unwrap_err().to_string();
    assert!(err.contains("cos_sin"), "{err}");
    let cs = table(3, 3);
    let cs_bf16 = RopeTable::new(
        &cs.cos.to_dtype(DType::BF16).unwrap(),
        &cs.sin.to_dtype(DType::BF16).unwrap(),
    )
    .unwrap();
    let err = rope(&x, &cs_bf16).unwrap_err().to_string();
    assert!(err.contains("dtype"), "{err}");
    let err = rope(&random(&[1, 3, 16], 5), &cs).unwrap_err().to_string();
    assert!(err.contains("cos_sin"), "{err}");
    // Rows whose width is no whole number of heads, or whose count no whole batch.
    let err = rope(&random(&[3, 12], 5), &cs).unwrap_err().to_string();
    assert!(err.contains("heads"), "{err}");
    let err = rope(&random(&[4, 16], 5), &cs).unwrap_err().to_string();
    assert!(err.contains("heads"), "{err}");
}

#[test]
fn rows_turn_like_their_four_dimensional_view() {
    let (b, t, heads, hd) = (2, 3, 2, 8);
    let x = random(&[b, t, heads, hd], 21);
    let angles = RopeTable::new(&random(&[t, hd / 2], 22), &random(&[t, hd / 2], 23)).unwrap();
    let four = rope(&x, &angles)
        .unwrap()
        .reshape((b * t, heads * hd))
        .unwrap();
    let max_diff = |rows: Tensor| -> f32 {
        assert_eq!(rows.dims(), [b * t, heads * hd]);
        let d = (&four - rows).unwrap().abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap()
    };
    let rows = x.reshape((b * t, heads * hd)).unwrap();
    assert_eq!(max_diff(rope(&rows, &angles).unwrap()), 0.0);
    // The differentiable op on rows (a tracked input takes it on the CPU) agrees too.
    let var = candle_core::Var::from_tensor(&rows).unwrap();
    let diff = max_diff(rope(var.as_tensor(), &angles).unwrap());
    assert!(diff < 1e-6, "{diff}");
}

#[test]
fn op_backward_matches_rope_slow_autograd() {
    let (b, t, heads, hd) = (2, 5, 3, 16);
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let x = random(&[b, t, heads, hd], 7).to_dtype(dtype).unwrap();
        let cos = random(&[t, hd / 2], 8).to_dtype(dtype).unwrap();
        let sin = random(&[t, hd / 2], 9).to_dtype(dtype).unwrap();
        let table = RopeTable::new(&cos, &sin).unwrap();
        let probe = random(&[b, t, heads, hd], 10);
        let grad_through = |f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>| {
            let var = candle_core::Var::from_tensor(&x).unwrap();
            let out = f(var.as_tensor()).unwrap();
            let loss = (out.to_dtype(DType::F32).unwrap() * &probe)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            grads
                .get(var.as_tensor())
                .expect("a gradient for x")
                .clone()
        };
        let got = grad_through(&|x| x.apply_op2(&table.cos_sin, Rope));
        let want = grad_through(&|x| {
            let heads_first = x.transpose(1, 2)?.contiguous()?;
            candle_nn::rotary_emb::rope_slow(&heads_first, &cos, &sin)?.transpose(1, 2)
        });
        // The public function takes the op (and so its backward) when x tracks gradients.
        let public = grad_through(&|x| rope(x, &table));
        assert_eq!(
            common::rel_l2(
                &public.to_dtype(DType::F32).unwrap(),
                &got.to_dtype(DType::F32).unwrap()
            )
            .unwrap(),
            0.0
        );
        assert_eq!(got.dims(), x.dims());
        let err = common::rel_l2(
            &got.to_dtype(DType::F32).unwrap(),
            &want.to_dtype(DType::F32).unwrap(),
        )
        .unwrap();
        assert!(err < tol, "{dtype:?}: rel err {err:.2e}");
    }
}

#[test]
fn fused_projection_rows_turn_like_their_split_parts() {
    use fused_ops::rope_qkv;
    // (b, t, query heads, key/value heads, hd): grouped and plain attention.
    for &(b, t, nq, nkv, hd) in &[(1, 1, 4, 2, 16), (2, 5, 9, 3, 32), (3, 2, 2, 2, 8)] {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let rows = b * t;
            let qkv = random(&[rows, (nq + 2 * nkv) * hd], 31)
                .to_dtype(dtype)
                .unwrap();
            let cos = random(&[t, hd / 2], 32).to_dtype(dtype).unwrap();
            let sin = random(&[t, hd / 2], 33).to_dtype(dtype).unwrap();
            let angles = RopeTable::new(&cos, &sin).unwrap();
            let (q, kv) = rope_qkv(&qkv, &angles, nq, nkv).unwrap();
            assert_eq!(q.dims(), [rows, nq * hd]);
            assert_eq!(kv.dims(), [rows, 2 * nkv * hd]);
            assert!(q.is_contiguous() && kv.is_contiguous());
            // Each a tensor of its own: a KV cache keeping `kv` holds no queries.
            assert_eq!(kv.layout().start_offset(), 0);
            let part = |start: usize, heads: usize| qkv.narrow(1, start * hd, heads * hd).unwrap();
            let want_q = rope(&part(0, nq), &angles).unwrap();
            let want_k = rope(&part(nq, nkv), &angles).unwrap();
            let err = common::rel_l2(&q, &want_q).unwrap();
            assert!(err < tol, "q {dtype:?}: {err:.2e}");
            let err = common::rel_l2(&kv.narrow(1, 0, nkv * hd).unwrap(), &want_k).unwrap();
            assert!(err < tol, "k {dtype:?}: {err:.2e}");
            // The values pass through unchanged, bit for bit.
            let v = kv.narrow(1, nkv * hd, nkv * hd).unwrap();
            let d = (v.to_dtype(DType::F32).unwrap()
                - part(nq + nkv, nkv).to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
            assert_eq!(d, 0.0, "values {dtype:?}");
        }
    }
    // Rows that are not q | k | v of the given heads are refused with the shapes.
    let angles = RopeTable::new(&random(&[2, 4], 34), &random(&[2, 4], 35)).unwrap();
    let err = rope_qkv(&random(&[2, 7 * 8], 36), &angles, 4, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope_qkv") && err.contains("[2, 56]"), "{err}");
    let err = rope_qkv(&random(&[3, 8 * 8], 36), &angles, 4, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cos_sin"), "{err}");
}

/// The keys of `k | v` rows turned in place equal the RoPE op's keys bit for bit, and
/// the values are left as they were.
#[test]
fn keys_turned_in_place_match_the_op_and_leave_the_values() {
    use fused_ops::rope_keys_in_place;
    for &(b, t, nkv, hd) in &[(1, 1, 2, 16), (2, 5, 3, 32), (3, 2, 1, 8)] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let rows = b * t;
            let kv = random(&[rows, 2 * nkv * hd], 41).to_dtype(dtype).unwrap();
            let before = kv.copy().unwrap();
            let cos = random(&[t, hd / 2], 42).to_dtype(dtype).unwrap();
            let sin = random(&[t, hd / 2], 43).to_dtype(dtype).unwrap();
            let angles = RopeTable::new(&cos, &sin).unwrap();
            rope_keys_in_place(&kv, &angles, nkv).unwrap();
            let as_f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let max_diff = |a: &Tensor, b: &Tensor| -> f32 {
                (as_f32(a) - as_f32(b))
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap()
            };
            let part = |x: &Tensor, start: usize| x.narrow(1, start * hd, nkv * hd).unwrap();
            let want_k = part(&before, 0)
                .contiguous()
                .unwrap()
                .apply_op2_no_bwd(&angles.cos_sin, &Rope)
                .unwrap();
            assert_eq!(max_diff(&part(&kv, 0), &want_k), 0.0, "keys {dtype:?}");
            assert!(
                max_diff(&part(&kv, 0), &part(&before, 0)) > 0.0,
                "keys moved"
            );
            assert_eq!(
                max_diff(&part(&kv, nkv), &part(&before, nkv)),
                0.0,
                "values"
            );
        }
    }
    let angles = RopeTable::new(&random(&[2, 4], 44), &random(&[2, 4], 45)).unwrap();
    // Rows that are not two halves of `kv_heads` heads, a view that is not contiguous
    // and a dtype other than the table's are refused.
    let err = rope_keys_in_place(&random(&[2, 3 * 8], 46), &angles, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rope_keys_in_place") && err.contains("[2, 24]"),
        "{err}"
    );
    let wide = random(&[2, 4 * 8], 47);
    let err = rope_keys_in_place(&wide.narrow(1, 0, 16).unwrap(), &angles, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("contiguous"), "{err}");
    let err = rope_keys_in_place(
        &random(&[2, 16], 48).to_dtype(DType::BF16).unwrap(),
        &angles,
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("dtype"), "{err}");
}
