//! The fused residual add + RMS norm against the two candle ops it replaces, and its
//! bad-input errors.

mod common;

use candle_core::{DType, Tensor};
use fused_ops::{add_rms_norm, AddRmsNorm, RmsNorm};

fn random(shape: (usize, usize), seed: u64) -> Tensor {
    common::uniform(&[shape.0, shape.1], seed, 2.0)
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    common::rel_l2(a, b).unwrap()
}

#[test]
fn op_matches_add_then_rms_norm() {
    // (M, d): one token, odd token counts, hidden sizes of the default model and others.
    for (k, &(m, d)) in [(1, 8), (1, 576), (7, 64), (33, 576), (5, 2048)]
        .iter()
        .enumerate()
    {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let seed = 10 * k as u64;
            let x = random((m, d), seed).to_dtype(dtype).unwrap();
            let y = random((m, d), seed + 1).to_dtype(dtype).unwrap();
            let alpha = random((1, d), seed + 2)
                .squeeze(0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let eps = 1e-5;
            let both = x
                .apply_op3_no_bwd(&y, &alpha, &AddRmsNorm::new(eps))
                .unwrap();
            assert_eq!(both.dims(), &[2 * m, d]);
            let sum = (&x + &y).unwrap();
            let normed = candle_nn::ops::rms_norm(&sum, &alpha, eps as f32).unwrap();
            // The sum is what candle's add stores, to the bit.
            let got = both.narrow(0, 0, m).unwrap().to_dtype(DType::F32).unwrap();
            let want = sum.to_dtype(DType::F32).unwrap();
            assert_eq!(
                got.to_vec2::<f32>().unwrap(),
                want.to_vec2::<f32>().unwrap()
            );
            let err = rel_err(&both.narrow(0, m, m).unwrap(), &normed);
            assert!(err < tol, "({m}, {d}) {dtype:?}: rel err {err:.2e}");
            // The public function keeps the leading dims.
            let x3 = x.reshape((1, m, d)).unwrap();
            let y3 = y.reshape((1, m, d)).unwrap();
            let (s3, n3) = add_rms_norm(&x3, &y3, &alpha, eps).unwrap();
            assert_eq!(s3.dims(), &[1, m, d]);
            assert!(rel_err(&n3.squeeze(0).unwrap(), &normed) < tol);
        }
    }
}

#[test]
fn bad_shapes_and_dtypes_are_rejected() {
    let x = random((3, 16), 1);
    let alpha = random((1, 16), 2).squeeze(0).unwrap();
    let short = random((3, 8), 3);
    let err = add_rms_norm(&x, &short, &alpha, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("add_rms_norm"), "{err}");
    let err = add_rms_norm(&x, &x.to_dtype(DType::BF16).unwrap(), &alpha, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("dtype"), "{err}");
    let wrong_alpha = random((1, 8), 4).squeeze(0).unwrap();
    let err = x
        .apply_op3_no_bwd(&x, &wrong_alpha, &AddRmsNorm::new(1e-5))
        .unwrap_err()
        .to_string();
    assert!(err.contains("alpha"), "{err}");
}

/// `(x, y, alpha)` → `(x + y, normed)`.
type AddNorm = dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Tensor, Tensor)>;

/// `[dx, dy, dalpha]` of `Σ sum ⊙ p0 + Σ normed ⊙ p1` through `f`.
fn norm_gradients(f: &AddNorm, inputs: [&Tensor; 3], probes: &[Tensor; 2]) -> [Tensor; 3] {
    let vars = inputs.map(|t| candle_core::Var::from_tensor(t).unwrap());
    let (sum, normed) = f(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    )
    .unwrap();
    let probe = |t: &Tensor, p: &Tensor| {
        (t.to_dtype(DType::F32).unwrap() * p)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let loss = (probe(&sum, &probes[0]) + probe(&normed, &probes[1])).unwrap();
    let grads = loss.backward().unwrap();
    vars.map(|v| grads.get(v.as_tensor()).expect("a gradient").clone())
}

#[test]
fn op_backward_matches_candle_autograd() {
    for (k, &(m, d)) in [(1, 8), (7, 64), (33, 576)].iter().enumerate() {
        let seed = 100 + 10 * k as u64;
        let x = random((m, d), seed);
        let y = random((m, d), seed + 1);
        let alpha = random((1, d), seed + 2).squeeze(0).unwrap();
        let probes = [random((m, d), seed + 3), random((m, d), seed + 4)];
        let eps = 1e-5;
        let fused = norm_gradients(
            &move |x, y, a| {
                let sum = (x + y)?;
                let normed = sum.apply_op2(a, RmsNorm::new(eps))?;
                Ok((sum, normed))
            },
            [&x, &y, &alpha],
            &probes,
        );
        let plain = norm_gradients(
            &move |x, y, a| {
                let sum = (x + y)?;
                let normed = candle_nn::ops::rms_norm_slow(&sum, a, eps as f32)?;
                Ok((sum, normed))
            },
            [&x, &y, &alpha],
            &probes,
        );
        for (name, (a, b)) in ["dx", "dy", "dalpha"].iter().zip(fused.iter().zip(&plain)) {
            assert_eq!(a.dims(), b.dims(), "{name}");
            let err = rel_err(a, b);
            assert!(err < 1e-5, "({m}, {d}) {name}: rel err {err}");
        }
        // The public function on the CPU falls back to candle's differentiable ops.
        let public = norm_gradients(
            &move |x, y, a| add_rms_norm(x, y, a, eps),
            [&x, &y, &alpha],
            &probes,
        );
        for (a, b) in public.iter().zip(&plain) {
            assert!(rel_err(a, b) < 1e-6);
        }
    }
}
