//! End-to-end, one server through its whole life, in order: NOT_SERVING
//! while the model loads, SERVING, an engine failure that fails one request
//! only, KV returned after cancel / deadline /
//! disconnect, the global queue cap, then SIGTERM with requests in flight:
//! NOT_SERVING, UNAVAILABLE for new calls, the short request completes, the
//! long one is cut at the drain timeout, exit 0.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tonic::Code;
use weft_grpc::pb;

const NOT_SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
const SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;

fn long(prompt: &str, id: &str) -> pb::GenerateRequest {
    let mut r = text_req(prompt, 2000);
    r.ignore_eos = true;
    r.request_id = id.to_string();
    r
}

async fn kv_used(s: &Server) -> f64 {
    metric(&s.metrics().await, "weft_kv_blocks_used", &[]).unwrap_or(-1.0)
}

/// Waits until no KV block is in use and nothing runs or waits.
async fn wait_idle(s: &Server, what: &str) {
    let t0 = Instant::now();
    loop {
        let text = s.metrics().await;
        let kv = metric(&text, "weft_kv_blocks_used", &[]).unwrap_or(-1.0);
        let running = metric(&text, "weft_requests_running", &[]).unwrap_or(0.0);
        let waiting = metric(&text, "weft_requests_waiting", &[]).unwrap_or(0.0);
        if kv == 0.0 && running == 0.0 && waiting == 0.0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "{what}: KV blocks {kv}, running {running}, waiting {waiting} after {:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_life() {
    let s = Server::spawn_env(
        &[
            "--max-batch-rows",
            "2",
            "--max-waiting",
            "2",
            "--drain-timeout",
            "8s",
        ],
        // Every attempt of the first step fails (1 try + 3 retries).
        &[("WEFT_TEST_FAULTS", "after_forward:1-4")],
    );

    // ---- loading: the listeners are up, the model is not.
    assert_eq!(s.health("").await.unwrap(), NOT_SERVING);
    assert_eq!(s.health("weft.v1.Generation").await.unwrap(), NOT_SERVING);
    let mut c = s.client().await;
    assert_code(
        c.generate(text_req("hi", 1)).await,
        Code::Unavailable,
        "loading",
    );
    assert_eq!(metric(&s.metrics().await, "weft_serving", &[]), Some(0.0));
    s.wait_serving().await;
    assert_eq!(s.health("weft.v1.Generation").await.unwrap(), SERVING);
    assert!(s.stdout().iter().any(|l| l.starts_with("weft: ready")));
    wait_idle(&s, "start").await;

    // ---- An engine failure (injected: the first step fails every retry)
    // fails that request only, with INTERNAL; the next one is served.
    assert_code(
        c.generate(text_req("The capital of France is", 3)).await,
        Code::Internal,
        "generation failed",
    );
    let ok = c
        .generate(text_req("The capital of France is", 3))
        .await
        .unwrap()
        .into_inner();
    assert!(ok.text.contains("Paris"), "{:?}", ok.text);
    wait_idle(&s, "after an engine failure").await;

    // ---- Cancel frees the row and its blocks within a step.
    let mut st = c
        .generate_stream(long("Tell me about the sea", "kv-cancel"))
        .await
        .unwrap()
        .into_inner();
    st.message().await.unwrap().unwrap();
    assert!(kv_used(&s).await > 0.0, "a running request holds KV blocks");
    assert!(
        c.cancel(pb::CancelRequest {
            request_id: "kv-cancel".into()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
    wait_idle(&s, "after Cancel").await;
    drop(st);

    // ---- A deadline frees them too.
    let got = collect(
        &mut c,
        with(
            long("Tell me about the sky", "kv-deadline"),
            None,
            Some(Duration::from_millis(1200)),
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status.map(|s| s.code()), Some(Code::DeadlineExceeded));
    assert!(
        !got.ids.is_empty(),
        "tokens were generated before the deadline"
    );
    wait_idle(&s, "after a deadline").await;

    // ---- So does a client that goes away mid-stream.
    {
        let mut c2 = s.client().await;
        let mut st = c2
            .generate_stream(long("Tell me about the moon", "kv-gone"))
            .await
            .unwrap()
            .into_inner();
        st.message().await.unwrap().unwrap();
        st.message().await.unwrap().unwrap();
        assert!(kv_used(&s).await > 0.0);
    }
    wait_idle(&s, "after a disconnect").await;
    let text = s.metrics().await;
    assert!(
        metric(
            &text,
            "weft_grpc_requests_total",
            &["method=\"GenerateStream\"", "code=\"cancelled\""]
        )
        .unwrap_or(0.0)
            >= 1.0,
        "the disconnect is counted"
    );
    assert!(
        metric(
            &text,
            "weft_requests_finished_total",
            &["reason=\"deadline\""]
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    assert!(
        metric(
            &text,
            "weft_requests_finished_total",
            &["reason=\"cancelled\""]
        )
        .unwrap_or(0.0)
            >= 2.0
    );

    // ---- The global queue cap: 2 rows run, 2 wait, the 5th is refused at once.
    let mut held = Vec::new();
    for i in 0..2 {
        let mut st = c
            .generate_stream(long("Count to a thousand", &format!("q{i}")))
            .await
            .unwrap()
            .into_inner();
        st.message().await.unwrap().unwrap();
        held.push(st);
    }
    for i in 2..4 {
        let st = c
            .generate_stream(long("Count to a thousand", &format!("q{i}")))
            .await
            .unwrap()
            .into_inner();
        held.push(st);
    }
    let t0 = Instant::now();
    let e = assert_code(
        c.generate(text_req("one more", 2)).await,
        Code::ResourceExhausted,
        "queue",
    );
    assert!(t0.elapsed() < Duration::from_secs(1), "refused at once");
    assert!(retry_after_ms(&e) > 0);
    let e = assert_code(
        c.generate_stream(text_req("one more", 2)).await.map(|_| ()),
        Code::ResourceExhausted,
        "queue",
    );
    assert!(retry_after_ms(&e) > 0);
    drop(held);
    wait_idle(&s, "after dropping queued streams").await;

    // ---- Drain: a short request completes, a long one is cut at the timeout.
    let mut short = text_req("The capital of France is", 12);
    short.ignore_eos = true;
    let mut cs = s.client().await;
    let mut short_st = cs.generate_stream(short).await.unwrap().into_inner();
    let first = short_st.message().await.unwrap().unwrap();
    let mut cl = s.client().await;
    let long_task = tokio::spawn(async move {
        collect(
            &mut cl,
            with(long("Write an endless poem", "drain-long"), None, None),
        )
        .await
    });
    let short_task = tokio::spawn(async move {
        let mut c = Collected::default();
        if let Some(pb::generate_stream_response::Event::Delta(d)) = first.event {
            c.ids.extend(d.ids);
        }
        loop {
            match short_st.message().await {
                Ok(Some(m)) => match m.event {
                    Some(pb::generate_stream_response::Event::Delta(d)) => c.ids.extend(d.ids),
                    Some(pb::generate_stream_response::Event::Finished(f)) => c.finished = Some(f),
                    None => {}
                },
                Ok(None) => return c,
                Err(e) => {
                    c.status = Some(e);
                    return c;
                }
            }
        }
    });
    wait_metric(
        &s,
        "weft_requests_running",
        &[],
        |v| v >= 2.0,
        Duration::from_secs(10),
    )
    .await;
    let t_term = Instant::now();
    s.signal(libc::SIGTERM);
    // Health flips and new calls are refused while the drain runs.
    let t0 = Instant::now();
    loop {
        if s.health("").await.unwrap() == NOT_SERVING {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "health still SERVING after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_code(
        s.client().await.generate(text_req("late", 1)).await,
        Code::Unavailable,
        "shutting down",
    );
    // The HTTP API refuses too: 503 with an error object, and /health says so.
    let http = s.http_addr.clone().expect("HTTP API listening");
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"prompt": "late", "max_tokens": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let e: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(e["error"]["type"], "service_unavailable", "{e}");
    let h = reqwest::get(format!("http://{http}/health")).await.unwrap();
    assert_eq!(h.status(), 503);
    let short = short_task.await.unwrap();
    assert!(short.status.is_none(), "{:?}", short.status);
    let f = short.finished.expect("the in-flight request finished");
    assert_eq!(reason(&f), pb::FinishReason::Length);
    assert_eq!(short.ids.len(), 12);
    let long = long_task.await.unwrap().unwrap();
    let st = long.status.expect("the long request is cut");
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    let waited = t_term.elapsed();
    assert!(
        waited >= Duration::from_secs(7) && waited < Duration::from_secs(20),
        "cut after {waited:?} (drain timeout 8s)"
    );
    let status = s.wait_exit(Duration::from_secs(15)).await;
    assert!(
        status.success(),
        "exit status {status}; stderr:\n{}",
        s.stderr()
    );
    assert!(s.stdout().iter().any(|l| l == "weft: stopped"));

    // One info line per request with the facts.
    let log = s.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("request finished") && l.contains("request_id=kv-deadline"))
        .unwrap_or_else(|| panic!("no completion line for kv-deadline:\n{log}"));
    for field in [
        "tenant=default",
        "prompt_tokens=",
        "generated_tokens=",
        "finish_reason=deadline",
        "ttft_ms=",
        "total_ms=",
    ] {
        assert!(line.contains(field), "{field} missing in {line}");
    }
}
