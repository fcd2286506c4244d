//! The contract between the scheduler and a model implementation.
//!
//! The scheduler never sees tensors: it hands the model token ids and positions and gets
//! host logits back. The real MLX model (crate `weft-models`) implements [`Model`]; tests
//! and benchmarks use [`crate::fake::FakeModel`].

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
    /// same forward, gets logits for all `1 + draft` positions, and [`Model::keep`] says
    /// how many of its tokens the commit keeps.
    pub draft: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_token_ids: Vec<u32>,
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
    /// One batched forward: each row appends `tokens` (a prefill chunk, or the single token
    /// to decode) at positions `start_pos..` (`start_pos` == that row's committed length).
    /// Returns, for each row with `want_logits`, the logits of its last position (in input
    /// order), as one flat `Vec<f32>` of `[n_wanted, vocab]` plus the row order. Staged:
    /// nothing becomes visible until `commit()`; `rollback()` drops the staged state. A new
    /// row id appears first with `start_pos` 0.
    fn forward(&mut self, batch: &[RowInput]) -> Result<Logits, ModelError>;
    fn commit(&mut self) -> Result<(), ModelError>;
    /// Whether `forward` takes rows with a draft (speculative decoding).
    fn supports_drafts(&self) -> bool {
        false
    }
    /// Staged, between `forward` and `commit`: of the tokens a row with a draft fed this
    /// step, keep only the first `tokens` (the decoded token plus the accepted draft).
    fn keep(&mut self, row: RowId, tokens: usize) -> Result<(), ModelError> {
        Err(ModelError::Contract(format!(
            "keep({row}, {tokens}): this model takes no drafts"
        )))
    }
    fn rollback(&mut self);
    /// Forget a row's state (finished, cancelled, preempted). Not staged.
    fn release_row(&mut self, row: RowId);

    /// Prefix reuse, pure lookup: how many leading `tokens` of a new row this
    /// tenant's cached state could cover (0 = none; always < `tokens.len()`).
    fn prefix_len(&self, _tenant: &str, _tokens: &[u32]) -> usize {
        0
    }

    /// Gives the new `row` (no state yet) the cached state of the longest prefix
    /// of `tokens` this tenant left behind and returns its length, at most what
    /// `prefix_len` said. Not staged: the row now exists at that length, and its
    /// first `forward` starts there. Tenants never see each other's entries.
    fn attach_prefix(&mut self, _row: RowId, _tenant: &str, _tokens: &[u32]) -> usize {
        0
    }

    /// Offered just before `release_row` of a row that finished normally:
    /// `tokens` are the tokens whose state the row holds, for later reuse.
    fn offer_prefix(&mut self, _row: RowId, _tenant: &str, _tokens: &[u32]) {}
}

/// Token ids -> text. Must be pure: the same ids always give the same text, because the
/// incremental detokenizer decodes overlapping windows and diffs them.
pub trait Detokenizer: Send + Sync {
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
}
