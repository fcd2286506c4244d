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

mod admission;
pub mod config;
mod detok;
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
