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
