//! Gemma 3 text models (`general.architecture = "gemma3"`) -> an HF-layout
//! directory that mlx-lm's `gemma3_text` model (and transformers'
//! `Gemma3ForCausalLM`) loads.
//!
//! Every tensor is dequantized exactly (see [`crate::quant::dequantize_into`])
//! and stored as **bf16**, the dtype Google publishes Gemma 3 in. Why not
//! MLX affine: the files mix five formats, and two have no exact MLX form
//! (Q6_K scales 16-element groups, which MLX's group sizes 32/64/128 cannot
//! express; Q4_K's per-group scale `d * sc` is an f16 times a 6-bit integer,
//! which needs more mantissa than an f16 MLX scale has). A single dtype keeps
//! the directory loadable by any mlx-lm style loader; a server that wants
//! 4/8-bit weights re-quantizes at load. The rounding to bf16 is the only
//! loss (round to nearest even: relative error at most 2^-8 per value,
//! about 0.15% relative RMS per tensor; the measured figures are in
//! `weft_conversion.json`); the norm weights are exact (see below).
//!
//! GGUF conventions undone here, each with its source:
//!
//! 1. **RMSNorm weights carry +1.** Gemma's RMSNorm multiplies by `1 + w`;
//!    llama.cpp's multiplies by `w`, so its converter adds 1 to every tensor
//!    whose HF name ends in `norm.weight` (`convert_hf_to_gguf.py`,
//!    `Gemma3Model.norm_shift` = 1.0: "Gemma3RMSNorm adds 1.0 to the norm
//!    value"), which covers input/post-attention/pre- and post-feedforward
//!    norms, `q_norm`/`k_norm` and the final norm. transformers' GGUF loader
//!    undoes it the same way (`Gemma2TensorProcessor`, used for gemma3 in
//!    `modeling_gguf_pytorch_utils.py`: `if "norm.weight" in name: weights =
//!    weights - 1`). We subtract 1 in f32; for the 270M file every result is
//!    exactly a bf16 value (the originals were bf16), so the norms are lossless.
//! 2. **No q/k row permutation.** llama.cpp permutes q/k rows only in its
//!    `LlamaModel` converter (for adjacent-pair RoPE); `Gemma3Model` does not
//!    override `modify_tensors` that way, and its Gemma 3 graph uses NeoX
//!    (rotate-half) RoPE like HF. transformers' loader permutes only for
//!    llama/mistral. So q/k are copied in their stored order.
//! 3. **Local RoPE base is not in the file.** llama.cpp's loader hard-codes
//!    `rope_freq_base_train_swa = 10000` for gemma3 (`llama-model.cpp`) and
//!    reads `gemma3.rope.freq_base` for the global layers (written by the
//!    converter from HF's `rope_theta`). We use `gemma3.rope.freq_base_swa`
//!    if a newer file has it, else 10000.
//! 4. **Layer pattern is not in the file.** llama.cpp sets
//!    `set_swa_pattern(6)` for gemma3 when `attention.sliding_window` is
//!    present: layers `i` with `i % 6 == 5` are global, the rest local (HF's
//!    `layer_types`, mlx-lm's `sliding_window_pattern` = 6).
//! 5. **Query scaling is not in the file.** llama.cpp uses `1/sqrt(head_dim)`
//!    except for the 27B (62 layers): `1/sqrt(hidden / heads)` (gemma_pytorch's
//!    config), i.e. HF's `query_pre_attn_scalar`.
//! 6. **Embedding scaling** (`sqrt(hidden)`) and the gelu-tanh MLP are part of
//!    the architecture in both worlds; nothing is stored for them.
//! 7. **No `output.weight`**: the embeddings are tied (`tie_word_embeddings`).
//!    llama.cpp's converter also drops embedding rows past the tokenizer's
//!    vocabulary; `vocab_size` is the embedding's row count.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use half::bf16;
use safetensors::Dtype;
use serde_json::{json, Map, Value};

use crate::convert::{clean_f32, read_shape, usize_key, OwnedTensor, WEIGHTS_FILE};
use crate::error::GgufError;
use crate::quant::{can_dequantize, dequantize_into, DEQUANTIZABLE};
use crate::reader::{GgufFile, TensorInfo};
use crate::tokenizer::{build_tokenizer, write_json};

type Result<T> = std::result::Result<T, GgufError>;

/// Every this many layers, the last one is global (llama.cpp's `set_swa_pattern(6)`).
pub const SLIDING_WINDOW_PATTERN: usize = 6;

/// llama.cpp's fixed RoPE base for Gemma 3's local (sliding-window) layers.
pub const LOCAL_ROPE_BASE: f64 = 10000.0;

/// Name of the per-tensor conversion-error report written beside the weights.
pub const CONVERSION_REPORT: &str = "weft_conversion.json";

/// Hyper-parameters of a Gemma 3 GGUF, read from its `gemma3.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Params {
    /// `gemma3.embedding_length`
    pub hidden_size: usize,
    /// `gemma3.block_count`
    pub num_hidden_layers: usize,
    /// `gemma3.feed_forward_length`
    pub intermediate_size: usize,
    /// `gemma3.attention.head_count`
    pub num_attention_heads: usize,
    /// `gemma3.attention.head_count_kv` (defaults to the head count)
    pub num_key_value_heads: usize,
    /// `gemma3.attention.key_length` (= value_length), else hidden / heads
    pub head_dim: usize,
    /// `gemma3.attention.layer_norm_rms_epsilon`
    pub rms_norm_eps: f64,
    /// `gemma3.rope.freq_base` (global layers; llama.cpp's default 10000)
    pub rope_theta: f64,
    /// `gemma3.rope.freq_base_swa`, else llama.cpp's fixed 10000
    pub rope_local_base_freq: f64,
    /// Linear RoPE scaling factor of the global layers (`gemma3.rope.scaling.*`)
    pub rope_linear_factor: Option<f64>,
    /// `gemma3.attention.sliding_window` (None: every layer global)
    pub sliding_window: Option<usize>,
    /// HF's `query_pre_attn_scalar` (see convention 5 in the module docs)
    pub query_pre_attn_scalar: usize,
    /// `gemma3.final_logit_softcapping`, if set
    pub final_logit_softcapping: Option<f64>,
    /// `gemma3.context_length`
    pub max_position_embeddings: usize,
}

impl Gemma3Params {
    /// Reads and checks the `gemma3.*` hyper-parameters.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "gemma3" {
            return Err(GgufError::Unsupported(format!(
                "general.architecture = {arch:?}, expected \"gemma3\""
            )));
        }
        let k = |s: &str| format!("gemma3.{s}");
        let opt = |s: &str| -> Result<Option<usize>> {
            match g.get(&k(s)) {
                None => Ok(None),
                Some(_) => Ok(Some(usize_key(g, &k(s))?)),
            }
        };
        let c = read_shape(g, "gemma3")?;
        let float_or = |s: &str, default: f64| -> Result<f64> {
            match g.get(&k(s)) {
                None => Ok(default),
                Some(_) => Ok(clean_f32(g.get_f64(&k(s))?)),
            }
        };
        let rope_local_base_freq = float_or("rope.freq_base_swa", LOCAL_ROPE_BASE)?;
        let rope_linear_factor = match g.get_str_opt(&k("rope.scaling.type"))? {
            None | Some("none") => None,
            Some("linear") => {
                let f = float_or("rope.scaling.factor", 1.0)?;
                if !(f.is_finite() && f > 0.0) {
                    return Err(GgufError::WrongType {
                        key: k("rope.scaling.factor"),
                        expected: "a positive factor".into(),
                        found: f.to_string(),
                    });
                }
                (f != 1.0).then_some(f)
            }
            Some(other) => {
                return Err(GgufError::Unsupported(format!(
                    "{} = {other:?} (only linear RoPE scaling is supported for gemma3)",
                    k("rope.scaling.type")
                )))
            }
        };
        let sliding_window = opt("attention.sliding_window")?.filter(|&w| w > 0);
        let query_pre_attn_scalar = if c.num_hidden_layers == 62 {
            c.hidden_size / c.num_attention_heads
        } else {
            c.head_dim
        };
        let final_logit_softcapping = match g.get(&k("final_logit_softcapping")) {
            None => None,
            Some(_) => {
                Some(clean_f32(g.get_f64(&k("final_logit_softcapping"))?)).filter(|&c| c > 0.0)
            }
        };
        Ok(Gemma3Params {
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            intermediate_size: c.intermediate_size,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope_local_base_freq,
            rope_linear_factor,
            sliding_window,
            query_pre_attn_scalar,
            final_logit_softcapping,
            max_position_embeddings: c.max_position_embeddings,
        })
    }

    /// Whether layer `i` is a global (full-attention) layer.
    pub fn is_global(&self, layer: usize) -> bool {
        self.sliding_window.is_none()
            || layer % SLIDING_WINDOW_PATTERN == SLIDING_WINDOW_PATTERN - 1
    }
}

/// What a GGUF tensor becomes: HF name, expected GGUF dims (innermost
/// first), and whether it is a Gemma norm (stored as `w + 1`).
#[derive(Debug, Clone, PartialEq)]
struct Target {
    name: String,
    dims: Vec<usize>,
    norm: bool,
}

fn target_for(name: &str, p: &Gemma3Params, vocab: usize) -> Option<Target> {
    let h = p.hidden_size;
    let q_dim = p.num_attention_heads * p.head_dim;
    let kv_dim = p.num_key_value_heads * p.head_dim;
    let t = |name: String, dims: Vec<usize>, norm: bool| Some(Target { name, dims, norm });
    match name {
        "token_embd.weight" => return t("model.embed_tokens.weight".into(), vec![h, vocab], false),
        "output.weight" => return t("lm_head.weight".into(), vec![h, vocab], false),
        "output_norm.weight" => return t("model.norm.weight".into(), vec![h], true),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer_str, rest) = rest.split_once('.')?;
    let layer: usize = layer_str.parse().ok()?;
    if layer >= p.num_hidden_layers || layer_str != layer.to_string() {
        return None;
    }
    let b = format!("model.layers.{layer}");
    let ff = p.intermediate_size;
    match rest {
        "attn_norm.weight" => t(format!("{b}.input_layernorm.weight"), vec![h], true),
        "post_attention_norm.weight" => t(
            format!("{b}.post_attention_layernorm.weight"),
            vec![h],
            true,
        ),
        "ffn_norm.weight" => t(
            format!("{b}.pre_feedforward_layernorm.weight"),
            vec![h],
            true,
        ),
        "post_ffw_norm.weight" => t(
            format!("{b}.post_feedforward_layernorm.weight"),
            vec![h],
            true,
        ),
        "attn_q_norm.weight" => t(
            format!("{b}.self_attn.q_norm.weight"),
            vec![p.head_dim],
            true,
        ),
        "attn_k_norm.weight" => t(
            format!("{b}.self_attn.k_norm.weight"),
            vec![p.head_dim],
            true,
        ),
        "attn_q.weight" => t(
            format!("{b}.self_attn.q_proj.weight"),
            vec![h, q_dim],
            false,
        ),
        "attn_k.weight" => t(
            format!("{b}.self_attn.k_proj.weight"),
            vec![h, kv_dim],
            false,
        ),
        "attn_v.weight" => t(
            format!("{b}.self_attn.v_proj.weight"),
            vec![h, kv_dim],
            false,
        ),
        "attn_output.weight" => t(
            format!("{b}.self_attn.o_proj.weight"),
            vec![q_dim, h],
            false,
        ),
        "ffn_gate.weight" => t(format!("{b}.mlp.gate_proj.weight"), vec![h, ff], false),
        "ffn_up.weight" => t(format!("{b}.mlp.up_proj.weight"), vec![h, ff], false),
        "ffn_down.weight" => t(format!("{b}.mlp.down_proj.weight"), vec![ff, h], false),
        _ => None,
    }
}

/// The tensors a Gemma 3 file must have. Lazy, so a hostile `block_count`
/// fails at the first missing layer instead of building every name.
fn required_tensors(p: &Gemma3Params) -> impl Iterator<Item = String> {
    const PER_LAYER: [&str; 13] = [
        "attn_norm",
        "post_attention_norm",
        "ffn_norm",
        "post_ffw_norm",
        "attn_q_norm",
        "attn_k_norm",
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

/// How far the stored bf16 values are from the exact f32 dequantization.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TensorError {
    /// ggml type in the GGUF.
    pub ggml_type: String,
    /// Number of values.
    pub n: usize,
    /// max |bf16 - exact|
    pub max_abs: f64,
    /// max |bf16 - exact| / |exact| over nonzero exact values
    pub max_rel: f64,
    /// ||bf16 - exact|| / ||exact|| (relative RMS error of the whole tensor)
    pub rel_rms: f64,
}

/// The converted Gemma 3 weights and the conversion error of each.
#[derive(Debug, Default)]
pub struct Gemma3Weights {
    /// Tensors by their HF / mlx-lm name (all bf16).
    pub tensors: BTreeMap<String, OwnedTensor>,
    /// Conversion error by HF name.
    pub errors: BTreeMap<String, TensorError>,
    /// Whether the file has its own output matrix (else embeddings are tied).
    pub has_lm_head: bool,
    /// Rows of the embedding matrix.
    pub vocab_size: usize,
}

fn check_dims(info: &TensorInfo, want: &[usize]) -> Result<()> {
    let want_u64: Vec<u64> = want.iter().map(|&d| d as u64).collect();
    if info.dims != want_u64 {
        return Err(GgufError::bad_tensor(
            &info.name,
            format!(
                "has dims {:?} (innermost first), expected {want_u64:?} from the metadata",
                info.dims
            ),
        ));
    }
    Ok(())
}

/// Dequantizes `data` (a tensor of `n` values whose innermost dimension is
/// `row`) to bf16, a row at a time, subtracting `shift` first; also measures
/// the bf16 rounding error against the exact f32 values.
fn to_bf16(
    info: &TensorInfo,
    data: &[u8],
    n: usize,
    row: usize,
    shift: f32,
) -> Result<(Vec<u8>, TensorError)> {
    let (block_elems, block_bytes) = info
        .ggml_type
        .block_layout()
        .ok_or_else(|| GgufError::bad_tensor(&info.name, "unknown block layout"))?;
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    if row == 0 || row % block_elems != 0 || n % row != 0 {
        return Err(GgufError::bad_tensor(
            &info.name,
            format!(
                "row length {row} is not a whole number of {} blocks",
                info.ggml_type
            ),
        ));
    }
    let row_bytes = row / block_elems * block_bytes;
    let rows = n / row;
    if rows.checked_mul(row_bytes) != Some(data.len()) {
        return Err(GgufError::bad_tensor(
            &info.name,
            format!(
                "{} bytes of data for {n} {} values",
                data.len(),
                info.ggml_type
            ),
        ));
    }
    let mut out = Vec::with_capacity(n * 2);
    let mut scratch = vec![0f32; row];
    let (mut max_abs, mut max_rel, mut err2, mut ref2) = (0f64, 0f64, 0f64, 0f64);
    for r in 0..rows {
        dequantize_into(
            &info.name,
            info.ggml_type,
            &data[r * row_bytes..(r + 1) * row_bytes],
            &mut scratch,
        )?;
        for &v in &scratch {
            let exact = v - shift;
            let b = bf16::from_f32(exact);
            out.extend_from_slice(&b.to_le_bytes());
            let (e, x) = (f64::from(exact), f64::from(b.to_f32()));
            let d = (x - e).abs();
            max_abs = max_abs.max(d);
            if e != 0.0 {
                max_rel = max_rel.max(d / e.abs());
            }
            err2 += d * d;
            ref2 += e * e;
        }
    }
    let rel_rms = if ref2 > 0.0 {
        (err2 / ref2).sqrt()
    } else {
        0.0
    };
    Ok((
        out,
        TensorError {
            ggml_type: info.ggml_type.name(),
            n,
            max_abs,
            max_rel,
            rel_rms,
        },
    ))
}

/// Converts every tensor of a Gemma 3 GGUF to bf16 under its HF name.
pub fn convert_gemma3_weights(g: &GgufFile, p: &Gemma3Params) -> Result<Gemma3Weights> {
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
    let mut out = Gemma3Weights {
        vocab_size: vocab,
        ..Gemma3Weights::default()
    };
    for info in g.tensors() {
        let target = target_for(&info.name, p, vocab).ok_or_else(|| GgufError::UnknownTensor {
            name: info.name.clone(),
            arch: "gemma3".into(),
        })?;
        check_dims(info, &target.dims)?;
        if !can_dequantize(info.ggml_type) {
            return Err(GgufError::UnsupportedTensorType {
                name: info.name.clone(),
                type_name: info.ggml_type.name(),
                supported: DEQUANTIZABLE,
            });
        }
        if target.norm && info.ggml_type.block_layout().map(|l| l.0) != Some(1) {
            return Err(GgufError::UnsupportedTensorType {
                name: info.name.clone(),
                type_name: format!("{} (for a norm vector)", info.ggml_type),
                supported: "F32, F16, BF16",
            });
        }
        let data = g.tensor_data(info)?;
        let n: usize = target.dims.iter().product();
        let shift = if target.norm { 1.0 } else { 0.0 };
        let (bytes, err) = to_bf16(info, data, n, target.dims[0], shift)?;
        if target.name == "lm_head.weight" {
            out.has_lm_head = true;
        }
        // HF shape is the GGUF dims reversed (outermost first).
        let shape: Vec<usize> = target.dims.iter().rev().copied().collect();
        out.tensors.insert(
            target.name.clone(),
            OwnedTensor {
                dtype: Dtype::BF16,
                shape,
                data: bytes,
            },
        );
        out.errors.insert(target.name, err);
    }
    Ok(out)
}

/// Gemma 3's chat template (as in Google's `tokenizer_config.json` for the
/// Gemma 3 text models), used when the GGUF carries none: turns are
/// `<start_of_turn>{user|model}\n...<end_of_turn>\n`, a system message is
/// prepended to the first user turn.
pub const GEMMA3_CHAT_TEMPLATE: &str = "{{ bos_token }}\n\
{%- if messages[0]['role'] == 'system' -%}\n\
    {%- if messages[0]['content'] is string -%}\n\
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n\
    {%- else -%}\n\
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n\
    {%- endif -%}\n\
    {%- set loop_messages = messages[1:] -%}\n\
{%- else -%}\n\
    {%- set first_user_prefix = \"\" -%}\n\
    {%- set loop_messages = messages -%}\n\
{%- endif -%}\n\
{%- for message in loop_messages -%}\n\
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n\
        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n\
    {%- endif -%}\n\
    {%- if (message['role'] == 'assistant') -%}\n\
        {%- set role = \"model\" -%}\n\
    {%- else -%}\n\
        {%- set role = message['role'] -%}\n\
    {%- endif -%}\n\
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n\
    {%- if message['content'] is string -%}\n\
        {{ message['content'] | trim }}\n\
    {%- elif message['content'] is iterable -%}\n\
        {%- for item in message['content'] -%}\n\
            {%- if item['type'] == 'image' -%}\n\
                {{ '<start_of_image>' }}\n\
            {%- elif item['type'] == 'text' -%}\n\
                {{ item['text'] | trim }}\n\
            {%- endif -%}\n\
        {%- endfor -%}\n\
    {%- else -%}\n\
        {{ raise_exception(\"Invalid content type\") }}\n\
    {%- endif -%}\n\
    {{ '<end_of_turn>\\n' }}\n\
{%- endfor -%}\n\
{%- if add_generation_prompt -%}\n\
    {{'<start_of_turn>model\\n'}}\n\
{%- endif -%}\n";

/// `config.json` for mlx-lm's `gemma3_text` (and transformers' `Gemma3TextConfig`).
pub fn gemma3_config(
    p: &Gemma3Params,
    vocab_size: usize,
    tied: bool,
    bos: Option<u32>,
    eos: &[u32],
    pad: Option<u32>,
) -> Value {
    let mut c = Map::new();
    c.insert("architectures".into(), json!(["Gemma3ForCausalLM"]));
    c.insert("model_type".into(), json!("gemma3_text"));
    c.insert("hidden_size".into(), json!(p.hidden_size));
    c.insert("num_hidden_layers".into(), json!(p.num_hidden_layers));
    c.insert("intermediate_size".into(), json!(p.intermediate_size));
    c.insert("num_attention_heads".into(), json!(p.num_attention_heads));
    c.insert("num_key_value_heads".into(), json!(p.num_key_value_heads));
    c.insert("head_dim".into(), json!(p.head_dim));
    c.insert("rms_norm_eps".into(), json!(p.rms_norm_eps));
    c.insert("vocab_size".into(), json!(vocab_size));
    c.insert(
        "max_position_embeddings".into(),
        json!(p.max_position_embeddings),
    );
    c.insert("rope_theta".into(), json!(p.rope_theta));
    c.insert("rope_local_base_freq".into(), json!(p.rope_local_base_freq));
    c.insert(
        "rope_scaling".into(),
        match p.rope_linear_factor {
            Some(f) => json!({"rope_type": "linear", "factor": f}),
            None => Value::Null,
        },
    );
    c.insert(
        "query_pre_attn_scalar".into(),
        json!(p.query_pre_attn_scalar),
    );
    let (window, pattern) = match p.sliding_window {
        Some(w) => (json!(w), SLIDING_WINDOW_PATTERN),
        None => (Value::Null, 1),
    };
    c.insert("sliding_window".into(), window);
    // mlx-lm reads `sliding_window_pattern`; transformers reads `layer_types`.
    c.insert("sliding_window_pattern".into(), json!(pattern));
    let layer_types: Vec<&str> = (0..p.num_hidden_layers)
        .map(|i| {
            if p.is_global(i) {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    c.insert("layer_types".into(), json!(layer_types));
    c.insert(
        "final_logit_softcapping".into(),
        p.final_logit_softcapping.map_or(Value::Null, |v| json!(v)),
    );
    c.insert("attn_logit_softcapping".into(), Value::Null);
    c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    c.insert("attention_bias".into(), json!(false));
    c.insert("tie_word_embeddings".into(), json!(tied));
    c.insert("torch_dtype".into(), json!("bfloat16"));
    if let Some(b) = bos {
        c.insert("bos_token_id".into(), json!(b));
    }
    match eos {
        [] => {}
        [one] => {
            c.insert("eos_token_id".into(), json!(one));
        }
        many => {
            c.insert("eos_token_id".into(), json!(many));
        }
    }
    if let Some(pd) = pad {
        c.insert("pad_token_id".into(), json!(pd));
    }
    Value::Object(c)
}

/// Converts an opened Gemma 3 GGUF into `out_dir` (see the module docs).
pub fn convert_gemma3(g: &GgufFile, out_dir: &Path) -> Result<()> {
    let p = Gemma3Params::from_gguf(g)?;
    let tok = build_tokenizer(g)?;
    let weights = convert_gemma3_weights(g, &p)?;
    if tok.vocab_size > weights.vocab_size {
        return Err(GgufError::Malformed(format!(
            "tokenizer has {} tokens but the embedding only {} rows",
            tok.vocab_size, weights.vocab_size
        )));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| GgufError::io("create directory", out_dir, e))?;

    // Generation stops at <eos> and at the end of a chat turn.
    let mut eos: Vec<u32> = tok.eos_token_id.into_iter().collect();
    if let Some(end_of_turn) = tok.tokenizer.token_to_id("<end_of_turn>") {
        if !eos.contains(&end_of_turn) {
            eos.push(end_of_turn);
        }
    }
    let config = gemma3_config(
        &p,
        weights.vocab_size,
        !weights.has_lm_head,
        tok.bos_token_id,
        &eos,
        tok.pad_token_id,
    );
    write_json(&out_dir.join("config.json"), &config)?;
    let mut gen = Map::new();
    if let Some(b) = tok.bos_token_id {
        gen.insert("bos_token_id".into(), json!(b));
    }
    gen.insert("eos_token_id".into(), json!(eos));
    if let Some(pd) = tok.pad_token_id {
        gen.insert("pad_token_id".into(), json!(pd));
    }
    write_json(&out_dir.join("generation_config.json"), &Value::Object(gen))?;
    tok.save(out_dir)?;

    let mut report = Map::new();
    for (name, e) in &weights.errors {
        report.insert(
            name.clone(),
            json!({
                "ggml_type": e.ggml_type,
                "n": e.n,
                "max_abs_err": e.max_abs,
                "max_rel_err": e.max_rel,
                "rel_rms_err": e.rel_rms,
            }),
        );
    }
    write_json(
        &out_dir.join(CONVERSION_REPORT),
        &json!({
            "stored_dtype": "bfloat16",
            "reference": "exact f32 dequantization of the GGUF tensors (norms: minus 1)",
            "tensors": Value::Object(report),
        }),
    )?;

    let path = out_dir.join(WEIGHTS_FILE);
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "mlx".to_string());
    let source = g
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    meta.insert("weft_gguf_source".to_string(), source);
    // Streams tensor by tensor, so the peak is the tensors plus a buffer.
    safetensors::serialize_to_file(weights.tensors.iter(), Some(meta), &path).map_err(|e| {
        GgufError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        }
    })?;
    // safetensors creates the file owner-only; give it the permissions the
    // other files of the directory got.
    let config = out_dir.join("config.json");
    let perms = std::fs::metadata(&config)
        .map_err(|e| GgufError::io("stat", &config, e))?
        .permissions();
    std::fs::set_permissions(&path, perms).map_err(|e| GgufError::io("set permissions", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::{GgmlType, GgufBuilder, GgufValue};

    fn params() -> Gemma3Params {
        Gemma3Params {
            hidden_size: 256,
            num_hidden_layers: 7,
            intermediate_size: 512,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 256,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_local_base_freq: 1e4,
            rope_linear_factor: None,
            sliding_window: Some(512),
            query_pre_attn_scalar: 256,
            final_logit_softcapping: None,
            max_position_embeddings: 32768,
        }
    }

    #[test]
    fn names_map_like_hf() {
        let p = params();
        let t = target_for("blk.3.ffn_norm.weight", &p, 10).unwrap();
        assert_eq!(t.name, "model.layers.3.pre_feedforward_layernorm.weight");
        assert!(t.norm);
        let t = target_for("blk.0.attn_q_norm.weight", &p, 10).unwrap();
        assert_eq!(
            (t.name.as_str(), t.dims.as_slice()),
            ("model.layers.0.self_attn.q_norm.weight", &[256usize][..])
        );
        let t = target_for("blk.6.attn_output.weight", &p, 10).unwrap();
        assert_eq!(t.dims, vec![512, 256]);
        assert!(!t.norm);
        assert_eq!(target_for("blk.7.attn_q.weight", &p, 10), None);
        assert_eq!(target_for("blk.01.attn_q.weight", &p, 10), None);
        assert_eq!(target_for("rope_freqs.weight", &p, 10), None);
        // 5 local : 1 global.
        let globals: Vec<usize> = (0..18).filter(|&i| p.is_global(i)).collect();
        assert_eq!(globals, vec![5, 11, 17]);
    }

    /// A tiny Gemma 3 GGUF: hidden 32, 2 layers, 2 heads of 32, 1 KV head,
    /// FFN 64, vocab 8 SentencePiece tokens; matrices Q8_0/Q5_0/F16, norms F32.
    pub(crate) fn tiny_gemma3(retype: Option<(&str, GgmlType)>, extra: Option<&str>) -> Vec<u8> {
        let s = |v: &str| GgufValue::String(v.into());
        let toks = [
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<start_of_turn>",
            "<end_of_turn>",
            "▁a",
            "a",
        ];
        let types = [3, 3, 3, 3, 3, 3, 1, 1];
        let mut b = GgufBuilder::new()
            .kv("general.architecture", s("gemma3"))
            .kv("gemma3.embedding_length", GgufValue::U32(32))
            .kv("gemma3.block_count", GgufValue::U32(2))
            .kv("gemma3.feed_forward_length", GgufValue::U32(64))
            .kv("gemma3.attention.head_count", GgufValue::U32(2))
            .kv("gemma3.attention.head_count_kv", GgufValue::U32(1))
            .kv("gemma3.attention.key_length", GgufValue::U32(32))
            .kv("gemma3.attention.value_length", GgufValue::U32(32))
            .kv(
                "gemma3.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-6),
            )
            .kv("gemma3.rope.freq_base", GgufValue::F32(1e6))
            .kv("gemma3.attention.sliding_window", GgufValue::U32(16))
            .kv("gemma3.context_length", GgufValue::U32(128))
            .kv("tokenizer.ggml.model", s("llama"))
            .kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(toks.iter().map(|t| s(t)).collect()),
            )
            .kv(
                "tokenizer.ggml.scores",
                GgufValue::Array(
                    [
                        -1000.0f32, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0, 0.0, -1.0,
                    ]
                    .into_iter()
                    .map(GgufValue::F32)
                    .collect(),
                ),
            )
            .kv(
                "tokenizer.ggml.token_type",
                GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
            )
            .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(2))
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(1))
            .kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(3))
            .kv("tokenizer.ggml.padding_token_id", GgufValue::U32(0))
            .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(true))
            .kv("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false));
        let bytes_for = |ty: GgmlType, n: usize| -> Vec<u8> {
            if ty == GgmlType::F32 {
                // Norm weights as llama.cpp stores them: 1 + w.
                return (0..n)
                    .flat_map(|i| (1.0f32 + i as f32 / 64.0).to_le_bytes())
                    .collect();
            }
            let (be, bb) = ty.block_layout().unwrap();
            let len = n / be as usize * bb as usize;
            let mut v: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            if ty == GgmlType::Q8_0 || ty == GgmlType::Q5_0 {
                for blk in v.chunks_exact_mut(bb as usize) {
                    blk[0] = 0x00;
                    blk[1] = 0x2c; // d = 1/16
                }
            }
            v
        };
        let mut tensors: Vec<(String, Vec<u64>, GgmlType)> = vec![
            ("token_embd.weight".into(), vec![32, 8], GgmlType::Q8_0),
            ("output_norm.weight".into(), vec![32], GgmlType::F32),
        ];
        for l in 0..2 {
            for (n, dims, ty) in [
                ("attn_norm", vec![32u64], GgmlType::F32),
                ("post_attention_norm", vec![32], GgmlType::F32),
                ("ffn_norm", vec![32], GgmlType::F32),
                ("post_ffw_norm", vec![32], GgmlType::F32),
                ("attn_q_norm", vec![32], GgmlType::F32),
                ("attn_k_norm", vec![32], GgmlType::F32),
                ("attn_q", vec![32, 64], GgmlType::Q5_0),
                ("attn_k", vec![32, 32], GgmlType::Q5_0),
                ("attn_v", vec![32, 32], GgmlType::Q8_0),
                ("attn_output", vec![64, 32], GgmlType::F16),
                ("ffn_gate", vec![32, 64], GgmlType::Q5_0),
                ("ffn_up", vec![32, 64], GgmlType::Q5_0),
                ("ffn_down", vec![64, 32], GgmlType::Q8_0),
            ] {
                tensors.push((format!("blk.{l}.{n}.weight"), dims, ty));
            }
        }
        if let Some(name) = extra {
            tensors.push((name.into(), vec![32], GgmlType::F32));
        }
        for (name, dims, ty) in tensors {
            let ty = match retype {
                Some((n, t)) if n == name => t,
                _ => ty,
            };
            let n = dims.iter().product::<u64>() as usize;
            b = b.tensor(&name, &dims, ty, bytes_for(ty, n));
        }
        b.build()
    }

    fn tmp_dir(tag: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!("weft-gemma3-{tag}-{}-{nanos}", std::process::id()))
    }

    #[test]
    fn converts_a_synthetic_gemma3() {
        let g = GgufFile::from_bytes("tiny-gemma3.gguf", tiny_gemma3(None, None)).unwrap();
        let dir = tmp_dir("tiny");
        crate::convert(&g, &dir).unwrap();
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["model_type"], "gemma3_text");
        assert_eq!(cfg["head_dim"], 32);
        assert_eq!(cfg["query_pre_attn_scalar"], 32);
        assert_eq!(cfg["sliding_window"], 16);
        assert_eq!(cfg["sliding_window_pattern"], 6);
        assert_eq!(
            cfg["layer_types"],
            json!(["sliding_attention", "sliding_attention"])
        );
        assert_eq!(cfg["rope_local_base_freq"].as_f64(), Some(10000.0));
        assert_eq!(cfg["rope_theta"].as_f64(), Some(1e6));
        assert_eq!(cfg["tie_word_embeddings"], true);
        assert_eq!(cfg["eos_token_id"], json!([1, 5]));
        let gen: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("generation_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(gen["eos_token_id"], json!([1, 5]));
        let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 2 + 2 * 13);
        let n = st.tensor("model.layers.1.self_attn.k_norm.weight").unwrap();
        assert_eq!((n.dtype(), n.shape()), (Dtype::BF16, &[32usize][..]));
        // 1 + i/64 stored; i/64 back (exact in bf16).
        let vals: Vec<f32> = n
            .data()
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(vals, (0..32).map(|i| i as f32 / 64.0).collect::<Vec<_>>());
        let q = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.shape(), &[64, 32]);
        let e = st.tensor("model.embed_tokens.weight").unwrap();
        assert_eq!(e.shape(), &[8, 32]);
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(CONVERSION_REPORT)).unwrap())
                .unwrap();
        let rel = report["tensors"]["model.embed_tokens.weight"]["max_rel_err"]
            .as_f64()
            .unwrap();
        assert!(rel <= 1.0 / 256.0, "{rel}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn conversion_errors_name_the_tensor() {
        let dir = tmp_dir("bad");
        let g = GgufFile::from_bytes(
            "x",
            tiny_gemma3(Some(("blk.1.ffn_up.weight", GgmlType::Q8_1)), None),
        )
        .unwrap();
        let err = crate::convert(&g, &dir).unwrap_err().to_string();
        assert!(
            err.contains("blk.1.ffn_up.weight") && err.contains("Q8_1"),
            "{err}"
        );
        let g = GgufFile::from_bytes(
            "x",
            tiny_gemma3(Some(("blk.0.attn_norm.weight", GgmlType::Q8_0)), None),
        )
        .unwrap();
        let err = crate::convert(&g, &dir).unwrap_err().to_string();
        assert!(err.contains("blk.0.attn_norm.weight"), "{err}");
        let g = GgufFile::from_bytes("x", tiny_gemma3(None, Some("blk.0.mystery.weight"))).unwrap();
        let err = crate::convert(&g, &dir).unwrap_err().to_string();
        assert!(
            err.contains("blk.0.mystery.weight") && err.contains("gemma3"),
            "{err}"
        );
        assert!(
            !dir.exists(),
            "nothing is written before the input is validated"
        );
    }
}
