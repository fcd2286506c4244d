//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a GGUF file, converting it, or
/// fetching the default model. Every variant names what it was looking at
/// (a path, a metadata key, a tensor) so that a bad file gives a clear message.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// An I/O operation on `path` failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("open", "read", "write", ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The file does not start with the GGUF magic.
    #[error("{path}: not a GGUF file (magic bytes {found:02x?}, expected \"GGUF\")")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first bytes that were found.
        found: Vec<u8>,
    },

    /// The GGUF version is not one this reader understands.
    #[error("unsupported GGUF version {version} (supported: 2 and 3, little-endian)")]
    UnsupportedVersion {
        /// The version number as read (little-endian).
        version: u32,
    },

    /// The file ended (or a declared length ran) past the end of the data.
    #[error("GGUF file is truncated or malformed: {what} at byte offset {offset} needs {needed} bytes, only {available} left")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// How many bytes were left.
        available: u64,
    },

    /// A structural value in the header is out of range.
    #[error("GGUF file is malformed: {0}")]
    Malformed(String),

    /// A string in the file is not valid UTF-8.
    #[error("GGUF file is malformed: {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string (key name, or tensor index).
        what: String,
    },

    /// A metadata value has a type code this reader does not know.
    #[error("GGUF metadata key {key:?} has unknown value type {type_code}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The type code read from the file.
        type_code: u32,
    },

    /// A required metadata key is absent.
    #[error("GGUF metadata key {key:?} is missing")]
    MissingKey {
        /// The metadata key.
        key: String,
    },

    /// A metadata key holds a value of the wrong type or an out-of-range value.
    #[error("GGUF metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        /// The metadata key.
        key: String,
        /// What was expected.
        expected: String,
        /// What was found.
        found: String,
    },

    /// A required tensor is absent.
    #[error("GGUF tensor {name:?} is missing")]
    MissingTensor {
        /// The tensor name (GGUF spelling).
        name: String,
    },

    /// A tensor has a shape that does not fit what the conversion needs.
    #[error("GGUF tensor {name:?}: {reason}")]
    BadTensor {
        /// The tensor name (GGUF spelling).
        name: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor is stored in a ggml type the converter cannot map losslessly.
    #[error("GGUF tensor {name:?} has type {type_name}, which this converter does not support there (supported: {supported})")]
    UnsupportedTensorType {
        /// The tensor name (GGUF spelling).
        name: String,
        /// The ggml type name (or numeric code).
        type_name: String,
        /// The types that are supported in that place.
        supported: &'static str,
    },

    /// The file holds a tensor the converter does not know where to put.
    #[error("GGUF tensor {name:?} has no counterpart in the mlx-lm {arch} layout")]
    UnknownTensor {
        /// The tensor name (GGUF spelling).
        name: String,
        /// The architecture being converted.
        arch: String,
    },

    /// The model uses a feature the converter does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),

    /// Building or saving the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// Writing the safetensors file failed.
    #[error("writing safetensors {path}: {reason}")]
    Safetensors {
        /// The output file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// Serializing JSON failed.
    #[error("writing JSON {path}: {source}")]
    Json {
        /// The output file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },

    /// Downloading failed.
    #[error("downloading {url}: {reason}")]
    Download {
        /// The URL.
        url: String,
        /// What went wrong.
        reason: String,
    },

    /// A file does not have the expected SHA-256.
    #[error("{path}: SHA-256 mismatch: expected {expected}, got {actual} (corrupt or wrong file)")]
    HashMismatch {
        /// The file that was checked.
        path: PathBuf,
        /// The expected digest (hex).
        expected: String,
        /// The digest that was computed (hex).
        actual: String,
    },

    /// Reading the wheel (zip archive) failed.
    #[error("wheel {path}: {reason}")]
    Zip {
        /// The wheel.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

impl GgufError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        GgufError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn bad_tensor(name: &str, reason: impl Into<String>) -> Self {
        GgufError::BadTensor {
            name: name.to_string(),
            reason: reason.into(),
        }
    }
}
