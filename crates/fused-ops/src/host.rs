//! Host data for the CPU kernels: the three value dtypes the ops take (f32, bf16, f16),
//! and tensors read as rows of them.
//!
//! Every CPU kernel computes in f32: half-precision inputs are widened on the fly,
//! one weight row at a time, so a kernel is written once and stays exact in f32.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

use crate::error::{err, OpError};

/// A value dtype that can be widened to and narrowed from f32.
pub trait Float: candle_core::WithDType + Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Float for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Float for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Float for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// A borrowed, contiguous CPU matrix of any TwELL dtype, read row by row as f32.
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Rows<'a> {
    /// Borrows a contiguous storage; `what` names the input in error messages.
    pub fn new(what: &'static str, storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return err(OpError::Invalid(format!(
                "{what}: input must be contiguous (call .contiguous() first)"
            )));
        };
        Ok(match storage {
            CpuStorage::F32(v) => Rows::F32(&v[start..end]),
            CpuStorage::BF16(v) => Rows::Bf16(&v[start..end]),
            CpuStorage::F16(v) => Rows::F16(&v[start..end]),
            other => {
                return err(OpError::BadDtype {
                    what,
                    dtype: other.dtype(),
                })
            }
        })
    }

    pub fn dtype(&self) -> DType {
        match self {
            Rows::F32(_) => DType::F32,
            Rows::Bf16(_) => DType::BF16,
            Rows::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Rows::F32(v) => v.len(),
            Rows::Bf16(v) => v.len(),
            Rows::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `[start, start + len)` as f32: borrowed for f32, widened into `scratch`
    /// otherwise.
    #[inline]
    pub fn f32_range<'s>(&'s self, start: usize, len: usize, scratch: &'s mut Vec<f32>) -> &'s [f32]
    where
        'a: 's,
    {
        match self {
            Rows::F32(v) => &v[start..start + len],
            Rows::Bf16(v) => widen(&v[start..start + len], scratch),
            Rows::F16(v) => widen(&v[start..start + len], scratch),
        }
    }

    /// The whole matrix widened to an owned f32 vector.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = Vec::new();
        self.f32_range(0, self.len(), &mut out).to_vec()
    }
}

fn widen<'s, T: Float>(src: &[T], scratch: &'s mut Vec<f32>) -> &'s [f32] {
    scratch.clear();
    scratch.extend(src.iter().map(|v| v.to_f32()));
    scratch
}

/// Narrows an f32 buffer into a `CpuStorage` of `dtype`.
pub fn storage_from_f32(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::BF16 => CpuStorage::BF16(values.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(values.into_iter().map(f16::from_f32).collect()),
        dtype => {
            return err(OpError::BadDtype {
                what: "output",
                dtype,
            })
        }
    })
}

/// True for the dtypes TwELL values may have.
pub fn is_value_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Wraps an f32 result as a tensor of `dtype` on `device`.
pub fn tensor_from_f32(
    values: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// A tensor's data on the host, ready to be borrowed as [`Rows`]: the tensor itself
/// when it is a contiguous CPU tensor, else a contiguous CPU copy.
pub fn host(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)?.contiguous()
}

/// Runs `f` on the rows of a contiguous CPU tensor.
pub fn with_rows<R>(
    what: &'static str,
    t: &Tensor,
    f: impl FnOnce(Rows<'_>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(Rows::new(what, cpu, layout)?),
        _ => err(OpError::Invalid(format!("{what}: expected a host tensor"))),
    }
}

/// An f32 vector from a tensor of any float dtype, on the host.
pub fn f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}
