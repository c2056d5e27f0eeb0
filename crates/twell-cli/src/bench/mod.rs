//! `twell bench`: dense against sparse, side by side, in one run.

pub mod energy;
pub mod mlp;
pub mod model;
pub mod timing;
