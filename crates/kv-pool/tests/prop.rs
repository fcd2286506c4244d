//! Property tests: random schedules against a shadow storage.
//!
//! The harness plays the storage half: it applies the pool's `StorageOp`s and
//! writes every appended token id into the (block, offset) the tables say. If
//! the accounting ever hands one block to two writers, loses a copy-on-write,
//! serves a prefix hit from the wrong block or frees a block still in use, some
//! sequence reads back a wrong token id. Storage writes happen only after a
//! step commits (operations first, then tokens), as in the engine.

use std::collections::HashMap;

use proptest::prelude::*;
use weft_kv_pool::*;

const DOC_LEN: usize = 40;

/// Coverage counters: the test fails if a schedule family never happened, so
/// a strategy change cannot silently stop exercising a path.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    appends: usize,
    exhausted: usize,
    cow_copies: usize,
    window_releases: usize,
    prefix_hits: usize,
    evictions: usize,
    commits: usize,
    rollbacks: usize,
    fork_pending: usize,
    slot_exhausted: usize,
    slot_batches: usize,
}

static SEEN: std::sync::Mutex<Seen> = std::sync::Mutex::new(Seen {
    appends: 0,
    exhausted: 0,
    cow_copies: 0,
    window_releases: 0,
    prefix_hits: 0,
    evictions: 0,
    commits: 0,
    rollbacks: 0,
    fork_pending: 0,
    slot_exhausted: 0,
    slot_batches: 0,
});

fn seen(f: impl FnOnce(&mut Seen)) {
    f(&mut SEEN.lock().unwrap());
}
const VOCAB: u32 = 3;

#[derive(Debug, Clone)]
struct Cfg {
    block_size: u32,
    full: Option<u32>,
    sliding: Option<(u32, u32)>,
    slots: u32,
    key: Option<u64>,
}

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        salt: Option<u8>,
        doc: u8,
        len: u8,
        slot: bool,
    },
    Append {
        seq: u8,
        n: u8,
        diverge: bool,
        seed: u8,
    },
    Fork {
        seq: u8,
    },
    Release {
        seq: u8,
    },
    Lookup {
        salt: u8,
        doc: u8,
        len: u8,
    },
    SetPos {
        seq: u8,
        pos: u16,
    },
    Begin,
    Commit,
    Rollback,
    Slots {
        picks: Vec<u8>,
        keep: Vec<u8>,
        extract: u8,
    },
}

fn cfg_strategy() -> impl Strategy<Value = Cfg> {
    (
        prop_oneof![Just(1u32), Just(2), Just(4)],
        prop::option::weighted(0.85, 2u32..40),
        prop::option::of((1u32..12, 1u32..24)),
        0u32..4,
        prop::option::of(any::<u64>()),
    )
        .prop_map(|(block_size, full, sliding, slots, key)| Cfg {
            block_size,
            full: if full.is_none() && sliding.is_none() {
                Some(8)
            } else {
                full
            },
            sliding,
            slots,
            key,
        })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop::option::weighted(0.8, 0u8..3), 0u8..3, 0u8..24, prop::bool::weighted(0.25))
            .prop_map(|(salt, doc, len, slot)| Op::Alloc { salt, doc, len, slot }),
        8 => (any::<u8>(), 1u8..5, prop::bool::weighted(0.3), any::<u8>())
            .prop_map(|(seq, n, diverge, seed)| Op::Append { seq, n, diverge, seed }),
        2 => any::<u8>().prop_map(|seq| Op::Fork { seq }),
        4 => any::<u8>().prop_map(|seq| Op::Release { seq }),
        2 => (0u8..3, 0u8..3, 0u8..(DOC_LEN as u8)).prop_map(|(salt, doc, len)| Op::Lookup { salt, doc, len }),
        1 => (any::<u8>(), any::<u16>()).prop_map(|(seq, pos)| Op::SetPos { seq, pos }),
        2 => Just(Op::Begin),
        1 => Just(Op::Commit),
        1 => Just(Op::Rollback),
        1 => (prop::collection::vec(any::<u8>(), 0..6), prop::collection::vec(any::<u8>(), 0..6), any::<u8>())
            .prop_map(|(picks, keep, extract)| Op::Slots { picks, keep, extract }),
    ]
}

fn docs() -> Vec<Vec<u32>> {
    // Shared 8-token head so documents share prefixes; tiny vocabulary so equal
    // blocks recur at different positions (the chain must tell them apart).
    (0..3u32)
        .map(|d| {
            (0..DOC_LEN as u32)
                .map(|i| {
                    if i < 8 {
                        (i * 7) % VOCAB
                    } else {
                        (i * (d + 2) + d + i / 5) % VOCAB
                    }
                })
                .collect()
        })
        .collect()
}

fn state_of(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ u64::from(t) ^ 0x100).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[derive(Debug, Clone)]
struct TSeq {
    id: SeqId,
    salt: Option<Salt>,
    doc: usize,
    tokens: Vec<u32>,
    position: usize,
    slot: bool,
    /// Length before the first append of the open step.
    base: Option<usize>,
}

struct Write {
    seq: SeqId,
    group: usize,
    block: BlockId,
    offset: usize,
    token: u32,
}

struct Harness {
    pool: KvPool,
    cfg: Cfg,
    kinds: Vec<AttentionKind>,
    docs: Vec<Vec<u32>>,
    seqs: Vec<TSeq>,
    storage: Vec<HashMap<BlockId, Vec<Option<u32>>>>,
    slot_state: HashMap<SlotId, u64>,
    txn: Option<(PoolSnapshot, Vec<TSeq>)>,
    writes: Vec<Write>,
}

impl Harness {
    fn new(cfg: Cfg) -> Self {
        let mut g = KvGroups::new(cfg.block_size).state_slots(cfg.slots);
        if let Some(n) = cfg.full {
            g = g.full(n);
        }
        if let Some((w, n)) = cfg.sliding {
            g = g.sliding(w, n);
        }
        if let Some(k) = cfg.key {
            g = g.hash_key(k);
        }
        let kinds = g.groups.iter().map(|s| s.kind).collect::<Vec<_>>();
        let pool = KvPool::new(g).unwrap();
        Self {
            storage: vec![HashMap::new(); kinds.len()],
            pool,
            cfg,
            kinds,
            docs: docs(),
            seqs: Vec::new(),
            slot_state: HashMap::new(),
            txn: None,
            writes: Vec::new(),
        }
    }

    fn bs(&self) -> usize {
        self.cfg.block_size as usize
    }

    fn pick(&self, i: u8) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| i as usize % self.seqs.len())
    }

    /// Expected outcome of appending `n` tokens to `t`, computed from public
    /// state only.
    fn expect_append(&self, t: &TSeq, n: usize) -> Result<(), KvError> {
        let bs = self.bs();
        let len = t.tokens.len();
        let base = t.base.unwrap_or(len);
        for (g, kind) in self.kinds.iter().enumerate() {
            let table = self.pool.table(t.id, g).unwrap();
            let pool = self.pool.group(g).unwrap();
            let drop_to = match kind {
                AttentionKind::Full => 0,
                AttentionKind::SlidingWindow { window } => {
                    base.saturating_sub(*window as usize) / bs
                }
            };
            let n_drop = drop_to.saturating_sub(table.offset).min(table.blocks.len());
            let freed = table.blocks[..n_drop]
                .iter()
                .filter(|&&b| pool.refcount(b).unwrap() == 1)
                .count();
            // What the scheduler plans with: a step's first append releases
            // exactly `releasable_on_append` (the step's base is the length now).
            if self.txn.is_some() && t.base.is_none() {
                assert_eq!(
                    self.pool.releasable_on_append(t.id, g).unwrap(),
                    freed,
                    "releasable_on_append of group {g}"
                );
            }
            let cow = len % bs != 0
                && table
                    .blocks
                    .last()
                    .is_some_and(|&b| pool.refcount(b).unwrap() > 1);
            let needed = (len + n).div_ceil(bs) - len.div_ceil(bs) + usize::from(cow);
            let available = pool.available() + freed;
            if needed > available {
                return Err(KvError::PoolExhausted {
                    group: g,
                    needed,
                    available,
                });
            }
        }
        Ok(())
    }

    fn append(&mut self, i: usize, toks: Vec<u32>) -> Result<(), TestCaseError> {
        if toks.is_empty() {
            return Ok(());
        }
        let t = self.seqs[i].clone();
        let expected = self.expect_append(&t, toks.len());
        let before = self.pool.snapshot();
        let cached_before: usize = self.pool.stats().groups.iter().map(|g| g.cached).sum();
        let r = if t.salt.is_some() {
            self.pool.append_tokens(t.id, &toks)
        } else {
            self.pool.append(t.id, toks.len())
        };
        match (&r, &expected) {
            (Ok(a), Ok(())) => {
                let a = *a;
                let cached_after: usize = self.pool.stats().groups.iter().map(|g| g.cached).sum();
                seen(|s| {
                    s.appends += 1;
                    s.cow_copies += a.copies;
                    s.window_releases += a.released;
                    s.evictions += usize::from(cached_after < cached_before);
                });
            }
            (Err(e), Err(x)) => {
                seen(|s| s.exhausted += 1);
                prop_assert_eq!(e, x);
                prop_assert_eq!(self.pool.snapshot(), before, "failed append changed state");
                return Ok(());
            }
            _ => prop_assert!(
                false,
                "append {:?}: got {:?}, expected {:?}",
                toks.len(),
                r,
                expected
            ),
        }
        let len = t.tokens.len();
        let s = &mut self.seqs[i];
        if self.txn.is_some() && s.base.is_none() {
            s.base = Some(len);
        }
        s.tokens.extend_from_slice(&toks);
        s.position += toks.len();
        for g in 0..self.kinds.len() {
            let table = self.pool.table(t.id, g).unwrap();
            for (k, &token) in toks.iter().enumerate() {
                let (block, offset) = table.locate(len + k).expect("new token is mapped");
                self.writes.push(Write {
                    seq: t.id,
                    group: g,
                    block,
                    offset,
                    token,
                });
            }
        }
        if self.txn.is_none() {
            let ops = self.pool.take_ops();
            self.apply(ops, &[t.id]);
        }
        Ok(())
    }

    /// The storage half: operations first, then the step's token writes, then
    /// recurrent-state writes of the sequences that ran.
    fn apply(&mut self, ops: Vec<StorageOp>, ran: &[SeqId]) {
        let bs = self.bs();
        for op in ops {
            match op {
                StorageOp::CopyBlock { group, src, dst } => {
                    let c = self.storage[group]
                        .get(&src)
                        .cloned()
                        .unwrap_or_else(|| vec![None; bs]);
                    self.storage[group].insert(dst, c);
                }
                StorageOp::CopySlot { src, dst } => {
                    let v = self.slot_state.get(&src).copied();
                    match v {
                        Some(v) => self.slot_state.insert(dst, v),
                        None => self.slot_state.remove(&dst),
                    };
                }
                StorageOp::ResetSlot(s) => {
                    self.slot_state.insert(s, state_of(&[]));
                }
            }
        }
        let live: Vec<SeqId> = self.seqs.iter().map(|s| s.id).collect();
        for w in std::mem::take(&mut self.writes) {
            // A sequence released within the step is not in the forward pass.
            if live.contains(&w.seq) {
                self.storage[w.group]
                    .entry(w.block)
                    .or_insert_with(|| vec![None; bs])[w.offset] = Some(w.token);
            }
        }
        for id in ran {
            if let Some(t) = self.seqs.iter().find(|s| s.id == *id) {
                if let Some(slot) = self.pool.sequence(*id).unwrap().state_slot {
                    self.slot_state.insert(slot, state_of(&t.tokens));
                }
            }
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let pool = &self.pool;
        if let Err(e) = pool.check_invariants() {
            prop_assert!(false, "invariant: {}", e);
        }
        let stats = pool.stats();
        prop_assert_eq!(stats.sequences, self.seqs.len());
        for (g, gs) in stats.groups.iter().enumerate() {
            // No leak.
            prop_assert_eq!(gs.free + gs.cached + gs.used, gs.total);
            // Refcount == number of tables holding the block (independently of
            // the pool's own check).
            let mut held: HashMap<BlockId, u32> = HashMap::new();
            for t in &self.seqs {
                for &b in pool.table(t.id, g).unwrap().blocks {
                    *held.entry(b).or_default() += 1;
                }
            }
            let gp = pool.group(g).unwrap();
            for b in 0..gs.total as BlockId {
                prop_assert_eq!(
                    gp.refcount(b).unwrap(),
                    held.get(&b).copied().unwrap_or(0),
                    "group {} block {}",
                    g,
                    b
                );
            }
            prop_assert_eq!(held.len(), gs.used);
            // A block is indexed under at most one hash, hence one salt.
            let mut owner: HashMap<BlockId, Salt> = HashMap::new();
            for c in gp.cached_blocks() {
                prop_assert!(
                    owner.insert(c.block, c.salt).is_none(),
                    "block {} indexed twice",
                    c.block
                );
            }
        }
        prop_assert_eq!(stats.slots.free + stats.slots.used, stats.slots.total);
        prop_assert_eq!(
            stats.slots.used,
            self.seqs.iter().filter(|s| s.slot).count()
        );
        for t in &self.seqs {
            let info = pool.sequence(t.id).unwrap();
            prop_assert_eq!(info.len, t.tokens.len());
            prop_assert_eq!(info.position, t.position);
            prop_assert_eq!(info.state_slot.is_some(), t.slot);
            if t.salt.is_some() {
                prop_assert_eq!(pool.tokens(t.id).unwrap(), &t.tokens[..]);
            }
        }
        if self.txn.is_none() {
            self.check_contents()?;
            self.check_no_false_misses()?;
        }
        Ok(())
    }

    /// A sequence's own indexed leading blocks must be found by a lookup of its
    /// tokens (full-attention-only configurations, where the hit is exactly
    /// those blocks).
    fn check_no_false_misses(&self) -> Result<(), TestCaseError> {
        if self.kinds.iter().any(|k| *k != AttentionKind::Full) {
            return Ok(());
        }
        let bs = self.bs();
        for t in &self.seqs {
            let Some(salt) = t.salt else { continue };
            let table = self.pool.table(t.id, 0).unwrap();
            let gp = self.pool.group(0).unwrap();
            let k = table
                .blocks
                .iter()
                .take(t.tokens.len() / bs)
                .take_while(|&&b| gp.cached_entry(b).is_some_and(|e| e.salt == salt))
                .count();
            let hit = self.pool.lookup(salt, &t.tokens[..k * bs]);
            prop_assert_eq!(hit.tokens, k * bs);
            for (g, gh) in hit.groups.iter().enumerate() {
                prop_assert_eq!(
                    &gh.blocks[..],
                    &self.pool.table(t.id, g).unwrap().blocks[..k]
                );
            }
        }
        Ok(())
    }

    /// Every token a sequence can still attend to reads back from the shadow
    /// storage through its tables.
    fn check_contents(&self) -> Result<(), TestCaseError> {
        let bs = self.bs();
        for t in &self.seqs {
            let len = t.tokens.len();
            for (g, kind) in self.kinds.iter().enumerate() {
                let table = self.pool.table(t.id, g).unwrap();
                let needed_from = match kind {
                    AttentionKind::Full => 0,
                    AttentionKind::SlidingWindow { window } => len.saturating_sub(*window as usize),
                };
                for (i, &want) in t.tokens.iter().enumerate() {
                    match table.locate(i) {
                        Some((b, off)) => {
                            let got = self.storage[g].get(&b).and_then(|c| c[off]);
                            prop_assert_eq!(
                                got,
                                Some(want),
                                "seq {:?} group {} token {} block {}",
                                t.id,
                                g,
                                i,
                                b
                            );
                        }
                        None => {
                            prop_assert!(
                                i < needed_from,
                                "seq {:?} group {} lost token {}",
                                t.id,
                                g,
                                i
                            );
                            prop_assert!(i / bs < table.offset);
                        }
                    }
                }
            }
            if t.slot {
                let slot = self.pool.sequence(t.id).unwrap().state_slot.unwrap();
                prop_assert_eq!(
                    self.slot_state.get(&slot).copied(),
                    Some(state_of(&t.tokens))
                );
            }
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Alloc {
                salt,
                doc,
                len,
                slot,
            } => {
                let doc = *doc as usize;
                let tokens = self.docs[doc][..*len as usize].to_vec();
                let salt = salt.map(|s| Salt(u64::from(s)));
                let mut spec = SeqSpec::new(OwnerId(salt.map_or(9, |s| s.0 as u32)));
                spec.salt = salt;
                spec.state_slot = *slot;
                let expect_hit = match salt {
                    Some(s) if !slot => self.pool.lookup(s, &tokens).tokens,
                    _ => 0,
                };
                let before = self.pool.snapshot();
                let slot_short = *slot && self.pool.slots().free() == 0;
                let r = self.pool.allocate_with_prefix(spec, &tokens);
                if slot_short {
                    prop_assert_eq!(
                        r,
                        Err(KvError::SlotsExhausted {
                            needed: 1,
                            available: 0
                        })
                    );
                    prop_assert_eq!(self.pool.snapshot(), before);
                    return Ok(());
                }
                let (id, hit) = r.map_err(|e| TestCaseError::fail(format!("alloc: {e}")))?;
                prop_assert_eq!(hit, expect_hit);
                seen(|s| s.prefix_hits += usize::from(hit > 0));
                prop_assert_eq!(hit % self.bs(), 0);
                self.seqs.push(TSeq {
                    id,
                    salt,
                    doc,
                    tokens: tokens[..hit].to_vec(),
                    position: hit,
                    slot: *slot,
                    base: None,
                });
                if self.txn.is_none() {
                    let ops = self.pool.take_ops();
                    self.apply(ops, &[]);
                    // A hit's blocks already hold the prompt.
                    self.check_contents()?;
                }
                let i = self.seqs.len() - 1;
                self.append(i, tokens[hit..].to_vec())?;
            }
            Op::Append {
                seq,
                n,
                diverge,
                seed,
            } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let t = &self.seqs[i];
                let len = t.tokens.len();
                let toks: Vec<u32> = (0..*n as usize)
                    .map(|k| {
                        let doc = &self.docs[t.doc];
                        if !diverge && len + k < doc.len() {
                            doc[len + k]
                        } else {
                            (u32::from(*seed) + k as u32) % VOCAB
                        }
                    })
                    .collect();
                self.append(i, toks)?;
            }
            Op::Fork { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let t = self.seqs[i].clone();
                let before = self.pool.snapshot();
                let slot_short = t.slot && self.pool.slots().free() == 0;
                let r = self.pool.fork(t.id);
                if self.txn.is_some() && t.base.is_some() {
                    seen(|s| s.fork_pending += 1);
                    prop_assert_eq!(r, Err(KvError::ForkOfPendingSequence(t.id)));
                    prop_assert_eq!(self.pool.snapshot(), before);
                } else if slot_short {
                    seen(|s| s.slot_exhausted += 1);
                    prop_assert_eq!(
                        r,
                        Err(KvError::SlotsExhausted {
                            needed: 1,
                            available: 0
                        })
                    );
                    prop_assert_eq!(self.pool.snapshot(), before);
                } else {
                    let id = r.map_err(|e| TestCaseError::fail(format!("fork: {e}")))?;
                    self.seqs.push(TSeq {
                        id,
                        base: None,
                        ..t
                    });
                    if self.txn.is_none() {
                        let ops = self.pool.take_ops();
                        self.apply(ops, &[]);
                    }
                }
            }
            Op::Release { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let t = self.seqs.remove(i);
                self.pool
                    .release(t.id)
                    .map_err(|e| TestCaseError::fail(format!("release: {e}")))?;
                prop_assert_eq!(self.pool.release(t.id), Err(KvError::UnknownSequence(t.id)));
                prop_assert!(self.pool.table(t.id, 0).is_err() || self.kinds.is_empty());
            }
            Op::Lookup { salt, doc, len } => {
                let salt = Salt(u64::from(*salt));
                let tokens = &self.docs[*doc as usize][..*len as usize];
                let hit = self.pool.lookup(salt, tokens);
                let bs = self.bs();
                prop_assert_eq!(hit.tokens % bs, 0);
                prop_assert!(hit.tokens <= tokens.len());
                for (g, gh) in hit.groups.iter().enumerate() {
                    for (j, &b) in gh.blocks.iter().enumerate() {
                        let logical = gh.offset + j;
                        let e = self.pool.group(g).unwrap().cached_entry(b);
                        let e = e.ok_or_else(|| TestCaseError::fail("hit block not indexed"))?;
                        prop_assert_eq!(e.salt, salt, "hit across salts");
                        prop_assert_eq!(&e.tokens[..], &tokens[logical * bs..(logical + 1) * bs]);
                        // And the storage really holds those tokens.
                        let c = self.storage[g].get(&b).cloned().unwrap_or_default();
                        let want: Vec<Option<u32>> = e.tokens.iter().map(|&t| Some(t)).collect();
                        prop_assert_eq!(c, want);
                    }
                }
            }
            Op::SetPos { seq, pos } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                self.pool
                    .set_position(self.seqs[i].id, usize::from(*pos))
                    .map_err(|e| TestCaseError::fail(format!("set_position: {e}")))?;
                self.seqs[i].position = usize::from(*pos);
            }
            Op::Begin => {
                let r = self.pool.begin();
                if self.txn.is_some() {
                    prop_assert_eq!(r, Err(KvError::TransactionOpen));
                } else {
                    prop_assert_eq!(r, Ok(()));
                    self.txn = Some((self.pool.snapshot(), self.seqs.clone()));
                }
            }
            Op::Commit => {
                let r = self.pool.commit();
                match self.txn.take() {
                    None => prop_assert_eq!(r, Err(KvError::NoTransaction)),
                    Some(_) => {
                        let ops = r.map_err(|e| TestCaseError::fail(format!("commit: {e}")))?;
                        let ran: Vec<SeqId> = self
                            .seqs
                            .iter()
                            .filter(|s| s.base.is_some())
                            .map(|s| s.id)
                            .collect();
                        self.apply(ops, &ran);
                        seen(|s| s.commits += 1);
                        for s in &mut self.seqs {
                            s.base = None;
                        }
                    }
                }
            }
            Op::Rollback => {
                let r = self.pool.rollback();
                match self.txn.take() {
                    None => prop_assert_eq!(r, Err(KvError::NoTransaction)),
                    Some((snap, seqs)) => {
                        prop_assert_eq!(r, Ok(()));
                        prop_assert_eq!(self.pool.snapshot(), snap, "rollback is not exact");
                        seen(|s| s.rollbacks += 1);
                        self.seqs = seqs;
                        self.writes.clear();
                    }
                }
            }
            Op::Slots {
                picks,
                keep,
                extract,
            } => {
                let with: Vec<&TSeq> = self.seqs.iter().filter(|s| s.slot).collect();
                if with.is_empty() {
                    return Ok(());
                }
                let chosen: Vec<SeqId> = picks
                    .iter()
                    .map(|&p| with[p as usize % with.len()].id)
                    .collect();
                let mid = chosen.len() / 2;
                let mut a = self.pool.slot_batch(&chosen[..mid]).unwrap();
                let b = self.pool.slot_batch(&chosen[mid..]).unwrap();
                a.merge(b);
                let mut rows: Vec<SlotId> = chosen
                    .iter()
                    .map(|&id| self.pool.sequence(id).unwrap().state_slot.unwrap())
                    .collect();
                prop_assert_eq!(a.rows(), &rows[..]);
                seen(|s| s.slot_batches += 1);
                let mut k: Vec<usize> = Vec::new();
                for &x in keep {
                    if !rows.is_empty() {
                        let r = x as usize % rows.len();
                        if !k.contains(&r) {
                            k.push(r);
                        }
                    }
                }
                a.filter(&k).unwrap();
                rows = k.iter().map(|&r| rows[r]).collect();
                prop_assert_eq!(a.rows(), &rows[..]);
                if !rows.is_empty() {
                    let r = *extract as usize % rows.len();
                    prop_assert_eq!(a.extract(r), Ok(rows.remove(r)));
                    prop_assert_eq!(a.rows(), &rows[..]);
                }
                let with_ids: Vec<SeqId> =
                    self.seqs.iter().filter(|s| !s.slot).map(|s| s.id).collect();
                if let Some(&id) = with_ids.first() {
                    prop_assert_eq!(self.pool.slot_batch(&[id]), Err(KvError::NoStateSlot(id)));
                }
            }
        }
        Ok(())
    }
}

fn run(cfg: Cfg, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut h = Harness::new(cfg);
    h.check()?;
    for op in &ops {
        h.step(op)?;
        h.check()?;
    }
    if h.txn.is_some() {
        h.step(&Op::Commit)?;
        h.check()?;
    }
    for t in std::mem::take(&mut h.seqs) {
        h.pool.release(t.id).unwrap();
    }
    h.check()?;
    let st = h.pool.stats();
    for g in st.groups {
        prop_assert_eq!(g.used, 0);
        prop_assert_eq!(g.free + g.cached, g.total);
    }
    prop_assert_eq!(st.slots.used, 0);
    Ok(())
}

#[test]
fn random_schedules() {
    // PROPTEST_CASES overrides the default for longer soak runs.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    let strategy = (cfg_strategy(), prop::collection::vec(op_strategy(), 1..90));
    if let Err(e) = runner.run(&strategy, |(cfg, ops)| run(cfg, ops)) {
        panic!("{e}");
    }
    let s = *SEEN.lock().unwrap();
    eprintln!("coverage: {s:?}");
    for (name, n) in [
        ("appends", s.appends),
        ("exhausted", s.exhausted),
        ("cow copies", s.cow_copies),
        ("window releases", s.window_releases),
        ("prefix hits", s.prefix_hits),
        ("evictions", s.evictions),
        ("commits", s.commits),
        ("rollbacks", s.rollbacks),
        ("fork of pending", s.fork_pending),
        ("slot exhaustion", s.slot_exhausted),
        ("slot batches", s.slot_batches),
    ] {
        assert!(n > 0, "no {name} in any schedule: {s:?}");
    }
}
