//! `twell bench`: dense against sparse, side by side, in one run.

pub mod energy;
pub mod loss;
pub mod memory;
pub mod mlp;
pub mod mlp_train;
pub mod model;
pub mod timing;
