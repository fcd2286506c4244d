//! One block id space: reference counts, the free list, the LRU list of cached
//! blocks and the prefix-cache index.

use std::collections::HashMap;

use crate::hash::{BlockHash, IdBuild, Salt};
use crate::layout::{check_block_size, KvLayout, MAX_BLOCKS};
use crate::{GroupId, KvError};

/// Index of a block in a group's storage tensors (the same row in every layer
/// of the group).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Which list, if any, a block is on. A block is on exactly one of the two
/// lists iff its reference count is zero, which is what makes the no-leak
/// invariant (`free + cached + used == total`) checkable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Free,
    Cached,
    Used,
}

/// Per-block bookkeeping. The list links live here (an intrusive doubly linked
/// list over the `Vec`), so taking a cached block out of the middle of the LRU
/// list on a prefix hit is O(1) without a separate index.
#[derive(Debug, Clone, Copy)]
struct Meta {
    refcount: u32,
    prev: u32,
    next: u32,
    place: Place,
    hash: Option<BlockHash>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct List {
    head: u32,
    tail: u32,
    len: u32,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// What the prefix-cache index keeps per full block. The tokens, salt and
/// parent are kept to verify every hit exactly: a hash collision can then at
/// worst cost a miss, never hand back KV computed for other tokens or another
/// tenant.
#[derive(Debug, Clone)]
struct CacheEntry {
    block: BlockId,
    salt: Salt,
    parent: BlockHash,
    tokens: Box<[u32]>,
}

/// Undo record. Block metadata and list heads are restored from before-images,
/// which restores list *order* exactly, not just membership.
#[derive(Debug, Clone)]
enum Undo {
    Meta(BlockId, Meta),
    FreeList(List),
    CachedList(List),
    CacheInserted(BlockHash),
    CacheRemoved(BlockHash, CacheEntry),
}

/// Block counts for metrics and admission control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockStats {
    /// Blocks in the group.
    pub total: usize,
    /// Unreferenced blocks with no cached contents.
    pub free: usize,
    /// Unreferenced blocks whose contents are in the prefix cache (evictable).
    pub cached: usize,
    /// Blocks referenced by at least one table.
    pub used: usize,
}

/// A prefix-cache entry as seen from outside, for audits and tests.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CachedBlock {
    /// Chain hash the block is filed under.
    pub hash: BlockHash,
    /// The block.
    pub block: BlockId,
    /// Isolation domain it was registered under.
    pub salt: Salt,
    /// Hash of the previous block in the chain.
    pub parent: BlockHash,
    /// Token ids the block holds.
    pub tokens: Vec<u32>,
}

/// Exact accounting state of one [`BlockPool`], comparable with `==`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPoolSnapshot {
    /// Reference count per block.
    pub refcounts: Vec<u32>,
    /// Free list, next block to hand out first.
    pub free_order: Vec<BlockId>,
    /// Cached list, least recently used (next to evict) first.
    pub cached_order: Vec<BlockId>,
    /// Prefix-cache index, sorted by hash.
    pub cache: Vec<CachedBlock>,
}

/// Fixed-size block allocator for one group of layers, with a prefix cache.
///
/// Blocks are `u32` indices into storage that lives elsewhere (the MLX half).
/// Unreferenced blocks sit on one of two lists:
///
/// * the free list (no useful contents), handed out first, LIFO so recently
///   touched storage is reused first;
/// * the cached list (full blocks still indexed by the prefix cache), in LRU
///   order, evicted from the front only when the free list is empty, so cached
///   prefixes survive as long as memory allows.
///
/// Both lists are intrusive over the block metadata, so alloc, free, hit and
/// evict are O(1).
#[derive(Debug, Clone)]
pub struct BlockPool {
    group: GroupId,
    block_size: u32,
    meta: Vec<Meta>,
    free: List,
    cached: List,
    cache: HashMap<BlockHash, CacheEntry, IdBuild>,
    journal: Vec<Undo>,
    journaling: bool,
    /// Cached blocks handed out (evicted) since the journal was last cleared:
    /// if the step that took them rolls back after its forward pass wrote
    /// them, their cache entries must not come back ([`Self::forget_evicted`]).
    evicted: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn with_blocks(num_blocks: u32, block_size: u32) -> Result<Self, KvError> {
        Self::new_in_group(0, num_blocks, block_size)
    }

    /// A pool sized to fit `budget_bytes` of storage laid out as `layout`.
    pub fn with_budget(layout: KvLayout, budget_bytes: u64) -> Result<Self, KvError> {
        Self::with_blocks(layout.blocks_for_budget(budget_bytes)?, layout.block_size)
    }

    pub(crate) fn new_in_group(
        group: GroupId,
        num_blocks: u32,
        block_size: u32,
    ) -> Result<Self, KvError> {
        check_block_size(block_size)?;
        if num_blocks > MAX_BLOCKS {
            return Err(KvError::InvalidConfig("too many blocks in a group"));
        }
        let meta = (0..num_blocks)
            .map(|b| Meta {
                refcount: 0,
                prev: if b == 0 { NIL } else { b - 1 },
                next: if b + 1 == num_blocks { NIL } else { b + 1 },
                place: Place::Free,
                hash: None,
            })
            .collect();
        let free = if num_blocks == 0 {
            EMPTY
        } else {
            List {
                head: 0,
                tail: num_blocks - 1,
                len: num_blocks,
            }
        };
        Ok(Self {
            group,
            block_size,
            meta,
            free,
            cached: EMPTY,
            cache: HashMap::default(),
            journal: Vec::new(),
            journaling: false,
            evicted: Vec::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks an allocation can get right now: free plus evictable cached.
    pub fn available(&self) -> usize {
        (self.free.len + self.cached.len) as usize
    }

    /// Counts for metrics; O(1).
    pub fn stats(&self) -> BlockStats {
        let free = self.free.len as usize;
        let cached = self.cached.len as usize;
        BlockStats {
            total: self.meta.len(),
            free,
            cached,
            used: self.meta.len() - free - cached,
        }
    }

    /// References held on `block` (0 for free and cached blocks).
    pub fn refcount(&self, block: BlockId) -> Result<u32, KvError> {
        Ok(self.meta_of(block)?.refcount)
    }

    /// Takes one block: a free one if any, else evicts the least recently used
    /// cached block (dropping its prefix-cache entry). The block comes back with
    /// one reference.
    pub fn alloc(&mut self) -> Result<BlockId, KvError> {
        let b = if self.free.head != NIL {
            self.free.head
        } else if self.cached.head != NIL {
            let b = self.cached.head;
            if self.journaling {
                self.evicted.push(b);
            }
            let hash = self.meta[b as usize]
                .hash
                .expect("cached blocks are indexed");
            self.remove_entry(hash);
            b
        } else {
            return Err(KvError::PoolExhausted {
                group: self.group,
                needed: 1,
                available: 0,
            });
        };
        self.unlink(b);
        self.set_meta(
            b,
            Meta {
                refcount: 1,
                prev: NIL,
                next: NIL,
                place: Place::Used,
                hash: None,
            },
        );
        Ok(b)
    }

    /// Adds a reference to a block that is in use, or revives a cached block
    /// (a prefix hit): it leaves the LRU list and keeps its cache entry.
    pub fn retain(&mut self, block: BlockId) -> Result<(), KvError> {
        let mut m = *self.meta_of(block)?;
        match m.place {
            Place::Used => m.refcount += 1,
            Place::Cached => {
                self.unlink(block);
                m = self.meta[block as usize];
                m.place = Place::Used;
                m.refcount = 1;
                m.prev = NIL;
                m.next = NIL;
            }
            Place::Free => {
                return Err(KvError::NotAllocated {
                    group: self.group,
                    block,
                })
            }
        }
        self.set_meta(block, m);
        Ok(())
    }

    /// Drops one reference. At zero, a block indexed by the prefix cache goes to
    /// the most-recently-used end of the cached list; any other block goes to the
    /// free list.
    pub fn release(&mut self, block: BlockId) -> Result<(), KvError> {
        let mut m = *self.meta_of(block)?;
        if m.refcount == 0 {
            return Err(KvError::DoubleFree {
                group: self.group,
                block,
            });
        }
        m.refcount -= 1;
        self.set_meta(block, m);
        if m.refcount == 0 {
            if m.hash.is_some() {
                self.push_back_cached(block);
            } else {
                self.push_front_free(block);
            }
        }
        Ok(())
    }

    /// Files a full, referenced block in the prefix cache under `hash`.
    ///
    /// Returns `false` (and changes nothing) when another block already holds
    /// that hash — two sequences computed the same prefix concurrently; the
    /// first one wins and the duplicate is freed normally later — or when the
    /// block is already indexed.
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        salt: Salt,
        parent: BlockHash,
        tokens: &[u32],
    ) -> Result<bool, KvError> {
        let m = *self.meta_of(block)?;
        if m.place != Place::Used {
            return Err(KvError::NotAllocated {
                group: self.group,
                block,
            });
        }
        if m.hash.is_some() || self.cache.contains_key(&hash) {
            return Ok(false);
        }
        self.cache.insert(
            hash,
            CacheEntry {
                block,
                salt,
                parent,
                tokens: tokens.into(),
            },
        );
        if self.journaling {
            self.journal.push(Undo::CacheInserted(hash));
        }
        self.set_meta(
            block,
            Meta {
                hash: Some(hash),
                ..m
            },
        );
        Ok(true)
    }

    /// The block filed under `hash`, if its entry matches exactly.
    pub fn lookup(
        &self,
        hash: BlockHash,
        salt: Salt,
        parent: BlockHash,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let e = self.cache.get(&hash)?;
        (e.salt == salt && e.parent == parent && *e.tokens == *tokens).then_some(e.block)
    }

    /// The prefix-cache entry of a block, if it has one.
    pub fn cached_entry(&self, block: BlockId) -> Option<CachedBlock> {
        let hash = self.meta.get(block as usize)?.hash?;
        let e = &self.cache[&hash];
        Some(CachedBlock {
            hash,
            block: e.block,
            salt: e.salt,
            parent: e.parent,
            tokens: e.tokens.to_vec(),
        })
    }

    /// Opens a transaction on this pool alone (a [`crate::KvPool`] manages its
    /// groups' journals itself).
    pub fn begin(&mut self) -> Result<(), KvError> {
        if self.journaling {
            return Err(KvError::TransactionOpen);
        }
        self.journaling = true;
        Ok(())
    }

    /// Keeps the changes since [`begin`](Self::begin).
    pub fn commit(&mut self) -> Result<(), KvError> {
        if !self.journaling {
            return Err(KvError::NoTransaction);
        }
        self.journal.clear();
        self.journaling = false;
        Ok(())
    }

    /// Undoes every change since [`begin`](Self::begin), list order included.
    pub fn rollback(&mut self) -> Result<(), KvError> {
        if !self.journaling {
            return Err(KvError::NoTransaction);
        }
        self.rollback_to(0);
        self.journaling = false;
        Ok(())
    }

    pub(crate) fn set_journaling(&mut self, on: bool) {
        self.journaling = on;
    }

    pub(crate) fn journal_len(&self) -> usize {
        self.journal.len()
    }

    pub(crate) fn clear_journal(&mut self) {
        self.journal.clear();
        self.evicted.clear();
    }

    /// Forgets the undo records and evictions before the marks (an older step
    /// committed while a younger one stays open).
    pub(crate) fn drain_journal(&mut self, journal: usize, evicted: usize) {
        self.journal.drain(..journal.min(self.journal.len()));
        self.evicted.drain(..evicted.min(self.evicted.len()));
    }

    pub(crate) fn evicted_len(&self) -> usize {
        self.evicted.len()
    }

    /// [`Self::forget_evicted`] for the blocks evicted since `mark`, by a
    /// younger step undone while an older one stays open: the changes are
    /// journaled into the older step and the blocks stay listed as evicted,
    /// so undoing the older step forgets them as well.
    pub(crate) fn forget_evicted_since(&mut self, mark: usize) {
        let blocks: Vec<BlockId> = self.evicted[mark.min(self.evicted.len())..].to_vec();
        for b in blocks {
            let m = self.meta[b as usize];
            if m.place != Place::Cached {
                continue;
            }
            if let Some(h) = m.hash {
                self.remove_entry(h);
            }
            self.unlink(b);
            let m = self.meta[b as usize];
            self.set_meta(b, Meta { hash: None, ..m });
            self.push_front_free(b);
        }
    }

    /// Drops the evictions listed since `mark` (their step was undone before
    /// anything was written).
    pub(crate) fn truncate_evicted(&mut self, mark: usize) {
        self.evicted.truncate(mark);
    }

    /// After a rollback: blocks the undone work had evicted from the prefix
    /// cache are back on the cached list with their entries, but a forward
    /// pass may have overwritten their contents since. They become free
    /// blocks instead (their entries dropped), so no later hit can read them.
    pub(crate) fn forget_evicted(&mut self) {
        let journaling = std::mem::replace(&mut self.journaling, false);
        for b in std::mem::take(&mut self.evicted) {
            let m = self.meta[b as usize];
            if m.place != Place::Cached {
                continue;
            }
            if let Some(h) = m.hash {
                self.cache.remove(&h);
            }
            self.unlink(b);
            self.meta[b as usize].hash = None;
            self.push_front_free(b);
        }
        self.journaling = journaling;
    }

    pub(crate) fn rollback_to(&mut self, mark: usize) {
        while self.journal.len() > mark {
            match self.journal.pop().expect("length checked") {
                Undo::Meta(b, m) => self.meta[b as usize] = m,
                Undo::FreeList(l) => self.free = l,
                Undo::CachedList(l) => self.cached = l,
                Undo::CacheInserted(h) => {
                    self.cache.remove(&h);
                }
                Undo::CacheRemoved(h, e) => {
                    self.cache.insert(h, e);
                }
            }
        }
    }

    /// Exact state, for tests of rollback and atomicity.
    pub fn snapshot(&self) -> BlockPoolSnapshot {
        let mut cache: Vec<CachedBlock> = self
            .cache
            .iter()
            .map(|(h, e)| CachedBlock {
                hash: *h,
                block: e.block,
                salt: e.salt,
                parent: e.parent,
                tokens: e.tokens.to_vec(),
            })
            .collect();
        cache.sort();
        BlockPoolSnapshot {
            refcounts: self.meta.iter().map(|m| m.refcount).collect(),
            free_order: self.walk(self.free),
            cached_order: self.walk(self.cached),
            cache,
        }
    }

    /// Every prefix-cache entry, sorted by hash.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.snapshot().cache
    }

    /// Verifies the internal invariants (list structure, places, refcounts vs
    /// lists, cache index vs metadata). O(blocks); for tests and debug audits.
    pub fn check_invariants(&self) -> Result<(), String> {
        let g = self.group;
        let mut seen = vec![false; self.meta.len()];
        for (list, place) in [(self.free, Place::Free), (self.cached, Place::Cached)] {
            let mut prev = NIL;
            let mut cur = list.head;
            let mut n = 0u32;
            while cur != NIL {
                let m = self.meta.get(cur as usize).ok_or_else(|| {
                    format!("group {g}: list links to block {cur} outside the pool")
                })?;
                if seen[cur as usize] {
                    return Err(format!("group {g}: block {cur} is on a list twice"));
                }
                seen[cur as usize] = true;
                if m.place != place || m.prev != prev || m.refcount != 0 {
                    return Err(format!(
                        "group {g}: block {cur} has bad list metadata {m:?}"
                    ));
                }
                if (place == Place::Cached) != m.hash.is_some() {
                    return Err(format!(
                        "group {g}: block {cur} on {place:?} list with hash {:?}",
                        m.hash
                    ));
                }
                prev = cur;
                cur = m.next;
                n += 1;
            }
            if prev != list.tail || n != list.len {
                return Err(format!("group {g}: {place:?} list tail/len mismatch"));
            }
        }
        for (b, m) in self.meta.iter().enumerate() {
            if !seen[b] && (m.place != Place::Used || m.refcount == 0) {
                return Err(format!(
                    "group {g}: block {b} is neither listed nor referenced: {m:?}"
                ));
            }
            if let Some(h) = m.hash {
                match self.cache.get(&h) {
                    Some(e) if e.block as usize == b => {}
                    _ => {
                        return Err(format!(
                            "group {g}: block {b} claims hash {h:#x} it does not own"
                        ))
                    }
                }
            }
        }
        for (h, e) in &self.cache {
            if self.meta.get(e.block as usize).and_then(|m| m.hash) != Some(*h) {
                return Err(format!(
                    "group {g}: cache entry {h:#x} points at block {} which disowns it",
                    e.block
                ));
            }
            if e.tokens.len() != self.block_size as usize {
                return Err(format!("group {g}: cache entry {h:#x} is not a full block"));
            }
        }
        Ok(())
    }

    fn walk(&self, list: List) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(list.len as usize);
        let mut cur = list.head;
        while cur != NIL {
            out.push(cur);
            cur = self.meta[cur as usize].next;
        }
        out
    }

    fn meta_of(&self, block: BlockId) -> Result<&Meta, KvError> {
        self.meta.get(block as usize).ok_or(KvError::NotAllocated {
            group: self.group,
            block,
        })
    }

    fn remove_entry(&mut self, hash: BlockHash) {
        let e = self.cache.remove(&hash).expect("indexed hash");
        if self.journaling {
            self.journal.push(Undo::CacheRemoved(hash, e));
        }
    }

    #[inline]
    fn set_meta(&mut self, b: BlockId, m: Meta) {
        if self.journaling {
            self.journal.push(Undo::Meta(b, self.meta[b as usize]));
        }
        self.meta[b as usize] = m;
    }

    #[inline]
    fn set_list(&mut self, place: Place, l: List) {
        match place {
            Place::Free => {
                if self.journaling {
                    self.journal.push(Undo::FreeList(self.free));
                }
                self.free = l;
            }
            Place::Cached => {
                if self.journaling {
                    self.journal.push(Undo::CachedList(self.cached));
                }
                self.cached = l;
            }
            Place::Used => unreachable!("used blocks are on no list"),
        }
    }

    fn list(&self, place: Place) -> List {
        match place {
            Place::Free => self.free,
            Place::Cached => self.cached,
            Place::Used => unreachable!("used blocks are on no list"),
        }
    }

    /// Takes `b` off its list; the caller rewrites `b`'s own metadata.
    fn unlink(&mut self, b: BlockId) {
        let m = self.meta[b as usize];
        let mut l = self.list(m.place);
        if m.prev == NIL {
            l.head = m.next;
        } else {
            let mut p = self.meta[m.prev as usize];
            p.next = m.next;
            self.set_meta(m.prev, p);
        }
        if m.next == NIL {
            l.tail = m.prev;
        } else {
            let mut n = self.meta[m.next as usize];
            n.prev = m.prev;
            self.set_meta(m.next, n);
        }
        l.len -= 1;
        self.set_list(m.place, l);
    }

    fn push_front_free(&mut self, b: BlockId) {
        let mut l = self.free;
        let mut m = self.meta[b as usize];
        m.place = Place::Free;
        m.prev = NIL;
        m.next = l.head;
        if l.head == NIL {
            l.tail = b;
        } else {
            let mut h = self.meta[l.head as usize];
            h.prev = b;
            self.set_meta(l.head, h);
        }
        l.head = b;
        l.len += 1;
        self.set_meta(b, m);
        self.set_list(Place::Free, l);
    }

    fn push_back_cached(&mut self, b: BlockId) {
        let mut l = self.cached;
        let mut m = self.meta[b as usize];
        m.place = Place::Cached;
        m.next = NIL;
        m.prev = l.tail;
        if l.tail == NIL {
            l.head = b;
        } else {
            let mut t = self.meta[l.tail as usize];
            t.next = b;
            self.set_meta(l.tail, t);
        }
        l.tail = b;
        l.len += 1;
        self.set_meta(b, m);
        self.set_list(Place::Cached, l);
    }
}
