//! Knowledge distillation: the student (the model being sparsified) learns the
//! teacher's whole next-token distribution, not only the one observed token.
//!
//! A sparsity fine-tune removes most of the FFN's activity, and the model has to
//! re-learn with fewer neurons from few tokens. The teacher's distribution over the
//! whole vocabulary carries far more signal per token than a one-hot target, which is
//! why pruning and distillation go together; mixed with the corpus' cross-entropy it
//! also keeps the student from drifting far from the checkpoint it started as.

/// Mean over positions of `KL(p ‖ q)`, `p = softmax(teacher)`, `q = softmax(student)`,
/// computed in f32 from logits of any dtype and leading shape (`[.., vocab]`), and
/// differentiable in the student only: one op, which reads the `[tokens, vocab]` logits
/// a few times instead of making some twenty-five f32 passes over them.
pub use twell::ops::kl_divergence;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor, Var};

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
    fn is_zero_for_equal_logits_and_reads_bf16_and_batched_shapes() {
        let device = Device::Cpu;
        let s = Tensor::randn(0f32, 3.0, (2, 3, 50), &device).unwrap();
        let kl = kl_divergence(&s, &s).unwrap().to_scalar::<f32>().unwrap();
        assert!(kl.abs() < 1e-6, "{kl}");
        // A shift of every logit of a row changes nothing.
        let shifted = (&s + 7.0).unwrap();
        let kl = kl_divergence(&shifted, &s)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(kl.abs() < 1e-5, "{kl}");
        let t = Tensor::randn(0f32, 3.0, (2, 3, 50), &device).unwrap();
        let f32_kl = kl_divergence(&s, &t).unwrap().to_scalar::<f32>().unwrap();
        let bf16_kl = kl_divergence(
            &s.to_dtype(DType::BF16).unwrap(),
            &t.to_dtype(DType::BF16).unwrap(),
        )
        .unwrap();
        assert_eq!(bf16_kl.dtype(), DType::F32);
        let bf16_kl = bf16_kl.to_scalar::<f32>().unwrap();
        assert!(f32_kl > 0.5 && (bf16_kl - f32_kl).abs() < 0.05 * f32_kl);
    }

    #[test]
    fn refuses_logits_of_different_shapes() {
        let device = Device::Cpu;
        let s = Tensor::zeros((4, 10), DType::F32, &device).unwrap();
        let t = Tensor::zeros((4, 11), DType::F32, &device).unwrap();
        let e = kl_divergence(&s, &t).unwrap_err().to_string();
        assert!(e.contains("differ in shape"), "{e}");
        let empty = Tensor::zeros((0, 10), DType::F32, &device).unwrap();
        assert!(kl_divergence(&empty, &empty).is_err());
    }
}
