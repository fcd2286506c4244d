//! Typed errors.
//!
//! Every failure the scheduler can react to (capacity, stale handles, misuse of
//! the step protocol) is a variant here rather than a panic: the engine serves
//! many tenants from one process, so one bad request must never take the pool
//! down, and a capacity shortfall must be visible to the scheduler so it can
//! preempt instead of silently truncating a sequence.

use crate::{BlockId, GroupId, SeqId, SlotId};

/// Errors returned by the accounting layer.
///
/// Every operation that returns an error leaves the pool exactly as it was
/// before the call (operations are atomic), so the caller can retry, preempt or
/// roll back the surrounding step without reasoning about partial effects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free or evictable blocks in one group for the request.
    ///
    /// `available` counts truly free blocks, evictable prefix-cache blocks and
    /// blocks the operation itself would have released (sliding-window blocks),
    /// so `needed - available` is exactly the shortfall the scheduler must
    /// reclaim by preempting.
    #[error("KV pool exhausted in group {group}: needed {needed} blocks, {available} available")]
    PoolExhausted {
        /// Group (layer kind) that ran out.
        group: GroupId,
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks that could have been provided.
        available: usize,
    },
    /// No free SSM state slot.
    #[error("state slots exhausted: needed {needed}, available {available}")]
    SlotsExhausted {
        /// Slots the operation needed.
        needed: usize,
        /// Free slots.
        available: usize,
    },
    /// The id does not name a live sequence (never created, or already released).
    #[error("unknown or released sequence {0:?}")]
    UnknownSequence(SeqId),
    /// A block was released more often than it was referenced.
    #[error("block {block} of group {group} is not referenced (double free)")]
    DoubleFree {
        /// Group of the block.
        group: GroupId,
        /// The block.
        block: BlockId,
    },
    /// A block id outside the pool, or a retain of a block nobody holds and the
    /// prefix cache does not know.
    #[error("block {block} of group {group} is not allocated")]
    NotAllocated {
        /// Group of the block.
        group: GroupId,
        /// The block.
        block: BlockId,
    },
    /// A slot id outside the pool or not currently acquired.
    #[error("state slot {0} is not acquired")]
    SlotNotAcquired(SlotId),
    /// A sequence without a state slot was put in a slot batch.
    #[error("sequence {0:?} has no state slot")]
    NoStateSlot(SeqId),
    /// A row index outside a slot batch, or a repeated row in a filter.
    #[error("row {row} is out of range or repeated in a batch of {len} rows")]
    BadRow {
        /// Offending row.
        row: usize,
        /// Rows in the batch.
        len: usize,
    },
    /// `append` (count only) on a sequence that takes part in prefix caching:
    /// the cache needs the token ids to address full blocks.
    #[error("sequence {0:?} is prefix-cached; use append_tokens")]
    TokensRequired(SeqId),
    /// Forking a sequence whose tokens appended in the open step are not yet
    /// written by the forward pass: the copy-on-write copy and the state-slot
    /// copy run before the forward pass and would copy stale contents.
    #[error("sequence {0:?} has tokens appended in the open step; fork it after commit")]
    ForkOfPendingSequence(SeqId),
    /// `begin` while a step is open.
    #[error("a step transaction is already open")]
    TransactionOpen,
    /// `commit`/`rollback` without an open step.
    #[error("no step transaction is open")]
    NoTransaction,
    /// Rejected configuration.
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
    /// A group index outside the configured groups.
    #[error("unknown group {0}")]
    UnknownGroup(GroupId),
    /// [`KvPool::truncate`](crate::KvPool::truncate) past what the open step
    /// appended, or outside a step: only tokens whose KV this step wrote (and
    /// that no prefix-cache entry covers) can be taken back.
    #[error("cannot truncate sequence {seq:?} of {len} tokens to {to}: only this step's appends (down to {floor}) can be dropped")]
    BadTruncate {
        /// The sequence.
        seq: SeqId,
        /// Its length.
        len: usize,
        /// Requested length.
        to: usize,
        /// Shortest length it may be cut to.
        floor: usize,
    },
    /// [`crate::KvPool::set_tokens`] outside what the newest open step appended.
    #[error("cannot overwrite {len} tokens of sequence {seq:?} at {pos}: only tokens the newest open step appended can be replaced")]
    BadTokens {
        /// The sequence.
        seq: SeqId,
        /// First position to overwrite.
        pos: usize,
        /// Tokens to overwrite.
        len: usize,
    },
}
