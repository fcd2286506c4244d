//! Weft's scheduler: queueing, per-tenant fair share, admission, step planning with
//! chunked prefill, preemption by recompute, host sampling, and the step transaction,
//! run by one engine thread that owns the model.
//!
//! The crate knows no tensors. A model plugs in through [`Model`]; KV memory through
//! [`KvBudget`] (the built-in [`BlockBudget`] counts blocks; `weft-kv-pool` is meant to
//! back it in production). [`fake::FakeModel`] makes everything testable without MLX.
//!
//! - [`Engine`] / [`EngineHandle`]: the engine thread and the API for async front ends.
//! - [`Scheduler`]: the synchronous core, driven step by step with caller-supplied time
//!   (what simulations and benchmarks use).
//!
//! # One step
//! 1. Reap: requests whose stream was dropped, that were cancelled, or whose deadline
//!    passed leave, and their rows and blocks return.
//! 2. Plan: decoding rows first (each feeds its last sampled token); if their KV growth
//!    does not fit, the least-kept rows are preempted (lowest priority, then the tenant
//!    most ahead in fair share, then newest). Then prefill chunks of running rows in the
//!    same keep order, shrunk to the token budget and free memory. Then joiners, picked
//!    by virtual token counter (smallest first) and priority within a tenant.
//! 3. Transaction: reserve KV, forward, sample, stage text and finish decisions, model
//!    commit, then apply (infallible). Any failure before the model's commit rolls back
//!    the model and the KV budget and leaves the scheduler untouched, because nothing
//!    in it is written until the apply; the step is retried. After `max_step_retries`
//!    the batch is bisected until the failing request is alone, and only it fails.
//!
//! Preemption and admission are decided before the transaction and stay decided if it
//! fails: preempting calls `release_row`, which is not staged, so the transaction
//! boundary is drawn after them. A retry therefore plans the same batch.
//!
//! # Fair share
//! Virtual token counters (Sheng et al., OSDI'24): a tenant's counter grows by
//! `w_in * prompt_tokens / weight` when a request is first admitted and by
//! `w_out / weight` per generated token; recomputation after preemption is not charged.
//! A tenant that becomes backlogged is lifted to the smallest counter among backlogged
//! tenants (or to the counter of the tenant that left the queue last), so idle time is
//! not banked.
//!
//! # Where text is made
//! Requests without stop strings get bare token ids from the engine; their
//! [`EventStream`] detokenizes incrementally on the receiving side, so tokenizer work
//! (microseconds per token with real tokenizers) stays off the engine thread. Requests
//! with stop strings are detokenized by the engine, which must see the text to stop.
//! Both paths use the same incremental, UTF-8 safe algorithm and emit the same text.
//!
//! # Recompute and determinism
//! A preempted request keeps its generated tokens, text state and sampling position;
//! it resumes by prefilling prompt ++ generated under a fresh row id. Sampling draws
//! token `i` of a request from a ChaCha8 stream at a position derived from `i`, so
//! seeded output does not depend on the batch, on retries or on preemption.
//!
//! # KV budget and `weft-kv-pool`
//! The scheduler asks a [`KvBudget`] whether rows can grow, reserves growth inside the
//! step's transaction (`begin` / `commit` / `rollback`) and releases rows it drops.
//! `weft-kv-pool`'s `KvPool` has the same transaction shape; an adapter (row id ->
//! sequence id, `reserve` -> `append`, `release` -> `release`) belongs where the model
//! and the pool are built together, since the model needs the same pool's block tables.
//! [`Engine::start_with_budget`] builds both on the engine thread for that reason.
//! Prefix-cache hits are not used yet (a new row always starts at position 0), so
//! `Usage::cached_prompt_tokens` is 0.

mod admission;
mod chan;
pub mod config;
mod detok;
pub mod draft;
pub mod engine;
pub mod fake;
pub mod fault;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod request;
mod sampling;
pub mod scheduler;
mod util;

pub use config::{SchedulerConfig, TenantLimits, VtcWeights};
pub use engine::{Engine, EngineError, EngineHandle};
pub use fault::{FaultPlan, FaultPoint};
pub use kv::{BlockBudget, KvBudget, KvError};
pub use model::{Detokenizer, Logits, Model, ModelError, ModelInfo, RowId, RowInput};
pub use request::{
    Event, EventStream, FinishReason, Finished, Request, RequestKey, SamplingParams, StopMatch,
    SubmitError, TokenDelta, TokenLogprob, Usage,
};
pub use scheduler::{Scheduler, SchedulerError, Stats, StepReport, TenantStats};
