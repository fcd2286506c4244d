//! Scheduler overhead per step, excluding the model's own time: a trivial fake forward
//! (one-hot logits), greedy sampling on a 256-token vocabulary, all rows decoding.
//! Detokenizer calls (the fake's are cheap) and event sends stay in the measurement;
//! draining the event streams (the client's side) does not.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use weft_scheduler::fake::{FakeConfig, FakeDetokenizer, FakeLogits, FakeModel};
use weft_scheduler::{
    Detokenizer, EventStream, Model, ModelError, ModelInfo, Request, RowId, RowInput, Scheduler,
    SchedulerConfig, StepOutput, StorageOp,
};

/// Times every model call so the benchmark can subtract it.
struct Timed {
    inner: FakeModel,
    spent: Rc<Cell<Duration>>,
}

impl Timed {
    fn time<T>(&mut self, f: impl FnOnce(&mut FakeModel) -> T) -> T {
        let t = Instant::now();
        let out = f(&mut self.inner);
        self.spent.set(self.spent.get() + t.elapsed());
        out
    }
}

impl Model for Timed {
    fn info(&self) -> ModelInfo {
        self.inner.info()
    }
    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<StepOutput, ModelError> {
        self.time(|m| m.forward(ops, batch))
    }
    fn commit(&mut self) -> Result<(), ModelError> {
        self.time(|m| m.commit())
    }
    fn rollback(&mut self) {
        self.time(|m| m.rollback())
    }
    fn release_row(&mut self, row: RowId) {
        self.time(|m| m.release_row(row))
    }
}

/// Steps measured on one scheduler before it is rebuilt (outside the measurement), so
/// rows never finish and contexts (pool blocks, the fake's shadow storage) stay bounded.
const STEPS_PER_SETUP: u64 = 4000;
const MAX_CONTEXT: usize = 8192;

fn setup(
    rows: usize,
    detok: Arc<dyn Detokenizer>,
) -> (
    Scheduler<Timed>,
    Vec<EventStream>,
    Rc<Cell<Duration>>,
    Instant,
) {
    let spent = Rc::new(Cell::new(Duration::ZERO));
    let fake = FakeConfig {
        vocab_size: 256,
        max_context: MAX_CONTEXT,
        eos_token_ids: vec![0],
        layers: 1,
        logits: FakeLogits::Trivial,
        // Room for every row's whole context; the walk over it is test-only.
        kv_block_size: 16,
        kv_blocks: 1 << 17,
        sliding_window: None,
        sliding_blocks: None,
        verify_kv: false,
        step_cost: None,
        // `Timed` forwards one step at a time.
        defer_sampling: false,
        adapter_slots: 0,
        state_slots: 0,
        unmeasured_pipelined: false,
        new_shape_cost: 0.0,
        reports_traces: false,
        short_prompts: None,
    };
    let cfg = SchedulerConfig {
        max_batch_rows: rows,
        max_step_tokens: rows.max(512),
        prefill_chunk: 512,
        ..SchedulerConfig::default()
    };
    let model = Timed {
        inner: FakeModel::new(fake),
        spent: spent.clone(),
    };
    let mut s = Scheduler::new(cfg, model, detok).expect("config");
    let mut now = Instant::now();
    let streams: Vec<EventStream> = (0..rows)
        .map(|i| {
            let prompt: Vec<u32> = (0..32)
                .map(|j| 1 + ((i * 31 + j * 7) % 250) as u32)
                .collect();
            let mut r = Request::new(format!("tenant-{}", i % 8), prompt, MAX_CONTEXT - 64);
            // Every row holds its own context (no prefix shared across rows).
            r.max_tokens = r.max_tokens.min(STEPS_PER_SETUP as usize + 200);
            r.ignore_eos = true;
            s.submit(r, now).expect("admitted")
        })
        .collect();
    // Reach steady state: every row admitted and decoding.
    for _ in 0..100 {
        let rep = s.step(now);
        now += Duration::from_millis(10);
        if rep.sampled == rows && rep.tokens == rows {
            break;
        }
    }
    assert_eq!(s.stats().running, rows);
    (s, streams, spent, now)
}

fn bench_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step_overhead");
    for rows in [1usize, 64, 256] {
        g.bench_with_input(BenchmarkId::from_parameter(rows), &rows, |b, &rows| {
            let (mut s, mut streams, mut spent, mut now) = setup(rows, Arc::new(FakeDetokenizer));
            let mut stepped = 0u64;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if stepped == STEPS_PER_SETUP {
                        (s, streams, spent, now) = setup(rows, Arc::new(FakeDetokenizer));
                        stepped = 0;
                    }
                    stepped += 1;
                    spent.set(Duration::ZERO);
                    let t = Instant::now();
                    let rep = s.step(now);
                    total += t.elapsed().saturating_sub(spent.get());
                    debug_assert_eq!(rep.sampled, rows);
                    now += Duration::from_millis(10);
                    // The client side: drain the events (not part of the engine's cost).
                    for st in streams.iter_mut() {
                        while st.try_recv().is_some() {}
                    }
                }
                total
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_step);
criterion_main!(benches);
