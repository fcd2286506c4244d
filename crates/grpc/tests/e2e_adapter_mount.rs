//! LoRA adapters mounted and unmounted at run time (issue 18 item 2): a real
//! `weft serve --adapter b=DIR --adapter-root ROOT --max-loras 1 --tenants FILE`
//! on the default model. The Admin service mounts an adapter from under the
//! root (only for a tenant granted `manage_adapters`), with a clear status for
//! each bad input; with one resident slot, requests mixing two adapters and
//! none each get what they get alone while the pool loads and evicts (counted
//! on /metrics); an adapter unmounted while it streams lets that request
//! finish, refuses new ones, and mounts again from its files; vLLM's
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` do the same over HTTP.

mod common;

use std::path::Path;

use common::*;
use tonic::Code;
use weft_grpc::pb;
use weft_grpc::pb::admin_client::AdminClient;
use weft_grpc::server::tenants::hash_key;
use weft_models::{RandomAdapter, Target};

const ADMIN_KEY: &str = "key-of-tenant-admin";
const USER_KEY: &str = "key-of-tenant-user";
const PROMPT: &str = "The three most useful things to know about rivers are";

fn write(dir: &Path, model: &weft_models::ModelConfig, rank: usize, seed: u64) {
    let spec = RandomAdapter {
        rank,
        targets: vec![Target::Q, Target::V],
        scale: 2.0,
        seed,
        bf16: false,
    };
    weft_models::write_random_mlx_lm(dir, model, &spec).unwrap();
}

fn req(adapter: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut r = text_req(PROMPT, max_tokens);
    r.adapter = adapter.to_string();
    r
}

async fn ids(s: &Server, adapter: &str) -> Vec<u32> {
    let mut c = s.client().await;
    let out = c
        .generate(with(req(adapter, 16), Some(USER_KEY), None))
        .await
        .unwrap_or_else(|e| panic!("generate with {adapter:?}: {e}"))
        .into_inner();
    assert_eq!(out.ids.len(), 16, "{out:?}");
    out.ids
}

fn load(name: &str, path: &str, key: &str) -> tonic::Request<pb::LoadAdapterRequest> {
    with(
        pb::LoadAdapterRequest {
            name: name.into(),
            path: path.into(),
        },
        Some(key),
        None,
    )
}

async fn listed(s: &Server) -> Vec<String> {
    let mut c = s.client().await;
    let models = c
        .list_models(with(pb::ListModelsRequest {}, Some(USER_KEY), None))
        .await
        .unwrap()
        .into_inner()
        .models;
    models[0].adapters.iter().map(|a| a.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adapters_mount_and_unmount_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = weft_grpc::runtime::resolve_model("", true).expect("the default model");
    let config = weft_models::ModelConfig::load(&model_dir).expect("config");
    let root = dir.path().join("root");
    write(&root.join("a"), &config, 8, 1);
    write(&root.join("wide"), &config, 32, 3);
    write(&dir.path().join("b"), &config, 8, 2);
    write(&dir.path().join("outside"), &config, 8, 4);
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"admin\"\napi_key_sha256 = \"{}\"\nmanage_adapters = true\n\n\
             [[tenant]]\nname = \"user\"\napi_key_sha256 = \"{}\"\n",
            hash_key(ADMIN_KEY),
            hash_key(USER_KEY)
        ),
    )
    .unwrap();
    let b = format!("b={}", dir.path().join("b").display());
    let s = Server::start(&[
        "--adapter",
        &b,
        "--adapter-root",
        root.to_str().unwrap(),
        "--max-loras",
        "1",
        "--tenants",
        tenants.to_str().unwrap(),
    ])
    .await;
    let mut admin = AdminClient::new(s.channel().await);

    // Only a tenant granted manage_adapters mounts.
    assert_code(
        admin.load_adapter(load("a", "a", USER_KEY)).await,
        Code::PermissionDenied,
        "may not manage adapters",
    );
    let info = admin
        .load_adapter(load("a", "a", ADMIN_KEY))
        .await
        .unwrap_or_else(|e| panic!("LoadAdapter: {e}"))
        .into_inner();
    assert_eq!(
        (info.name.as_str(), info.rank, info.format.as_str()),
        ("a", 8, "mlx-lm")
    );
    assert_eq!(info.targets, vec!["q_proj".to_string(), "v_proj".into()]);
    assert_eq!(listed(&s).await, vec!["b".to_string(), "a".into()]);

    // Bad input: a clear status each, nothing mounted.
    let outside = dir.path().join("outside").display().to_string();
    for (name, path, code, needle) in [
        ("a", "a", Code::AlreadyExists, "mounted already"),
        (
            "x",
            "../outside",
            Code::InvalidArgument,
            "outside the adapter root",
        ),
        (
            "x",
            outside.as_str(),
            Code::InvalidArgument,
            "outside the adapter root",
        ),
        ("x", "missing", Code::NotFound, "missing"),
        (
            "x/y",
            "a",
            Code::InvalidArgument,
            "expected 1-64 characters",
        ),
        ("x", "", Code::InvalidArgument, "path: empty"),
        ("wide", "wide", Code::InvalidArgument, "rank 32"),
    ] {
        assert_code(
            admin.load_adapter(load(name, path, ADMIN_KEY)).await,
            code,
            needle,
        );
    }
    assert_eq!(listed(&s).await, vec!["b".to_string(), "a".into()]);

    // Each adapter alone, then all mixed while one slot holds them in turn.
    let alone_a = ids(&s, "a").await;
    let alone_b = ids(&s, "b").await;
    let base = ids(&s, "").await;
    assert_ne!(alone_a, base, "the mounted adapter changes the output");
    assert_ne!(alone_a, alone_b);
    let mut tasks = Vec::new();
    for i in 0..6 {
        let name = ["a", "b", ""][i % 3];
        let url = s.url();
        tasks.push(tokio::spawn(async move {
            let out = client_at(url)
                .await
                .generate(with(req(name, 16), Some(USER_KEY), None))
                .await
                .unwrap_or_else(|e| panic!("generate with {name:?}: {e}"))
                .into_inner();
            (name, out.ids)
        }));
    }
    for t in tasks {
        let (name, got) = t.await.unwrap();
        let want = match name {
            "a" => &alone_a,
            "b" => &alone_b,
            _ => &base,
        };
        assert_eq!(&got, want, "adapter {name:?} mixed with the others");
    }
    let m = s.metrics().await;
    let evictions = metric(&m, "weft_adapter_evictions_total", &[]).unwrap_or(0.0);
    // a and b in f32: 30 layers x (576 x 8 + 8 x 576 + 576 x 8 + 8 x 192) x 4 bytes each.
    let host = metric(&m, "weft_adapter_host_bytes", &[]).unwrap_or(0.0);
    assert!(
        host > 2.0 * 1.0e6,
        "two adapters' files in host memory: {host} bytes"
    );
    let loads = metric(&m, "weft_adapter_loads_total", &[]).unwrap_or(0.0);
    assert!(
        evictions >= 2.0 && loads > evictions,
        "one slot for two adapters in use: loads {loads}, evictions {evictions}"
    );
    assert_eq!(
        metric(&m, "weft_lora_requests_info", &["max_lora=\"1\""]).map(|v| v > 0.0),
        Some(true),
        "max_lora is the slot count:\n{m}"
    );

    // Unmounted while it streams: that request finishes, new ones are refused.
    let mut long = req("a", 120);
    long.ignore_eos = true;
    let mut c = s.client().await;
    let mut stream = c
        .generate_stream(with(long, Some(USER_KEY), None))
        .await
        .unwrap()
        .into_inner();
    let mut got = 0;
    while got == 0 {
        match stream.message().await.unwrap().and_then(|m| m.event) {
            Some(pb::generate_stream_response::Event::Delta(d)) => got += d.ids.len(),
            other => panic!("expected a delta first: {other:?}"),
        }
    }
    let gone = admin
        .unload_adapter(with(
            pb::UnloadAdapterRequest { name: "a".into() },
            Some(ADMIN_KEY),
            None,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gone.live_requests, 1);
    assert_code(
        c.generate(with(req("a", 4), Some(USER_KEY), None)).await,
        Code::InvalidArgument,
        "unknown adapter \"a\"",
    );
    assert_eq!(listed(&s).await, vec!["b".to_string()]);
    let mut finished = None;
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(pb::generate_stream_response::Event::Delta(d)) => got += d.ids.len(),
            Some(pb::generate_stream_response::Event::Finished(f)) => finished = Some(f),
            None => {}
        }
    }
    let f = finished.expect("a final message");
    assert_eq!(reason(&f), pb::FinishReason::Length, "{f:?}");
    assert_eq!(got, 120);
    assert_code(
        admin
            .unload_adapter(with(
                pb::UnloadAdapterRequest { name: "a".into() },
                Some(ADMIN_KEY),
                None,
            ))
            .await,
        Code::NotFound,
        "no adapter \"a\"",
    );

    // Mounted again (another name, same files): the same output as before.
    admin
        .load_adapter(load("a2", "a", ADMIN_KEY))
        .await
        .unwrap();
    assert_eq!(ids(&s, "a2").await, alone_a);

    // vLLM's HTTP routes: the same service, statuses as HTTP codes.
    let http = s.http_addr.clone().expect("http listener");
    let client = reqwest::Client::new();
    let post = |route: &str, key: &str, body: serde_json::Value| {
        client
            .post(format!("http://{http}/v1/{route}"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let a3 = serde_json::json!({"lora_name": "a3", "lora_path": "a"});
    let r = post("load_lora_adapter", USER_KEY, a3.clone())
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let r = post("load_lora_adapter", ADMIN_KEY, a3.clone())
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(
        (v["name"].as_str(), v["rank"].as_u64()),
        (Some("a3"), Some(8))
    );
    let r = post("load_lora_adapter", ADMIN_KEY, a3).await.unwrap();
    assert_eq!(r.status(), 409);
    let r = post(
        "load_lora_adapter",
        ADMIN_KEY,
        serde_json::json!({"lora_name": "a4"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(ids(&s, "a3").await, alone_a);
    let gone = serde_json::json!({"lora_name": "a3"});
    let r = post("unload_lora_adapter", ADMIN_KEY, gone.clone())
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = post("unload_lora_adapter", ADMIN_KEY, gone).await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(listed(&s).await, vec!["b".to_string(), "a2".into()]);
}
