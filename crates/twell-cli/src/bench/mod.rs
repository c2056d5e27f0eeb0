//! `twell bench`: dense against sparse, side by side, in one run.

pub mod mlp;
pub mod timing;
