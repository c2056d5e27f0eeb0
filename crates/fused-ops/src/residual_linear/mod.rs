//! `residual + y · Wᵀ` with the sum written over the residual: on CUDA the product's GEMM
//! takes the residual as its `C` (beta = 1), so a layer's output projection and the
//! residual add are one pass, and no `[m, d]` product is written and read back.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

use crate::error::{err, OpError};

/// `residual [m, n] + y [m, k] · weightᵀ` (`weight [n, k]`, a bias-free linear layer's
/// weight as HF stores it). On CUDA in bf16 with contiguous operands the sum is written
/// over `residual`'s storage (taken by value: every tensor sharing that storage sees the
/// sum) and `residual` is returned; elsewhere candle's ops make a new tensor. For
/// inference: no backward.
pub fn residual_add_linear(residual: Tensor, y: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let (dims_ok, (m, n)) = match (residual.dims(), y.dims(), weight.dims()) {
        (&[m, n], &[my, k], &[nw, kw]) => (m == my && n == nw && k == kw, (m, n)),
        _ => (false, (0, 0)),
    };
    if !dims_ok {
        return err(OpError::ShapeMismatch {
            what: "residual_add_linear",
            detail: format!(
                "want residual [m, n], y [m, k] and weight [n, k], got {:?}, {:?} and {:?}",
                residual.dims(),
                y.dims(),
                weight.dims()
            ),
        });
    }
    for (what, t) in [("y", y), ("weight", weight)] {
        if t.dtype() != residual.dtype() || !t.device().same_device(residual.device()) {
            return err(OpError::Invalid(format!(
                "residual_add_linear: {what} is {:?} on {:?}, the residual {:?} on {:?}",
                t.dtype(),
                t.device().location(),
                residual.dtype(),
                residual.device().location()
            )));
        }
    }
    let in_place = residual.device().is_cuda()
        && residual.dtype() == DType::BF16
        && m > 0
        && n > 0
        && [&residual, y, weight].iter().all(|t| t.is_contiguous());
    if !in_place {
        return residual + y.matmul(&weight.t()?)?;
    }
    residual.inplace_op3(y, weight, &ResidualLinear)?;
    Ok(residual)
}

/// The op behind [`residual_add_linear`]'s CUDA form.
struct ResidualLinear;

impl candle_core::InplaceOp3 for ResidualLinear {
    fn name(&self) -> &'static str {
        "residual-add-linear"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        err(OpError::Invalid(
            "residual_add_linear writes in place on CUDA only (the CPU form adds with \
             candle's ops)"
                .into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        rs: &mut candle_core::CudaStorage,
        rl: &Layout,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<()> {
        cuda::residual_add_linear(rs, rl, ys, yl, ws, wl)
    }
}
