//! Paged KV end to end, against real `weft serve` processes with the default
//! model: preemption under real pool exhaustion (with and without step faults
//! at every fault point) keeps every stream exactly as an unconstrained server
//! produces it; a burst of one long and many short requests never takes more
//! than the configured pool; blocks return to zero afterwards; K/V stored
//! quantized (`--kv-bits`) serves a batch from a pool that many more blocks
//! fit in.

mod common;

use std::time::Duration;

use common::*;
use weft_grpc::pb;

/// Greedy requests with prompts of 30-60 tokens and 40 new tokens each.
fn burst(n: usize) -> Vec<pb::GenerateRequest> {
    let topics = [
        "rivers",
        "mountains",
        "the sea",
        "deserts",
        "forests",
        "cities",
        "the moon",
        "winter",
    ];
    (0..n)
        .map(|i| {
            let t = topics[i % topics.len()];
            let mut r = text_req(
                &format!(
                    "Request {i}. Write a few plain sentences about {t}, how people live near {t}, \
                     and what they remember about {t} from their childhood."
                ),
                40,
            );
            r.ignore_eos = true;
            r.request_id = format!("kv-{i}");
            r
        })
        .collect()
}

async fn run_all(s: &Server, reqs: &[pb::GenerateRequest]) -> Vec<Collected> {
    let mut tasks = Vec::new();
    for r in reqs {
        let mut c = s.client().await;
        let r = r.clone();
        tasks.push(tokio::spawn(async move {
            collect(&mut c, with(r, None, Some(Duration::from_secs(600))))
                .await
                .unwrap()
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn wait_blocks_free(s: &Server) {
    wait_metric(
        s,
        "weft_kv_blocks_used",
        &[],
        |v| v == 0.0,
        Duration::from_secs(10),
    )
    .await;
}

fn pool_total(text: &str) -> f64 {
    [
        "weft_kv_blocks_used",
        "weft_kv_blocks_free",
        "weft_kv_blocks_cached",
    ]
    .iter()
    .map(|m| metric(text, m, &[]).unwrap_or(f64::NAN))
    .sum()
}

/// Resident memory of a process, from /proc (for the test's report).
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_under_a_small_pool_keeps_every_stream() {
    let reqs = burst(8);
    // The reference: a pool far larger than the burst needs.
    let big = Server::start(&["--kv-blocks", "1024", "--speculate", "0"]).await;
    let want = run_all(&big, &reqs).await;
    drop(big);
    // 8 rows x (~45 + 40 tokens) need ~48 blocks of 16; 24 hold half of them,
    // so rows are preempted and resume (recomputing from their cached blocks).
    let small = Server::start(&["--kv-blocks", "24", "--speculate", "0"]).await;
    let got = run_all(&small, &reqs).await;
    let text = small.metrics().await;
    let preempted = metric(&text, "weft_preemptions_total", &[]).unwrap_or(0.0);
    eprintln!("small pool: {preempted} preemptions");
    assert!(preempted > 0.0, "a 24-block pool must preempt this burst");
    assert_eq!(pool_total(&text), 24.0);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(g.status.is_none(), "request {i}: {:?}", g.status);
        assert_eq!(g.ids, w.ids, "request {i}: tokens differ under preemption");
        assert_eq!(g.text, w.text, "request {i}: text differs under preemption");
        assert_eq!(g.ids.len(), 40);
    }
    wait_blocks_free(&small).await;
    drop(small);

    // The same with step faults at every point of the real-model path: each
    // fault rolls the step back (pool, model) and the retry continues.
    let faulty = Server::start_env(
        &["--kv-blocks", "24", "--speculate", "0"],
        &[(
            "WEFT_TEST_FAULTS",
            "after_plan:3,after_forward:5-6,sampling:9,commit_bookkeeping:12,after_forward:20",
        )],
    )
    .await;
    let got = run_all(&faulty, &reqs).await;
    let text = faulty.metrics().await;
    let rollbacks = metric(&text, "weft_step_rollbacks_total", &[]).unwrap_or(0.0);
    eprintln!("faulty small pool: {rollbacks} rollbacks");
    assert!(rollbacks >= 6.0, "every injected fault rolls a step back");
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(g.status.is_none(), "request {i}: {:?}", g.status);
        assert_eq!(
            g.ids, w.ids,
            "request {i}: tokens differ after rolled-back faults"
        );
    }
    wait_blocks_free(&faulty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_and_many_short_requests_stay_inside_the_pool() {
    // 32 MiB of f32 K/V for the default model: 45 blocks of 16 tokens (720
    // tokens, the burst needs ~1300).
    let s = Server::start(&["--kv-memory", "32MiB", "--speculate", "0"]).await;
    let before = s.metrics().await;
    let total = pool_total(&before);
    let per_block = 30.0 * 3.0 * 64.0 * 2.0 * 4.0 * 16.0;
    assert_eq!(total, ((32u64 << 20) as f64 / per_block).floor());
    let rss0 = rss_mib(s.pid());
    let long = {
        // About 400 tokens (digits are single tokens): fits the pool alone,
        // not beside all the short ones.
        let words: Vec<String> = (0..120).map(|i| format!("w{i}")).collect();
        let mut r = text_req(&words.join(" "), 16);
        r.ignore_eos = true;
        r
    };
    let mut reqs = vec![long];
    reqs.extend(burst(10));
    let done = {
        let s = &s;
        let reqs = &reqs;
        async move { run_all(s, reqs).await }
    };
    let watch = async {
        let mut max_used: f64 = 0.0;
        // A hang guard, not a speed bound: a debug build on a loaded 2-core
        // machine has taken over a minute.
        for _ in 0..3000 {
            let text = s.metrics().await;
            let used = metric(&text, "weft_kv_blocks_used", &[]).unwrap_or(0.0);
            assert_eq!(pool_total(&text), total, "the pool never grows");
            assert!(used <= total);
            max_used = max_used.max(used);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        max_used
    };
    let out = tokio::select! {
        out = done => out,
        _ = watch => panic!("the burst did not finish in five minutes"),
    };
    let rss1 = rss_mib(s.pid());
    let text = s.metrics().await;
    eprintln!(
        "pool {total} blocks ({:.2} MiB); server RSS {rss0:.0} MiB before the burst, {rss1:.0} MiB after; \
         {} preemptions",
        total * per_block / (1 << 20) as f64,
        metric(&text, "weft_preemptions_total", &[]).unwrap_or(0.0)
    );
    for (i, c) in out.iter().enumerate() {
        assert!(c.status.is_none(), "request {i}: {:?}", c.status);
        assert_eq!(c.ids.len(), if i == 0 { 16 } else { 40 }, "request {i}");
    }
    wait_blocks_free(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_kv_serves_a_burst_from_more_blocks_of_the_same_memory() {
    // 32 MiB: 45 blocks of f32 K/V (see above); at 8 bits in groups of 64
    // a token's head vector is 64 bytes plus an f32 scale and bias.
    let s = Server::start(&["--kv-memory", "32MiB", "--kv-bits", "8", "--speculate", "0"]).await;
    let text = s.metrics().await;
    let per_block = 30.0 * 3.0 * 2.0 * (64.0 + 2.0 * 4.0) * 16.0;
    let total = pool_total(&text);
    assert_eq!(total, ((32u64 << 20) as f64 / per_block).floor());
    assert!(total > 3.0 * 45.0, "{total} blocks");
    let mut c = s.client().await;
    let list = c
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.models[0].kv_dtype, "q8g64/float32");
    assert_eq!(list.models[0].kv_groups[0].blocks as f64, total);
    // The burst fits without preemption now (it needs ~48 blocks).
    let out = run_all(&s, &burst(8)).await;
    for (i, c) in out.iter().enumerate() {
        assert!(c.status.is_none(), "request {i}: {:?}", c.status);
        assert_eq!(c.ids.len(), 40, "request {i}");
        assert!(!c.text.trim().is_empty(), "request {i}: empty text");
    }
    let text = s.metrics().await;
    assert_eq!(
        metric(&text, "weft_preemptions_total", &[]).unwrap_or(0.0),
        0.0
    );
    wait_blocks_free(&s).await;
}
