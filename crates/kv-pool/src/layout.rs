//! Sizing and per-layer-kind configuration.

use crate::KvError;

/// Largest block size accepted; larger blocks waste too much memory in partially
/// filled tail blocks to be useful, and it keeps token offsets in a `u32`.
pub const MAX_BLOCK_SIZE: u32 = 1024;

/// Shape of one block of KV storage for one group of layers.
///
/// Only used to turn a byte budget into a block count: the accounting itself
/// never touches storage, but sizing from bytes is what operators configure
/// ("give the KV cache 40 GiB"), so the conversion lives next to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Layers whose storage this block id indexes (the block id addresses the
    /// same row in every one of these layers' tensors).
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (2 for f16/bf16, 1 for 8-bit quantised caches).
    pub dtype_bytes: u32,
    /// Tokens per block.
    pub block_size: u32,
}

impl KvLayout {
    /// Bytes of K plus V for one token across all layers of the group.
    ///
    /// The factor 2 is for separate K and V tensors; a latent-attention model
    /// that stores one joint tensor should halve `kv_heads` or `head_dim`.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// Bytes of one block across all layers of the group.
    pub fn bytes_per_block(&self) -> u64 {
        self.bytes_per_token() * u64::from(self.block_size)
    }

    /// How many whole blocks fit in `budget_bytes`.
    ///
    /// Rounds down (a partial block cannot be addressed) and caps at the largest
    /// count a `u32` block id can index.
    pub fn blocks_for_budget(&self, budget_bytes: u64) -> Result<u32, KvError> {
        check_block_size(self.block_size)?;
        let per = self.bytes_per_block();
        if per == 0 {
            return Err(KvError::InvalidConfig("layout has a zero dimension"));
        }
        Ok(u32::try_from(budget_bytes / per).unwrap_or(MAX_BLOCKS))
    }
}

/// Largest number of blocks in one group; `u32::MAX` is the list sentinel.
pub const MAX_BLOCKS: u32 = u32::MAX - 1;

pub(crate) fn check_block_size(block_size: u32) -> Result<(), KvError> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE || !block_size.is_power_of_two() {
        return Err(KvError::InvalidConfig(
            "block size must be a power of two in 1..=1024 (16, 32 or 64 in practice)",
        ));
    }
    Ok(())
}

/// How a group of layers attends, which decides how long its blocks must live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every token attends to the whole history: blocks live as long as the sequence.
    Full,
    /// A token at position `p` attends only to `[p - window, p)`, so blocks that
    /// fall entirely before that range can be returned to the pool early.
    SlidingWindow {
        /// Window length in tokens (must be at least 1).
        window: u32,
    },
}

impl AttentionKind {
    /// The kind's name in metrics and the API: "full" or "sliding_window".
    pub fn label(self) -> &'static str {
        match self {
            AttentionKind::Full => "full",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
        }
    }

    /// First logical block a sequence of `len` tokens still needs: blocks lying
    /// entirely before `len - window` are never attended again (0 for full
    /// attention). The pool drops the blocks before this one, taking the length
    /// at the start of a step, when the sequence next appends.
    pub fn first_needed(self, len: usize, block_size: usize) -> usize {
        match self {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow { window } => {
                len.saturating_sub(window as usize) / block_size.max(1)
            }
        }
    }
}

/// One group of layers that share a block id space and therefore one block table
/// per sequence.
///
/// Layers of different kinds need different tables (a sliding-window table
/// drops old blocks, a full table does not), so a model that mixes kinds gets
/// one group per kind, each with its own storage tensors and capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    /// Attention kind of the group's layers.
    pub kind: AttentionKind,
    /// Number of blocks in the group's storage.
    pub num_blocks: u32,
}

impl GroupSpec {
    /// A group sized by block count.
    pub fn new(kind: AttentionKind, num_blocks: u32) -> Self {
        Self { kind, num_blocks }
    }

    /// A group sized from a byte budget for its storage.
    pub fn from_budget(
        kind: AttentionKind,
        layout: KvLayout,
        budget_bytes: u64,
    ) -> Result<Self, KvError> {
        Ok(Self {
            kind,
            num_blocks: layout.blocks_for_budget(budget_bytes)?,
        })
    }
}

/// Configuration of a [`crate::KvPool`]: block size, the per-kind group table
/// and the number of SSM state slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Tokens per block, shared by all groups so that one token count maps to
    /// the same block boundaries everywhere and one prefix hash chain serves
    /// every group.
    pub block_size: u32,
    /// The groups, indexed by [`GroupId`](crate::GroupId).
    pub groups: Vec<GroupSpec>,
    /// SSM state slots (0 for pure-attention models).
    pub state_slots: u32,
    /// Key for the prefix hash chain. `None` draws a random key per pool, which
    /// keeps one tenant from crafting token sequences whose hashes collide with
    /// another's; a fixed key makes runs reproducible.
    pub hash_key: Option<u64>,
}

impl KvGroups {
    /// Starts a configuration with no groups.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            groups: Vec::new(),
            state_slots: 0,
            hash_key: None,
        }
    }

    /// Adds a full-attention group of `num_blocks` blocks.
    pub fn full(mut self, num_blocks: u32) -> Self {
        self.groups
            .push(GroupSpec::new(AttentionKind::Full, num_blocks));
        self
    }

    /// Adds a sliding-window group of `num_blocks` blocks.
    pub fn sliding(mut self, window: u32, num_blocks: u32) -> Self {
        self.groups.push(GroupSpec::new(
            AttentionKind::SlidingWindow { window },
            num_blocks,
        ));
        self
    }

    /// Adds a group.
    pub fn group(mut self, spec: GroupSpec) -> Self {
        self.groups.push(spec);
        self
    }

    /// Sets the number of SSM state slots.
    pub fn state_slots(mut self, slots: u32) -> Self {
        self.state_slots = slots;
        self
    }

    /// Fixes the prefix hash key (reproducible hashes).
    pub fn hash_key(mut self, key: u64) -> Self {
        self.hash_key = Some(key);
        self
    }

    /// Groups a model's per-layer attention kinds into one group per distinct
    /// kind, in order of first appearance, and returns the configuration plus
    /// the layer → group map the storage half needs to pick a layer's table.
    ///
    /// `blocks_for(kind, layers)` sizes each group, given how many layers it has.
    pub fn from_layer_kinds(
        block_size: u32,
        layer_kinds: &[AttentionKind],
        mut blocks_for: impl FnMut(AttentionKind, u32) -> u32,
    ) -> (Self, Vec<crate::GroupId>) {
        let mut kinds: Vec<(AttentionKind, u32)> = Vec::new();
        let mut map = Vec::with_capacity(layer_kinds.len());
        for kind in layer_kinds {
            let g = match kinds.iter().position(|(k, _)| k == kind) {
                Some(g) => g,
                None => {
                    kinds.push((*kind, 0));
                    kinds.len() - 1
                }
            };
            kinds[g].1 += 1;
            map.push(g);
        }
        let mut cfg = Self::new(block_size);
        for (kind, layers) in kinds {
            cfg.groups
                .push(GroupSpec::new(kind, blocks_for(kind, layers)));
        }
        (cfg, map)
    }

    pub(crate) fn validate(&self) -> Result<(), KvError> {
        check_block_size(self.block_size)?;
        if self.groups.is_empty() && self.state_slots == 0 {
            return Err(KvError::InvalidConfig("no KV groups and no state slots"));
        }
        for g in &self.groups {
            if g.num_blocks > MAX_BLOCKS {
                return Err(KvError::InvalidConfig("too many blocks in a group"));
            }
            if let AttentionKind::SlidingWindow { window } = g.kind {
                if window == 0 {
                    return Err(KvError::InvalidConfig("sliding window of 0 tokens"));
                }
            }
        }
        if self.state_slots > MAX_BLOCKS {
            return Err(KvError::InvalidConfig("too many state slots"));
        }
        Ok(())
    }
}
