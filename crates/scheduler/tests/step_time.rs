//! Steps bounded in time (issue 17 item 1), with the fake model's simulated step
//! cost: 8 streams decode while a 2048- and a 7000-token prompt join. Under an
//! inter-token latency target the scheduler sizes each mixed step's prefill by the
//! cost it learned from the steps before, so steps that carry decoding rows stay near
//! the target; without one, each mixed step carries a whole prefill chunk. Either way
//! every stream gets exactly the same tokens.

mod common;

use std::time::Duration;

use common::*;
use weft_scheduler::fake::{FakeConfig, FakeFaults, FakeStepCost};
use weft_scheduler::step_cost::ShortPrompts;
use weft_scheduler::{FinishReason, ItlTarget, Request, SchedulerConfig, StartingStep};

/// A CPU-like device: 10 ms a step, 1 ms per decoding row, 0.2 ms per prefill token,
/// and attention that makes a token at depth 6000 cost ~1.6x one at depth 0.
const COST: FakeStepCost = FakeStepCost {
    base: 10e-3,
    per_decode_row: 1e-3,
    per_prefill_token: 0.2e-3,
    per_attention: 2e-8,
    per_context_key: 0.0,
    jitter: 0.0,
    overlap: false,
    per_mixed_step: 0.0,
};
const TARGET: Duration = Duration::from_millis(60);

fn config(itl_target: Option<Duration>) -> SchedulerConfig {
    let itl_target = itl_target.map_or(ItlTarget::Off, ItlTarget::Fixed);
    SchedulerConfig {
        max_batch_rows: 16,
        max_step_tokens: 2048,
        prefill_chunk: 512,
        itl_target,
        ..sched_config()
    }
}

fn fake() -> FakeConfig {
    FakeConfig {
        max_context: 8192,
        kv_blocks: 2048,
        // The decoding streams run their 300 tokens (no end-of-sequence pick).
        eos_token_ids: vec![],
        step_cost: Some(COST),
        ..fake_config()
    }
}

fn workload() -> Vec<Spec> {
    workload_of(300, [20, 60])
}

/// 8 streams generating `gen` tokens each, and a 2048- and a 7000-token prompt
/// arriving at the steps `at`.
fn workload_of(gen: usize, at: [u64; 2]) -> Vec<Spec> {
    let mut g = rng(17);
    let mut specs: Vec<Spec> = (0..8)
        .map(|i| {
            let mut r = Request::new("decode", prompt(&mut g, 24 + i), gen);
            r.request_id = Some(format!("d{i}"));
            Spec::at(0, r)
        })
        .collect();
    for (at, len) in at.into_iter().zip([2048usize, 7000]) {
        let mut r = Request::new("long", prompt(&mut g, len), 4);
        r.request_id = Some(format!("long{len}"));
        specs.push(Spec::at(at, r));
    }
    specs
}

/// Simulated seconds of every forward that decoded rows next to a prefill.
fn mixed_steps(run: &Run) -> Vec<f64> {
    run.sched
        .model()
        .step_costs()
        .iter()
        .filter(|&&(decode, other, _)| decode > 0 && other > 0)
        .map(|c| c.2)
        .collect()
}

/// `count` requests of `tenant` (ids `{id}0`, `{id}1`, ...) with `len`-token
/// prompts and `gen` tokens to generate, arriving at step `at`.
fn requests(
    g: &mut rand_chacha::ChaCha8Rng,
    tenant: &str,
    id: &str,
    count: usize,
    (len, gen): (usize, usize),
    at: u64,
) -> Vec<Spec> {
    (0..count)
        .map(|i| {
            let mut r = Request::new(tenant, prompt(g, len), gen);
            r.request_id = Some(format!("{id}{i}"));
            Spec::at(at, r)
        })
        .collect()
}

/// A run under the auto ITL target (3x the decode step, at least 5 ms) with the
/// targets the scheduler planned under, step by step.
fn run_auto(mut cfg: SchedulerConfig, fake: FakeConfig, specs: &[Spec]) -> (Run, Vec<f64>) {
    cfg.itl_target = ItlTarget::Auto {
        factor: 3.0,
        min: Duration::from_millis(5),
    };
    let mut targets = Vec::new();
    let r = run(cfg, fake, FakeFaults::default(), specs, |_, s, _| {
        targets.extend(s.stats().itl_target);
    });
    (r, targets)
}

/// A run with the fake model's simulated cost, no faults, nothing observed.
fn run_timed(cfg: SchedulerConfig, fake: FakeConfig, specs: &[Spec]) -> Run {
    run(cfg, fake, FakeFaults::default(), specs, |_, _, _| {})
}

fn p99(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

#[test]
fn long_prompts_join_decoding_streams_within_the_itl_target() {
    let specs = workload();
    let bounded = run_timed(config(Some(TARGET)), fake(), &specs);
    let unbounded = run_timed(config(None), fake(), &specs);
    assert_clean(&bounded);
    assert_clean(&unbounded);
    assert_same_streams(&bounded, &unbounded);

    let target = TARGET.as_secs_f64();
    let (b, u) = (mixed_steps(&bounded), mixed_steps(&unbounded));
    // The 9000 prompt tokens need many more, smaller mixed steps under the target.
    assert!(
        b.len() > 2 * u.len(),
        "{} bounded vs {} unbounded mixed steps",
        b.len(),
        u.len()
    );
    // Without a target a 512-token chunk beside 8 rows is ~120-190 ms.
    assert!(p99(&u) > 2.0 * target, "unbounded p99 {:.3} s", p99(&u));
    // With one, the steps decoding rows wait on stay within 1.5x of it (the issue's
    // bound), once the cost model has seen a few steps.
    let settled = &b[4.min(b.len())..];
    assert!(
        p99(settled) <= 1.5 * target,
        "bounded mixed steps p99 {:.3} s vs target {target}",
        p99(settled)
    );
    let worst = settled.iter().fold(0f64, |m, &x| m.max(x));
    assert!(
        worst <= 1.5 * target,
        "worst bounded mixed step {worst:.3} s"
    );
    // The prompts still advance every step (a block's worth at least): the long
    // requests finish, and not much later in steps than the chunked-only run's.
    for i in 8..10 {
        let (x, y) = (&bounded.outcomes[i], &unbounded.outcomes[i]);
        assert!(x.finished.is_some() && y.finished.is_some());
    }
}

/// A GPU-like device whose prefill chunks gather their whole context out of the pool
/// before attending: 1.5 us per context key whatever the chunk's length, so at depth
/// 7000 the read alone is half the 20 ms target, while short prompts keep arriving.
/// The cost model learns the read apart from the chunk's tokens and attention, and
/// the steps the decoding rows wait on stay within 1.2x of the target all through.
#[test]
fn deep_chunks_that_read_their_context_stay_within_the_target() {
    let cost = FakeStepCost {
        base: 4e-3,
        per_decode_row: 1e-4,
        per_prefill_token: 5e-5,
        per_attention: 1e-10,
        per_context_key: 1.5e-6,
        jitter: 0.0,
        overlap: false,
        per_mixed_step: 2e-3,
    };
    let target = Duration::from_millis(20);
    let fake = || FakeConfig {
        step_cost: Some(cost),
        ..fake()
    };
    // Short prompts keep arriving beside the long ones: shallow chunks and deep ones
    // share the steps the model learns from.
    let mut specs = workload();
    let mut g = rng(29);
    for i in 0..60u64 {
        specs.push(Spec::at(
            10 + 8 * i,
            Request::new("short", prompt(&mut g, 48 + (i as usize % 5) * 40), 2),
        ));
    }
    let bounded = run_timed(config(Some(target)), fake(), &specs);
    let unbounded = run_timed(config(None), fake(), &specs);
    assert_clean(&bounded);
    assert_same_streams(&bounded, &unbounded);
    let target = target.as_secs_f64();
    let b = mixed_steps(&bounded);
    let settled = &b[4.min(b.len())..];
    let deep = settled.iter().filter(|&&c| c > 1.5 * target).count();
    eprintln!(
        "mixed steps p99 {:.4} s, {deep} of {} over 1.5x",
        p99(settled),
        settled.len()
    );
    assert!(
        p99(settled) <= 1.5 * target,
        "mixed steps p99 {:.4} s vs target {target} ({deep} of {} over 1.5x)",
        p99(settled),
        settled.len()
    );
    // The model predicts deep chunks, not just bounds them on average: no step past
    // 1.2x (without the context term the deepest run ~1.3x over).
    let worst = settled.iter().fold(0f64, |m, &x| m.max(x));
    assert!(worst <= 1.2 * target, "worst mixed step {worst:.4} s");
    assert!(p99(&mixed_steps(&unbounded)) > 2.0 * target);
    assert!(bounded.outcomes.iter().all(|o| o.finished.is_some()));
}

/// A 2-core CPU's regime (the long-prompts benchmark on the default model): the
/// chunk's depth is what costs, so deep in the 7000-token prompt even one token of
/// it is a sizeable part of the target and every step carries a few; steps vary by
/// +-10%. While every step prefills, the cost model cannot tell its constant from
/// the prefill flag, so the decoding rows' own cost (which says whether any chunk
/// fits) must stay measured: a decode-only step now and then, and the steps stay
/// within the bound. (On the real CPU benchmark, without the probe, the rows alone
/// came out over the target and the scheduler fell back to a whole block at depth,
/// 2-3x the target; this noiseless-enough fake keeps its fit without the probe, so
/// here only the probe's cadence would fail: 279 chunked steps in a row.)
#[test]
fn a_prompt_whose_depth_is_what_costs_keeps_the_rows_own_cost_measured() {
    let cost = FakeStepCost {
        base: 40e-3,
        per_decode_row: 1e-3,
        per_prefill_token: 2e-3,
        per_attention: 2e-6,
        per_context_key: 0.0,
        jitter: 0.1,
        overlap: false,
        per_mixed_step: 15e-3,
    };
    let target = Duration::from_millis(150);
    let fake = FakeConfig {
        step_cost: Some(cost),
        ..fake()
    };
    let bounded = run_timed(config(Some(target)), fake, &workload());
    assert_clean(&bounded);
    let costs = bounded.sched.model().step_costs();
    // While the prompts join (from the first mixed step to the last), a step that
    // decodes alone at least every 33.
    let first = costs.iter().position(|c| c.0 > 0 && c.1 > 0).unwrap();
    let last = costs.iter().rposition(|c| c.0 > 0 && c.1 > 0).unwrap();
    let mut streak = 0;
    let mut longest = 0;
    for c in &costs[first..=last] {
        streak = if c.1 == 0 { 0 } else { streak + 1 };
        longest = longest.max(streak);
    }
    assert!(
        longest <= 33,
        "{longest} steps in a row carried prompt chunks"
    );
    let target = target.as_secs_f64();
    let b = mixed_steps(&bounded);
    let settled = &b[4.min(b.len())..];
    let over = settled.iter().filter(|&&c| c > 1.5 * target).count();
    assert!(
        p99(settled) <= 1.5 * target,
        "mixed steps p99 {:.4} s vs target {target} ({over} of {} over 1.5x)",
        p99(settled),
        settled.len()
    );
    assert!(bounded.outcomes.iter().all(|o| o.finished.is_some()));
}

#[test]
fn a_lone_prompt_prefills_whole_chunks() {
    // A lone long prompt: nobody waits on its steps yet, so they are held to the
    // burst bound (4 targets), which whole 512-token chunks fit.
    let mut g = rng(3);
    let mut r = Request::new("long", prompt(&mut g, 3000), 2);
    r.request_id = Some("alone".into());
    let specs = vec![Spec::at(0, r)];
    let a = run_timed(config(Some(TARGET)), fake(), &specs);
    let b = run_timed(config(None), fake(), &specs);
    assert_clean(&a);
    assert_same_streams(&a, &b);
    assert_eq!(
        a.sched.model().step_costs().len(),
        b.sched.model().step_costs().len(),
        "the same steps with and without a target"
    );
}

/// A 7000-token prompt joining 8 decoding streams is cancelled (or passes its
/// deadline) halfway through its prefill. Cancels and deadlines are applied between
/// steps, so one arriving at any moment waits for the step in progress at most: under
/// the target every step the prompt shares with the streams is bounded by it (without
/// one they are 2-3x it), and the prompt's blocks are back at the first step boundary
/// after the cancel — the row leaves mid-prefill, its partial chunks with it.
#[test]
fn a_cancelled_long_prompt_frees_its_blocks_within_one_bounded_step() {
    const JOIN: u64 = 20;
    const AFTER: u64 = 8;
    let target = TARGET.as_secs_f64();
    for how in ["cancel", "deadline"] {
        for itl in [Some(TARGET), None] {
            let mut specs: Vec<Spec> = workload().into_iter().take(8).collect();
            let mut g = rng(5);
            let mut r = Request::new("long", prompt(&mut g, 7000), 4);
            r.request_id = Some("long".into());
            let mut s = Spec::at(JOIN, r);
            match how {
                "cancel" => s.cancel_after = Some(AFTER),
                _ => s.deadline_after = Some(AFTER),
            }
            specs.push(s);
            // Per step: blocks in use, and the simulated seconds of its last forward.
            let mut used = Vec::new();
            let mut cost = Vec::new();
            let r = run(
                config(itl),
                fake(),
                FakeFaults::default(),
                &specs,
                |_, sched, _| {
                    used.push(sched.stats().kv_blocks_used);
                    cost.push(sched.model().step_costs().last().map_or(0.0, |c| c.2));
                },
            );
            assert_clean(&r);
            let o = &r.outcomes[8];
            let f = o.finished.as_ref().expect("the long request finished");
            let want = match how {
                "cancel" => FinishReason::Cancelled,
                _ => FinishReason::Deadline,
            };
            assert_eq!(f.reason, want, "{how} {itl:?}");
            assert!(
                o.tokens.is_empty(),
                "{how} {itl:?}: cut before its first token"
            );
            // Applied at the first step boundary after it came.
            assert_eq!(o.finish_step, Some(AFTER), "{how} {itl:?}");
            let at = (JOIN + AFTER) as usize;
            // Mid-prefill: it held a good part of its 438 blocks.
            let held = used[at - 1] - used[at];
            assert!(
                (50..438).contains(&held),
                "{how} {itl:?}: {held} blocks freed at the cancel ({} -> {})",
                used[at - 1],
                used[at]
            );
            // The streams decoding beside it keep theirs: what is left is theirs alone.
            assert!(
                used[at] <= 8 * 20,
                "{how} {itl:?}: {} blocks left",
                used[at]
            );
            // The step a cancel can wait for: every step while the prompt was in.
            let worst = cost[JOIN as usize + 5..at]
                .iter()
                .fold(0f64, |m, &c| m.max(c));
            match itl {
                Some(_) => assert!(
                    worst <= 1.5 * target,
                    "{how}: a step of {worst:.3} s under a {target} s target"
                ),
                None => assert!(
                    worst > 2.0 * target,
                    "{how}: without a target, steps of {worst:.3} s"
                ),
            }
        }
    }
}

/// `ItlTarget::Auto`: the target is a multiple of what the step's decoding rows cost
/// alone — here 3x the 8 streams' 18 ms, 54 ms — the median of the latest steps that
/// decoded alone, and the mixed steps keep to it as to a fixed one. Also on a noisy device
/// (+-25% per step) whose lanes run decoding and prefill side by side (a step costs
/// the larger part, as on a CPU with two lanes): the fit of all steps then puts the
/// prefill's cost in its constant, and 3x its guess of "decoding alone" would be 3x
/// a mixed step (and feed on itself: a larger target, larger chunks, a larger guess).
#[test]
fn the_auto_target_follows_the_decode_step_cost() {
    for (jitter, overlap) in [(0.0, false), (0.25, true)] {
        let specs = workload();
        let cost = FakeStepCost {
            jitter,
            overlap,
            ..COST
        };
        let fake = || FakeConfig {
            step_cost: Some(cost),
            ..fake()
        };
        let (auto, targets) = run_auto(config(None), fake(), &specs);
        let plain = run_timed(config(None), fake(), &specs);
        assert_clean(&auto);
        assert_same_streams(&auto, &plain);
        // 8 decoding rows alone: 10 ms + 8 x 1 ms.
        let want = 3.0 * (COST.base + 8.0 * COST.per_decode_row);
        let worst = targets
            .iter()
            .fold(0f64, |m, &t| m.max((t - want).abs() / want));
        assert!(
            worst < 0.2,
            "jitter {jitter}: auto targets {:.4}..{:.4} vs {want}",
            targets.iter().fold(f64::MAX, |m, &t| m.min(t)),
            targets.iter().fold(0f64, |m, &t| m.max(t))
        );
        let b = mixed_steps(&auto);
        let settled = &b[4.min(b.len())..];
        assert!(
            p99(settled) <= 1.5 * want,
            "jitter {jitter}: mixed steps p99 {:.3} s vs auto target {want:.3}",
            p99(settled)
        );
        assert!(p99(&mixed_steps(&plain)) > 2.0 * want);
    }
}

/// A GPU's steps: a plain decode step runs compiled (4 ms beside 16 rows), a step with
/// any prefill op by op (13 ms more), prefill tokens cheap (30 us each). A wave of
/// short prompts must go in chunks that amortize the fixed cost — several prompts
/// per step — not one block per overhead-dominated step. Under the GPU's auto
/// target (3x the decode step, at least 20 ms) a chunk fits beside the rows; the
/// chunks then grow to an overhead's worth of tokens within 1.3 targets. Under a
/// fixed 10 ms target the decoding rows and the overhead alone are past that: the
/// target yields, to the decoding step plus two overheads.
#[test]
fn chunks_amortize_the_fixed_cost_of_a_mixed_step() {
    let cost = FakeStepCost {
        base: 4e-3,
        per_decode_row: 2e-5,
        per_prefill_token: 3e-5,
        per_attention: 1e-10,
        per_context_key: 0.0,
        jitter: 0.0,
        overlap: false,
        per_mixed_step: 13e-3,
    };
    let mut g = rng(23);
    let mut specs: Vec<Spec> = (0..16)
        .map(|i| Spec::at(0, Request::new("decode", prompt(&mut g, 24 + i), 400)))
        .collect();
    for i in 0..48 {
        specs.push(Spec::at(
            30 + i / 8,
            Request::new("wave", prompt(&mut g, 128), 8),
        ));
    }
    let fake = FakeConfig {
        step_cost: Some(cost),
        ..fake()
    };
    let alone = cost.base + 64.0 * cost.per_decode_row;
    let auto = ItlTarget::Auto {
        factor: 3.0,
        min: Duration::from_millis(20),
    };
    let fixed = ItlTarget::Fixed(Duration::from_millis(10));
    // (target, the fewest tokens a mixed step takes on average, the most it may
    // take once the cost is learned): ~250 tokens (8 ms of them) within 26 ms, and
    // ~380 (up to 13 ms, an overhead's worth) past the fixed target.
    for (itl, least, bound) in [
        (auto, 200, 1.3 * 20e-3 * 1.05),
        (fixed, 320, alone + 2.0 * cost.per_mixed_step),
    ] {
        let mut cfg = config(None);
        cfg.max_batch_rows = 64;
        cfg.itl_target = itl;
        let r = run_timed(cfg, fake.clone(), &specs);
        assert_clean(&r);
        assert!(r.outcomes.iter().all(|o| o.finished.is_some()));
        let steps = r.sched.model().step_costs();
        let mixed: Vec<&(usize, usize, f64)> = steps
            .iter()
            .filter(|&&(decode, other, _)| decode > 0 && other > 0)
            .collect();
        let tokens: usize = mixed.iter().map(|c| c.1).sum();
        assert!(
            tokens >= 16 * 128,
            "{itl:?}: {tokens} prefill tokens beside decoding rows"
        );
        let per_step = tokens / mixed.len();
        let total: f64 = steps.iter().map(|c| c.2).sum();
        eprintln!(
            "{itl:?}: {} mixed steps, {per_step} prefill tokens each, {total:.2} simulated s in all",
            mixed.len()
        );
        assert!(
            per_step >= least,
            "{itl:?}: {per_step} prefill tokens per mixed step over {} steps",
            mixed.len()
        );
        let worst = mixed.iter().skip(4).fold(0f64, |m, c| m.max(c.2));
        assert!(worst <= bound, "{itl:?}: worst mixed step {worst:.4} s");
    }
}

/// Latency isolation (issue 17 item 2): a tenant that was active lately holds
/// another tenant's prompt-only steps to the target too. Here the light tenant
/// sends a request, then the flood's burst of twelve 1500-token prompts arrives
/// (steps with no decoding row, each prefilling up to the 2048-token budget),
/// then the light tenant's next request: whatever step is in progress when it
/// arrives is one it waits for. With the isolation window every burst step stays
/// within 1.5x the target; without it (window zero) they are held to the burst
/// bound (`burst_step_factor` targets), and with neither they run 5-7x over it.
/// The streams are the same either way.
#[test]
fn another_tenants_burst_of_prompts_is_held_to_the_target() {
    let mut g = rng(29);
    let light = |g: &mut _, id: &str, len: usize, gen: usize| {
        let mut r = Request::new("light", prompt(g, len), gen);
        r.request_id = Some(id.into());
        Spec::at(0, r)
    };
    // The light tenant's first request is a longer one: the cost model has seen
    // prompt-only and decode steps before the burst (a server that has been up a
    // while has).
    let mut specs = vec![light(&mut g, "l0", 900, 16)];
    for i in 0..12 {
        let mut r = Request::new("flood", prompt(&mut g, 1500), 4);
        r.request_id = Some(format!("f{i}"));
        specs.push(Spec::at(24, r));
    }
    let mut l1 = light(&mut g, "l1", 8, 2);
    l1.arrival_step = 28;
    specs.push(l1);
    let with = |window: Duration, burst: f64| SchedulerConfig {
        isolation_window: window,
        burst_step_factor: burst,
        ..config(Some(TARGET))
    };
    let isolated = run_timed(with(Duration::from_secs(3600), 4.0), fake(), &specs);
    let open = run_timed(with(Duration::ZERO, 4.0), fake(), &specs);
    let unbound = run_timed(with(Duration::ZERO, f64::INFINITY), fake(), &specs);
    assert_clean(&isolated);
    assert_clean(&open);
    assert_clean(&unbound);
    assert_same_streams(&isolated, &open);
    assert_same_streams(&isolated, &unbound);
    // Prompt-only steps: first the light tenant's 900-token prompt in two
    // chunks (one tenant active: not held to the target), then the flood's.
    let prompt_only = |r: &Run| -> Vec<f64> {
        r.sched
            .model()
            .step_costs()
            .iter()
            .filter(|&&(decode, other, _)| decode == 0 && other > 64)
            .map(|c| c.2)
            .collect()
    };
    let (pb, po, pu) = (
        prompt_only(&isolated),
        prompt_only(&open),
        prompt_only(&unbound),
    );
    let target = TARGET.as_secs_f64();
    assert!(
        pb.len() > 2 && pb[0] > 1.5 * target && pb[0] <= 4.0 * 1.5 * target,
        "a lone tenant's prompt is held to the burst bound, not the target: {pb:?}"
    );
    let (b, o) = (pb[2..].to_vec(), po[2..].to_vec());
    let u = pu[pu.len().min(1)..].to_vec();
    let worst = |v: &[f64]| v.iter().fold(0f64, |m, &x| m.max(x));
    eprintln!(
        "prompt-only steps: isolated {} (worst {:.3} s), open {} (worst {:.3} s), unbound {} (worst {:.3} s)",
        b.len(),
        worst(&b),
        o.len(),
        worst(&o),
        u.len(),
        worst(&u)
    );
    assert!(
        !u.is_empty() && worst(&u) > 5.0 * target,
        "the unbound run's burst steps {u:?}"
    );
    assert!(
        !o.is_empty() && worst(&o) > 1.5 * target && worst(&o) <= 4.0 * 1.5 * target,
        "the open run's burst steps {o:?} against a bound of 4 targets of {target}"
    );
    assert!(
        !b.is_empty() && worst(&b) <= 1.5 * target,
        "isolated burst steps {b:?} against a target of {target}"
    );
    // The light tenant's second request starts in the step after it arrives.
    let l1 = &isolated.outcomes[specs.len() - 1];
    assert!(
        l1.first_token_step.is_some_and(|s| s <= 1),
        "{:?}",
        l1.first_token_step
    );
}

/// A queue under the auto target: 24 requests of 384-token prompts arrive at
/// once. The target is a multiple of what decoding costs, and the decoding rows
/// are the few admitted first: were it only of them (3x a 1-3 row step, ~40 ms),
/// each step would admit ~1/3 of a prompt beside them, the batch would stay a few
/// rows, and the queue would wait ~60 steps for its first tokens (the CPU server's
/// tenant-mix flood: 1-3 rows decoding while 30 requests waited 5-40 s). The target
/// follows the batch as it will be once the waiting requests are in, so the queue
/// is admitted in prompt-sized chunks and decodes together.
#[test]
fn a_queue_is_admitted_as_the_batch_it_will_be() {
    let mut g = rng(41);
    // Two streams decode first, so the cost model and the auto target are warm
    // when the queue arrives (a server that has been up a while).
    let mut specs = requests(&mut g, "warm", "w", 2, (32, 400), 0);
    specs.extend(requests(&mut g, "flood", "q", 24, (384, 48), 40));
    let cfg = SchedulerConfig {
        max_batch_rows: 32,
        ..config(None)
    };
    let (auto, targets) = run_auto(cfg, fake(), &specs);
    let plain = run_timed(config(None), fake(), &specs);
    assert_clean(&auto);
    assert_same_streams(&auto, &plain);
    let widest = auto
        .sched
        .model()
        .step_costs()
        .iter()
        .map(|c| c.0)
        .max()
        .unwrap_or(0);
    let mut first: Vec<u64> = auto
        .outcomes
        .iter()
        .skip(2)
        .filter_map(|o| o.first_token_step)
        .collect();
    first.sort_unstable();
    let median = first[first.len() / 2];
    eprintln!(
        "widest decode step {widest} rows, first tokens at steps {first:?}, targets {:.4}..{:.4}",
        targets.iter().fold(f64::MAX, |m, &t| m.min(t)),
        targets.iter().fold(0f64, |m, &t| m.max(t))
    );
    assert!(
        widest >= 16,
        "the queue decoded at most {widest} rows together"
    );
    assert!(
        median <= 30,
        "half the queue waited over 30 steps: {first:?}"
    );
}

/// Latency isolation: while tenants share the engine, a tenant holding no row gets
/// its first request's prefill in a step of its own, not beside another tenant's
/// decoding rows (whose step would cost it their whole decode besides its prompt).
/// The decoding rows skip that one step, never two in a row: two light tenants
/// arriving together share the step, and the flood decodes in the next.
#[test]
fn a_starting_tenants_prefill_runs_without_the_others_decoding_rows() {
    let mut g = rng(53);
    let mut specs = requests(&mut g, "flood", "f", 12, (40, 120), 0);
    for (i, (tenant, at)) in [("light", 30u64), ("light", 60), ("other", 60)]
        .into_iter()
        .enumerate()
    {
        specs.extend(requests(&mut g, tenant, &format!("l{i}-"), 1, (24, 4), at));
    }
    let with = |window: Duration| SchedulerConfig {
        isolation_window: window,
        ..config(Some(TARGET))
    };
    let isolated = run_timed(with(Duration::from_secs(3600)), fake(), &specs);
    let mixed = run_timed(with(Duration::ZERO), fake(), &specs);
    assert_clean(&isolated);
    assert_clean(&mixed);
    assert_same_streams(&isolated, &mixed);
    let steps = |r: &Run| r.sched.model().step_costs().to_vec();
    let (si, sm) = (steps(&isolated), steps(&mixed));
    // The light prompts' steps: no decoding row beside them when isolated, the
    // flood's 12 rows beside them otherwise.
    let alone: Vec<_> = si
        .iter()
        .filter(|c| c.0 == 0 && (24..=48).contains(&c.1))
        .collect();
    let beside: Vec<_> = sm.iter().filter(|c| c.0 > 0 && c.1 >= 24).collect();
    eprintln!("isolated prompt-only steps {alone:?}; mixed steps with a light prompt {beside:?}");
    assert!(
        alone.iter().any(|c| c.1 == 24) && alone.iter().any(|c| c.1 == 48),
        "each arrival's prefill alone (the two at step 60 together): {alone:?}"
    );
    assert!(
        !beside.is_empty(),
        "without the window they join the decode steps"
    );
    // Decoding rows never skip two steps in a row.
    for w in si.windows(2) {
        assert!(w[0].0 > 0 || w[1].0 > 0 || w[0].1 == 0, "{si:?}");
    }
    // And the light requests' first steps cost them less than a mixed step would.
    let cost = |c: &(usize, usize, f64)| c.2;
    let worst_alone = alone.iter().map(|c| cost(c)).fold(0f64, f64::max);
    let best_beside = beside.iter().map(|c| cost(c)).fold(f64::MAX, f64::min);
    assert!(
        worst_alone < best_beside,
        "alone {worst_alone:.4} s vs beside {best_beside:.4} s"
    );
}

/// With [`StartingStep::BesideRows`] (a GPU's compiled mixed step, where a short
/// prompt beside the decoding rows costs little more than the rows) a starting
/// tenant's prefill keeps the decoding rows in its step and leaves only the other
/// tenants' prompts out: the flood's rows never skip a step, and the light prompts
/// (alone at step 30, two tenants together at step 60) still go before the
/// flood's prompts that arrived with them.
#[test]
fn a_starting_tenants_prefill_beside_the_rows_leaves_only_others_prompts_out() {
    let mut g = rng(53);
    let mut specs = requests(&mut g, "flood", "f", 12, (40, 120), 0);
    specs.extend(requests(&mut g, "flood", "g", 4, (40, 8), 30));
    specs.extend(requests(&mut g, "flood", "h", 4, (40, 8), 60));
    for (i, (tenant, at)) in [("light", 30u64), ("light", 60), ("other", 60)]
        .into_iter()
        .enumerate()
    {
        specs.extend(requests(&mut g, tenant, &format!("l{i}-"), 1, (24, 4), at));
    }
    let with = |starting_step: StartingStep| SchedulerConfig {
        isolation_window: Duration::from_secs(3600),
        starting_step,
        ..config(Some(TARGET))
    };
    let beside = run_timed(with(StartingStep::BesideRows), fake(), &specs);
    let alone = run_timed(with(StartingStep::Alone), fake(), &specs);
    assert_clean(&beside);
    assert_clean(&alone);
    assert_same_streams(&beside, &alone);
    let steps = beside.sched.model().step_costs().to_vec();
    let first_decode = steps.iter().position(|c| c.0 > 0).unwrap();
    assert!(
        steps[first_decode..].iter().all(|c| c.0 > 0),
        "the decoding rows skipped a step: {steps:?}"
    );
    // The light prompts' steps: the flood's 12 rows decoding, nothing else
    // prefilling (the flood's 160 prompt tokens that arrived with them wait).
    for light in [24, 48] {
        assert!(
            steps.iter().any(|c| c.0 >= 12 && c.1 == light),
            "no step of {light} prompt tokens beside the rows: {steps:?}"
        );
    }
    // Alone, those steps had no decoding row.
    let a = alone.sched.model().step_costs();
    assert!(a.iter().any(|c| c.0 == 0 && c.1 == 24), "{a:?}");
}

/// A long prompt of a tenant holding no row gets no step of its own (one it does
/// not finish would only stretch the decoding rows' gap: they would wait for it and
/// then for a full mixed step): from the first decode step on, every step that
/// prefills the long prompts carries the streams too. A starting tenant's prompt
/// of one chunk still runs alone.
#[test]
fn a_long_prompt_never_runs_in_a_step_without_the_decoding_rows() {
    // The prompt tokens of each step without decoding rows after the first
    // step that decoded.
    let alone = |specs: &[Spec]| -> Vec<usize> {
        let r = run_timed(config(Some(TARGET)), fake(), specs);
        assert_clean(&r);
        let steps = r.sched.model().step_costs();
        let first_decode = steps.iter().position(|c| c.0 > 0).unwrap();
        steps[first_decode..]
            .iter()
            .filter(|c| c.0 == 0 && c.1 > 0)
            .map(|c| c.1)
            .collect()
    };
    let long = alone(&workload());
    assert!(
        long.is_empty(),
        "prompt steps without the streams: {long:?}"
    );
    // Short prompts of starting tenants still run alone (the test above); here
    // a 24-token one beside the streams, and a 600-token one (two chunks) that
    // does not.
    let mut g = rng(5);
    let mut specs = requests(&mut g, "flood", "f", 8, (40, 200), 0);
    specs.extend(requests(&mut g, "light", "s", 1, (24, 4), 40));
    specs.extend(requests(&mut g, "other", "l", 1, (600, 4), 120));
    assert_eq!(alone(&specs), [24], "only the short prompt alone");
}

/// A GPU's regime, where the model reports no step's seconds and the scheduler
/// times them itself: a plain decode step runs compiled (5 ms beside 8 rows), a
/// step with a prompt chunk op by op (12 ms more), tokens cheap. Under a 20 ms
/// target a 2048- and a 7000-token prompt join 8 decoding streams of 3000 tokens.
/// The decode-only probe (a step now and then without chunks, so the rows' own cost
/// stays measured) runs pipelined, and a lone pipelined step went unmeasured: it did
/// not end the streak, so every later step was a probe and the prompts waited for
/// the streams to finish (on an H200: 2189 steps, TTFT 14 s; here 2773 steps).
/// Again with the first call of every new chunk length 15 ms slower (MLX CUDA plans
/// each new shape): one such step put the cost of a context key 100x too high
/// into the fit, no chunk fitted after it, and the prompt went a token a step
/// (those run as decode rows, and teach the fit nothing of prefilling) for 2000
/// steps on an H100; here 2100. Now the prompts' first tokens come within ~150
/// steps either way.
#[test]
fn prompts_keep_joining_when_the_model_does_not_time_its_steps() {
    let cost = FakeStepCost {
        base: 5e-3,
        per_decode_row: 5e-5,
        per_prefill_token: 5e-5,
        per_attention: 1e-10,
        per_context_key: 1e-7,
        jitter: 0.05,
        overlap: false,
        per_mixed_step: 12e-3,
    };
    let specs = workload_of(3000, [200, 240]);
    // The strict bound (opt-in on a GPU) only where first calls are rare (its
    // chunk shapes warmed up front, in multiples of a block): under a slow first
    // call of every new length it held p99 to 20 ms but the 7000-token prompt's
    // first token came after 543 steps, the fit's overhead kept past the bound.
    for (new_shape_cost, strict_bound) in [(0.0, false), (15e-3, false), (0.0, true)] {
        let fake = FakeConfig {
            step_cost: Some(cost),
            unmeasured_pipelined: true,
            new_shape_cost,
            ..fake()
        };
        // A GPU's settings: strict bound, chunks in multiples of a block.
        let cfg = SchedulerConfig {
            strict_bound,
            prefill_granule: if strict_bound { 16 } else { 1 },
            ..config(Some(Duration::from_millis(20)))
        };
        let r = run_timed(cfg, fake, &specs);
        assert_clean(&r);
        let costs = r.sched.model().step_costs();
        let mixed = mixed_steps(&r);
        let tokens: usize = costs
            .iter()
            .filter(|c| c.0 > 0 && c.1 > 0)
            .map(|c| c.1)
            .sum();
        let first: Vec<u64> = r.outcomes[8..]
            .iter()
            .map(|o| o.first_token_step.unwrap())
            .collect();
        eprintln!(
            "strict {strict_bound}, new shapes +{new_shape_cost} s: first tokens after {first:?} steps; {} mixed steps, \
             {tokens} prefill tokens, p99 {:.4} s",
            mixed.len(),
            p99(&mixed)
        );
        for steps in &first {
            assert!(
                *steps <= 150,
                "new shapes +{new_shape_cost} s: first tokens after {first:?} steps"
            );
        }
        if new_shape_cost == 0.0 {
            assert!(p99(&mixed[4.min(mixed.len())..]) <= 1.5 * 20e-3);
        }
    }
}

/// `prefill_granule` (a GPU's 16): a chunk cut to fit the target is cut to a
/// multiple of a block, so the steps run few chunk lengths (each new one is a new
/// shape, slow on its first call on a GPU); only the rest of a prompt keeps its
/// own length. Without it the target leaves chunks of every length. The streams are
/// the same either way.
#[test]
fn chunks_cut_to_the_target_come_in_multiples_of_the_granule() {
    let run_with = |granule: usize| {
        let cfg = SchedulerConfig {
            prefill_granule: granule,
            ..config(Some(TARGET))
        };
        run_timed(cfg, fake(), &workload())
    };
    let (cut, any) = (run_with(16), run_with(1));
    assert_clean(&cut);
    assert_same_streams(&cut, &any);
    let odd = |r: &Run| {
        let mut lens: Vec<usize> = r
            .sched
            .model()
            .step_costs()
            .iter()
            .filter(|c| c.0 > 0 && c.1 >= 16 && c.1 % 16 != 0)
            .map(|c| c.1)
            .collect();
        lens.sort_unstable();
        lens.dedup();
        lens
    };
    let (o_cut, o_any) = (odd(&cut), odd(&any));
    eprintln!(
        "lengths off the granule: {o_cut:?} with it, {} without",
        o_any.len()
    );
    // The two prompts' last chunks (and a step carrying both prompts' chunks).
    assert!(o_cut.len() <= 3, "{o_cut:?}");
    assert!(o_any.len() > 10, "{o_any:?}");
    assert!(cut.outcomes.iter().all(|o| o.finished.is_some()));
}

/// Steps that carry prompt chunks are queued behind the step before them, like
/// decode steps: a prompt's next chunk is known before the step in flight is read,
/// so the host builds it while the device runs that one (on a GPU a step with a
/// chunk runs op by op, and its graph build is most of its cost). While the long
/// prompts join 8 streams, almost every step is queued behind the one before; the
/// streams are those of a run that never pipelines.
#[test]
fn steps_with_prompt_chunks_are_queued_behind_the_step_before() {
    let plain_cfg = SchedulerConfig {
        pipeline: false,
        ..config(Some(TARGET))
    };
    let piped = run_timed(config(Some(TARGET)), fake(), &workload());
    let plain = run_timed(plain_cfg, fake(), &workload());
    assert_clean(&piped);
    assert_same_streams(&piped, &plain);
    let steps = piped.sched.model().step_costs().len() as u64;
    let mixed = mixed_steps(&piped).len() as u64;
    let chained = piped.sched.stats().pipelined_steps;
    eprintln!("{chained} of {steps} steps queued behind the one before, {mixed} mixed");
    assert!(chained * 10 >= steps * 9, "{chained} of {steps} chained");
    assert!(chained > steps - mixed, "mixed steps chained too");
}

/// A step that traced a compiled form first (a GPU's first call of a new shape:
/// on an H100 one such step of 896 prompt tokens took 4.8 s) is not what its
/// shape costs: the model says so ([`Model::last_build_traced`]) and the cost
/// model does not learn from it (learned, one such step priced prompt tokens at
/// hundreds of times their cost, and a long prompt crept beside the decoding rows
/// a few tokens a step for the rest of the run). A step whose follower traced is
/// not learned either (that trace ran inside its period).
#[test]
fn steps_that_traced_do_not_teach_the_cost_model() {
    let cost = FakeStepCost {
        base: 5e-3,
        per_decode_row: 5e-5,
        per_prefill_token: 5e-5,
        per_attention: 1e-10,
        per_context_key: 1e-7,
        jitter: 0.05,
        overlap: false,
        per_mixed_step: 3e-3,
    };
    let specs = workload_of(3000, [200, 240]);
    let run = |reports_traces: bool| {
        let fake = FakeConfig {
            step_cost: Some(cost),
            new_shape_cost: 2.0,
            reports_traces,
            ..fake()
        };
        // Chunks cut to blocks, as on a GPU: few lengths, each traced once.
        let cfg = SchedulerConfig {
            prefill_granule: 16,
            ..config(Some(Duration::from_millis(20)))
        };
        let r = run_timed(cfg, fake, &specs);
        assert_clean(&r);
        let steps = r.sched.model().step_costs().len() as u64;
        let seen = r.sched.model().traced_steps();
        let observed = r.sched.step_cost().observed();
        eprintln!(
            "first calls reported {reports_traces}: {steps} steps, {seen} of them traced, \
             {observed} observed"
        );
        (steps, seen, observed)
    };
    let (steps, seen, observed) = run(true);
    assert!(seen > 0, "no step traced");
    assert!(
        observed + seen <= steps,
        "{observed} steps of {steps} observed, {seen} of them traced"
    );
    let (steps, _, observed) = run(false);
    assert_eq!(observed, steps, "unreported first calls are learned");
}

/// A starting tenant's short request that arrives with another tenant's burst of
/// prompts (nothing decoding yet) gets a step of its own first: a step with the
/// burst's prompts would make its first token wait for their prefill too (on the
/// CPU a light request arriving with a 32-stream flood's first prompts waited
/// ~505 ms for a 164-token step, its own 32 tokens take ~150 ms).
#[test]
fn a_starting_tenants_prompt_goes_before_another_tenants_burst_in_a_step_of_its_own() {
    let mut g = rng(71);
    let mut specs = requests(&mut g, "flood", "f", 12, (100, 40), 0);
    specs.extend(requests(&mut g, "light", "l", 1, (24, 4), 0));
    for window in [Duration::from_secs(3600), Duration::ZERO] {
        let cfg = SchedulerConfig {
            isolation_window: window,
            ..config(Some(TARGET))
        };
        let r = run_timed(cfg, fake(), &specs);
        assert_clean(&r);
        let steps = r.sched.model().step_costs().to_vec();
        eprintln!("window {window:?}: first steps {:?}", &steps[..3]);
        if window.is_zero() {
            assert!(steps[0].1 > 24, "off: one step with the burst {steps:?}");
        } else {
            assert_eq!(
                (steps[0].0, steps[0].1),
                (0, 24),
                "the light prompt alone first: {steps:?}"
            );
        }
    }
}

/// Where the model runs short prompt chunks as decoding rows (a GPU's compiled
/// decode step: `Model::short_prompts`), a wave of short prompts joins decoding rows
/// in steps that stay short: each takes the prompts that still run as decoding rows
/// within the target, and the next one, which would turn the step into a prefill
/// with its fixed cost, waits for the next step. Here that cost (25 ms, past the
/// 20 ms target) is learned from the decoding rows' own longer prompts, so the
/// amortized allowance for a prefill would let a step run to ~55 ms: a wave
/// step priced as a prefill took 9 prompts.
#[test]
fn short_prompts_join_as_decoding_rows_and_keep_the_step_short() {
    let cost = FakeStepCost {
        base: 5e-3,
        per_decode_row: 1e-5,
        per_prefill_token: 2e-5,
        per_attention: 0.0,
        per_context_key: 0.0,
        jitter: 0.0,
        overlap: false,
        per_mixed_step: 25e-3,
    };
    let mut g = rng(29);
    // Prompts of 600-607 tokens (500 a chunk): too long to run as decoding rows.
    let mut specs: Vec<Spec> = (0..64)
        .map(|i| {
            let r = Request::new("decode", prompt(&mut g, 600 + i % 8), 400);
            Spec::at(i as u64 / 2, r)
        })
        .collect();
    for i in 0..48 {
        specs.push(Spec::at(
            90 + i / 16,
            Request::new("wave", prompt(&mut g, 128), 8),
        ));
    }
    let fake = FakeConfig {
        step_cost: Some(cost),
        short_prompts: Some(ShortPrompts {
            tokens: 1024,
            keys: 65_536,
        }),
        kv_blocks: 8192,
        ..fake()
    };
    let mut cfg = config(None);
    cfg.max_batch_rows = 128;
    cfg.prefill_chunk = 500;
    cfg.itl_target = ItlTarget::Auto {
        factor: 3.0,
        min: Duration::from_millis(20),
    };
    let r = run_timed(cfg, fake, &specs);
    assert_clean(&r);
    assert!(r.outcomes.iter().all(|o| o.finished.is_some()));
    // The wave's steps: its 128-token prompts beside the 64 rows.
    let steps = r.sched.model().step_costs();
    let wave: Vec<&(usize, usize, f64)> = steps
        .iter()
        .filter(|&&(decode, other, _)| decode >= 64 && other > 0 && other % 128 == 0)
        .collect();
    let tokens: usize = wave.iter().map(|c| c.1).sum();
    let worst = wave.iter().fold(0f64, |m, c| m.max(c.2));
    eprintln!(
        "{} steps with the wave's prompts beside the rows, {tokens} prompt tokens, worst {worst:.4} s",
        wave.len()
    );
    assert_eq!(
        tokens,
        48 * 128,
        "prompt tokens of the wave beside the rows"
    );
    assert!(
        worst <= 1.5 * 20e-3,
        "worst step with the wave's prompts {worst:.4} s"
    );
    assert!(
        wave.len() <= 10,
        "the wave took {} steps to join (7 prompts a step run as decoding rows)",
        wave.len()
    );
}
