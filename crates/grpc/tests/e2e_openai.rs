//! End-to-end: the OpenAI-compatible HTTP API of a real `weft serve`, driven
//! by the official `openai` Python client (tests/openai/client_check.py) and
//! by raw HTTP for what an SDK hides: the same tokens as the gRPC API, 429
//! with `Retry-After` when a tenant is over its limit, and a client that
//! disconnects from a non-streaming request cancelling it.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use tokio::sync::OnceCell;
use weft_grpc::pb;
use weft_grpc::server::tenants::hash_key;

static SERVER: OnceCell<Server> = OnceCell::const_new();

const KEY: &str = "openai-test-key";
const TIGHT: &str = "tight-test-key";

async fn server() -> &'static Server {
    SERVER
        .get_or_init(|| async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tenants.toml");
            std::fs::write(
                &path,
                format!(
                    "[[tenant]]\nname = \"app\"\napi_key_sha256 = \"{}\"\n\n\
                     [[tenant]]\nname = \"tight\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 1\n",
                    hash_key(KEY),
                    hash_key(TIGHT)
                ),
            )
            .unwrap();
            let s = Server::start(&[
                "--tenants",
                path.to_str().unwrap(),
                "--metrics-aliases",
                "vllm",
            ])
            .await;
            std::mem::forget(dir);
            s
        })
        .await
}

fn base(s: &Server) -> String {
    format!(
        "http://{}/v1",
        s.http_addr.as_deref().expect("HTTP API listening")
    )
}

fn python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = std::env::var_os("WEFT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv/bin/python"));
    assert!(
        p.exists(),
        "{} not found: run `bash .ci/run` once (it creates .venv with the openai package) or set WEFT_PYTHON",
        p.display()
    );
    p
}

async fn model_name(s: &Server) -> String {
    let mut c = s.client().await;
    let r = c
        .list_models(with(pb::ListModelsRequest {}, Some(KEY), None))
        .await
        .unwrap()
        .into_inner();
    r.models[0].name.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_client_works_and_matches_the_grpc_api() {
    let s = server().await;
    let model = model_name(s).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/openai/client_check.py");
    let base = base(s);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python())
            .arg(&script)
            .args([&base, KEY, &model])
            .output()
    })
    .await
    .unwrap()
    .expect("running the openai client");
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let facts: serde_json::Value = serde_json::from_slice(
        out.stdout
            .split(|&b| b == b'\n')
            .rfind(|l| !l.is_empty())
            .unwrap_or_default(),
    )
    .expect("facts line");
    // The same greedy completion through gRPC: the two APIs share one path.
    let mut c = s.client().await;
    let mut req = text_req("The capital of France is", 8);
    req.sampling = Some(pb::SamplingParams::default());
    let r = c
        .generate(with(req, Some(KEY), None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(facts["greedy_text"].as_str(), Some(r.text.as_str()));
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_tenant_limit_is_429_with_retry_after() {
    let s = server().await;
    let url = format!("{}/completions", base(s));
    // One long streamed request holds the tight tenant's only slot.
    let body = serde_json::json!({"prompt": "Tell me a long story", "max_tokens": 400,
        "ignore_eos": true, "stream": true});
    let held = http()
        .post(&url)
        .bearer_auth(TIGHT)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let r = http()
        .post(&url)
        .bearer_auth(TIGHT)
        .header("content-type", "application/json")
        .body((serde_json::json!({"prompt": "hi", "max_tokens": 2})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1, "Retry-After {retry}");
    let e: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(e["error"]["type"], "rate_limit_error", "{e}");
    drop(held);
    // No key at all: 401 with an error object.
    let r = http()
        .post(&url)
        .header("content-type", "application/json")
        .body((serde_json::json!({"prompt": "hi"})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let e: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    // A body that is not the schema: 400 naming the field.
    let r = http()
        .post(&url)
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body((serde_json::json!({"max_tokens": 3})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(e["error"]["param"], "prompt", "{e}");
    // HTTP calls are counted under their own method names.
    let refused = metric(
        &s.metrics().await,
        "weft_grpc_requests_total",
        &[
            "method=\"openai.completions\"",
            "code=\"resource_exhausted\"",
        ],
    );
    assert!(refused.is_some_and(|v| v >= 1.0), "{refused:?}");
    let h = http()
        .get(format!("http://{}/health", s.http_addr.as_deref().unwrap()))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
}

/// A client that gives up on a whole-answer request (no stream) takes its
/// request out of the batch: the engine sees the cancel within a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_cancels_a_non_streaming_request() {
    let s = server().await;
    let url = format!("{}/chat/completions", base(s));
    let before = metric(
        &s.metrics().await,
        "weft_requests_finished_total",
        &["reason=\"cancelled\""],
    )
    .unwrap_or(0.0);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Write a very long essay."}],
        "max_completion_tokens": 3000, "ignore_eos": true});
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(1500))
        .build()
        .unwrap();
    let t0 = Instant::now();
    let r = client
        .post(&url)
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    assert!(
        r.is_err(),
        "a 3000-token answer came back in {:?}",
        t0.elapsed()
    );
    wait_metric(
        s,
        "weft_requests_finished_total",
        &["reason=\"cancelled\""],
        |v| v > before,
        Duration::from_secs(10),
    )
    .await;
    wait_metric(
        s,
        "weft_requests_running",
        &[],
        |v| v == 0.0,
        Duration::from_secs(10),
    )
    .await;
}

/// What autoscalers and the inference gateway scrape: waiting / running
/// requests and KV usage (also under vLLM's names with `--metrics-aliases
/// vllm`), build and cache-config info.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_gauges_are_exported() {
    let s = server().await;
    let text = s.metrics().await;
    for name in [
        "weft_num_requests_waiting",
        "weft_num_requests_running",
        "weft_kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ] {
        let v = metric(&text, name, &[]).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        assert!(v >= 0.0, "{name} = {v}");
    }
    let usage = metric(&text, "vllm:kv_cache_usage_perc", &[]).unwrap();
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert_eq!(metric(&text, "weft_build_info", &[]), Some(1.0), "{text}");
    assert_eq!(
        metric(&text, "weft_kv_cache_config_info", &["block_size=\"16\""]),
        Some(1.0),
        "{text}"
    );
}
