//! Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) and Gemma 3's
//! text decoder (the same layer with sandwich norms, gelu-tanh, scaled
//! embeddings and sliding-window layers) over mlx-rs.

use std::future::Future;

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{ops, Array, Dtype};

use crate::config::{Activation, Arch, ModelConfig};
use crate::cpu_kernels::{self, Kernels};
use crate::decode_kernels::{self, DecodeKernels, LoraIn, ProShrink, QkvHeads, ShrinkIn};
use crate::error::{ModelError, Result};
use crate::gated_delta::GatedDeltaNet;
use crate::gemv::{Post, Pre};
use crate::kv::{self, KvShape, KvStep, LayerKv};
use crate::linear::{Linear, WeightPolicy};
use crate::lora::{Group, LoraStep};
use crate::mamba2::Mamba2;
use crate::weights::Weights;

/// Projections computed by one matmul whose output is split.
enum Proj {
    Fused { lin: Linear, splits: Vec<i32> },
    Separate(Vec<Linear>),
}

impl Proj {
    fn new(parts: Vec<Linear>) -> Result<Self> {
        let refs: Vec<&Linear> = parts.iter().collect();
        Ok(match Linear::fuse(&refs)? {
            Some(lin) => {
                let mut splits = Vec::new();
                let mut acc = 0;
                for p in &parts[..parts.len() - 1] {
                    acc += p.out_features();
                    splits.push(acc);
                }
                Proj::Fused { lin, splits }
            }
            None => Proj::Separate(parts),
        })
    }

    /// The parts' outputs `[N, out_i]`, each plus its adapter delta
    /// (`deltas`, one per part; None: not adapted).
    async fn forward(&self, x: &Array, deltas: Option<Vec<Option<Array>>>) -> Result<Vec<Array>> {
        let out = match self {
            Proj::Fused { lin, splits } => {
                lin.forward_async(x).await?.split_at_indices(splits, -1)?
            }
            Proj::Separate(parts) => {
                let mut out = Vec::with_capacity(parts.len());
                for p in parts {
                    out.push(p.forward_async(x).await?);
                }
                out
            }
        };
        add_deltas(out, deltas, |d, _| Ok(d))
    }

    /// The projections as `[B, T, heads, head_dim]` per part (`heads[i]`
    /// heads each). A fused output is reshaped once and split along the head
    /// axis, so the parts are views of it (no copy per part).
    /// `x` is `[B * T, hidden]`.
    async fn forward_heads(
        &self,
        x: &Array,
        (b, t): (i32, i32),
        heads: &[i32],
        head_dim: i32,
        deltas: Option<Vec<Option<Array>>>,
    ) -> Result<Vec<Array>> {
        let out = match self {
            Proj::Fused { lin, .. } => {
                let total: i32 = heads.iter().sum();
                let y = lin
                    .forward_async(x)
                    .await?
                    .reshape(&[b, t, total, head_dim])?;
                let mut at = Vec::with_capacity(heads.len());
                let mut acc = 0;
                for h in &heads[..heads.len() - 1] {
                    acc += h;
                    at.push(acc);
                }
                y.split_at_indices(&at, 2)?
            }
            Proj::Separate(_) => {
                let parts = self.forward(x, None).await?;
                parts
                    .into_iter()
                    .zip(heads)
                    .map(|(p, &h)| Ok(p.reshape(&[b, t, h, head_dim])?))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        add_deltas(out, deltas, |d, i| {
            Ok(d.reshape(&[b, t, heads[i], head_dim])?)
        })
    }

    /// Packs every part for the CPU GEMM (those that are dense f32).
    fn pack(&mut self) -> Result<()> {
        let parts: Vec<&mut Linear> = match self {
            Proj::Fused { lin, .. } => vec![lin],
            Proj::Separate(parts) => parts.iter_mut().collect(),
        };
        for p in parts {
            pack_in_place(p)?;
        }
        Ok(())
    }

    fn linears(&self) -> Vec<&Linear> {
        match self {
            Proj::Fused { lin, .. } => vec![lin],
            Proj::Separate(parts) => parts.iter().collect(),
        }
    }
}

/// `parts[i] + deltas[i]` where a delta is given (shaped by `shape(delta, i)`).
fn add_deltas(
    parts: Vec<Array>,
    deltas: Option<Vec<Option<Array>>>,
    shape: impl Fn(Array, usize) -> Result<Array>,
) -> Result<Vec<Array>> {
    let Some(deltas) = deltas else {
        return Ok(parts);
    };
    if deltas.len() != parts.len() {
        return Err(ModelError::Invalid(format!(
            "{} adapter deltas for {} projections",
            deltas.len(),
            parts.len()
        )));
    }
    parts
        .into_iter()
        .zip(deltas)
        .enumerate()
        .map(|(i, (p, d))| match d {
            Some(d) => Ok(ops::add(&p, &shape(d.as_dtype(p.dtype())?, i)?)?),
            None => Ok(p),
        })
        .collect()
}

/// `y + delta` (the adapter's low-rank output of a single projection).
fn with_delta(y: Array, delta: Option<Vec<Option<Array>>>) -> Result<Array> {
    match delta.and_then(|mut d| d.pop().flatten()) {
        Some(d) => Ok(ops::add(&y, &d.as_dtype(y.dtype())?)?),
        None => Ok(y),
    }
}

struct Attention {
    qkv: Proj,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
}

struct Mlp {
    gate_up: Proj,
    down: Linear,
}

/// What mixes a layer's tokens: attention over the KV cache, or a recurrent
/// layer over per-row state.
enum Mixer {
    Attention(Attention),
    Delta(GatedDeltaNet),
    Mamba(Mamba2),
    /// A block whose mixer is an ungated ReLU² MLP (Nemotron-H's `-`).
    Mlp {
        up: Linear,
        down: Linear,
    },
}

impl Mixer {
    fn attn(&self, layer: usize) -> Result<&Attention> {
        match self {
            Mixer::Attention(a) => Ok(a),
            _ => Err(ModelError::Invalid(format!(
                "layer {layer} is not an attention layer"
            ))),
        }
    }
}

struct Layer {
    mixer: Mixer,
    /// The layer's MLP and its input's norm (Llama's
    /// `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`);
    /// None in single-mixer blocks (Nemotron-H).
    mlp: Option<(Mlp, Array)>,
    input_norm: Array,
    /// Gemma's norms of the attention and MLP outputs before their residual
    /// adds (`post_attention_layernorm`, `post_feedforward_layernorm`).
    attn_out_norm: Option<Array>,
    mlp_out_norm: Option<Array>,
    /// Attends over a sliding window (uses the local RoPE).
    sliding: bool,
}

/// Rotary embedding parameters, fixed at load.
struct Rope {
    dims: i32,
    base: Option<f32>,
    scale: f32,
    freqs: Option<Array>,
    /// `[dims / 2]` f32 inverse frequencies and `[1]` f32 scale, as the
    /// fused decode kernels take them.
    inv_freq: Array,
    scale_arr: Array,
}

/// Why a model's one-token decode steps cannot run the fused decode kernels
/// (`None`: they can).
fn unfusable(layers: &[Layer], c: &ModelConfig, policy: WeightPolicy) -> Option<&'static str> {
    if policy.kernels != Kernels::Stock || policy.host_gemm {
        return Some("CPU kernels");
    }
    if !decode_kernels::supports(policy.dtype) {
        return Some("dtype");
    }
    if c.head_dim % 2 != 0 || layers.is_empty() {
        return Some("shape");
    }
    if c.arch == Arch::Gemma3 {
        return Some("Gemma 3 layers");
    }
    if c.attn_output_gate || c.rotary_dim != c.head_dim {
        return Some("gated or partially rotated attention");
    }
    for l in layers {
        let (Mixer::Attention(attn), Some((mlp, _))) = (&l.mixer, &l.mlp) else {
            return Some("recurrent or single-mixer layers");
        };
        if attn.q_norm.is_some() || attn.k_norm.is_some() {
            return Some("per-head q/k norms");
        }
        if !matches!(attn.qkv, Proj::Fused { .. }) || !matches!(mlp.gate_up, Proj::Fused { .. }) {
            return Some("unfused projections");
        }
    }
    None
}

thread_local! {
    static TRACES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times this thread traced a compiled function (MLX runs a compiled
/// function's Rust body only to trace it). Shapeless functions trace once per
/// thread; more means shapes or dtypes are forcing retraces (each a compile),
/// which the engine exports as `weft_compile_traces_total`.
pub fn compile_traces() -> u64 {
    TRACES.with(|t| t.get())
}

/// Counts one trace of a compiled function (see [`compile_traces`]).
pub(crate) fn count_trace() {
    TRACES.with(|t| t.set(t.get() + 1));
}

/// `h + y`; in float16 summed in f32 and clipped to the f16 range, as Gemma's
/// reference does (bf16 and f32 have the range).
fn residual_add(h: &Array, y: &Array) -> Result<Array> {
    if h.dtype() != Dtype::Float16 {
        return Ok(ops::add(h, y)?);
    }
    let s = ops::add(&h.as_dtype(Dtype::Float32)?, &y.as_dtype(Dtype::Float32)?)?;
    let bound = 65504.0f32;
    let s = ops::clip(&s, (Array::from_f32(-bound), Array::from_f32(bound)))?;
    Ok(s.as_dtype(Dtype::Float16)?)
}

/// `gelu_tanh(g) * u`, gelu with MLX's tanh approximation `0.5 x (1 +
/// tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, constants in the activation's
/// dtype.
fn gelu_tanh_mul(g: &Array, u: &Array) -> Result<Array> {
    let dt = g.dtype();
    let k = |v: f32| Array::from_f32(v).as_dtype(dt);
    let cube = ops::power(g, &k(3.0)?)?;
    let inner = ops::add(g, &ops::multiply(&k(0.044715)?, &cube)?)?;
    let t = ops::tanh(&ops::multiply(
        &k((2.0 / std::f32::consts::PI).sqrt())?,
        &inner,
    )?)?;
    let half_x = ops::multiply(&k(0.5)?, g)?;
    let gelu = ops::multiply(&half_x, &ops::add(&k(1.0)?, &t)?)?;
    Ok(ops::multiply(&gelu, u)?)
}

/// `silu(g) * u` as one compiled (shapeless) MLX function: one fused
/// elementwise kernel per layer on the GPU instead of three.
fn fused_silu_mul(g: &Array, u: &Array) -> Result<Array> {
    type Fused =
        Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;
    fn stock((g, u): (&Array, &Array)) -> std::result::Result<Array, Exception> {
        count_trace();
        ops::multiply(ops::multiply(g, ops::sigmoid(g)?)?, u)
    }
    thread_local! {
        static FUSED: std::cell::RefCell<Fused> =
            std::cell::RefCell::new(Box::new(compile(stock, true)));
    }
    Ok(FUSED.with(|f| (f.borrow_mut())((g, u)))?)
}

pub struct LlamaModel {
    pub config: ModelConfig,
    pub policy: WeightPolicy,
    embed: Linear,
    layers: Vec<Layer>,
    norm: Array,
    lm_head: Option<Linear>,
    rope: Rope,
    /// RoPE of the sliding-window layers, where its base differs.
    rope_local: Option<Rope>,
    /// The sliding-window layers, for the KV layout.
    sliding: Option<kv::SlidingLayers>,
    /// The recurrent layers, for the KV layout's state slots.
    recurrent: Option<kv::RecurrentLayers>,
    /// Layers with neither K/V nor state (Nemotron-H's MLP blocks), as
    /// `KvShape::stateless`.
    stateless: u128,
    /// `[1]` f32 RMSNorm epsilon for the fused kernels.
    eps: Array,
    /// Whether one-token steps may run the fused decode kernels.
    fusable: bool,
}

impl LlamaModel {
    pub fn from_weights(config: ModelConfig, mut w: Weights, policy: WeightPolicy) -> Result<Self> {
        let q = |path: &str| {
            config
                .quantization
                .as_ref()
                .and_then(|qz| qz.for_module(path))
        };
        let dt = policy.dtype;
        let mut offset = config.norm_offset;
        if config.arch == Arch::Qwen3_5 {
            // mlx-lm's layout (`language_model.model.*`) or Hugging Face's
            // (`model.language_model.*`, `lm_head`), without the vision tower.
            w.rename(|n| {
                if n.starts_with("model.visual")
                    || n.starts_with("vision_tower")
                    || n.starts_with("mtp.")
                {
                    None
                } else if let Some(rest) = n.strip_prefix("language_model.") {
                    Some(rest.to_string())
                } else if let Some(rest) = n.strip_prefix("model.language_model.") {
                    Some(format!("model.{rest}"))
                } else {
                    Some(n.to_string())
                }
            });
            // A Hugging Face checkpoint keeps its convolutions `[C, 1, K]` and
            // its norms (other than the gated one) as `w` of `1 + w`; mlx-lm
            // converts both at load.
            if w.convert_conv1d()? {
                offset = 1.0;
            }
        }
        if config.arch == Arch::NemotronH {
            // mlx-lm's names (`backbone.*`) mapped onto the shared ones.
            w.rename(|n| {
                if n.starts_with("mtp.") {
                    return None;
                }
                Some(if let Some(rest) = n.strip_prefix("backbone.embeddings") {
                    format!("model.embed_tokens{rest}")
                } else if let Some(rest) = n.strip_prefix("backbone.norm_f") {
                    format!("model.norm{rest}")
                } else if let Some(rest) = n.strip_prefix("backbone.") {
                    format!("model.{rest}")
                } else {
                    n.to_string()
                })
            });
            w.convert_conv1d()?;
        }
        // Gemma's `(1 + w)` is added once here, in the model dtype as the
        // reference computes it each call.
        let norm = |w: &mut Weights, name: &str| -> Result<Array> {
            let x = w.take(name)?.as_dtype(dt)?;
            if offset == 0.0 {
                return Ok(x);
            }
            Ok(ops::add(&x, &Array::from_f32(offset).as_dtype(dt)?)?)
        };
        let embed = Linear::load(
            &mut w,
            "model.embed_tokens",
            q("model.embed_tokens"),
            policy,
        )?;
        let mut layers = Vec::with_capacity(config.num_layers as usize);
        for i in 0..config.num_layers {
            let p = format!("model.layers.{i}");
            let lin = |w: &mut Weights, name: &str| {
                let path = format!("{p}.{name}");
                Linear::load(w, &path, q(&path), policy)
            };
            let recurrent = config
                .recurrent_layers
                .get(i as usize)
                .copied()
                .unwrap_or(false);
            if config.single_mixer {
                let mlp_block = config.mlp_layers.get(i as usize).copied().unwrap_or(false);
                let mixer = match (recurrent, mlp_block, config.mamba) {
                    (true, _, Some(shape)) => Mixer::Mamba(Mamba2::load(
                        &mut w,
                        &format!("{p}.mixer"),
                        shape,
                        config.rms_norm_eps,
                        config.mamba_dt_limit,
                        policy,
                        |path| q(path),
                    )?),
                    (true, _, None) => {
                        return Err(ModelError::Invalid(format!(
                            "layer {i} is a Mamba-2 block but the config has no Mamba-2 shape"
                        )))
                    }
                    (false, true, _) => Mixer::Mlp {
                        up: lin(&mut w, "mixer.up_proj")?,
                        down: lin(&mut w, "mixer.down_proj")?,
                    },
                    (false, false, _) => Mixer::Attention(Attention {
                        qkv: Proj::new(vec![
                            lin(&mut w, "mixer.q_proj")?,
                            lin(&mut w, "mixer.k_proj")?,
                            lin(&mut w, "mixer.v_proj")?,
                        ])?,
                        o: lin(&mut w, "mixer.o_proj")?,
                        q_norm: None,
                        k_norm: None,
                    }),
                };
                layers.push(Layer {
                    mixer,
                    mlp: None,
                    input_norm: norm(&mut w, &format!("{p}.norm.weight"))?,
                    attn_out_norm: None,
                    mlp_out_norm: None,
                    sliding: false,
                });
                continue;
            }
            let (q_norm, k_norm) = if recurrent {
                (None, None)
            } else if matches!(config.arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3_5) {
                (
                    Some(norm(&mut w, &format!("{p}.self_attn.q_norm.weight"))?),
                    Some(norm(&mut w, &format!("{p}.self_attn.k_norm.weight"))?),
                )
            } else {
                (None, None)
            };
            let mixer = match (recurrent, config.delta) {
                (true, Some(shape)) => Mixer::Delta(GatedDeltaNet::load(
                    &mut w,
                    &format!("{p}.linear_attn"),
                    shape,
                    config.rms_norm_eps,
                    policy,
                    |path| q(path),
                )?),
                (true, None) => {
                    return Err(ModelError::Invalid(format!(
                        "layer {i} is recurrent but the config has no state shape"
                    )))
                }
                (false, _) => Mixer::Attention(Attention {
                    qkv: Proj::new(vec![
                        lin(&mut w, "self_attn.q_proj")?,
                        lin(&mut w, "self_attn.k_proj")?,
                        lin(&mut w, "self_attn.v_proj")?,
                    ])?,
                    o: lin(&mut w, "self_attn.o_proj")?,
                    q_norm,
                    k_norm,
                }),
            };
            let mlp = Mlp {
                gate_up: Proj::new(vec![
                    lin(&mut w, "mlp.gate_proj")?,
                    lin(&mut w, "mlp.up_proj")?,
                ])?,
                down: lin(&mut w, "mlp.down_proj")?,
            };
            let post_norm = if config.sandwich_norms {
                norm(&mut w, &format!("{p}.pre_feedforward_layernorm.weight"))?
            } else {
                norm(&mut w, &format!("{p}.post_attention_layernorm.weight"))?
            };
            layers.push(Layer {
                mixer,
                mlp: Some((mlp, post_norm)),
                input_norm: norm(&mut w, &format!("{p}.input_layernorm.weight"))?,
                attn_out_norm: config
                    .sandwich_norms
                    .then(|| norm(&mut w, &format!("{p}.post_attention_layernorm.weight")))
                    .transpose()?,
                mlp_out_norm: config
                    .sandwich_norms
                    .then(|| norm(&mut w, &format!("{p}.post_feedforward_layernorm.weight")))
                    .transpose()?,
                sliding: config
                    .sliding_layers
                    .get(i as usize)
                    .copied()
                    .unwrap_or(false),
            });
        }
        let final_norm = norm(&mut w, "model.norm.weight")?;
        let lm_head = if config.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(Linear::load(&mut w, "lm_head", q("lm_head"), policy)?)
        };
        let rope = Rope::from_config(&config)?;
        // Local layers: plain RoPE at their own base (no scaling).
        let rope_local = match config.rope_local_theta {
            Some(base) if config.sliding_layers.iter().any(|&s| s) => {
                let mut local = config.clone();
                local.rope_theta = base;
                local.rope_scaling = None;
                Some(Rope::from_config(&local)?)
            }
            _ => None,
        };
        // Rotary tables some checkpoints carry are recomputed, not read.
        let leftover: Vec<_> = w
            .remaining()
            .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
            .cloned()
            .collect();
        if !leftover.is_empty() {
            tracing::warn!(count = leftover.len(), first = %leftover[0], "unused tensors in model directory");
        }
        let why = unfusable(&layers, &config, policy);
        if let Some(why) = why {
            tracing::debug!(why, "fused decode kernels off for this model");
        }
        let sliding = match config.sliding_window {
            Some(w) => kv::SlidingLayers::from_flags(w as u32, &config.sliding_layers)?,
            None => None,
        };
        let mut model = Self {
            stateless: kv::layer_bits(&config.mlp_layers, "block")?,
            recurrent: kv::RecurrentLayers::from_flags(
                config.recurrent_state(),
                &config.recurrent_layers,
            )?,
            sliding,
            eps: Array::from_slice(&[config.rms_norm_eps], &[1]),
            fusable: why.is_none(),
            config,
            policy,
            embed,
            layers,
            norm: final_norm,
            lm_head,
            rope,
            rope_local,
        };
        model.materialize()?;
        if model.policy.host_gemm {
            model.pack_linears()?;
        }
        Ok(model)
    }

    /// Moves the dense f32 linears onto the CPU GEMM. A tied embedding stays
    /// an MLX array for lookups and gets a packed copy as the output head.
    fn pack_linears(&mut self) -> Result<()> {
        for l in &mut self.layers {
            // A recurrent layer's projections stay MLX's (its recurrence is
            // MLX ops between them either way).
            match &mut l.mixer {
                Mixer::Attention(attn) => {
                    attn.qkv.pack()?;
                    pack_in_place(&mut attn.o)?;
                }
                Mixer::Mlp { up, down } => {
                    pack_in_place(up)?;
                    pack_in_place(down)?;
                }
                Mixer::Delta(_) | Mixer::Mamba(_) => {}
            }
            if let Some((mlp, _)) = &mut l.mlp {
                mlp.gate_up.pack()?;
                pack_in_place(&mut mlp.down)?;
            }
        }
        match &mut self.lm_head {
            Some(head) => pack_in_place(head)?,
            None => self.lm_head = self.embed.to_host()?,
        }
        Ok(())
    }

    /// Evaluates every weight so load-time conversions (dtype, dequantize)
    /// happen once, not inside the first step.
    fn materialize(&self) -> Result<()> {
        fn lin(l: &Linear) -> Vec<&Array> {
            match l {
                Linear::Dense { weight, wt, bias } => {
                    [weight, wt].into_iter().chain(bias).collect()
                }
                Linear::Quantized {
                    weight,
                    scales,
                    biases,
                    bias,
                    ..
                } => [weight, scales, biases].into_iter().chain(bias).collect(),
                Linear::Host { bias, .. } => bias.iter().collect(),
            }
        }
        let mut all: Vec<&Array> = vec![&self.norm];
        all.extend(lin(&self.embed));
        if let Some(h) = &self.lm_head {
            all.extend(lin(h));
        }
        for l in &self.layers {
            let mut lins = Vec::new();
            if let Some((mlp, post_norm)) = &l.mlp {
                lins.extend(mlp.gate_up.linears());
                lins.push(&mlp.down);
                all.push(post_norm);
            }
            match &l.mixer {
                Mixer::Attention(attn) => {
                    lins.extend(attn.qkv.linears());
                    lins.push(&attn.o);
                    all.extend(attn.q_norm.iter().chain(attn.k_norm.iter()));
                }
                Mixer::Delta(d) => {
                    lins.extend(d.linears());
                    all.extend(d.arrays());
                }
                Mixer::Mamba(m) => {
                    lins.extend(m.linears());
                    all.extend(m.arrays());
                }
                Mixer::Mlp { up, down } => lins.extend([up, down]),
            }
            for x in lins {
                all.extend(lin(x));
            }
            all.push(&l.input_norm);
            all.extend(l.attn_out_norm.iter().chain(l.mlp_out_norm.iter()));
        }
        mlx_rs::transforms::eval(all)?;
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The shape of this model's KV cache.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.layers.len(),
            kv_heads: self.config.num_kv_heads as u32,
            head_dim: self.config.head_dim as u32,
            dtype: self.policy.dtype,
            sliding: self.sliding,
            quant: None,
            recurrent: self.recurrent,
            stateless: self.stateless,
        }
    }

    /// Forward `tokens` `[B, T]` (int32, rows right-padded) for the rows of
    /// `kv`, writing their K/V into the pool slots their tables name.
    /// Returns logits `[B, T', V]`: T' is 1 when `last_only` (each row's last
    /// real token), else T.
    pub fn forward(&self, tokens: &Array, kv: &mut KvStep<'_>, last_only: bool) -> Result<Array> {
        self.forward_with_hook(tokens, kv, last_only, &mut |_| Ok(()))
    }

    /// As `forward`, calling `after_layer(i)` after building layer i's graph
    /// (fault injection and tracing use it).
    pub fn forward_with_hook(
        &self,
        tokens: &Array,
        kv: &mut KvStep<'_>,
        last_only: bool,
        after_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Array> {
        block_on(self.forward_async(tokens, kv, last_only, None, after_layer))
    }

    /// As `forward`, each row adding its adapter's low-rank deltas (`lora`
    /// covers the forward's rows; None: no row has an adapter).
    pub fn forward_lora(
        &self,
        tokens: &Array,
        kv: &mut KvStep<'_>,
        last_only: bool,
        lora: Option<&LoraStep>,
    ) -> Result<Array> {
        let mut no_hook = |_: usize| Ok(());
        block_on(self.forward_async(tokens, kv, last_only, lora, &mut no_hook))
    }

    /// Runs independent forwards (`(lane, tokens, kv, last_only, adapters)`) in
    /// lockstep, each built on its lane's stream. With packed linears a
    /// forward stops at each GEMM; while one forward's GEMM runs on the CPU
    /// pool, MLX evaluates the others' norms, RoPE and attention on their
    /// streams, so both kinds of work overlap instead of taking turns.
    pub fn forward_interleaved(
        &self,
        jobs: Vec<(usize, &Array, &mut KvStep<'_>, bool, Option<&LoraStep>)>,
        lanes: &crate::Lanes,
        after_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Vec<Array>> {
        let hook = std::cell::RefCell::new(after_layer);
        let mut hooks: Vec<_> = jobs
            .iter()
            .map(|_| |i: usize| (hook.borrow_mut())(i))
            .collect();
        let mut lane_of = Vec::with_capacity(jobs.len());
        let mut futs = Vec::with_capacity(jobs.len());
        for ((lane, tokens, kv, last_only, lora), h) in jobs.into_iter().zip(hooks.iter_mut()) {
            lane_of.push(lane);
            futs.push(Box::pin(self.forward_async(tokens, kv, last_only, lora, h)));
        }
        let mut out: Vec<Option<Array>> = futs.iter().map(|_| None).collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        loop {
            let mut pending = false;
            for (i, fut) in futs.iter_mut().enumerate() {
                if out[i].is_some() {
                    continue;
                }
                match lanes.on(lane_of[i], || fut.as_mut().poll(&mut cx)) {
                    std::task::Poll::Ready(r) => out[i] = Some(r?),
                    std::task::Poll::Pending => pending = true,
                }
            }
            if !pending {
                break;
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// The forward over any [`LayerKv`]: a compiled step traces it over its
    /// array inputs. The linears must be MLX's (no packed host GEMM).
    pub fn forward_kv(
        &self,
        tokens: &Array,
        kv: &mut dyn LayerKv,
        last_only: bool,
        lora: Option<&LoraStep>,
    ) -> Result<Array> {
        let mut no_hook = |_: usize| Ok(());
        block_on(self.forward_async(tokens, kv, last_only, lora, &mut no_hook))
    }

    async fn forward_async<K: LayerKv + ?Sized>(
        &self,
        tokens: &Array,
        kv: &mut K,
        last_only: bool,
        lora: Option<&LoraStep>,
        after_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Array> {
        let shape = tokens.shape();
        if shape.len() != 2 || shape[0] as usize != kv.batch() || shape[1] != kv.step_tokens() {
            return Err(ModelError::Invalid(format!(
                "tokens shape {shape:?} does not match a step of {} rows x {} tokens",
                kv.batch(),
                kv.step_tokens()
            )));
        }
        // The hidden state stays `[B * T, hidden]`: 2-D matmuls need no
        // flatten / unflatten around them in every layer.
        let (b, t) = (shape[0], shape[1]);
        if let Some(l) = lora {
            if l.rows() != b as usize {
                return Err(ModelError::Invalid(format!(
                    "adapter slots for {} rows in a forward of {b}",
                    l.rows()
                )));
            }
        }
        let deltas = |i: usize, g: Group, x: &Array| match lora {
            Some(l) => l.deltas(i, g, x),
            None => Ok(None),
        };
        if t == 1 && self.fusable {
            if let Some(k) = kv.fused() {
                return self.forward_fused(tokens, kv, &k, lora, after_layer).await;
            }
        }
        let mut h = self
            .embed
            .embed(&tokens.reshape(&[b * t])?, self.policy.dtype)?;
        if let Some(s) = self.config.embed_scale {
            h = ops::multiply(&h, &Array::from_f32(s).as_dtype(h.dtype())?)?;
        }
        let offsets = kv.offsets().clone();
        let eps = self.config.rms_norm_eps;
        let out_norm = |y: Array, n: &Option<Array>| -> Result<Array> {
            match n {
                Some(w) => Ok(fast::rms_norm(&y, Some(w), eps)?),
                None => Ok(y),
            }
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, Some(&layer.input_norm), eps)?;
            let a = match &layer.mixer {
                Mixer::Attention(attn) => {
                    self.attention(i, layer, attn, &x, kv, &offsets, lora)
                        .await?
                }
                Mixer::Delta(d) => {
                    let state = kv.state(i)?;
                    let last = kv.last_index().cloned();
                    let (y, new) = d.forward(&x.reshape(&[b, t, -1])?, &state, last.as_ref())?;
                    kv.set_state(i, new)?;
                    y.reshape(&[b * t, -1])?
                }
                Mixer::Mamba(m) => {
                    let state = kv.state(i)?;
                    let last = kv.last_index().cloned();
                    let (y, new) = m.forward(&x.reshape(&[b, t, -1])?, &state, last.as_ref())?;
                    kv.set_state(i, new)?;
                    y.reshape(&[b * t, -1])?
                }
                Mixer::Mlp { up, down } => {
                    let u = up.forward_async(&x).await?;
                    let r = ops::maximum(&u, &Array::from_f32(0.0).as_dtype(u.dtype())?)?;
                    down.forward_async(&ops::multiply(&r, &r)?).await?
                }
            };
            h = residual_add(&h, &out_norm(a, &layer.attn_out_norm)?)?;
            let Some((m, post_norm)) = &layer.mlp else {
                after_layer(i)?;
                continue;
            };
            let x = fast::rms_norm(&h, Some(post_norm), eps)?;
            let gu = m.gate_up.forward(&x, deltas(i, Group::GateUp, &x)?).await?;
            let (g, u) = (&gu[0], &gu[1]);
            let act = match (self.config.activation, self.policy.kernels) {
                (Activation::GeluTanh, _) => gelu_tanh_mul(g, u)?,
                (Activation::Silu, Kernels::Stock) => fused_silu_mul(g, u)?,
                (Activation::Silu, Kernels::CpuTuned) => cpu_kernels::silu_mul(g, u)?,
                (Activation::Relu2, _) => {
                    return Err(ModelError::Invalid(
                        "ReLU² is the activation of ungated MLP blocks only".into(),
                    ))
                }
            };
            let down = with_delta(
                m.down.forward_async(&act).await?,
                deltas(i, Group::Down, &act)?,
            )?;
            h = residual_add(&h, &out_norm(down, &layer.mlp_out_norm)?)?;
            after_layer(i)?;
        }
        let mut rows_t = t;
        if last_only && t > 1 {
            let last = kv::last_positions(&h.reshape(&[b, t, -1])?, kv.last_index())?;
            rows_t = last.dim(1);
            h = last.reshape(&[b * rows_t, -1])?;
        }
        let mut b = b;
        if let (Some(keep), 1) = (kv.logit_rows(), rows_t) {
            h = h.take_axis(keep, 0)?;
            b = keep.dim(0);
        }
        let h = fast::rms_norm(&h, Some(&self.norm), self.config.rms_norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward_async(&h).await?,
            None => self.embed.forward(&h)?,
        };
        let logits = match self.config.final_logit_softcapping {
            Some(cap) => {
                let c = Array::from_f32(cap).as_dtype(logits.dtype())?;
                ops::multiply(&ops::tanh(&ops::divide(&logits, &c)?)?, &c)?
            }
            None => logits,
        };
        Ok(logits.reshape(&[b, rows_t, -1])?)
    }

    /// The one-token forward over the fused decode kernels
    /// ([`crate::decode_kernels`]): ~12 primitives per layer instead of ~28.
    /// The residual add of each half-layer and the next norm are one kernel,
    /// so each layer ends with the next one's normed input.
    async fn forward_fused<K: LayerKv + ?Sized>(
        &self,
        tokens: &Array,
        kv: &mut K,
        k: &DecodeKernels,
        lora: Option<&LoraStep>,
        after_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Array> {
        let c = &self.config;
        let qd = c.num_heads * c.head_dim;
        let kvd = c.num_kv_heads * c.head_dim;
        // Adapters of a fused projection's output `y`: a pool stacked
        // densely hands the shrink (one matmul) to the kernel that reads `y`,
        // which adds the expand as it reads; a gathered one adds its delta
        // through `gather_mm`s and an add here.
        // `z`: the shrink of `x` already computed by the add-norm kernel
        // that made `x` (`crate::lora::fused_shrink`), else one matmul here.
        let adapt = |y: Array,
                     i: usize,
                     g: Group,
                     x: &Array,
                     outs: &[i32],
                     z: Option<Array>|
         -> Result<(Array, Option<LoraIn>)> {
            let Some(l) = lora else {
                return Ok((y, None));
            };
            if let Some(d) = l.dense(i, g) {
                let cast = |a: &Array| -> Result<Array> {
                    Ok(if a.dtype() == y.dtype() {
                        a.clone()
                    } else {
                        a.as_dtype(y.dtype())?
                    })
                };
                let z = match z {
                    Some(z) if z.dtype() == y.dtype() => z,
                    _ => ops::matmul(&cast(x)?, &cast(d.a)?)?,
                };
                let b = d.b.iter().map(cast).collect::<Result<Vec<_>>>()?;
                let cols: Vec<(i32, i32)> = d
                    .parts
                    .iter()
                    .map(|&j| (outs[..j].iter().sum(), outs[j]))
                    .collect();
                let slots = l.slots().clone();
                return Ok((y, Some(LoraIn { z, slots, b, cols })));
            }
            match l.fused_delta(i, g, x, outs)? {
                Some(d) => Ok((ops::add(&y, &d.as_dtype(y.dtype())?)?, None)),
                None => Ok((y, None)),
            }
        };
        let b = tokens.dim(0);
        let heads = QkvHeads {
            q: c.num_heads,
            kv: c.num_kv_heads,
            dim: c.head_dim,
        };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut h = self
            .embed
            .embed(&tokens.reshape(&[b])?, self.policy.dtype)?;
        let quantized = matches!(
            self.layers
                .first()
                .map(|l| l.mlp.as_ref().map(|(m, _)| &m.down)),
            Some(Some(Linear::Quantized { .. }))
        );
        // The GEMV path has no adapter deltas: steps with adapters (or a
        // compiled step traced with the adapter pool's inputs) take the
        // fused layer below.
        if lora.is_none() && k.gemv_rows(b, quantized) {
            return self.forward_gemv(h, kv, k, heads, scale, after_layer);
        }
        let first = self
            .layers
            .first()
            .ok_or_else(|| ModelError::Invalid("model has no layers".into()))?;
        let mut x = fast::rms_norm(&h, Some(&first.input_norm), c.rms_norm_eps)?;
        let mut xz: Option<Array> = None;
        // Layer `i`'s group `g` where a shrink kernel can take it: the pool
        // stacks it densely and the kernel's loads split its rank in the
        // dtype `dt` (else the matmul shrinks). The step, the group and its
        // first part's expand stack.
        let kernel_group = |i: usize, g: Group, dt: mlx_rs::Dtype| {
            let l = lora?;
            let d = l.dense(i, g)?;
            let b0 = d.b.first()?;
            ShrinkIn::vector(b0.dim(1), dt).map(|_| (l, d, b0))
        };
        // The shrink of layer `i`'s group `g`, for the add-norm kernel that
        // makes its input, in the dtype `dt` of the residual stream.
        let fused_shrink = lora.is_some() && crate::lora::fused_shrink();
        let shrink_for = |i: usize, g: Group, dt: mlx_rs::Dtype| -> Result<Option<ShrinkIn>> {
            let Some((l, d, b0)) = kernel_group(i, g, dt).filter(|_| fused_shrink) else {
                return Ok(None);
            };
            let a = if d.a.dtype() == dt {
                d.a.clone()
            } else {
                d.a.as_dtype(dt)?
            };
            Ok(Some(ShrinkIn {
                a,
                slots: l.slots().clone(),
                parts: d.parts.len() as i32,
                slots_n: b0.dim(0),
                rank: b0.dim(1),
            }))
        };
        // The output projection's adapters for the add-norm kernel that
        // reads it (`crate::lora::o_prologue`), where every array is in the
        // residual stream's dtype `dt`.
        let o_prologue = fused_shrink && crate::lora::o_prologue();
        let pro_for = |i: usize, x: &Array, dt: mlx_rs::Dtype| -> Option<ProShrink> {
            let (l, d, b0) = kernel_group(i, Group::O, dt).filter(|_| o_prologue)?;
            (d.parts == [0] && [x.dtype(), d.a.dtype(), b0.dtype()] == [dt, dt, dt]).then(|| {
                ProShrink {
                    x: x.clone(),
                    a: d.a.clone(),
                    b: b0.clone(),
                    slots: l.slots().clone(),
                }
            })
        };
        let add_norm =
            |h: &Array, (a, l): (Array, Option<LoraIn>), w: &Array, next: Option<ShrinkIn>| {
                let (a, l) = if a.dtype() == h.dtype() {
                    (a, l)
                } else {
                    let l = l.map(|l| l.cast(h.dtype())).transpose()?;
                    (a.as_dtype(h.dtype())?, l)
                };
                k.add_rms_norm(h, &a, w, &self.eps, l.as_ref(), next.as_ref())
            };
        for (i, layer) in self.layers.iter().enumerate() {
            let attn = layer.mixer.attn(i)?;
            let (mlp, post_norm) = layer.mlp.as_ref().ok_or_else(|| {
                ModelError::Invalid(format!("layer {i}: fused decode needs an MLP"))
            })?;
            let (Proj::Fused { lin: qkv, .. }, Proj::Fused { lin: gate_up, .. }) =
                (&attn.qkv, &mlp.gate_up)
            else {
                return Err(ModelError::Invalid(format!(
                    "layer {i}: fused decode needs fused projections"
                )));
            };
            let (y, l) = adapt(
                k.linear(qkv, &x)?,
                i,
                Group::Qkv,
                &x,
                &[qd, kvd, kvd],
                xz.take(),
            )?;
            let (q, kr, vr) = k.rope_qkv(
                &y,
                l.as_ref(),
                kv.offsets(),
                &self.rope.inv_freq,
                &self.rope.scale_arr,
                heads,
            )?;
            let a = kv.attend_rows(i, &q, &kr, &vr, scale)?;
            let gu_shrink = shrink_for(i, Group::GateUp, h.dtype())?;
            let (s, n, nz) = match pro_for(i, &a, h.dtype()) {
                // The output projection's shrink and expand inside the
                // add-norm kernel that reads it.
                Some(pro) => {
                    let y = k.linear(&attn.o, &a)?;
                    k.add_rms_norm_pro(&h, &y, post_norm, &self.eps, &pro, gu_shrink.as_ref())?
                }
                None => {
                    let a = adapt(
                        k.linear(&attn.o, &a)?,
                        i,
                        Group::O,
                        &a,
                        &[c.hidden_size],
                        None,
                    )?;
                    add_norm(&h, a, post_norm, gu_shrink)?
                }
            };
            let inter = c.intermediate_size;
            let (gu, l) = adapt(
                k.linear(gate_up, &n)?,
                i,
                Group::GateUp,
                &n,
                &[inter, inter],
                nz,
            )?;
            let down_shrink = shrink_for(i, Group::Down, gu.dtype())?;
            let (act, dz) = k.silu_mul(&gu, l.as_ref(), down_shrink.as_ref())?;
            let m = adapt(
                k.linear(&mlp.down, &act)?,
                i,
                Group::Down,
                &act,
                &[c.hidden_size],
                dz,
            )?;
            let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.input_norm);
            let next_shrink = if i + 1 < self.layers.len() {
                shrink_for(i + 1, Group::Qkv, s.dtype())?
            } else {
                None
            };
            (h, x, xz) = add_norm(&s, m, next, next_shrink)?;
            after_layer(i)?;
        }
        drop(h);
        let x = match kv.logit_rows() {
            Some(keep) => x.take_axis(keep, 0)?,
            None => x,
        };
        let logits = match &self.lm_head {
            Some(head) => k.linear(head, &x)?,
            None => k.linear(&self.embed, &x)?,
        };
        Ok(logits.reshape(&[x.dim(0), 1, -1])?)
    }

    /// The model's RMS norm of weight `w`, before a GEMV.
    fn pre_norm<'a>(&'a self, w: &'a Array) -> Pre<'a> {
        Pre::Norm {
            w,
            eps: &self.eps,
            eps_f: self.config.rms_norm_eps,
        }
    }

    /// [`Self::forward_fused`] for a step of few rows, every product one
    /// GEMV kernel ([`crate::gemv`]) with the norm before it and the residual
    /// add or SwiGLU after it fused in: 8 primitives per layer (QKV, RoPE,
    /// two scatters, two attention kernels, then output, gate/up and down).
    /// `h` is the embedded tokens `[B, hidden]`.
    fn forward_gemv<K: LayerKv + ?Sized>(
        &self,
        mut h: Array,
        kv: &mut K,
        k: &DecodeKernels,
        heads: QkvHeads,
        scale: f32,
        after_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Array> {
        for (i, layer) in self.layers.iter().enumerate() {
            let attn = layer.mixer.attn(i)?;
            let (mlp, post_norm) = layer.mlp.as_ref().ok_or_else(|| {
                ModelError::Invalid(format!("layer {i}: fused decode needs an MLP"))
            })?;
            let (Proj::Fused { lin: qkv, .. }, Proj::Fused { lin: gate_up, .. }) =
                (&attn.qkv, &mlp.gate_up)
            else {
                return Err(ModelError::Invalid(format!(
                    "layer {i}: fused decode needs fused projections"
                )));
            };
            let y = k.product(qkv, &h, self.pre_norm(&layer.input_norm), Post::None)?;
            let (q, kr, vr) = k.rope_qkv(
                &y,
                None,
                kv.offsets(),
                &self.rope.inv_freq,
                &self.rope.scale_arr,
                heads,
            )?;
            let a = kv.attend_rows(i, &q, &kr, &vr, scale)?;
            let h1 = k.product(&attn.o, &a, Pre::None, Post::Residual(&h))?;
            let act = k.product(gate_up, &h1, self.pre_norm(post_norm), Post::SiluPair)?;
            h = k.product(&mlp.down, &act, Pre::None, Post::Residual(&h1))?;
            after_layer(i)?;
        }
        let h = match kv.logit_rows() {
            Some(keep) => h.take_axis(keep, 0)?,
            None => h,
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = k.product(head, &h, self.pre_norm(&self.norm), Post::None)?;
        Ok(logits.reshape(&[h.dim(0), 1, -1])?)
    }

    #[allow(clippy::too_many_arguments)]
    async fn attention<K: LayerKv + ?Sized>(
        &self,
        layer: usize,
        l: &Layer,
        attn: &Attention,
        x: &Array,
        kv: &mut K,
        offsets: &Array,
        lora: Option<&LoraStep>,
    ) -> Result<Array> {
        let c = &self.config;
        let deltas = |g: Group, x: &Array| match lora {
            Some(lr) => lr.deltas(layer, g, x),
            None => Ok(None),
        };
        let (b, t) = (kv.batch() as i32, kv.step_tokens());
        let heads = |y: Array, norm: &Option<Array>| -> Result<Array> {
            let y = match norm {
                Some(w) => fast::rms_norm(&y, Some(w), c.rms_norm_eps)?,
                None => y,
            };
            Ok(y.transpose_axes(&[0, 2, 1, 3])?)
        };
        // A gated query projection holds, per head, the query then its gate.
        let q_heads = if c.attn_output_gate {
            2 * c.num_heads
        } else {
            c.num_heads
        };
        let mut qkv = attn
            .qkv
            .forward_heads(
                x,
                (b, t),
                &[q_heads, c.num_kv_heads, c.num_kv_heads],
                c.head_dim,
                deltas(Group::Qkv, x)?,
            )
            .await?
            .into_iter();
        let mut next = || {
            qkv.next()
                .ok_or_else(|| ModelError::Invalid("qkv split".into()))
        };
        let (q, gate) = if c.attn_output_gate {
            let qg = next()?.reshape(&[b, t, c.num_heads, 2, c.head_dim])?;
            let q = qg.try_index((.., .., .., 0))?;
            let gate = qg
                .try_index((.., .., .., 1))?
                .reshape(&[b * t, c.num_heads * c.head_dim])?;
            (q, Some(gate))
        } else {
            (next()?, None)
        };
        let q = heads(q, &attn.q_norm)?;
        let k = heads(next()?, &attn.k_norm)?;
        let v = heads(next()?, &None)?;
        let rope = match (&self.rope_local, l.sliding) {
            (Some(local), true) => local,
            _ => &self.rope,
        };
        // Nemotron-H's attention has no positional embedding.
        let (q, k) = if c.use_rope {
            (rope.apply(&q, offsets)?, rope.apply(&k, offsets)?)
        } else {
            (q, k)
        };
        let out = kv.attend(layer, &q, &k, &v, c.attn_scale)?;
        // `[B, heads, T, D]` -> `[B * T, heads * D]`; with one token per row
        // the memory order already matches (no transpose copy).
        let width = c.num_heads * c.head_dim;
        let out = if t == 1 {
            out.reshape(&[b, width])?
        } else {
            out.transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b * t, width])?
        };
        let out = match gate {
            Some(g) => ops::multiply(&out, &ops::sigmoid(&g)?)?,
            None => out,
        };
        let d = deltas(Group::O, &out)?;
        with_delta(attn.o.forward_async(&out).await?, d)
    }

    /// Dtype activations run in.
    pub fn dtype(&self) -> Dtype {
        self.policy.dtype
    }
}

impl Rope {
    fn from_config(c: &ModelConfig) -> Result<Self> {
        let dims = c.rotary_dim;
        let mut rope = Rope {
            dims,
            base: Some(c.rope_theta),
            scale: 1.0,
            freqs: None,
            inv_freq: Array::from_slice(&[0f32], &[1]),
            scale_arr: Array::from_slice(&[0f32], &[1]),
        };
        let mut freqs = None;
        if let Some(s) = &c.rope_scaling {
            freqs = rope.scaled(c, s)?;
        }
        rope.inv_freq = Array::from_slice(
            &decode_kernels::inv_freq(dims, rope.base, freqs.as_deref()),
            &[(dims / 2).max(1)],
        );
        rope.scale_arr = Array::from_slice(&[rope.scale], &[1]);
        Ok(rope)
    }

    /// Applies `rope_scaling`; returns llama3's explicit frequencies.
    fn scaled(
        &mut self,
        c: &ModelConfig,
        s: &crate::config::RopeScaling,
    ) -> Result<Option<Vec<f32>>> {
        let dims = self.dims;
        let rope = self;
        let kind = s.rope_type.as_deref().unwrap_or("default");
        match kind {
            "default" => {}
            "linear" => {
                let f = s
                    .factor
                    .ok_or_else(|| bad_scaling("linear scaling needs factor"))?;
                rope.scale = 1.0 / f;
            }
            "llama3" => {
                let factor = s
                    .factor
                    .ok_or_else(|| bad_scaling("llama3 scaling needs factor"))?;
                let low = s.low_freq_factor.unwrap_or(1.0);
                let high = s.high_freq_factor.unwrap_or(4.0);
                let old = s.original_max_position_embeddings.unwrap_or(8192.0);
                let (low_wl, high_wl) = (old / low, old / high);
                let freqs: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        let f = c.rope_theta.powf((2 * i) as f32 / dims as f32);
                        let wl = 2.0 * std::f32::consts::PI * f;
                        let f = if wl > low_wl { f * factor } else { f };
                        if wl > high_wl && wl < low_wl {
                            let smooth = (old / wl - low) / (high - low);
                            f / ((1.0 - smooth) / factor + smooth)
                        } else {
                            f
                        }
                    })
                    .collect();
                rope.freqs = Some(Array::from_slice(&freqs, &[dims / 2]));
                rope.base = None;
                return Ok(Some(freqs));
            }
            other => {
                return Err(bad_scaling(&format!(
                    "rope_scaling type {other:?} is not supported"
                )))
            }
        }
        Ok(None)
    }

    fn apply(&self, x: &Array, offsets: &Array) -> Result<Array> {
        let rope = |x: &Array, offsets: &Array| {
            fast::rope_dynamic(
                x,
                self.dims,
                false,
                self.base,
                self.scale,
                offsets,
                self.freqs.as_ref(),
            )
        };
        let s = x.shape();
        let rows = match s {
            [b, h, t, _] => mlx_cuda_rope_rows(self.dims, *t, *h).filter(|r| *b > *r),
            _ => None,
        };
        let Some(rows) = rows else {
            return Ok(rope(x, offsets)?);
        };
        // Rows at a time, each with its own offsets (or the one shared).
        let cuts: Vec<i32> = (rows..s[0]).step_by(rows as usize).collect();
        let xs = x.split_at_indices(&cuts, 0)?;
        let os = if offsets.ndim() == 1 {
            offsets.split_at_indices(&cuts, 0)?
        } else {
            vec![offsets.clone(); xs.len()]
        };
        let parts = xs
            .iter()
            .zip(&os)
            .map(|(x, o)| rope(x, o))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(ops::concatenate(&parts, 0)?)
    }
}

/// The most rows of `[rows, heads, t, head]` one `fast::rope` call may take
/// on MLX's CUDA backend, where fewer than all of them: its launch gives the
/// thread block up to 2^10 threads over `(dims / 2, t, rows * ceil(heads /
/// 4))`, a power of two per axis in turn, without the 64 that CUDA allows
/// along z, so a narrow rotation (head 16, one token a row) over 128 or more
/// of those z rows fails to launch ("invalid argument"). `None`: any count
/// launches (or no row count would).
fn mlx_cuda_rope_rows(dims: i32, t: i32, heads: i32) -> Option<i32> {
    // MLX's block shape: each axis in turn gains a power of two while its
    // size allows, up to 2^10 threads in all.
    let block_z = |d0: i32, d1: i32, d2: i32| {
        let (mut p, mut sum) = ([0u32; 3], 0);
        loop {
            let before = sum;
            for (i, d) in [d0, d1, d2].into_iter().enumerate() {
                if sum < 10 && i64::from(d) >= 1i64 << (p[i] + 1) {
                    p[i] += 1;
                    sum += 1;
                }
            }
            if sum == before || sum == 10 {
                return 1i64 << p[2];
            }
        }
    };
    let per_row = (heads + 3) / 4;
    // The z axis reaches 128 threads only from 128 z rows on.
    if block_z(dims / 2, t, 128) <= 64 || per_row >= 128 {
        return None;
    }
    Some(127 / per_row)
}

/// Drives a forward to completion on this thread (its awaits are the packed
/// host GEMM's, which make progress on their own pool).
fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

fn pack_in_place(l: &mut Linear) -> Result<()> {
    if let Some(packed) = l.to_host()? {
        *l = packed;
    }
    Ok(())
}

fn bad_scaling(msg: &str) -> ModelError {
    ModelError::Config {
        path: "config.json".into(),
        message: format!("rope_scaling: {msg}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_rotations_are_split_where_mlx_cuda_would_not_launch_them() {
        // Head 16, one token a row: the z axis takes 7 of the 10 powers of two.
        assert_eq!(mlx_cuda_rope_rows(16, 1, 4), Some(127));
        assert_eq!(mlx_cuda_rope_rows(16, 1, 8), Some(63));
        // Real heads leave z at most 2^5 (head 64) or 2^4 (head 128); a chunk's
        // tokens take their share too.
        assert_eq!(mlx_cuda_rope_rows(64, 1, 32), None);
        assert_eq!(mlx_cuda_rope_rows(128, 1, 32), None);
        assert_eq!(mlx_cuda_rope_rows(16, 32, 4), None);
    }

    #[test]
    fn a_split_rotation_equals_one_call() {
        // Heads of 16, as the test fixtures'.
        let c = ModelConfig::parse(
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5, "vocab_size": 256}"#,
        )
        .unwrap();
        let rope = Rope::from_config(&c).unwrap();
        let (b, h) = (300, 4);
        let x = mlx_rs::random::normal::<f32>(&[b, h, 1, 16], None, None, None).unwrap();
        let offsets = Array::from_slice(&(0..b).map(|i| i * 7 % 97).collect::<Vec<i32>>(), &[b]);
        let split = rope.apply(&x, &offsets).unwrap();
        let one = fast::rope_dynamic(&x, 16, false, rope.base, rope.scale, &offsets, None).unwrap();
        let diff = ops::subtract(&split, &one).unwrap();
        assert!(diff.as_slice::<f32>().iter().all(|d| *d == 0.0));
    }
}
