//! Property-based fuzzing of what clients and operators hand the server
//! (issue 17, item 5): the tenant file, the TOML config, and request
//! validation. Mutated inputs give a typed error (anyhow for files,
//! INVALID_ARGUMENT — or NOT_FOUND for an unknown model — for requests) or
//! `Ok`, never a panic; inputs known to be invalid are refused, and what is
//! accepted respects the documented limits.

use std::sync::atomic::AtomicUsize;

use clap::Parser;
use proptest::prelude::*;
use tonic::Code;
use weft_grpc::pb;
use weft_grpc::runtime::ServedModel;
use weft_grpc::server::config::{ServeArgs, Settings};
use weft_grpc::server::tenants::{hash_key, Tenant, Tenants};
use weft_grpc::server::validate::{self, Limits};
use weft_grpc::units::parse_duration;

// ---- tenant file -----------------------------------------------------------

fn tenant_toml(fields: &[(String, String)]) -> String {
    let mut t = format!(
        "[[tenant]]\nname = \"alpha\"\napi_key_sha256 = \"{}\"\n",
        hash_key("k1")
    );
    for (k, v) in fields {
        t.push_str(&format!("{k} = {v}\n"));
    }
    t.push_str(&format!(
        "\n[[tenant]]\nname = \"beta\"\napi_key_sha256 = [\"{}\"]\nweight = 2.0\n",
        hash_key("k2")
    ));
    t
}

/// TOML values of every shape, with the edge cases the fields care about.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        (-3i64..5).prop_map(|v| v.to_string()),
        any::<i64>().prop_map(|v| v.to_string()),
        Just("9223372036854775807".to_string()),
        prop_oneof![
            Just(0.0f64),
            Just(-1.0),
            Just(1e308),
            Just(0.5),
            any::<f64>()
        ]
        .prop_map(|v| if v.is_finite() {
            format!("{v:?}")
        } else {
            "nan".into()
        }),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        "[a-zA-Z0-9 ._%-]{0,20}".prop_map(|s| format!("{s:?}")),
        (any::<i32>(), any::<i32>()).prop_map(|(a, b)| format!("[{a}, {b}]")),
        Just("[]".to_string()),
        Just("{}".to_string()),
        Just(format!("\"{}\"", "f".repeat(64))),
        Just(format!("\"{}\"", "g".repeat(64))),
    ]
}

const TENANT_KEYS: &[&str] = &[
    "weight",
    "priority",
    "max_concurrent",
    "tokens_per_minute",
    "max_prompt_tokens",
    "max_tokens",
    "max_running",
    "max_waiting",
    "name",
    "api_key_sha256",
    "unknown_key",
];

#[test]
fn the_base_tenant_file_parses_and_known_bad_ones_do_not() {
    assert!(Tenants::parse(&tenant_toml(&[])).is_ok());
    for (k, v) in [
        ("weight", "0.0"),
        ("weight", "-1.0"),
        ("weight", "nan"),
        ("weight", "inf"),
        ("priority", "[3, 1]"),
        ("max_tokens", "0"),
        ("max_concurrent", "0"),
        ("max_tokens", "-1"),
        ("unknown_key", "1"),
    ] {
        let r = Tenants::parse(&tenant_toml(&[(k.into(), v.into())]));
        assert!(r.is_err(), "{k} = {v} was accepted");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Arbitrary values for the tenant fields: an error, or tenants whose
    /// limits hold what the server relies on.
    #[test]
    fn mutated_tenant_files_parse_or_fail_cleanly(
        fields in proptest::collection::vec(
            (proptest::sample::select(TENANT_KEYS), toml_value()), 0..4)
    ) {
        let fields: Vec<(String, String)> =
            fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        // A key given twice is a TOML error, which is fine too.
        if let Ok(Tenants::Keyed(ts)) = Tenants::parse(&tenant_toml(&fields)) {
            for (t, keys) in &ts {
                prop_assert!(t.weight.is_finite() && t.weight > 0.0, "{t:?}");
                prop_assert!(t.priority_min <= t.priority_max);
                prop_assert!(!keys.is_empty());
                for v in [t.max_concurrent, t.max_prompt_tokens, t.max_tokens,
                          t.max_running, t.max_waiting] {
                    prop_assert!(v != Some(0));
                }
                prop_assert!(t.tokens_per_minute != Some(0));
            }
        }
    }

    /// Byte damage to a valid tenant file: no panic.
    #[test]
    fn damaged_tenant_files_never_panic(
        cut in 0usize..400,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
    ) {
        let mut b = tenant_toml(&[("priority".into(), "[0, 3]".into())]).into_bytes();
        for (i, v) in flips {
            let n = b.len();
            b[i % n] = v;
        }
        b.truncate(cut.min(b.len()));
        let _ = Tenants::parse(&String::from_utf8_lossy(&b));
    }
}

// ---- server config file ----------------------------------------------------

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn resolve(toml_text: &str) -> anyhow::Result<Settings> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("weft.toml");
    std::fs::write(&path, toml_text).expect("write");
    let args = Cli::try_parse_from(["serve", "--config", path.to_str().expect("utf-8 path")])
        .expect("flags parse")
        .serve;
    Settings::resolve(args)
}

const CONFIG_KEYS: &[&str] = &[
    "listen",
    "metrics_listen",
    "http_listen",
    "metrics_aliases",
    "model",
    "max_batch_rows",
    "max_step_tokens",
    "max_waiting",
    "prefill_chunk",
    "decode_prefill_tokens",
    "speculate",
    "speculate_step_tokens",
    "kv_blocks",
    "kv_block_size",
    "kv_memory",
    "default_max_tokens",
    "drain_timeout",
    "coalesce",
    "compute_dtype",
    "weights",
    "nonsense",
];

fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => toml_value(),
        1 => prop_oneof![
            Just("\"100000000000000000000\""), Just("\"10000000000000000000\""), Just("\"3000000000000000h\""), Just("\"-1s\""),
            Just("\"5d\""), Just("\"0.5\""), Just("\"90%\""), Just("\"150%\""),
            Just("\"1e30GiB\""), Just("\"2GiB\""), Just("\"0\""), Just("\"off\""),
            Just("\"127.0.0.1:0\""), Just("\"[::1]:99999\""), Just("\"f32\""),
        ].prop_map(str::to_string),
    ]
}

#[test]
fn the_base_config_resolves_and_known_bad_ones_do_not() {
    let base = "max_batch_rows = 8\nkv_memory = \"64MiB\"\ndrain_timeout = \"5s\"\n";
    resolve(base).expect("valid");
    for bad in [
        "max_batch_rows = 0",
        "kv_block_size = 12",
        "kv_blocks = 1\nkv_memory = \"1GiB\"",
        "drain_timeout = \"100000000000000000000\"",
        "coalesce = \"10000000000000000000\"",
        "listen = \"nowhere\"",
        "max_batch_rows = -1",
        "nonsense = 1",
    ] {
        assert!(resolve(bad).is_err(), "{bad:?} was accepted");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary values for the config keys: an error or settings that pass
    /// the server's own checks (no zero sizes, a power-of-two block size,
    /// durations that can be added to an `Instant` and multiplied by 5).
    #[test]
    fn mutated_configs_resolve_or_fail_cleanly(
        fields in proptest::collection::vec(
            (proptest::sample::select(CONFIG_KEYS), config_value()), 1..4)
    ) {
        let text: String = fields.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
        if let Ok(s) = resolve(&text) {
            prop_assert!(s.max_batch_rows > 0 && s.max_step_tokens >= s.max_batch_rows);
            prop_assert!(s.kv_block_size.is_power_of_two());
            prop_assert!(s.coalesce.checked_mul(5).is_some());
            prop_assert!(std::time::Instant::now().checked_add(s.drain_timeout).is_some());
            let _ = s.scheduler_config();
        }
    }

    /// Durations as flags and config spell them: never a panic; accepted
    /// ones are usable.
    #[test]
    fn durations_never_panic(s in "[0-9.eE+-]{0,24}[a-z]{0,2}") {
        if let Ok(d) = parse_duration(&s) {
            prop_assert!(d.checked_mul(5).is_some());
        }
    }
}

// ---- request validation ----------------------------------------------------

const VOCAB: usize = 12;
const CONTEXT: usize = 64;

/// A tiny real tokenizer (byte-level BPE, with a chat template), built the
/// way `weft serve` builds the default model's.
fn tokenizer(dir: &std::path::Path) -> weft_models::Tokenizer {
    use weft_gguf::{build_tokenizer, GgufBuilder, GgufFile, GgufValue};
    let strings =
        |v: &[&str]| GgufValue::Array(v.iter().map(|s| GgufValue::String(s.to_string())).collect());
    let toks = [
        "<|end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab", "12", "Ġ1", "c", "<tool>",
    ];
    let types = [3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4];
    let b = GgufBuilder::new()
        .kv("general.architecture", GgufValue::String("llama".into()))
        .kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", GgufValue::String("smollm".into()))
        .kv("tokenizer.ggml.tokens", strings(&toks))
        .kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
        )
        .kv(
            "tokenizer.ggml.merges",
            strings(&["a b", "Ġ ab", "1 2", "Ġ 1"]),
        )
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(0))
        .kv(
            "tokenizer.chat_template",
            GgufValue::String(
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into(),
            ),
        );
    let g = GgufFile::from_bytes("tiny", b.build()).expect("tiny gguf");
    build_tokenizer(&g)
        .expect("tokenizer")
        .save(dir)
        .expect("save");
    weft_models::Tokenizer::load(dir).expect("load")
}

fn served() -> ServedModel {
    ServedModel {
        name: "tiny".into(),
        dir: std::path::PathBuf::new(),
        architecture: "llama".into(),
        context_length: CONTEXT,
        vocab_size: VOCAB,
        dtype: "float32".into(),
        quantization: "none".into(),
        sliding_window: None,
        layer_kinds: vec!["full_attention".into(); 2],
        state_slots: 0,
        state_bytes_per_row: 0,
        kv_dtype: "float32".into(),
        eos_token_ids: vec![0],
        memory: Default::default(),
        adapters: std::sync::Arc::new(weft_grpc::adapters::AdapterCatalog::new(
            weft_grpc::adapters::StartedAdapters {
                served: ["sql", "chat"]
                    .iter()
                    .enumerate()
                    .map(|(i, n)| weft_grpc::runtime::ServedAdapter {
                        name: n.to_string(),
                        id: i as u32 + 1,
                        rank: 8,
                        scale: 1.0,
                        targets: vec!["q_proj".into()],
                        format: "peft".into(),
                        host_bytes: 0,
                    })
                    .collect(),
                slots: 2,
                max_rank: 8,
            },
            None,
        )),
    }
}

fn tenant(max_tokens: Option<usize>, max_prompt: Option<usize>) -> Tenant {
    Tenant {
        name: "t".into(),
        weight: 1.0,
        priority_min: -2,
        priority_max: 2,
        max_concurrent: None,
        tokens_per_minute: None,
        max_prompt_tokens: max_prompt,
        max_tokens,
        max_running: None,
        max_waiting: None,
        // Of the served "sql" and "chat", this tenant may use "sql".
        adapters: Some(vec!["sql".into()]),
        manage_adapters: false,
        in_flight: AtomicUsize::new(0),
    }
}

fn f32_edge() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(0.0f32),
        Just(-0.0),
        Just(1.0),
        Just(0.5),
        Just(2.0),
        Just(-2.0),
        Just(100.0),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(f32::MIN_POSITIVE),
        -3.0f32..3.0,
        any::<f32>(),
    ]
}

fn sampling_params() -> impl Strategy<Value = pb::SamplingParams> {
    (
        (f32_edge(), f32_edge(), any::<u32>(), f32_edge()),
        (
            f32_edge(),
            f32_edge(),
            f32_edge(),
            proptest::option::of(any::<u64>()),
        ),
    )
        .prop_map(|((temperature, top_p, top_k, min_p), (rp, pp, fp, seed))| {
            pb::SamplingParams {
                temperature,
                top_p,
                top_k,
                min_p,
                repetition_penalty: rp,
                presence_penalty: pp,
                frequency_penalty: fp,
                seed,
            }
        })
}

fn input() -> impl Strategy<Value = Option<pb::generate_request::Input>> {
    use pb::generate_request::Input;
    let text = prop_oneof![Just(String::new()), "[ab12 c]{1,80}", any::<String>()];
    let ids = proptest::collection::vec(
        prop_oneof![0u32..(VOCAB as u32 + 2), any::<u32>()],
        0..(CONTEXT + 4),
    );
    let msg = ("[a-z]{0,6}", any::<String>())
        .prop_map(|(role, content)| pb::ChatMessage { role, content });
    prop_oneof![
        1 => Just(None),
        3 => text.prop_map(|t| Some(Input::Text(t))),
        3 => ids.prop_map(|ids| Some(Input::Tokens(pb::TokenIds { ids }))),
        2 => proptest::collection::vec(msg, 0..4)
            .prop_map(|messages| Some(Input::Chat(pb::Chat { messages }))),
    ]
}

fn request() -> impl Strategy<Value = pb::GenerateRequest> {
    (
        (
            prop_oneof![
                Just(String::new()),
                Just("tiny".to_string()),
                Just("sql".to_string()),
                Just("chat".to_string()),
                "[a-z]{1,5}"
            ],
            input(),
            proptest::option::of(sampling_params()),
            prop_oneof![0u32..80, any::<u32>()],
            prop_oneof![
                3 => Just(String::new()),
                1 => Just("sql".to_string()),
                1 => Just("chat".to_string()),
                1 => ".{1,6}"
            ],
        ),
        (
            proptest::collection::vec(
                prop_oneof![Just(String::new()), ".{1,4}", "x{60,70}"],
                0..10,
            ),
            proptest::collection::vec(prop_oneof![0u32..14, any::<u32>()], 0..70),
            any::<bool>(),
            prop_oneof![0u32..24, any::<u32>()],
            prop_oneof![-3i32..4, any::<i32>()],
            prop_oneof![Just(String::new()), ".{0,8}", "[a-z]{120,140}"],
        ),
    )
        .prop_map(
            |(
                (model, input, sampling, max_tokens, adapter),
                (stop, stop_token_ids, ignore_eos, logprobs, priority, request_id),
            )| {
                pb::GenerateRequest {
                    model,
                    input,
                    sampling,
                    max_tokens,
                    stop,
                    stop_token_ids,
                    ignore_eos,
                    logprobs,
                    priority,
                    request_id,
                    constraint: None,
                    adapter,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Sampling parameters of any value: INVALID_ARGUMENT naming the field,
    /// or parameters inside the ranges the .proto documents.
    #[test]
    fn sampling_is_valid_or_invalid_argument(s in sampling_params()) {
        match validate::sampling(Some(&s)) {
            Ok((p, seed)) => {
                prop_assert_eq!(seed, s.seed);
                prop_assert!((0.0..=100.0).contains(&p.temperature));
                prop_assert!(p.top_p > 0.0 && p.top_p <= 1.0, "{p:?}");
                prop_assert!((0.0..1.0).contains(&p.min_p));
                prop_assert!(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite());
                prop_assert!((-2.0..=2.0).contains(&p.presence_penalty));
                prop_assert!((-2.0..=2.0).contains(&p.frequency_penalty));
            }
            Err(e) => {
                prop_assert_eq!(e.code(), Code::InvalidArgument);
                prop_assert!(e.message().starts_with("sampling."), "{}", e.message());
            }
        }
    }

    /// Header values and request ids of any text: no panic.
    #[test]
    fn timeouts_and_request_ids_never_panic(s in any::<String>(), digits in "[0-9]{1,8}[HMSmun\u{e9}]") {
        let _ = validate::parse_grpc_timeout(&s);
        let _ = validate::parse_grpc_timeout(&digits);
        match validate::check_request_id(&s) {
            Ok(Some(id)) => prop_assert!(id.len() <= validate::MAX_REQUEST_ID_BYTES),
            Ok(None) => prop_assert!(s.is_empty()),
            Err(e) => prop_assert_eq!(e.code(), Code::InvalidArgument),
        }
    }
}

#[test]
fn whole_requests_are_valid_or_refused_with_invalid_argument() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = tokenizer(dir.path());
    let model = served();
    let limits = Limits {
        model: &model,
        tokenizer: &tok,
        default_max_tokens: 16,
        grammars: None,
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(2048));
    let strategy = (
        request(),
        proptest::option::of(1usize..40),
        proptest::option::of(1usize..40),
    );
    runner
        .run(&strategy, |(r, t_max, t_prompt)| {
            let t = tenant(t_max, t_prompt);
            match validate::build(&r, &t, &limits, "rid".into(), None) {
                Ok(req) => {
                    let n = req.prompt.len();
                    prop_assert!(n > 0 && n < CONTEXT);
                    prop_assert!(n + req.max_tokens <= CONTEXT);
                    prop_assert!(req.prompt.iter().all(|&id| (id as usize) < VOCAB));
                    prop_assert!(req.stop_token_ids.iter().all(|&id| (id as usize) < VOCAB));
                    prop_assert!(req.stop_strings.len() <= validate::MAX_STOP_STRINGS);
                    prop_assert!(req.logprobs.unwrap_or(0) <= validate::MAX_LOGPROBS as usize);
                    prop_assert!((t.priority_min..=t.priority_max).contains(&r.priority));
                    if let Some(m) = t.max_tokens {
                        prop_assert!(req.max_tokens <= m);
                    }
                    if let Some(m) = t.max_prompt_tokens {
                        prop_assert!(n <= m);
                    }
                    prop_assert!(["", "tiny", "sql"].contains(&r.model.as_str()));
                    // The adapter: `adapter`, else the one `model` names; only
                    // "sql" is this tenant's.
                    let named = if r.adapter.is_empty() && r.model == "sql" {
                        "sql"
                    } else {
                        r.adapter.as_str()
                    };
                    prop_assert_eq!(req.adapter, (named == "sql").then_some(1));
                    prop_assert!(
                        !(["sql", "chat"].contains(&r.model.as_str())
                            && !r.adapter.is_empty()
                            && r.adapter != r.model)
                    );
                    prop_assert!(named.is_empty() || named == "sql");
                }
                Err(e) => {
                    let named =
                        if r.adapter.is_empty() && ["sql", "chat"].contains(&r.model.as_str()) {
                            r.model.as_str()
                        } else {
                            r.adapter.as_str()
                        };
                    let model_adapter = ["sql", "chat"].contains(&r.model.as_str());
                    let want = if !["", "tiny", "sql", "chat"].contains(&r.model.as_str()) {
                        Code::NotFound
                    } else if model_adapter && !r.adapter.is_empty() && r.adapter != r.model {
                        Code::InvalidArgument
                    } else if named == "chat" {
                        Code::PermissionDenied
                    } else {
                        Code::InvalidArgument
                    };
                    prop_assert_eq!(e.code(), want, "{}", e.message());
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
}
