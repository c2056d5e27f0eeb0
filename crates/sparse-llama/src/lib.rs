//! # sparse-llama
//!
//! A Llama causal LM whose feed-forward layers run dense or through TwELL sparse
//! kernels, with checkpoint IO (HF directories, the hf-hub cache, GGUF), text
//! generation, perplexity and per-layer sparsity statistics. The fine-tuning that
//! makes a checkpoint sparse is the `sparse-train` crate.

pub mod adapter;
pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod decode;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod model;
pub mod perplexity;
pub mod sparsity;
pub mod synthetic;
pub mod tensor_parallel;
pub mod tokenizer;

pub use config::{
    Config, Llama3RopeConfig, Llama3RopeType, LlamaConfig, LlamaEosToks, SparseSettings,
    DEFAULT_MAX_SEQ_LEN,
};
pub use decode::{DecodeOptions, DecodeRow, SlotDecoder};
pub use error::LlamaError;
pub use model::{AttentionPath, Cache, CpuQuantization, Llama, SparseLlama, TrainOutput};
pub use twell::cpu::quant::QuantFormat;
