//! Peak device memory of a region: the CUDA pool's high-water mark above what was
//! in use when the region began (measured by the driver, not estimated).

use anyhow::Result;
use candle_core::Device;

/// Device memory accounting (CUDA pool) around a region.
pub struct MemoryProbe<'a> {
    device: &'a Device,
    base: u64,
}

impl<'a> MemoryProbe<'a> {
    pub fn start(device: &'a Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = device {
            device.synchronize()?;
            fused_ops::cuda::reset_pool_peak(c)?;
            let (current, _) = fused_ops::cuda::pool_usage(c)?;
            return Ok(Self {
                device,
                base: current,
            });
        }
        Ok(Self { device, base: 0 })
    }

    /// Most device memory in use above the start, since the start (None on CPU).
    pub fn peak_extra(&self) -> Result<Option<u64>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self.device {
            self.device.synchronize()?;
            let (_, high) = fused_ops::cuda::pool_usage(c)?;
            return Ok(Some(high.saturating_sub(self.base)));
        }
        let _ = (self.device, self.base);
        Ok(None)
    }
}
