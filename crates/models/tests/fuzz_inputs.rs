//! Property-based fuzzing of what a model directory feeds the loader
//! (issue 17, item 5): `config.json` and safetensors headers. Mutated or
//! random inputs give a typed `ModelError` or `Ok`, never a panic; inputs
//! known to be invalid (a non-positive size, a tensor whose data does not fit
//! its shape) are errors.

use proptest::prelude::*;
use serde_json::{json, Value};
use weft_models::weights::Weights;
use weft_models::{ModelConfig, ModelError};

fn base_config() -> Value {
    json!({
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 32,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "max_position_embeddings": 256,
        "eos_token_id": [0, 2],
        "bos_token_id": 1,
        "quantization": {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 64, "bits": 8}}
    })
}

const KEYS: &[&str] = &[
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "max_position_embeddings",
    "quantization",
    "eos_token_id",
    "bos_token_id",
];

/// Sizes that must be positive for a config to be usable.
const SIZES: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|v| json!(v)),
        (-3i64..300).prop_map(|v| json!(v)),
        Just(json!(i32::MIN)),
        Just(json!(u64::MAX)),
        any::<f64>()
            .prop_map(|v| serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)),
        "[a-z_.]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("group_size".to_string()),
                    Just("bits".to_string()),
                    Just("type".to_string()),
                    Just("factor".to_string()),
                    "[a-z_.]{1,10}"
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn check_config(text: &str) -> Result<ModelConfig, ModelError> {
    let out = ModelConfig::parse(text);
    if let Err(e) = &out {
        assert!(matches!(e, ModelError::Config { .. }), "{e:?}");
    }
    out
}

#[test]
fn the_base_config_parses() {
    let c = check_config(&base_config().to_string()).expect("valid");
    assert_eq!((c.head_dim, c.num_kv_heads), (16, 2));
}

#[test]
fn non_positive_sizes_are_refused() {
    for key in SIZES {
        for v in [0i64, -1, i32::MIN as i64] {
            let mut c = base_config();
            c[key] = json!(v);
            let r = check_config(&c.to_string());
            assert!(r.is_err(), "{key} = {v} was accepted");
        }
    }
    for key in ["rms_norm_eps", "rope_theta"] {
        for v in [0.0f64, -1.0] {
            let mut c = base_config();
            c[key] = json!(v);
            assert!(check_config(&c.to_string()).is_err(), "{key} = {v}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Fields replaced, added or removed with arbitrary JSON: a typed config
    /// error or a config whose sizes are all positive.
    #[test]
    fn mutated_configs_parse_or_give_config_errors(
        edits in proptest::collection::vec(
            (proptest::sample::select(KEYS), proptest::option::of(json_value())),
            1..4,
        )
    ) {
        let mut c = base_config();
        let obj = c.as_object_mut().expect("object");
        for (k, v) in &edits {
            match v {
                Some(v) => { obj.insert(k.to_string(), v.clone()); }
                None => { obj.remove(*k); }
            }
        }
        if let Ok(cfg) = check_config(&c.to_string()) {
            for v in [cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings] {
                prop_assert!(v > 0, "accepted a non-positive size: {cfg:?}");
            }
            prop_assert!(cfg.num_heads % cfg.num_kv_heads == 0);
        }
    }

    /// Byte-level damage to the text (cuts and overwrites): no panic.
    #[test]
    fn damaged_config_text_never_panics(
        cut in 0usize..600,
        flips in proptest::collection::vec((0usize..600, any::<u8>()), 0..6),
    ) {
        let mut b = base_config().to_string().into_bytes();
        for (i, v) in flips {
            let n = b.len();
            b[i % n] = v;
        }
        b.truncate(cut.min(b.len()));
        let _ = check_config(&String::from_utf8_lossy(&b));
    }
}

// ---- safetensors ---------------------------------------------------------

/// A safetensors file from a header value and a data section.
fn st_file(header: &Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

fn load(bytes: &[u8]) -> Result<Weights, ModelError> {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("model.safetensors"), bytes).expect("write");
    let out = Weights::load_dir(dir.path());
    if let Err(e) = &out {
        assert!(
            matches!(e, ModelError::Weights(_) | ModelError::Tensor { .. }),
            "{e:?}"
        );
    }
    out
}

fn dtype_size(d: &str) -> Option<u64> {
    Some(match d {
        "BOOL" | "U8" | "I8" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

#[test]
fn a_valid_file_loads_and_a_short_one_does_not() {
    let header = json!({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}});
    let good = st_file(&header, &[0u8; 24]);
    let mut w = load(&good).expect("valid");
    assert!(w.take("w").is_ok());
    for cut in 0..good.len() {
        assert!(load(&good[..cut]).is_err(), "cut at {cut} loaded");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Structured headers with arbitrary dtypes, shapes and offsets: when
    /// the data range does not match the shape, or runs past the data, the
    /// load is an error; never a panic.
    #[test]
    fn arbitrary_headers_are_typed_errors(
        dtype in proptest::sample::select(&["F32", "F16", "BF16", "U32", "I64", "U8", "BOOL", "F64", "I8", "F8_E4M3", "C64", "XYZ"][..]),
        shape in proptest::collection::vec(prop_oneof![0u64..5, Just(u64::MAX), Just(1u64 << 32)], 0..4),
        start in prop_oneof![0u64..64, Just(u64::MAX)],
        len in prop_oneof![0u64..64, Just(u64::MAX)],
        data_len in 0usize..96,
        extra in proptest::option::of(json_value()),
    ) {
        let end = start.saturating_add(len);
        let mut header = json!({"t": {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}});
        if let Some(x) = extra {
            header["__metadata__"] = x;
        }
        let r = load(&st_file(&header, &vec![7u8; data_len]));
        let fits = dtype_size(dtype).and_then(|sz| {
            shape.iter().try_fold(sz, |acc, &d| acc.checked_mul(d))
        }) == Some(len) && end as usize <= data_len && end != u64::MAX;
        if !fits {
            prop_assert!(r.is_err(), "accepted {header} over {data_len} bytes");
        }
    }

    /// Random damage to a valid two-tensor file: no panic.
    #[test]
    fn damaged_files_never_panic(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..5),
        len_word in proptest::option::of(any::<u64>()),
    ) {
        let header = json!({
            "a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]},
            "b": {"dtype": "I32", "shape": [2, 2], "data_offsets": [8, 24]},
            "__metadata__": {"format": "mlx"}
        });
        let mut f = st_file(&header, &[1u8; 24]);
        for (i, v) in flips {
            let n = f.len();
            f[i % n] = v;
        }
        if let Some(w) = len_word {
            f[..8].copy_from_slice(&w.to_le_bytes());
        }
        let _ = load(&f);
    }
}

// ---- LoRA adapters -------------------------------------------------------

const ADAPTER_KEYS: &[&str] = &[
    "fine_tune_type",
    "num_layers",
    "lora_parameters",
    "rank",
    "scale",
    "keys",
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "use_dora",
    "layers_to_transform",
    "rank_pattern",
    "bias",
    "modules_to_save",
];

const LORA_NAMES: &[&str] = &[
    "model.layers.0.self_attn.q_proj.lora_a",
    "model.layers.0.self_attn.q_proj.lora_b",
    "model.layers.1.mlp.down_proj.lora_a",
    "model.layers.1.mlp.down_proj.lora_b",
    "model.layers.7.self_attn.k_proj.lora_a",
    "model.layers.0.self_attn.qkv_proj.lora_a",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight",
    "lm_head.weight",
];

/// Loads an adapter directory holding `config` and a tensor file `file`
/// named for `peft`'s layout or mlx-lm's; any failure must be a typed error.
fn load_adapter(config: &str, file: &[u8], peft: bool) -> Result<weft_models::Adapter, ModelError> {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("adapter_config.json"), config).expect("write");
    let name = if peft {
        "adapter_model.safetensors"
    } else {
        "adapters.safetensors"
    };
    std::fs::write(dir.path().join(name), file).expect("write");
    let base = ModelConfig::parse(&base_config().to_string()).expect("base config");
    let out = weft_models::Adapter::load(dir.path(), &base);
    if let Err(e) = &out {
        assert!(
            matches!(
                e,
                ModelError::Config { .. } | ModelError::Weights(_) | ModelError::Tensor { .. }
            ),
            "{e:?}"
        );
    }
    out
}

/// A file of f32 tensors `(name, shape)`.
fn lora_file(tensors: &[(String, Vec<u64>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (n, s) in tensors {
        let len = s.iter().product::<u64>() * 4;
        header.insert(
            n.clone(),
            json!({"dtype": "F32", "shape": s, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    st_file(&Value::Object(header), &vec![0u8; at as usize])
}

#[test]
fn a_valid_adapter_loads() {
    let cfg = json!({"fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}});
    let file = lora_file(&[
        (LORA_NAMES[0].into(), vec![64, 4]),
        (LORA_NAMES[1].into(), vec![4, 64]),
    ]);
    let a = load_adapter(&cfg.to_string(), &file, false).expect("valid adapter");
    assert_eq!((a.rank, a.scale), (4, 2.0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Adapter configs of either layout with keys replaced by arbitrary JSON,
    /// over a valid or arbitrary tensor file: a typed error or an adapter,
    /// never a panic; a rank outside 1..=64 never loads.
    #[test]
    fn mutated_adapters_load_or_give_typed_errors(
        peft in any::<bool>(),
        edits in proptest::collection::vec(
            (proptest::sample::select(ADAPTER_KEYS), json_value()), 0..4),
        tensors in proptest::collection::vec(
            (proptest::sample::select(LORA_NAMES),
             proptest::collection::vec(prop_oneof![0u64..70, Just(64u64)], 0..3)),
            0..4),
        keep_valid in any::<bool>(),
    ) {
        let mut cfg = if peft {
            json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
                "target_modules": ["v_proj"]})
        } else {
            json!({"fine_tune_type": "lora", "num_layers": 2,
                "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}})
        };
        for (k, v) in edits {
            let nested = matches!(k, "rank" | "scale" | "keys");
            match cfg.get_mut("lora_parameters").and_then(Value::as_object_mut) {
                Some(p) if nested => {
                    p.insert(k.to_string(), v);
                }
                _ => {
                    if let Some(o) = cfg.as_object_mut() {
                        o.insert(k.to_string(), v);
                    }
                }
            }
        }
        let mut ts: Vec<(String, Vec<u64>)> = if keep_valid {
            if peft {
                vec![(LORA_NAMES[6].into(), vec![4, 64]), (LORA_NAMES[7].into(), vec![32, 4])]
            } else {
                vec![(LORA_NAMES[0].into(), vec![64, 4]), (LORA_NAMES[1].into(), vec![4, 64])]
            }
        } else {
            Vec::new()
        };
        for (n, s) in tensors {
            if !ts.iter().any(|(m, _)| m == n) {
                ts.push((n.to_string(), s));
            }
        }
        if let Ok(a) = load_adapter(&cfg.to_string(), &lora_file(&ts), peft) {
            prop_assert!((1..=64).contains(&a.rank), "rank {}", a.rank);
            prop_assert!(a.scale.is_finite());
        }
    }
}
