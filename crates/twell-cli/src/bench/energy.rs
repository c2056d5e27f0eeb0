//! GPU energy from NVML's total-energy counter, read before and after a timed region
//! (a counter, not power polling). Unavailable on CPU builds and where NVML is absent.

/// Reads the energy counter of one GPU, in millijoules.
pub struct EnergyMeter {
    #[cfg(feature = "cuda")]
    device: Option<(nvml_wrapper::Nvml, u32)>,
}

impl EnergyMeter {
    /// A meter for GPU `ordinal`; `None` inside when NVML cannot be used.
    pub fn new(ordinal: Option<usize>) -> Self {
        #[cfg(feature = "cuda")]
        {
            let device = ordinal.and_then(|o| {
                let nvml = nvml_wrapper::Nvml::init().ok()?;
                nvml.device_by_index(o as u32)
                    .ok()?
                    .total_energy_consumption()
                    .ok()?;
                Some((nvml, o as u32))
            });
            Self { device }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Self {}
        }
    }

    /// The counter now, in millijoules.
    pub fn read_mj(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        {
            let (nvml, i) = self.device.as_ref()?;
            nvml.device_by_index(*i)
                .ok()?
                .total_energy_consumption()
                .ok()
        }
        #[cfg(not(feature = "cuda"))]
        None
    }
}
