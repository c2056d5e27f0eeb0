//! `--device` and `--dtype`: where and in what precision a subcommand computes.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// `--device`: `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("'{other}': want cpu, cuda or cuda:N")),
            },
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// The device, opened and (CUDA) tuned: the memory pool keeps what it frees, cuBLAS
    /// gets a workspace, per-buffer event tracking is off (`fused_ops::cuda::configure`).
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => {
                if !candle_core::utils::cuda_is_available() {
                    bail!(
                        "--device cuda: this build has no CUDA support (rebuild with \
                         --features cuda)"
                    );
                }
                let dev = Device::new_cuda(ordinal)?;
                #[cfg(feature = "cuda")]
                if let Device::Cuda(c) = &dev {
                    fused_ops::cuda::configure(c)?;
                }
                Ok(dev)
            }
        }
    }
}

/// The device as a report names it: the GPU's own name (`NVIDIA H100 80GB HBM3`), so
/// that figures say which card gave them; `cpu` for the host.
pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        #[cfg(feature = "cuda")]
        Device::Cuda(c) => c
            .cuda_stream()
            .context()
            .name()
            .unwrap_or_else(|_| format!("{:?}", device.location())),
        _ => format!("{:?}", device.location()),
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArg {
    /// cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

impl DeviceArg {
    pub fn device(&self) -> Result<Device> {
        self.device.open()
    }
}

/// `--dtype`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    /// `arg`'s dtype, else the default for `device`: bf16 on CUDA, f32 elsewhere.
    pub fn or_default(arg: Option<Self>, device: &Device) -> DType {
        match arg {
            Some(d) => d.dtype(),
            None if device.is_cuda() => DType::BF16,
            None => DType::F32,
        }
    }
}

impl std::fmt::Display for DtypeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

/// `--ffn`: [`twell::FfnMode`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnArg {
    /// candle's dense MLP, the reference.
    Dense,
    /// The TwELL kernels at every call.
    Sparse,
    /// Per call, the side its own timings find faster at that size and density.
    Auto,
}

impl FfnArg {
    pub fn mode(self) -> twell::FfnMode {
        match self {
            Self::Dense => twell::FfnMode::Dense,
            Self::Sparse => twell::FfnMode::Sparse,
            Self::Auto => twell::FfnMode::Auto,
        }
    }
}
