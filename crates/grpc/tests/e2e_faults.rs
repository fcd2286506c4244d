//! Faults beyond the step against a real `weft serve` (`WEFT_TEST_FAULTS`, a
//! test-only knob): a panic on the engine thread fails the in-flight requests
//! with INTERNAL, turns health NOT_SERVING and exits 1; MLX allocation
//! failures in steps split the batch and lose nothing.

mod common;

use std::time::Duration;

use common::*;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_fails_in_flight_requests_and_exits_non_zero() {
    let s = Server::start_env(&[], &[("WEFT_TEST_FAULTS", "panic:6")]).await;
    let ch = s.channel().await;
    let reqs: Vec<_> = (0..2)
        .map(|i| {
            let mut c = weft_grpc::pb::generation_client::GenerationClient::new(ch.clone());
            tokio::spawn(async move {
                let mut r = text_req(&format!("Request {i}: the river"), 200);
                r.ignore_eos = true;
                collect(&mut c, with(r, None, None)).await.unwrap()
            })
        })
        .collect();
    for r in reqs {
        let out = r.await.unwrap();
        let st = out.status.expect("the request fails");
        assert_eq!(st.code(), Code::Internal, "{st:?}");
        assert!(
            st.message().contains("engine thread panicked"),
            "{}",
            st.message()
        );
    }
    // Unhealthy at once (the server lingers a second before it exits).
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    assert_eq!(s.health("").await.unwrap(), not_serving);
    let status = s.wait_exit(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(1), "{status}");
    let log = s.stderr();
    assert!(log.contains("injected engine-thread panic"), "{log}");
    assert!(log.contains("the engine stopped unexpectedly"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_failures_split_the_batch_and_lose_nothing() {
    // Forwards 2-4 fail with MLX's own allocation error: the 3-row decode
    // step is split, the single row retried.
    let s = Server::start_env(&[], &[("WEFT_TEST_FAULTS", "alloc:2-4")]).await;
    let ch = s.channel().await;
    let prompts = [
        "The capital of France is",
        "Rivers flow to",
        "One, two, three,",
    ];
    let run = |p: &'static str| {
        let mut c = weft_grpc::pb::generation_client::GenerationClient::new(ch.clone());
        async move { c.generate(text_req(p, 8)).await.map(|r| r.into_inner()) }
    };
    let batched: Vec<_> = prompts.iter().map(|&p| tokio::spawn(run(p))).collect();
    let mut first = Vec::new();
    for b in batched {
        let out = b.await.unwrap().expect("every request succeeds");
        assert_eq!(
            out.usage.as_ref().unwrap().generated_tokens as usize,
            out.ids.len()
        );
        first.push(out.ids);
    }
    let m = s.metrics().await;
    let oom = metric(&m, "weft_step_out_of_memory_total", &[]).unwrap_or(0.0);
    assert!(oom >= 2.0, "weft_step_out_of_memory_total {oom}");
    assert!(s.stderr().contains("Unable to allocate"), "{}", s.stderr());
    // The faults are spent: the same prompts one at a time give the same ids.
    for (p, ids) in prompts.iter().zip(&first) {
        let out = run(p).await.unwrap();
        assert_eq!(&out.ids, ids, "{p}");
    }
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(s.health("").await.unwrap(), serving);
}
