//! A reader for GGUF files (versions 2 and 3, little-endian).
//!
//! The whole file is memory-mapped; the header (metadata and tensor infos)
//! is parsed eagerly and validated, tensor data is handed out as borrowed
//! byte slices. Every length read from the file is checked against the bytes
//! that are actually there before anything is allocated, so a truncated or
//! corrupt file gives an error, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::GgufError;

type Result<T> = std::result::Result<T, GgufError>;

/// The default alignment of the tensor data section.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Largest number of dimensions a ggml tensor can have.
pub const MAX_DIMS: u32 = 4;

/// A ggml tensor type, by its numeric code in the file.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    /// 32-bit float.
    pub const F32: GgmlType = GgmlType(0);
    /// 16-bit IEEE float.
    pub const F16: GgmlType = GgmlType(1);
    /// 4-bit, blocks of 32: f16 scale, 16 bytes of nibbles; value = d * (q - 8).
    pub const Q4_0: GgmlType = GgmlType(2);
    /// 4-bit, blocks of 32: f16 scale, f16 min, 16 bytes of nibbles; value = d * q + m.
    pub const Q4_1: GgmlType = GgmlType(3);
    /// 5-bit, blocks of 32.
    pub const Q5_0: GgmlType = GgmlType(6);
    /// 5-bit with min, blocks of 32.
    pub const Q5_1: GgmlType = GgmlType(7);
    /// 8-bit, blocks of 32: f16 scale, 32 signed bytes; value = d * q.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// 8-bit with sum, blocks of 32.
    pub const Q8_1: GgmlType = GgmlType(9);
    /// k-quant 2-bit.
    pub const Q2_K: GgmlType = GgmlType(10);
    /// k-quant 3-bit.
    pub const Q3_K: GgmlType = GgmlType(11);
    /// k-quant 4-bit.
    pub const Q4_K: GgmlType = GgmlType(12);
    /// k-quant 5-bit.
    pub const Q5_K: GgmlType = GgmlType(13);
    /// k-quant 6-bit.
    pub const Q6_K: GgmlType = GgmlType(14);
    /// k-quant 8-bit.
    pub const Q8_K: GgmlType = GgmlType(15);
    /// 8-bit integer.
    pub const I8: GgmlType = GgmlType(24);
    /// 16-bit integer.
    pub const I16: GgmlType = GgmlType(25);
    /// 32-bit integer.
    pub const I32: GgmlType = GgmlType(26);
    /// 64-bit integer.
    pub const I64: GgmlType = GgmlType(27);
    /// 64-bit float.
    pub const F64: GgmlType = GgmlType(28);
    /// bfloat16.
    pub const BF16: GgmlType = GgmlType(30);

    /// The type's name as ggml spells it, or `type<N>` for an unknown code.
    pub fn name(self) -> String {
        let known = match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return format!("type{}", self.0),
        };
        known.to_string()
    }

    /// `(elements per block, bytes per block)` for the types whose storage
    /// size this reader knows; `None` otherwise.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        Some(match self.0 {
            0 => (1, 4),
            1 => (1, 2),
            2 => (32, 18),
            3 => (32, 20),
            6 => (32, 22),
            7 => (32, 24),
            8 => (32, 34),
            9 => (32, 36),
            10 => (256, 84),
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210),
            15 => (256, 292),
            24 => (1, 1),
            25 => (1, 2),
            26 => (1, 4),
            27 => (1, 8),
            28 => (1, 8),
            30 => (1, 2),
            _ => return None,
        })
    }
}

impl fmt::Debug for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `UINT8`
    U8(u8),
    /// `INT8`
    I8(i8),
    /// `UINT16`
    U16(u16),
    /// `INT16`
    I16(i16),
    /// `UINT32`
    U32(u32),
    /// `INT32`
    I32(i32),
    /// `FLOAT32`
    F32(f32),
    /// `BOOL`
    Bool(bool),
    /// `STRING`
    String(String),
    /// `ARRAY` (elements all of one type, possibly nested arrays)
    Array(Vec<GgufValue>),
    /// `UINT64`
    U64(u64),
    /// `INT64`
    I64(i64),
    /// `FLOAT64`
    F64(f64),
}

impl GgufValue {
    /// The GGUF name of this value's type (`UINT32`, `ARRAY[STRING]`, ...).
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::U8(_) => "UINT8".into(),
            GgufValue::I8(_) => "INT8".into(),
            GgufValue::U16(_) => "UINT16".into(),
            GgufValue::I16(_) => "INT16".into(),
            GgufValue::U32(_) => "UINT32".into(),
            GgufValue::I32(_) => "INT32".into(),
            GgufValue::F32(_) => "FLOAT32".into(),
            GgufValue::Bool(_) => "BOOL".into(),
            GgufValue::String(_) => "STRING".into(),
            GgufValue::Array(items) => match items.first() {
                Some(first) => format!("ARRAY[{}]", first.type_name()),
                None => "ARRAY[]".into(),
            },
            GgufValue::U64(_) => "UINT64".into(),
            GgufValue::I64(_) => "INT64".into(),
            GgufValue::F64(_) => "FLOAT64".into(),
        }
    }

    /// Any integer value, as i128 (so every GGUF integer fits).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A float value (`FLOAT32` widened, or `FLOAT64`).
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, for a `STRING`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The bool, for a `BOOL`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, for an `ARRAY`.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Dimensions, innermost first (`dims[0]` is the contiguous one; for a
    /// matrix it is the number of columns / input features).
    pub dims: Vec<u64>,
    /// The storage type.
    pub ggml_type: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Number of elements (product of `dims`).
    pub n_elements: u64,
    /// Size of the data in bytes, when the type's layout is known.
    pub n_bytes: Option<u64>,
}

impl TensorInfo {
    /// The shape in row-major order (outermost first), as numpy/MLX/safetensors
    /// write it: `dims` reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An opened, parsed GGUF file.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, and parses its header.
    ///
    /// The file must not be modified while the returned value is alive.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| GgufError::io("open", path, e))?;
        // SAFETY: the map is read-only and the file is not modified by this
        // process; like every mmap-based reader we rely on no other process
        // truncating the file while it is mapped (documented on `open`).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io("mmap", path, e))?;
        Self::parse(path.to_path_buf(), Storage::Mapped(mmap))
    }

    /// Parses a GGUF file held in memory (`name` is used in error messages).
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(name.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<GgufFile> {
        let bytes = storage.bytes();
        let mut cur = Cursor {
            data: bytes,
            pos: 0,
        };
        let magic = cur.take(4, "magic").map_err(|_| GgufError::BadMagic {
            path: path.clone(),
            found: bytes.iter().take(4).copied().collect(),
        })?;
        if magic != b"GGUF" {
            return Err(GgufError::BadMagic {
                path,
                found: magic.to_vec(),
            });
        }
        let version = cur.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let tensor_count = cur.u64("tensor count")?;
        let kv_count = cur.u64("metadata count")?;
        // Each key/value needs at least 8 (key length) + 4 (type) bytes and
        // each tensor info at least 8 + 4 + 4 + 8 bytes.
        cur.check_count(kv_count, 12, "metadata count")?;

        let mut metadata = Vec::new();
        let mut metadata_index = HashMap::new();
        for i in 0..kv_count {
            let key = cur.string(&format!("metadata key #{i}"))?;
            let type_code = cur.u32(&format!("type of metadata key {key:?}"))?;
            let value = cur.value(&key, type_code, 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Malformed(format!(
                    "metadata key {key:?} appears twice"
                )));
            }
            metadata.push((key, value));
        }

        cur.check_count(tensor_count, 24, "tensor count")?;
        let mut infos = Vec::new();
        for i in 0..tensor_count {
            let name = cur.string(&format!("name of tensor #{i}"))?;
            let n_dims = cur.u32(&format!("dimension count of tensor {name:?}"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::bad_tensor(
                    &name,
                    format!("has {n_dims} dimensions (must be 1..={MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(cur.u64(&format!("dimension {d} of tensor {name:?}"))?);
            }
            let ggml_type = GgmlType(cur.u32(&format!("type of tensor {name:?}"))?);
            let offset = cur.u64(&format!("data offset of tensor {name:?}"))?;
            infos.push((name, dims, ggml_type, offset));
        }

        let alignment = match metadata_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v {
                    GgufValue::U32(a) if *a != 0 && a.is_power_of_two() => u64::from(*a),
                    _ => {
                        return Err(GgufError::WrongType {
                            key: "general.alignment".into(),
                            expected: "a non-zero power of two UINT32".into(),
                            found: format!("{v:?}"),
                        })
                    }
                }
            }
        };
        let header_end = cur.pos as u64;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        if data_offset > file_len && tensor_count > 0 {
            return Err(GgufError::Truncated {
                what: "tensor data section".into(),
                offset: data_offset,
                needed: 1,
                available: 0,
            });
        }
        let data_len = file_len.saturating_sub(data_offset);

        let mut tensors = Vec::with_capacity(infos.len());
        let mut tensor_index = HashMap::new();
        for (name, dims, ggml_type, offset) in infos {
            let mut n_elements: u64 = 1;
            for &d in &dims {
                if d == 0 {
                    return Err(GgufError::bad_tensor(
                        &name,
                        format!("has a zero dimension ({dims:?})"),
                    ));
                }
                n_elements = n_elements.checked_mul(d).ok_or_else(|| {
                    GgufError::bad_tensor(&name, format!("dimensions {dims:?} overflow"))
                })?;
            }
            if offset % alignment != 0 {
                return Err(GgufError::bad_tensor(
                    &name,
                    format!("data offset {offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            let n_bytes = match ggml_type.block_layout() {
                None => None,
                Some((block_elems, block_bytes)) => {
                    if dims[0] % block_elems != 0 {
                        return Err(GgufError::bad_tensor(
                            &name,
                            format!(
                                "innermost dimension {} is not a multiple of the {} block size {block_elems}",
                                dims[0], ggml_type
                            ),
                        ));
                    }
                    let n = (n_elements / block_elems)
                        .checked_mul(block_bytes)
                        .ok_or_else(|| GgufError::bad_tensor(&name, "byte size overflows"))?;
                    let end = offset
                        .checked_add(n)
                        .ok_or_else(|| GgufError::bad_tensor(&name, "data range overflows"))?;
                    if end > data_len {
                        return Err(GgufError::Truncated {
                            what: format!("data of tensor {name:?}"),
                            offset: data_offset.saturating_add(offset),
                            needed: n,
                            available: data_len.saturating_sub(offset),
                        });
                    }
                    Some(n)
                }
            };
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Malformed(format!(
                    "tensor {name:?} appears twice"
                )));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                n_bytes,
            });
        }

        Ok(GgufFile {
            path,
            storage,
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The path this file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data-section alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the tensor data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// One metadata value; a `MissingKey` error when absent.
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
        })
    }

    fn wrong(key: &str, expected: &str, found: &GgufValue) -> GgufError {
        let shown = match found {
            GgufValue::Array(items) => {
                format!("{} with {} elements", found.type_name(), items.len())
            }
            GgufValue::String(s) if s.len() > 80 => format!("STRING of {} bytes", s.len()),
            other => format!("{} {:?}", other.type_name(), other),
        };
        GgufError::WrongType {
            key: key.to_string(),
            expected: expected.to_string(),
            found: shown,
        }
    }

    /// A non-negative integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_integer()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
    }

    /// A non-negative integer that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_integer()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| Self::wrong(key, "a non-negative 32-bit integer", v))
    }

    /// Like [`get_u32`](Self::get_u32), `None` when the key is absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_u32(key).map(Some),
        }
    }

    /// A float (FLOAT32 or FLOAT64). FLOAT32 is returned as the exact f32 value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_float().ok_or_else(|| Self::wrong(key, "a float", v))
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "BOOL", v))
    }

    /// Like [`get_bool`](Self::get_bool), `None` when the key is absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_bool(key).map(Some),
        }
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "STRING", v))
    }

    /// Like [`get_str`](Self::get_str), `None` when the key is absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_str(key).map(Some),
        }
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&[GgufValue]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "ARRAY", v))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let items = self.get_array(key)?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                item.as_str().ok_or_else(|| GgufError::WrongType {
                    key: key.to_string(),
                    expected: "ARRAY[STRING]".into(),
                    found: format!("element {i} of type {}", item.type_name()),
                })
            })
            .collect()
    }

    /// An array of integers (any integer element type).
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let items = self.get_array(key)?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                item.as_integer()
                    .and_then(|v| i64::try_from(v).ok())
                    .ok_or_else(|| GgufError::WrongType {
                        key: key.to_string(),
                        expected: "ARRAY of integers".into(),
                        found: format!("element {i} of type {}", item.type_name()),
                    })
            })
            .collect()
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor info, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// One tensor info; a `MissingTensor` error when absent.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            name: name.to_string(),
        })
    }

    /// The raw bytes of a tensor (in its ggml storage type).
    pub fn tensor_data(&self, info: &TensorInfo) -> Result<&[u8]> {
        let n = info
            .n_bytes
            .ok_or_else(|| GgufError::UnsupportedTensorType {
                name: info.name.clone(),
                type_name: info.ggml_type.name(),
                supported: "types with a known block size",
            })?;
        let bytes = self.storage.bytes();
        let start = self.data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(n));
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() as u64 => Ok(&bytes[s as usize..e as usize]),
            _ => Err(GgufError::Truncated {
                what: format!("data of tensor {:?}", info.name),
                offset: self.data_offset.saturating_add(info.offset),
                needed: n,
                available: (bytes.len() as u64)
                    .saturating_sub(self.data_offset.saturating_add(info.offset)),
            }),
        }
    }
}

/// Nesting depth allowed for arrays of arrays.
const MAX_ARRAY_DEPTH: u32 = 8;

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let n = n as usize;
        let out = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in
    /// what is left, before anything sized by `count` is allocated.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        match count.checked_mul(min_size) {
            Some(n) if n <= self.remaining() => Ok(()),
            _ => Err(GgufError::Truncated {
                what: format!("{what} ({count})"),
                offset: self.pos as u64,
                needed: count.saturating_mul(min_size),
                available: self.remaining(),
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(&format!("length of {what}"))?;
        let b = self.take(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what.to_string(),
        })
    }

    fn value(&mut self, key: &str, type_code: u32, depth: u32) -> Result<GgufValue> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match type_code {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(&what())?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&what())?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what())?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => {
                let [b] = self.array::<1>(&what())?;
                match b {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    _ => {
                        return Err(GgufError::Malformed(format!(
                            "metadata key {key:?}: BOOL byte is {b}, not 0 or 1"
                        )))
                    }
                }
            }
            8 => GgufValue::String(self.string(&what())?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Malformed(format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem_type = self.u32(&format!("element type of metadata key {key:?}"))?;
                let count = self.u64(&format!("element count of metadata key {key:?}"))?;
                let min_size = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => {
                        return Err(GgufError::UnknownValueType {
                            key: key.to_string(),
                            type_code: other,
                        })
                    }
                };
                self.check_count(
                    count,
                    min_size,
                    &format!("element count of metadata key {key:?}"),
                )?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what())?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what())?)),
            other => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_string(),
                    type_code: other,
                })
            }
        })
    }
}

/// Builds GGUF (v3) files in memory. Meant for tests and tooling; the
/// converter itself only reads.
#[derive(Debug, Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufBuilder {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn kv(mut self, key: &str, value: GgufValue) -> Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor; `dims` innermost first, `data` in the ggml storage type.
    pub fn tensor(mut self, name: &str, dims: &[u64], ggml_type: GgmlType, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ggml_type, data));
        self
    }

    /// The file's bytes.
    pub fn build(&self) -> Vec<u8> {
        fn put_str(out: &mut Vec<u8>, s: &str) {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        fn type_code(v: &GgufValue) -> u32 {
            match v {
                GgufValue::U8(_) => 0,
                GgufValue::I8(_) => 1,
                GgufValue::U16(_) => 2,
                GgufValue::I16(_) => 3,
                GgufValue::U32(_) => 4,
                GgufValue::I32(_) => 5,
                GgufValue::F32(_) => 6,
                GgufValue::Bool(_) => 7,
                GgufValue::String(_) => 8,
                GgufValue::Array(_) => 9,
                GgufValue::U64(_) => 10,
                GgufValue::I64(_) => 11,
                GgufValue::F64(_) => 12,
            }
        }
        fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
            match v {
                GgufValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::Bool(x) => out.push(u8::from(*x)),
                GgufValue::String(s) => put_str(out, s),
                GgufValue::Array(items) => {
                    let elem = items.first().map(type_code).unwrap_or(4);
                    out.extend_from_slice(&elem.to_le_bytes());
                    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                    for item in items {
                        put_value(out, item);
                    }
                }
                GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
                GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            }
        }

        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&type_code(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let align = DEFAULT_ALIGNMENT as usize;
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.0.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        let data_start = out.len().div_ceil(align) * align;
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> GgufBuilder {
        GgufBuilder::new()
            .kv("general.architecture", GgufValue::String("llama".into()))
            .kv("llama.block_count", GgufValue::U32(2))
            .kv("some.float", GgufValue::F32(1e-5))
            .kv(
                "some.strings",
                GgufValue::Array(vec![
                    GgufValue::String("a".into()),
                    GgufValue::String("b c".into()),
                ]),
            )
            .kv(
                "some.nested",
                GgufValue::Array(vec![
                    GgufValue::Array(vec![GgufValue::I8(-1)]),
                    GgufValue::Array(vec![]),
                ]),
            )
            .kv("some.bool", GgufValue::Bool(true))
            .kv("some.i64", GgufValue::I64(-5))
            .tensor(
                "a",
                &[3],
                GgmlType::F32,
                [1f32, 2., 3.]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            )
            .tensor("b", &[2, 2], GgmlType::F16, vec![0; 8])
    }

    #[test]
    fn reads_every_value_type_and_tensors() {
        let f = GgufFile::from_bytes("sample", sample().build()).expect("parse");
        assert_eq!(f.version(), 3);
        assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
        assert_eq!(f.get_f64("some.float").unwrap() as f32, 1e-5f32);
        assert_eq!(f.get_str_array("some.strings").unwrap(), vec!["a", "b c"]);
        assert!(f.get_bool("some.bool").unwrap());
        assert_eq!(f.get_array("some.nested").unwrap().len(), 2);
        assert!(matches!(
            f.get_u64("some.i64"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(f.get_u32("nope"), Err(GgufError::MissingKey { key }) if key == "nope"));
        assert_eq!(f.tensors().len(), 2);
        let a = f.require_tensor("a").unwrap();
        assert_eq!(
            f.tensor_data(a).unwrap(),
            &[0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64]
        );
        let b = f.require_tensor("b").unwrap();
        assert_eq!(b.shape(), vec![2, 2]);
        assert_eq!(b.n_bytes, Some(8));
        assert!(matches!(
            f.require_tensor("c"),
            Err(GgufError::MissingTensor { .. })
        ));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().build();
        for cut in 0..bytes.len() {
            let r = GgufFile::from_bytes("cut", bytes[..cut].to_vec());
            assert!(
                r.is_err(),
                "truncation at {cut} of {} was accepted",
                bytes.len()
            );
        }
    }

    #[test]
    fn corrupted_bytes_never_panic() {
        let bytes = sample().build();
        for i in 0..bytes.len() {
            for v in [0x00u8, 0xff, 0x7f, 0x80, 0x09] {
                let mut b = bytes.clone();
                b[i] = v;
                // Any outcome but a panic (or a huge allocation) is fine.
                let _ = GgufFile::from_bytes("fuzz", b).map(|f| {
                    for t in f.tensors() {
                        let _ = f.tensor_data(t);
                    }
                });
            }
        }
    }

    #[test]
    fn garbage_is_rejected() {
        assert!(matches!(
            GgufFile::from_bytes("x", b"GGML\x03\0\0\0".to_vec()),
            Err(GgufError::BadMagic { .. })
        ));
        let mut v = sample().build();
        v[4] = 9;
        assert!(matches!(
            GgufFile::from_bytes("x", v),
            Err(GgufError::UnsupportedVersion { version: 9 })
        ));
        // A huge array count must not allocate.
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(b'k');
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes("x", b),
            Err(GgufError::Truncated { .. })
        ));
        // Unknown tensor types are listed but their data is refused by name.
        let f = GgufFile::from_bytes(
            "x",
            GgufBuilder::new()
                .tensor("weird", &[4], GgmlType(99), vec![0; 32])
                .build(),
        )
        .unwrap();
        let info = f.require_tensor("weird").unwrap();
        let err = f.tensor_data(info).unwrap_err().to_string();
        assert!(err.contains("weird") && err.contains("type99"), "{err}");
    }
}
