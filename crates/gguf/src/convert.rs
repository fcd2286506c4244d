//! GGUF (llama architecture) -> mlx-lm model directory, without requantizing;
//! gemma3 files go to [`crate::gemma3`].

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::{Dtype, View};
use serde_json::{json, Map, Value};

use crate::error::GgufError;
use crate::quant::{self, GROUP_SIZE};
use crate::reader::{GgmlType, GgufFile, TensorInfo};
use crate::tokenizer::{build_tokenizer, write_json};

type Result<T> = std::result::Result<T, GgufError>;

/// Name of the weights file written into the output directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Hyper-parameters of a llama-architecture GGUF, read from its metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    /// `llama.embedding_length`
    pub hidden_size: usize,
    /// `llama.block_count`
    pub num_hidden_layers: usize,
    /// `llama.feed_forward_length`
    pub intermediate_size: usize,
    /// `llama.attention.head_count`
    pub num_attention_heads: usize,
    /// `llama.attention.head_count_kv` (defaults to the head count)
    pub num_key_value_heads: usize,
    /// `llama.attention.key_length`, or hidden size / heads
    pub head_dim: usize,
    /// `llama.attention.layer_norm_rms_epsilon`
    pub rms_norm_eps: f64,
    /// `llama.rope.freq_base` (defaults to 10000)
    pub rope_theta: f64,
    /// `llama.context_length`
    pub max_position_embeddings: usize,
}

/// The f64 with the shortest decimal form that rounds to the same f32
/// (so 1e-5f32 is written as 1e-5, not 9.999999747378752e-6).
pub(crate) fn clean_f32(v: f64) -> f64 {
    let f = v as f32;
    if f64::from(f) != v {
        return v; // a genuine FLOAT64 value
    }
    f.to_string().parse::<f64>().unwrap_or(v)
}

pub(crate) fn usize_key(g: &GgufFile, key: &str) -> Result<usize> {
    let v = g.get_u64(key)?;
    usize::try_from(v).map_err(|_| GgufError::WrongType {
        key: key.into(),
        expected: "a size that fits in memory".into(),
        found: v.to_string(),
    })
}

pub(crate) fn positive(key: &str, v: usize) -> Result<usize> {
    if v == 0 {
        return Err(GgufError::WrongType {
            key: key.into(),
            expected: "a positive value".into(),
            found: "0".into(),
        });
    }
    Ok(v)
}

impl LlamaParams {
    /// Reads and checks the `llama.*` hyper-parameters.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::Unsupported(format!(
                "general.architecture = {arch:?}; only \"llama\" and \"gemma3\" are supported"
            )));
        }
        let shape = read_shape(g, "llama")?;
        let scaling_key = "llama.rope.scaling.type";
        if let Some(t) = g.get_str_opt(scaling_key)? {
            if t != "none" {
                return Err(GgufError::Unsupported(format!(
                    "{scaling_key} = {t:?} (RoPE scaling)"
                )));
            }
        }
        Ok(shape)
    }
}

/// The transformer shape every supported architecture stores the same way under its
/// `{arch}.` metadata prefix (a llama's whole set of hyper-parameters; Gemma 3 adds
/// its own), read and checked once for all of them: `attention.head_count_kv`
/// divides the head count, the head dimension (`attention.key_length`, else hidden /
/// heads) is even and equals `attention.value_length` and `rope.dimension_count`
/// where given.
pub(crate) fn read_shape(g: &GgufFile, arch: &str) -> Result<LlamaParams> {
    let k = |s: &str| format!("{arch}.{s}");
    let req = |s: &str| -> Result<usize> { positive(&k(s), usize_key(g, &k(s))?) };
    let opt = |s: &str| -> Result<Option<usize>> {
        match g.get(&k(s)) {
            None => Ok(None),
            Some(_) => Ok(Some(positive(&k(s), usize_key(g, &k(s))?)?)),
        }
    };
    let hidden_size = req("embedding_length")?;
    let num_hidden_layers = req("block_count")?;
    let intermediate_size = req("feed_forward_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let num_key_value_heads = opt("attention.head_count_kv")?.unwrap_or(num_attention_heads);
    if num_attention_heads % num_key_value_heads != 0 {
        return Err(GgufError::WrongType {
            key: k("attention.head_count_kv"),
            expected: format!("a divisor of the head count {num_attention_heads}"),
            found: num_key_value_heads.to_string(),
        });
    }
    let head_dim = match opt("attention.key_length")? {
        Some(v) => v,
        None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
        None => {
            return Err(GgufError::WrongType {
                key: k("attention.head_count"),
                expected: format!(
                    "a divisor of the embedding length {hidden_size} (no {} is given)",
                    k("attention.key_length")
                ),
                found: num_attention_heads.to_string(),
            })
        }
    };
    for other in ["attention.value_length", "rope.dimension_count"] {
        if g.get(&k(other)).is_some() && usize_key(g, &k(other))? != head_dim {
            return Err(GgufError::Unsupported(format!(
                "{} = {} differs from the head dimension {head_dim}",
                k(other),
                usize_key(g, &k(other))?
            )));
        }
    }
    if head_dim % 2 != 0 {
        return Err(GgufError::Unsupported(format!(
            "odd head dimension {head_dim}"
        )));
    }
    let rms_norm_eps = clean_f32(g.get_f64(&k("attention.layer_norm_rms_epsilon"))?);
    let rope_theta = match g.get(&k("rope.freq_base")) {
        None => 10000.0,
        Some(_) => clean_f32(g.get_f64(&k("rope.freq_base"))?),
    };
    Ok(LlamaParams {
        hidden_size,
        num_hidden_layers,
        intermediate_size,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        max_position_embeddings: usize_key(g, &k("context_length"))?,
    })
}

/// What a GGUF tensor becomes.
#[derive(Debug, Clone, PartialEq)]
enum Target {
    /// A matrix (`<module>.weight`, maybe quantized), with its expected
    /// `[rows, cols]` (rows = output features), and the head count to
    /// un-permute rows by (for q/k).
    Matrix {
        module: String,
        rows: usize,
        cols: usize,
        unpermute_heads: Option<usize>,
    },
    /// A vector, copied as is.
    Vector { name: String, len: usize },
}

fn target_for(name: &str, p: &LlamaParams, vocab: usize) -> Option<Target> {
    let h = p.hidden_size;
    let q_dim = p.num_attention_heads * p.head_dim;
    let kv_dim = p.num_key_value_heads * p.head_dim;
    let matrix = |module: String, rows: usize, cols: usize, heads: Option<usize>| Target::Matrix {
        module,
        rows,
        cols,
        unpermute_heads: heads,
    };
    match name {
        "token_embd.weight" => return Some(matrix("model.embed_tokens".into(), vocab, h, None)),
        "output.weight" => return Some(matrix("lm_head".into(), vocab, h, None)),
        "output_norm.weight" => {
            return Some(Target::Vector {
                name: "model.norm.weight".into(),
                len: h,
            })
        }
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer_str, rest) = rest.split_once('.')?;
    let layer: usize = layer_str.parse().ok()?;
    if layer >= p.num_hidden_layers || layer_str != layer.to_string() {
        return None;
    }
    let base = format!("model.layers.{layer}");
    Some(match rest {
        "attn_norm.weight" => Target::Vector {
            name: format!("{base}.input_layernorm.weight"),
            len: h,
        },
        "ffn_norm.weight" => Target::Vector {
            name: format!("{base}.post_attention_layernorm.weight"),
            len: h,
        },
        "attn_q.weight" => matrix(
            format!("{base}.self_attn.q_proj"),
            q_dim,
            h,
            Some(p.num_attention_heads),
        ),
        "attn_k.weight" => matrix(
            format!("{base}.self_attn.k_proj"),
            kv_dim,
            h,
            Some(p.num_key_value_heads),
        ),
        "attn_v.weight" => matrix(format!("{base}.self_attn.v_proj"), kv_dim, h, None),
        "attn_output.weight" => matrix(format!("{base}.self_attn.o_proj"), h, q_dim, None),
        "ffn_gate.weight" => matrix(
            format!("{base}.mlp.gate_proj"),
            p.intermediate_size,
            h,
            None,
        ),
        "ffn_up.weight" => matrix(format!("{base}.mlp.up_proj"), p.intermediate_size, h, None),
        "ffn_down.weight" => matrix(
            format!("{base}.mlp.down_proj"),
            h,
            p.intermediate_size,
            None,
        ),
        _ => return None,
    })
}

/// The GGUF tensors a llama model must have.
/// The tensors a llama file must have, in order. Lazy: `block_count` comes
/// from the file, and a hostile one (billions of layers) must fail at the
/// first missing layer, not build every name first.
fn required_tensors(p: &LlamaParams) -> impl Iterator<Item = String> {
    const PER_LAYER: [&str; 9] = [
        "attn_norm",
        "ffn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    ["token_embd.weight", "output_norm.weight"]
        .into_iter()
        .map(str::to_string)
        .chain((0..p.num_hidden_layers).flat_map(|l| {
            PER_LAYER
                .into_iter()
                .map(move |t| format!("blk.{l}.{t}.weight"))
        }))
}

/// A tensor ready to be written to safetensors.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn plain_dtype(ty: GgmlType) -> Option<Dtype> {
    match ty {
        GgmlType::F32 => Some(Dtype::F32),
        GgmlType::F16 => Some(Dtype::F16),
        GgmlType::BF16 => Some(Dtype::BF16),
        _ => None,
    }
}

fn check_dims(info: &TensorInfo, want: &[usize]) -> Result<()> {
    let got: Vec<u64> = info.dims.clone();
    let want_u64: Vec<u64> = want.iter().map(|&d| d as u64).collect();
    if got != want_u64 {
        return Err(GgufError::bad_tensor(
            &info.name,
            format!("has dims {got:?} (innermost first), expected {want_u64:?} from the metadata"),
        ));
    }
    Ok(())
}

fn f16_bytes(v: &[half::f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The converted weights plus what `config.json` needs to know about them.
#[derive(Debug, Default)]
pub struct ConvertedWeights {
    /// Tensors by their Hugging Face / mlx-lm name.
    pub tensors: BTreeMap<String, OwnedTensor>,
    /// Bits of each quantized module (module path -> bits); group size is always 32.
    pub quantized: BTreeMap<String, u32>,
    /// Whether the file has its own output matrix (else embeddings are tied).
    pub has_lm_head: bool,
}

/// Converts every tensor of a llama GGUF to its mlx-lm form.
pub fn convert_weights(g: &GgufFile, p: &LlamaParams) -> Result<ConvertedWeights> {
    for name in required_tensors(p) {
        g.require_tensor(&name)?;
    }
    let embd = g.require_tensor("token_embd.weight")?;
    let vocab = match embd.dims.as_slice() {
        [_, v] => {
            usize::try_from(*v).map_err(|_| GgufError::bad_tensor(&embd.name, "too large"))?
        }
        dims => {
            return Err(GgufError::bad_tensor(
                &embd.name,
                format!("has dims {dims:?}, expected [hidden, vocab]"),
            ))
        }
    };
    if let Some(v) = g.get_u32_opt("llama.vocab_size")? {
        if v as usize != vocab {
            return Err(GgufError::bad_tensor(
                &embd.name,
                format!("has {vocab} rows but llama.vocab_size is {v}"),
            ));
        }
    }

    let mut out = ConvertedWeights::default();
    for info in g.tensors() {
        if info.name == "rope_freqs.weight" {
            return Err(GgufError::Unsupported(
                "tensor rope_freqs.weight (llama-3 style RoPE frequency scaling)".into(),
            ));
        }
        let target = target_for(&info.name, p, vocab).ok_or_else(|| GgufError::UnknownTensor {
            name: info.name.clone(),
            arch: "llama".into(),
        })?;
        let data = g.tensor_data(info)?;
        match target {
            Target::Vector { name, len } => {
                check_dims(info, &[len])?;
                let dtype = plain_dtype(info.ggml_type).ok_or_else(|| {
                    GgufError::UnsupportedTensorType {
                        name: info.name.clone(),
                        type_name: format!("{} (for a vector)", info.ggml_type),
                        supported: "F32, F16, BF16",
                    }
                })?;
                out.tensors.insert(
                    name,
                    OwnedTensor {
                        dtype,
                        shape: vec![len],
                        data: data.to_vec(),
                    },
                );
            }
            Target::Matrix {
                module,
                rows,
                cols,
                unpermute_heads,
            } => {
                check_dims(info, &[cols, rows])?;
                if module == "lm_head" {
                    out.has_lm_head = true;
                }
                let data: Cow<[u8]> = match unpermute_heads {
                    Some(heads) => {
                        Cow::Owned(quant::unpermute_rows(&info.name, data, rows, heads)?)
                    }
                    None => Cow::Borrowed(data),
                };
                if let Some(dtype) = plain_dtype(info.ggml_type) {
                    out.tensors.insert(
                        format!("{module}.weight"),
                        OwnedTensor {
                            dtype,
                            shape: vec![rows, cols],
                            data: data.into_owned(),
                        },
                    );
                } else {
                    let q = quant::gguf_to_mlx(&info.name, info.ggml_type, &data, rows, cols)?;
                    let packed_cols = cols * q.bits as usize / 32;
                    let groups = cols / GROUP_SIZE;
                    out.tensors.insert(
                        format!("{module}.weight"),
                        OwnedTensor {
                            dtype: Dtype::U32,
                            shape: vec![rows, packed_cols],
                            data: u32_bytes(&q.weight),
                        },
                    );
                    out.tensors.insert(
                        format!("{module}.scales"),
                        OwnedTensor {
                            dtype: Dtype::F16,
                            shape: vec![rows, groups],
                            data: f16_bytes(&q.scales),
                        },
                    );
                    out.tensors.insert(
                        format!("{module}.biases"),
                        OwnedTensor {
                            dtype: Dtype::F16,
                            shape: vec![rows, groups],
                            data: f16_bytes(&q.biases),
                        },
                    );
                    out.quantized.insert(module, q.bits);
                }
            }
        }
    }
    Ok(out)
}

/// The `quantization` section of `config.json` in mlx-lm's format: the most
/// common bit width as the default, and a per-module override for the rest.
fn quantization_config(quantized: &BTreeMap<String, u32>) -> Option<Value> {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &b in quantized.values() {
        *counts.entry(b).or_insert(0) += 1;
    }
    let default_bits = counts
        .into_iter()
        .max_by_key(|&(bits, n)| (n, std::cmp::Reverse(bits)))?
        .0;
    let mut q = Map::new();
    q.insert("group_size".into(), json!(GROUP_SIZE));
    q.insert("bits".into(), json!(default_bits));
    q.insert("mode".into(), json!("affine"));
    for (module, &bits) in quantized {
        if bits != default_bits {
            q.insert(
                module.clone(),
                json!({"group_size": GROUP_SIZE, "bits": bits}),
            );
        }
    }
    Some(Value::Object(q))
}

/// Converts the GGUF file at `gguf` into an mlx-lm model directory `out_dir`
/// (created if needed; files in it are overwritten).
pub fn convert_gguf(gguf: &Path, out_dir: &Path) -> Result<()> {
    let g = GgufFile::open(gguf)?;
    convert(&g, out_dir)
}

/// Like [`convert_gguf`], for an already opened file: `llama` files become
/// an mlx-lm `llama` directory (lossless, MLX affine), `gemma3` files an
/// mlx-lm `gemma3_text` directory (bf16; see [`crate::gemma3`]).
pub fn convert(g: &GgufFile, out_dir: &Path) -> Result<()> {
    if g.get_str("general.architecture")? == "gemma3" {
        return crate::gemma3::convert_gemma3(g, out_dir);
    }
    convert_llama(g, out_dir)
}

fn convert_llama(g: &GgufFile, out_dir: &Path) -> Result<()> {
    let p = LlamaParams::from_gguf(g)?;
    let tok = build_tokenizer(g)?;
    let weights = convert_weights(g, &p)?;
    let vocab_size = weights
        .tensors
        .get("model.embed_tokens.weight")
        .map(|t| t.shape[0])
        .ok_or_else(|| GgufError::MissingTensor {
            name: "token_embd.weight".into(),
        })?;
    if tok.vocab_size > vocab_size {
        return Err(GgufError::Malformed(format!(
            "tokenizer has {} tokens but the embedding only {vocab_size} rows",
            tok.vocab_size
        )));
    }

    std::fs::create_dir_all(out_dir).map_err(|e| GgufError::io("create directory", out_dir, e))?;

    let mut config = Map::new();
    config.insert("architectures".into(), json!(["LlamaForCausalLM"]));
    config.insert("model_type".into(), json!("llama"));
    config.insert("hidden_size".into(), json!(p.hidden_size));
    config.insert("num_hidden_layers".into(), json!(p.num_hidden_layers));
    config.insert("intermediate_size".into(), json!(p.intermediate_size));
    config.insert("num_attention_heads".into(), json!(p.num_attention_heads));
    config.insert("num_key_value_heads".into(), json!(p.num_key_value_heads));
    config.insert("head_dim".into(), json!(p.head_dim));
    config.insert("rms_norm_eps".into(), json!(p.rms_norm_eps));
    config.insert("vocab_size".into(), json!(vocab_size));
    config.insert("rope_theta".into(), json!(p.rope_theta));
    config.insert(
        "max_position_embeddings".into(),
        json!(p.max_position_embeddings),
    );
    config.insert("tie_word_embeddings".into(), json!(!weights.has_lm_head));
    config.insert("hidden_act".into(), json!("silu"));
    config.insert("attention_bias".into(), json!(false));
    config.insert("mlp_bias".into(), json!(false));
    config.insert("torch_dtype".into(), json!("float16"));
    for (key, id) in [
        ("bos_token_id", tok.bos_token_id),
        ("eos_token_id", tok.eos_token_id),
        ("pad_token_id", tok.pad_token_id),
    ] {
        if let Some(id) = id {
            config.insert(key.into(), json!(id));
        }
    }
    if let Some(q) = quantization_config(&weights.quantized) {
        config.insert("quantization".into(), q.clone());
        config.insert("quantization_config".into(), q);
    }
    write_json(&out_dir.join("config.json"), &Value::Object(config))?;

    let mut gen = Map::new();
    for (key, id) in [
        ("bos_token_id", tok.bos_token_id),
        ("eos_token_id", tok.eos_token_id),
        ("pad_token_id", tok.pad_token_id),
    ] {
        if let Some(id) = id {
            gen.insert(key.into(), json!(id));
        }
    }
    write_json(&out_dir.join("generation_config.json"), &Value::Object(gen))?;

    tok.save(out_dir)?;

    let path = out_dir.join(WEIGHTS_FILE);
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "mlx".to_string());
    let source = g
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    meta.insert("weft_gguf_source".to_string(), source);
    // Serialized in memory and written with std::fs so the file gets the
    // usual permissions (the directory is moved into place atomically by
    // `pull_default`, so a temporary file is not needed here).
    let bytes = safetensors::serialize(weights.tensors.iter(), Some(meta)).map_err(|e| {
        GgufError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        }
    })?;
    drop(weights);
    std::fs::write(&path, bytes).map_err(|e| GgufError::io("write", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LlamaParams {
        LlamaParams {
            hidden_size: 64,
            num_hidden_layers: 2,
            intermediate_size: 96,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            max_position_embeddings: 128,
        }
    }

    #[test]
    fn names_map_like_hf() {
        let p = params();
        assert_eq!(
            target_for("blk.1.attn_k.weight", &p, 100),
            Some(Target::Matrix {
                module: "model.layers.1.self_attn.k_proj".into(),
                rows: 32,
                cols: 64,
                unpermute_heads: Some(2)
            })
        );
        assert_eq!(
            target_for("blk.0.ffn_norm.weight", &p, 100),
            Some(Target::Vector {
                name: "model.layers.0.post_attention_layernorm.weight".into(),
                len: 64
            })
        );
        assert_eq!(target_for("blk.2.attn_k.weight", &p, 100), None);
        assert_eq!(target_for("blk.x.attn_k.weight", &p, 100), None);
        assert_eq!(target_for("blk.0.attn_qkv.weight", &p, 100), None);
    }

    #[test]
    fn quantization_section_uses_overrides() {
        let mut q = BTreeMap::new();
        q.insert("model.embed_tokens".to_string(), 8);
        q.insert("model.layers.0.mlp.up_proj".to_string(), 4);
        q.insert("model.layers.0.mlp.down_proj".to_string(), 4);
        let v = quantization_config(&q).unwrap();
        assert_eq!(v["bits"], 4);
        assert_eq!(v["group_size"], 32);
        assert_eq!(
            v["model.embed_tokens"],
            json!({"group_size": 32, "bits": 8})
        );
        assert!(v.get("model.layers.0.mlp.up_proj").is_none());
        assert_eq!(quantization_config(&BTreeMap::new()), None);
    }

    /// A tiny but complete llama GGUF: hidden 256, 1 layer, 4 heads, 2 KV
    /// heads, FFN 64, vocab 8; q/k/v/o/ffn Q4_1, embeddings Q8_0, norms F32.
    fn tiny_llama(
        skip: Option<&str>,
        retype: Option<(&str, GgmlType)>,
        extra: Option<&str>,
    ) -> Vec<u8> {
        use crate::reader::{GgufBuilder, GgufValue};
        let s = |v: &str| GgufValue::String(v.into());
        let toks = ["<|end|>", "a", "b", "ab", "c", "Ġ", "Ġa", "d"];
        let mut b = GgufBuilder::new()
            .kv("general.architecture", s("llama"))
            .kv("llama.embedding_length", GgufValue::U32(256))
            .kv("llama.block_count", GgufValue::U32(1))
            .kv("llama.feed_forward_length", GgufValue::U32(64))
            .kv("llama.attention.head_count", GgufValue::U32(4))
            .kv("llama.attention.head_count_kv", GgufValue::U32(2))
            .kv(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-6),
            )
            .kv("llama.rope.freq_base", GgufValue::F32(10000.0))
            .kv("llama.context_length", GgufValue::U32(128))
            .kv("tokenizer.ggml.model", s("gpt2"))
            .kv("tokenizer.ggml.pre", s("smollm"))
            .kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(toks.iter().map(|t| s(t)).collect()),
            )
            .kv(
                "tokenizer.ggml.token_type",
                GgufValue::Array(
                    [3, 1, 1, 1, 1, 1, 1, 1]
                        .into_iter()
                        .map(GgufValue::I32)
                        .collect(),
                ),
            )
            .kv(
                "tokenizer.ggml.merges",
                GgufValue::Array(vec![s("a b"), s("Ġ a")]),
            )
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(0));
        let bytes_for = |ty: GgmlType, n: usize| -> Vec<u8> {
            let (be, bb) = ty.block_layout().unwrap();
            let len = n / be as usize * bb as usize;
            // Small positive f16 scales (0x2c00 = 1/16) and varied payload bytes.
            let mut v: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            if ty == GgmlType::Q4_1 || ty == GgmlType::Q8_0 || ty == GgmlType::Q4_0 {
                for blk in v.chunks_exact_mut(bb as usize) {
                    blk[0] = 0x00;
                    blk[1] = 0x2c;
                }
            }
            v
        };
        let mut tensors: Vec<(&str, Vec<u64>, GgmlType)> = vec![
            ("token_embd.weight", vec![256, 8], GgmlType::Q8_0),
            ("output_norm.weight", vec![256], GgmlType::F32),
            ("blk.0.attn_norm.weight", vec![256], GgmlType::F32),
            ("blk.0.ffn_norm.weight", vec![256], GgmlType::F32),
            ("blk.0.attn_q.weight", vec![256, 256], GgmlType::Q4_1),
            ("blk.0.attn_k.weight", vec![256, 128], GgmlType::Q4_1),
            ("blk.0.attn_v.weight", vec![256, 128], GgmlType::Q4_0),
            ("blk.0.attn_output.weight", vec![256, 256], GgmlType::F16),
            ("blk.0.ffn_gate.weight", vec![256, 64], GgmlType::Q4_1),
            ("blk.0.ffn_up.weight", vec![256, 64], GgmlType::Q4_1),
            ("blk.0.ffn_down.weight", vec![64, 256], GgmlType::Q4_1),
        ];
        if let Some(name) = extra {
            tensors.push((name, vec![256], GgmlType::F32));
        }
        for (name, dims, ty) in tensors {
            if Some(name) == skip {
                continue;
            }
            let ty = match retype {
                Some((n, t)) if n == name => t,
                _ => ty,
            };
            let n = dims.iter().product::<u64>() as usize;
            b = b.tensor(name, &dims, ty, bytes_for(ty, n));
        }
        b.build()
    }

    fn tmp_dir(tag: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!("weft-gguf-{tag}-{}-{nanos}", std::process::id()))
    }

    #[test]
    fn converts_a_synthetic_llama() {
        let g = GgufFile::from_bytes("tiny.gguf", tiny_llama(None, None, None)).unwrap();
        let dir = tmp_dir("tiny");
        convert(&g, &dir).unwrap();
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["head_dim"], 64);
        assert_eq!(cfg["num_key_value_heads"], 2);
        assert_eq!(cfg["vocab_size"], 8);
        assert_eq!(cfg["rms_norm_eps"].as_f64(), Some(1e-6));
        assert_eq!(cfg["quantization"]["bits"], 4);
        assert_eq!(cfg["quantization"]["model.embed_tokens"]["bits"], 8);
        let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let k = st.tensor("model.layers.0.self_attn.k_proj.weight").unwrap();
        assert_eq!((k.dtype(), k.shape()), (Dtype::U32, &[128usize, 32][..]));
        let e = st.tensor("model.embed_tokens.weight").unwrap();
        assert_eq!(e.shape(), &[8, 64]);
        let o = st.tensor("model.layers.0.self_attn.o_proj.weight").unwrap();
        assert_eq!((o.dtype(), o.shape()), (Dtype::F16, &[256usize, 256][..]));
        assert!(st.tensor("model.layers.0.self_attn.o_proj.scales").is_err());
        assert_eq!(st.tensor("model.norm.weight").unwrap().dtype(), Dtype::F32);
        // 3 quantized tensors per quantized matrix (7) + o_proj + 3 norms.
        assert_eq!(st.len(), 7 * 3 + 1 + 3);
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        assert_eq!(
            tok.encode("ab a<|end|>", false).unwrap().get_ids(),
            &[3, 6, 0]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn conversion_errors_name_the_tensor() {
        let dir = tmp_dir("bad");
        let g =
            GgufFile::from_bytes("x", tiny_llama(Some("blk.0.ffn_up.weight"), None, None)).unwrap();
        let err = convert(&g, &dir).unwrap_err();
        assert!(
            matches!(&err, GgufError::MissingTensor { name } if name == "blk.0.ffn_up.weight"),
            "{err}"
        );
        let g = GgufFile::from_bytes(
            "x",
            tiny_llama(None, Some(("blk.0.ffn_up.weight", GgmlType::Q4_K)), None),
        )
        .unwrap();
        let err = convert(&g, &dir).unwrap_err().to_string();
        assert!(
            err.contains("blk.0.ffn_up.weight") && err.contains("Q4_K"),
            "{err}"
        );
        let g = GgufFile::from_bytes("x", tiny_llama(None, None, Some("blk.0.mystery.weight")))
            .unwrap();
        let err = convert(&g, &dir).unwrap_err().to_string();
        assert!(err.contains("blk.0.mystery.weight"), "{err}");
        assert!(
            !dir.exists(),
            "nothing is written before the input is validated"
        );
    }

    #[test]
    fn f32_values_get_their_short_form() {
        assert_eq!(clean_f32(f64::from(1e-5f32)), 1e-5);
        assert_eq!(clean_f32(f64::from(1e-6f32)), 1e-6);
        assert_eq!(clean_f32(100000.0), 100000.0);
        assert_eq!(clean_f32(0.1), 0.1);
    }
}
