//! Errors of the ops' input checks.
//!
//! Ops return `candle_core::Result`; these variants are wrapped into `candle_core::Error`
//! so callers keep one error type, and tests and users can still downcast to the cause.

use candle_core::DType;

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{what}: expected a rank-{expected} tensor, got shape {got:?}")]
    BadRank {
        what: &'static str,
        expected: usize,
        got: Vec<usize>,
    },
    #[error("{what}: shape mismatch: {detail}")]
    ShapeMismatch { what: &'static str, detail: String },
    #[error("{what}: unsupported dtype {dtype:?} (the ops take f32, bf16 or f16)")]
    BadDtype { what: &'static str, dtype: DType },
    #[error("{what}: dtypes differ ({a:?} vs {b:?}); convert the inputs to one dtype first")]
    DtypeMismatch {
        what: &'static str,
        a: DType,
        b: DType,
    },
    #[error("{what}: inputs live on different devices")]
    DeviceMismatch { what: &'static str },
    #[error("{what}: empty dimension in shape {shape:?}")]
    Empty {
        what: &'static str,
        shape: Vec<usize>,
    },
    #[error("{0}")]
    Invalid(String),
}

impl From<OpError> for candle_core::Error {
    fn from(e: OpError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Shorthand used by the checks: build the error and convert it.
pub(crate) fn err<T>(e: OpError) -> candle_core::Result<T> {
    Err(e.into())
}
