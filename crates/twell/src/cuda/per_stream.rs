//! Scratch kept per CUDA stream for the life of the process: a launch that needs scratch
//! of a size known before it runs takes it from here instead of allocating it each call
//! (a decode step would otherwise pay an allocation a layer), and two candle devices,
//! which have streams of their own, never share one.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{CudaDevice, Result};

/// One `T` per stream, made on first use and remade when it no longer fits.
pub struct PerStream<T> {
    by_stream: Mutex<Option<HashMap<usize, T>>>,
}

impl<T> PerStream<T> {
    pub const fn new() -> Self {
        Self {
            by_stream: Mutex::new(None),
        }
    }

    /// Runs `use_it` with the scratch of `dev`'s stream, first made by `make` where there
    /// is none or `fits` refuses the one kept. A replaced buffer is freed in stream order,
    /// after the launches that used it. The lock is held while `use_it` runs, so two host
    /// threads launching on one stream never share the scratch at once.
    pub fn with<R>(
        &self,
        dev: &CudaDevice,
        fits: impl FnOnce(&T) -> bool,
        make: impl FnOnce() -> Result<T>,
        use_it: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        let key = dev.cuda_stream().cu_stream() as usize;
        let mut guard = self.by_stream.lock().expect("per-stream scratch lock");
        let map = guard.get_or_insert_with(HashMap::new);
        if !map.get(&key).is_some_and(fits) {
            map.insert(key, make()?);
        }
        use_it(map.get_mut(&key).expect("inserted above"))
    }
}
