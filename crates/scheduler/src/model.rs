//! The contract between the scheduler and a model implementation.
//!
//! The scheduler never sees tensors: it hands the model token ids, positions, each
//! row's KV block tables and how to sample it ([`RowSampling`]), and gets the picked
//! token ids back ([`StepOutput`]) — the logits stay wherever the model computed them
//! (on a GPU, only ids and requested logprobs cross to the host). The scheduler owns the KV
//! *accounting* (a `weft_kv_pool::KvPool` built from [`ModelInfo::kv`]); the model owns
//! the *storage* those blocks index, writes each step's K/V where the tables say and reads
//! a row's context through them. The real MLX model (crate `weft-models`) implements
//! [`Model`]; tests and benchmarks use [`crate::fake::FakeModel`].

pub use weft_kv_pool::{KvGroups, RowBlocks, StorageOp};

use crate::request::{SamplingParams, TokenLogprob};

/// Identifies one row (one residency of a request in the batch). A preempted request
/// that resumes gets a fresh row id, so a model never sees an id come back.
pub type RowId = u64;

/// One row's share of a batched forward call.
#[derive(Debug, Clone, PartialEq)]
pub struct RowInput {
    pub row: RowId,
    /// A prefill chunk, or the token to decode followed by a draft.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; always equal to the row's committed length.
    pub start_pos: usize,
    /// Whether the logits of the last position are needed (the last prefill chunk, or a
    /// decode token).
    pub want_logits: bool,
    /// Trailing `tokens` that are a speculative draft (0: none; only with
    /// [`Model::supports_drafts`]). The row decodes `tokens[0]`, verifies the draft in the
    /// same forward and gets logits for all `1 + draft` positions; the scheduler takes
    /// rejected draft tokens back in its pool (their slots become dead data).
    pub draft: usize,
    /// The row's block table in each KV group of [`ModelInfo::kv`], in group order,
    /// already holding slots `start_pos .. start_pos + tokens.len()`: the forward writes
    /// this step's K/V there and reads the row's context `0 .. start_pos` through it.
    pub blocks: Vec<RowBlocks>,
    /// How to pick this row's tokens (meaningful only with `want_logits`).
    pub sampling: RowSampling,
    /// `tokens[0]` is a placeholder for the token this row picks at its last position
    /// in the step submitted just before this one, still outstanding
    /// ([`Model::submit`]): the model feeds that pick, which the host does not know yet.
    pub follows: bool,
    /// The LoRA adapter the row runs with ([`crate::Request::adapter`]; None: the base
    /// model).
    pub adapter: Option<u32>,
    /// The row's recurrent-state slot, for a model with state layers (SSM, linear
    /// attention; [`KvGroups::state_slots`] > 0): the forward reads the row's state as
    /// of `start_pos` from it (a zero state at `start_pos` 0, whatever the slot held)
    /// and leaves the state after its tokens there, staged until commit. None for
    /// other models.
    pub state_slot: Option<u32>,
}

impl RowInput {
    /// Positions the row gets a token for when it wants logits: `1 + draft`.
    pub fn positions(&self) -> usize {
        1 + self.draft
    }
}

/// How a row's next tokens are picked; every implementation of [`Model`] samples with
/// exactly these semantics (the host reference is
/// [`crate::sampling::HostSampler`]): penalties over `seen`, then greedy or a
/// temperature draw restricted by top-k, top-p and min-p, the draw for the row's
/// position `j` taken at [`crate::sampling::uniform`]`(seed, index + j)` — a function of
/// the request alone, never of its batch neighbours.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RowSampling {
    pub params: SamplingParams,
    pub seed: u64,
    /// Index (among the request's generated tokens) of the token the row's first
    /// position picks.
    pub index: u64,
    /// Return the picked token's logprob and the `n` most likely at every position.
    pub logprobs: Option<usize>,
    /// Distinct tokens the penalties apply to; empty unless `params` has penalties.
    /// Repetition applies to each, presence and frequency to those generated.
    pub seen: Vec<SeenToken>,
    /// The tokens an output constraint allows at each of the row's positions (`1 +
    /// draft` masks; empty: any token anywhere). The others are removed before the
    /// pick (after penalties, before greedy or the draw: their logits become -inf);
    /// logprobs stay those of the raw logits.
    pub allowed: Vec<TokenMask>,
}

/// A set of token ids as a bitmask: token `t` is in it when bit `t % 32` of word
/// `t / 32` is set (llguidance's and the device sampler's layout). Cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask(std::sync::Arc<[u32]>);

impl TokenMask {
    pub fn from_words(words: Vec<u32>) -> Self {
        Self(words.into())
    }

    /// The bitmask words (`ceil(vocab / 32)` of them for a mask built for `vocab`).
    pub fn words(&self) -> &[u32] {
        &self.0
    }

    /// The words, shared (a model hands them to its device sampler without a copy).
    pub fn shared(&self) -> std::sync::Arc<[u32]> {
        self.0.clone()
    }

    pub fn allows(&self, t: u32) -> bool {
        self.0
            .get(t as usize / 32)
            .is_some_and(|w| w >> (t % 32) & 1 == 1)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The smallest allowed token, if any.
    pub fn first(&self) -> Option<u32> {
        self.0
            .iter()
            .enumerate()
            .find(|(_, &w)| w != 0)
            .map(|(i, w)| i as u32 * 32 + w.trailing_zeros())
    }
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenMask({} allowed)", self.count())
    }
}

/// One token a request has seen, for penalties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenToken {
    pub id: u32,
    pub in_prompt: bool,
    /// Times it was generated so far.
    pub generated: u32,
}

/// What one forward picked: for each row with `want_logits`, in input order, the token
/// at each of its positions (`1 + draft`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    pub rows: Vec<RowId>,
    /// One per position, rows concatenated.
    pub tokens: Vec<u32>,
    /// Empty when no row asked for logprobs; otherwise one per position (None for
    /// rows that did not ask).
    pub logprobs: Vec<Option<TokenLogprob>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_token_ids: Vec<u32>,
    /// The KV storage the model holds: block size, one group per attention kind with its
    /// block count, SSM state slots. The scheduler's pool mirrors it exactly, so every
    /// block it accounts for exists.
    pub kv: KvGroups,
    /// Distinct LoRA adapters the running rows may use at once (the model's resident
    /// adapter slots; 0: the model serves none). The scheduler admits a request whose
    /// adapter is not running yet only while fewer than this many are; the model makes
    /// each step's adapters resident, evicting one no running row uses.
    pub adapter_slots: usize,
}

/// What a model says of an adapter it registered ([`Model::add_adapter`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterDesc {
    pub rank: u32,
    /// Multiplier of the low-rank product.
    pub scale: f32,
    /// The projections it adapts ("q_proj", ...).
    pub targets: Vec<String>,
    /// Its file layout ("mlx-lm", "peft").
    pub format: String,
    /// Host bytes it keeps while not resident.
    pub host_bytes: u64,
}

/// What a model's adapter residency has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterCounters {
    /// Adapters copied into a resident slot.
    pub loads: u64,
    /// Resident adapters whose slot another adapter took.
    pub evictions: u64,
}

/// An adapter's source in the model's own terms (for the MLX model, its files read
/// into host memory), handed through the engine to [`Model::add_adapter`].
pub type AdapterSource = Box<dyn std::any::Any + Send>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The scheduler broke the contract (wrong position, unknown row, ...). Retrying the
    /// same batch cannot help, but the scheduler still treats it like any failed step.
    #[error("model contract violated: {0}")]
    Contract(String),
    /// The device ran out of memory for this batch.
    #[error("model out of memory: {0}")]
    OutOfMemory(String),
    /// Anything else (kernel failure, injected fault, ...).
    #[error("model failure: {0}")]
    Failed(String),
}

/// A batched, staged model. Lives on the engine thread only; need not be `Send`.
pub trait Model {
    fn info(&self) -> ModelInfo;
    /// One batched forward: first `ops` (the step's copy-on-write block copies and state
    /// slot resets, in order), then each row appends `tokens` (a prefill chunk, or the
    /// token to decode and a draft) at positions `start_pos..`, its K/V written into the
    /// slots its `blocks` name. Then, for each row with `want_logits`, it samples its
    /// last position (all `1 + draft` positions for a row with a draft) as the row's
    /// [`RowSampling`] says and returns the picked tokens in input order.
    ///
    /// KV writes are not staged: they land in slots past each row's committed length or
    /// in blocks this step allocated, which a rollback returns to the pool as dead data.
    /// Anything else the model keeps per row (recurrent state) is staged: nothing of it
    /// is visible until `commit()`, and `rollback()` drops it.
    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<StepOutput, ModelError>;
    /// Keeps the oldest step whose output was returned (by `forward` or `collect`) and
    /// not yet committed or rolled back.
    fn commit(&mut self) -> Result<(), ModelError>;
    /// Whether `forward` takes rows with a draft (speculative decoding).
    fn supports_drafts(&self) -> bool {
        false
    }
    /// Where the model runs a step's short prompt chunks as more decoding rows
    /// (None: never): the cost model then prices such a step as decoding rows.
    fn short_prompts(&self) -> Option<crate::step_cost::ShortPrompts> {
        None
    }
    /// Drops the newest step not committed (submitted, collected or forwarded): a
    /// scheduler undoing two pipelined steps calls it twice.
    fn rollback(&mut self);
    /// Whether [`submit`](Self::submit) / [`collect`](Self::collect) pipeline steps.
    fn pipelines(&self) -> bool {
        false
    }
    /// Queues the step [`forward`](Self::forward) would run and returns without waiting
    /// for its tokens, so the host can plan the next step while the device computes
    /// this one. At most two steps are outstanding (submitted, not yet committed or
    /// rolled back); the second may have rows with [`RowInput::follows`], fed by the
    /// first's picks. A failed submit leaves nothing of its step (the outstanding one
    /// is untouched).
    fn submit(&mut self, _ops: &[StorageOp], _batch: &[RowInput]) -> Result<(), ModelError> {
        Err(ModelError::Contract(
            "this model does not pipeline steps".into(),
        ))
    }
    /// Whether a step may be queued in two halves: its forward first
    /// ([`submit_unsampled`](Self::submit_unsampled)), its sampling later
    /// ([`submit_sampling`](Self::submit_sampling)), so that a step's sampling
    /// parameters (penalty counts, a constraint's mask) can wait for the picks of the
    /// step before it while the device already computes the forward.
    fn defers_sampling(&self) -> bool {
        false
    }
    /// Queues the forward of a step like [`submit`](Self::submit) does, up to its
    /// logits, without sampling them: the step's [`RowInput::sampling`] is ignored and
    /// [`submit_sampling`](Self::submit_sampling) must follow before anything else is
    /// submitted or collected. A failed call leaves nothing of its step.
    fn submit_unsampled(
        &mut self,
        _ops: &[StorageOp],
        _batch: &[RowInput],
    ) -> Result<(), ModelError> {
        Err(ModelError::Contract(
            "this model does not defer sampling".into(),
        ))
    }
    /// Queues the sampling of the step [`submit_unsampled`](Self::submit_unsampled)
    /// queued: `batch` is that step's rows again, and only their `sampling` is read.
    /// A failed call leaves the step open and unsampled (roll it back).
    fn submit_sampling(&mut self, _batch: &[RowInput]) -> Result<(), ModelError> {
        Err(ModelError::Contract(
            "this model does not defer sampling".into(),
        ))
    }
    /// Waits for the oldest submitted step not collected yet and returns what it
    /// picked (as `forward` would have); it stays staged until `commit` or
    /// `rollback`.
    fn collect(&mut self) -> Result<StepOutput, ModelError> {
        Err(ModelError::Contract(
            "this model does not pipeline steps".into(),
        ))
    }
    /// Forget whatever per-row state the model keeps beyond the KV blocks (finished,
    /// cancelled, preempted), in committed and in outstanding steps alike (a pipelined
    /// scheduler releases a row that finished while the step after it is in flight;
    /// that step's output for the row is ignored). Not staged.
    fn release_row(&mut self, row: RowId);
    /// A step just failed with [`ModelError::OutOfMemory`] and was rolled back: free
    /// what the model can spare (MLX's buffer cache, scratch buffers) before the
    /// scheduler retries the step's rows in smaller batches.
    fn release_memory(&mut self) {}
    /// Seconds the last [`submit`](Self::submit) or
    /// [`submit_unsampled`](Self::submit_unsampled) waited on the device for part of
    /// its own step (a step of several forwards may evaluate all but the last inside
    /// the submit), not counting the wait for the step queued before it. A pipelined
    /// scheduler charges them to the submitted step instead of to the period of the
    /// step it queued behind. `None`, the default: the submit never waits so.
    fn last_submit_blocked_seconds(&self) -> Option<f64> {
        None
    }
    /// Whether the last `forward` or submit built a compiled form of its step for
    /// the first time (a trace, and its first run's kernel builds): its time is
    /// then not what its shape costs, and the scheduler's cost model does not learn
    /// from it (one such step of seconds taught it a per-token cost hundreds of
    /// times the real one). `false`, the default: nothing is compiled.
    fn last_build_traced(&self) -> bool {
        false
    }
    /// Seconds the last `forward` took by the model's own measure (a fake model's
    /// simulated cost); `None`, the default, has the scheduler time the call.
    fn last_step_seconds(&self) -> Option<f64> {
        None
    }
    /// Registers a LoRA adapter rows may name as `id` from then on (`source` in the
    /// model's own terms; a source of another kind is refused). Checked against the
    /// model now: an error says what does not fit. Called between steps, never for an
    /// `id` registered already.
    fn add_adapter(&mut self, _id: u32, _source: AdapterSource) -> Result<AdapterDesc, ModelError> {
        Err(ModelError::Contract("this model serves no adapters".into()))
    }
    /// Forgets adapter `id`; no row names it any more.
    fn remove_adapter(&mut self, _id: u32) -> Result<(), ModelError> {
        Ok(())
    }
    /// What the model's adapter residency has done.
    fn adapter_counters(&self) -> AdapterCounters {
        AdapterCounters::default()
    }
}

/// Token ids -> text. Must be pure: the same ids always give the same text, because the
/// incremental detokenizer decodes overlapping windows and diffs them.
pub trait Detokenizer: Send + Sync {
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
}
