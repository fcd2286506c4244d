//! Engine configuration.

use std::collections::HashMap;
use std::time::Duration;

use crate::fault::FaultPlan;

/// The step that runs a starting tenant's prefill (a tenant holding no row, one
/// short request waiting) while tenants share the engine: it goes before the
/// others' prompts either way, so it never waits for their prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartingStep {
    /// In a step of its own, the decoding rows left out (they wait one short step):
    /// where decoding rows beside a prompt cost the prompt's step much (on the CPU a
    /// 33-row decode doubles a short request's first step).
    #[default]
    Alone,
    /// Beside the decoding rows, other tenants' prompts left out: where a prompt
    /// joins decoding rows in one forward for little more than the rows alone (a
    /// GPU's compiled decode step running a short prompt's tokens as more rows),
    /// the rows then lose no step to it.
    BesideRows,
}

/// Limits that apply to each tenant separately.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLimits {
    /// Rows of this tenant in the running batch at once.
    pub max_running: usize,
    /// Requests of this tenant waiting (submitted, not running) at once.
    pub max_waiting: usize,
    /// Token-rate budget: prompt + max_tokens charged at submit, unused generation
    /// refunded at finish. None: unlimited.
    pub tokens_per_minute: Option<u64>,
}

impl Default for TenantLimits {
    fn default() -> Self {
        Self {
            max_running: usize::MAX,
            max_waiting: 1024,
            tokens_per_minute: None,
        }
    }
}

/// Virtual token counter weights (Sheng et al., OSDI'24). A tenant's counter grows by
/// `(input * prompt_tokens + output * generated_tokens) / tenant_weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VtcWeights {
    pub input: f64,
    pub output: f64,
}

impl Default for VtcWeights {
    fn default() -> Self {
        Self {
            input: 1.0,
            output: 2.0,
        }
    }
}

/// Inter-token latency target of a step that decodes rows (issue 17): its prefill is
/// sized by the learned step cost ([`crate::step_cost`]) so the step is predicted
/// within it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ItlTarget {
    /// Token budgets only (`decode_prefill_tokens`, `max_step_tokens`).
    Off,
    /// This many seconds a step.
    Fixed(Duration),
    /// `factor` times the cost of a decode-only step (the median of the latest,
    /// or the predicted cost of the batch once the waiting requests are in it when
    /// that is more), and at least `min`: follows the device, the model and the
    /// batch (a bigger batch's streams already wait longer per token, so a prompt
    /// may take a proportional share). No bound until the cost model has seen
    /// enough steps.
    Auto { factor: f64, min: Duration },
}

impl ItlTarget {
    /// `weft serve`'s default: prefill may make a step that decodes at most 3x as
    /// long as decoding alone, and take at least 100 ms on the CPU (where a step's
    /// fixed cost is large) or 20 ms on a GPU.
    pub fn auto(gpu: bool) -> Self {
        ItlTarget::Auto {
            factor: 3.0,
            min: Duration::from_millis(if gpu { 20 } else { 100 }),
        }
    }
}

/// [`SchedulerConfig::prefill_granule`] on a GPU (`weft serve`, `weft
/// bench-engine`): chunks cut to fit the ITL target in multiples of a KV block. On
/// an H100's long-prompts trace, a chunk at a length not run before took over 1.4x
/// its prediction 12 times in 51, one at a length run before 4 times in 104.
pub const GPU_PREFILL_GRANULE: usize = 16;

/// [`SchedulerConfig::burst_step_factor`]'s default: a lone tenant's prompt-only
/// step runs up to 4 targets (on a CPU ~0.6 s, its fixed cost ~5% of it).
pub const BURST_STEP_FACTOR: f64 = 4.0;

/// The most of the engine's time that [`SchedulerConfig::anticipation`]'s waits may
/// take: each wait draws on a credit that grows at this many seconds a second (up
/// to [`ANTICIPATION_CREDIT_WAITS`] waits), so many tenants chaining requests at once
/// cannot hold the others' steps back by more than this share.
pub const ANTICIPATION_SHARE: f64 = 0.05;
/// The most anticipation credit that builds up while nobody is anticipated, in
/// whole waits ([`SchedulerConfig::anticipation`]s): a burst of chaining tenants
/// is waited for this many times before the share binds.
pub const ANTICIPATION_CREDIT_WAITS: u32 = 10;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Rows in one forward call.
    pub max_batch_rows: usize,
    /// Tokens (decode + prefill) in one forward call. Must be >= max_batch_rows so every
    /// decoding row advances each step.
    pub max_step_tokens: usize,
    /// Largest prefill piece of one row in one step.
    pub prefill_chunk: usize,
    /// Prefill tokens in a step that also decodes rows (None: whatever
    /// `max_step_tokens` leaves). Decoding rows wait for every prefill in their
    /// step, so this bounds their inter-token latency while prompts arrive; a
    /// step with no decoding rows still prefills up to `max_step_tokens`.
    pub decode_prefill_tokens: Option<usize>,
    /// Inter-token latency target of a step that decodes rows: its prefill is sized by
    /// the learned step cost ([`crate::step_cost`]) so the step is predicted within
    /// it (on top of `decode_prefill_tokens`). Off by default here; `weft serve`
    /// defaults to [`ItlTarget::auto`].
    pub itl_target: ItlTarget,
    /// Latency isolation between tenants: while more than one tenant has had
    /// requests in the engine within this window, a step without decoding rows
    /// is held to `itl_target` too, so a tenant arriving during another's burst
    /// of prompts waits for one bounded step, not for a whole batch of prompts.
    /// With one tenant active, such steps are held to `burst_step_factor` times
    /// the target instead. Zero turns it off.
    pub isolation_window: Duration,
    /// A step without decoding rows and without another tenant active within
    /// `isolation_window` is held to this many times `itl_target`: long enough
    /// that a step's fixed cost is a small part of it (prompt throughput), short
    /// enough that a request arriving during a burst of prompts — another tenant
    /// idle until then, or the same tenant's next one — and a cancel wait for a
    /// bounded step, not for a whole batch of prompts. `f64::INFINITY`: such steps
    /// prefill as much as the token budget allows.
    pub burst_step_factor: f64,
    /// Anticipatory scheduling: when a tenant's last live request finishes while
    /// other work runs, the engine waits up to this long before its next step for
    /// that tenant's next request. A client that chains requests (a chat turn, an
    /// agent's tool loop, a pipeline) sends it within a few ms of the last one's
    /// end, just after the next step began, and would wait for all of that step
    /// before its own prefill could start; arriving during the wait, it gets it in
    /// the next step ([`crate::Scheduler`]'s starting-tenant step). Only for a
    /// tenant whose last return came within this long (or after a pause longer than
    /// `isolation_window`: a fresh start), the wait ends as soon as it
    /// arrives, and waits take at most [`ANTICIPATION_SHARE`] of the engine's time.
    /// Zero turns it off.
    pub anticipation: Duration,
    /// What the step of a starting tenant's prefill carries besides it (latency
    /// isolation between tenants, while tenants share the engine; see
    /// [`StartingStep`]).
    pub starting_step: StartingStep,
    /// A prompt chunk cut to fit `itl_target` is cut to a multiple of this many
    /// tokens when it is at least that long (the whole rest of a prompt is not cut).
    /// On a GPU every new chunk length is a new shape, whose first call runs slow
    /// (MLX's CUDA backend plans it): a chunk at each length the target happens to
    /// leave made a slow step of many (see [`GPU_PREFILL_GRANULE`]). 1: any length.
    pub prefill_granule: usize,
    /// The most a step that decodes rows may take, in `itl_target`s, for its
    /// prompt chunks to amortize the fixed cost of a step that prefills (see
    /// [`crate::step_cost::StepCost::prefill_within`]); at least 1.
    pub amortized_bound: f64,
    /// Steps that decode rows stay within `amortized_bound` targets by prediction
    /// even where the predicted fixed cost of prefilling alone is past it (see
    /// [`crate::step_cost::StepCost::with_strict_bound`]); off, the target then
    /// yields to that cost (a CPU's op-by-op mixed step).
    pub strict_bound: bool,
    /// Speculative decoding: the most draft tokens (from prompt lookup, see
    /// `draft.rs`) a decoding row verifies per step. Only greedy requests without
    /// penalties or stop strings speculate, so their tokens are exactly plain decoding's.
    /// 0 turns it off; only models that take drafts use it.
    pub speculate: usize,
    /// Most tokens a step's decoding rows feed, drafts included: drafts fill what the
    /// rows (1 token each) leave, so from this many rows on none are drafted. Verifying
    /// costs a forward over every draft token,
    /// which is cheap while a step is small and dominated by reading the weights, and
    /// not once the batch alone makes it compute-bound.
    pub speculate_step_tokens: usize,
    /// Requests waiting across all tenants.
    pub max_waiting: usize,
    /// Limits of tenants named here; their names are also the only `tenant` label values
    /// in metrics (everyone else is "other"), which keeps label cardinality bounded.
    pub tenants: HashMap<String, TenantLimits>,
    /// Limits of tenants not named in `tenants`.
    pub default_tenant: TenantLimits,
    pub vtc: VtcWeights,
    /// Blocks kept available (free or evictable) when admitting new rows, so running
    /// rows can keep decoding without preempting right away. The KV block size and
    /// count are the model's (`ModelInfo::kv`), not configured here.
    pub kv_watermark_blocks: usize,
    /// Reuse KV of earlier requests of the same tenant (block-aligned prompt prefixes,
    /// and a preempted request's own blocks when it resumes). Off: every row computes
    /// its whole context, and nothing is kept in the pool after a row leaves.
    pub prefix_cache: bool,
    /// Fixes the pool's prefix hash key (reproducible hashes in tests). None (the
    /// default) keeps the model's `KvGroups::hash_key`, normally None: a random key per
    /// pool, so no tenant can predict or craft block hashes.
    pub kv_hash_key: Option<u64>,
    /// Attempts of a failed step before its rows are isolated (bisected).
    pub max_step_retries: u32,
    /// Largest accepted `Request::logprobs`.
    pub max_logprobs: usize,
    /// Seeds requests that carry no seed (mixed with the request key).
    pub seed: u64,
    /// Burst coalescing: an engine with nothing running waits, after a request
    /// arrives, until no other request has arrived for this long (capped at
    /// `coalesce_max`) before its first step, so requests sent together prefill
    /// in one batched step instead of the first one alone and the rest a whole
    /// prefill later. Zero turns it off. Never delays a step with running rows.
    pub coalesce_gap: Duration,
    /// Longest burst-coalescing wait.
    pub coalesce_max: Duration,
    /// Test-only fault injection; empty in production.
    pub faults: FaultPlan,
    /// Pipeline steady decoding with models that can ([`crate::Model::pipelines`]):
    /// while the device computes a step, the next one is planned and queued with
    /// the first's picks as its inputs. Steps that admit, preempt, prefill part of a
    /// prompt or could carry drafts (`speculate`, while the batch is below
    /// `speculate_step_tokens` rows) run one at a time either way; so do steps with
    /// penalized or constrained rows unless the model defers sampling
    /// ([`crate::Model::defers_sampling`]).
    pub pipeline: bool,
    /// Test-only: after every rolled-back attempt, compare a fingerprint of the whole
    /// scheduler state with the pre-step one and count mismatches in `Stats`.
    pub verify_rollback: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_rows: 256,
            max_step_tokens: 2048,
            prefill_chunk: 512,
            decode_prefill_tokens: None,
            itl_target: ItlTarget::Off,
            isolation_window: Duration::from_secs(5),
            burst_step_factor: BURST_STEP_FACTOR,
            anticipation: Duration::ZERO,
            starting_step: StartingStep::Alone,
            prefill_granule: 1,
            amortized_bound: crate::step_cost::AMORTIZED_BOUND,
            strict_bound: false,
            speculate: 0,
            speculate_step_tokens: 8,
            max_waiting: 4096,
            tenants: HashMap::new(),
            default_tenant: TenantLimits::default(),
            vtc: VtcWeights::default(),
            kv_watermark_blocks: 0,
            prefix_cache: true,
            kv_hash_key: None,
            max_step_retries: 3,
            max_logprobs: 20,
            seed: 0x5eed,
            coalesce_gap: Duration::ZERO,
            coalesce_max: Duration::ZERO,
            faults: FaultPlan::default(),
            pipeline: true,
            verify_rollback: false,
        }
    }
}

impl SchedulerConfig {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_batch_rows == 0 {
            return Err("max_batch_rows must be > 0".into());
        }
        if self.max_step_tokens < self.max_batch_rows {
            return Err("max_step_tokens must be >= max_batch_rows".into());
        }
        if self.prefill_chunk == 0 {
            return Err("prefill_chunk must be > 0".into());
        }
        match self.itl_target {
            ItlTarget::Fixed(t) if t.is_zero() => return Err("itl_target must be > 0".into()),
            ItlTarget::Auto { factor, .. } if !(factor.is_finite() && factor >= 1.0) => {
                return Err("itl_target's auto factor must be >= 1".into())
            }
            _ => {}
        }
        if !(self.amortized_bound.is_finite() && self.amortized_bound >= 1.0) {
            return Err(
                "amortized_bound must be >= 1 (a bound below the target never amortizes)".into(),
            );
        }
        if self.decode_prefill_tokens == Some(0) {
            return Err(
                "decode_prefill_tokens must be > 0 (0 would stall prompts behind decoding rows)"
                    .into(),
            );
        }
        if !(self.vtc.input >= 0.0 && self.vtc.output >= 0.0) {
            return Err("vtc weights must be >= 0".into());
        }
        Ok(())
    }

    pub(crate) fn limits(&self, tenant: &str) -> &TenantLimits {
        self.tenants.get(tenant).unwrap_or(&self.default_tenant)
    }
}
