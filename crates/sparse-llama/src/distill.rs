//! Knowledge distillation: the student (the model being sparsified) learns the
//! teacher's whole next-token distribution, not only the one observed token.
//!
//! A sparsity fine-tune removes most of the FFN's activity, and the model has to
//! re-learn with fewer neurons from few tokens. The teacher's distribution over the
//! whole vocabulary carries far more signal per token than a one-hot target, which is
//! why pruning and distillation go together; mixed with the corpus' cross-entropy it
//! also keeps the student from drifting far from the checkpoint it started as.

/// Mean over positions of `KL(p ‖ q)`, `p = softmax(teacher)`, `q = softmax(student)`,
/// from logits of any dtype and leading shape (`[.., vocab]`), and differentiable in the
/// student only: on the CPU one op, which reads the `[tokens, vocab]` logits a few times
/// instead of making some twenty-five f32 passes over them (on CUDA still the passes,
/// until the op's kernel has been checked on the GPU).
pub use twell::ops::kl_divergence;

use candle_core::{DType, Result, Tensor, D};

/// Mean over layers and tokens of the relative squared distance between the student's
/// and the teacher's residual streams, `‖s - t‖² / ‖t‖²` per token (rows `[tokens,
/// hidden]`, one tensor a layer), in f32 and differentiable in the student only.
///
/// Why: the logits' KL reaches each layer only through every layer after it; the
/// teacher's residual stream tells each layer what its output should have been, a
/// signal per layer and per token. Relative per token, because a few positions (the
/// attention sinks) carry residuals orders of magnitude larger than the rest and would
/// otherwise be all the term sees.
pub fn residual_distance(student: &[Tensor], teacher: &[Tensor]) -> Result<Tensor> {
    if student.len() != teacher.len() || student.is_empty() {
        candle_core::bail!(
            "residual distillation needs one residual a layer on each side (student {}, \
             teacher {})",
            student.len(),
            teacher.len()
        );
    }
    let per_layer = student
        .iter()
        .zip(teacher)
        .map(|(s, t)| {
            if s.dims() != t.dims() {
                candle_core::bail!(
                    "student residual {:?} and teacher residual {:?} differ in shape",
                    s.dims(),
                    t.dims()
                );
            }
            let t = t.detach().to_dtype(DType::F32)?;
            let diff = (s.to_dtype(DType::F32)? - &t)?;
            // The epsilon keeps an all-zero teacher row (none in a real model) finite.
            let scale = (t.sqr()?.sum(D::Minus1)? + 1e-6)?;
            diff.sqr()?.sum(D::Minus1)?.div(&scale)?.mean_all()
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&per_layer, 0)?.mean_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn residual_distance_is_relative_per_token_and_trains_the_student_only() -> Result<()> {
        let dev = Device::Cpu;
        // Token 0's teacher row is 100x token 1's; both students are off by 10% of
        // their own row, so each token adds 0.01 and the mean is 0.01, not token 0's.
        let teacher = Tensor::new(&[[300f32, 400.0], [3.0, 4.0]], &dev)?;
        let student = Var::from_tensor(&(&teacher * 1.1)?)?;
        let (s, t) = (student.as_tensor(), &teacher);
        let one = std::slice::from_ref;
        let d = residual_distance(one(s), one(t))?;
        let d = d.to_scalar::<f32>()?;
        assert!((d - 0.01).abs() < 1e-5, "{d}");
        // Equal sides are at distance 0; the gradient points the student at the teacher.
        let same = residual_distance(one(t), one(t))?;
        assert_eq!(same.to_scalar::<f32>()?, 0.0);
        let loss = residual_distance(one(s), one(t))?;
        let grads = loss.backward()?;
        let g = grads.get(student.as_tensor()).expect("student gradient");
        // d/ds of (s - t)²/‖t‖² / 2 tokens = (s - t)/‖t‖²: 0.1·t/‖t‖² per element.
        let want = Tensor::new(
            &[
                [0.1f32 * 300.0 / 250_000.0, 0.1 * 400.0 / 250_000.0],
                [0.1 * 3.0 / 25.0, 0.1 * 4.0 / 25.0],
            ],
            &dev,
        )?;
        let err = (g - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-6, "gradient off by {err}");
        // Mismatched layers or shapes are refused.
        assert!(residual_distance(&[], &[]).is_err());
        let wide = Tensor::zeros((2, 3), DType::F32, &dev)?;
        let e = residual_distance(&[wide], &[teacher])
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ in shape"), "{e}");
        Ok(())
    }
}
