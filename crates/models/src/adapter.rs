//! LoRA adapters on disk: mlx-lm's (`adapters.safetensors` +
//! `adapter_config.json`) and PEFT's (`adapter_model.safetensors` +
//! `adapter_config.json`), read and validated against the base model.
//!
//! Both formats hold, per adapted projection, a low-rank pair whose product
//! is added to the projection's output: `y = W x + scale * B (A x)`.
//!
//! - **mlx-lm** (`mlx_lm/tuner/lora.py`, `tuner/utils.py::load_adapters`):
//!   `model.layers.N.<module>.lora_a` `[in, r]` and `.lora_b` `[r, out]`,
//!   applied as `y + scale * ((x @ lora_a) @ lora_b)`; the config's
//!   `lora_parameters.scale` is the multiplier itself (mlx-lm has no alpha),
//!   `num_layers` adapts the last N layers (0 or less: all), `keys`
//!   (optional, layer-relative module paths such as `self_attn.q_proj`)
//!   restricts the modules, `fine_tune_type` must be `lora`.
//! - **PEFT**: `base_model.model.model.layers.N.<module>.lora_A.weight`
//!   `[r, in]` and `.lora_B.weight` `[out, r]`; scale `lora_alpha / r`, or
//!   `lora_alpha / sqrt(r)` with `use_rslora`. Per-module rank or alpha
//!   patterns, DoRA, `fan_in_fan_out`, trained biases and
//!   `modules_to_save` change the model beyond a LoRA delta and are refused.
//!
//! Adapters are outside input: every name, rank and shape is checked, and an
//! error names the tensor (and the expected and found shapes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_rs::Array;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// Largest LoRA rank an adapter may have.
pub const MAX_RANK: usize = 64;

/// A projection of a decoder layer an adapter can adapt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module path inside a layer (`self_attn.q_proj`, ...).
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// The module's own name (`q_proj`, ...), what PEFT's `target_modules` lists.
    pub fn short(self) -> &'static str {
        let m = self.module();
        m.rsplit('.').next().unwrap_or(m)
    }

    fn from_module(path: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.module() == path)
    }

    /// `(in, out)` features of this projection in `c`'s layers.
    pub fn dims(self, c: &ModelConfig) -> (i32, i32) {
        let q = c.num_heads * c.head_dim;
        let kv = c.num_kv_heads * c.head_dim;
        match self {
            Target::Q => (c.hidden_size, q),
            Target::K | Target::V => (c.hidden_size, kv),
            Target::O => (q, c.hidden_size),
            Target::Gate | Target::Up => (c.hidden_size, c.intermediate_size),
            Target::Down => (c.intermediate_size, c.hidden_size),
        }
    }
}

/// Which file layout an adapter came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFormat {
    MlxLm,
    Peft,
}

/// One adapted projection: `delta = scale * (x @ a) @ b`.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `[in, rank]`.
    pub a: Array,
    /// `[rank, out]`, not scaled.
    pub b: Array,
}

/// A validated LoRA adapter for one base model.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub path: PathBuf,
    pub format: AdapterFormat,
    pub rank: usize,
    /// Multiplier of the low-rank product.
    pub scale: f32,
    /// Per layer of the base model, the projections this adapter adapts.
    pub layers: Vec<BTreeMap<Target, LoraPair>>,
}

impl Adapter {
    /// Reads the adapter in `dir` (mlx-lm's or PEFT's layout, told apart by
    /// the safetensors file present) and checks it against the base model
    /// `base`.
    pub fn load(dir: &Path, base: &ModelConfig) -> Result<Adapter> {
        AdapterFiles::read(dir)?.parse(base)
    }

    /// The projections adapted in any layer.
    pub fn targets(&self) -> std::collections::BTreeSet<Target> {
        self.layers.iter().flat_map(|l| l.keys().copied()).collect()
    }
}

/// An adapter's files read into host memory: what a server keeps of an
/// adapter that is not resident in the device pool (loaded again from these
/// bytes, not the disk, when a row needs it). Plain bytes, so any thread may
/// read them; [`parse`](Self::parse) makes the arrays.
#[derive(Debug, Clone)]
pub struct AdapterFiles {
    pub dir: PathBuf,
    pub format: AdapterFormat,
    config_path: PathBuf,
    config: Value,
    tensors_path: PathBuf,
    tensors: std::sync::Arc<[u8]>,
}

impl AdapterFiles {
    /// Reads `dir`'s `adapter_config.json` and its safetensors file
    /// (`adapters.safetensors`: mlx-lm, else `adapter_model.safetensors`:
    /// PEFT). Nothing is checked against a model yet.
    pub fn read(dir: &Path) -> Result<Self> {
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::Io {
            path: config_path.clone(),
            source: e,
        })?;
        let config: Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
        let mlx = dir.join("adapters.safetensors");
        let peft = dir.join("adapter_model.safetensors");
        let (format, tensors_path) = if mlx.exists() {
            (AdapterFormat::MlxLm, mlx)
        } else if peft.exists() {
            (AdapterFormat::Peft, peft)
        } else {
            return Err(ModelError::Weights(format!(
                "{}: neither adapters.safetensors (mlx-lm) nor adapter_model.safetensors (PEFT)",
                dir.display()
            )));
        };
        let tensors = std::fs::read(&tensors_path).map_err(|e| ModelError::Io {
            path: tensors_path.clone(),
            source: e,
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            format,
            config_path,
            config,
            tensors_path,
            tensors: tensors.into(),
        })
    }

    /// Host bytes held (the tensors file).
    pub fn bytes(&self) -> u64 {
        self.tensors.len() as u64
    }

    /// The adapter's arrays, checked against the base model `base` (an
    /// error names the tensor).
    pub fn parse(&self, base: &ModelConfig) -> Result<Adapter> {
        let common = match self.format {
            AdapterFormat::MlxLm => MlxSpec::parse(&self.config, &self.config_path, base)?.common,
            AdapterFormat::Peft => PeftSpec::parse(&self.config, &self.config_path)?.common,
        };
        let tensors = read_safetensors(&self.tensors_path, &self.tensors)?;
        build(&self.dir, self.format, &common, tensors, base)
    }
}

/// A random mlx-lm adapter to write ([`write_random_mlx_lm`]): for tests and
/// benchmarks, which need adapters of a given shape but no trained values.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomAdapter {
    pub rank: usize,
    /// The projections adapted, in every layer; their tensors are written in
    /// this order (a then b of each), layer by layer.
    pub targets: Vec<Target>,
    /// `lora_parameters.scale`, the multiplier of the low-rank product.
    pub scale: f32,
    /// Seeds the values: the same seed (and shape) writes the same files.
    pub seed: u64,
    /// Stores the tensors in bfloat16 instead of float32.
    pub bf16: bool,
}

/// Writes `spec` as an mlx-lm adapter for `base` into `dir` (created if
/// missing): `adapter_config.json` (`fine_tune_type` lora, `num_layers` all
/// of `base`'s, `lora_parameters` rank, scale, dropout 0 and the targets'
/// module paths as `keys`, what mlx-lm's `load_adapters` reads) and
/// `adapters.safetensors` with `lora_a` `[in, rank]` and `lora_b` `[rank,
/// out]` for every target in every layer.
///
/// Every value, of both halves, is uniform in [-0.5, 0.5) from a xorshift
/// sequence seeded by `seed`: unlike a trained adapter's (or mlx-lm's
/// initial, zero `lora_b`), the product is large enough that the adapter
/// changes what a model generates; `scale` sizes it.
pub fn write_random_mlx_lm(dir: &Path, base: &ModelConfig, spec: &RandomAdapter) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    if spec.rank == 0 || spec.rank > MAX_RANK {
        return Err(ModelError::Invalid(format!(
            "random adapter rank {}: ranks 1..={MAX_RANK} are served",
            spec.rank
        )));
    }
    if spec.targets.is_empty() {
        return Err(ModelError::Invalid("random adapter with no targets".into()));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config = serde_json::json!({
        "fine_tune_type": "lora",
        "num_layers": base.num_layers,
        "lora_parameters": {
            "rank": spec.rank,
            // As written (0.05, not 0.05000000074505806): f32's shortest form.
            "scale": spec.scale.to_string().parse::<f64>().unwrap_or(f64::from(spec.scale)),
            "dropout": 0.0,
            "keys": spec.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
        }
    });
    let config_path = dir.join("adapter_config.json");
    std::fs::write(&config_path, config.to_string()).map_err(io(&config_path))?;
    let mut state = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32
    };
    let dtype = if spec.bf16 {
        safetensors::Dtype::BF16
    } else {
        safetensors::Dtype::F32
    };
    let r = spec.rank;
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..base.num_layers.max(0) as usize {
        for t in &spec.targets {
            let (i, o) = t.dims(base);
            let name = format!("model.layers.{l}.{}", t.module());
            for (suffix, shape) in [("lora_a", [i as usize, r]), ("lora_b", [r, o as usize])] {
                let n: usize = shape.iter().product();
                let bytes: Vec<u8> = if spec.bf16 {
                    (0..n)
                        .flat_map(|_| half::bf16::from_f32(next()).to_le_bytes())
                        .collect()
                } else {
                    (0..n).flat_map(|_| next().to_le_bytes()).collect()
                };
                data.push((format!("{name}.{suffix}"), shape.to_vec(), bytes));
            }
        }
    }
    let views = data
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::Weights(format!("{n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = dir.join("adapters.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))
}

/// What both formats' configs decide.
struct Common {
    rank: usize,
    scale: f32,
    /// Layers the adapter may touch (None: all).
    layers: Option<Vec<bool>>,
    /// Modules it may touch (None: all seven).
    targets: Option<Vec<Target>>,
}

struct MlxSpec {
    common: Common,
}

impl MlxSpec {
    fn parse(v: &Value, path: &Path, base: &ModelConfig) -> Result<Self> {
        let bad = |message: String| ModelError::Config {
            path: path.to_path_buf(),
            message,
        };
        let kind = v
            .get("fine_tune_type")
            .map(|t| t.as_str().unwrap_or("?"))
            .unwrap_or("lora");
        if kind != "lora" {
            return Err(bad(format!(
                "fine_tune_type {kind:?}: only \"lora\" adapters are served"
            )));
        }
        let p = v
            .get("lora_parameters")
            .ok_or_else(|| bad("lora_parameters missing".into()))?;
        let rank = rank_of(p.get("rank"), "lora_parameters.rank").map_err(bad)?;
        let scale = p
            .get("scale")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("lora_parameters.scale missing or not a number".into()))?
            as f32;
        if !scale.is_finite() {
            return Err(bad(format!("lora_parameters.scale {scale} is not finite")));
        }
        let n = base.num_layers.max(0) as usize;
        let layers = match v.get("num_layers") {
            None => None,
            Some(x) => {
                let k = x
                    .as_i64()
                    .ok_or_else(|| bad("num_layers is not an integer".into()))?;
                // mlx-lm adapts `layers[-max(k, 0):]`: the last k, or all for k <= 0.
                let k = if k <= 0 { n } else { (k as usize).min(n) };
                Some((0..n).map(|i| i >= n - k).collect())
            }
        };
        let targets = match p.get("keys") {
            None | Some(Value::Null) => None,
            Some(Value::Array(keys)) => {
                let mut out = Vec::new();
                for k in keys {
                    let s = k
                        .as_str()
                        .ok_or_else(|| bad("lora_parameters.keys: not a string".into()))?;
                    let t = Target::from_module(s).ok_or_else(|| {
                        bad(format!(
                            "lora_parameters.keys: {s:?} is not one of {:?}",
                            Target::ALL.map(Target::module)
                        ))
                    })?;
                    out.push(t);
                }
                Some(out)
            }
            Some(_) => return Err(bad("lora_parameters.keys is not a list".into())),
        };
        Ok(Self {
            common: Common {
                rank,
                scale,
                layers,
                targets,
            },
        })
    }
}

struct PeftSpec {
    common: Common,
}

impl PeftSpec {
    fn parse(v: &Value, path: &Path) -> Result<Self> {
        let bad = |message: String| ModelError::Config {
            path: path.to_path_buf(),
            message,
        };
        if let Some(t) = v.get("peft_type") {
            if t.as_str() != Some("LORA") {
                return Err(bad(format!("peft_type {t}: only LORA adapters are served")));
            }
        }
        let truthy = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        for k in ["use_dora", "fan_in_fan_out"] {
            if truthy(k) {
                return Err(bad(format!("{k}: true is not supported")));
            }
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if v.get(k)
                .and_then(Value::as_object)
                .is_some_and(|m| !m.is_empty())
            {
                return Err(bad(format!(
                    "{k}: per-module ranks or alphas are not supported"
                )));
            }
        }
        if let Some(b) = v.get("bias") {
            if b.as_str() != Some("none") {
                return Err(bad(format!(
                    "bias {b}: adapters that train biases are not supported"
                )));
            }
        }
        if v.get("modules_to_save")
            .and_then(Value::as_array)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(
                "modules_to_save: adapters carrying whole modules are not supported".into(),
            ));
        }
        let rank = rank_of(v.get("r"), "r").map_err(bad)?;
        let alpha = v
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("lora_alpha missing or not a number".into()))?;
        let scale = if truthy("use_rslora") {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        } as f32;
        if !scale.is_finite() {
            return Err(bad(format!("lora_alpha {alpha} gives scale {scale}")));
        }
        let targets = match v.get("target_modules") {
            // A string is a regular expression over module paths (or
            // "all-linear"); the tensors present decide then.
            None | Some(Value::Null) | Some(Value::String(_)) => None,
            Some(Value::Array(names)) => {
                let mut out = Vec::new();
                for n in names {
                    let s = n
                        .as_str()
                        .ok_or_else(|| bad("target_modules: not a string".into()))?;
                    // PEFT matches a module whose path is the name or ends in ".name".
                    out.extend(
                        Target::ALL
                            .into_iter()
                            .filter(|t| t.module() == s || t.module().ends_with(&format!(".{s}"))),
                    );
                }
                Some(out)
            }
            Some(_) => return Err(bad("target_modules is not a list or string".into())),
        };
        let layers = match v.get("layers_to_transform") {
            None | Some(Value::Null) => None,
            Some(x) => {
                let list: Vec<i64> = match x {
                    Value::Array(a) => a.iter().filter_map(Value::as_i64).collect(),
                    other => other.as_i64().into_iter().collect(),
                };
                if list.is_empty() || list.iter().any(|&i| i < 0) {
                    return Err(bad(format!("layers_to_transform {x} is not a layer list")));
                }
                // Layers past any model's are never adapted (and bound the list).
                let top = list.iter().copied().max().unwrap_or(0).min(1 << 16) as usize;
                let mut on = vec![false; top + 1];
                for i in list {
                    if let Some(x) = on.get_mut(i as usize) {
                        *x = true;
                    }
                }
                Some(on)
            }
        };
        Ok(Self {
            common: Common {
                rank,
                scale,
                layers,
                targets,
            },
        })
    }
}

fn rank_of(v: Option<&Value>, what: &str) -> std::result::Result<usize, String> {
    let r = v
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("{what} missing or not a positive integer"))?;
    if r == 0 || r as usize > MAX_RANK {
        return Err(format!("{what} {r}: ranks 1..={MAX_RANK} are served"));
    }
    Ok(r as usize)
}

/// Every tensor of one safetensors file (`bytes`, read from `path`).
fn read_safetensors(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Array>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let array = Array::try_from(view).map_err(|e| ModelError::Tensor {
            name: name.clone(),
            message: e.to_string(),
        })?;
        out.insert(name, array);
    }
    Ok(out)
}

/// Which half of a pair a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    A,
    B,
}

/// `(layer, module path, half)` of a tensor name in `format`, or None.
fn parse_name(format: AdapterFormat, name: &str) -> Option<(usize, &str, Half)> {
    let (prefix, a, b) = match format {
        AdapterFormat::MlxLm => ("model.layers.", ".lora_a", ".lora_b"),
        AdapterFormat::Peft => (
            "base_model.model.model.layers.",
            ".lora_A.weight",
            ".lora_B.weight",
        ),
    };
    let rest = name.strip_prefix(prefix)?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    if let Some(m) = rest.strip_suffix(a) {
        Some((layer, m, Half::A))
    } else {
        rest.strip_suffix(b).map(|m| (layer, m, Half::B))
    }
}

/// A tensor and its name in the file.
type Named = (String, Array);

fn build(
    dir: &Path,
    format: AdapterFormat,
    spec: &Common,
    tensors: BTreeMap<String, Array>,
    base: &ModelConfig,
) -> Result<Adapter> {
    let n = base.num_layers.max(0) as usize;
    let r = spec.rank as i32;
    let bad = |name: &str, message: String| ModelError::Tensor {
        name: name.to_string(),
        message,
    };
    // (layer, target) -> (a, b) with their tensor names.
    let mut halves: BTreeMap<(usize, Target), [Option<Named>; 2]> = BTreeMap::new();
    for (name, t) in tensors {
        let Some((layer, module, half)) = parse_name(format, &name) else {
            return Err(bad(
                &name,
                "is not a LoRA tensor of a decoder layer's projection (q/k/v/o/gate/up/down_proj)"
                    .into(),
            ));
        };
        let Some(target) = Target::from_module(module) else {
            return Err(bad(
                &name,
                format!(
                    "adapts module {module:?}, which the base model has no LoRA support for \
                     (one of {:?})",
                    Target::ALL.map(Target::module)
                ),
            ));
        };
        if layer >= n {
            return Err(bad(
                &name,
                format!("adapts layer {layer}, but the base model has {n} layers"),
            ));
        }
        if let Some(on) = &spec.layers {
            if !on.get(layer).copied().unwrap_or(false) {
                return Err(bad(
                    &name,
                    format!("adapts layer {layer}, outside the layers adapter_config.json names"),
                ));
            }
        }
        if let Some(ts) = &spec.targets {
            if !ts.contains(&target) {
                return Err(bad(
                    &name,
                    format!(
                        "adapts {}, which adapter_config.json does not list",
                        target.module()
                    ),
                ));
            }
        }
        let (i, o) = target.dims(base);
        let want: [i32; 2] = match (format, half) {
            (AdapterFormat::MlxLm, Half::A) => [i, r],
            (AdapterFormat::MlxLm, Half::B) => [r, o],
            (AdapterFormat::Peft, Half::A) => [r, i],
            (AdapterFormat::Peft, Half::B) => [o, r],
        };
        if t.shape() != want {
            return Err(bad(
                &name,
                format!(
                    "shape {:?}, expected {want:?} (rank {r}, {} is [{i} -> {o}] in the base model)",
                    t.shape(),
                    target.module()
                ),
            ));
        }
        if !matches!(
            t.dtype(),
            mlx_rs::Dtype::Float32 | mlx_rs::Dtype::Float16 | mlx_rs::Dtype::Bfloat16
        ) {
            return Err(bad(
                &name,
                format!("dtype {:?}, expected a float", t.dtype()),
            ));
        }
        let t = match format {
            AdapterFormat::MlxLm => t,
            // PEFT stores both as torch Linear weights `[out, in]`.
            AdapterFormat::Peft => t.t().contiguous()?,
        };
        let slot = &mut halves.entry((layer, target)).or_default()[half as usize];
        *slot = Some((name, t));
    }
    let mut layers: Vec<BTreeMap<Target, LoraPair>> = vec![BTreeMap::new(); n];
    for ((layer, target), [a, b]) in halves {
        let (suffix_a, suffix_b) = match format {
            AdapterFormat::MlxLm => ("lora_a", "lora_b"),
            AdapterFormat::Peft => ("lora_A.weight", "lora_B.weight"),
        };
        match (a, b) {
            (Some((_, a)), Some((_, b))) => {
                layers[layer].insert(target, LoraPair { a, b });
            }
            (Some((name, _)), None) => {
                return Err(bad(
                    &name,
                    format!("has no {suffix_b} partner: both halves of a pair are needed"),
                ))
            }
            (None, Some((name, _))) => {
                return Err(bad(
                    &name,
                    format!("has no {suffix_a} partner: both halves of a pair are needed"),
                ))
            }
            (None, None) => {}
        }
    }
    if layers.iter().all(|l| l.is_empty()) {
        return Err(ModelError::Weights(format!(
            "{}: the adapter holds no LoRA tensors",
            dir.display()
        )));
    }
    Ok(Adapter {
        path: dir.to_path_buf(),
        format,
        rank: spec.rank,
        scale: spec.scale,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small Llama: 2 layers, hidden 64, 4 / 2 heads of 16, FFN 96.
    fn tiny_base() -> ModelConfig {
        ModelConfig::parse(
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5, "vocab_size": 256}"#,
        )
        .unwrap()
    }

    #[test]
    fn random_adapters_load_with_their_rank_and_targets() {
        let base = tiny_base();
        let dir = tempfile::tempdir().unwrap();
        for (bf16, targets) in [
            (false, Target::ALL.to_vec()),
            (true, vec![Target::Q, Target::V, Target::Down]),
        ] {
            let d = dir.path().join(format!("{bf16}"));
            let spec = RandomAdapter {
                rank: 16,
                targets: targets.clone(),
                scale: 0.5,
                seed: 7,
                bf16,
            };
            write_random_mlx_lm(&d, &base, &spec).unwrap();
            let a = Adapter::load(&d, &base).unwrap();
            assert_eq!(a.format, AdapterFormat::MlxLm);
            assert_eq!((a.rank, a.scale), (16, 0.5));
            let want: std::collections::BTreeSet<Target> = targets.iter().copied().collect();
            assert_eq!(a.targets(), want);
            assert_eq!(a.layers.len(), 2);
            for l in &a.layers {
                assert_eq!(
                    l.keys().copied().collect::<std::collections::BTreeSet<_>>(),
                    want
                );
                let p = &l[&Target::Down];
                assert_eq!((p.a.shape(), p.b.shape()), (&[96, 16][..], &[16, 64][..]));
                let dt = if bf16 {
                    mlx_rs::Dtype::Bfloat16
                } else {
                    mlx_rs::Dtype::Float32
                };
                assert_eq!(p.a.dtype(), dt);
            }
            // Deterministic: the same seed writes the same bytes, another seed not.
            let again = dir.path().join("again");
            write_random_mlx_lm(&again, &base, &spec).unwrap();
            let read = |d: &Path| std::fs::read(d.join("adapters.safetensors")).unwrap();
            assert_eq!(read(&d), read(&again));
            let other = RandomAdapter { seed: 8, ..spec };
            write_random_mlx_lm(&again, &base, &other).unwrap();
            assert_ne!(read(&d), read(&again));
        }
    }

    #[test]
    fn names_parse_in_both_formats() {
        assert_eq!(
            parse_name(
                AdapterFormat::MlxLm,
                "model.layers.12.self_attn.q_proj.lora_a"
            ),
            Some((12, "self_attn.q_proj", Half::A))
        );
        assert_eq!(
            parse_name(
                AdapterFormat::Peft,
                "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
            ),
            Some((3, "mlp.down_proj", Half::B))
        );
        assert_eq!(
            parse_name(
                AdapterFormat::MlxLm,
                "model.layers.x.self_attn.q_proj.lora_a"
            ),
            None
        );
        assert_eq!(
            parse_name(
                AdapterFormat::MlxLm,
                "model.layers.+1.self_attn.q_proj.lora_a"
            ),
            None
        );
        assert_eq!(
            parse_name(
                AdapterFormat::Peft,
                "model.layers.1.self_attn.q_proj.lora_a"
            ),
            None
        );
    }
}
