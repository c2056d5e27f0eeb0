//! # fused-ops: fused transformer ops for Candle
//!
//! The ops a Llama forward and its training step spend their time in around the MLP, each
//! a candle CustomOp with a CPU path (the reference) and a CUDA path (bf16 kernels from
//! `twell-kernels`), and with its backward pass where training needs one:
//!
//! * [`causal_attention`] (and [`causal_attention_rows`] on `[tokens, heads·hd]` rows):
//!   causal attention in one kernel, [`causal_attention_step`] the one-token decode step
//!   that also writes the KV cache, and [`attention_softmax_grad`], the row-wise middle
//!   of the attention's backward;
//! * [`add_rms_norm`]: the residual add and the RMS norm after it ([`rms_norm`] alone);
//! * [`rope`]: rotary position embedding of queries and keys ([`rope_qkv`] on fused
//!   q | k | v rows, [`rope_keys_in_place`] on a cache's `k | v` rows);
//! * [`residual_add_linear`]: `residual + x · Wᵀ` as one GEMM;
//! * [`cross_entropy`]: the language-model loss over the logits, and [`embedding`], the
//!   token embedding at the input (a one-pass backward);
//! * [`kl_divergence`]: the distillation loss between a teacher's and a student's logits;
//! * [`adamw_step`] and [`adamw_step_mixed`]: an AdamW update of one parameter in place
//!   (f32, or a bf16 variable on an f32 master), and [`sum_squares`] for gradient norms.
//!
//! [`cuda`] holds what the CUDA launchers share (device tuning, launch shapes, poisoned
//! outputs for tests); `twell`'s sparse MLP launches through it too.

mod adamw;
mod add_rms_norm;
mod argmax;
mod attention;
pub mod checks;
pub mod compare;
mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod embedding;
pub mod error;
pub mod host;
mod kl_divergence;
mod linear_rows;
pub mod per_key;
mod residual_linear;
mod rope;
pub mod simd;

pub use adamw::{adamw_step, adamw_step_mixed, sum_squares, AdamwStep};
pub use add_rms_norm::{add_rms_norm, rms_norm, AddRmsNorm, RmsNorm};
pub use argmax::argmax_rows;
pub use attention::softmax_grad::{
    attention_row_dot, attention_softmax_grad, AttentionSoftmaxGrad,
};
pub use attention::{
    causal_attention, causal_attention_reference, causal_attention_rows,
    causal_attention_rows_turning_q, causal_attention_step, fused_on_device,
    kernel_name as causal_attention_kernel_name, step_on_device, CausalAttention,
    CausalAttentionStep, SlotAttention, CUDA_DECODE_MAX_KEYS, CUDA_HEAD_DIMS,
};
pub use cross_entropy::{cross_entropy, CrossEntropy};
pub use embedding::{embedding, Embedding};
pub use error::OpError;
pub use kl_divergence::{
    kl_divergence, kl_divergence_fused, kl_divergence_reference, KlDivergence,
};
pub use linear_rows::{linear_rows, LINEAR_ROWS_MAX};
pub use residual_linear::residual_add_linear;
pub use rope::{
    rope, rope_keys_in_place, rope_qkv, rope_qkv_part, QkvPart, Rope, RopeQkv, RopeTable,
};
