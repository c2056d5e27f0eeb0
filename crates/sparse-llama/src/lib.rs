//! # sparse-llama
//!
//! A Llama causal LM whose feed-forward layers run dense or through TwELL sparse
//! kernels, with checkpoint IO (HF directories, the hf-hub cache, GGUF), text
//! generation, perplexity, and L1 sparsity fine-tuning.

pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod distill;
pub mod error;
pub mod fused_mlp;
pub mod generate;
pub mod gguf;
pub mod model;
pub mod optim;
pub mod perplexity;
pub mod sample;
pub mod sparsity;
pub mod synthetic;
pub mod tokenizer;
pub mod train;

pub use config::{Config, LlamaConfig, LlamaEosToks, SparseSettings};
pub use error::LlamaError;
pub use model::{AttentionPath, Cache, Llama, SparseLlama, TrainOutput};
