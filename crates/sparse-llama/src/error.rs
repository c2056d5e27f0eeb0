//! Errors of model loading, saving and configuration.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {detail}", path.display())]
    BadFile { path: PathBuf, detail: String },
    #[error("not found: {0}")]
    NotFound(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid config: {0}")]
    BadConfig(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Invalid(String),
}

impl From<LlamaError> for candle_core::Error {
    fn from(e: LlamaError) -> Self {
        candle_core::Error::wrap(e)
    }
}

pub(crate) fn err<T>(e: LlamaError) -> candle_core::Result<T> {
    Err(e.into())
}
