//! Errors of the TwELL format and ops.
//!
//! Library functions return `candle_core::Result`; these variants are wrapped into
//! `candle_core::Error` so callers keep one error type, but tests and users can still
//! downcast to the precise cause.

use candle_core::DType;

#[derive(Debug, thiserror::Error)]
pub enum TwellError {
    #[error("TwELL tile width must be one of 32, 64, 128 or 256 columns, got {0}")]
    BadTile(usize),
    #[error("TwELL compression factor must be 2, 4 or 8, got {0}")]
    BadCompression(usize),
    #[error("{what}: expected a rank-{expected} tensor, got shape {got:?}")]
    BadRank {
        what: &'static str,
        expected: usize,
        got: Vec<usize>,
    },
    #[error("{what}: shape mismatch: {detail}")]
    ShapeMismatch { what: &'static str, detail: String },
    #[error("{what}: unsupported dtype {dtype:?} (TwELL values are f32, bf16 or f16)")]
    BadDtype { what: &'static str, dtype: DType },
    #[error("{what}: a matrix of {rows} x {cols} is too large for 32-bit TwELL offsets")]
    TooLarge {
        what: &'static str,
        rows: usize,
        cols: usize,
    },
    #[error("sparse FFN needs a ReLU gate: SiLU activations are never exactly zero")]
    SparseNeedsRelu,
    #[error(
        "sparse FFN: the TwELL kernels do not apply MLP biases (mlp_bias) yet; \
         run this model with the dense FFN (--ffn dense or auto)"
    )]
    SparseBias,
    #[error("{0}")]
    Invalid(String),
}

impl From<TwellError> for candle_core::Error {
    fn from(e: TwellError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Shorthand used by the checks: build the error and convert it.
pub(crate) fn err<T>(e: TwellError) -> candle_core::Result<T> {
    Err(e.into())
}
