//! The engine thread through its async API.

mod common;

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use weft_scheduler::fake::{FakeDetokenizer, FakeModel};
use weft_scheduler::{
    Engine, EngineError, Event, EventStream, FinishReason, Finished, Model, ModelError, ModelInfo,
    Request, RowId, RowInput, StepOutput, StorageOp, SubmitError,
};

/// The fake model with `before` run ahead of every forward: a delay, a gate the
/// test holds, or nothing.
struct Hooked<F: FnMut()> {
    inner: FakeModel,
    before: F,
}

impl<F: FnMut()> Model for Hooked<F> {
    fn info(&self) -> ModelInfo {
        self.inner.info()
    }
    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<StepOutput, ModelError> {
        (self.before)();
        self.inner.forward(ops, batch)
    }
    fn commit(&mut self) -> Result<(), ModelError> {
        self.inner.commit()
    }
    fn rollback(&mut self) {
        self.inner.rollback()
    }
    fn release_row(&mut self, row: RowId) {
        self.inner.release_row(row)
    }
}

/// A fake whose every forward takes `d` on the clock (no simulated cost).
fn slow(inner: FakeModel, d: Duration) -> Hooked<impl FnMut()> {
    Hooked {
        inner,
        before: move || std::thread::sleep(d),
    }
}

fn start() -> Engine {
    Engine::start(
        sched_config(),
        || {
            // Not `Send` (holds an `Rc`), like an MLX-backed model: proves the
            // engine builds and keeps the model on its own thread.
            let not_send = Rc::new(());
            Ok::<_, String>(Hooked {
                inner: FakeModel::new(fake_config()),
                before: move || {
                    std::hint::black_box(&not_send);
                },
            })
        },
        Arc::new(FakeDetokenizer),
    )
    .expect("engine starts")
}

async fn collect(mut s: EventStream) -> (Vec<u32>, String, Finished) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(ev) = s.recv().await {
        match ev {
            Event::Token(d) => {
                ids.extend(d.ids);
                text.push_str(&d.text);
            }
            Event::Finished(f) => return (ids, text, f),
        }
    }
    panic!("stream ended without a final event");
}

/// Bounded wait for a condition the engine reaches within a few steps.
async fn eventually(mut f: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("condition not reached");
}

#[tokio::test]
async fn concurrent_requests_stream_to_completion() {
    let engine = start();
    let h = engine.handle();
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = Request::new(format!("t{}", i % 4), vec![1 + i % 60, 2, 3], 20);
            r.ignore_eos = true;
            let s = h.submit(r).expect("admitted");
            collect(s).await
        }));
    }
    let oracle = FakeModel::new(fake_config());
    for (i, t) in tasks.into_iter().enumerate() {
        let (ids, text, f) = t.await.unwrap();
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!(ids.len(), 20);
        assert_eq!(f.usage.generated_tokens, 20);
        assert!(f.usage.time_to_first_token.is_some());
        // Greedy: first token is the argmax after the prompt.
        let l = oracle.logits_for_history(&[1 + i as u32 % 60, 2, 3]);
        let best = (0..l.len()).fold(0, |b, j| if l[j] > l[b] { j } else { b });
        assert_eq!(ids[0], best as u32);
        assert!(!text.is_empty());
    }
    eventually(|| {
        let st = engine.stats();
        st.running == 0 && st.waiting == 0 && st.kv_blocks_used == 0
    })
    .await;
    engine.shutdown();
}

#[tokio::test]
async fn dropping_the_stream_or_cancelling_frees_the_row() {
    let engine = start();
    let mut r = Request::new("t", vec![5; 10], 3000);
    r.ignore_eos = true;
    let mut s = engine.submit(r.clone()).unwrap();
    assert!(matches!(s.recv().await, Some(Event::Token(_))));
    drop(s);
    // `running` is live but KV figures come from the snapshot published after a
    // step, so wait for both (a leak never satisfies it and times out).
    eventually(|| {
        let st = engine.stats();
        st.running == 0 && st.kv_blocks_used == 0
    })
    .await;

    r.request_id = Some("job-1".into());
    let mut s = engine.submit(r).unwrap();
    assert!(matches!(s.recv().await, Some(Event::Token(_))));
    assert!(engine.cancel("t", "job-1"));
    assert!(!engine.cancel("t", "no-such-job"));
    let (_, _, f) = collect(s).await;
    assert_eq!(f.reason, FinishReason::Cancelled);
}

#[tokio::test]
async fn deadline_ends_a_request() {
    let engine = start();
    let mut r = Request::new("t", vec![5; 10], 3000);
    r.ignore_eos = true;
    // Already expired: the engine must notice before it schedules the request.
    r.deadline = Some(std::time::Instant::now());
    let (ids, _, f) = collect(engine.submit(r).unwrap()).await;
    assert_eq!(f.reason, FinishReason::Deadline);
    assert!(ids.is_empty());
}

#[tokio::test]
async fn shutdown_finishes_live_requests_and_refuses_new_ones() {
    let engine = start();
    let h = engine.handle();
    let mut r = Request::new("t", vec![5; 10], 3000);
    r.ignore_eos = true;
    let s = h.submit(r.clone()).unwrap();
    engine.shutdown();
    let (_, _, f) = collect(s).await;
    assert_eq!(f.reason, FinishReason::Error);
    assert!(f.error.unwrap().contains("shut down"));
    assert_eq!(h.submit(r).err(), Some(SubmitError::ShuttingDown));
}

#[test]
fn factory_errors_are_reported() {
    let r = Engine::start(
        sched_config(),
        || Err::<FakeModel, _>("weights not found"),
        Arc::new(FakeDetokenizer),
    );
    match r {
        Err(EngineError::Factory(m)) => assert!(m.contains("weights not found")),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("expected an error"),
    }
    let mut bad = sched_config();
    bad.max_step_tokens = 1;
    assert!(matches!(
        Engine::start(
            bad,
            || Ok::<_, String>(FakeModel::new(fake_config())),
            Arc::new(FakeDetokenizer)
        ),
        Err(EngineError::Config(_))
    ));
}

#[test]
fn submit_errors_are_immediate() {
    let engine = Engine::start(
        sched_config(),
        || Ok::<_, String>(FakeModel::new(fake_config())),
        Arc::new(FakeDetokenizer),
    )
    .unwrap();
    assert!(matches!(
        engine.submit(Request::new("t", vec![1; 5000], 10)),
        Err(SubmitError::Invalid(_))
    ));
}

/// Requests of a burst that reach an idle engine a little apart are prefilled in
/// one step with burst coalescing on; without it, the first one steps alone.
#[tokio::test]
async fn burst_coalescing_batches_close_arrivals_into_one_step() {
    for (gap, want_steps) in [(Duration::from_millis(400), 1), (Duration::ZERO, 2)] {
        let cfg = weft_scheduler::SchedulerConfig {
            coalesce_gap: gap,
            coalesce_max: gap * 5,
            ..sched_config()
        };
        let engine = Engine::start(
            cfg,
            || Ok::<_, String>(FakeModel::new(fake_config())),
            Arc::new(FakeDetokenizer),
        )
        .expect("engine starts");
        let first = engine.submit(Request::new("a", vec![1, 2, 3], 1)).unwrap();
        if gap.is_zero() {
            // Without coalescing the first request is done before the second exists
            // (waiting for it keeps a loaded machine from batching them by accident).
            assert_eq!(collect(first).await.0.len(), 1);
            let second = engine.submit(Request::new("b", vec![4, 5, 6], 1)).unwrap();
            assert_eq!(collect(second).await.0.len(), 1);
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let second = engine.submit(Request::new("b", vec![4, 5, 6], 1)).unwrap();
            assert_eq!(collect(first).await.0.len(), 1);
            assert_eq!(collect(second).await.0.len(), 1);
        }
        // Stats are published after the step that sent the events.
        eventually(|| engine.stats().steps >= want_steps).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(engine.stats().steps, want_steps, "gap {gap:?}");
        engine.shutdown();
    }
}

/// A panic on the engine thread (outside any step transaction): every live request,
/// running or queued, gets a final error event naming the panic; the handle reports
/// the failure and `stopped` resolves; later submits are refused at once.
#[tokio::test]
async fn a_panic_on_the_engine_thread_fails_every_live_request() {
    let mut cfg = sched_config();
    cfg.max_batch_rows = 2;
    cfg.coalesce_gap = Duration::ZERO;
    cfg.faults = weft_scheduler::FaultPlan::default().panic_at_step(4);
    let e = Engine::start(
        cfg,
        || Ok::<_, String>(FakeModel::new(fake_config())),
        Arc::new(FakeDetokenizer),
    )
    .expect("engine starts");
    let h = e.handle();
    assert!(h.failure().is_none());
    // The failure hook runs before any live request gets its final event.
    let hooked = Arc::new(std::sync::Mutex::new(None::<String>));
    let seen = hooked.clone();
    h.on_failure(Box::new(move |why| {
        *seen.lock().unwrap() = Some(why.to_string());
    }));
    // Two rows run, the third waits: all three are live when step 4 panics.
    let streams: Vec<EventStream> = (0..3)
        .map(|i| {
            let mut r = Request::new("t", vec![1 + i, 2, 3], 1000);
            r.ignore_eos = true;
            h.submit(r).expect("admitted")
        })
        .collect();
    for s in streams {
        let (_, _, f) = tokio::time::timeout(Duration::from_secs(10), collect(s))
            .await
            .expect("the stream ends");
        assert_eq!(f.reason, FinishReason::Error);
        let hook_saw = hooked.lock().unwrap().clone().expect("the hook ran first");
        assert!(
            hook_saw.contains("injected engine-thread panic"),
            "{hook_saw}"
        );
        let msg = f.error.unwrap_or_default();
        assert!(
            msg.contains("engine thread panicked") && msg.contains("injected"),
            "{msg}"
        );
    }
    tokio::time::timeout(Duration::from_secs(10), h.stopped())
        .await
        .expect("stopped resolves");
    let why = h.failure().expect("the failure is published");
    assert!(why.contains("injected engine-thread panic"), "{why}");
    assert!(matches!(
        h.submit(Request::new("t", vec![1], 4)),
        Err(SubmitError::ShuttingDown)
    ));
    // Dropping the engine after its thread died neither hangs nor panics.
    drop(e);
}

/// `stopped` also resolves after a plain shutdown, with no failure.
#[tokio::test]
async fn stopped_resolves_after_shutdown_without_a_failure() {
    let e = start();
    let h = e.handle();
    tokio::task::spawn_blocking(move || e.shutdown())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), h.stopped())
        .await
        .expect("stopped resolves");
    assert!(h.failure().is_none());
}

/// A fake-model engine with `anticipation`, a flood tenant decoding without pause.
async fn flooded(anticipation: Duration) -> (Engine, EventStream) {
    let cfg = weft_scheduler::SchedulerConfig {
        anticipation,
        ..sched_config()
    };
    let fake = weft_scheduler::fake::FakeConfig {
        max_context: 65536,
        kv_blocks: 5000,
        eos_token_ids: vec![],
        verify_kv: false,
        ..fake_config()
    };
    // Steps of 0.2 ms: the flood outlasts the tests (an optimized build runs the
    // fake's 60000 steps in well under a second otherwise).
    let engine = Engine::start(
        cfg,
        move || {
            Ok::<_, String>(slow(
                FakeModel::new(fake.clone()),
                Duration::from_micros(200),
            ))
        },
        Arc::new(FakeDetokenizer),
    )
    .expect("engine starts");
    let flood = engine
        .submit(Request::new("flood", vec![1, 2, 3], 60000))
        .unwrap();
    eventually(|| engine.stats().steps >= 5).await;
    (engine, flood)
}

/// Anticipation: while another tenant's rows decode, a tenant whose last request
/// just ended gets a moment to send its next one before the engine steps again, so
/// a client that chains requests does not wait for the whole step that began right
/// after its last one ended. The light client sends its next request 60 ms after
/// the last one's final event, and another flood request arrives in between: with
/// a 400 ms anticipation (its credit, 10 waits, covers this one) the engine does not step until the light request is in
/// (the flood's submit does not end the wait); without it the flood keeps stepping.
#[tokio::test]
async fn the_engine_waits_briefly_for_a_finished_tenants_next_request() {
    for (anticipation, waits) in [(Duration::from_millis(400), true), (Duration::ZERO, false)] {
        let (engine, flood) = flooded(anticipation).await;
        let first = engine
            .submit(Request::new("light", vec![4, 5, 6], 2))
            .unwrap();
        assert_eq!(collect(first).await.0.len(), 2);
        let s0 = engine.stats().steps;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let more = engine
            .submit(Request::new("flood", vec![1, 2, 4], 60000))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
        let s1 = engine.stats().steps;
        let next = engine
            .submit(Request::new("light", vec![7, 8, 9], 2))
            .unwrap();
        assert_eq!(collect(next).await.0.len(), 2);
        let between = s1 - s0;
        let a = engine.stats().anticipation;
        if waits {
            assert!(between <= 1, "{between} steps while the engine anticipated");
            assert_eq!((a.arrived, a.missed), (1, 0), "{a:?}");
            assert!(a.waited >= Duration::from_millis(40), "{a:?}");
        } else {
            assert!(between > 5, "only {between} steps without anticipation");
            assert_eq!(a, weft_scheduler::AnticipationCounts::default());
        }
        drop((flood, more));
        engine.shutdown();
    }
}

/// A tenant that took longer to come back than the anticipation is not waited for
/// the next time: the wait that missed it costs the others once, not per request.
#[tokio::test]
async fn a_tenant_slower_than_the_anticipation_is_not_waited_for_again() {
    let (engine, flood) = flooded(Duration::from_millis(20)).await;
    let first = engine
        .submit(Request::new("light", vec![4, 5, 6], 2))
        .unwrap();
    assert_eq!(collect(first).await.0.len(), 2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = engine.stats().anticipation;
    assert_eq!(
        (a.arrived, a.missed),
        (0, 1),
        "the first wait ran out: {a:?}"
    );
    assert!(a.waited >= Duration::from_millis(15), "{a:?}");
    let second = engine
        .submit(Request::new("light", vec![7, 8, 9], 2))
        .unwrap();
    assert_eq!(collect(second).await.0.len(), 2);
    let s0 = engine.stats().steps;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s1 = engine.stats().steps;
    assert!(s1 - s0 > 5, "only {} steps: it waited again", s1 - s0);
    assert_eq!(engine.stats().anticipation, a, "no second wait");
    drop(flood);
    engine.shutdown();
}

/// A request's time to first token includes the step that produced the token:
/// its usage and the server's TTFT histogram are stamped when the step's tokens
/// came out, not when it began (which reported ~0 for a prompt prefilled in one
/// step on an idle engine, however long the step).
#[tokio::test]
async fn time_to_first_token_counts_the_step_that_made_it() {
    let engine = Engine::start(
        sched_config(),
        || {
            Ok::<_, String>(slow(
                FakeModel::new(fake_config()),
                Duration::from_millis(100),
            ))
        },
        Arc::new(FakeDetokenizer),
    )
    .expect("engine starts");
    let (ids, _, f) = collect(engine.submit(Request::new("t", vec![1, 2, 3], 2)).unwrap()).await;
    assert_eq!(ids.len(), 2);
    let ttft = f.usage.time_to_first_token.expect("a first token");
    assert!(ttft >= Duration::from_millis(100), "{ttft:?}");
    engine.shutdown();
}

/// A cancelled row's blocks go back to the pool as the cancel is handled, and the
/// engine's stats say so then, not after the next step: here the next step never
/// ends (its forward is held), and the stats show the blocks back while it waits.
/// (Stats published only after each step kept the cancelled row's blocks in them
/// for a whole step more: issue 17's cancel benchmark read 20 ms for a 10 ms step.)
#[tokio::test]
async fn a_cancel_shows_in_the_stats_before_the_next_step_ends() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let permits = Arc::new(AtomicUsize::new(usize::MAX / 2));
    let waiting = Arc::new(AtomicBool::new(false));
    let (p, w) = (permits.clone(), waiting.clone());
    let engine = Engine::start(
        sched_config(),
        move || {
            // Every forward waits for a permit from the test, and says when it
            // is waiting: the test holds the engine thread inside a step.
            Ok::<_, String>(Hooked {
                inner: FakeModel::new(fake_config()),
                before: move || {
                    loop {
                        let n = p.load(SeqCst);
                        if n > 0 && p.compare_exchange(n, n - 1, SeqCst, SeqCst).is_ok() {
                            break;
                        }
                        w.store(true, SeqCst);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    w.store(false, SeqCst);
                },
            })
        },
        Arc::new(FakeDetokenizer),
    )
    .expect("engine starts");
    // Dropped before the engine, also when an assertion fails: lets its thread
    // out of the held forward so the engine's drop can join it.
    struct Open(Arc<AtomicUsize>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.store(usize::MAX / 2, SeqCst);
        }
    }
    let _open = Open(permits.clone());
    let mut keep = Request::new("t", vec![3; 10], 3000);
    keep.ignore_eos = true;
    let mut victim = Request::new("t", (0..80).map(|i| 1 + i % 60).collect(), 3000);
    victim.ignore_eos = true;
    victim.request_id = Some("victim".into());
    let mut ks = engine.submit(keep).unwrap();
    let mut vs = engine.submit(victim).unwrap();
    assert!(matches!(ks.recv().await, Some(Event::Token(_))));
    assert!(matches!(vs.recv().await, Some(Event::Token(_))));
    // Hold the engine inside a forward.
    permits.store(0, SeqCst);
    eventually(|| waiting.load(SeqCst)).await;
    let before = engine.stats().kv_blocks_used;
    assert!(before >= 6, "both rows hold blocks: {before}");
    assert!(engine.cancel("t", "victim"));
    // Let forwards through one at a time until the cancel is handled (its final
    // event), then hold the next step's forward.
    let f = loop {
        permits.store(1, SeqCst);
        eventually(|| permits.load(SeqCst) == 0).await;
        match tokio::time::timeout(Duration::from_millis(200), async {
            loop {
                match vs.recv().await {
                    Some(Event::Finished(f)) => return f,
                    Some(_) => {}
                    None => panic!("stream ended without a final event"),
                }
            }
        })
        .await
        {
            Ok(f) => break f,
            Err(_) => continue,
        }
    };
    assert_eq!(f.reason, FinishReason::Cancelled);
    eventually(|| waiting.load(SeqCst)).await;
    // The engine is inside a forward that cannot end; the stats it published before
    // entering it must already be without the victim's blocks.
    let after = engine.stats().kv_blocks_used;
    assert!(
        after + 5 <= before,
        "the victim's blocks are still counted: {before} before the cancel, {after} after"
    );
    drop(_open);
    drop(ks);
    engine.shutdown();
}
