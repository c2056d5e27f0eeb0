//! Comparing a fast path with its reference, as every check in the project does.

use candle_core::{DType, Result, Tensor};

/// `‖a − b‖ / ‖b‖`, computed in f64 (on the tensors' device); `b` is the reference.
pub fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if den == 0.0 { num } else { num / den })
}
