//! Weft's paged KV cache: the accounting and, behind feature `mlx` (on by
//! default), the MLX storage.
//!
//! The accounting decides *which* storage rows hold what and never touches
//! the storage itself. The MLX half ([`storage`]) owns per-layer tensors shaped
//! `[num_blocks, kv_heads, block_size, head_dim]` (and state-slot tensors for
//! SSM layers), indexes them with the [`BlockId`]s and [`SlotId`]s handed out
//! here, and performs the [`StorageOp`]s the accounting queues. Keeping the
//! bookkeeping pure Rust makes it testable without an accelerator (build with
//! `--no-default-features`): the property tests drive thousands of random
//! schedules against a shadow storage.
//!
//! Pieces:
//!
//! * [`BlockPool`] — one block id space: refcounts, free list, LRU list of
//!   cached blocks, prefix-cache index.
//! * [`KvPool`] — sequences with one block table per layer group
//!   ([`KvGroups`]: full attention and sliding window side by side),
//!   copy-on-write forks, prefix reuse keyed by a tenant [`Salt`], SSM state
//!   slots ([`SlotPool`], [`SlotBatch`]) and step transactions with exact
//!   rollback ([`KvPool::snapshot`]).
//! * [`storage`] — pool tensors, batched per-row writes and padded reads with
//!   masks, quantized K/V, SSM state rows with staged replacement.

#![warn(missing_docs)]

mod block_pool;
mod error;
mod hash;
mod layout;
mod pool;
mod slots;
#[cfg(feature = "mlx")]
pub mod storage;

pub use block_pool::{BlockId, BlockPool, BlockPoolSnapshot, BlockStats, CachedBlock};
pub use error::KvError;
pub use hash::{BlockHash, Salt};
pub use layout::{AttentionKind, GroupSpec, KvGroups, KvLayout, MAX_BLOCKS, MAX_BLOCK_SIZE};
pub use pool::{
    Appended, BlockTable, GroupHit, GroupId, KvPool, OwnerId, OwnerUsage, PoolSnapshot, PoolStats,
    PrefixHit, PrefixStats, RowBlocks, SeqId, SeqInfo, SeqSpec, SequenceSnapshot, StorageOp,
};
pub use slots::{SlotBatch, SlotId, SlotPool, SlotPoolSnapshot, SlotStats};
