//! The f32 dot and axpy loops of the sparse kernels: fused-ops' (the attention's CPU
//! forward runs on them too), under this crate's path.

pub use fused_ops::simd::*;
