//! End-to-end: API keys, tenant isolation and per-tenant limits against a
//! real `weft serve --tenants FILE`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::sync::OnceCell;
use tonic::Code;
use weft_grpc::pb;
use weft_grpc::server::tenants::hash_key;

static SERVER: OnceCell<Server> = OnceCell::const_new();

const ALICE: &str = "alice-secret-key";
const BOB: &str = "bob-secret-key";
const CAROL: &str = "carol-secret-key";
const DAVE: &str = "dave-secret-key";

async fn server() -> &'static Server {
    SERVER
        .get_or_init(|| async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tenants.toml");
            std::fs::write(
                &path,
                format!(
                    r#"
[[tenant]]
name = "alice"
api_key_sha256 = "{}"
weight = 2.0
priority = [0, 5]
max_concurrent = 2
max_prompt_tokens = 64
max_tokens = 24

[[tenant]]
name = "bob"
api_key_sha256 = ["{}", "{}"]
tokens_per_minute = 120

[[tenant]]
name = "carol"
api_key_sha256 = "{}"

[[tenant]]
name = "dave"
api_key_sha256 = "{}"
"#,
                    hash_key(ALICE),
                    hash_key("bob-old-key"),
                    hash_key(BOB),
                    hash_key(CAROL),
                    hash_key(DAVE)
                ),
            )
            .unwrap();
            let s = Server::start(&["--tenants", path.to_str().unwrap()]).await;
            // The file was read at startup; keep the dir alive anyway.
            std::mem::forget(dir);
            s
        })
        .await
}

fn long(id: &str) -> pb::GenerateRequest {
    let mut r = text_req("Tell me a story about a dragon", 24);
    r.ignore_eos = true;
    r.request_id = id.to_string();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required() {
    let s = server().await;
    let mut c = s.client().await;
    for key in [None, Some("wrong-key")] {
        let what = if key.is_none() { "missing" } else { "unknown" };
        assert_code(
            c.generate(with(text_req("hi", 1), key, None)).await,
            Code::Unauthenticated,
            what,
        );
        assert_code(
            c.generate_stream(with(text_req("hi", 1), key, None))
                .await
                .map(|_| ()),
            Code::Unauthenticated,
            what,
        );
        assert_code(
            c.tokenize(with(
                pb::TokenizeRequest {
                    model: String::new(),
                    text: "x".into(),
                },
                key,
                None,
            ))
            .await,
            Code::Unauthenticated,
            what,
        );
        assert_code(
            c.list_models(with(pb::ListModelsRequest {}, key, None))
                .await,
            Code::Unauthenticated,
            what,
        );
        assert_code(
            c.cancel(with(
                pb::CancelRequest {
                    request_id: "x".into(),
                },
                key,
                None,
            ))
            .await,
            Code::Unauthenticated,
            what,
        );
    }
    let mut r = tonic::Request::new(text_req("hi", 1));
    r.metadata_mut()
        .insert("authorization", format!("Basic {ALICE}").parse().unwrap());
    assert_code(c.generate(r).await, Code::Unauthenticated, "Bearer");
    // Health stays open.
    assert_eq!(
        s.health("").await.unwrap(),
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // Good keys, both of bob's.
    for key in [ALICE, BOB, "bob-old-key", CAROL] {
        c.list_models(with(pb::ListModelsRequest {}, Some(key), None))
            .await
            .unwrap();
    }
    let text = s.metrics().await;
    assert!(
        metric(
            &text,
            "weft_grpc_requests_total",
            &["code=\"unauthenticated\"", "tenant=\"none\""]
        )
        .unwrap_or(0.0)
            >= 5.0
    );
    assert!(
        metric(
            &text,
            "weft_grpc_requests_total",
            &["method=\"ListModels\"", "tenant=\"bob\""]
        )
        .unwrap_or(0.0)
            >= 2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cannot_touch_each_other() {
    let s = server().await;
    let mut c = s.client().await;
    // Dave and carol use the same client id at the same time.
    let mut a = c
        .generate_stream(with(long("same-id"), Some(DAVE), None))
        .await
        .unwrap()
        .into_inner();
    let mut k = c
        .generate_stream(with(long("same-id"), Some(CAROL), None))
        .await
        .unwrap()
        .into_inner();
    a.message().await.unwrap().unwrap();
    k.message().await.unwrap().unwrap();
    // Bob cannot cancel either (same answer as for an unknown id).
    let canceller = c.clone();
    let cancel = |key: &'static str, id: &str| {
        let mut c = canceller.clone();
        let id = id.to_string();
        async move {
            c.cancel(with(pb::CancelRequest { request_id: id }, Some(key), None))
                .await
                .unwrap()
                .into_inner()
                .cancelled
        }
    };
    assert!(!cancel(BOB, "same-id").await);
    assert!(!cancel(BOB, "no-such-id").await);
    // Dave cancels his; carol's keeps going to the end.
    assert!(cancel(DAVE, "same-id").await);
    let mut dave_reason = None;
    while let Some(m) = a.message().await.unwrap() {
        if let Some(pb::generate_stream_response::Event::Finished(f)) = m.event {
            dave_reason = Some(reason(&f));
        }
    }
    assert_eq!(dave_reason, Some(pb::FinishReason::Cancelled));
    let mut carol_finished = None;
    let mut n = 1;
    while let Some(m) = k.message().await.unwrap() {
        match m.event {
            Some(pb::generate_stream_response::Event::Delta(d)) => n += d.ids.len(),
            Some(pb::generate_stream_response::Event::Finished(f)) => carol_finished = Some(f),
            None => {}
        }
    }
    let f = carol_finished.unwrap();
    assert_eq!(reason(&f), pb::FinishReason::Length);
    assert_eq!(n, 24);

    // Server-assigned ids are just as private.
    let mut a = c
        .generate_stream(with(long(""), Some(DAVE), None))
        .await
        .unwrap()
        .into_inner();
    let id = a.message().await.unwrap().unwrap().request_id;
    assert!(!cancel(CAROL, &id).await);
    assert!(cancel(DAVE, &id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_tenant_limits() {
    let s = server().await;
    let mut c = s.client().await;
    let alice = |r: pb::GenerateRequest| with(r, Some(ALICE), None);

    // Validation against alice's limits, naming them.
    let mut r = text_req("hi", 25);
    r.request_id = "too-many".into();
    assert_code(
        c.generate(alice(r)).await,
        Code::InvalidArgument,
        "limit of 24",
    );
    let big = "word ".repeat(80);
    assert_code(
        c.generate(alice(text_req(&big, 4))).await,
        Code::InvalidArgument,
        "at most 64",
    );
    let mut r = text_req("hi", 2);
    r.priority = 6;
    assert_code(
        c.generate(alice(r.clone())).await,
        Code::InvalidArgument,
        "[0, 5]",
    );
    r.priority = -1;
    assert_code(
        c.generate(alice(r.clone())).await,
        Code::InvalidArgument,
        "[0, 5]",
    );
    r.priority = 5;
    c.generate(alice(r)).await.unwrap();
    // Carol has no priority range beyond the default [0, 0].
    let mut r = text_req("hi", 2);
    r.priority = 1;
    assert_code(
        c.generate(with(r, Some(CAROL), None)).await,
        Code::InvalidArgument,
        "priority",
    );
    // max_tokens 0 = the server default, capped by the tenant's max_tokens.
    let mut r = text_req("Tell me everything", 0);
    r.ignore_eos = true;
    let out = c.generate(alice(r)).await.unwrap().into_inner();
    assert_eq!(out.ids.len(), 24);

    // max_concurrent = 2: a third call is refused at once with a retry hint.
    let mut held = Vec::new();
    for i in 0..2 {
        let mut st = c
            .generate_stream(alice(long(&format!("conc-{i}"))))
            .await
            .unwrap()
            .into_inner();
        st.message().await.unwrap().unwrap();
        held.push(st);
    }
    let t0 = Instant::now();
    let e = assert_code(
        c.generate(alice(text_req("three", 1))).await,
        Code::ResourceExhausted,
        "max_concurrent 2",
    );
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert!(retry_after_ms(&e) > 0);
    let e = assert_code(
        c.generate_stream(alice(text_req("three", 1)))
            .await
            .map(|_| ()),
        Code::ResourceExhausted,
        "max_concurrent",
    );
    assert!(retry_after_ms(&e) > 0);
    // Other tenants are not affected.
    c.generate(with(text_req("hi", 1), Some(CAROL), None))
        .await
        .unwrap();
    drop(held);
    // The slots come back once the streams are gone.
    let t0 = Instant::now();
    loop {
        match c.generate(alice(text_req("again", 1))).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(t0.elapsed() < Duration::from_secs(5), "slots never freed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_rate_quota() {
    let s = server().await;
    let mut c = s.client().await;
    let bob = |r: pb::GenerateRequest| with(r, Some(BOB), None);
    // More than a whole minute's budget can never pass.
    assert_code(
        c.generate(bob(text_req("hi", 200))).await,
        Code::InvalidArgument,
        "120 tokens/minute",
    );
    // ~100 of 120 tokens: the first passes, the second is over quota now.
    let mut r = text_req("Count slowly", 90);
    r.ignore_eos = true;
    let mut st = c
        .generate_stream(bob(r.clone()))
        .await
        .unwrap()
        .into_inner();
    st.message().await.unwrap().unwrap();
    let e = assert_code(
        c.generate(bob(r.clone())).await,
        Code::ResourceExhausted,
        "tokens/minute",
    );
    let ms = retry_after_ms(&e);
    assert!((1_000..=60_000).contains(&ms), "retry-after-ms {ms}");
    let e = assert_code(
        c.generate_stream(bob(r)).await.map(|_| ()),
        Code::ResourceExhausted,
        "tokens/minute",
    );
    assert!(retry_after_ms(&e) > 0);
    drop(st);
    let text = s.metrics().await;
    assert!(
        metric(
            &text,
            "weft_grpc_requests_total",
            &["code=\"resource_exhausted\"", "tenant=\"bob\""]
        )
        .unwrap_or(0.0)
            >= 2.0
    );
}
