//! Latency isolation between tenants (issue 17 item 2): fair share covers time to
//! first token, not only token counts. A tenant that sends short requests one at a
//! time gets its prefill into the next step while another tenant floods the engine —
//! holding most of the batch's rows, prefilling long prompts and queueing more.

mod common;

use common::*;
use weft_scheduler::fake::FakeFaults;
use weft_scheduler::{Request, SchedulerConfig};

fn config(max_batch_rows: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_rows,
        max_step_tokens: 256,
        prefill_chunk: 64,
        ..sched_config()
    }
}

/// `flood` requests of the flood tenant at step 0 (prompts of `prompt` tokens and up
/// to 2x that, `gen` tokens and up to 2x that generated), and `light` short requests
/// of the light tenant, one every `every` steps from step `from`.
fn workload(
    flood: usize,
    prompt_len: usize,
    gen: usize,
    light: usize,
    from: u64,
    every: u64,
) -> Vec<Spec> {
    let mut g = rng(42);
    let mut specs = Vec::new();
    for i in 0..flood {
        let len = prompt_len + below(&mut g, prompt_len as u64) as usize;
        let max_tokens = gen + below(&mut g, gen as u64) as usize;
        let mut r = Request::new("flood", prompt(&mut g, len), max_tokens);
        r.ignore_eos = true;
        r.request_id = Some(format!("f{i}"));
        specs.push(Spec::at(0, r));
    }
    for i in 0..light {
        let len = 8 + below(&mut g, 17) as usize;
        let mut r = Request::new("light", prompt(&mut g, len), 4);
        r.ignore_eos = true;
        r.request_id = Some(format!("l{i}"));
        specs.push(Spec::at(from + i as u64 * every, r));
    }
    specs
}

/// Runs `specs`, checking at each light arrival that the flood still queues
/// requests and holds at least `min_rows` rows (so the isolation is really tested).
/// Returns the run, the light requests' TTFT in steps and how many arrivals met a
/// batch without a free row.
fn run_mix(cfg: SchedulerConfig, specs: &[Spec], min_rows: usize) -> (Run, Vec<u64>, usize) {
    let arrivals: Vec<u64> = specs
        .iter()
        .filter(|s| s.req.tenant == "light")
        .map(|s| s.arrival_step)
        .collect();
    let rows = cfg.max_batch_rows;
    let (mut checked, mut full) = (0, 0);
    let r = run(
        cfg,
        fake_blocks(8000),
        FakeFaults::default(),
        specs,
        |step, sched, _| {
            // The state a light request meets when it arrives at `step + 1`.
            if arrivals.contains(&(step + 1)) {
                let st = sched.stats();
                let f = st.tenants.iter().find(|t| t.tenant == "flood").unwrap();
                assert!(
                    f.running >= min_rows && f.waiting > 0,
                    "at step {step} the flood holds {} rows and queues {}",
                    f.running,
                    f.waiting
                );
                checked += 1;
                full += usize::from(st.running == rows);
            }
        },
    );
    assert_eq!(checked, arrivals.len(), "every light arrival met the flood");
    assert_clean(&r);
    let ttft = specs
        .iter()
        .zip(&r.outcomes)
        .filter(|(s, _)| s.req.tenant == "light")
        .map(|(_, o)| o.first_token_step.expect("light request got a token"))
        .collect();
    (r, ttft, full)
}

/// The flood keeps the step's prefill budget busy with its own long prompts (several
/// chunks each) while it holds 32-64 rows: a light request still prefills in the
/// step after it arrives, where it would otherwise wait behind every prompt the flood
/// started before it. Total work is unchanged: the flood finishes in as many steps.
#[test]
fn a_light_tenant_prefills_next_step_while_another_floods_the_budget() {
    let cfg = config(64);
    let specs = workload(400, 300, 60, 20, 150, 11);
    let (mixed, ttft, _) = run_mix(cfg.clone(), &specs, 32);
    eprintln!("budget flood: light TTFT steps {ttft:?}");
    let worst = *ttft.iter().max().unwrap();
    assert!(worst <= 1, "light TTFT in steps under the flood: {ttft:?}");

    // The flood alone takes about as many steps: the light requests' few tokens
    // were moved ahead, not added on top of a step's budget.
    let alone: Vec<Spec> = specs
        .iter()
        .filter(|s| s.req.tenant == "flood")
        .cloned()
        .collect();
    let solo = run_blocks(config(64), 8000, &alone);
    assert_clean(&solo);
    assert!(
        mixed.steps as f64 <= solo.steps as f64 * 1.05,
        "{} steps with the light tenant vs {} for the flood alone",
        mixed.steps,
        solo.steps
    );
}

/// The flood holds every row of the batch with long generations (rows free up only
/// every few steps): the light tenant, below its fair share of rows, takes a row from
/// the flood's least-kept one, and its request still starts in the step after it
/// arrives. The preempted request resumes and streams exactly what it would have.
#[test]
fn a_light_tenant_gets_a_row_while_another_holds_the_whole_batch() {
    let cfg = config(32);
    let specs = workload(160, 20, 150, 12, 60, 37);
    let (mixed, ttft, full) = run_mix(cfg.clone(), &specs, 28);
    eprintln!("row flood: light TTFT steps {ttft:?}, {full} arrivals at a full batch");
    assert!(
        full * 2 >= ttft.len(),
        "{full} of {} arrivals met a full batch",
        ttft.len()
    );
    let worst = *ttft.iter().max().unwrap();
    assert!(worst <= 1, "light TTFT in steps under the flood: {ttft:?}");
    assert!(mixed.sched.stats().preemptions > 0);
    // Preempted or not, every flood stream is what it is without the light tenant.
    let alone: Vec<Spec> = specs
        .iter()
        .filter(|s| s.req.tenant == "flood")
        .cloned()
        .collect();
    let solo = run_blocks(cfg, 8000, &alone);
    assert_clean(&solo);
    for (i, s) in alone.iter().enumerate() {
        let j = specs
            .iter()
            .position(|x| x.req.request_id == s.req.request_id)
            .unwrap();
        assert_eq!(
            mixed.outcomes[j].tokens, solo.outcomes[i].tokens,
            "flood request {i}"
        );
    }
    // At most one row per light request changed hands (no preemption storm).
    assert!(
        mixed.sched.stats().preemptions <= ttft.len() as u64,
        "{} preemptions for {} light requests",
        mixed.sched.stats().preemptions,
        ttft.len()
    );
}

/// Two floods of equal weight: the second, arriving while the first holds every row,
/// takes one row at once and the rest as the first's rows finish. Rows are only
/// taken for a tenant holding none, never to even out the shares of tenants that
/// hold some (evening out would preempt ~15 rows here at once, half the batch).
#[test]
fn two_floods_do_not_preempt_each_other() {
    let mut g = rng(8);
    let mut specs = Vec::new();
    for t in ["a", "b"] {
        for i in 0..120 {
            let len = 20 + below(&mut g, 20) as usize;
            let mut r = Request::new(t, prompt(&mut g, len), 60);
            r.ignore_eos = true;
            r.request_id = Some(format!("{t}{i}"));
            specs.push(Spec::at(if t == "a" { 0 } else { 5 }, r));
        }
    }
    // Memory for everyone: any preemption is one for a row.
    let mut preempted_at = Vec::new();
    let mut seen = 0;
    let r = run(
        config(32),
        fake_blocks(8000),
        FakeFaults::default(),
        &specs,
        |step, sched, _| {
            let st = sched.stats();
            if st.preemptions > seen {
                // Whoever got the row held none before this step.
                preempted_at.push((step, st.preemptions - seen));
                seen = st.preemptions;
            }
        },
    );
    assert_clean(&r);
    assert!(
        preempted_at.iter().all(|&(_, n)| n == 1),
        "one row a step at most: {preempted_at:?}"
    );
    assert!(
        preempted_at.len() <= 6,
        "{} preemptions between two equal floods: {preempted_at:?}",
        preempted_at.len()
    );
    // b arrives at step 5, while a's step 4 is queued behind (pipelined): the next
    // step planned is 6.
    assert!(
        preempted_at.first().is_some_and(|p| p.0 <= 6),
        "b's first row at once: {preempted_at:?}"
    );
}
