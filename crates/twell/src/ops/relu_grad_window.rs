//! `relu_grad_window`: ReLU forward, with a backward that also reaches the gates just
//! below zero.
//!
//! Through a plain ReLU, a neuron that is off for a token gets no gradient from the
//! loss, so the loss cannot ask for a neuron it is missing: which few neurons fire per
//! token is left to the sparsity term, which only ever pushes gates down. Here the
//! gradient passes, as if the neuron were on, for gates in `(−w·mean|g|, 0]`, where
//! `mean|g|` is the mean size of the layer's gates in this pass. That is a
//! straight-through estimate of what turning the neuron on would do: the loss can then
//! pull a useful neuron across zero, where the sparsity term weighs it like the others.
//! The forward is the ReLU itself, so every zero stays an exact zero.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::error::{err, TwellError};

/// The op: `w`, the window below zero in units of the mean `|g|`.
pub struct ReluGradWindow {
    pub window: f64,
}

impl CustomOp1 for ReluGradWindow {
    fn name(&self) -> &'static str {
        "relu-grad-window"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((s.unary_impl::<candle_core::op::Relu>(l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((s.unary_impl::<candle_core::op::Relu>(l)?, l.shape().clone()))
    }

    fn bwd(&self, gate: &Tensor, _relu: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let gate = gate.detach();
        // The scale in f32: a mean over millions of bf16 values.
        let mean_size = gate.to_dtype(DType::F32)?.abs()?.mean_all()?;
        let threshold = (mean_size * -self.window)?.to_dtype(gate.dtype())?;
        let passes = gate.broadcast_gt(&threshold)?.to_dtype(grad.dtype())?;
        Ok(Some(grad.mul(&passes)?))
    }
}

/// `relu(gate)`, whose gradient also passes where `gate` lies within `window` times the
/// mean `|gate|` below zero (see the module doc). `window` 0 is the plain ReLU's
/// gradient (but at exact zeros).
pub fn relu_grad_window(gate: &Tensor, window: f64) -> Result<Tensor> {
    check_window(window)?;
    gate.apply_op1(ReluGradWindow { window })
}

/// `Ok` for a window the op can take: a finite number ≥ 0.
pub fn check_window(window: f64) -> Result<()> {
    if !(window >= 0.0 && window.is_finite()) {
        return err(TwellError::Invalid(format!(
            "the ReLU's gradient window must be a number >= 0, not {window}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Gates around zero, the upstream gradient 1 everywhere: which gates pass it.
    fn passed(gates: &[f32], window: f64) -> Vec<f32> {
        let g = Var::from_slice(gates, gates.len(), &Device::Cpu).unwrap();
        let out = relu_grad_window(g.as_tensor(), window).unwrap();
        let grads = out.sum_all().unwrap().backward().unwrap();
        grads.get(&g).unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn forward_is_the_relu() {
        let gates = [-2.0f32, -0.1, 0.0, 0.1, 3.0];
        let g = Tensor::new(&gates, &Device::Cpu).unwrap();
        let out = relu_grad_window(&g, 0.5).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out, vec![0.0, 0.0, 0.0, 0.1, 3.0]);
    }

    #[test]
    fn the_gradient_passes_inside_the_window() {
        // mean |g| = (2 + 1 + 0.2 + 0.1 + 0.1 + 2.6) / 6 = 1; window 0.5: g > -0.5 passes.
        let gates = [-2.0f32, -1.0, -0.2, 0.1, -0.1, 2.6];
        assert_eq!(passed(&gates, 0.5), vec![0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        // Window 0: the plain ReLU's gradient.
        assert_eq!(passed(&gates, 0.0), vec![0.0, 0.0, 0.0, 1.0, 0.0, 1.0]);
        // Window 1.5: down to -1.5.
        assert_eq!(passed(&gates, 1.5), vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn bad_windows_are_refused() {
        let g = Tensor::new(&[1.0f32], &Device::Cpu).unwrap();
        for bad in [-0.1, f64::NAN, f64::INFINITY] {
            let e = relu_grad_window(&g, bad).unwrap_err().to_string();
            assert!(e.contains("gradient window"), "{e}");
        }
    }
}
