//! Errors at the models crate boundary.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("weights: {0}")]
    Weights(String),
    #[error("tensor {name}: {message}")]
    Tensor { name: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("mlx: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
