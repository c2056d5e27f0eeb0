//! The scratch of the split decode attention step (`crate::attention_split`): each
//! split's partial softmax sums and a ticket per (sequence, head) for the merge, kept
//! per stream so a step costs no allocation.

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaDevice, Result};

use crate::cuda::{stream_key, PerStream};

/// The partial sums (`[pairs, splits, 2 + hd]` f32) and the zeroed tickets (`[pairs]`)
/// of one stream, grown to the largest step seen.
pub struct Scratch {
    pub part: CudaSlice<f32>,
    pub tickets: CudaSlice<u32>,
}

static SCRATCH: PerStream<Scratch> = PerStream::new();

/// Runs `launch` with this stream's scratch, at least `part_len` partial sums and
/// `pairs` tickets (zero; the kernel leaves them zero).
pub fn with_scratch<T>(
    dev: &CudaDevice,
    part_len: usize,
    pairs: usize,
    launch: impl FnOnce(&mut Scratch) -> Result<T>,
) -> Result<T> {
    SCRATCH.with(
        stream_key(dev),
        |s| s.part.len() >= part_len && s.tickets.len() >= pairs,
        || {
            Ok(Scratch {
                part: dev.alloc_zeros::<f32>(part_len.max(1))?,
                tickets: dev.alloc_zeros::<u32>(pairs.max(1))?,
            })
        },
        launch,
    )
}
