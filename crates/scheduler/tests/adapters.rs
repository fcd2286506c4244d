//! LoRA adapter slots in the scheduler, against the fake model (which checks every
//! forward's adapters against its slots and simulates their residency): the running
//! rows never name more adapters than the model holds at once, a request waiting for
//! a slot is not starved by the running adapters' later requests, and an adapter
//! removed while requests use it lets them finish and is forgotten after.

mod common;

use std::sync::Arc;

use common::*;
use weft_scheduler::fake::{FakeConfig, FakeDetokenizer, FakeFaults, FakeModel};
use weft_scheduler::{FinishReason, Request, Scheduler};

fn fake(slots: usize) -> FakeConfig {
    FakeConfig {
        adapter_slots: slots,
        ..fake_config()
    }
}

/// Registers adapters `1..=n` with the fake.
fn register(n: u32) -> impl FnOnce(&mut Scheduler<FakeModel>) {
    move |s| {
        for id in 1..=n {
            s.add_adapter(id, Box::new(())).expect("register");
        }
    }
}

/// Two tenants' varied requests over five adapters and none.
fn mixed(seed: u64, count: usize) -> Vec<Spec> {
    let mut g = rng(seed);
    (0..count)
        .map(|i| {
            let t = ["a", "b"][i % 2];
            let mut req = varied_request(&mut g, t, 1.0, i);
            req.adapter = [None, Some(1), Some(2), Some(3), Some(4), Some(5)][i % 6];
            Spec::at(below(&mut g, 200), req)
        })
        .collect()
}

/// With two slots for five adapters, every step's rows name at most two of them;
/// adapters are loaded and evicted as the mix moves on, and every request's tokens
/// are the ones it gets when all five fit at once.
#[test]
fn rows_never_hold_more_adapters_than_the_slots() {
    let specs = mixed(31, 180);
    let mut most = 0;
    let tight = run_full(
        sched_config(),
        fake(2),
        FakeFaults::default(),
        &specs,
        Arc::new(FakeDetokenizer),
        register(5),
        |_, s: &mut Scheduler<FakeModel>, _| {
            let running = s.stats().adapters.iter().filter(|a| a.running > 0).count();
            most = most.max(running);
        },
    );
    assert_clean(&tight);
    assert!(most <= 2, "{most} adapters running at once with 2 slots");
    let st = tight.sched.stats();
    assert!(tight.sched.model().stats().max_step_adapters <= 2);
    assert!(
        st.adapter_evictions > 0 && st.adapter_loads > st.adapter_evictions,
        "loads {} evictions {}",
        st.adapter_loads,
        st.adapter_evictions
    );
    let roomy = run_full(
        sched_config(),
        fake(8),
        FakeFaults::default(),
        &specs,
        Arc::new(FakeDetokenizer),
        register(5),
        |_, _: &mut Scheduler<FakeModel>, _| {},
    );
    assert_clean(&roomy);
    assert!(roomy.sched.model().stats().max_step_adapters > 2);
    assert_eq!(roomy.sched.stats().adapter_evictions, 0);
    for (i, (a, b)) in tight.outcomes.iter().zip(&roomy.outcomes).enumerate() {
        let fa = a.finished.as_ref().expect("finished");
        let fb = b.finished.as_ref().expect("finished");
        assert_ne!(
            fa.reason,
            FinishReason::Error,
            "request {i}: {:?}",
            fa.error
        );
        assert_eq!(
            (a.tokens.as_slice(), fa.reason),
            (b.tokens.as_slice(), fb.reason),
            "request {i} ({:?})",
            specs[i].req.adapter
        );
    }
}

/// One slot; tenant a keeps a stream of adapter-1 requests coming for 300 steps, and
/// tenant b sends one adapter-2 request early. b's request must not wait for a's
/// stream to end: once it waits for the slot, no new adapter-1 request joins, the
/// running ones drain, and b's gets the slot.
#[test]
fn a_request_waiting_for_a_slot_is_not_starved() {
    let mut g = rng(5);
    let mut specs: Vec<Spec> = (0..300)
        .map(|i| {
            let mut r = Request::new("a", prompt(&mut g, 8), 16);
            r.ignore_eos = true;
            r.adapter = Some(1);
            Spec::at(i, r)
        })
        .collect();
    let mut b = Request::new("b", prompt(&mut g, 8), 4);
    b.ignore_eos = true;
    b.adapter = Some(2);
    specs.push(Spec::at(20, b));
    let r = run_full(
        sched_config(),
        fake(1),
        FakeFaults::default(),
        &specs,
        Arc::new(FakeDetokenizer),
        register(2),
        |_, _: &mut Scheduler<FakeModel>, _| {},
    );
    assert_clean(&r);
    let waited = r.outcomes[300].finish_step.expect("b finished");
    assert!(
        waited < 60,
        "the adapter-2 request took {waited} steps behind a stream of adapter-1 requests"
    );
    assert_eq!(r.sched.model().stats().max_step_adapters, 1);
}

/// Adapter 1 is removed while four of its requests run: they finish normally, a
/// request naming it that arrives afterwards fails with a message, the model forgets
/// it once the four are done, and its id is not taken again.
#[test]
fn a_removed_adapter_lets_its_requests_finish_then_goes() {
    let mut g = rng(9);
    let mut specs: Vec<Spec> = (0..4)
        .map(|_| {
            let mut r = Request::new("a", prompt(&mut g, 12), 24);
            r.ignore_eos = true;
            r.adapter = Some(1);
            Spec::at(0, r)
        })
        .collect();
    let mut late = Request::new("a", prompt(&mut g, 12), 4);
    late.adapter = Some(1);
    specs.push(Spec::at(10, late));
    let mut other = Request::new("a", prompt(&mut g, 12), 4);
    other.adapter = Some(2);
    specs.push(Spec::at(10, other));
    let mut live_at_removal = None;
    let r = run_full(
        sched_config(),
        fake(2),
        FakeFaults::default(),
        &specs,
        Arc::new(FakeDetokenizer),
        register(2),
        |step, s: &mut Scheduler<FakeModel>, _| {
            if step == 5 {
                live_at_removal = Some(s.remove_adapter(1));
                assert_eq!(s.model().registered_adapters(), vec![1, 2], "still running");
            }
        },
    );
    assert_clean(&r);
    assert_eq!(live_at_removal, Some(4));
    for o in &r.outcomes[..4] {
        let f = o.finished.as_ref().expect("finished");
        assert_eq!(f.reason, FinishReason::Length, "{:?}", f.error);
        assert_eq!(o.tokens.len(), 24);
    }
    let f = r.outcomes[4].finished.as_ref().expect("finished");
    assert_eq!(f.reason, FinishReason::Error);
    assert!(
        f.error.as_deref().unwrap_or("").contains("unloaded"),
        "{:?}",
        f.error
    );
    assert_eq!(
        r.outcomes[5].finished.as_ref().map(|f| f.reason),
        Some(FinishReason::Length)
    );
    assert_eq!(r.sched.model().registered_adapters(), vec![2]);
    let mut s = r.sched;
    assert!(
        s.add_adapter(1, Box::new(())).is_err(),
        "ids are not reused"
    );
}
