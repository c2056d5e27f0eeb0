//! The fused distillation loss against the same loss as candle ops, forward and backward,
//! and its bad-input errors.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use fused_ops::{kl_divergence, kl_divergence_reference};

type Loss = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// The loss and the student's gradient through `f` (the loss scaled by 3, so a gradient
/// that ignored the incoming one would show).
fn loss_and_grad(f: Loss, student: &Tensor, teacher: &Tensor) -> (f32, Tensor) {
    let var = Var::from_tensor(student).unwrap();
    let loss = f(var.as_tensor(), teacher).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    let value = loss.to_scalar::<f32>().unwrap();
    let grads = (loss * 3.0).unwrap().backward().unwrap();
    let grad = grads.get(var.as_tensor()).expect("a gradient").clone();
    (value, grad)
}

/// KL computed row by row in f64, the plain definition.
fn reference(student: &[Vec<f64>], teacher: &[Vec<f64>]) -> f64 {
    let softmax = |row: &[f64]| {
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect::<Vec<_>>()
    };
    let mut total = 0.0;
    for (s, t) in student.iter().zip(teacher) {
        let (q, p) = (softmax(s), softmax(t));
        total += p
            .iter()
            .zip(&q)
            .map(|(p, q)| if *p > 0.0 { p * (p / q).ln() } else { 0.0 })
            .sum::<f64>();
    }
    total / student.len() as f64
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64).unwrap().to_vec2().unwrap()
}

#[test]
fn matches_the_definition_and_its_gradient_is_q_minus_p() {
    let device = Device::Cpu;
    let (n, v) = (5, 37);
    // Wide logits, so some probabilities are tiny and the shift matters.
    let s = (Tensor::randn(0f32, 4.0, (n, v), &device).unwrap() + 30.0).unwrap();
    let t = (Tensor::randn(0f32, 6.0, (n, v), &device).unwrap() - 50.0).unwrap();
    let s = Var::from_tensor(&s).unwrap();
    let kl = kl_divergence(s.as_tensor(), &t).unwrap();
    let want = reference(&rows(s.as_tensor()), &rows(&t));
    let got = kl.to_scalar::<f32>().unwrap() as f64;
    assert!(
        want > 0.1,
        "the test needs distributions that differ: {want}"
    );
    assert!((got - want).abs() < 1e-4 * want.max(1.0), "{got} vs {want}");

    let grads = kl.backward().unwrap();
    let g = rows(grads.get(s.as_tensor()).unwrap());
    let softmax = |x: &Tensor| rows(&candle_nn::ops::softmax_last_dim(x).unwrap());
    let (q, p) = (softmax(s.as_tensor()), softmax(&t));
    for i in 0..n {
        for j in 0..v {
            let want = (q[i][j] - p[i][j]) / n as f64;
            assert!(
                (g[i][j] - want).abs() < 1e-6,
                "[{i}, {j}] {} vs {want}",
                g[i][j]
            );
        }
    }
    // The teacher gets no gradient.
    assert!(grads.get(&t).is_none());
}

#[test]
fn matches_the_candle_op_loss_forward_and_backward() {
    // (N, V): one row, odd sizes, a vocabulary wider than a block's threads, and rows
    // whose logits sit far from zero (the shift by the maximum matters).
    for (k, &(n, v, offset)) in [
        (1, 5, 0.0),
        (7, 33, 0.0),
        (16, 1000, 40.0),
        (3, 3001, -60.0),
    ]
    .iter()
    .enumerate()
    {
        let student = (common::uniform_unrelated(&[n, v], 30 + k as u64, 4.0) + offset).unwrap();
        let teacher = (common::uniform_unrelated(&[n, v], 60 + k as u64, 6.0) - offset).unwrap();
        let (want, want_grad) = loss_and_grad(kl_divergence_reference, &student, &teacher);
        assert!(
            want > 0.1,
            "the case needs distributions that differ: {want}"
        );
        // A bf16 student meets a bf16 teacher, or an f32 one (read as it is).
        for (dtype, teacher_dtype, tol) in [
            (DType::F32, DType::F32, 1e-5),
            (DType::BF16, DType::BF16, 3e-2),
            (DType::BF16, DType::F32, 3e-2),
        ] {
            let (s, t) = (
                student.to_dtype(dtype).unwrap(),
                teacher.to_dtype(teacher_dtype).unwrap(),
            );
            let (got, grad) = loss_and_grad(kl_divergence, &s, &t);
            // The bf16 case rounds the logits the reference read in f32.
            let (ref_loss, ref_grad) = if dtype == DType::F32 {
                (want, want_grad.clone())
            } else {
                loss_and_grad(kl_divergence_reference, &s, &t)
            };
            assert!(
                ((got - ref_loss) / ref_loss).abs() < tol as f32,
                "({n}, {v}) {dtype:?}/{teacher_dtype:?}: loss {got} vs {ref_loss}"
            );
            assert_eq!(grad.dims(), &[n, v]);
            assert_eq!(grad.dtype(), dtype);
            let err = common::rel_l2(
                &grad.to_dtype(DType::F32).unwrap(),
                &ref_grad.to_dtype(DType::F32).unwrap(),
            )
            .unwrap();
            assert!(
                err < tol,
                "({n}, {v}) {dtype:?}/{teacher_dtype:?}: gradient rel err {err}"
            );
        }
    }
}

#[test]
fn is_zero_between_equal_distributions_and_reads_any_leading_shape() {
    let s = common::uniform_unrelated(&[2, 3, 50], 5, 3.0);
    let same = kl_divergence(&s, &s).unwrap().to_scalar::<f32>().unwrap();
    assert!(same.abs() < 1e-6, "{same}");
    // A shift of every logit of a row leaves its softmax, so the loss is 0 again.
    let shifted = (&s + 7.0).unwrap();
    let kl = kl_divergence(&shifted, &s)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(kl.abs() < 1e-5, "{kl}");
    // [2, 3, 50] is six positions: the same loss as the rows laid out flat.
    let t = common::uniform_unrelated(&[2, 3, 50], 6, 3.0);
    let batched = kl_divergence(&s, &t).unwrap().to_scalar::<f32>().unwrap();
    let flat = kl_divergence(&s.reshape((6, 50)).unwrap(), &t.reshape((6, 50)).unwrap())
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(batched > 0.1 && (batched - flat).abs() < 1e-6);
}

#[test]
fn the_teacher_gets_no_gradient_and_may_come_in_another_dtype() {
    let s = Var::from_tensor(&common::uniform_unrelated(&[4, 40], 7, 3.0)).unwrap();
    let t = Var::from_tensor(&common::uniform_unrelated(&[4, 40], 8, 3.0)).unwrap();
    let loss = kl_divergence(s.as_tensor(), t.as_tensor()).unwrap();
    let grads = loss.backward().unwrap();
    assert!(grads.get(s.as_tensor()).is_some());
    assert!(grads.get(t.as_tensor()).is_none());
    // An f32 teacher for a bf16 student is read in bf16.
    let bf16_student = s.as_tensor().to_dtype(DType::BF16).unwrap();
    let mixed = kl_divergence(&bf16_student, t.as_tensor())
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let want = loss.to_scalar::<f32>().unwrap();
    assert!((mixed - want).abs() < 3e-2 * want, "{mixed} vs {want}");
}

#[test]
fn bad_input_is_rejected() {
    let msg = |r: candle_core::Result<Tensor>| r.expect_err("expected an error").to_string();
    let s = common::uniform_unrelated(&[4, 10], 1, 1.0);
    let wider = common::uniform_unrelated(&[4, 11], 2, 1.0);
    assert!(msg(kl_divergence(&s, &wider)).contains("differ in shape"));
    let empty = Tensor::zeros((0, 10), DType::F32, &Device::Cpu).unwrap();
    assert!(msg(kl_divergence(&empty, &empty)).contains("empty logits"));
    let no_vocab = Tensor::zeros((4, 0), DType::F32, &Device::Cpu).unwrap();
    assert!(msg(kl_divergence(&no_vocab, &no_vocab)).contains("empty logits"));
    let ids = Tensor::zeros((4, 10), DType::U32, &Device::Cpu).unwrap();
    assert!(!msg(kl_divergence(&ids, &ids)).is_empty());
}
