//! Deterministic simulation harness: a fake clock, a generated workload, and a driver
//! that steps the scheduler and collects every request's stream.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use weft_scheduler::fake::{FakeConfig, FakeDetokenizer, FakeFaults, FakeLogits, FakeModel};
use weft_scheduler::kv_pool::Salt;
use weft_scheduler::{
    Detokenizer, Event, EventStream, FinishReason, Finished, Request, SamplingParams, Scheduler,
    SchedulerConfig, StopMatch, SubmitError, TenantLimits, TokenLogprob,
};

/// Simulated time per step.
pub const DT: Duration = Duration::from_millis(10);

#[derive(Debug, Clone)]
pub struct Spec {
    pub arrival_step: u64,
    pub req: Request,
    /// Cancel by request id this many steps after arrival.
    pub cancel_after: Option<u64>,
    /// Drop the event stream this many steps after arrival.
    pub drop_after: Option<u64>,
    /// Deadline this many steps after arrival.
    pub deadline_after: Option<u64>,
}

impl Spec {
    /// A request arriving at `arrival_step` that runs to its end undisturbed.
    pub fn at(arrival_step: u64, req: Request) -> Self {
        Spec {
            arrival_step,
            req,
            cancel_after: None,
            drop_after: None,
            deadline_after: None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub submit_error: Option<SubmitError>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finished: Option<Finished>,
    pub events_after_finish: usize,
    pub dropped: bool,
    /// Steps from arrival to first token event / to finish.
    pub first_token_step: Option<u64>,
    pub finish_step: Option<u64>,
}

pub struct Run {
    pub sched: Scheduler<FakeModel>,
    pub outcomes: Vec<Outcome>,
    pub steps: u64,
    pub max_waiting_seen: usize,
}

/// KV blocks of the default fake: tight enough that the workloads preempt.
pub const BLOCKS: u32 = 200;

pub fn fake_config() -> FakeConfig {
    fake_blocks(BLOCKS)
}

/// The default fake with `blocks` KV blocks of 16 tokens (the model decides the pool).
pub fn fake_blocks(blocks: u32) -> FakeConfig {
    FakeConfig {
        vocab_size: 64,
        max_context: 4096,
        eos_token_ids: vec![0],
        layers: 4,
        kv_block_size: 16,
        kv_blocks: blocks,
        verify_kv: true,
        ..FakeConfig::default()
    }
}

/// A fake whose greedy output loops (logits depend on the last token only): the text
/// prompt-lookup drafts predict.
pub fn looping_fake() -> FakeConfig {
    FakeConfig {
        logits: FakeLogits::LastToken,
        ..fake_config()
    }
}

pub fn sched_config() -> SchedulerConfig {
    SchedulerConfig {
        max_batch_rows: 48,
        max_step_tokens: 256,
        prefill_chunk: 64,
        max_waiting: 100_000,
        default_tenant: TenantLimits {
            max_running: usize::MAX,
            max_waiting: 100_000,
            tokens_per_minute: None,
        },
        verify_rollback: true,
        ..SchedulerConfig::default()
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    rng.next_u64() % n.max(1)
}

pub fn chance(rng: &mut ChaCha8Rng, p: f64) -> bool {
    ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
}

/// Prompt tokens avoid 0 (EOS) so prompts never look finished.
pub fn prompt(rng: &mut ChaCha8Rng, len: usize) -> Vec<u32> {
    (0..len).map(|_| 1 + below(rng, 63) as u32).collect()
}

/// A varied request: long and short prompts, greedy and seeded sampling, penalties,
/// stop ids and strings, logprobs.
pub fn varied_request(rng: &mut ChaCha8Rng, tenant: &str, weight: f64, i: usize) -> Request {
    let len = if chance(rng, 0.2) {
        100 + below(rng, 300)
    } else {
        1 + below(rng, 40)
    } as usize;
    let mut r = Request::new(tenant, prompt(rng, len), 1 + below(rng, 48) as usize);
    r.tenant_weight = weight;
    r.priority = below(rng, 3) as i32;
    r.request_id = Some(format!("{tenant}-{i}"));
    match below(rng, 4) {
        0 => {}
        1 => {
            r.sampling = SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..Default::default()
            };
            r.seed = Some(rng.next_u64());
        }
        2 => {
            r.sampling = SamplingParams {
                temperature: 1.2,
                top_k: 8,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: 0.2,
                frequency_penalty: 0.1,
                ..Default::default()
            };
            r.seed = Some(rng.next_u64());
        }
        _ => {
            // No seed: the engine derives one from its own seed and the request key,
            // which only matches across runs if keys match (they do: same submit order).
            r.sampling = SamplingParams {
                temperature: 0.7,
                ..Default::default()
            };
        }
    }
    if chance(rng, 0.2) {
        r.stop_token_ids = vec![1 + below(rng, 63) as u32];
    }
    if chance(rng, 0.25) {
        let stops = ["e", "ab", "é", " a", "x.", "zz"];
        r.stop_strings = vec![stops[below(rng, stops.len() as u64) as usize].to_string()];
    }
    if chance(rng, 0.15) {
        r.ignore_eos = true;
    }
    if chance(rng, 0.1) {
        r.logprobs = Some(below(rng, 4) as usize);
    }
    r
}

/// `run` with the default fake model, no model faults and no step observer.
pub fn run_plain(cfg: SchedulerConfig, specs: &[Spec]) -> Run {
    run_blocks(cfg, BLOCKS, specs)
}

/// `run_plain` with a KV pool of `blocks` blocks.
pub fn run_blocks(cfg: SchedulerConfig, blocks: u32, specs: &[Spec]) -> Run {
    run(
        cfg,
        fake_blocks(blocks),
        FakeFaults::default(),
        specs,
        |_, _, _| {},
    )
}

/// Tenant isolation and pool consistency, checked against the live pool: no block is
/// in the tables of two tenants (by owner and by salt), every table matches its
/// sequence's length, and the pool's own invariants hold.
pub fn audit_pool(sched: &Scheduler<FakeModel>) {
    let pool = sched.kv_pool();
    let mut owner: HashMap<u32, (weft_scheduler::kv_pool::OwnerId, Option<Salt>)> = HashMap::new();
    for seq in pool.live_sequences() {
        let info = pool.sequence(seq).expect("live sequence");
        let t = pool.table(seq, 0).expect("table");
        assert_eq!(t.blocks.len(), info.len.div_ceil(pool.block_size()));
        for &b in t.blocks {
            let o = *owner.entry(b).or_insert((info.owner, info.salt));
            assert_eq!(
                o,
                (info.owner, info.salt),
                "block {b} is shared across tenants"
            );
        }
    }
    pool.check_invariants().expect("pool invariants");
}

/// Drive `specs` to completion. `on_step` sees the scheduler after every step.
pub fn run(
    cfg: SchedulerConfig,
    fake: FakeConfig,
    faults: FakeFaults,
    specs: &[Spec],
    on_step: impl FnMut(u64, &Scheduler<FakeModel>, &[Outcome]),
) -> Run {
    run_detok(cfg, fake, faults, specs, Arc::new(FakeDetokenizer), on_step)
}

/// [`run`] with another detokenizer (a vocabulary of the test's own).
pub fn run_detok(
    cfg: SchedulerConfig,
    fake: FakeConfig,
    faults: FakeFaults,
    specs: &[Spec],
    detok: Arc<dyn Detokenizer>,
    mut on_step: impl FnMut(u64, &Scheduler<FakeModel>, &[Outcome]),
) -> Run {
    run_full(
        cfg,
        fake,
        faults,
        specs,
        detok,
        |_| {},
        |step, s: &mut Scheduler<FakeModel>, o: &[Outcome]| on_step(step, s, o),
    )
}

/// [`run_detok`] with `setup` called on the new scheduler before the first
/// request, and `on_step` given the scheduler mutably (after each step).
pub fn run_full(
    cfg: SchedulerConfig,
    fake: FakeConfig,
    faults: FakeFaults,
    specs: &[Spec],
    detok: Arc<dyn Detokenizer>,
    setup: impl FnOnce(&mut Scheduler<FakeModel>),
    mut on_step: impl FnMut(u64, &mut Scheduler<FakeModel>, &[Outcome]),
) -> Run {
    let max_waiting = cfg.max_waiting;
    let model = FakeModel::with_faults(fake, faults);
    let mut sched = Scheduler::new(cfg, model, detok).expect("config");
    setup(&mut sched);
    let base = Instant::now();
    let mut outcomes: Vec<Outcome> = vec![Outcome::default(); specs.len()];
    let mut streams: Vec<Option<EventStream>> = (0..specs.len()).map(|_| None).collect();
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| (specs[i].arrival_step, i));
    let mut next = 0;
    let mut step = 0u64;
    let mut max_waiting_seen = 0;
    let mut by_step: HashMap<u64, Vec<(usize, bool)>> = HashMap::new();
    loop {
        let now = base + DT * step as u32;
        while next < order.len() && specs[order[next]].arrival_step <= step {
            let i = order[next];
            next += 1;
            let mut req = specs[i].req.clone();
            if let Some(d) = specs[i].deadline_after {
                req.deadline = Some(now + DT * d as u32);
            }
            match sched.submit(req, now) {
                Ok(s) => {
                    streams[i] = Some(s);
                    if let Some(c) = specs[i].cancel_after {
                        by_step.entry(step + c).or_default().push((i, true));
                    }
                    if let Some(c) = specs[i].drop_after {
                        by_step.entry(step + c).or_default().push((i, false));
                    }
                }
                Err(e) => outcomes[i].submit_error = Some(e),
            }
        }
        if let Some(actions) = by_step.remove(&step) {
            for (i, is_cancel) in actions {
                if is_cancel {
                    let r = &specs[i].req;
                    sched.cancel(&r.tenant, r.request_id.as_deref().unwrap_or(""), now);
                } else if streams[i].take().is_some() {
                    outcomes[i].dropped = true;
                }
            }
        }
        sched.step(now);
        for (i, s) in streams.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            while let Some(ev) = s.try_recv() {
                let o = &mut outcomes[i];
                if o.finished.is_some() {
                    o.events_after_finish += 1;
                    continue;
                }
                match ev {
                    Event::Token(d) => {
                        if o.first_token_step.is_none() && !d.ids.is_empty() {
                            o.first_token_step = Some(step - specs[i].arrival_step);
                        }
                        o.tokens.extend(&d.ids);
                        o.text.push_str(&d.text);
                        o.logprobs.extend(d.logprobs.unwrap_or_default());
                    }
                    Event::Finished(f) => {
                        o.finish_step = Some(step - specs[i].arrival_step);
                        o.finished = Some(f);
                    }
                }
            }
        }
        let st = sched.stats();
        max_waiting_seen = max_waiting_seen.max(st.waiting);
        assert_eq!(
            st.kv_blocks_used + st.kv_blocks_free + st.kv_blocks_cached,
            st.kv_blocks_total
        );
        on_step(step, &mut sched, &outcomes);
        step += 1;
        if next == order.len() && by_step.is_empty() && !sched.has_work() {
            break;
        }
        assert!(step < 2_000_000, "simulation did not finish");
    }
    // Late events (none expected) would show up here.
    for (i, s) in streams.iter_mut().enumerate() {
        if let Some(s) = s {
            while let Some(ev) = s.try_recv() {
                if outcomes[i].finished.is_some() {
                    outcomes[i].events_after_finish += 1;
                } else if let Event::Finished(f) = ev {
                    outcomes[i].finished = Some(f);
                }
            }
        }
    }
    let _ = max_waiting;
    Run {
        sched,
        outcomes,
        steps: step,
        max_waiting_seen,
    }
}

/// Leak and contract checks that hold after any run.
pub fn assert_clean(run: &Run) {
    let st = run.sched.stats();
    // Every block is back: free, or evictable in the prefix cache.
    assert_eq!(st.kv_blocks_used, 0, "KV blocks leaked");
    assert_eq!(st.kv_blocks_free + st.kv_blocks_cached, st.kv_blocks_total);
    let pool = run.sched.kv_pool();
    let ps = pool.stats();
    for (g, b) in ps.groups.iter().enumerate() {
        assert_eq!(b.used, 0, "pool blocks of group {g} still referenced");
    }
    assert_eq!(ps.sequences, 0, "pool sequences leaked");
    assert!(!pool.in_transaction());
    pool.check_invariants()
        .expect("pool invariants after drain");
    assert_eq!(st.running, 0);
    assert_eq!(st.waiting, 0);
    assert_eq!(
        st.rollback_mismatches, 0,
        "rollback did not restore the pre-step state"
    );
    assert!(
        run.sched.model().violations().is_empty(),
        "model contract: {:?}",
        run.sched.model().violations()
    );
    assert_eq!(run.sched.model().live_rows(), 0, "model rows leaked");
    assert!(!run.sched.model().has_staged());
    for t in &st.tenants {
        assert_eq!((t.running, t.waiting), (0, 0), "tenant {}", t.tenant);
    }
    for (i, o) in run.outcomes.iter().enumerate() {
        if o.submit_error.is_some() {
            continue;
        }
        assert_eq!(
            o.events_after_finish, 0,
            "request {i} got events after its final one"
        );
        if !o.dropped {
            assert!(o.finished.is_some(), "request {i} never finished");
        }
    }
}

/// What the streamed text must be: the detokenized ids (stop token / EOS excluded), cut
/// before the earliest stop string.
pub fn expected_text(req: &Request, o: &Outcome, f: &Finished) -> String {
    let mut ids = o.tokens.clone();
    if matches!(f.stop, Some(StopMatch::TokenId(_))) || f.reason == FinishReason::Eos {
        ids.pop();
    }
    let full = FakeDetokenizer.decode(&ids).unwrap_or_default();
    let cut = req
        .stop_strings
        .iter()
        .filter_map(|s| full.find(s.as_str()))
        .min();
    match cut {
        Some(c) => full[..c].to_string(),
        None => full,
    }
}

pub fn is_natural(f: &Finished) -> bool {
    matches!(
        f.reason,
        FinishReason::Length | FinishReason::Stop | FinishReason::Eos
    )
}

/// Two runs of the same specs streamed the same tokens, text, logprobs and finish.
pub fn assert_same_streams(a: &Run, b: &Run) {
    for (i, (x, y)) in a.outcomes.iter().zip(&b.outcomes).enumerate() {
        assert_eq!(x.tokens, y.tokens, "request {i} tokens");
        assert_eq!(x.text, y.text, "request {i} text");
        assert_eq!(x.logprobs, y.logprobs, "request {i} logprobs");
        // A stream its client dropped never sees its end.
        assert_eq!(x.dropped, y.dropped, "request {i} dropped");
        let finish = |o: &Outcome| o.finished.as_ref().map(|f| (f.reason, f.stop.clone()));
        assert!(x.dropped || x.finished.is_some(), "request {i} unfinished");
        assert_eq!(finish(x), finish(y), "request {i} finish");
    }
}
