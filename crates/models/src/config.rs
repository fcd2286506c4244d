//! `config.json` of an HF / mlx-lm model directory.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::ModelError;
use crate::gated_delta::DeltaShape;
use crate::mamba2::Mamba2Shape;

/// Architectures this crate builds graphs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama, SmolLM2, Mistral-style dense decoders.
    Llama,
    /// Llama plus q/k/v projection biases.
    Qwen2,
    /// Llama plus per-head RMSNorm on q and k.
    Qwen3,
    /// Gemma 3 text: sliding-window and global layers, `(1 + w)` RMSNorms
    /// with extra norms around attention and MLP, gelu-tanh MLP, scaled
    /// embeddings, per-kind RoPE bases, q/k norms.
    Gemma3,
    /// Qwen3.5 text (dense): Gated DeltaNet linear-attention layers beside
    /// gated full attention (the query projection carries a sigmoid output
    /// gate per head, q/k norms, partial rotary embedding).
    Qwen3_5,
    /// Nemotron-H: a stack of blocks, each one norm and one mixer — Mamba-2,
    /// attention without positional embedding, or a ReLU² MLP.
    NemotronH,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu` with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `relu(x)^2` of an ungated MLP (Nemotron-H's MLP blocks).
    Relu2,
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
    num_hidden_layers: Option<i32>,
    intermediate_size: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    #[serde(alias = "layer_norm_epsilon")]
    rms_norm_eps: f32,
    vocab_size: i32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<RopeScaling>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    max_position_embeddings: Option<i32>,
    #[serde(default)]
    quantization: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    bos_token_id: Option<u32>,
    // Gemma 3.
    sliding_window: Option<i32>,
    sliding_window_pattern: Option<i32>,
    layer_types: Option<Vec<String>>,
    rope_local_base_freq: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    hidden_activation: Option<String>,
    final_logit_softcapping: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    // Qwen3.5.
    linear_num_value_heads: Option<i32>,
    linear_num_key_heads: Option<i32>,
    linear_key_head_dim: Option<i32>,
    linear_value_head_dim: Option<i32>,
    linear_conv_kernel_dim: Option<i32>,
    full_attention_interval: Option<i32>,
    rope_parameters: Option<serde_json::Value>,
    partial_rotary_factor: Option<f32>,
    num_experts: Option<i32>,
    // Nemotron-H.
    hybrid_override_pattern: Option<Vec<String>>,
    layers_block_type: Option<Vec<String>>,
    mamba_num_heads: Option<i32>,
    mamba_head_dim: Option<i32>,
    ssm_state_size: Option<i32>,
    n_groups: Option<i32>,
    conv_kernel: Option<i32>,
    time_step_limit: Option<(f32, f32)>,
    mlp_bias: Option<bool>,
    mamba_proj_bias: Option<bool>,
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
    /// Per layer, whether it attends over a sliding window of
    /// [`sliding_window`](Self::sliding_window) tokens (all false for
    /// full-attention families).
    pub sliding_layers: Vec<bool>,
    /// Tokens a sliding-window layer's query sees, itself included.
    pub sliding_window: Option<i32>,
    /// RoPE base of the sliding-window layers (Gemma 3's local layers);
    /// global layers use `rope_theta` and `rope_scaling`.
    pub rope_local_theta: Option<f32>,
    /// Attention's score scale (`head_dim^-0.5`, or Gemma's
    /// `query_pre_attn_scalar^-0.5`).
    pub attn_scale: f32,
    pub activation: Activation,
    /// Added to every RMSNorm weight at load (Gemma's norms multiply by
    /// `1 + w`).
    pub norm_offset: f32,
    /// The embedding's output is multiplied by this (Gemma: `sqrt(hidden)`,
    /// rounded to bf16 as the reference does).
    pub embed_scale: Option<f32>,
    /// Gemma's sandwich norms: the attention and MLP outputs are normed
    /// before their residual adds, and the MLP input has its own norm.
    pub sandwich_norms: bool,
    /// `tanh(logits / c) * c` on the output logits.
    pub final_logit_softcapping: Option<f32>,
    /// Per layer, whether it is a recurrent (Gated DeltaNet) layer instead of
    /// attention (all false for attention-only families).
    pub recurrent_layers: Vec<bool>,
    /// The recurrent layers' shape (Qwen3.5).
    pub delta: Option<DeltaShape>,
    /// Leading features of each head RoPE rotates (`head_dim` unless the
    /// family rotates part of it).
    pub rotary_dim: i32,
    /// The query projection carries a sigmoid gate per head, applied to the
    /// attention output before `o_proj` (Qwen3.5).
    pub attn_output_gate: bool,
    /// The Mamba-2 mixers' shape (Nemotron-H's recurrent layers).
    pub mamba: Option<Mamba2Shape>,
    /// Mamba-2's `dt` range after its softplus.
    pub mamba_dt_limit: (f32, f32),
    /// Per layer, whether it is a block of only an MLP (Nemotron-H's `-`):
    /// no K/V, no state.
    pub mlp_layers: Vec<bool>,
    /// Each layer is one norm and one mixer (Nemotron-H), not attention and
    /// an MLP.
    pub single_mixer: bool,
    /// Attention rotates q and k (false: no positional embedding at all).
    pub use_rope: bool,
}

impl ModelConfig {
    /// The recurrent layers' state shape (Gated DeltaNet or Mamba-2), if any.
    pub fn recurrent_state(&self) -> Option<crate::kv::RecurrentState> {
        self.delta
            .map(Into::into)
            .or_else(|| self.mamba.map(Into::into))
    }

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
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let raw: RawConfig =
            serde_json::from_value(text_model_config(value)).map_err(|e| bad(e.to_string()))?;
        let arch = match raw.model_type.as_str() {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3_text" => Arch::Gemma3,
            "qwen3_5" | "qwen3_5_text" => Arch::Qwen3_5,
            "nemotron_h" => Arch::NemotronH,
            other => {
                return Err(bad(format!(
                "model_type {other:?} is not supported (llama, mistral, qwen2, qwen3, gemma3_text, qwen3_5, nemotron_h)"
            )))
            }
        };
        let nemotron = arch == Arch::NemotronH;
        let blocks = if nemotron {
            Some(nemotron_blocks(&raw).map_err(bad)?)
        } else {
            None
        };
        let num_hidden_layers = match (&blocks, raw.num_hidden_layers) {
            (Some(b), Some(n)) if n as usize != b.len() => {
                return Err(bad(format!(
                    "num_hidden_layers {n} but the block pattern lists {} blocks",
                    b.len()
                )))
            }
            (Some(b), _) => b.len() as i32,
            (None, Some(n)) => n,
            (None, None) => return Err(bad("num_hidden_layers is missing".into())),
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
            ("num_hidden_layers", num_hidden_layers),
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
        let gemma = arch == Arch::Gemma3;
        let layers = num_hidden_layers as usize;
        let (sliding_layers, sliding_window) = if gemma {
            let window = raw.sliding_window.unwrap_or(512);
            if window <= 0 {
                return Err(bad(format!(
                    "sliding_window must be positive, got {window}"
                )));
            }
            let kinds = match &raw.layer_types {
                Some(t) => {
                    if t.len() != layers {
                        return Err(bad(format!(
                            "layer_types lists {} layers, num_hidden_layers is {layers}",
                            t.len()
                        )));
                    }
                    t.iter()
                        .map(|k| match k.as_str() {
                            "sliding_attention" => Ok(true),
                            "full_attention" => Ok(false),
                            other => Err(bad(format!(
                                "layer_types: {other:?} is not sliding_attention or full_attention"
                            ))),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                }
                None => {
                    // mlx-lm's gemma3_text: every `pattern`-th layer is global.
                    let pattern = raw.sliding_window_pattern.unwrap_or(6);
                    if pattern <= 0 {
                        return Err(bad(format!(
                            "sliding_window_pattern must be positive, got {pattern}"
                        )));
                    }
                    let p = pattern as usize;
                    (0..layers).map(|i| (i + 1) % p != 0).collect()
                }
            };
            (kinds, Some(window))
        } else {
            (vec![false; layers], None)
        };
        let activation = match raw.hidden_activation.as_deref() {
            None if gemma => Activation::GeluTanh,
            None if nemotron => Activation::Relu2,
            None | Some("silu") => Activation::Silu,
            Some("gelu_pytorch_tanh") | Some("gelu_approx") => Activation::GeluTanh,
            Some(other) => {
                return Err(bad(format!("hidden_activation {other:?} is not supported")))
            }
        };
        if raw.attn_logit_softcapping.is_some() {
            return Err(bad(
                "attn_logit_softcapping is not supported (Gemma 2's attention soft-capping)".into(),
            ));
        }
        let qwen35 = arch == Arch::Qwen3_5;
        let (recurrent_layers, delta) = if qwen35 {
            recurrent_layout(&raw, layers).map_err(bad)?
        } else if let Some(b) = &blocks {
            (b.iter().map(|&k| k == 'M').collect(), None)
        } else {
            (vec![false; layers], None)
        };
        let mamba = if nemotron {
            Some(mamba_shape(&raw).map_err(bad)?)
        } else {
            None
        };
        // Qwen3.5 keeps its RoPE settings in `rope_parameters`; a text-only
        // forward's multimodal RoPE sections all see the same position, which
        // is plain RoPE.
        let rope_params = raw.rope_parameters.as_ref().and_then(|v| v.as_object());
        let param = |k: &str| rope_params.and_then(|o| o.get(k)).and_then(|v| v.as_f64());
        let rope_theta = match param("rope_theta") {
            Some(t) if qwen35 => t as f32,
            _ => raw.rope_theta,
        };
        if let Some(kind) = rope_params
            .and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
            .and_then(|v| v.as_str())
            .filter(|k| *k != "default")
        {
            return Err(bad(format!(
                "rope_parameters type {kind:?} is not supported (default)"
            )));
        }
        let partial = param("partial_rotary_factor")
            .map(|f| f as f32)
            .or(raw.partial_rotary_factor)
            .unwrap_or(if qwen35 { 0.25 } else { 1.0 });
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(bad(format!(
                "partial_rotary_factor must be in (0, 1], got {partial}"
            )));
        }
        let rotary_dim = (head_dim as f32 * partial) as i32;
        if rotary_dim < 2 || rotary_dim % 2 != 0 {
            return Err(bad(format!(
                "head_dim {head_dim} x partial_rotary_factor {partial} gives {rotary_dim} \
                 rotated features; RoPE needs an even number"
            )));
        }
        let attn_scale = match raw.query_pre_attn_scalar {
            Some(q) if gemma => {
                if !(q.is_finite() && q > 0.0) {
                    return Err(bad(format!(
                        "query_pre_attn_scalar must be positive, got {q}"
                    )));
                }
                q.powf(-0.5)
            }
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        Ok(Self {
            sliding_layers,
            sliding_window,
            rope_local_theta: gemma.then(|| raw.rope_local_base_freq.unwrap_or(10000.0)),
            attn_scale,
            activation,
            norm_offset: if gemma { 1.0 } else { 0.0 },
            embed_scale: gemma
                .then(|| half::bf16::from_f32((raw.hidden_size as f32).sqrt()).to_f32()),
            sandwich_norms: gemma,
            final_logit_softcapping: raw.final_logit_softcapping.filter(|c| *c > 0.0),
            recurrent_layers,
            delta,
            rotary_dim,
            attn_output_gate: qwen35,
            mamba,
            mamba_dt_limit: raw.time_step_limit.unwrap_or((0.0, f32::INFINITY)),
            mlp_layers: match &blocks {
                Some(b) => b.iter().map(|&k| k == '-').collect(),
                None => vec![false; layers],
            },
            single_mixer: nemotron,
            use_rope: !nemotron,
            arch,
            model_type: raw.model_type,
            hidden_size: raw.hidden_size,
            num_layers: num_hidden_layers,
            intermediate_size: raw.intermediate_size,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            vocab_size: raw.vocab_size,
            rope_theta,
            rope_scaling: raw.rope_scaling,
            // Gemma ties its head unless the config says otherwise.
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            attention_bias: raw.attention_bias.unwrap_or(arch == Arch::Qwen2),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            quantization,
            eos_token_ids,
            bos_token_id: raw.bos_token_id,
        })
    }
}

/// The text model's settings: a multimodal checkpoint's `text_config`, with
/// what only its top level says (quantization, token ids, tied embeddings)
/// carried over; any other config as it is.
fn text_model_config(mut v: serde_json::Value) -> serde_json::Value {
    let Some(top) = v.as_object_mut() else {
        return v;
    };
    let Some(serde_json::Value::Object(mut text)) = top.remove("text_config") else {
        return v;
    };
    for (k, x) in top.iter() {
        if !text.contains_key(k) && k != "vision_config" {
            text.insert(k.clone(), x.clone());
        }
    }
    serde_json::Value::Object(text)
}

/// Nemotron-H's block kinds, one char each as mlx-lm spells them: `M`
/// Mamba-2, `*` attention, `-` MLP (`E`, mixture of experts, is refused).
fn nemotron_blocks(raw: &RawConfig) -> Result<Vec<char>, String> {
    if let Some(p) = &raw.hybrid_override_pattern {
        return p
            .iter()
            .map(|k| match k.as_str() {
                "M" => Ok('M'),
                "*" => Ok('*'),
                "-" => Ok('-'),
                "E" => Err("mixture-of-experts blocks (E) are not supported".to_string()),
                other => Err(format!("hybrid_override_pattern: unknown block {other:?}")),
            })
            .collect();
    }
    let types = raw
        .layers_block_type
        .as_ref()
        .or(raw.layer_types.as_ref())
        .ok_or("hybrid_override_pattern or layers_block_type is missing")?;
    types
        .iter()
        .map(|k| match k.as_str() {
            "mamba" | "linear_attention" | "conv" => Ok('M'),
            "attention" | "full_attention" => Ok('*'),
            "mlp" => Ok('-'),
            "moe" => Err("mixture-of-experts blocks (moe) are not supported".to_string()),
            other => Err(format!("layers_block_type: unknown block {other:?}")),
        })
        .collect()
}

/// Nemotron-H's Mamba-2 shape.
fn mamba_shape(raw: &RawConfig) -> Result<Mamba2Shape, String> {
    if raw.mlp_bias == Some(true) || raw.mamba_proj_bias == Some(true) {
        return Err("mlp_bias / mamba_proj_bias are not supported".into());
    }
    let need = |name: &str, v: Option<i32>| -> Result<i32, String> {
        match v {
            Some(x) if x > 0 => Ok(x),
            Some(x) => Err(format!("{name} must be positive, got {x}")),
            None => Err(format!("{name} is missing")),
        }
    };
    let s = Mamba2Shape {
        heads: need("mamba_num_heads", raw.mamba_num_heads)?,
        head_dim: need("mamba_head_dim", raw.mamba_head_dim)?,
        state: need("ssm_state_size", raw.ssm_state_size)?,
        groups: need("n_groups", raw.n_groups)?,
        kernel: need("conv_kernel", raw.conv_kernel)?,
    };
    if s.heads % s.groups != 0 {
        return Err(format!(
            "mamba_num_heads {} must be a multiple of n_groups {}",
            s.heads, s.groups
        ));
    }
    if s.kernel < 2 {
        return Err(format!("conv_kernel must be at least 2, got {}", s.kernel));
    }
    Ok(s)
}

/// Qwen3.5's layer kinds (`layer_types`, else every
/// `full_attention_interval`-th layer attends) and its Gated DeltaNet shape.
fn recurrent_layout(
    raw: &RawConfig,
    layers: usize,
) -> Result<(Vec<bool>, Option<DeltaShape>), String> {
    if raw.num_experts.unwrap_or(0) > 0 {
        return Err("Qwen3.5 mixture-of-experts models are not supported (num_experts > 0)".into());
    }
    let kinds = match &raw.layer_types {
        Some(t) => {
            if t.len() != layers {
                return Err(format!(
                    "layer_types lists {} layers, num_hidden_layers is {layers}",
                    t.len()
                ));
            }
            t.iter()
                .map(|k| match k.as_str() {
                    "linear_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(format!(
                        "layer_types: {other:?} is not linear_attention or full_attention"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        None => {
            let every = raw.full_attention_interval.unwrap_or(4);
            if every <= 0 {
                return Err(format!(
                    "full_attention_interval must be positive, got {every}"
                ));
            }
            (0..layers).map(|i| (i + 1) % every as usize != 0).collect()
        }
    };
    let need = |name: &str, v: Option<i32>| -> Result<i32, String> {
        match v {
            Some(x) if x > 0 => Ok(x),
            Some(x) => Err(format!("{name} must be positive, got {x}")),
            None => Err(format!("{name} is missing")),
        }
    };
    let shape = DeltaShape {
        k_heads: need("linear_num_key_heads", raw.linear_num_key_heads)?,
        v_heads: need("linear_num_value_heads", raw.linear_num_value_heads)?,
        k_dim: need("linear_key_head_dim", raw.linear_key_head_dim)?,
        v_dim: need("linear_value_head_dim", raw.linear_value_head_dim)?,
        kernel: need("linear_conv_kernel_dim", raw.linear_conv_kernel_dim)?,
    };
    if shape.v_heads % shape.k_heads != 0 {
        return Err(format!(
            "linear_num_value_heads {} must be a multiple of linear_num_key_heads {}",
            shape.v_heads, shape.k_heads
        ));
    }
    if shape.kernel < 2 {
        return Err(format!(
            "linear_conv_kernel_dim must be at least 2, got {}",
            shape.kernel
        ));
    }
    Ok((kinds, Some(shape)))
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
