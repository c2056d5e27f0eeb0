//! # candle-twell
//!
//! Sparse feed-forward layers for Candle LLMs: the TwELL format and sparse MLP
//! ([`twell`]), the fused transformer ops around it ([`fused_ops`]), and a Llama whose
//! MLPs use them ([`sparse_llama`]), with the fine-tuning that makes them sparse
//! ([`sparse_train`]).
//!
//! ```no_run
//! use candle_twell::sparse_llama::checkpoint::{Checkpoint, LoadOptions};
//! # fn main() -> candle_core::Result<()> {
//! let ck = Checkpoint::open("data/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let model = ck.load_model(candle_core::DType::F32, &candle_core::Device::Cpu, &LoadOptions::default())?;
//! # let _ = model; Ok(()) }
//! ```

pub use fused_ops;
pub use sparse_llama;
pub use sparse_train;
pub use twell;
