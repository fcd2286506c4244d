//! Simulations with the fake model: thousands of requests from several tenants, skewed
//! arrival, long and short prompts, cancellations, deadlines and KV pressure.

mod common;

use std::collections::HashMap;

use common::*;
use weft_scheduler::fake::{FakeConfig, FakeFaults, FakeModel};
use weft_scheduler::{FinishReason, Request, Scheduler, TenantLimits};

/// One tenant floods at step 0; others arrive steadily; a few requests are cancelled,
/// dropped, or carry tight deadlines.
fn mixed_workload(seed: u64, flood: usize, steady: usize) -> Vec<Spec> {
    let mut g = rng(seed);
    let mut specs = Vec::new();
    for i in 0..flood {
        let req = varied_request(&mut g, "flood", 1.0, i);
        specs.push(Spec {
            arrival_step: below(&mut g, 5),
            req,
            cancel_after: None,
            drop_after: None,
            deadline_after: None,
        });
    }
    for (t, w) in [("alpha", 1.0), ("beta", 2.0), ("gamma", 1.0)] {
        for i in 0..steady {
            let req = varied_request(&mut g, t, w, i);
            specs.push(Spec {
                arrival_step: (i as u64) * 4 + below(&mut g, 4),
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            });
        }
    }
    for s in specs.iter_mut() {
        match below(&mut g, 40) {
            0 => s.cancel_after = Some(below(&mut g, 60)),
            1 => s.drop_after = Some(below(&mut g, 60)),
            2 => s.deadline_after = Some(1 + below(&mut g, 80)),
            _ => {}
        }
    }
    specs
}

/// The same requests without cancellations or deadlines: the reference streams.
fn undisturbed(specs: &[Spec]) -> Vec<Spec> {
    specs
        .iter()
        .map(|s| Spec {
            cancel_after: None,
            drop_after: None,
            deadline_after: None,
            ..s.clone()
        })
        .collect()
}

#[test]
fn mixed_workload_under_kv_pressure_matches_unpressured_run() {
    let specs = mixed_workload(1, 1500, 300);
    assert!(specs.len() >= 2000);

    // Reference: KV never runs out, a larger batch, nothing cancelled.
    let mut big = sched_config();
    big.max_batch_rows = 128;
    big.max_step_tokens = 1024;
    let reference = run_blocks(big, 100_000, &undisturbed(&specs));
    assert_clean(&reference);
    assert_eq!(reference.sched.stats().preemptions, 0);

    let pressured = run_plain(sched_config(), &specs);
    assert_clean(&pressured);
    let st = pressured.sched.stats();
    assert!(
        st.preemptions > 50,
        "workload should preempt, got {}",
        st.preemptions
    );

    let mut compared = 0;
    let mut preempted_compared = 0;
    let mut reasons: HashMap<FinishReason, usize> = HashMap::new();
    for (i, (p, r)) in pressured
        .outcomes
        .iter()
        .zip(&reference.outcomes)
        .enumerate()
    {
        let rf = r.finished.as_ref().expect("reference finishes everything");
        assert!(is_natural(rf), "reference request {i} ended with {rf:?}");
        if p.dropped {
            assert!(
                r.tokens.starts_with(&p.tokens),
                "dropped request {i} streamed tokens not in its reference"
            );
            continue;
        }
        let pf = p.finished.as_ref().expect("finished");
        *reasons.entry(pf.reason).or_default() += 1;
        assert_eq!(
            pf.usage.generated_tokens,
            p.tokens.len(),
            "request {i}: usage vs stream"
        );
        assert_eq!(pf.usage.prompt_tokens, specs[i].req.prompt.len());
        if is_natural(pf) {
            assert_eq!(
                p.tokens, r.tokens,
                "request {i} tokens differ (preemptions {})",
                pf.usage.preemptions
            );
            assert_eq!(p.text, r.text, "request {i} text differs");
            assert_eq!(pf.reason, rf.reason);
            assert_eq!(pf.stop, rf.stop);
            assert_eq!(
                p.text,
                expected_text(&specs[i].req, p, pf),
                "request {i} text vs detokenized ids"
            );
            if let Some(n) = specs[i].req.logprobs {
                assert_eq!(
                    p.logprobs.len(),
                    p.tokens.len(),
                    "request {i}: one logprob per token"
                );
                for (lp, t) in p.logprobs.iter().zip(&p.tokens) {
                    assert_eq!(lp.id, *t);
                    assert!(lp.logprob <= 0.0 && lp.top.len() == n);
                    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
                }
            } else {
                assert!(p.logprobs.is_empty());
            }
            for s in &specs[i].req.stop_strings {
                assert!(
                    !p.text.contains(s.as_str()),
                    "request {i} emitted stop string {s:?}"
                );
            }
            compared += 1;
            if pf.usage.preemptions > 0 {
                preempted_compared += 1;
            }
        } else {
            assert!(
                matches!(pf.reason, FinishReason::Cancelled | FinishReason::Deadline),
                "request {i}: unexpected {pf:?}"
            );
            assert!(
                r.tokens.starts_with(&p.tokens),
                "cut-short request {i} is not a prefix of its reference"
            );
        }
    }
    eprintln!(
        "compared {compared}, of them preempted {preempted_compared}; finishes {reasons:?}; \
         steps {}; preemptions {}",
        pressured.steps, st.preemptions
    );
    assert!(compared > 1800, "compared {compared}");
    assert!(
        preempted_compared > 20,
        "preempted requests compared: {preempted_compared}"
    );
    for r in [
        FinishReason::Length,
        FinishReason::Stop,
        FinishReason::Eos,
        FinishReason::Cancelled,
        FinishReason::Deadline,
    ] {
        assert!(
            reasons.get(&r).copied().unwrap_or(0) > 0,
            "no request finished with {r:?}: {reasons:?}"
        );
    }
    // Queue bounded by what was admitted plus rows pushed back by preemption.
    assert!(pressured.max_waiting_seen <= specs.len());
}

/// Greedy outputs checked against the fake model directly, not against another run of
/// the scheduler: each generated token is the argmax after the exact history.
#[test]
fn greedy_streams_equal_direct_oracle() {
    let mut g = rng(7);
    let specs: Vec<Spec> = (0..300)
        .map(|i| {
            let len = if i % 5 == 0 {
                150 + below(&mut g, 200)
            } else {
                1 + below(&mut g, 30)
            } as usize;
            let mut req = Request::new(
                ["a", "b", "c"][i % 3],
                prompt(&mut g, len),
                1 + below(&mut g, 40) as usize,
            );
            req.ignore_eos = i % 2 == 0;
            Spec {
                arrival_step: below(&mut g, 100),
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            }
        })
        .collect();
    let r = run_plain(sched_config(), &specs);
    assert_clean(&r);
    assert!(r.sched.stats().preemptions > 0);
    let oracle = FakeModel::new(fake_config());
    for (s, o) in specs.iter().zip(&r.outcomes) {
        let mut hist = s.req.prompt.clone();
        let mut want = Vec::new();
        while want.len() < s.req.max_tokens {
            let l = oracle.logits_for_history(&hist);
            let mut best = 0;
            for (i, v) in l.iter().enumerate() {
                if *v > l[best] {
                    best = i;
                }
            }
            let t = best as u32;
            want.push(t);
            hist.push(t);
            if t == 0 && !s.req.ignore_eos {
                break;
            }
        }
        assert_eq!(o.tokens, want);
    }
}

/// Service of continuously backlogged tenants, measured from their streams, stays within
/// the VTC bound of their weights; nobody starves.
#[test]
fn fair_share_follows_weights_within_vtc_bound() {
    let mut g = rng(3);
    let mut specs = Vec::new();
    // "heavy" and "light" (weight 2) both flood; "late" floods later; "small" trickles.
    for (t, w, start, n) in [
        ("heavy", 1.0, 0u64, 1200usize),
        ("light", 2.0, 0, 1200),
        ("late", 1.0, 300, 600),
    ] {
        for _ in 0..n {
            let len = 1 + below(&mut g, 60) as usize;
            let mut req = Request::new(t, prompt(&mut g, len), 1 + below(&mut g, 30) as usize);
            req.tenant_weight = w;
            req.ignore_eos = true;
            specs.push(Spec {
                arrival_step: start,
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            });
        }
    }
    for i in 0..60 {
        let mut req = Request::new("small", prompt(&mut g, 10), 5);
        req.ignore_eos = true;
        specs.push(Spec {
            arrival_step: 10 + i * 20,
            req,
            cancel_after: None,
            drop_after: None,
            deadline_after: None,
        });
    }
    let cfg = sched_config();
    let (w_in, w_out) = (cfg.vtc.input, cfg.vtc.output);
    let max_prompt = 60.0;
    let max_out = 30.0;
    // Sheng et al.: two backlogged clients' weighted service differs by at most
    // 2 * max(w_in * L_in, w_out * M), M the tokens one batch can hold. Our batch holds
    // at most max_batch_rows rows of max_out output tokens each.
    let m = (cfg.max_batch_rows as f64) * max_out;
    let bound = 2.0 * (w_in * max_prompt).max(w_out * m);

    let weights: HashMap<&str, f64> = [
        ("heavy", 1.0),
        ("light", 2.0),
        ("late", 1.0),
        ("small", 1.0),
    ]
    .into();
    let mut window: Option<HashMap<String, f64>> = None;
    let mut window_closed = false;
    let mut max_gap: f64 = 0.0;
    let mut checked_steps = 0;
    let tenant_of: Vec<String> = specs.iter().map(|s| s.req.tenant.clone()).collect();
    let prompt_len: Vec<usize> = specs.iter().map(|s| s.req.prompt.len()).collect();
    let r = run(
        cfg,
        fake_blocks(2000),
        FakeFaults::default(),
        &specs,
        |_, sched, outs| {
            // Normalized service from the streams: prompt when the first token arrives,
            // each generated token as it arrives.
            let mut service: HashMap<String, f64> = HashMap::new();
            for (i, o) in outs.iter().enumerate() {
                let t = &tenant_of[i];
                let mut s = w_out * o.tokens.len() as f64;
                if !o.tokens.is_empty() {
                    s += w_in * prompt_len[i] as f64;
                }
                *service.entry(t.clone()).or_default() += s / weights[t.as_str()];
            }
            let st = sched.stats();
            let backlogged: Vec<&str> = ["heavy", "light", "late"]
                .into_iter()
                .filter(|t| st.tenants.iter().any(|x| x.tenant == *t && x.waiting > 0))
                .collect();
            if backlogged.len() == 3 && !window_closed {
                // Service since the moment all three became backlogged together.
                let base = window.get_or_insert_with(|| service.clone());
                let d: Vec<f64> = backlogged
                    .iter()
                    .map(|t| service[*t] - base.get(*t).copied().unwrap_or(0.0))
                    .collect();
                let gap = d.iter().cloned().fold(f64::MIN, f64::max)
                    - d.iter().cloned().fold(f64::MAX, f64::min);
                max_gap = max_gap.max(gap);
                checked_steps += 1;
            } else if window.is_some() {
                window_closed = true;
            }
        },
    );
    assert_clean(&r);
    assert!(
        checked_steps > 100,
        "all three tenants should be backlogged together for a while ({checked_steps})"
    );
    eprintln!("gap {max_gap} bound {bound} checked {checked_steps}");
    assert!(
        max_gap <= bound,
        "service gap {max_gap} exceeds VTC bound {bound}"
    );
    // Starvation: each trickling request starts within a bounded number of steps.
    for (s, o) in specs.iter().zip(&r.outcomes) {
        if s.req.tenant == "small" {
            let f = o.finished.as_ref().unwrap();
            assert_eq!(f.reason, FinishReason::Length);
            assert!(
                o.first_token_step.unwrap() <= 40,
                "small request waited {:?} steps",
                o.first_token_step
            );
        }
    }
}

/// Per-tenant running caps hold in every step; the queue stays bounded by the limits.
#[test]
fn tenant_running_cap_holds() {
    let mut g = rng(11);
    let specs: Vec<Spec> = (0..400)
        .map(|i| {
            let mut req = Request::new(["capped", "free"][i % 2], prompt(&mut g, 20), 10);
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
    cfg.tenants.insert(
        "capped".into(),
        TenantLimits {
            max_running: 5,
            max_waiting: 1000,
            tokens_per_minute: None,
        },
    );
    let mut max_capped = 0;
    let r = run(
        cfg,
        fake_blocks(10_000),
        FakeFaults::default(),
        &specs,
        |_, s: &Scheduler<FakeModel>, _| {
            for t in s.stats().tenants {
                if t.tenant == "capped" {
                    max_capped = max_capped.max(t.running);
                }
            }
        },
    );
    assert_clean(&r);
    assert_eq!(max_capped, 5);
}

fn drain(s: &mut weft_scheduler::EventStream, into: &mut Vec<weft_scheduler::Event>) {
    while let Some(e) = s.try_recv() {
        into.push(e);
    }
}

fn finished_of(evs: &[weft_scheduler::Event]) -> weft_scheduler::Finished {
    match evs.last() {
        Some(weft_scheduler::Event::Finished(f)) => f.clone(),
        other => panic!("no final event: {other:?}"),
    }
}

/// Within a tenant, higher priority is admitted first and preempted last.
#[test]
fn priority_orders_admission_and_preemption() {
    use std::sync::Arc;
    use std::time::Instant;
    use weft_scheduler::fake::FakeDetokenizer;

    // Admission: one row at a time; the later, higher-priority request goes first.
    let mut cfg = sched_config();
    cfg.max_batch_rows = 1;
    let mut s = Scheduler::new(
        cfg,
        FakeModel::new(fake_config()),
        Arc::new(FakeDetokenizer),
    )
    .unwrap();
    let t0 = Instant::now();
    let mut low = Request::new("t", vec![1, 2, 3], 5);
    low.ignore_eos = true;
    let mut high = low.clone();
    high.priority = 5;
    let mut ls = s.submit(low.clone(), t0).unwrap();
    let mut hs = s.submit(high.clone(), t0).unwrap();
    let (mut le, mut he) = (Vec::new(), Vec::new());
    let mut step = 0;
    let mut high_done_at = None;
    let mut low_first_at = None;
    while s.has_work() {
        s.step(t0 + DT * step);
        drain(&mut ls, &mut le);
        drain(&mut hs, &mut he);
        if high_done_at.is_none() && matches!(he.last(), Some(weft_scheduler::Event::Finished(_))) {
            high_done_at = Some(step);
        }
        if low_first_at.is_none() && !le.is_empty() {
            low_first_at = Some(step);
        }
        step += 1;
    }
    assert!(high_done_at.unwrap() < low_first_at.unwrap());

    // Preemption: KV for about one row; the older but lower-priority row is the victim.
    let mut s = Scheduler::new(
        sched_config(),
        FakeModel::new(fake_blocks(4)),
        Arc::new(FakeDetokenizer),
    )
    .unwrap();
    let mut low = Request::new("t", vec![7; 16], 40);
    low.ignore_eos = true;
    let mut high = low.clone();
    high.priority = 5;
    let mut ls = s.submit(low, t0).unwrap();
    let mut hs = s.submit(high, t0).unwrap();
    let (mut le, mut he) = (Vec::new(), Vec::new());
    let mut step = 0;
    while s.has_work() {
        s.step(t0 + DT * step);
        drain(&mut ls, &mut le);
        drain(&mut hs, &mut he);
        step += 1;
    }
    let (lf, hf) = (finished_of(&le), finished_of(&he));
    assert_eq!(hf.usage.preemptions, 0);
    assert!(lf.usage.preemptions >= 1);
    assert_eq!(
        (lf.usage.generated_tokens, hf.usage.generated_tokens),
        (40, 40)
    );
    let st = s.stats();
    assert_eq!((st.kv_blocks_used, st.kv_blocks_total), (0, 4));
    assert_eq!(st.kv_blocks_free + st.kv_blocks_cached, 4);
}

/// Prefix reuse: a tenant's second request that shares a prefix with its first
/// starts from the cached state (block-aligned), produces exactly the tokens a
/// cold run gives, and another tenant never hits that entry.
#[test]
fn prefix_reuse_is_exact_and_tenant_scoped() {
    use std::sync::Arc;
    use std::time::Instant;
    use weft_scheduler::fake::FakeDetokenizer;

    let run_one = |s: &mut Scheduler<FakeModel>, req: Request, t0: Instant| {
        let mut st = s.submit(req, t0).unwrap();
        let mut evs = Vec::new();
        let mut step = 0;
        while s.has_work() {
            s.step(t0 + DT * step);
            drain(&mut st, &mut evs);
            step += 1;
        }
        let ids: Vec<u32> = evs
            .iter()
            .filter_map(|e| match e {
                weft_scheduler::Event::Token(d) => Some(d.ids.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        (ids, finished_of(&evs))
    };
    let t0 = Instant::now();
    let shared: Vec<u32> = (1..=30).collect();
    let mut first = Request::new("a", shared.clone(), 6);
    first.ignore_eos = true;
    let mut second = Request::new("a", [shared.clone(), vec![40, 41, 42]].concat(), 6);
    second.ignore_eos = true;
    let mut other = second.clone();
    other.tenant = "b".into();

    // Blocks of 8 tokens.
    let fake = FakeConfig {
        kv_block_size: 8,
        ..fake_config()
    };
    let mk = |cfg: weft_scheduler::SchedulerConfig| {
        Scheduler::new(cfg, FakeModel::new(fake.clone()), Arc::new(FakeDetokenizer)).unwrap()
    };
    // Cold references for the second prompt: a fresh pool, and a pool with prefix
    // caching off that ran the first request before.
    let mut cold = mk(sched_config());
    let (want, cold_fin) = run_one(&mut cold, second.clone(), t0);
    assert_eq!(cold_fin.usage.cached_prompt_tokens, 0);
    let mut off = mk(weft_scheduler::SchedulerConfig {
        prefix_cache: false,
        ..sched_config()
    });
    run_one(&mut off, first.clone(), t0);
    let (got_off, f_off) = run_one(&mut off, second.clone(), t0);
    assert_eq!(
        (got_off, f_off.usage.cached_prompt_tokens),
        (want.clone(), 0)
    );
    assert_eq!(off.kv_pool().stats().groups[0].cached, 0);

    let mut s = mk(sched_config());
    let (_, f1) = run_one(&mut s, first, t0);
    assert_eq!(f1.usage.cached_prompt_tokens, 0);
    let (got, f2) = run_one(&mut s, second.clone(), t0);
    // The first request's 30 prompt tokens and 5 fed-back generated ones sit in the
    // pool; the second prompt shares 30 of them, and reuse is block-aligned (8).
    assert_eq!(f2.usage.cached_prompt_tokens, 24);
    assert_eq!(got, want, "a prefix hit changed the output");
    assert!(s.model().stats().prefix_rows >= 1);
    let (got_b, fb) = run_one(&mut s, other, t0);
    assert_eq!(
        fb.usage.cached_prompt_tokens, 0,
        "tenant b hit tenant a's prefix"
    );
    assert_eq!(got_b, want);
    // The same prompt again from tenant a: every full block but the one holding the
    // last prompt token (which the forward must compute) comes from the cache.
    let (again, fa) = run_one(&mut s, second, t0);
    assert_eq!(fa.usage.cached_prompt_tokens, 32);
    assert_eq!(again, want);
    let p = s.kv_pool().stats();
    assert_eq!(p.prefix.hit_tokens, 24 + 32);
    assert_eq!((p.groups[0].used, p.sequences), (0, 0));
    assert!(p.groups[0].cached > 0);
    s.kv_pool().check_invariants().unwrap();
    assert!(
        s.model().violations().is_empty(),
        "{:?}",
        s.model().violations()
    );
}

/// Continuous batching: a request arriving while other rows decode is prefilled in
/// the next step, not after the running rows finish.
#[test]
fn joiner_starts_while_others_decode() {
    let mut g = rng(5);
    let mut specs: Vec<Spec> = (0..16)
        .map(|_| {
            let mut req = Request::new("a", prompt(&mut g, 20), 200);
            req.ignore_eos = true;
            Spec::at(0, req)
        })
        .collect();
    let mut late = Request::new("a", prompt(&mut g, 20), 5);
    late.ignore_eos = true;
    specs.push(Spec::at(30, late));
    let r = run_blocks(sched_config(), 10_000, &specs);
    assert_clean(&r);
    let first = r.outcomes[16]
        .first_token_step
        .expect("late request got a token");
    assert!(
        first <= 1,
        "late joiner waited {first} steps for its first token"
    );
}

/// A short prompt that does not fit whole in the budget left by a step's other
/// prefill waits for the next step instead of starting with a partial chunk; a
/// prompt longer than one chunk still starts with whatever budget is left.
#[test]
fn short_prompts_are_not_split_across_steps() {
    let specs_of = |second_len: usize| -> Vec<Spec> {
        let mut g = rng(9);
        [60, second_len]
            .iter()
            .map(|&n| {
                let mut req = Request::new("a", prompt(&mut g, n), 3);
                req.ignore_eos = true;
                Spec::at(0, req)
            })
            .collect()
    };
    let mut cfg = sched_config();
    cfg.max_step_tokens = 100;
    cfg.prefill_chunk = 64;
    // One step per call: pipelined, the call that runs step 0 also queues step 1,
    // where the second prompt starts whole.
    cfg.pipeline = false;
    for (second_len, started_in_step_0) in [(60, 1), (200, 2)] {
        let mut running_after_first = None;
        let r = run(
            cfg.clone(),
            fake_blocks(1000),
            FakeFaults::default(),
            &specs_of(second_len),
            |step, s: &Scheduler<FakeModel>, _| {
                if step == 0 {
                    running_after_first = Some(s.stats().running);
                }
            },
        );
        assert_clean(&r);
        assert_eq!(
            running_after_first,
            Some(started_in_step_0),
            "second prompt of {second_len} tokens"
        );
    }
}

/// `decode_prefill_tokens` bounds the prefill riding along with decoding rows
/// (their inter-token latency), and only then: a step without decoding rows
/// still fills `max_step_tokens`.
#[test]
fn decode_prefill_tokens_bound_prefill_beside_decoding_rows() {
    let mut g = rng(21);
    let mut req = |n: usize, max_tokens: usize| {
        let mut r = Request::new("a", prompt(&mut g, n), max_tokens);
        r.ignore_eos = true;
        r
    };
    // Two 300-token prompts at once (nobody decodes yet), then a 500-token one
    // arriving while both decode.
    let specs = vec![
        Spec::at(0, req(300, 40)),
        Spec::at(0, req(300, 40)),
        Spec::at(3, req(500, 4)),
    ];
    let mut cfg = sched_config();
    cfg.max_step_tokens = 1024;
    cfg.prefill_chunk = 512;
    // Tokens are counted per step call as the fake computes them: a pipelined call
    // would also count the decode step it queues behind the one it commits.
    cfg.pipeline = false;
    for cap in [None, Some(64)] {
        cfg.decode_prefill_tokens = cap;
        let mut per_step = vec![];
        let mut seen = 0;
        let r = run(
            cfg.clone(),
            fake_blocks(1000),
            FakeFaults::default(),
            &specs,
            |_, s: &Scheduler<FakeModel>, _| {
                let t = s.model().stats().tokens;
                per_step.push(t - seen);
                seen = t;
            },
        );
        assert_clean(&r);
        assert_eq!(per_step[0], 600, "{cap:?}: both prompts in the first step");
        let late = &r.outcomes[2];
        let waited = late.first_token_step.expect("first token");
        match cap {
            None => {
                assert!(per_step.contains(&502), "{cap:?}: {per_step:?}");
                assert!(waited <= 1, "{cap:?}: waited {waited} steps");
            }
            Some(c) => {
                // Two decoding rows plus at most `c` prefill tokens per step
                // until the late prompt is in.
                assert!(
                    per_step[1..].iter().all(|&n| n <= 2 + c as u64),
                    "{cap:?}: {per_step:?}"
                );
                assert!(waited >= 500 / c as u64, "{cap:?}: waited {waited} steps");
            }
        }
    }
}

/// Speculative decoding changes how many steps a stream takes, never its tokens: the same
/// mixed workload (greedy and sampled, stop strings, logprobs, KV pressure, preemption)
/// streams identically with and without drafts, on a model whose greedy output loops
/// (drafts mostly accepted) and on one whose output never repeats (drafts mostly
/// rejected).
#[test]
fn speculation_keeps_every_stream_and_saves_steps_on_repetitive_output() {
    use weft_scheduler::fake::FakeLogits;
    let specs = undisturbed(&mixed_workload(3, 400, 100));
    for fake in [looping_fake(), fake_config()] {
        let logits = fake.logits;
        let plain = run(
            sched_config(),
            fake.clone(),
            FakeFaults::default(),
            &specs,
            |_, _, _| {},
        );
        assert_clean(&plain);
        let mut cfg = sched_config();
        cfg.speculate = 3;
        cfg.speculate_step_tokens = usize::MAX;
        let spec = run(cfg, fake, FakeFaults::default(), &specs, |_, _, _| {});
        assert_clean(&spec);
        let st = spec.sched.stats();
        assert!(st.preemptions > 0, "workload should preempt");
        assert_eq!(plain.sched.stats().draft_tokens, 0);
        assert_same_streams(&plain, &spec);
        let rate = st.accepted_tokens as f64 / st.draft_tokens.max(1) as f64;
        eprintln!(
            "{logits:?}: {} drafted, {} accepted ({rate:.2}), steps {} -> {}",
            st.draft_tokens, st.accepted_tokens, plain.steps, spec.steps
        );
        if logits == FakeLogits::LastToken {
            assert!(st.draft_tokens > 1000, "{st:?}");
            assert!(rate > 0.5, "looping output should accept most drafts");
        } else {
            // Few recurring pairs, nearly all rejected: the rejection path ran.
            assert!(st.draft_tokens > 20, "{st:?}");
        }
    }
    // Steps saved: a burst of greedy requests on looping output.
    let mut g = rng(5);
    let burst: Vec<Spec> = (0..40)
        .map(|i| {
            let mut req = Request::new("a", prompt(&mut g, 20), 48);
            req.ignore_eos = true;
            req.request_id = Some(format!("b{i}"));
            Spec::at(0, req)
        })
        .collect();
    let fake = FakeConfig {
        kv_blocks: 10_000,
        ..looping_fake()
    };
    let mut cfg = sched_config();
    let plain = run(
        cfg.clone(),
        fake.clone(),
        FakeFaults::default(),
        &burst,
        |_, _, _| {},
    );
    cfg.speculate = 3;
    cfg.speculate_step_tokens = usize::MAX;
    let spec = run(cfg, fake, FakeFaults::default(), &burst, |_, _, _| {});
    assert_clean(&spec);
    for (a, b) in plain.outcomes.iter().zip(&spec.outcomes) {
        assert_eq!(a.tokens, b.tokens);
    }
    assert!(
        spec.steps * 2 < plain.steps,
        "steps {} with drafts vs {} without",
        spec.steps,
        plain.steps
    );
}

/// Drafts ride only on small steps: while the decoding rows alone reach
/// `speculate_step_tokens`, nothing is drafted; as rows finish, the rest draft
/// within what is left of it.
#[test]
fn drafts_stay_within_the_step_token_budget() {
    let mut g = rng(11);
    let specs: Vec<Spec> = (0..10)
        .map(|i| {
            let mut req = Request::new("a", prompt(&mut g, 20), 20 + 12 * i);
            req.ignore_eos = true;
            Spec::at(0, req)
        })
        .collect();
    let fake = FakeConfig {
        kv_blocks: 10_000,
        ..looping_fake()
    };
    let mut cfg = sched_config();
    cfg.speculate = 4;
    cfg.speculate_step_tokens = 8;
    let (mut running, mut drafted, mut fed) = (0, 0, 0);
    let mut checked = 0;
    let r = run(cfg, fake, FakeFaults::default(), &specs, |step, s, _| {
        let st = s.stats();
        let now_fed = s.model().stats().tokens;
        if step > 0 {
            let (d, f) = (st.draft_tokens - drafted, now_fed - fed);
            if running >= 8 {
                assert_eq!(d, 0, "step {step}: {running} rows drafted {d}");
            } else {
                assert!(f as usize <= 8, "step {step}: {running} rows fed {f}");
                checked += usize::from(d > 0);
            }
        }
        (running, drafted, fed) = (st.running, st.draft_tokens, now_fed);
    });
    assert_clean(&r);
    assert!(checked > 10, "only {checked} steps drafted");
}

/// A model with a sliding-window KV group beside the full one (Gemma 3's local
/// layers): under KV pressure (preemption), cancels and deadlines every naturally
/// finished stream equals the full-attention reference run, while the fake re-reads
/// each row's window through its sliding table every step and the pool's sliding
/// tables shed the blocks behind the window.
#[test]
fn sliding_window_group_under_kv_pressure_matches_full_attention_run() {
    let specs = mixed_workload(3, 400, 100);
    let mut big = sched_config();
    big.max_batch_rows = 128;
    big.max_step_tokens = 1024;
    let reference = run_blocks(big, 100_000, &undisturbed(&specs));
    assert_clean(&reference);

    let mut fake = fake_blocks(BLOCKS);
    fake.sliding_window = Some(24);
    let (mut shed, mut fewer) = (0usize, 0usize);
    let pressured = run(
        sched_config(),
        fake,
        FakeFaults::default(),
        &specs,
        |_, s, _| {
            let pool = s.kv_pool();
            assert_eq!(pool.num_groups(), 2);
            for seq in pool.live_sequences() {
                let t = pool.table(seq, 1).expect("sliding table");
                let full = pool.table(seq, 0).expect("full table");
                // The pool drops blocks behind the window at a row's next append
                // (a chunk being prefilled holds all of its own).
                assert!(
                    t.offset + t.blocks.len() == full.blocks.len() && full.offset == 0,
                    "sliding table [{}, +{}) vs full table of {}",
                    t.offset,
                    t.blocks.len(),
                    full.blocks.len()
                );
                shed += usize::from(t.offset > 0);
            }
            let used = |g| pool.group(g).expect("group").stats().used;
            fewer += usize::from(used(1) < used(0));
        },
    );
    assert_clean(&pressured);
    let st = pressured.sched.stats();
    assert!(
        st.preemptions > 10,
        "workload should preempt, got {}",
        st.preemptions
    );
    assert!(shed > 0, "no sliding table ever dropped a block");
    assert!(
        fewer > 0,
        "the sliding group never held fewer blocks than the full one"
    );
    let mut compared = 0;
    for (i, (p, r)) in pressured
        .outcomes
        .iter()
        .zip(&reference.outcomes)
        .enumerate()
    {
        match &p.finished {
            Some(pf) if is_natural(pf) => {
                assert_eq!(p.tokens, r.tokens, "request {i} tokens differ");
                compared += 1;
            }
            _ => assert!(
                r.tokens.starts_with(&p.tokens),
                "request {i}: cut short but not a prefix of its reference"
            ),
        }
    }
    assert!(compared > 400, "compared {compared}");
}

/// Requests of very different lengths: a third with long prompts (200-900 tokens,
/// many windows long) and long generations, the rest short prompts (1-24 tokens);
/// sampling, stops and logprobs as `varied_request` draws them, nothing cancelled.
fn ragged_workload(seed: u64, n: usize) -> Vec<Spec> {
    let mut g = rng(seed);
    (0..n)
        .map(|i| {
            let t = ["a", "b", "c"][i % 3];
            let mut req = varied_request(&mut g, t, 1.0, i);
            if chance(&mut g, 0.33) {
                let len = 200 + below(&mut g, 700) as usize;
                req.prompt = prompt(&mut g, len);
                req.max_tokens = 50 + below(&mut g, 250) as usize;
            } else {
                let len = 1 + below(&mut g, 24) as usize;
                req.prompt = prompt(&mut g, len);
            }
            Spec {
                arrival_step: below(&mut g, 150),
                req,
                cancel_after: None,
                drop_after: None,
                deadline_after: None,
            }
        })
        .collect()
}

/// Gemma 3's layout as a real model sizes it: the sliding-window group holds only
/// windows, so it has far fewer blocks than the full group (here 50 against 1000).
/// Rows of very different lengths decode in one batch; with many short rows the
/// sliding group is the one that runs out, and the scheduler waits and preempts for
/// it as it does for the full group: no append ever fails (no rollback, no failed
/// request), the pool's invariants hold every step, every sliding table holds just
/// the window, and every stream equals the run with ample memory.
#[test]
fn smaller_sliding_group_binds_and_matches_the_ample_run() {
    let specs = ragged_workload(41, 400);
    let mut big = sched_config();
    big.max_batch_rows = 128;
    big.max_step_tokens = 1024;
    let reference = run_blocks(big, 100_000, &specs);
    assert_clean(&reference);

    let mut fake = fake_blocks(1000);
    fake.sliding_window = Some(24);
    fake.sliding_blocks = Some(50);
    let (mut sliding_bound, mut full_bound, mut most_rows, mut longest) = (0, 0, 0, 0);
    let pressured = run(
        sched_config(),
        fake,
        FakeFaults::default(),
        &specs,
        |step, s, _| {
            let pool = s.kv_pool();
            let avail = |g| pool.group(g).expect("group").available();
            assert_eq!(pool.group(1).expect("sliding").total(), 50);
            if avail(1) < 4 && avail(0) > 200 {
                sliding_bound += 1;
            }
            if avail(0) < 8 && avail(1) > 20 {
                full_bound += 1;
            }
            let (mut rows, mut lens) = (0, Vec::new());
            for seq in pool.live_sequences() {
                let t = pool.table(seq, 1).expect("sliding table");
                let full = pool.table(seq, 0).expect("full table");
                assert_eq!(t.offset + t.blocks.len(), full.blocks.len());
                // Between steps a row holds its window (first block partly behind
                // it) and the tokens its last step appended past it; with a step
                // queued behind the one in flight, the window of the older step's
                // base (it may run again) and both steps' appends.
                let len = pool.sequence(seq).expect("live").len;
                assert!(
                    t.blocks.len() <= 24usize.div_ceil(16) + 2 * 64usize.div_ceil(16) + 2,
                    "row of {len} tokens holds {} sliding blocks",
                    t.blocks.len()
                );
                rows += 1;
                lens.push(len);
            }
            if rows > 1 {
                lens.sort_unstable();
                longest = longest.max(lens[lens.len() - 1] / lens[0].max(1));
            }
            most_rows = most_rows.max(rows);
            if step % 3 == 0 {
                pool.check_invariants().expect("pool invariants");
            }
        },
    );
    assert_clean(&pressured);
    let st = pressured.sched.stats();
    eprintln!(
        "steps {} preemptions {} sliding-bound steps {sliding_bound} full-bound {full_bound} \
         rows {most_rows} length ratio {longest}",
        pressured.steps, st.preemptions
    );
    assert_eq!(st.rollbacks, 0, "an append failed: the plan overcommitted");
    assert_eq!(st.failed_requests, 0);
    assert!(st.preemptions > 0, "workload should preempt");
    assert!(
        sliding_bound > 10,
        "the sliding group never was the tight one"
    );
    assert!(
        longest >= 20,
        "rows of very different lengths never shared a step"
    );
    assert_eq!(pressured.sched.model().violations().len(), 0);
    for (i, (p, r)) in pressured
        .outcomes
        .iter()
        .zip(&reference.outcomes)
        .enumerate()
    {
        assert_eq!(p.tokens, r.tokens, "request {i} tokens");
        assert_eq!(
            p.finished.as_ref().map(|f| f.reason),
            r.finished.as_ref().map(|f| f.reason),
            "request {i} finish"
        );
    }
}

/// A hybrid model (recurrent-state layers beside attention: SSM or linear
/// attention rows): every row holds a state slot of kv-pool's slot pool, zeroed by
/// its first step's `ResetSlot`, and the fake checks at every forward that the
/// slot holds exactly the row's state at its `start_pos` (pipelined steps read the
/// staged state of the step before; a failed or rolled-back step's state is
/// dropped). Under KV pressure rows are preempted and resume from their first
/// token (no prefix is reused: cached blocks hold K/V, not the state after them),
/// random faults roll steps back, and no draft reaches the model. Every stream
/// equals the pure-attention run with ample memory; every slot comes back.
#[test]
fn recurrent_state_rows_survive_preemption_faults_and_pipelining() {
    let specs = ragged_workload(43, 300);
    let mut big = sched_config();
    big.max_batch_rows = 128;
    big.max_step_tokens = 1024;
    let reference = run_blocks(big, 100_000, &specs);
    assert_clean(&reference);

    let cfg = sched_config();
    let mut fake = fake_blocks(400);
    fake.state_slots = cfg.max_batch_rows as u32;
    let faults = FakeFaults {
        random: Some((17, 0.01)),
        ..FakeFaults::default()
    };
    let mut most_slots = 0;
    let hybrid = run(cfg, fake, faults, &specs, |step, s, _| {
        let pool = s.kv_pool();
        let slots = pool.slots().stats();
        assert_eq!(slots.total, 48);
        assert_eq!(
            slots.used,
            pool.live_sequences().count(),
            "a row without a slot"
        );
        for seq in pool.live_sequences() {
            assert!(pool.sequence(seq).expect("live").state_slot.is_some());
        }
        most_slots = most_slots.max(slots.used);
        if step % 7 == 0 {
            pool.check_invariants().expect("pool invariants");
        }
    });
    assert_clean(&hybrid);
    let st = hybrid.sched.stats();
    let fs = hybrid.sched.model().stats();
    eprintln!(
        "steps {} preemptions {} rollbacks {} state reads {} slot resets {} most slots {most_slots}",
        hybrid.steps, st.preemptions, st.rollbacks, fs.state_reads, fs.slot_resets
    );
    assert!(st.preemptions > 0, "workload should preempt");
    assert!(st.rollbacks > 0, "no fault fired");
    assert!(
        fs.slot_resets as usize >= specs.len(),
        "a row without a reset slot"
    );
    assert!(fs.state_reads > 10_000);
    assert_eq!(
        fs.prefix_rows, 0,
        "a stateful row started from a cached prefix"
    );
    assert_eq!(
        hybrid.sched.kv_pool().slots().stats().used,
        0,
        "slots leaked"
    );
    assert!(most_slots > 10);
    for (i, (h, r)) in hybrid.outcomes.iter().zip(&reference.outcomes).enumerate() {
        assert_eq!(h.tokens, r.tokens, "request {i} tokens");
    }
}

/// Fewer recurrent-state slots than rows a step may hold is refused at start,
/// naming both numbers.
#[test]
fn fewer_state_slots_than_rows_is_refused() {
    let mut fake = fake_blocks(400);
    fake.state_slots = 4;
    let err = weft_scheduler::Scheduler::new(
        sched_config(),
        FakeModel::new(fake),
        std::sync::Arc::new(weft_scheduler::fake::FakeDetokenizer),
    )
    .err()
    .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("4 recurrent-state slots") && msg.contains("48 rows"),
        "{msg}"
    );
}
