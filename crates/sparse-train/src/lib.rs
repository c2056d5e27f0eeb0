//! # sparse-train: fine-tuning Llama checkpoints for sparse feed-forward layers
//!
//! [`Trainer`] turns each MLP's gate to ReLU and trains with a sparsity term on its
//! activations, so that most of them become exact zeros the TwELL kernels can skip:
//!
//! * [`train`]: the loop, top to bottom (loss, accumulation, clipping, validation,
//!   checkpoints that resume exactly);
//! * [`penalty`]: the sparsity term ([`Penalty`]) and λ steered towards a target
//!   density ([`L1Controller`]);
//! * [`config`]: everything that shapes a run ([`TrainConfig`]);
//! * [`data`]: text packed into training sequences ([`PackedData`]), and [`sample`],
//!   more text sampled from the model itself;
//! * [`lora`]: low-rank adapters over frozen weights, a run small enough to ship;
//! * [`optim`]: AdamW whose state can be saved, on f32 master weights;
//! * [`fused_mlp`]: the up and down projections as one trainable matrix, the layout the
//!   TwELL kernels read.

pub mod config;
pub mod data;
pub mod fused_mlp;
pub mod lora;
pub mod optim;
pub mod penalty;
pub mod sample;
pub mod train;

pub use config::TrainConfig;
pub use data::PackedData;
pub use lora::{LoraSpec, LORA_MODULES};
pub use penalty::{DensityText, L1Controller, Penalty};
pub use train::{StepLog, Trainer, Validation};
