//! The pipelined engine loop: while the model computes step n, step n+1 is planned
//! and queued with step n's picks as its inputs. It must stream exactly what one step
//! at a time streams — requests finishing in step n drop their step n+1 work,
//! cancellations and deadlines land between steps — and a fault in step n rolls back
//! n and n+1 without losing, duplicating or streaming a token of either.

mod common;

use common::*;
use weft_scheduler::fake::{FakeConfig, FakeFaults};
use weft_scheduler::{FaultPlan, FaultPoint, Request, SamplingParams};

/// Requests in waves, so long stretches decode steadily (the steps that pipeline):
/// greedy and seeded sampling, stop ids and strings, EOS, logprobs; some requests are
/// cancelled, dropped or expire mid-stream (`disturbed`); no penalties except in
/// `penalized` of them (a penalized row keeps its batch one step at a time).
fn waves(seed: u64, n: usize, disturbed: bool, penalized: usize) -> Vec<Spec> {
    let mut g = rng(seed);
    (0..n)
        .map(|i| {
            let t = ["t0", "t1"][i % 2];
            let mut req = varied_request(&mut g, t, 1.0, i);
            if i >= penalized {
                no_penalties(&mut req);
            }
            req.max_tokens = 8 + below(&mut g, 120) as usize;
            let mut spec = Spec::at((i as u64 / 24) * 90 + below(&mut g, 6), req);
            if disturbed {
                disturb(&mut spec, &mut g, 12, 3, 40);
            }
            spec
        })
        .collect()
}

fn no_penalties(req: &mut weft_scheduler::Request) {
    let s = &mut req.sampling;
    s.repetition_penalty = 1.0;
    s.presence_penalty = 0.0;
    s.frequency_penalty = 0.0;
}

/// Three requests in `one_in` are disturbed: one cancelled, one dropped, one
/// expiring, each `from + below(span)` steps after its arrival.
fn disturb(spec: &mut Spec, g: &mut rand_chacha::ChaCha8Rng, one_in: u64, from: u64, span: u64) {
    match below(g, one_in) {
        0 => spec.cancel_after = Some(from + below(g, span)),
        1 => spec.drop_after = Some(from + below(g, span)),
        2 => spec.deadline_after = Some(from + below(g, span)),
        _ => {}
    }
}

/// `specs` run one step at a time and pipelined, both clean, their streams equal.
fn plain_and_piped(specs: &[Spec]) -> (Run, Run) {
    let plain = run_plain(one_at_a_time(), specs);
    let piped = run_plain(sched_config(), specs);
    assert_clean(&plain);
    assert_clean(&piped);
    assert_same_streams(&plain, &piped);
    (plain, piped)
}

fn one_at_a_time() -> weft_scheduler::SchedulerConfig {
    let mut cfg = sched_config();
    cfg.pipeline = false;
    cfg
}

#[test]
fn pipelined_steps_stream_exactly_what_one_step_at_a_time_does() {
    for (seed, blocks) in [(1, BLOCKS), (2, 10_000), (3, 120)] {
        let specs = waves(seed, 240, false, 6);
        let plain = run_blocks(one_at_a_time(), blocks, &specs);
        let piped = run_blocks(sched_config(), blocks, &specs);
        assert_clean(&plain);
        assert_clean(&piped);
        assert_same_streams(&plain, &piped);
        let (p, q) = (plain.sched.model().stats(), piped.sched.model().stats());
        eprintln!("seed {seed}: plain {p:?}\npiped {q:?}");
        assert_eq!(p.submits, 0);
        assert_eq!(
            q.max_staged, 2,
            "seed {seed}: no step was queued behind another"
        );
        assert!(
            q.submits * 2 > q.forwards,
            "seed {seed}: only {} of {} steps pipelined",
            q.submits,
            q.forwards
        );
        assert_eq!(q.collects, q.submits, "seed {seed}");
    }
}

/// Cancels, dropped streams and deadlines land between steps, while the next step is
/// queued: that step's work for the request is dropped, nothing of it streams, and its
/// blocks come back. (A request arriving while a step is queued joins one step later
/// than it would one step at a time, so step-timed disturbances cut streams at other
/// points: each is a prefix of the request's undisturbed stream.)
#[test]
fn cancels_and_deadlines_between_pipelined_steps_lose_nothing_else() {
    let specs = waves(4, 240, true, 0);
    let calm: Vec<Spec> = specs
        .iter()
        .map(|s| Spec::at(s.arrival_step, s.req.clone()))
        .collect();
    let full = run_plain(one_at_a_time(), &calm);
    let piped = run_plain(sched_config(), &specs);
    assert_clean(&piped);
    let cut = cut_streams(&specs, &piped, &full);
    assert!(cut > 10, "only {cut} streams were cut");
    assert_eq!(piped.sched.model().stats().max_staged, 2);
}

/// Checks `run` of the disturbed `specs` against `full`, their undisturbed run:
/// each disturbed stream is a prefix of its undisturbed one, every other stream
/// equal. Returns how many streams were cut short.
fn cut_streams(specs: &[Spec], run: &Run, full: &Run) -> usize {
    let mut cut = 0;
    for (i, (s, (o, f))) in specs
        .iter()
        .zip(run.outcomes.iter().zip(&full.outcomes))
        .enumerate()
    {
        let disturbed =
            s.cancel_after.is_some() || s.drop_after.is_some() || s.deadline_after.is_some();
        if disturbed {
            assert!(
                f.tokens.starts_with(&o.tokens),
                "request {i}: {:?} vs {:?}",
                o.tokens,
                f.tokens
            );
            cut += usize::from(o.tokens.len() < f.tokens.len());
        } else {
            assert_eq!(o.tokens, f.tokens, "request {i}");
            assert_eq!(o.text, f.text, "request {i}");
        }
    }
    cut
}

/// Undisturbed waves, so a run with faults (and so with more steps) must stream the
/// same as one without.
fn calm(seed: u64) -> Vec<Spec> {
    waves(seed, 200, false, 4)
}

#[test]
fn a_fault_in_a_pipelined_step_rolls_back_both_and_loses_nothing() {
    let specs = calm(7);
    let clean = run_plain(sched_config(), &specs);
    assert_clean(&clean);
    // Step n fails when read, with step n+1 queued on its picks (twice in a row at
    // 11-12: the re-run succeeds, the next pipelined step fails again).
    let collect = FakeFaults {
        collect_fail_calls: vec![3, 11, 12, 40, 41, 90],
        ..Default::default()
    };
    // A failing submit (of step n or of n+1 queued behind it), a failing commit.
    let forward = FakeFaults {
        forward_fail_calls: vec![4, 9, 30, 31, 77],
        fail_after_layer: 1,
        commit_fail_calls: vec![5, 20, 21, 60],
        ..Default::default()
    };
    for (name, faults, min_rollbacks) in [("collect", collect, 6), ("forward", forward, 9)] {
        let r = run(sched_config(), fake_config(), faults, &specs, |_, _, _| {});
        assert_clean(&r);
        assert_same_streams(&clean, &r);
        let st = r.sched.stats();
        assert_eq!(st.failed_steps, 0, "{name}");
        assert!(
            st.rollbacks >= min_rollbacks,
            "{name}: {} rollbacks",
            st.rollbacks
        );
        let f = r.sched.model().stats();
        assert!(f.max_staged == 2 && f.submits > 100, "{name}: {f:?}");
        if name == "collect" {
            assert_eq!(f.failed_collects, 6);
        }
    }
    // The scheduler's own fault points fire while the next step is queued.
    for point in FaultPoint::ALL {
        let mut cfg = sched_config();
        cfg.faults = FaultPlan::default().at(point, 5).at(point, 6).at(point, 70);
        let r = run_plain(cfg, &specs);
        assert_clean(&r);
        assert_same_streams(&clean, &r);
        assert_eq!(r.sched.stats().rollbacks, 3, "{point:?}");
    }
}

/// Random faults at the scheduler's points (seeded `seed`) and in the fake model
/// (`seed + 1`; its layer `fail_after_layer`), and a failed read of every `every`-th
/// collect from the first on.
fn random_faults(
    seed: u64,
    first: u64,
    every: usize,
    fail_after_layer: usize,
) -> (weft_scheduler::SchedulerConfig, FakeFaults) {
    let mut cfg = sched_config();
    cfg.faults = FaultPlan::random(seed, 0.03);
    cfg.max_step_retries = 60;
    let faults = FakeFaults {
        random: Some((seed + 1, 0.02)),
        collect_fail_calls: (first..3000).step_by(every).collect(),
        fail_after_layer,
        ..Default::default()
    };
    (cfg, faults)
}

#[test]
fn random_faults_in_pipelined_runs_leave_streams_unchanged() {
    let specs = calm(8);
    let clean = run_plain(one_at_a_time(), &specs);
    let (cfg, faults) = random_faults(3, 1, 37, 2);
    let r = run(cfg, fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_same_streams(&clean, &r);
    let st = r.sched.stats();
    assert!(st.rollbacks > 30, "rollbacks {}", st.rollbacks);
    assert_eq!(st.failed_steps, 0);
    let f = r.sched.model().stats();
    assert!(f.failed_collects >= 5 && f.failed_forwards >= 3, "{f:?}");
}

fn penalized(seed: u64) -> Vec<Spec> {
    let mut specs = calm(seed);
    for s in specs.iter_mut() {
        s.req.sampling = SamplingParams {
            temperature: 0.9,
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            ..Default::default()
        };
        s.req.seed = Some(5);
    }
    specs
}

/// Penalties need the step's pick in the next step's counts: a model that defers
/// sampling gets the next step's forward queued at once and its sampling (the counts
/// after the pick) once the step is read; the streams are those of the plain loop.
#[test]
fn penalized_rows_pipeline_with_their_sampling_deferred() {
    let specs = penalized(9);
    let plain = run_plain(one_at_a_time(), &specs);
    let piped = run_plain(sched_config(), &specs);
    assert_clean(&piped);
    assert_same_streams(&plain, &piped);
    let f = piped.sched.model().stats();
    assert_eq!(f.max_staged, 2, "{f:?}");
    assert!(f.deferred * 2 > f.forwards, "{f:?}");
    assert_eq!(f.sampling_calls, f.deferred);
    assert!(piped.sched.stats().pipelined_steps > 100);
}

/// A model that cannot defer sampling runs a batch with a penalized row one step at a
/// time, with the same streams.
#[test]
fn penalized_rows_keep_their_batch_one_step_at_a_time_without_deferred_sampling() {
    let specs = penalized(9);
    let plain = run_plain(one_at_a_time(), &specs);
    let fake = FakeConfig {
        defer_sampling: false,
        ..fake_config()
    };
    let piped = run(
        sched_config(),
        fake,
        FakeFaults::default(),
        &specs,
        |_, _, _| {},
    );
    assert_clean(&piped);
    assert_same_streams(&plain, &piped);
    let f = piped.sched.model().stats();
    assert_eq!((f.max_staged, f.deferred), (1, 0), "{f:?}");
}

/// A deferred sampling that fails rolls back the step it belonged to (only that one:
/// the step before it committed), and its rows run again with the same picks.
#[test]
fn a_failed_deferred_sampling_rolls_back_its_step_and_loses_nothing() {
    let specs = penalized(10);
    let clean = run_plain(one_at_a_time(), &specs);
    let faults = FakeFaults {
        sampling_fail_calls: vec![2, 3, 17, 50, 51, 52, 120],
        ..Default::default()
    };
    let r = run(sched_config(), fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_same_streams(&clean, &r);
    let f = r.sched.model().stats();
    assert_eq!(f.failed_samplings, 7, "{f:?}");
    let st = r.sched.stats();
    assert_eq!(st.failed_steps, 0);
    assert!(st.rollbacks >= 7, "{} rollbacks", st.rollbacks);
}

/// Requests arriving one after another over the run, so most arrive while a step
/// computes (the steps a server sees): no penalties; with `disturbed` some are
/// cancelled, dropped or expire mid-stream.
fn trickle(seed: u64, n: usize, disturbed: bool) -> Vec<Spec> {
    let mut g = rng(seed);
    // Disturbances drawn apart, so both workloads carry the same requests.
    let mut d = rng(seed + 1000);
    (0..n)
        .map(|i| {
            let t = ["t0", "t1", "t2"][i % 3];
            let mut req = varied_request(&mut g, t, 1.0, i);
            no_penalties(&mut req);
            req.max_tokens = 4 + below(&mut g, 60) as usize;
            let mut spec = Spec::at(i as u64 * 3 + below(&mut g, 3), req);
            if disturbed {
                disturb(&mut spec, &mut d, 8, 1, 20);
            }
            spec
        })
        .collect()
}

/// A request that arrives while a step computes joins the step queued behind it:
/// its admission is part of that step's transaction. The streams are the plain
/// loop's; with faults in either step (collect, forward, commit, the scheduler's own
/// points) an undone admission sends the request back to wait and it joins again,
/// nothing lost, duplicated or leaked — also when requests are cancelled, dropped or
/// expire while their admission's step is still open.
#[test]
fn requests_join_the_queued_step_and_a_rollback_undoes_their_admission() {
    let specs = trickle(11, 240, false);
    let (plain, piped) = plain_and_piped(&specs);
    let st = piped.sched.stats();
    assert!(
        st.pipelined_admissions * 2 > specs.len() as u64,
        "only {} of {} requests joined a queued step",
        st.pipelined_admissions,
        specs.len()
    );
    assert_eq!(st.admissions_undone, 0);

    let (cfg, faults) = random_faults(3, 5, 11, 1);
    let r = run(cfg, fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_same_streams(&plain, &r);
    let st = r.sched.stats();
    assert_eq!(st.failed_steps, 0);
    assert!(
        st.admissions_undone >= 5,
        "{} admissions undone",
        st.admissions_undone
    );

    let disturbed = trickle(11, 240, true);
    let (cfg, faults) = random_faults(7, 5, 11, 1);
    let r = run(cfg, fake_config(), faults, &disturbed, |_, _, _| {});
    assert_clean(&r);
    let st = r.sched.stats();
    assert!(st.admissions_undone >= 5, "{st:?}");
    let cut = cut_streams(&disturbed, &r, &plain);
    assert!(cut > 10, "only {cut} streams were cut");
}

/// Long prompts, each mid-way through its prefill for ~24 steps (64-token chunks),
/// while short requests arrive one after another; none arrives once the long prompt
/// is in. Most are its own tenant's, some another's.
fn beside_long_prompts(seed: u64) -> Vec<Spec> {
    let mut g = rng(seed);
    let mut specs = Vec::new();
    for k in 0..4u64 {
        let mut long = Request::new("t0", prompt(&mut g, 1500), 8);
        long.request_id = Some(format!("long-{k}"));
        specs.push(Spec::at(k * 80, long));
        for i in 0..10u64 {
            let t = if i % 5 == 4 { "t1" } else { "t0" };
            let mut req = varied_request(&mut g, t, 1.0, (k * 10 + i) as usize);
            no_penalties(&mut req);
            req.prompt.truncate(40);
            req.max_tokens = 4 + below(&mut g, 20) as usize;
            specs.push(Spec::at(k * 80 + 1 + i * 2, req));
        }
    }
    specs
}

/// A request of the tenant whose prompt is mid-way joins the step queued behind the
/// one in flight, after that prompt's chunk — where the plain plan admits it (a
/// tenant's own requests never go ahead of its running rows). Another tenant's
/// request ahead of the prompt in fair order waits for the plain plan, which admits
/// it before the chunk. Streams are the plain loop's, also with faults undoing
/// admissions.
#[test]
fn requests_join_a_queued_step_beside_a_prompt_mid_way() {
    let specs = beside_long_prompts(21);
    let short = specs.iter().filter(|s| s.req.prompt.len() <= 40).count() as u64;
    let (plain, piped) = plain_and_piped(&specs);
    let st = piped.sched.stats();
    eprintln!("{st:?}");
    assert!(
        st.pipelined_admissions * 2 > short,
        "only {} of {short} requests joined a queued step beside a prompt mid-way",
        st.pipelined_admissions,
    );

    let (cfg, faults) = random_faults(5, 5, 7, 1);
    let r = run(cfg, fake_config(), faults, &specs, |_, _, _| {});
    assert_clean(&r);
    assert_same_streams(&plain, &r);
    let st = r.sched.stats();
    assert_eq!(st.failed_steps, 0);
    assert!(st.admissions_undone >= 2, "{st:?}");
}
