//! The keys the launchers keep values by ([`crate::per_key::PerKey`]): scratch per CUDA
//! stream (a launch that needs scratch of a size known before it runs takes it from here
//! instead of allocating it each call, and two candle devices, which have streams of
//! their own, never share one; a replaced buffer is freed in stream order, after the
//! launches that used it) and driver values per context.

use candle_core::CudaDevice;

pub use crate::per_key::PerKey;

/// Scratch per stream ([`stream_key`]).
pub type PerStream<T> = PerKey<usize, T>;

/// The key of `dev`'s stream.
pub fn stream_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().cu_stream() as usize
}

/// The key of `dev`'s context: two cards never share a value asked of the driver.
pub fn context_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().context().cu_ctx() as usize
}
