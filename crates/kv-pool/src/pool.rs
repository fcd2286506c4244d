//! Sequences, per-group block tables, prefix reuse and step transactions.

use std::collections::BTreeMap;

use crate::block_pool::{BlockId, BlockPool, BlockPoolSnapshot, BlockStats};
use crate::hash::{BlockHash, ChainHasher, Salt, ROOT_HASH};
use crate::layout::{AttentionKind, KvGroups};
use crate::slots::{SlotBatch, SlotId, SlotPool, SlotPoolSnapshot, SlotStats};
use crate::KvError;

/// Index of a layer group (one per attention kind) in [`KvGroups::groups`].
pub type GroupId = usize;

/// Handle to a sequence owned by the pool.
///
/// The generation makes a handle kept past [`KvPool::release`] fail with
/// [`KvError::UnknownSequence`] instead of silently naming whichever sequence
/// reuses the slab entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId {
    index: u32,
    generation: u32,
}

impl SeqId {
    /// Dense index (stable while the sequence lives), for per-row side tables.
    pub fn index(self) -> u32 {
        self.index
    }
}

/// Who is charged for a sequence in [`PoolStats::owners`] (a tenant id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct OwnerId(pub u32);

/// How to create a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeqSpec {
    /// Tenant charged for the sequence.
    pub owner: OwnerId,
    /// Prefix-cache domain; `None` opts the sequence out of prefix caching
    /// (no lookups, no registration, no token ids kept).
    pub salt: Option<Salt>,
    /// Whether the sequence needs an SSM state slot (hybrid/recurrent models).
    pub state_slot: bool,
}

impl SeqSpec {
    /// A sequence for `owner`, without prefix caching or state slot.
    pub fn new(owner: OwnerId) -> Self {
        Self {
            owner,
            salt: None,
            state_slot: false,
        }
    }

    /// Enables prefix caching in the given domain.
    pub fn salted(mut self, salt: Salt) -> Self {
        self.salt = Some(salt);
        self
    }

    /// Requests an SSM state slot.
    pub fn with_state_slot(mut self) -> Self {
        self.state_slot = true;
        self
    }
}

/// Work the storage half must do before the next forward pass, in order.
///
/// All of a step's operations must be applied before the step's forward pass
/// writes anything: copies read contents written by earlier steps (which is why
/// [`KvPool::fork`] refuses sequences with unwritten tokens), and a later
/// operation may overwrite an earlier one's destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageOp {
    /// Copy-on-write: copy every layer's rows of block `src` to `dst`.
    CopyBlock {
        /// Group whose storage holds both blocks.
        group: GroupId,
        /// Shared block being written by one of its holders.
        src: BlockId,
        /// Fresh block that replaces `src` in the writer's table.
        dst: BlockId,
    },
    /// A fork: copy the whole state slot.
    CopySlot {
        /// Parent's slot.
        src: SlotId,
        /// Child's slot.
        dst: SlotId,
    },
    /// A new sequence's slot: zero it (recurrent state starts empty).
    ResetSlot(SlotId),
}

/// What one append did, summed over groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Appended {
    /// Blocks allocated for new tokens.
    pub new_blocks: usize,
    /// Copy-on-write copies queued (see [`StorageOp::CopyBlock`]).
    pub copies: usize,
    /// Sliding-window blocks given back.
    pub released: usize,
}

/// Blocks of a prefix hit in one group.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupHit {
    /// Logical index of `blocks[0]` (non-zero for sliding-window groups, which
    /// only need the blocks inside the window).
    pub offset: usize,
    /// Cached blocks, in logical order.
    pub blocks: Vec<BlockId>,
}

/// Longest cached block-aligned prefix usable in every group.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixHit {
    /// Tokens covered (a multiple of the block size).
    pub tokens: usize,
    /// Per group.
    pub groups: Vec<GroupHit>,
}

/// Prefix-cache effectiveness, counted at admission
/// ([`KvPool::allocate_with_prefix`]) so that a scheduler probing with
/// [`KvPool::lookup`] does not inflate it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// Admissions that queried the cache.
    pub lookups: u64,
    /// Tokens offered for matching.
    pub query_tokens: u64,
    /// Tokens served from the cache.
    pub hit_tokens: u64,
}

/// Per-tenant usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OwnerUsage {
    /// Live sequences.
    pub sequences: usize,
    /// Block references held, over all groups (a block shared by two of the
    /// owner's sequences counts twice; shared blocks are charged to every holder).
    pub block_refs: usize,
    /// State slots held.
    pub slots: usize,
}

/// Usage for metrics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Per group.
    pub groups: Vec<BlockStats>,
    /// State slots.
    pub slots: SlotStats,
    /// Live sequences.
    pub sequences: usize,
    /// Per owner.
    pub owners: BTreeMap<OwnerId, OwnerUsage>,
    /// Prefix cache.
    pub prefix: PrefixStats,
}

/// Read-only facts about a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    /// Tenant.
    pub owner: OwnerId,
    /// Prefix-cache domain.
    pub salt: Option<Salt>,
    /// KV slots committed (tokens whose KV is or will be in the tables).
    pub len: usize,
    /// RoPE offset of the next token; equals `len` unless set explicitly.
    pub position: usize,
    /// State slot, if any.
    pub state_slot: Option<SlotId>,
}

/// One sequence's block table in one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockTable<'a> {
    /// Logical index of `blocks[0]`: how many leading blocks a sliding window
    /// has dropped.
    pub offset: usize,
    /// Blocks, in logical order.
    pub blocks: &'a [BlockId],
    /// Tokens per block.
    pub block_size: usize,
}

impl BlockTable<'_> {
    /// Block and in-block offset holding token `index`, if it is still held.
    pub fn locate(&self, index: usize) -> Option<(BlockId, usize)> {
        let logical = index / self.block_size;
        let i = logical.checked_sub(self.offset)?;
        self.blocks.get(i).map(|b| (*b, index % self.block_size))
    }
}

/// One sequence's block table in one group, owned: what rides with a row's
/// step input to the storage half (which indexes its tensors with it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RowBlocks {
    /// Logical index of `blocks[0]` (see [`BlockTable::offset`]).
    pub offset: usize,
    /// Blocks, in logical order.
    pub blocks: Vec<BlockId>,
}

impl RowBlocks {
    /// Refills `self` from a borrowed table, reusing its allocation.
    pub fn copy_from(&mut self, t: &BlockTable<'_>) {
        self.offset = t.offset;
        self.blocks.clear();
        self.blocks.extend_from_slice(t.blocks);
    }

    /// As a borrowed table of `block_size`-token blocks.
    pub fn as_table(&self, block_size: usize) -> BlockTable<'_> {
        BlockTable {
            offset: self.offset,
            blocks: &self.blocks,
            block_size,
        }
    }
}

/// One sequence as recorded in a [`PoolSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceSnapshot {
    /// Handle.
    pub id: SeqId,
    /// Tenant.
    pub owner: OwnerId,
    /// Prefix-cache domain.
    pub salt: Option<Salt>,
    /// Committed tokens.
    pub len: usize,
    /// RoPE offset.
    pub position: usize,
    /// Leading full blocks already offered to the prefix cache.
    pub registered: usize,
    /// Hash of the last registered block.
    pub chain: BlockHash,
    /// State slot.
    pub state_slot: Option<SlotId>,
    /// `(offset, blocks)` per group.
    pub tables: Vec<(usize, Vec<BlockId>)>,
    /// Token ids (prefix-cached sequences only).
    pub tokens: Vec<u32>,
}

/// The whole accounting state, comparable with `==` (rollback tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Per group.
    pub groups: Vec<BlockPoolSnapshot>,
    /// State slots.
    pub slots: SlotPoolSnapshot,
    /// Live sequences in slab order.
    pub sequences: Vec<SequenceSnapshot>,
    /// Slab entries free for reuse, next reused last.
    pub free_seq_indices: Vec<u32>,
    /// Generation of every slab entry.
    pub generations: Vec<u32>,
    /// Storage operations not yet taken.
    pub pending_ops: Vec<StorageOp>,
    /// Prefix counters.
    pub prefix: PrefixStats,
}

#[derive(Debug, Clone, Copy)]
struct Header {
    len: usize,
    position: usize,
    /// `len` when the current step first appended to the sequence (what it may
    /// truncate to, and where its placeholders start).
    base_len: usize,
    /// The sequence's committed length while an open step has appended to it:
    /// `len` when the oldest open step that appended to it began. Blocks are
    /// released behind the window from here, so a step appending twice keeps every
    /// block its own forward pass still reads and, with a younger
    /// step stacked on an older one, the older may still roll back and run again
    /// from here, reading every block of its window (the younger step's appends
    /// must not hand those to another sequence to overwrite).
    hold: usize,
    /// Step in which the sequence last appended (`KvPool::epoch`).
    dirty_epoch: u64,
    registered: usize,
    chain: BlockHash,
    slot: Option<SlotId>,
}

#[derive(Debug, Clone)]
struct Table {
    offset: usize,
    blocks: Vec<BlockId>,
}

#[derive(Debug, Clone)]
struct SeqState {
    owner: OwnerId,
    salt: Option<Salt>,
    hdr: Header,
    tables: Vec<Table>,
    tokens: Vec<u32>,
}

#[derive(Debug, Clone)]
struct Entry {
    generation: u32,
    seq: Option<SeqState>,
}

/// Undo records for sequence state. Tables are journaled per edit (push, set,
/// drop-front) rather than cloned, so a step touching 256 rows costs a few
/// small records per row.
#[derive(Debug, Clone)]
enum SeqUndo {
    Created {
        index: u32,
        reused: bool,
    },
    Removed {
        index: u32,
        seq: Box<SeqState>,
    },
    Header {
        index: u32,
        old: Header,
    },
    TablePush {
        index: u32,
        group: u32,
    },
    TableSet {
        index: u32,
        group: u32,
        pos: u32,
        old: BlockId,
    },
    TableRemoveFront {
        index: u32,
        group: u32,
        old: BlockId,
    },
    TokensAppended {
        index: u32,
        old_len: usize,
    },
    TablePop {
        index: u32,
        group: u32,
        old: BlockId,
    },
    TokensTruncated {
        index: u32,
        removed: Vec<u32>,
    },
    TokensSet {
        index: u32,
        pos: usize,
        old: Vec<u32>,
    },
}

/// Where a younger step began (see [`KvPool::begin`]): the lengths of every
/// journal and list, and the prefix counters, to undo it or to commit the step
/// below it.
#[derive(Debug, Clone)]
struct Younger {
    /// The older step's epoch: sequences it appended to are still uncommitted.
    older_epoch: u64,
    journal: usize,
    slots: usize,
    groups: Vec<(usize, usize)>,
    ops: usize,
    dirty: usize,
    prefix: PrefixStats,
}

struct Hit {
    tokens: usize,
    groups: Vec<GroupHit>,
    chain: BlockHash,
}

/// The accounting half of the paged KV cache: groups of blocks, sequences and
/// their block tables, the prefix cache, SSM state slots, and step
/// transactions.
///
/// # Ownership
///
/// The pool owns every sequence in a slab; callers hold plain [`SeqId`]s and
/// give sequences back with [`release`](Self::release). A dropped id therefore
/// cannot leak blocks behind the pool's back: the blocks stay accounted to a
/// live sequence that [`live_sequences`](Self::live_sequences) and the
/// per-owner stats still show. RAII guards were rejected because a guard
/// needs either a borrow of the pool (which would forbid the batch-wide
/// mutation a scheduler does every step) or shared interior mutability, and a
/// guard dropped inside a step that is later rolled back would have to
/// resurrect itself. Ids plus explicit release are simple to reason about and
/// to test.
///
/// # Steps
///
/// [`begin`](Self::begin) / [`commit`](Self::commit) /
/// [`rollback`](Self::rollback) bracket one engine step. The intended order
/// is: plan the step (appends, admissions, forks, releases) inside the
/// transaction; on [`KvError::PoolExhausted`] roll back (or preempt and keep
/// going); commit; apply the returned [`StorageOp`]s; run the forward pass.
/// Rollback restores the state exactly (tables, refcounts, positions, cache
/// entries, list order, slots), which is only meaningful because storage has
/// not been written yet at that point.
///
/// Full blocks are filed in the prefix cache at commit, not when the append is
/// planned: their contents only exist after the forward pass, and a sequence
/// released within the step (preempted) never gets them computed at all.
///
/// Outside a transaction every call is its own step (it commits on success).
/// Every call is atomic: on error nothing changed.
#[derive(Debug, Clone)]
pub struct KvPool {
    cfg: KvGroups,
    block_size: usize,
    groups: Vec<BlockPool>,
    slots: SlotPool,
    hasher: ChainHasher,
    slab: Vec<Entry>,
    free_seqs: Vec<u32>,
    live: usize,
    journal: Vec<SeqUndo>,
    ops: Vec<StorageOp>,
    dirty: Vec<SeqId>,
    in_txn: bool,
    epoch: u64,
    prefix: PrefixStats,
    txn_prefix: PrefixStats,
    txn_ops_len: usize,
    marks: Vec<usize>,
    /// A second step opened on top of the first (pipelined engine steps).
    younger: Option<Younger>,
}

/// First logical block a sequence of `len` tokens still needs in a group:
/// blocks lying entirely before `len - window` are never attended again.
fn first_needed(kind: AttentionKind, len: usize, block_size: usize) -> usize {
    kind.first_needed(len, block_size)
}

impl KvPool {
    /// Builds a pool from a validated configuration.
    pub fn new(cfg: KvGroups) -> Result<Self, KvError> {
        cfg.validate()?;
        let groups = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(g, spec)| {
                let mut p = BlockPool::new_in_group(g, spec.num_blocks, cfg.block_size)?;
                // Always journal: outside a step the journal is the undo log that
                // makes each call atomic, and is cleared when the call returns.
                p.set_journaling(true);
                Ok(p)
            })
            .collect::<Result<Vec<_>, KvError>>()?;
        let mut slots = SlotPool::new(cfg.state_slots);
        slots.set_journaling(true);
        Ok(Self {
            block_size: cfg.block_size as usize,
            hasher: ChainHasher::new(cfg.hash_key),
            cfg,
            groups,
            slots,
            slab: Vec::new(),
            free_seqs: Vec::new(),
            live: 0,
            journal: Vec::new(),
            ops: Vec::new(),
            dirty: Vec::new(),
            in_txn: false,
            epoch: 0,
            prefix: PrefixStats::default(),
            txn_prefix: PrefixStats::default(),
            txn_ops_len: 0,
            marks: Vec::new(),
            younger: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KvGroups {
        &self.cfg
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// A group's allocator, read-only (refcounts, cache entries, stats).
    pub fn group(&self, group: GroupId) -> Result<&BlockPool, KvError> {
        self.groups.get(group).ok_or(KvError::UnknownGroup(group))
    }

    /// The state slots, read-only.
    pub fn slots(&self) -> &SlotPool {
        &self.slots
    }

    /// Whether a step transaction is open.
    pub fn in_transaction(&self) -> bool {
        self.in_txn
    }

    // ----- sequences -------------------------------------------------------

    /// Creates an empty sequence.
    pub fn allocate(&mut self, spec: SeqSpec) -> Result<SeqId, KvError> {
        self.allocate_with_prefix(spec, &[]).map(|(id, _)| id)
    }

    /// Creates a sequence that starts with the longest cached prefix of
    /// `tokens` (block-aligned, same salt), taking a reference on each reused
    /// block; returns the id and how many tokens were reused. The caller
    /// appends the remaining tokens.
    ///
    /// Pass all but the last prompt token when the forward pass must produce
    /// logits for the prompt's end: a full hit would otherwise leave nothing to
    /// compute. Sequences with a state slot never reuse a prefix, because the
    /// recurrent state at the end of a cached prefix is not cached.
    pub fn allocate_with_prefix(
        &mut self,
        spec: SeqSpec,
        tokens: &[u32],
    ) -> Result<(SeqId, usize), KvError> {
        self.atomically(|p| {
            if spec.state_slot && p.slots.free() == 0 {
                return Err(KvError::SlotsExhausted {
                    needed: 1,
                    available: 0,
                });
            }
            let hit = match spec.salt {
                Some(salt) if !spec.state_slot => p.lookup_inner(salt, tokens),
                _ => p.empty_hit(),
            };
            let slot = if spec.state_slot {
                let s = p.slots.acquire(spec.owner)?;
                p.ops.push(StorageOp::ResetSlot(s));
                Some(s)
            } else {
                None
            };
            let mut tables = Vec::with_capacity(p.groups.len());
            for (g, gh) in hit.groups.into_iter().enumerate() {
                for &b in &gh.blocks {
                    p.groups[g].retain(b)?;
                }
                tables.push(Table {
                    offset: gh.offset,
                    blocks: gh.blocks,
                });
            }
            let n = hit.tokens;
            let state = SeqState {
                owner: spec.owner,
                salt: spec.salt,
                hdr: Header {
                    len: n,
                    position: n,
                    base_len: n,
                    hold: n,
                    dirty_epoch: 0,
                    registered: n / p.block_size,
                    chain: hit.chain,
                    slot,
                },
                tables,
                tokens: if spec.salt.is_some() {
                    tokens[..n].to_vec()
                } else {
                    Vec::new()
                },
            };
            let id = p.insert_seq(state);
            if spec.salt.is_some() && !tokens.is_empty() {
                p.prefix.lookups += 1;
                p.prefix.query_tokens += tokens.len() as u64;
                p.prefix.hit_tokens += n as u64;
            }
            Ok((id, n))
        })
    }

    /// Adds `n` tokens by count, allocating blocks as needed (copy-on-write of
    /// a shared partial last block, sliding-window release first). Only for
    /// sequences without a salt: cached sequences need the token ids.
    pub fn append(&mut self, seq: SeqId, n: usize) -> Result<Appended, KvError> {
        self.atomically(|p| p.append_inner(seq, n, None))
    }

    /// Adds tokens by id. Blocks they fill are filed in the prefix cache when
    /// the step commits.
    pub fn append_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Appended, KvError> {
        self.atomically(|p| p.append_inner(seq, tokens.len(), Some(tokens)))
    }

    /// Creates a child sharing every block (reference counts go up; the first
    /// of the two to write into a shared partial block gets a private copy).
    /// A state slot is copied eagerly, since recurrent state is rewritten whole
    /// each step.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, KvError> {
        self.atomically(|p| {
            let idx = p.resolve(seq)?;
            let s = p.slab[idx].seq.as_ref().expect("resolved");
            if s.hdr.dirty_epoch == p.epoch {
                return Err(KvError::ForkOfPendingSequence(seq));
            }
            let mut child = s.clone();
            child.hdr.dirty_epoch = 0;
            if let Some(src) = s.hdr.slot {
                let dst = p.slots.acquire(child.owner)?;
                p.ops.push(StorageOp::CopySlot { src, dst });
                child.hdr.slot = Some(dst);
            }
            for (g, t) in child.tables.iter().enumerate() {
                for &b in &t.blocks {
                    p.groups[g].retain(b)?;
                }
            }
            Ok(p.insert_seq(child))
        })
    }

    /// Gives a sequence's blocks and slot back. Blocks the prefix cache knows
    /// become evictable cached blocks; the rest become free.
    ///
    /// Blocks are released last-to-first so that, within one sequence, later
    /// blocks are evicted before earlier ones: a cached block is useless once
    /// its parent is gone, since lookups walk the chain from the start.
    pub fn release(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.atomically(|p| {
            let idx = p.resolve(seq)?;
            {
                let KvPool {
                    slab,
                    groups,
                    slots,
                    ..
                } = &mut *p;
                let s = slab[idx].seq.as_ref().expect("resolved");
                for (g, t) in s.tables.iter().enumerate() {
                    for &b in t.blocks.iter().rev() {
                        groups[g].release(b)?;
                    }
                }
                if let Some(slot) = s.hdr.slot {
                    slots.release(slot)?;
                }
            }
            let e = &mut p.slab[idx];
            let state = e.seq.take().expect("resolved");
            e.generation = e.generation.wrapping_add(1);
            p.free_seqs.push(idx as u32);
            p.live -= 1;
            p.journal.push(SeqUndo::Removed {
                index: idx as u32,
                seq: Box::new(state),
            });
            Ok(())
        })
    }

    /// Overrides the RoPE offset (e.g. for position schemes that do not advance
    /// one per KV slot). Appends advance it by the number of tokens.
    pub fn set_position(&mut self, seq: SeqId, position: usize) -> Result<(), KvError> {
        self.atomically(|p| {
            let idx = p.resolve(seq)?;
            let s = p.slab[idx].seq.as_mut().expect("resolved");
            p.journal.push(SeqUndo::Header {
                index: idx as u32,
                old: s.hdr,
            });
            s.hdr.position = position;
            Ok(())
        })
    }

    /// Takes back the tail of what the open step appended to `seq`, keeping
    /// its first `len` tokens: a speculative step's rejected draft tokens.
    /// Blocks left without a token go back to the pool; the position moves
    /// back by as much. Staged like the appends (a rollback restores them), so
    /// the sequence never holds KV slots it does not use (no holes). Only
    /// tokens appended in this step can be dropped, and never below a block
    /// the prefix cache already holds.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), KvError> {
        if !self.in_txn {
            let s = self.seq(seq)?;
            return Err(KvError::BadTruncate {
                seq,
                len: s.hdr.len,
                to: len,
                floor: s.hdr.len,
            });
        }
        self.atomically(|p| {
            let idx = p.resolve(seq)?;
            let bs = p.block_size;
            let epoch = p.epoch;
            let KvPool {
                slab,
                groups,
                journal,
                ..
            } = &mut *p;
            let s = slab[idx].seq.as_mut().expect("resolved");
            let floor = if s.hdr.dirty_epoch == epoch {
                s.hdr.base_len.max(s.hdr.registered * bs)
            } else {
                s.hdr.len
            };
            if len < floor || len > s.hdr.len {
                return Err(KvError::BadTruncate {
                    seq,
                    len: s.hdr.len,
                    to: len,
                    floor,
                });
            }
            let cut = s.hdr.len - len;
            if cut == 0 {
                return Ok(());
            }
            let index = idx as u32;
            journal.push(SeqUndo::Header { index, old: s.hdr });
            s.hdr.len = len;
            s.hdr.position -= cut.min(s.hdr.position);
            let want = len.div_ceil(bs);
            for (g, t) in s.tables.iter_mut().enumerate() {
                while t.offset + t.blocks.len() > want && !t.blocks.is_empty() {
                    let old = t.blocks.pop().expect("non-empty");
                    journal.push(SeqUndo::TablePop {
                        index,
                        group: g as u32,
                        old,
                    });
                    groups[g].release(old)?;
                }
            }
            if s.salt.is_some() {
                let keep = s.tokens.len() - cut;
                let removed = s.tokens.split_off(keep);
                journal.push(SeqUndo::TokensTruncated { index, removed });
            }
            Ok(())
        })
    }

    /// Facts about a live sequence.
    pub fn sequence(&self, seq: SeqId) -> Result<SeqInfo, KvError> {
        let s = self.seq(seq)?;
        Ok(SeqInfo {
            owner: s.owner,
            salt: s.salt,
            len: s.hdr.len,
            position: s.hdr.position,
            state_slot: s.hdr.slot,
        })
    }

    /// A sequence's block table in one group.
    pub fn table(&self, seq: SeqId, group: GroupId) -> Result<BlockTable<'_>, KvError> {
        let s = self.seq(seq)?;
        let t = s.tables.get(group).ok_or(KvError::UnknownGroup(group))?;
        Ok(BlockTable {
            offset: t.offset,
            blocks: &t.blocks,
            block_size: self.block_size,
        })
    }

    /// Blocks of `seq`'s table in `group` that its next step's first append
    /// returns to the pool before allocating: those behind the window of its
    /// length now (the append's base) that only this sequence references. A
    /// block shared with another sequence stays in use and is not counted, so
    /// this is what the append frees at least (0 for full-attention groups).
    pub fn releasable_on_append(&self, seq: SeqId, group: GroupId) -> Result<usize, KvError> {
        let s = self.seq(seq)?;
        let t = s.tables.get(group).ok_or(KvError::UnknownGroup(group))?;
        let kind = self.cfg.groups[group].kind;
        let from = self.committed_len(&s.hdr);
        let drop = first_needed(kind, from, self.block_size)
            .saturating_sub(t.offset)
            .min(t.blocks.len());
        let pool = &self.groups[group];
        Ok(t.blocks[..drop]
            .iter()
            .filter(|&&b| pool.refcount(b) == Ok(1))
            .count())
    }

    /// The committed length of the sequence with this header: where a step
    /// that appends to it keeps its window from ([`Header::hold`]).
    fn committed_len(&self, h: &Header) -> usize {
        if !self.in_txn {
            h.len
        } else if h.dirty_epoch == self.epoch {
            h.hold
        } else if self
            .younger
            .as_ref()
            .is_some_and(|y| h.dirty_epoch == y.older_epoch)
        {
            // Appended in the older step, which began at its committed length.
            h.base_len
        } else {
            h.len
        }
    }

    /// Token ids of a prefix-cached sequence (empty for unsalted ones).
    pub fn tokens(&self, seq: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.seq(seq)?.tokens)
    }

    /// Every live sequence (leak audits: anything here the scheduler does not
    /// know about is a forgotten `release`).
    pub fn live_sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.slab.iter().enumerate().filter_map(|(i, e)| {
            e.seq.as_ref().map(|_| SeqId {
                index: i as u32,
                generation: e.generation,
            })
        })
    }

    /// Number of live sequences.
    pub fn num_sequences(&self) -> usize {
        self.live
    }

    /// The state slots of `seqs` in row order, as a batch to gather from.
    pub fn slot_batch(&self, seqs: &[SeqId]) -> Result<SlotBatch, KvError> {
        seqs.iter()
            .map(|&id| self.seq(id)?.hdr.slot.ok_or(KvError::NoStateSlot(id)))
            .collect::<Result<Vec<_>, _>>()
            .map(SlotBatch::from_slots)
    }

    // ----- prefix cache ----------------------------------------------------

    /// Longest block-aligned prefix of `tokens` cached under `salt` in every
    /// group. For sliding-window groups only the blocks inside the window at
    /// the end of the prefix must be cached. Read-only and not counted.
    pub fn lookup(&self, salt: Salt, tokens: &[u32]) -> PrefixHit {
        let h = self.lookup_inner(salt, tokens);
        PrefixHit {
            tokens: h.tokens,
            groups: h.groups,
        }
    }

    /// Prefix-cache counters.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix
    }

    /// Prefix-cache counters of committed work: what they were when the oldest
    /// open step began (lookups inside an open step count once it commits, and
    /// never if it rolls back); [`prefix_stats`](Self::prefix_stats) with no step
    /// open.
    pub fn committed_prefix_stats(&self) -> PrefixStats {
        if self.in_txn {
            self.txn_prefix
        } else {
            self.prefix
        }
    }

    fn empty_hit(&self) -> Hit {
        Hit {
            tokens: 0,
            groups: vec![GroupHit::default(); self.groups.len()],
            chain: ROOT_HASH,
        }
    }

    fn lookup_inner(&self, salt: Salt, tokens: &[u32]) -> Hit {
        const MISS: BlockId = BlockId::MAX;
        let bs = self.block_size;
        let n = tokens.len() / bs;
        let ng = self.groups.len();
        if ng == 0 || n == 0 {
            return self.empty_hit();
        }
        let kinds: Vec<AttentionKind> = self.cfg.groups.iter().map(|g| g.kind).collect();
        // Full groups: the hit blocks so far; sliding groups: one entry per
        // block (MISS when absent), since only a window of them is needed.
        let mut found: Vec<Vec<BlockId>> = vec![Vec::new(); ng];
        let mut hashes = Vec::with_capacity(n);
        let mut parent = ROOT_HASH;
        let mut k_full = 0;
        for i in 0..n {
            let toks = &tokens[i * bs..(i + 1) * bs];
            let h = self.hasher.hash_block(parent, salt, toks);
            let mut all_full = true;
            for (g, pool) in self.groups.iter().enumerate() {
                let b = pool.lookup(h, salt, parent, toks);
                match kinds[g] {
                    AttentionKind::Full => match b {
                        Some(b) => found[g].push(b),
                        None => all_full = false,
                    },
                    AttentionKind::SlidingWindow { .. } => found[g].push(b.unwrap_or(MISS)),
                }
            }
            if !all_full {
                break;
            }
            hashes.push(h);
            parent = h;
            k_full = i + 1;
        }
        // Largest k <= k_full whose window blocks are all present in every
        // sliding group. A miss at block m rules out every k > m (the window of
        // a smaller k starts no later), so jump straight below it.
        let mut k = k_full;
        loop {
            let mut limit: Option<usize> = None;
            for (g, kind) in kinds.iter().enumerate() {
                if let AttentionKind::SlidingWindow { .. } = kind {
                    let first = first_needed(*kind, k * bs, bs);
                    if let Some(pos) = found[g][first..k].iter().rposition(|&b| b == MISS) {
                        let m = first + pos;
                        limit = Some(limit.map_or(m, |l| l.min(m)));
                    }
                }
            }
            match limit {
                Some(m) => k = m,
                None => break,
            }
        }
        let groups = kinds
            .iter()
            .zip(found)
            .map(|(kind, f)| {
                let first = first_needed(*kind, k * bs, bs);
                GroupHit {
                    offset: first,
                    blocks: f[first..k].to_vec(),
                }
            })
            .collect();
        Hit {
            tokens: k * bs,
            groups,
            chain: if k == 0 { ROOT_HASH } else { hashes[k - 1] },
        }
    }

    // ----- steps -----------------------------------------------------------

    /// Opens a step. Everything until [`commit`](Self::commit) or
    /// [`rollback`](Self::rollback) is staged. Refused while one is open
    /// ([`begin_next`](Self::begin_next) stacks a second).
    pub fn begin(&mut self) -> Result<(), KvError> {
        if self.in_txn {
            return Err(KvError::TransactionOpen);
        }
        self.in_txn = true;
        self.epoch += 1;
        self.txn_prefix = self.prefix;
        self.txn_ops_len = self.ops.len();
        Ok(())
    }

    /// Opens a second step on top of the open one: a pipelined engine plans
    /// step n+1 while step n computes. Everything from here on belongs to the
    /// new (younger) step; [`commit`](Self::commit) then commits the older
    /// one and rollbacks undo the younger first. Refused unless exactly one
    /// step is open.
    pub fn begin_next(&mut self) -> Result<(), KvError> {
        if !self.in_txn {
            return Err(KvError::NoTransaction);
        }
        if self.younger.is_some() {
            return Err(KvError::TransactionOpen);
        }
        {
            // The older step's work is final now (everything from here on is the
            // younger step's): file its full blocks now, journaled into it, so
            // undoing it still undoes them and the younger step never files a
            // block holding its own placeholders early. Lookups happen between
            // steps, never while one computes, so none sees them before the
            // older step commits.
            let dirty = std::mem::take(&mut self.dirty);
            self.register(&dirty, true);
            self.dirty = dirty;
            self.dirty.clear();
            let older_epoch = self.epoch;
            self.epoch += 1;
            self.younger = Some(Younger {
                older_epoch,
                journal: self.journal.len(),
                slots: self.slots.journal_len(),
                groups: self
                    .groups
                    .iter()
                    .map(|g| (g.journal_len(), g.evicted_len()))
                    .collect(),
                ops: self.ops.len(),
                dirty: self.dirty.len(),
                prefix: self.prefix,
            });
        }
        Ok(())
    }

    /// Steps open: 0, 1, or 2 while a younger step is stacked on an older one.
    pub fn open_steps(&self) -> usize {
        usize::from(self.in_txn) + usize::from(self.younger.is_some())
    }

    /// Closes the oldest open step: files newly filled blocks in the prefix
    /// cache and returns every pending storage operation, in order. With a
    /// younger step open, only the older step's part is committed (its blocks
    /// were filed when the younger step began; what the younger step appended
    /// is not computed yet and may hold placeholders,
    /// [`set_tokens`](Self::set_tokens)): the operations returned are those
    /// recorded before the younger step began, and the younger step stays
    /// open: undoing it later restores the state right after this commit.
    pub fn commit(&mut self) -> Result<Vec<StorageOp>, KvError> {
        if !self.in_txn {
            return Err(KvError::NoTransaction);
        }
        if let Some(y) = self.younger.take() {
            // What the younger step appended to now starts at a committed length
            // (undoing it restores each header as it was before its append).
            for &seq in &self.dirty[..] {
                if let Ok(idx) = self.resolve(seq) {
                    if let Some(s) = self.slab[idx].seq.as_mut() {
                        s.hdr.hold = s.hdr.base_len;
                    }
                }
            }
            self.journal.drain(..y.journal);
            self.slots.drain_journal(y.slots);
            for (g, &(j, e)) in self.groups.iter_mut().zip(&y.groups) {
                g.drain_journal(j, e);
            }
            let rest = self.ops.split_off(y.ops);
            self.txn_ops_len = 0;
            self.txn_prefix = y.prefix;
            return Ok(std::mem::replace(&mut self.ops, rest));
        }
        self.finish_step();
        self.clear_journals();
        self.in_txn = false;
        self.txn_ops_len = 0;
        Ok(std::mem::take(&mut self.ops))
    }

    /// Overwrites `tokens` of `seq` from position `pos`: tokens the newest
    /// open step appended as placeholders (their ids were not known yet, a
    /// pipelined step feeding the previous one's picks) get their real ids
    /// before that step commits and files them in the prefix cache. Refused
    /// unless every position lies in what the newest open step appended.
    /// Undone with the step. A sequence without a salt keeps no token ids:
    /// nothing to overwrite.
    pub fn set_tokens(&mut self, seq: SeqId, pos: usize, tokens: &[u32]) -> Result<(), KvError> {
        let idx = self.resolve(seq)?;
        let epoch = self.epoch;
        let in_txn = self.in_txn;
        let s = self.slab[idx].seq.as_mut().expect("resolved");
        let end = pos + tokens.len();
        if !in_txn || s.hdr.dirty_epoch != epoch || pos < s.hdr.base_len || end > s.hdr.len {
            return Err(KvError::BadTokens {
                seq,
                pos,
                len: tokens.len(),
            });
        }
        if s.salt.is_none() || tokens.is_empty() {
            return Ok(());
        }
        let old = s.tokens[pos..end].to_vec();
        s.tokens[pos..end].copy_from_slice(tokens);
        self.journal.push(SeqUndo::TokensSet {
            index: idx as u32,
            pos,
            old,
        });
        Ok(())
    }

    /// Undoes the step: the state is exactly what it was at
    /// [`begin`](Self::begin) (see [`snapshot`](Self::snapshot)). Only for a
    /// step whose forward pass wrote nothing yet; after writes, use
    /// [`rollback_after_writes`](Self::rollback_after_writes).
    pub fn rollback(&mut self) -> Result<(), KvError> {
        self.rollback_inner(false)
    }

    /// Undoes a step whose forward pass may already have written storage
    /// (the engine's order: appends, storage operations, forward, sampling,
    /// commit). Tables, refcounts, positions, tokens and slots are exactly as
    /// at [`begin`](Self::begin); the one difference from
    /// [`rollback`](Self::rollback) is that cached blocks the step evicted come
    /// back *free*, their prefix-cache entries dropped, because the forward
    /// may have overwritten them. Writes anywhere else are harmless: they went
    /// to slots past a sequence's committed length or to blocks the step
    /// allocated, which return to the pool as dead data.
    pub fn rollback_after_writes(&mut self) -> Result<(), KvError> {
        self.rollback_inner(true)
    }

    fn rollback_inner(&mut self, written: bool) -> Result<(), KvError> {
        if !self.in_txn {
            return Err(KvError::NoTransaction);
        }
        if let Some(y) = self.younger.take() {
            self.undo_seqs(y.journal);
            self.slots.rollback_to(y.slots);
            for (g, &(j, e)) in self.groups.iter_mut().zip(&y.groups) {
                g.rollback_to(j);
                if written {
                    g.forget_evicted_since(e);
                } else {
                    g.truncate_evicted(e);
                }
            }
            self.ops.truncate(y.ops);
            self.dirty.truncate(y.dirty);
            self.prefix = y.prefix;
            return Ok(());
        }
        self.undo_seqs(0);
        self.slots.rollback_to(0);
        for g in &mut self.groups {
            g.rollback_to(0);
            if written {
                g.forget_evicted();
            } else {
                g.clear_journal();
            }
        }
        self.ops.truncate(self.txn_ops_len);
        self.dirty.clear();
        self.prefix = self.txn_prefix;
        self.in_txn = false;
        self.txn_ops_len = 0;
        Ok(())
    }

    /// Takes the storage operations of committed work. Inside a step, the
    /// step's own operations stay until [`commit`](Self::commit) (they would
    /// be wrong to apply if the step rolls back).
    pub fn take_ops(&mut self) -> Vec<StorageOp> {
        if self.in_txn {
            let rest = self.ops.split_off(self.txn_ops_len);
            if let Some(y) = &mut self.younger {
                y.ops -= self.txn_ops_len;
            }
            self.txn_ops_len = 0;
            std::mem::replace(&mut self.ops, rest)
        } else {
            std::mem::take(&mut self.ops)
        }
    }

    /// Storage operations of the open step only (empty outside a step). They
    /// write only blocks this step allocated, so applying them before the
    /// forward pass is safe even if the step then rolls back: the blocks go
    /// back to the pool holding dead data.
    pub fn step_ops(&self) -> &[StorageOp] {
        if let Some(y) = &self.younger {
            &self.ops[y.ops.min(self.ops.len())..]
        } else if self.in_txn {
            &self.ops[self.txn_ops_len.min(self.ops.len())..]
        } else {
            &[]
        }
    }

    /// Pending storage operations, committed or not.
    pub fn pending_ops(&self) -> &[StorageOp] {
        &self.ops
    }

    // ----- observation -----------------------------------------------------

    /// Usage for metrics. O(live sequences × groups) for the per-owner part.
    pub fn stats(&self) -> PoolStats {
        let mut owners: BTreeMap<OwnerId, OwnerUsage> = BTreeMap::new();
        for s in self.slab.iter().filter_map(|e| e.seq.as_ref()) {
            let u = owners.entry(s.owner).or_default();
            u.sequences += 1;
            u.block_refs += s.tables.iter().map(|t| t.blocks.len()).sum::<usize>();
            u.slots += usize::from(s.hdr.slot.is_some());
        }
        PoolStats {
            groups: self.groups.iter().map(BlockPool::stats).collect(),
            slots: self.slots.stats(),
            sequences: self.live,
            owners,
            prefix: self.prefix,
        }
    }

    /// The exact accounting state. Two snapshots are equal iff every table,
    /// refcount, position, cache entry, list order, slot and pending operation
    /// is equal.
    pub fn snapshot(&self) -> PoolSnapshot {
        let sequences = self
            .slab
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let s = e.seq.as_ref()?;
                Some(SequenceSnapshot {
                    id: SeqId {
                        index: i as u32,
                        generation: e.generation,
                    },
                    owner: s.owner,
                    salt: s.salt,
                    len: s.hdr.len,
                    position: s.hdr.position,
                    registered: s.hdr.registered,
                    chain: s.hdr.chain,
                    state_slot: s.hdr.slot,
                    tables: s
                        .tables
                        .iter()
                        .map(|t| (t.offset, t.blocks.clone()))
                        .collect(),
                    tokens: s.tokens.clone(),
                })
            })
            .collect();
        PoolSnapshot {
            groups: self.groups.iter().map(BlockPool::snapshot).collect(),
            slots: self.slots.snapshot(),
            sequences,
            free_seq_indices: self.free_seqs.clone(),
            generations: self.slab.iter().map(|e| e.generation).collect(),
            pending_ops: self.ops.clone(),
            prefix: self.prefix,
        }
    }

    /// Checks every cross-structure invariant: per-group list structure, each
    /// block's refcount equals the number of tables holding it, no table holds
    /// a block twice, table lengths match token counts, slots are held by at
    /// most one sequence, and the slab bookkeeping agrees. O(state); for tests
    /// and debug audits.
    pub fn check_invariants(&self) -> Result<(), String> {
        for g in &self.groups {
            g.check_invariants()?;
        }
        self.slots.check_invariants()?;
        let bs = self.block_size;
        let mut refs: Vec<Vec<u32>> = self.groups.iter().map(|g| vec![0; g.total()]).collect();
        let mut last_holder: Vec<Vec<usize>> = self
            .groups
            .iter()
            .map(|g| vec![usize::MAX; g.total()])
            .collect();
        let mut slot_holder = vec![false; self.slots.stats().total];
        let mut live = 0;
        for (i, e) in self.slab.iter().enumerate() {
            let Some(s) = &e.seq else { continue };
            live += 1;
            if s.tables.len() != self.groups.len() {
                return Err(format!(
                    "seq {i}: {} tables for {} groups",
                    s.tables.len(),
                    self.groups.len()
                ));
            }
            for (g, t) in s.tables.iter().enumerate() {
                let want = s.hdr.len.div_ceil(bs);
                if t.offset + t.blocks.len() != want {
                    return Err(format!(
                        "seq {i} group {g}: offset {} + {} blocks for {} tokens",
                        t.offset,
                        t.blocks.len(),
                        s.hdr.len
                    ));
                }
                if self.cfg.groups[g].kind == AttentionKind::Full && t.offset != 0 {
                    return Err(format!(
                        "seq {i} group {g}: full-attention table has offset {}",
                        t.offset
                    ));
                }
                for &b in &t.blocks {
                    let Some(r) = refs[g].get_mut(b as usize) else {
                        return Err(format!("seq {i} group {g}: block {b} outside the pool"));
                    };
                    if last_holder[g][b as usize] == i {
                        return Err(format!("seq {i} group {g}: block {b} twice in one table"));
                    }
                    last_holder[g][b as usize] = i;
                    *r += 1;
                }
            }
            if s.salt.is_some() && s.tokens.len() != s.hdr.len {
                return Err(format!(
                    "seq {i}: {} token ids for {} tokens",
                    s.tokens.len(),
                    s.hdr.len
                ));
            }
            if s.hdr.registered > s.hdr.len / bs {
                return Err(format!("seq {i}: registered past its full blocks"));
            }
            if let Some(slot) = s.hdr.slot {
                match slot_holder.get_mut(slot as usize) {
                    Some(h) if !*h && self.slots.owner(slot) == Some(s.owner) => *h = true,
                    _ => {
                        return Err(format!(
                            "seq {i}: slot {slot} not acquired for it or shared"
                        ))
                    }
                }
            }
        }
        for (g, pool) in self.groups.iter().enumerate() {
            for (b, &want) in refs[g].iter().enumerate() {
                let have = pool.refcount(b as BlockId).map_err(|e| e.to_string())?;
                if have != want {
                    return Err(format!(
                        "group {g} block {b}: refcount {have}, held by {want} tables"
                    ));
                }
            }
        }
        if live != self.live {
            return Err(format!("live count {} but {live} sequences", self.live));
        }
        let mut free_seen = vec![false; self.slab.len()];
        for &i in &self.free_seqs {
            match free_seen.get_mut(i as usize) {
                Some(f) if !*f && self.slab[i as usize].seq.is_none() => *f = true,
                _ => {
                    return Err(format!(
                        "slab free list entry {i} is live, repeated or out of range"
                    ))
                }
            }
        }
        if free_seen.iter().filter(|f| **f).count() + live != self.slab.len() {
            return Err("slab entry neither live nor free".into());
        }
        if !self.in_txn && !self.dirty.is_empty() {
            return Err("dirty sequences outside a step".into());
        }
        Ok(())
    }

    // ----- internals -------------------------------------------------------

    fn seq(&self, id: SeqId) -> Result<&SeqState, KvError> {
        let idx = self.resolve(id)?;
        Ok(self.slab[idx].seq.as_ref().expect("resolved"))
    }

    fn resolve(&self, id: SeqId) -> Result<usize, KvError> {
        match self.slab.get(id.index as usize) {
            Some(e) if e.generation == id.generation && e.seq.is_some() => Ok(id.index as usize),
            _ => Err(KvError::UnknownSequence(id)),
        }
    }

    fn insert_seq(&mut self, state: SeqState) -> SeqId {
        self.live += 1;
        if let Some(index) = self.free_seqs.pop() {
            let e = &mut self.slab[index as usize];
            e.seq = Some(state);
            self.journal.push(SeqUndo::Created {
                index,
                reused: true,
            });
            SeqId {
                index,
                generation: e.generation,
            }
        } else {
            let index = self.slab.len() as u32;
            self.slab.push(Entry {
                generation: 0,
                seq: Some(state),
            });
            self.journal.push(SeqUndo::Created {
                index,
                reused: false,
            });
            SeqId {
                index,
                generation: 0,
            }
        }
    }

    fn append_inner(
        &mut self,
        seq: SeqId,
        n: usize,
        tokens: Option<&[u32]>,
    ) -> Result<Appended, KvError> {
        let idx = self.resolve(seq)?;
        let bs = self.block_size;
        let epoch = self.epoch;
        let hold = self.committed_len(&self.slab[idx].seq.as_ref().expect("resolved").hdr);
        let KvPool {
            slab,
            groups,
            journal,
            ops,
            dirty,
            cfg,
            ..
        } = self;
        let s = slab[idx].seq.as_mut().expect("resolved");
        if s.salt.is_some() && tokens.is_none() {
            return Err(KvError::TokensRequired(seq));
        }
        if n == 0 {
            return Ok(Appended::default());
        }
        let len = s.hdr.len;
        let have = len.div_ceil(bs);
        let want = (len + n).div_ceil(bs);
        // Plan every group before touching any, so a shortfall reports exact
        // numbers and changes nothing.
        for (g, t) in s.tables.iter().enumerate() {
            let pool = &groups[g];
            let drop = first_needed(cfg.groups[g].kind, hold, bs)
                .saturating_sub(t.offset)
                .min(t.blocks.len());
            let freed = t.blocks[..drop]
                .iter()
                .filter(|&&b| pool.refcount(b) == Ok(1))
                .count();
            let cow = len % bs != 0
                && t.blocks
                    .last()
                    .is_some_and(|&b| pool.refcount(b).is_ok_and(|r| r > 1));
            let needed = want - have + usize::from(cow);
            let available = pool.available() + freed;
            if needed > available {
                return Err(KvError::PoolExhausted {
                    group: g,
                    needed,
                    available,
                });
            }
        }
        let index = idx as u32;
        journal.push(SeqUndo::Header { index, old: s.hdr });
        if s.hdr.dirty_epoch != epoch {
            s.hdr.dirty_epoch = epoch;
            s.hdr.base_len = len;
            s.hdr.hold = hold;
            dirty.push(seq);
        }
        s.hdr.len += n;
        s.hdr.position += n;
        let mut out = Appended::default();
        for (g, t) in s.tables.iter_mut().enumerate() {
            let pool = &mut groups[g];
            let group = g as u32;
            let drop_to = first_needed(cfg.groups[g].kind, hold, bs);
            while t.offset < drop_to && !t.blocks.is_empty() {
                let old = t.blocks.remove(0);
                t.offset += 1;
                journal.push(SeqUndo::TableRemoveFront { index, group, old });
                pool.release(old)?;
                out.released += 1;
            }
            if len % bs != 0 {
                if let Some(&src) = t.blocks.last() {
                    if pool.refcount(src)? > 1 {
                        let dst = pool.alloc()?;
                        let pos = t.blocks.len() - 1;
                        t.blocks[pos] = dst;
                        journal.push(SeqUndo::TableSet {
                            index,
                            group,
                            pos: pos as u32,
                            old: src,
                        });
                        pool.release(src)?;
                        ops.push(StorageOp::CopyBlock { group: g, src, dst });
                        out.copies += 1;
                    }
                }
            }
            for _ in have..want {
                let b = pool.alloc()?;
                t.blocks.push(b);
                journal.push(SeqUndo::TablePush { index, group });
                out.new_blocks += 1;
            }
        }
        if let (Some(tokens), Some(_)) = (tokens, s.salt) {
            journal.push(SeqUndo::TokensAppended {
                index,
                old_len: s.tokens.len(),
            });
            s.tokens.extend_from_slice(tokens);
        }
        Ok(out)
    }

    /// Files the full blocks of sequences that appended in this step.
    fn finish_step(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        self.register(&dirty, false);
        dirty.clear();
        self.dirty = dirty;
    }

    /// Files the full blocks of `seqs` in the prefix cache; with `journal`,
    /// the sequence headers it advances are journaled (the groups journal
    /// their own changes), so undoing the open step undoes the filing.
    fn register(&mut self, seqs: &[SeqId], journal: bool) {
        let bs = self.block_size;
        for &id in seqs {
            let Ok(idx) = self.resolve(id) else { continue };
            let KvPool {
                slab,
                groups,
                hasher,
                journal: undo,
                ..
            } = &mut *self;
            let s = slab[idx].seq.as_mut().expect("resolved");
            let Some(salt) = s.salt else { continue };
            let full = s.hdr.len / bs;
            if journal && s.hdr.registered < full {
                undo.push(SeqUndo::Header {
                    index: idx as u32,
                    old: s.hdr,
                });
            }
            while s.hdr.registered < full {
                let i = s.hdr.registered;
                let toks = &s.tokens[i * bs..(i + 1) * bs];
                let h = hasher.hash_block(s.hdr.chain, salt, toks);
                for (g, t) in s.tables.iter().enumerate() {
                    if let Some(&b) = i.checked_sub(t.offset).and_then(|j| t.blocks.get(j)) {
                        let r = groups[g].register(b, h, salt, s.hdr.chain, toks);
                        debug_assert!(r.is_ok(), "table blocks are referenced");
                    }
                }
                s.hdr.chain = h;
                s.hdr.registered += 1;
            }
        }
    }

    fn clear_journals(&mut self) {
        self.journal.clear();
        self.slots.clear_journal();
        for g in &mut self.groups {
            g.clear_journal();
        }
    }

    /// Runs one public operation atomically: on error everything it did is
    /// undone; outside a step, success commits it.
    fn atomically<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, KvError>,
    ) -> Result<T, KvError> {
        let auto = !self.in_txn;
        if auto {
            self.epoch += 1;
        }
        self.marks.clear();
        self.marks.push(self.journal.len());
        self.marks.push(self.slots.journal_len());
        self.marks.push(self.ops.len());
        self.marks.push(self.dirty.len());
        for g in &self.groups {
            self.marks.push(g.journal_len());
        }
        let r = f(self);
        if r.is_err() {
            let (seq, slots, ops, dirty) =
                (self.marks[0], self.marks[1], self.marks[2], self.marks[3]);
            self.undo_seqs(seq);
            self.slots.rollback_to(slots);
            self.ops.truncate(ops);
            self.dirty.truncate(dirty);
            for (g, pool) in self.groups.iter_mut().enumerate() {
                pool.rollback_to(self.marks[4 + g]);
            }
        }
        if auto {
            if r.is_ok() {
                self.finish_step();
            }
            self.clear_journals();
        }
        r
    }

    fn undo_seqs(&mut self, mark: usize) {
        while self.journal.len() > mark {
            match self.journal.pop().expect("length checked") {
                SeqUndo::Created { index, reused } => {
                    self.slab[index as usize].seq = None;
                    self.live -= 1;
                    if reused {
                        self.free_seqs.push(index);
                    } else {
                        self.slab.pop();
                    }
                }
                SeqUndo::Removed { index, seq } => {
                    let top = self.free_seqs.pop();
                    debug_assert_eq!(top, Some(index));
                    let e = &mut self.slab[index as usize];
                    e.generation = e.generation.wrapping_sub(1);
                    e.seq = Some(*seq);
                    self.live += 1;
                }
                SeqUndo::Header { index, old } => self.state_mut(index).hdr = old,
                SeqUndo::TablePush { index, group } => {
                    self.state_mut(index).tables[group as usize].blocks.pop();
                }
                SeqUndo::TableSet {
                    index,
                    group,
                    pos,
                    old,
                } => self.state_mut(index).tables[group as usize].blocks[pos as usize] = old,
                SeqUndo::TableRemoveFront { index, group, old } => {
                    let t = &mut self.state_mut(index).tables[group as usize];
                    t.blocks.insert(0, old);
                    t.offset -= 1;
                }
                SeqUndo::TokensAppended { index, old_len } => {
                    self.state_mut(index).tokens.truncate(old_len);
                }
                SeqUndo::TablePop { index, group, old } => {
                    self.state_mut(index).tables[group as usize]
                        .blocks
                        .push(old);
                }
                SeqUndo::TokensTruncated { index, removed } => {
                    self.state_mut(index).tokens.extend(removed);
                }
                SeqUndo::TokensSet { index, pos, old } => {
                    let t = &mut self.state_mut(index).tokens;
                    t[pos..pos + old.len()].copy_from_slice(&old);
                }
            }
        }
    }

    fn state_mut(&mut self, index: u32) -> &mut SeqState {
        self.slab[index as usize]
            .seq
            .as_mut()
            .expect("journaled sequence is live at undo")
    }
}
