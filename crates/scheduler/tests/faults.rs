//! Transactional steps: injected faults at every point leave no trace in the streams;
//! persistent failures fail only the requests that cause them.

mod common;

use common::*;
use weft_scheduler::fake::FakeFaults;
use weft_scheduler::{FaultPlan, FaultPoint, FinishReason, SchedulerConfig};

/// Varied requests; a third of them start with one of two shared system prompts, so
/// steps run with prefix hits (besides the hits of preempted requests resuming).
fn workload(seed: u64, n: usize) -> Vec<Spec> {
    let mut g = rng(seed);
    let systems = [
        prompt(&mut rng(seed + 1), 40),
        prompt(&mut rng(seed + 2), 64),
    ];
    (0..n)
        .map(|i| {
            let t = ["t0", "t1", "t2"][i % 3];
            let mut req = varied_request(&mut g, t, 1.0 + (i % 3) as f64, i);
            if chance(&mut g, 0.33) {
                let sys = &systems[below(&mut g, 2) as usize];
                req.prompt = [sys.clone(), req.prompt.clone()].concat();
            }
            Spec {
                arrival_step: below(&mut g, 200),
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            }
        })
        .collect()
}

/// Steps of the run started rows from cached blocks: shared system prompts and
/// preempted requests resuming.
fn assert_prefix_hits(r: &Run) {
    let p = r.sched.kv_pool().stats().prefix;
    let cached: usize = r
        .outcomes
        .iter()
        .filter_map(|o| o.finished.as_ref())
        .map(|f| f.usage.cached_prompt_tokens)
        .sum();
    eprintln!("prefix {p:?}, cached prompt tokens {cached}");
    assert!(cached > 500, "cached prompt tokens {cached}");
    assert!(p.hit_tokens as usize > cached, "no resume hits: {p:?}");
    assert!(r.sched.model().stats().prefix_rows > 20);
}

#[test]
fn random_faults_everywhere_leave_streams_unchanged() {
    let specs = workload(21, 500);
    let clean = run_plain(sched_config(), &specs);
    assert_clean(&clean);

    let mut cfg = sched_config();
    cfg.faults = FaultPlan::random(99, 0.05);
    cfg.max_step_retries = 60;
    let faults = FakeFaults {
        random: Some((5, 0.03)),
        fail_after_layer: 2,
        ..Default::default()
    };
    let faulty = run(cfg, fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&faulty);
    let st = faulty.sched.stats();
    assert!(st.rollbacks > 50, "rollbacks {}", st.rollbacks);
    assert_eq!(st.failed_steps, 0);
    assert!(st.preemptions > 0);
    assert_prefix_hits(&faulty);
    let fake = faulty.sched.model().stats();
    assert!(
        fake.failed_forwards >= 5 && fake.failed_commits >= 5,
        "{fake:?}"
    );
    for p in FaultPoint::ALL {
        assert!(
            faulty.sched.faults().reached(p) > 100,
            "{p:?} reached {}",
            faulty.sched.faults().reached(p)
        );
    }
    assert_same_streams(&clean, &faulty);
}

#[test]
fn each_fault_point_alone_is_retried() {
    let specs = workload(4, 120);
    let clean = run_plain(sched_config(), &specs);
    for point in FaultPoint::ALL {
        let mut cfg = sched_config();
        cfg.faults = FaultPlan::default().at(point, 3).at(point, 4).at(point, 50);
        let r = run_plain(cfg, &specs);
        assert_clean(&r);
        assert_eq!(r.sched.stats().rollbacks, 3, "{point:?}");
        assert_same_streams(&clean, &r);
    }
    // Mid-forward (after layer 1) and model-commit faults.
    let faults = FakeFaults {
        forward_fail_calls: vec![2, 3, 30],
        fail_after_layer: 1,
        commit_fail_calls: vec![7, 8, 9],
        ..Default::default()
    };
    let r = run(sched_config(), fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_eq!(r.sched.stats().rollbacks, 6);
    assert_same_streams(&clean, &r);
}

#[test]
fn poisoned_requests_fail_alone_and_others_continue() {
    let mut specs = workload(8, 200);
    let poison = 63u32;
    for s in specs.iter_mut() {
        if s.req.prompt[0] == poison {
            s.req.prompt[0] = 1;
        }
    }
    let poisoned = [5usize, 77, 150];
    for &i in &poisoned {
        specs[i].req.prompt[0] = poison;
    }
    let clean = run_plain(sched_config(), &specs);
    let mut cfg = sched_config();
    cfg.max_step_retries = 2;
    let faults = FakeFaults {
        poison_token: Some(poison),
        ..Default::default()
    };
    let r = run(cfg, fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_eq!(r.sched.stats().failed_requests, poisoned.len() as u64);
    for (i, (x, y)) in r.outcomes.iter().zip(&clean.outcomes).enumerate() {
        let f = x.finished.as_ref().unwrap();
        if poisoned.contains(&i) {
            assert_eq!(f.reason, FinishReason::Error);
            assert!(x.tokens.is_empty());
            let msg = f.error.as_deref().unwrap_or("");
            assert!(
                msg.contains("step failed") && msg.contains("injected"),
                "{msg}"
            );
        } else {
            assert_eq!(
                x.tokens, y.tokens,
                "request {i} was disturbed by a poisoned neighbour"
            );
            assert_eq!(f.reason, y.finished.as_ref().unwrap().reason);
        }
    }
}

/// Faults while rows verify drafts (after the pool truncated a rejected draft, after
/// sampling part of a draft) roll back like any other step: streams equal the
/// fault-free run without drafts.
#[test]
fn faults_with_speculation_leave_streams_unchanged() {
    let specs = workload(8, 300);
    let fake = looping_fake();
    let clean = run(
        sched_config(),
        fake.clone(),
        FakeFaults::default(),
        &specs,
        |_, _, _| {},
    );
    assert_clean(&clean);
    let mut cfg = sched_config();
    cfg.speculate = 2;
    cfg.speculate_step_tokens = usize::MAX;
    cfg.faults = FaultPlan::random(17, 0.05);
    cfg.max_step_retries = 60;
    let faults = FakeFaults {
        random: Some((3, 0.03)),
        fail_after_layer: 1,
        ..Default::default()
    };
    let faulty = run(cfg, fake, faults, &specs, |_, _, _| {});
    assert_clean(&faulty);
    let st = faulty.sched.stats();
    assert!(st.rollbacks > 30, "rollbacks {}", st.rollbacks);
    assert!(st.accepted_tokens > 100, "{st:?}");
    assert!(st.preemptions > 0);
    assert_prefix_hits(&faulty);
    assert_same_streams(&clean, &faulty);
}

/// Allocation failures: a forward feeding more tokens than the device has memory for
/// fails with `OutOfMemory`. The scheduler frees what the model can spare and splits
/// the batch at once (never retrying the same rows), the halves commit, and every
/// stream is what it is with memory to spare; no request fails.
#[test]
fn out_of_memory_splits_the_batch_and_loses_nothing() {
    let specs = workload(31, 300);
    let clean = run_plain(sched_config(), &specs);
    assert_clean(&clean);
    let mut cfg = sched_config();
    cfg.max_step_retries = 50;
    let faults = FakeFaults {
        // A prefill chunk (64) always fits alone; a full step (256) never does.
        memory_tokens: Some(96),
        fail_after_layer: 1,
        ..Default::default()
    };
    let r = run(cfg, fake_config(), faults, &specs, |_, s, _| audit_pool(s));
    assert_clean(&r);
    let st = r.sched.stats();
    let fake = r.sched.model().stats();
    eprintln!("{st:?}\n{fake:?}");
    assert!(st.out_of_memory > 20, "out of memory {}", st.out_of_memory);
    assert_eq!(st.out_of_memory, fake.out_of_memory);
    assert_eq!(fake.memory_releases, fake.out_of_memory);
    assert_eq!(st.rollbacks, st.out_of_memory);
    assert_eq!((st.failed_steps, st.failed_requests), (0, 0));
    assert_eq!(fake.repeated_after_oom, 0, "a batch was retried as it was");
    assert_same_streams(&clean, &r);
}

/// A row that does not fit even alone fails by itself, after its retries, with an
/// error saying so; the rows around it finish exactly as without it.
#[test]
fn a_row_too_large_for_memory_fails_alone() {
    let mut g = rng(12);
    let specs: Vec<Spec> = [3usize, 5, 30, 4, 6]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut req = weft_scheduler::Request::new("t0", prompt(&mut g, len), 12);
            req.ignore_eos = true;
            req.request_id = Some(format!("r{i}"));
            Spec::at(0, req)
        })
        .collect();
    let clean = run_plain(sched_config(), &specs);
    let faults = FakeFaults {
        memory_tokens: Some(8),
        ..Default::default()
    };
    let r = run(sched_config(), fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_eq!(r.sched.stats().failed_requests, 1);
    for (i, (x, y)) in r.outcomes.iter().zip(&clean.outcomes).enumerate() {
        let f = x.finished.as_ref().unwrap();
        if i == 2 {
            assert_eq!(f.reason, FinishReason::Error);
            let msg = f.error.as_deref().unwrap_or("");
            assert!(
                msg.contains("ran out of memory for this request alone"),
                "{msg}"
            );
            assert!(x.tokens.is_empty());
        } else {
            assert_eq!(x.tokens, y.tokens, "request {i}");
            assert_eq!(f.reason, FinishReason::Length);
        }
    }
}

/// A long run under 10,000+ injected step faults — at every scheduler point, torn
/// forwards, failed commits, allocation failures (every 11th forward), in plain and
/// pipelined steps — with preemption (a tight pool) and prefix hits: no token is lost
/// or duplicated (every stream equals the fault-free run's), no request fails, no
/// block leaks, the pool's invariants hold throughout, and the fake model's shadow KV
/// (every slot read back through the tables) never sees a wrong block. This run found
/// pipelined steps reusing a rolled-back predecessor's blocks in their tables.
#[test]
fn ten_thousand_step_faults_lose_nothing() {
    let specs = workload(77, 500);
    // Small steps and a tight pool: many steps, and preemption.
    let small = SchedulerConfig {
        max_batch_rows: 8,
        max_step_tokens: 48,
        prefill_chunk: 32,
        ..sched_config()
    };
    let fake = fake_blocks(48);
    let clean = run(
        small.clone(),
        fake.clone(),
        FakeFaults::default(),
        &specs,
        |_, _, _| {},
    );
    assert_clean(&clean);
    let mut cfg = small;
    cfg.faults = FaultPlan::random(2024, 0.3);
    cfg.max_step_retries = 500;
    // Every-step state fingerprints would cost more than the rest of the run; the
    // tests above check rollbacks restore the exact state.
    cfg.verify_rollback = false;
    let faults = FakeFaults {
        random: Some((9, 0.1)),
        fail_after_layer: 2,
        oom_calls: (5..1_000_000).step_by(11).collect(),
        ..Default::default()
    };
    let mut audits = 0u64;
    let faulty = run(cfg, fake, faults, &specs, |step, s, _| {
        if step % 5 == 0 {
            audit_pool(s);
            audits += 1;
        }
    });
    assert_clean(&faulty);
    let st = faulty.sched.stats();
    let fake = faulty.sched.model().stats();
    eprintln!("steps {} {st:?}\n{fake:?}", faulty.steps);
    assert!(st.rollbacks >= 10_000, "only {} faults", st.rollbacks);
    assert!(st.out_of_memory > 500, "{}", st.out_of_memory);
    assert!(
        fake.failed_forwards > 1000 && fake.failed_commits > 100,
        "{fake:?}"
    );
    assert!(st.pipelined_steps > 0);
    assert_eq!(st.failed_requests, 0);
    assert!(st.preemptions > 0);
    assert!(audits > 100);
    assert_same_streams(&clean, &faulty);
}

/// Random faults at every point with a sliding-window group much smaller than the
/// full one (it holds windows only, and is often the group that runs out): every
/// rollback restores both groups, no request fails, and every stream equals the
/// fault-free run with full attention only; the pool is audited every few steps.
#[test]
fn random_faults_with_a_small_sliding_group_leave_streams_unchanged() {
    let specs = workload(29, 300);
    let clean = run_plain(sched_config(), &specs);
    assert_clean(&clean);

    let mut cfg = sched_config();
    cfg.faults = FaultPlan::random(13, 0.05);
    cfg.max_step_retries = 60;
    let faults = FakeFaults {
        random: Some((17, 0.03)),
        fail_after_layer: 1,
        ..Default::default()
    };
    let mut fake = fake_config();
    fake.sliding_window = Some(20);
    fake.sliding_blocks = Some(40);
    let mut tight = 0;
    let faulty = run(cfg, fake, faults, &specs, |step, s, _| {
        let pool = s.kv_pool();
        tight += usize::from(pool.group(1).expect("sliding").available() < 4);
        if step % 4 == 0 {
            audit_pool(s);
        }
    });
    assert_clean(&faulty);
    let st = faulty.sched.stats();
    assert!(st.rollbacks > 20, "rollbacks {}", st.rollbacks);
    assert_eq!(st.failed_steps, 0);
    assert_eq!(st.failed_requests, 0);
    assert!(st.pipelined_steps > 0);
    assert!(tight > 0, "the sliding group never ran short");
    assert_same_streams(&clean, &faulty);
}

/// Random faults at every point with a sliding-window KV group beside the full one:
/// rollbacks restore both groups' tables (the sliding group's dropped blocks come
/// back), so every stream equals the fault-free full-attention run.
#[test]
fn random_faults_with_a_sliding_window_group_leave_streams_unchanged() {
    let specs = workload(23, 300);
    let clean = run_plain(sched_config(), &specs);
    assert_clean(&clean);

    let mut cfg = sched_config();
    cfg.faults = FaultPlan::random(7, 0.05);
    cfg.max_step_retries = 60;
    let faults = FakeFaults {
        random: Some((11, 0.03)),
        fail_after_layer: 2,
        ..Default::default()
    };
    let mut fake = fake_config();
    fake.sliding_window = Some(20);
    let faulty = run(cfg, fake, faults, &specs, |_, _, _| {});
    assert_clean(&faulty);
    let st = faulty.sched.stats();
    assert!(st.rollbacks > 20, "rollbacks {}", st.rollbacks);
    assert_eq!(st.failed_steps, 0);
    assert_same_streams(&clean, &faulty);
}
