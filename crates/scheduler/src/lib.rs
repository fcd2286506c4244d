//! Weft's scheduler: queueing, per-tenant fair share, admission, step planning with
//! chunked prefill, preemption by recompute, the sampling contract (and its host
//! implementation), and the step transaction,
//! run by one engine thread that owns the model.
//!
//! The crate knows no tensors. A model plugs in through [`Model`] and tells the scheduler
//! what KV storage it holds ([`ModelInfo::kv`]); the scheduler owns the accounting of that
//! storage, a paged [`KvPool`] from `weft-kv-pool` (block tables, refcounts, tenant-salted
//! prefix cache, step transactions), and hands the model each row's block tables.
//! [`fake::FakeModel`] makes everything testable without MLX: it keeps a shadow KV
//! storage indexed by those tables, so a wrong table changes its outputs.
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
//! 3. Transaction: append to the KV pool, forward (the model samples each row as its
//!    `RowSampling` says and returns ids), stage text and finish
//!    decisions, model commit and pool commit, then apply (infallible). Any failure before the model's commit rolls back
//!    the model and the pool and leaves the scheduler untouched, because nothing in it
//!    is written until the apply; the step is retried. After `max_step_retries`
//!    the batch is bisected until the failing request is alone, and only it fails.
//!
//! Preemption and admission are decided before the transaction and stay decided if it
//! fails: preempting calls `release_row` and releases the pool sequence, and admitting
//! allocates one (with its prefix hit), none of which is staged, so the transaction
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
//! # KV memory: the paged pool
//! The scheduler builds one [`KvPool`] from [`ModelInfo::kv`] (today: one full-attention
//! group, optionally a sliding-window group of as many blocks beside it, no state
//! slots; anything else is [`SchedulerError::UnsupportedKv`]), so every block it
//! accounts for exists in the model's storage. Each running request holds a pool
//! sequence next to its model row, and each step hands down one table per group (the
//! sliding one starts past the blocks behind the window, which the pool released).
//! - Admission asks the pool for the longest cached, block-aligned prefix of prompt ++
//!   generated (all but the last token, so the forward computes at least one) in the
//!   tenant's own salt: a tenant never hits another's blocks. Memory checks count real
//!   blocks: the blocks a row adds (`ceil((start + n) / bs)` minus those it holds) plus
//!   cached blocks a hit takes off the evictable list, against free + evictable blocks,
//!   with `kv_watermark_blocks` kept back for running rows. `Usage::cached_prompt_tokens`
//!   is the hit at first admission.
//! - A step is one pool transaction: `begin`, `append_tokens` of exactly what each row
//!   feeds, the rows' tables into [`RowInput::blocks`], `forward(step_ops, rows)`,
//!   the picked ids checked, `truncate` of rejected draft tokens, model commit, pool commit (which
//!   files newly full blocks in the prefix cache). A failure rolls back with
//!   `rollback_after_writes`, since the forward may already have written storage.
//! - Preemption frees what a victim alone references (shared prefix blocks stay). A
//!   finished, cancelled or preempted row releases its sequence; its full blocks stay as
//!   evictable cached blocks (the prefix cache is whatever the pool holds; LRU eviction
//!   when free blocks run out), so a preempted request normally resumes from its own
//!   blocks.

mod admission;
mod anticipation;
mod chan;
pub mod config;
pub mod constraint;
mod detok;
pub mod draft;
pub mod engine;
pub mod fake;
pub mod fault;
pub mod metrics;
pub mod model;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod step_cost;
mod util;

pub use anticipation::AnticipationCounts;
pub use config::{
    ItlTarget, SchedulerConfig, StartingStep, TenantLimits, VtcWeights, ANTICIPATION_CREDIT_WAITS,
    ANTICIPATION_SHARE, BURST_STEP_FACTOR, GPU_PREFILL_GRANULE,
};
pub use constraint::{Constraint, ConstraintSpec, Grammars};
pub use engine::{AdapterCallError, Engine, EngineError, EngineHandle, FailureHook};
pub use fault::{FaultPlan, FaultPoint};
pub use model::{
    AdapterCounters, AdapterDesc, AdapterSource, Detokenizer, KvGroups, Model, ModelError,
    ModelInfo, RowBlocks, RowId, RowInput, RowSampling, SeenToken, StepOutput, StorageOp,
    TokenMask,
};
pub use request::{
    Event, EventStream, FinishReason, Finished, Request, RequestKey, SamplingParams, StopMatch,
    SubmitError, TokenDelta, TokenLogprob, Usage,
};
pub use scheduler::{
    min_sliding_blocks, AdapterStats, Scheduler, SchedulerError, Stats, StepReport, TenantStats,
};
/// The KV pool crate, for the pool types [`Scheduler::kv_pool`] exposes.
pub use weft_kv_pool as kv_pool;
pub use weft_kv_pool::{KvError, KvPool};
