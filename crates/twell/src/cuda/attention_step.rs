//! The scratch of the split decode attention step (`crate::attention_split`): each
//! split's partial softmax sums and a ticket per (sequence, head) for the merge, kept
//! per stream so a step costs no allocation.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaDevice, Result};

/// The partial sums (`[pairs, splits, 2 + hd]` f32) and the zeroed tickets (`[pairs]`)
/// of one stream, grown to the largest step seen.
pub struct Scratch {
    pub part: CudaSlice<f32>,
    pub tickets: CudaSlice<u32>,
}

/// Keyed by the stream, so two candle devices never share one.
static SCRATCH: Mutex<Option<HashMap<usize, Scratch>>> = Mutex::new(None);

/// Runs `launch` with this stream's scratch, at least `part_len` partial sums and
/// `pairs` tickets (zero; the kernel leaves them zero).
pub fn with_scratch<T>(
    dev: &CudaDevice,
    part_len: usize,
    pairs: usize,
    launch: impl FnOnce(&mut Scratch) -> Result<T>,
) -> Result<T> {
    let key = dev.cuda_stream().cu_stream() as usize;
    let mut guard = SCRATCH.lock().expect("attention step scratch lock");
    let map = guard.get_or_insert_with(HashMap::new);
    let fits = map
        .get(&key)
        .is_some_and(|s| s.part.len() >= part_len && s.tickets.len() >= pairs);
    if !fits {
        // A replaced buffer is freed in stream order, after the launches that use it.
        map.insert(
            key,
            Scratch {
                part: dev.alloc_zeros::<f32>(part_len.max(1))?,
                tickets: dev.alloc_zeros::<u32>(pairs.max(1))?,
            },
        );
    }
    launch(map.get_mut(&key).expect("inserted above"))
}
