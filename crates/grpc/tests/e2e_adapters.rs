//! LoRA adapters served beside the model (issue 18 item 2): a real `weft serve
//! --adapter a=DIR --adapter b=DIR --tenants FILE` on the default model, with two
//! random mlx-lm adapters the test writes. Each adapter changes the output; rows
//! with different adapters (and none) batched together give what each gives
//! alone; `model` may name the adapter (the OpenAI API's way); an unknown
//! adapter is INVALID_ARGUMENT, one the tenant may not use PERMISSION_DENIED;
//! ListModels and `/v1/models` list them.

mod common;

use std::path::Path;

use common::*;
use tonic::Code;
use weft_grpc::pb;
use weft_grpc::server::tenants::hash_key;

const OPEN_KEY: &str = "key-of-tenant-open";
const ONLY_A_KEY: &str = "key-of-tenant-only-a";
const PROMPT: &str = "The three most useful things to know about rivers are";

/// An mlx-lm adapter of rank 8 on q_proj and v_proj of every layer, values from
/// a fixed pseudo-random sequence seeded by `seed`.
fn write_adapter(dir: &Path, model: &weft_models::ModelConfig, seed: u64) {
    use weft_models::Target;
    let spec = weft_models::RandomAdapter {
        rank: 8,
        targets: vec![Target::Q, Target::V],
        scale: 2.0,
        seed,
        bf16: false,
    };
    weft_models::write_random_mlx_lm(dir, model, &spec).unwrap();
}

fn req(adapter: &str, model: &str) -> pb::GenerateRequest {
    let mut r = text_req(PROMPT, 16);
    r.adapter = adapter.to_string();
    r.model = model.to_string();
    r
}

async fn ids(s: &Server, key: &str, r: pb::GenerateRequest) -> Vec<u32> {
    let mut c = s.client().await;
    let out = c
        .generate(with(r, Some(key), None))
        .await
        .unwrap_or_else(|e| panic!("generate: {e}"))
        .into_inner();
    assert_eq!(out.ids.len(), 16, "{out:?}");
    out.ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adapters_are_served_mixed_in_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = weft_grpc::runtime::resolve_model("", true).expect("the default model");
    let config = weft_models::ModelConfig::load(&model_dir).expect("config");
    write_adapter(&dir.path().join("a"), &config, 1);
    write_adapter(&dir.path().join("b"), &config, 2);
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"open\"\napi_key_sha256 = \"{}\"\n\n\
             [[tenant]]\nname = \"only-a\"\napi_key_sha256 = \"{}\"\nadapters = [\"a\"]\n",
            hash_key(OPEN_KEY),
            hash_key(ONLY_A_KEY)
        ),
    )
    .unwrap();
    let a = format!("a={}", dir.path().join("a").display());
    let b = format!("b={}", dir.path().join("b").display());
    let s = Server::start(&[
        "--adapter",
        &a,
        "--adapter",
        &b,
        "--tenants",
        tenants.to_str().unwrap(),
    ])
    .await;

    // ListModels lists both.
    let mut c = s.client().await;
    let models = c
        .list_models(with(pb::ListModelsRequest {}, Some(OPEN_KEY), None))
        .await
        .unwrap()
        .into_inner()
        .models;
    let listed: Vec<_> = models[0]
        .adapters
        .iter()
        .map(|a| {
            (
                a.name.as_str(),
                a.rank,
                a.targets.clone(),
                a.format.as_str(),
            )
        })
        .collect();
    let qv = vec!["q_proj".to_string(), "v_proj".to_string()];
    assert_eq!(
        listed,
        vec![("a", 8, qv.clone(), "mlx-lm"), ("b", 8, qv, "mlx-lm")]
    );

    // The memory plan counts the adapter pool: 3 slots (none, a, b) x layers of
    // q/v stacks (A [3, hidden, 2 x 8], B [3, 8, q out] and [3, 8, v out]).
    let (hidden, hd) = (config.hidden_size as usize, config.head_dim as usize);
    let (q_out, v_out) = (
        config.num_heads as usize * hd,
        config.num_kv_heads as usize * hd,
    );
    let elems = 3 * (hidden * 16 + 8 * q_out + 8 * v_out) * config.num_layers as usize;
    let width = if models[0].dtype == "float32" { 4 } else { 2 };
    let m = s.metrics().await;
    assert_eq!(
        metric(&m, "weft_memory_plan_bytes", &["part=\"adapters\""]),
        Some((elems * width) as f64),
        "dtype {}",
        models[0].dtype
    );

    // Alone, one at a time (greedy).
    let base = ids(&s, OPEN_KEY, req("", "")).await;
    let alone_a = ids(&s, OPEN_KEY, req("a", "")).await;
    let alone_b = ids(&s, OPEN_KEY, req("b", "")).await;
    eprintln!("base {base:?}\na    {alone_a:?}\nb    {alone_b:?}");
    assert_ne!(alone_a, base, "adapter a changes nothing");
    assert_ne!(alone_b, base, "adapter b changes nothing");
    assert_ne!(alone_a, alone_b, "adapters a and b give the same tokens");

    // Together: eight requests mixing a, b and none decode in the same steps,
    // and each gives what its adapter gave alone; `model` names an adapter too.
    let kinds = [
        ("a", ""),
        ("", ""),
        ("b", ""),
        ("", "a"),
        ("b", ""),
        ("", ""),
        ("a", ""),
        ("", "b"),
    ];
    let mut tasks = Vec::new();
    for (adapter, model) in kinds {
        let s_url = s.url();
        let r = req(adapter, model);
        tasks.push(tokio::spawn(async move {
            client_at(s_url)
                .await
                .generate(with(r, Some(OPEN_KEY), None))
                .await
                .map(|r| r.into_inner().ids)
        }));
    }
    for ((adapter, model), t) in kinds.iter().zip(tasks) {
        let got = t.await.unwrap().unwrap();
        let want = match (*adapter, *model) {
            ("a", _) | (_, "a") => &alone_a,
            ("b", _) | (_, "b") => &alone_b,
            _ => &base,
        };
        assert_eq!(
            &got, want,
            "adapter {adapter:?} / model {model:?} in a batch"
        );
    }
    let m = s.metrics().await;
    let steps = metric(&m, "weft_batch_size_count", &[]).unwrap_or(0.0);
    let rows = metric(&m, "weft_batch_size_sum", &[]).unwrap_or(0.0);
    assert!(
        rows > steps,
        "no step held more than one row ({rows} rows in {steps} steps)"
    );

    // Metrics: while a long request runs with adapter b, the per-adapter gauge
    // counts it and the gateway's LoRA info gauge names b as running.
    let mut long = req("b", "");
    long.max_tokens = 400;
    long.ignore_eos = true;
    let s_url = s.url();
    let running = tokio::spawn(async move {
        let mut st = client_at(s_url)
            .await
            .generate_stream(with(long, Some(OPEN_KEY), None))
            .await
            .unwrap()
            .into_inner();
        // Hold the stream open until aborted.
        while let Ok(Some(_)) = st.message().await {}
    });
    wait_metric(
        &s,
        "weft_adapter_requests",
        &["adapter=\"b\"", "state=\"running\""],
        |v| v == 1.0,
        std::time::Duration::from_secs(60),
    )
    .await;
    let m = s.metrics().await;
    assert_eq!(
        metric(
            &m,
            "weft_adapter_requests",
            &["adapter=\"a\"", "state=\"running\""]
        ),
        Some(0.0)
    );
    let info = metric(
        &m,
        "weft_lora_requests_info",
        &[
            "running_lora_adapters=\"b\"",
            "waiting_lora_adapters=\"\"",
            "max_lora=\"2\"",
        ],
    )
    .unwrap_or_else(|| panic!("no LoRA info gauge naming b running:\n{m}"));
    assert!(
        info > 1.6e9,
        "the info gauge's value is the refresh time: {info}"
    );
    running.abort();

    // Refusals.
    assert_code(
        c.generate(with(req("c", ""), Some(OPEN_KEY), None)).await,
        Code::InvalidArgument,
        "adapter: unknown adapter \"c\"",
    );
    assert_code(
        c.generate(with(req("b", "a"), Some(OPEN_KEY), None)).await,
        Code::InvalidArgument,
        "conflicts with model \"a\"",
    );
    assert_code(
        c.generate(with(req("b", ""), Some(ONLY_A_KEY), None)).await,
        Code::PermissionDenied,
        "may not use adapter \"b\"",
    );
    assert_code(
        c.generate(with(req("", "b"), Some(ONLY_A_KEY), None)).await,
        Code::PermissionDenied,
        "may not use adapter \"b\"",
    );
    assert_eq!(ids(&s, ONLY_A_KEY, req("a", "")).await, alone_a);

    // The OpenAI API: `/v1/models` lists the adapters, `model` runs one.
    let http = s.http_addr.clone().expect("http listener");
    let client = reqwest::Client::new();
    let body = |r: reqwest::Response| async move {
        let text = r.text().await.unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    };
    let list = body(
        client
            .get(format!("http://{http}/v1/models"))
            .bearer_auth(OPEN_KEY)
            .send()
            .await
            .unwrap(),
    )
    .await;
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(names.ends_with(&["a", "b"]), "{list}");
    let done = body(
        client
            .post(format!("http://{http}/v1/completions"))
            .bearer_auth(OPEN_KEY)
            .header("content-type", "application/json")
            .body(
                serde_json::json!({"model": "b", "prompt": PROMPT, "max_tokens": 16,
                                   "temperature": 0})
                .to_string(),
            )
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(done["model"], "b", "{done}");
    let mut c2 = s.client().await;
    let want_text = c2
        .generate(with(req("b", ""), Some(OPEN_KEY), None))
        .await
        .unwrap()
        .into_inner()
        .text;
    assert_eq!(done["choices"][0]["text"], want_text.as_str(), "{done}");
}
