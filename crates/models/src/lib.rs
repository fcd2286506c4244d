//! Model configs, weights, tokenizers and forward graphs over mlx-rs.
//!
//! Everything here runs on the engine thread: MLX arrays never cross threads.

pub mod cache;
pub mod config;
pub mod cpu_gemm;
pub mod cpu_kernels;
pub mod error;
pub mod lanes;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod prefix;
pub mod runner;
pub mod tokenizer;
pub mod weights;

pub use cache::KvCache;
pub use config::{Arch, ModelConfig};
pub use cpu_kernels::Kernels;
pub use error::ModelError;
pub use lanes::Lanes;
pub use linear::WeightPolicy;
pub use llama::LlamaModel;
pub use loader::{load, Device, LoadOptions, LoadedModel};
pub use runner::{BatchRunner, RowId, RowStep, StepLogits};
pub use tokenizer::{ChatMessage, Tokenizer};
