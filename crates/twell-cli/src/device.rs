//! `--device` and `--dtype` flags shared by the subcommands.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArg {
    /// cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl DeviceArg {
    pub fn device(&self) -> Result<Device> {
        parse_device(&self.device)
    }
}

pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => cuda(n),
            _ => bail!("--device '{other}': want cpu, cuda or cuda:N"),
        },
    }
}

fn cuda(ordinal: usize) -> Result<Device> {
    if !candle_core::utils::cuda_is_available() {
        bail!("--device cuda: this build has no CUDA support (rebuild with --features cuda)");
    }
    let dev = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = &dev {
        // TWELL_NO_TUNE=1 keeps candle's defaults (to measure what tuning changes).
        if std::env::var_os("TWELL_NO_TUNE").is_none() {
            twell::cuda::configure(c)?;
        }
    }
    Ok(dev)
}

pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => bail!("--dtype '{other}': want f32, bf16 or f16"),
    }
}
