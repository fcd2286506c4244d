//! The scheduler on the real paged pool: prefix hits are exact and tenant-scoped,
//! tenants never share a block, preemption under real exhaustion loses and repeats no
//! token, and every block comes back.

mod common;

use common::*;
use weft_scheduler::fake::{FakeFaults, FakeModel};
use weft_scheduler::{Request, Scheduler, SchedulerConfig};

/// A system prompt of `len` tokens shared by every request that uses `doc`.
fn system(doc: u64, len: usize) -> Vec<u32> {
    prompt(&mut rng(1000 + doc), len)
}

/// Requests from `tenants`, most of them starting with one of a few system prompts
/// (block-aligned and not), then a question of their own. The same system prompts are
/// used by every tenant, so only the salt keeps tenants apart.
fn shared_prefix_workload(seed: u64, n: usize, tenants: &[&str]) -> Vec<Spec> {
    let mut g = rng(seed);
    (0..n)
        .map(|i| {
            let t = tenants[i % tenants.len()];
            let mut req = varied_request(&mut g, t, 1.0, i);
            if chance(&mut g, 0.7) {
                let doc = below(&mut g, 3);
                let len = [32, 40, 100][doc as usize];
                let q = req.prompt.len().min(20);
                req.prompt = [system(doc, len), req.prompt[..q].to_vec()].concat();
            }
            Spec::at(below(&mut g, 300), req)
        })
        .collect()
}

fn no_cache(cfg: &SchedulerConfig) -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: false,
        ..cfg.clone()
    }
}

/// Cache on and cache off stream exactly the same; with it on, requests report cached
/// prompt tokens, the pool counts the hits, and the fake saw rows start past 0.
#[test]
fn prefix_hits_change_no_stream() {
    let specs = shared_prefix_workload(5, 600, &["a", "b", "c"]);
    let cfg = sched_config();
    let cold = run_blocks(no_cache(&cfg), 2000, &specs);
    assert_clean(&cold);
    assert_eq!(cold.sched.kv_pool().stats().prefix.hit_tokens, 0);
    let warm = run_blocks(cfg, 2000, &specs);
    assert_clean(&warm);
    assert_same_streams(&cold, &warm);
    for r in [&cold, &warm] {
        let st = r.sched.stats();
        assert_eq!(
            (st.rollbacks, st.failed_steps),
            (0, 0),
            "a step over-committed KV"
        );
    }
    let cached: usize = warm
        .outcomes
        .iter()
        .filter_map(|o| o.finished.as_ref())
        .map(|f| f.usage.cached_prompt_tokens)
        .sum();
    let hits = warm.sched.kv_pool().stats().prefix.hit_tokens;
    eprintln!(
        "cached prompt tokens {cached}, pool hit tokens {hits}, fake prefix rows {}",
        warm.sched.model().stats().prefix_rows
    );
    assert!(cached > 10_000, "cached prompt tokens {cached}");
    assert!(hits as usize >= cached);
    assert!(warm.sched.model().stats().prefix_rows > 100);
    assert!(warm.sched.model().stats().verified_slots > 0);
    assert!(warm.sched.model().stats().tokens < cold.sched.model().stats().tokens);
    for (o, s) in warm.outcomes.iter().zip(&specs) {
        if let Some(f) = &o.finished {
            assert!(f.usage.cached_prompt_tokens < s.req.prompt.len());
            assert_eq!(f.usage.cached_prompt_tokens % 16, 0);
        }
    }
}

/// The same prompts from several tenants at once: no block is ever in two tenants'
/// tables, checked against the pool after every step, under KV pressure (preemption,
/// eviction) and with speculation on.
#[test]
fn tenants_never_share_a_block() {
    let specs = shared_prefix_workload(9, 500, &["a", "b", "c", "d"]);
    let mut cfg = sched_config();
    cfg.speculate = 2;
    cfg.speculate_step_tokens = usize::MAX;
    let mut audited = 0;
    let mut shared_within = 0;
    let r = run(
        cfg,
        looping_fake(),
        FakeFaults::default(),
        &specs,
        |_, s: &Scheduler<FakeModel>, _| {
            audit_pool(s);
            audited += 1;
            // Sharing does happen, within a tenant.
            let pool = s.kv_pool();
            if let Ok(g) = pool.group(0) {
                shared_within += pool
                    .live_sequences()
                    .filter_map(|q| pool.table(q, 0).ok())
                    .flat_map(|t| t.blocks.to_vec())
                    .filter(|&b| g.refcount(b).is_ok_and(|c| c > 1))
                    .count();
            }
        },
    );
    assert_clean(&r);
    let st = r.sched.stats();
    assert!(st.preemptions > 0, "workload should preempt");
    assert!(st.accepted_tokens > 0);
    assert!(audited > 100);
    assert!(
        shared_within > 0,
        "no block was ever shared within a tenant"
    );
    assert!(r.sched.kv_pool().stats().prefix.hit_tokens > 0);
}

/// A pool far too small for the load: rows are preempted again and again (and resume
/// from their own cached blocks), and every stream still has exactly the tokens of an
/// unconstrained run.
#[test]
fn preemption_under_pool_exhaustion_loses_and_repeats_nothing() {
    let mut g = rng(17);
    let specs: Vec<Spec> = (0..300)
        .map(|i| {
            let len = 10 + below(&mut g, 120) as usize;
            let mut req = Request::new(["x", "y"][i % 2], prompt(&mut g, len), 20 + i % 60);
            req.ignore_eos = i % 3 != 0;
            req.request_id = Some(format!("r{i}"));
            Spec::at(below(&mut g, 20), req)
        })
        .collect();
    let reference = run_blocks(sched_config(), 100_000, &specs);
    assert_clean(&reference);
    assert_eq!(reference.sched.stats().preemptions, 0);
    let mut cfg = sched_config();
    cfg.kv_watermark_blocks = 2;
    // 40 blocks of 16 tokens: one long row and a few short ones at a time.
    let tight = run_blocks(cfg, 40, &specs);
    assert_clean(&tight);
    let st = tight.sched.stats();
    assert!(st.preemptions > 100, "preemptions {}", st.preemptions);
    assert_eq!(
        (st.rollbacks, st.failed_steps),
        (0, 0),
        "a step over-committed KV"
    );
    let pool = tight.sched.kv_pool().stats();
    // Prompts share nothing, so every hit is a preempted request resuming from its own
    // blocks.
    assert!(pool.prefix.hit_tokens > 1000, "{:?}", pool.prefix);
    let mut preempted = 0;
    for (i, (a, b)) in tight.outcomes.iter().zip(&reference.outcomes).enumerate() {
        let (fa, fb) = (a.finished.as_ref().unwrap(), b.finished.as_ref().unwrap());
        assert_eq!(
            a.tokens, b.tokens,
            "request {i} (preempted {})",
            fa.usage.preemptions
        );
        assert_eq!(a.text, b.text, "request {i}");
        assert_eq!((fa.reason, &fa.stop), (fb.reason, &fb.stop), "request {i}");
        assert_eq!(fa.usage.generated_tokens, a.tokens.len());
        assert_eq!(
            fa.usage.cached_prompt_tokens, 0,
            "request {i}: nothing to share"
        );
        preempted += usize::from(fa.usage.preemptions > 0);
    }
    assert!(preempted > 50, "preempted requests {preempted}");
}

/// Blocks go back to the pool's baseline: after a drained run nothing is referenced,
/// what is left is free or evictable, and a second wave on the same scheduler (which
/// must evict the first wave's cache) runs as clean.
#[test]
fn blocks_return_to_baseline_across_waves() {
    let specs = shared_prefix_workload(2, 200, &["a", "b"]);
    let mut r = run_blocks(sched_config(), 120, &specs);
    assert_clean(&r);
    let after_first = r.sched.kv_pool().stats();
    assert!(
        after_first.groups[0].cached > 0,
        "finished rows leave cached blocks"
    );
    // Second wave: different prompts, same scheduler.
    let t0 = std::time::Instant::now();
    let mut streams = Vec::new();
    let mut g = rng(77);
    for i in 0..60 {
        let mut req = Request::new(["a", "b", "c"][i % 3], prompt(&mut g, 90), 10);
        req.ignore_eos = true;
        streams.push(r.sched.submit(req, t0).unwrap());
    }
    let mut step = 0;
    while r.sched.has_work() {
        r.sched.step(t0 + DT * step);
        audit_pool(&r.sched);
        step += 1;
        assert!(step < 100_000);
    }
    for s in &mut streams {
        let mut n = 0;
        let mut done = false;
        while let Some(e) = s.try_recv() {
            match e {
                weft_scheduler::Event::Token(d) => n += d.ids.len(),
                weft_scheduler::Event::Finished(f) => {
                    assert_eq!(f.usage.generated_tokens, 10);
                    done = true;
                }
            }
        }
        assert!(done && n == 10);
    }
    let p = r.sched.kv_pool().stats();
    assert_eq!((p.groups[0].used, p.sequences), (0, 0));
    assert_eq!(p.groups[0].free + p.groups[0].cached, p.groups[0].total);
    r.sched.kv_pool().check_invariants().unwrap();
    assert!(r.sched.model().violations().is_empty());
    assert_eq!(r.sched.model().live_rows(), 0);
}

/// A model whose KV layout the scheduler cannot plan for is a typed error, not a panic.
#[test]
fn unsupported_kv_layouts_are_typed_errors() {
    use std::sync::Arc;
    use weft_scheduler::fake::FakeDetokenizer;
    use weft_scheduler::{
        min_sliding_blocks, KvGroups, Model, ModelError, ModelInfo, RowId, RowInput,
        SchedulerError, StepOutput, StorageOp,
    };
    struct Layout(KvGroups);
    impl Model for Layout {
        fn info(&self) -> ModelInfo {
            ModelInfo {
                vocab_size: 8,
                max_context: 64,
                eos_token_ids: vec![],
                kv: self.0.clone(),
                adapter_slots: 0,
            }
        }
        fn forward(&mut self, _: &[StorageOp], _: &[RowInput]) -> Result<StepOutput, ModelError> {
            Err(ModelError::Failed("unused".into()))
        }
        fn commit(&mut self) -> Result<(), ModelError> {
            Ok(())
        }
        fn rollback(&mut self) {}
        fn release_row(&mut self, _: RowId) {}
    }
    let mk =
        |kv: KvGroups| Scheduler::new(sched_config(), Layout(kv), Arc::new(FakeDetokenizer)).err();
    // Full plus a sliding-window group (Gemma 3): as many blocks, or fewer as long
    // as one row can advance (window 4 -> 1 block, a 64-token chunk 4, and 2:
    // weft_scheduler::min_sliding_blocks); a group smaller than both cannot plan.
    assert!(mk(KvGroups::new(16).full(8).sliding(4, 8)).is_none());
    assert_eq!(min_sliding_blocks(&sched_config(), 4, 16), 7);
    assert!(mk(KvGroups::new(16).full(80).sliding(4, 7)).is_none());
    assert!(matches!(
        mk(KvGroups::new(16).full(80).sliding(4, 6)),
        Some(SchedulerError::UnsupportedKv(_))
    ));
    assert!(mk(KvGroups::new(16).full(4).sliding(4, 4)).is_none());
    assert!(matches!(
        mk(KvGroups::new(16).full(4).sliding(4, 3)),
        Some(SchedulerError::UnsupportedKv(_))
    ));
    assert_eq!(min_sliding_blocks(&sched_config(), 512, 16), 32 + 4 + 2);
    assert!(matches!(
        mk(KvGroups::new(16).sliding(4, 8)),
        Some(SchedulerError::UnsupportedKv(_))
    ));
    assert!(matches!(
        mk(KvGroups::new(16).full(8).state_slots(2)),
        Some(SchedulerError::UnsupportedKv(_))
    ));
    assert!(matches!(
        mk(KvGroups::new(12).full(8)),
        Some(SchedulerError::Kv(_))
    ));
    assert!(mk(KvGroups::new(16).full(8)).is_none());
}

/// A failed step's forward may have overwritten cached blocks it evicted; those must
/// not come back as prefix hits (the pool's `rollback_after_writes`). Here a request
/// that always fails evicts the cached prefix of a finished request, and a later
/// request with that prefix must compute it again rather than read torn KV.
#[test]
fn a_failed_step_never_leaves_overwritten_blocks_in_the_cache() {
    use std::sync::Arc;
    use std::time::Instant;
    use weft_scheduler::fake::FakeDetokenizer;
    use weft_scheduler::FinishReason;

    let poison = 63;
    let fake = weft_scheduler::fake::FakeFaults {
        poison_token: Some(poison),
        ..Default::default()
    };
    let mut cfg = sched_config();
    cfg.max_step_retries = 2;
    cfg.prefill_chunk = 128;
    // 8 blocks of 16 tokens.
    let model = FakeModel::with_faults(fake_blocks(8), fake);
    let mut s = Scheduler::new(cfg, model, Arc::new(FakeDetokenizer)).unwrap();
    let t0 = Instant::now();
    let mut step = 0;
    let mut run_one = |s: &mut Scheduler<FakeModel>, req: Request| {
        let mut st = s.submit(req, t0).unwrap();
        let mut out = (Vec::new(), None);
        while s.has_work() {
            s.step(t0 + DT * step);
            step += 1;
            while let Some(e) = st.try_recv() {
                match e {
                    weft_scheduler::Event::Token(d) => out.0.extend(d.ids),
                    weft_scheduler::Event::Finished(f) => out.1 = Some(f),
                }
            }
        }
        (out.0, out.1.expect("finished"))
    };
    let p: Vec<u32> = (1..=48).collect();
    let mut a = Request::new("a", p.clone(), 2);
    a.ignore_eos = true;
    let (want, fa) = run_one(&mut s, a.clone());
    assert_eq!(fa.reason, FinishReason::Length);
    assert_eq!(s.kv_pool().stats().groups[0].cached, 3);
    // 100 tokens need 7 of the 8 blocks: two of the three cached ones are evicted and
    // written by a forward that then fails, every time.
    let mut z = Request::new("a", [vec![poison], vec![5; 99]].concat(), 2);
    z.ignore_eos = true;
    let (_, fz) = run_one(&mut s, z);
    assert_eq!(fz.reason, FinishReason::Error);
    let (got, fb) = run_one(&mut s, a);
    assert_eq!(got, want);
    assert!(fb.usage.cached_prompt_tokens <= 16, "{:?}", fb.usage);
    assert!(
        s.model().violations().is_empty(),
        "{:?}",
        s.model().violations()
    );
    s.kv_pool().check_invariants().unwrap();
    assert_eq!(s.kv_pool().stats().groups[0].used, 0);
}

/// One tenant's requests with the same system prompt under three adapters (and
/// none): the prefix cache is salted by adapter as well as by tenant — no block is
/// ever in the tables of two (tenant, adapter) domains, while requests of one adapter
/// do share their prefix — and the rows carry their request's adapter to the model.
#[test]
fn adapters_get_their_own_prefix_cache_domains() {
    let mut g = rng(21);
    let specs: Vec<Spec> = (0..240)
        .map(|i| {
            let t = ["a", "b"][i % 2];
            let mut req = varied_request(&mut g, t, 1.0, i);
            let q = req.prompt.len().min(20);
            req.prompt = [system(1, 48), req.prompt[..q].to_vec()].concat();
            req.adapter = [None, Some(1), Some(2), Some(u32::MAX)][(i / 2) % 4];
            Spec::at(below(&mut g, 300), req)
        })
        .collect();
    let mut salts = std::collections::HashSet::new();
    let r = run(
        sched_config(),
        fake_config(),
        FakeFaults::default(),
        &specs,
        |_, s: &Scheduler<FakeModel>, _| {
            audit_pool(s);
            let pool = s.kv_pool();
            for q in pool.live_sequences() {
                if let Ok(info) = pool.sequence(q) {
                    salts.insert((info.owner, info.salt));
                }
            }
        },
    );
    assert_clean(&r);
    assert_eq!(salts.len(), 8, "2 tenants x 4 adapter domains: {salts:?}");
    let hits = r.sched.kv_pool().stats().prefix.hit_tokens;
    assert!(
        hits > 1000,
        "requests of one adapter shared no prefix ({hits})"
    );
    let seen = &r.sched.model().stats().adapters;
    for a in [None, Some(1), Some(2), Some(u32::MAX)] {
        assert!(
            seen.contains(&a),
            "no row reached the model with adapter {a:?}"
        );
    }
}
