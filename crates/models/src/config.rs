//! `config.json` of an HF / mlx-lm model directory.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::ModelError;

/// Architectures this crate builds graphs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama, SmolLM2, Mistral-style dense decoders.
    Llama,
    /// Llama plus q/k/v projection biases.
    Qwen2,
    /// Llama plus per-head RMSNorm on q and k.
    Qwen3,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    pub factor: Option<f32>,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<f32>,
}

/// Quantization as mlx-lm writes it: defaults plus per-module overrides keyed
/// by module path (`false` means "this module is not quantized").
#[derive(Debug, Clone, Default)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
    pub overrides: HashMap<String, Option<(i32, i32)>>,
}

impl Quantization {
    /// (group_size, bits) for a module path, or None when it is stored dense.
    pub fn for_module(&self, path: &str) -> Option<(i32, i32)> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => Some((self.group_size, self.bits)),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
struct RawConfig {
    model_type: String,
    hidden_size: i32,
    num_hidden_layers: i32,
    intermediate_size: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    rms_norm_eps: f32,
    vocab_size: i32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    max_position_embeddings: Option<i32>,
    #[serde(default)]
    quantization: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    bos_token_id: Option<u32>,
}

fn default_theta() -> f32 {
    10000.0
}

/// The facts a forward graph needs, validated.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub model_type: String,
    pub hidden_size: i32,
    pub num_layers: i32,
    pub intermediate_size: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub max_position_embeddings: i32,
    pub quantization: Option<Quantization>,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl ModelConfig {
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Io {
            path: path.clone(),
            source: e,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ModelError::Config { message, .. } => ModelError::Config { path, message },
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Self, ModelError> {
        let bad = |message: String| ModelError::Config {
            path: "config.json".into(),
            message,
        };
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let arch = match raw.model_type.as_str() {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                return Err(bad(format!(
                    "model_type {other:?} is not supported (llama, mistral, qwen2, qwen3)"
                )))
            }
        };
        if raw.num_attention_heads <= 0 || raw.hidden_size <= 0 {
            return Err(bad(
                "num_attention_heads and hidden_size must be positive".into()
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads <= 0 || raw.num_attention_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "num_key_value_heads {num_kv_heads} must divide num_attention_heads {}",
                raw.num_attention_heads
            )));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        // Sizes become array shapes and loop bounds: a zero or negative one
        // from a corrupt file must stop here, not inside MLX.
        for (name, v) in [
            ("num_hidden_layers", raw.num_hidden_layers),
            ("intermediate_size", raw.intermediate_size),
            ("vocab_size", raw.vocab_size),
            ("head_dim", head_dim),
            (
                "max_position_embeddings",
                raw.max_position_embeddings.unwrap_or(1),
            ),
        ] {
            if v <= 0 {
                return Err(bad(format!("{name} must be positive, got {v}")));
            }
        }
        for (name, v) in [
            ("rms_norm_eps", raw.rms_norm_eps),
            ("rope_theta", raw.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(format!("{name} must be a positive number, got {v}")));
            }
        }
        let quantization = raw
            .quantization
            .as_ref()
            .map(parse_quantization)
            .transpose()
            .map_err(bad)?;
        let eos_token_ids = match &raw.eos_token_id {
            None => vec![],
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            Some(other) => return Err(bad(format!("eos_token_id {other} is not an id or list"))),
        };
        Ok(Self {
            arch,
            model_type: raw.model_type,
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            intermediate_size: raw.intermediate_size,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            vocab_size: raw.vocab_size,
            rope_theta: raw.rope_theta,
            rope_scaling: raw.rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias: raw.attention_bias.unwrap_or(arch == Arch::Qwen2),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            quantization,
            eos_token_ids,
            bos_token_id: raw.bos_token_id,
        })
    }
}

fn parse_quantization(v: &serde_json::Value) -> Result<Quantization, String> {
    let obj = v.as_object().ok_or("quantization must be an object")?;
    let int = |o: &serde_json::Map<String, serde_json::Value>, k: &str| -> Result<i32, String> {
        o.get(k)
            .and_then(|x| x.as_i64())
            .map(|x| x as i32)
            .ok_or(format!("quantization.{k} missing or not an integer"))
    };
    let group_size = int(obj, "group_size")?;
    let bits = int(obj, "bits")?;
    let check = |g: i32, b: i32| -> Result<(), String> {
        if ![32, 64, 128].contains(&g) || ![2, 3, 4, 5, 6, 8].contains(&b) {
            return Err(format!("unsupported quantization group_size {g} bits {b}"));
        }
        Ok(())
    };
    check(group_size, bits)?;
    let mut overrides = HashMap::new();
    for (k, val) in obj {
        match val {
            serde_json::Value::Bool(false) => {
                overrides.insert(k.clone(), None);
            }
            serde_json::Value::Object(o) => {
                let (g, b) = (int(o, "group_size")?, int(o, "bits")?);
                check(g, b)?;
                overrides.insert(k.clone(), Some((g, b)));
            }
            _ => {}
        }
    }
    Ok(Quantization {
        group_size,
        bits,
        overrides,
    })
}
