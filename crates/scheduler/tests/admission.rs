//! Admission: typed errors at once, limits that release as requests finish.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use weft_scheduler::fake::{FakeDetokenizer, FakeModel};
use weft_scheduler::{
    Event, FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig, SubmitError,
    TenantLimits,
};

fn sched(cfg: SchedulerConfig) -> Scheduler<FakeModel> {
    sched_blocks(cfg, BLOCKS)
}

fn sched_blocks(cfg: SchedulerConfig, blocks: u32) -> Scheduler<FakeModel> {
    Scheduler::new(
        cfg,
        FakeModel::new(fake_blocks(blocks)),
        Arc::new(FakeDetokenizer),
    )
    .unwrap()
}

fn invalid(r: Result<impl Sized, SubmitError>) -> String {
    match r {
        Err(SubmitError::Invalid(m)) => m,
        Err(e) => panic!("expected Invalid, got {e:?}"),
        Ok(_) => panic!("expected Invalid, got Ok"),
    }
}

fn overloaded(r: Result<impl Sized, SubmitError>) -> (Duration, String) {
    match r {
        Err(SubmitError::Overloaded {
            retry_after,
            reason,
        }) => (retry_after, reason),
        Err(e) => panic!("expected Overloaded, got {e:?}"),
        Ok(_) => panic!("expected Overloaded, got Ok"),
    }
}

#[test]
fn requests_that_can_never_fit_are_invalid_and_name_the_limit() {
    let mut cfg = sched_config();
    cfg.tenants.insert(
        "metered".into(),
        TenantLimits {
            tokens_per_minute: Some(100),
            ..TenantLimits::default()
        },
    );
    let mut s = sched_blocks(cfg, 10); // 160 tokens
    let now = Instant::now();
    assert!(invalid(s.submit(Request::new("t", vec![1; 4000], 200), now)).contains("max_context"));
    assert!(invalid(s.submit(Request::new("t", vec![1; 150], 20), now)).contains("KV capacity"));
    assert!(invalid(s.submit(Request::new("t", vec![], 2), now)).contains("prompt"));
    assert!(invalid(s.submit(Request::new("t", vec![64], 2), now)).contains("vocabulary"));
    assert!(invalid(s.submit(Request::new("t", vec![1], 0), now)).contains("max_tokens"));
    assert!(
        invalid(s.submit(Request::new("metered", vec![1; 50], 60), now)).contains("tokens/minute")
    );
    let mut r = Request::new("t", vec![1], 2);
    r.sampling = SamplingParams {
        temperature: -1.0,
        ..Default::default()
    };
    assert!(invalid(s.submit(r, now)).contains("temperature"));
    let mut r = Request::new("t", vec![1], 2);
    r.sampling = SamplingParams {
        top_p: 0.0,
        ..Default::default()
    };
    assert!(invalid(s.submit(r, now)).contains("top_p"));
    let mut r = Request::new("t", vec![1], 2);
    r.logprobs = Some(1000);
    assert!(invalid(s.submit(r, now)).contains("logprobs"));
    let mut r = Request::new("t", vec![1], 2);
    r.tenant_weight = 0.0;
    assert!(invalid(s.submit(r, now)).contains("tenant_weight"));
    let mut r = Request::new("t", vec![1], 2);
    r.stop_strings = vec![String::new()];
    assert!(invalid(s.submit(r, now)).contains("stop"));
    assert!(!s.has_work());
    // The largest request that fits does run.
    let mut ok = s.submit(Request::new("t", vec![1; 150], 11), now).unwrap();
    let mut t = now;
    while s.has_work() {
        s.step(t);
        t += DT;
    }
    let mut last = None;
    while let Some(ev) = ok.try_recv() {
        last = Some(ev);
    }
    assert!(matches!(last, Some(Event::Finished(_))));
}

#[test]
fn queue_limits_refuse_at_once_and_release() {
    let mut cfg = sched_config();
    cfg.max_waiting = 5;
    cfg.tenants.insert(
        "small".into(),
        TenantLimits {
            max_waiting: 2,
            ..TenantLimits::default()
        },
    );
    let mut s = sched(cfg);
    let now = Instant::now();
    let a = s.submit(Request::new("small", vec![1], 3), now).unwrap();
    let _b = s.submit(Request::new("small", vec![1], 3), now).unwrap();
    let (retry, why) = overloaded(s.submit(Request::new("small", vec![1], 3), now));
    assert!(
        retry > Duration::ZERO && why.contains("tenant queue"),
        "{why}"
    );
    let _c: Vec<_> = (0..3)
        .map(|_| s.submit(Request::new("other", vec![1], 3), now).unwrap())
        .collect();
    let (_, why) = overloaded(s.submit(Request::new("third", vec![1], 3), now));
    assert!(why.contains("engine queue"), "{why}");
    // Once requests leave the queue (start running), room opens up.
    drop(a);
    s.step(now);
    assert!(s.submit(Request::new("third", vec![1], 3), now).is_ok());
}

#[test]
fn token_rate_budget_gives_retry_after_and_refunds_unused_tokens() {
    let mut cfg = sched_config();
    // 600 tokens/minute = 10 tokens/second.
    cfg.tenants.insert(
        "m".into(),
        TenantLimits {
            tokens_per_minute: Some(600),
            ..TenantLimits::default()
        },
    );
    let mut s = sched(cfg);
    let t0 = Instant::now();
    let mut keep = Vec::new();
    for _ in 0..6 {
        keep.push(s.submit(Request::new("m", vec![1; 50], 50), t0).unwrap());
    }
    let (retry, why) = overloaded(s.submit(Request::new("m", vec![1; 50], 50), t0));
    assert!(why.contains("tokens/minute"));
    assert_eq!(retry, Duration::from_secs(10));
    // Other tenants are unaffected.
    assert!(s.submit(Request::new("x", vec![1; 50], 50), t0).is_ok());
    // After the hinted wait the bucket has refilled enough.
    assert!(s
        .submit(Request::new("m", vec![1; 50], 50), t0 + retry)
        .is_ok());
    assert!(s
        .submit(Request::new("m", vec![1; 50], 50), t0 + retry)
        .is_err());
    // A request cancelled before generating refunds its whole max_tokens.
    let mut r = Request::new("m", vec![1; 10], 90);
    r.request_id = Some("big".into());
    let t1 = t0 + retry + Duration::from_secs(10);
    let _big = s.submit(r, t1).unwrap();
    assert!(s.submit(Request::new("m", vec![1; 10], 90), t1).is_err());
    assert!(s.cancel("m", "big", t1));
    assert!(s.submit(Request::new("m", vec![1; 10], 80), t1).is_ok());
}

#[test]
fn duplicate_request_ids_are_refused_until_the_first_finishes() {
    let mut s = sched(sched_config());
    let now = Instant::now();
    let mut r = Request::new("t", vec![1, 2], 2);
    r.request_id = Some("x".into());
    let mut first = s.submit(r.clone(), now).unwrap();
    assert!(invalid(s.submit(r.clone(), now)).contains("already in use"));
    let mut other_tenant = r.clone();
    other_tenant.tenant = "u".into();
    assert!(s.submit(other_tenant, now).is_ok());
    assert!(s.cancel("t", "x", now));
    assert!(!s.cancel("t", "x", now));
    let mut evs = Vec::new();
    while let Some(e) = first.try_recv() {
        evs.push(e);
    }
    match evs.last() {
        Some(Event::Finished(f)) => assert_eq!(f.reason, FinishReason::Cancelled),
        other => panic!("{other:?}"),
    }
    assert!(s.submit(r, now).is_ok());
}
