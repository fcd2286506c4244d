//! MLX storage behind the accounting (feature `mlx`).
//!
//! * [`KvStorage`] — one layer group's K/V pool tensors (dense in the model
//!   dtype, or MLX affine 4/8-bit), block copies, and the batched write and
//!   read of one step.
//! * [`StepLayout`] — the host-side plan of a step in a group: flat write
//!   indices, the padded read's block table and its boolean mask. Computed
//!   once per step and group, shared by the group's layers.
//! * [`StateStorage`] — SSM state rows, written through with an undo journal
//!   per open step.
//!
//! The usual step: plan in [`KvPool`](crate::KvPool), commit it, apply the
//! returned operations with [`apply_storage_ops`], build one [`StepLayout`]
//! per group, then in every attention layer
//! [`KvStorage::update_and_fetch`] and attend with [`StepLayout::mask`].
//!
//! # Layout
//!
//! Blocks are head-major, `[num_blocks, kv_heads, block_size, head_dim]`,
//! so a read is one gather with block and head indices together whose output
//! already is attention's `[B, kv_heads, L, head_dim]`. The token-major
//! alternative `[num_blocks, block_size, kv_heads, head_dim]` makes the write
//! a one-axis scatter but the read a gather plus a transposing copy, measured
//! 2-3x slower on CPU (`benches/storage.rs`, `read/paged_take_transpose`);
//! with the raw two-axis `mlx_scatter` the head-major write costs the same as
//! a flat one.
//!
//! The gathered layout is an interim for MLX's dense SDPA. A paged-attention
//! kernel would take [`StepLayout::block_table`], [`StepLayout::context_lens`]
//! and [`StepLayout::first_block`] and read the pool arrays in place; those are
//! already public, the pool layout is what such kernels expect, and
//! [`KvStorage::read`] is the only place that would change.
//!
//! KV writes need no staging: a step only writes slots at or past each row's
//! committed length, in blocks the row holds alone, so the writes of a step
//! that is later abandoned are dead data the retry overwrites. SSM state is
//! replaced wholesale, so [`StateStorage`] journals the rows each step
//! replaced until the step commits, and a rollback writes them back.

mod ffi;
mod kv;
mod state;
mod step;

pub use kv::{scatter_tokens, AffineQuant, KvStorage, KvStorageConfig, QuantPool, QuantizedKv};
pub use state::{StateSpec, StateStorage};
pub use step::{RowStep, StepLayout};

use crate::{BlockId, KvError, SlotId, StorageOp};

/// Errors of the storage half.
///
/// Operations validate their inputs (shapes, ids, layers) before building any
/// MLX graph, so an error leaves the storage as it was; `Mlx` reports a
/// failure inside MLX itself.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An error from the accounting layer (unknown sequence or group).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// An MLX operation failed.
    #[error("mlx: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    /// Rejected storage configuration.
    #[error("invalid storage configuration: {0}")]
    InvalidConfig(&'static str),
    /// A layer index outside the storage.
    #[error("layer {layer} out of range ({layers} layers)")]
    UnknownLayer {
        /// Requested layer.
        layer: usize,
        /// Layers in the storage.
        layers: usize,
    },
    /// A block id outside the storage (a table from another pool or group).
    #[error("block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// Offending block.
        block: BlockId,
        /// Blocks in the storage.
        num_blocks: u32,
    },
    /// A slot id outside the storage.
    #[error("state slot {slot} out of range ({num_slots} slots)")]
    SlotOutOfRange {
        /// Offending slot.
        slot: SlotId,
        /// Slots in the storage.
        num_slots: u32,
    },
    /// A row's block table does not hold KV slots the step needs (blocks not
    /// yet appended, or already dropped by a sliding window).
    #[error("block table does not hold KV slots {first}..{end}")]
    NotHeld {
        /// First slot needed.
        first: usize,
        /// One past the last slot needed.
        end: usize,
    },
    /// An input array of the wrong shape.
    #[error("{what}: expected shape {expected:?}, got {got:?}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Expected shape.
        expected: Vec<i32>,
        /// Actual shape.
        got: Vec<i32>,
    },
    /// A malformed step or batch.
    #[error("bad step: {0}")]
    BadRow(&'static str),
    /// A size that does not fit MLX's 32-bit shapes and indices.
    #[error("{0} does not fit in an i32")]
    TooLarge(usize),
    /// [`KvStorage::read_quantized`] on dense storage.
    #[error("storage is not quantized")]
    NotQuantized,
    /// A state write, commit or rollback with no step open.
    #[error("no state step is open")]
    NoOpenStep,
}

/// Applies a committed step's [`StorageOp`]s: each `CopyBlock` to the
/// storage of its group (`kv` holds one [`KvStorage`] per group, in any
/// order), slot operations to `state`. Operations on one storage keep their
/// order; storages are independent of each other.
///
/// Every group and slot is checked first, so a misrouted operation changes
/// nothing.
pub fn apply_storage_ops(
    ops: &[StorageOp],
    kv: &mut [KvStorage],
    state: Option<&mut StateStorage>,
) -> Result<(), StorageError> {
    for op in ops {
        match *op {
            StorageOp::CopyBlock { group, src, dst } => {
                let s = kv
                    .iter()
                    .find(|s| s.config().group == group)
                    .ok_or(KvError::UnknownGroup(group))?;
                let nb = s.config().num_blocks;
                if let Some(&block) = [src, dst].iter().find(|&&b| b >= nb) {
                    return Err(StorageError::BlockOutOfRange {
                        block,
                        num_blocks: nb,
                    });
                }
            }
            StorageOp::CopySlot { src: slot, .. } | StorageOp::ResetSlot(slot) => {
                if state.is_none() {
                    return Err(StorageError::SlotOutOfRange { slot, num_slots: 0 });
                }
            }
        }
    }
    if let Some(st) = state {
        st.apply(ops)?;
    }
    for s in kv {
        s.apply(ops)?;
    }
    Ok(())
}
