//! Metric families are emitted under their documented names, with bounded labels.

mod common;

use std::collections::HashSet;

use common::*;
use metrics_util::debugging::DebuggingRecorder;
use weft_scheduler::{metrics as m, FaultPlan, FaultPoint, Request, TenantLimits};

#[test]
fn metrics_are_emitted_with_bounded_tenant_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut g = rng(2);
    let specs: Vec<Spec> = (0..300)
        .map(|i| {
            // 50 distinct tenants, one of them named in the config.
            let mut req = Request::new(
                format!("tenant-{}", i % 50),
                prompt(&mut g, 1 + i % 120),
                1 + i % 30,
            );
            req.ignore_eos = true;
            Spec {
                arrival_step: 0,
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            }
        })
        .collect();
    let mut cfg = sched_config();
    cfg.tenants
        .insert("tenant-0".into(), TenantLimits::default());
    cfg.faults = FaultPlan::default().at(FaultPoint::AfterForward, 2);
    let r = metrics::with_local_recorder(&recorder, || run_plain(cfg, &specs));
    assert_clean(&r);
    assert!(r.sched.stats().preemptions > 0);

    let snap = snapshotter.snapshot().into_vec();
    let names: HashSet<String> = snap
        .iter()
        .map(|(k, ..)| k.key().name().to_string())
        .collect();
    for want in [
        m::REQUESTS_RUNNING,
        m::REQUESTS_WAITING,
        m::KV_BLOCKS_USED,
        m::KV_BLOCKS_FREE,
        m::KV_BLOCKS_CACHED,
        m::KV_USAGE_RATIO,
        m::PREEMPTIONS,
        m::STEP_ROLLBACKS,
        m::STEP_DURATION,
        m::BATCH_SIZE,
        m::TTFT,
        m::ITL,
        m::QUEUE_TIME,
        m::PROMPT_TOKENS,
        m::GENERATION_TOKENS,
        m::REQUESTS_FINISHED,
        m::PREFIX_QUERIES,
        m::PREFIX_HITS,
    ] {
        assert!(names.contains(want), "missing {want}; have {names:?}");
    }
    let tenant_labels: HashSet<String> = snap
        .iter()
        .flat_map(|(k, ..)| {
            k.key()
                .labels()
                .filter(|l| l.key() == "tenant")
                .map(|l| l.value().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        tenant_labels,
        HashSet::from(["tenant-0".to_string(), "other".to_string()])
    );
    let gen_total: u64 = snap
        .iter()
        .filter(|(k, ..)| k.key().name() == m::GENERATION_TOKENS)
        .map(|(_, _, _, v)| match v {
            metrics_util::debugging::DebugValue::Counter(c) => *c,
            _ => 0,
        })
        .sum();
    let streamed: usize = r.outcomes.iter().map(|o| o.tokens.len()).sum();
    assert_eq!(gen_total, streamed as u64);

    // KV gauges are the pool's real block counts; prefix counters are the pool's.
    let value = |name: &str| -> f64 {
        snap.iter()
            .filter(|(k, ..)| k.key().name() == name)
            .map(|(_, _, _, v)| match v {
                metrics_util::debugging::DebugValue::Counter(c) => *c as f64,
                metrics_util::debugging::DebugValue::Gauge(g) => g.into_inner(),
                _ => 0.0,
            })
            .sum()
    };
    let pool = r.sched.kv_pool().stats();
    let g = pool.groups[0];
    assert_eq!(value(m::KV_BLOCKS_USED), 0.0);
    assert_eq!(value(m::KV_BLOCKS_FREE), g.free as f64);
    assert_eq!(value(m::KV_BLOCKS_CACHED), g.cached as f64);
    assert_eq!(
        value(m::KV_BLOCKS_FREE) + value(m::KV_BLOCKS_CACHED),
        g.total as f64
    );
    assert_eq!(value(m::KV_USAGE_RATIO), 0.0);
    assert!(g.cached > 0);
    assert_eq!(value(m::PREFIX_QUERIES), pool.prefix.query_tokens as f64);
    assert!(pool.prefix.query_tokens > 0);
    assert_eq!(value(m::PREFIX_HITS), pool.prefix.hit_tokens as f64);
}
