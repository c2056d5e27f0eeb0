//! `x · weightᵀ` for a few rows of x: a decode step's projections (one row a sequence).
//!
//! At 1–8 rows a projection is bound by reading its weight once. On CUDA in bf16 one
//! kernel (`kernels/src/linear_rows.cu`) streams every weight row through 16-byte loads,
//! all of a warp's loads in flight at once, and multiplies them by the few rows of x;
//! elsewhere, and for more rows, candle's matmul (cuBLAS), as `candle_nn::Linear` runs it.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::error::{err, OpError};

/// Most rows of x the kernel takes; more go to cuBLAS, whose tiles then pay off.
pub const LINEAR_ROWS_MAX: usize = 8;

/// `x [m, k] · weight [n, k]ᵀ` → `[m, n]` (a bias-free linear layer, its weight as HF
/// stores it). The kernel where it applies: CUDA, bf16, `1 ≤ m ≤ LINEAR_ROWS_MAX`, `k` a
/// multiple of 8, both operands contiguous; candle's matmul otherwise (the same result up
/// to the order of the f32 sums). Inference: no backward.
pub fn linear_rows(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (_, kw) = weight.dims2()?;
    if k != kw {
        return err(OpError::ShapeMismatch {
            what: "linear_rows",
            detail: format!(
                "x {:?} and weight {:?}: want x [m, k] and weight [n, k]",
                x.dims(),
                weight.dims()
            ),
        });
    }
    if !kernel_takes(x, weight, m, k) {
        return x.matmul(&weight.t()?);
    }
    x.apply_op2_no_bwd(weight, &LinearRows)
}

fn kernel_takes(x: &Tensor, weight: &Tensor, m: usize, k: usize) -> bool {
    x.device().is_cuda()
        && x.device().same_device(weight.device())
        && x.dtype() == DType::BF16
        && weight.dtype() == DType::BF16
        && (1..=LINEAR_ROWS_MAX).contains(&m)
        && k > 0
        && k.is_multiple_of(8)
        && weight.dim(0).is_ok_and(|n| n > 0)
        && x.is_contiguous()
        && weight.is_contiguous()
}

/// The op behind [`linear_rows`]' kernel: inputs `(x [m, k], weight [n, k])`.
struct LinearRows;

impl CustomOp2 for LinearRows {
    fn name(&self) -> &'static str {
        "linear-rows"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        err(OpError::Invalid(
            "linear_rows' kernel runs on CUDA only (the CPU form is candle's matmul)".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::linear_rows(xs, xl, ws, wl)
    }
}
