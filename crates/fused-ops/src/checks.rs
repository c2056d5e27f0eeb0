//! The input checks the ops share: each names the input and says what it expected.

use candle_core::{Layout, Result, Tensor};

use crate::error::{err, OpError};
use crate::host::is_value_dtype;

/// `(rows, cols)` of a rank-2 tensor with a value dtype (f32, bf16, f16) and no empty
/// dimension.
pub fn matrix_dims(what: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let (r, c) = match t.dims() {
        &[r, c] => (r, c),
        d => {
            return err(OpError::BadRank {
                what,
                expected: 2,
                got: d.to_vec(),
            })
        }
    };
    if !is_value_dtype(t.dtype()) {
        return err(OpError::BadDtype {
            what,
            dtype: t.dtype(),
        });
    }
    if r == 0 || c == 0 {
        return err(OpError::Empty {
            what,
            shape: vec![r, c],
        });
    }
    Ok((r, c))
}

/// `Ok` when `a` and `b` share a dtype and a device.
pub fn same_dtype_and_device(what: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return err(OpError::DtypeMismatch {
            what,
            a: a.dtype(),
            b: b.dtype(),
        });
    }
    if !a.device().same_device(b.device()) {
        return err(OpError::DeviceMismatch { what });
    }
    Ok(())
}

/// A shape mismatch of `what`, described by `detail`.
pub fn shape_err<T>(what: &'static str, detail: String) -> Result<T> {
    err(OpError::ShapeMismatch { what, detail })
}

/// The layout check shared by the `cpu_fwd`s: contiguous, rank 2.
pub fn contiguous_2d(what: &'static str, layout: &Layout) -> Result<(usize, usize)> {
    if layout.contiguous_offsets().is_none() {
        return err(OpError::Invalid(format!(
            "{what}: input must be contiguous"
        )));
    }
    match layout.dims() {
        &[r, c] => Ok((r, c)),
        d => err(OpError::BadRank {
            what,
            expected: 2,
            got: d.to_vec(),
        }),
    }
}

/// `x` with shape `dims`: `x` itself when it has them already. A reshape is a node of
/// candle's autograd graph even when nothing changes, and the backward pays every node
/// a zeros tensor and an add over its size (a 33 MB pass per `[8192, 2048]` bf16 node).
pub fn reshaped(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if x.dims() == dims {
        return Ok(x.clone());
    }
    x.reshape(dims)
}
