//! Model configs, weights, tokenizers and forward graphs over mlx-rs.
//!
//! Everything here runs on the engine thread: MLX arrays never cross threads.

pub mod adapter;
pub mod causal_conv;
pub mod compiled_decode;
pub mod compiled_mixed;
pub mod compiled_prefill;
pub mod composed_attention;
pub mod config;
pub mod cpu_gemm;
pub mod cpu_kernels;
mod cuda_kernel;
pub mod decode_kernels;
pub mod error;
pub mod gated_delta;
pub mod gemv;
pub mod graph_census;
pub mod host_attention;
pub mod kv;
pub mod lanes;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod lora;
pub mod mamba2;
pub mod memory;
pub mod paged_attention;
pub mod runner;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

pub use adapter::{
    write_random_mlx_lm, Adapter, AdapterFiles, AdapterFormat, RandomAdapter, Target,
};
pub use config::{Arch, ModelConfig};
pub use cpu_kernels::Kernels;
pub use error::ModelError;
pub use kv::{KvBudget, KvMemory, KvShape, KvSplit, KvStep, KvUse, PagedKv, SlidingLayers};
pub use lanes::Lanes;
pub use linear::WeightPolicy;
pub use llama::{compile_traces, LlamaModel};
pub use loader::{load, Device, LoadOptions, LoadedModel};
pub use lora::{
    AdapterCounters, AdapterId, AdapterPool, AdapterPoolConfig, LoraStep, StackLayout,
    DENSE_MAX_COLUMNS,
};
pub use runner::{
    BatchRunner, RowId, RowStep, StepLogits, StepPicks, StepTiming, DEFAULT_BLOCK_SIZE,
};
pub use sampler::{PickLogprobs, Picked, SampleRow};
pub use tokenizer::{ChatMessage, Tokenizer};
pub use weft_kv_pool::storage::AffineQuant;
pub use weft_kv_pool::{KvGroups, RowBlocks, StorageOp};
