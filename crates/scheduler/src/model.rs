//! The contract between the scheduler and a model implementation.
//!
//! The scheduler never sees tensors: it hands the model token ids, positions and each
//! row's KV block tables, and gets host logits back. The scheduler owns the KV
//! *accounting* (a `weft_kv_pool::KvPool` built from [`ModelInfo::kv`]); the model owns
//! the *storage* those blocks index, writes each step's K/V where the tables say and reads
//! a row's context through them. The real MLX model (crate `weft-models`) implements
//! [`Model`]; tests and benchmarks use [`crate::fake::FakeModel`].

pub use weft_kv_pool::{KvGroups, RowBlocks, StorageOp};

/// Identifies one row (one residency of a request in the batch). A preempted request
/// that resumes gets a fresh row id, so a model never sees an id come back.
pub type RowId = u64;

/// One row's share of a batched forward call.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// Host logits of one forward call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    /// Row-major `[positions, vocab]`: one position per row in `rows`, `1 + draft` for a
    /// row with a draft.
    pub data: Vec<f32>,
    /// The rows that asked for logits, in input order.
    pub rows: Vec<RowId>,
    pub vocab: usize,
}

impl Logits {
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let start = i.checked_mul(self.vocab)?;
        self.data.get(start..start.checked_add(self.vocab)?)
    }
}

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
    /// slots its `blocks` name. Returns, for each row with `want_logits`, the logits of
    /// its last position (all `1 + draft` positions for a row with a draft), in input
    /// order, as one flat `Vec<f32>` plus the row order.
    ///
    /// KV writes are not staged: they land in slots past each row's committed length or
    /// in blocks this step allocated, which a rollback returns to the pool as dead data.
    /// Anything else the model keeps per row (recurrent state) is staged: nothing of it
    /// is visible until `commit()`, and `rollback()` drops it.
    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<Logits, ModelError>;
    fn commit(&mut self) -> Result<(), ModelError>;
    /// Whether `forward` takes rows with a draft (speculative decoding).
    fn supports_drafts(&self) -> bool {
        false
    }
    fn rollback(&mut self);
    /// Forget whatever per-row state the model keeps beyond the KV blocks (finished,
    /// cancelled, preempted). Not staged.
    fn release_row(&mut self, row: RowId);
}

/// Token ids -> text. Must be pure: the same ids always give the same text, because the
/// incremental detokenizer decodes overlapping windows and diffs them.
pub trait Detokenizer: Send + Sync {
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
}
