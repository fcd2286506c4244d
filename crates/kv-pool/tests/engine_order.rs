//! Property test of the pool in the order the engine drives it.
//!
//! An engine step is: `begin`, appends (new rows are admitted with a
//! tenant-salted prefix lookup), the step's storage operations applied, the
//! forward pass writing every appended token into the slots the tables name,
//! rejected draft tokens truncated, and only then `commit` — or, if anything
//! failed after the writes, `rollback_after_writes`. Rows finish (release)
//! between steps.
//!
//! The harness is the storage: a map from (block, offset) to the token id
//! written there. After every step each live row must read back exactly its
//! committed tokens through its table, and a prefix hit must read back the
//! tokens it claims to cover. That fails if a write lands in a block another
//! row (or a cached prefix) still uses, if a rolled-back step leaves a cache
//! entry for a block it overwrote, if a truncation leaks or drops a block, or
//! if one tenant is served another's blocks.

use std::collections::HashMap;

use proptest::prelude::*;
use weft_kv_pool::*;

const TENANTS: u8 = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Admit a row of `tenant` following document `doc`, with a prompt of `len` tokens.
    Admit { tenant: u8, doc: u8, len: u8 },
    /// One step: each running row (by index) appends 1 + draft tokens, keeps
    /// `keep` of them, and the step commits unless `fail`.
    Step { rows: Vec<(u8, u8, u8)>, fail: bool },
    /// A row finishes.
    Finish { row: u8 },
    /// A row forks (copy-on-write of its partial last block on the next write).
    Fork { row: u8 },
}

fn doc(d: u8) -> Vec<u32> {
    // Documents 0..4 share their first 12 tokens pairwise, so hits happen
    // across requests; the tenant salt must still keep tenants apart.
    (0..200u32)
        .map(|i| {
            if i < 12 {
                (d as u32 / 2) * 1000 + i
            } else {
                d as u32 * 1000 + i
            }
        })
        .collect()
}

struct Row {
    seq: SeqId,
    tenant: u8,
    doc: Vec<u32>,
    /// Committed tokens (what the row must read back).
    len: usize,
}

struct Harness {
    pool: KvPool,
    store: HashMap<(BlockId, usize), u32>,
    rows: Vec<Row>,
    hits: usize,
    evictions_forgotten: usize,
}

impl Harness {
    fn read(&self, seq: SeqId, n: usize) -> Vec<Option<u32>> {
        let t = self.pool.table(seq, 0).expect("live");
        (0..n)
            .map(|i| {
                t.locate(i)
                    .and_then(|(b, o)| self.store.get(&(b, o)).copied())
            })
            .collect()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.pool.check_invariants().map_err(TestCaseError::fail)?;
        let mut owner: HashMap<BlockId, u8> = HashMap::new();
        for r in &self.rows {
            let got = self.read(r.seq, r.len);
            let want: Vec<Option<u32>> = r.doc[..r.len].iter().map(|&t| Some(t)).collect();
            prop_assert_eq!(got, want, "row of tenant {} reads wrong KV", r.tenant);
            prop_assert_eq!(self.pool.sequence(r.seq).unwrap().len, r.len);
            for &b in self.pool.table(r.seq, 0).unwrap().blocks {
                let o = *owner.entry(b).or_insert(r.tenant);
                prop_assert_eq!(o, r.tenant, "block {} shared across tenants", b);
            }
        }
        Ok(())
    }

    fn admit(&mut self, tenant: u8, d: u8, len: usize) -> Result<(), TestCaseError> {
        let doc = doc(d);
        let spec = SeqSpec::new(OwnerId(tenant as u32)).salted(Salt(tenant as u64 + 1));
        // The engine offers all but the last prompt token: the forward must
        // compute at least the last one.
        let Ok((seq, hit)) = self.pool.allocate_with_prefix(spec, &doc[..len - 1]) else {
            return Ok(());
        };
        if hit > 0 {
            self.hits += 1;
            let got = self.read(seq, hit);
            let want: Vec<Option<u32>> = doc[..hit].iter().map(|&t| Some(t)).collect();
            prop_assert_eq!(got, want, "prefix hit of {} tokens reads wrong KV", hit);
        }
        self.rows.push(Row {
            seq,
            tenant,
            doc,
            len: hit,
        });
        Ok(())
    }

    fn step(&mut self, picks: &[(u8, u8, u8)], fail: bool) -> Result<(), TestCaseError> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let cached_at_begin = self.pool.stats().groups[0].cached;
        self.pool.begin().unwrap();
        let mut planned: Vec<(usize, usize, usize)> = Vec::new(); // (row, fed, kept)
        for &(r, draft, keep) in picks {
            let i = r as usize % self.rows.len();
            if planned.iter().any(|p| p.0 == i) {
                continue;
            }
            let row = &self.rows[i];
            let n = (1 + draft as usize % 4).min(row.doc.len() - row.len);
            if n == 0 {
                continue;
            }
            let toks = &row.doc[row.len..row.len + n];
            match self.pool.append_tokens(row.seq, toks) {
                Ok(_) => planned.push((i, n, 1 + keep as usize % n)),
                Err(KvError::PoolExhausted { .. }) => {}
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
        }
        // Storage operations of this step, then the forward's writes.
        for op in self.pool.step_ops().to_vec() {
            if let StorageOp::CopyBlock { src, dst, .. } = op {
                for o in 0..self.pool.block_size() {
                    match self.store.get(&(src, o)).copied() {
                        Some(t) => self.store.insert((dst, o), t),
                        None => self.store.remove(&(dst, o)),
                    };
                }
            }
        }
        for &(i, n, _) in &planned {
            let row = &self.rows[i];
            let t = self.pool.table(row.seq, 0).unwrap();
            for j in 0..n {
                let (b, o) = t.locate(row.len + j).expect("appended slot is held");
                self.store.insert((b, o), row.doc[row.len + j]);
            }
        }
        for &(i, _, kept) in &planned {
            let row = &self.rows[i];
            self.pool.truncate(row.seq, row.len + kept).unwrap();
        }
        if fail {
            self.pool.rollback_after_writes().unwrap();
            // Cached blocks the step evicted and wrote are not cached again.
            let after = self.pool.stats().groups[0].cached;
            self.evictions_forgotten += cached_at_begin.saturating_sub(after);
        } else {
            self.pool.commit().unwrap();
            for &(i, _, kept) in &planned {
                self.rows[i].len += kept;
            }
        }
        Ok(())
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..TENANTS, 0u8..4, 2u8..40).prop_map(|(tenant, doc, len)| Op::Admit { tenant, doc, len }),
        6 => (prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>()), 1..6), prop::bool::weighted(0.25))
            .prop_map(|(rows, fail)| Op::Step { rows, fail }),
        2 => any::<u8>().prop_map(|row| Op::Finish { row }),
        1 => any::<u8>().prop_map(|row| Op::Fork { row }),
    ]
}

fn run(block_size: u32, blocks: u32, ops: &[Op]) -> Result<(usize, usize), TestCaseError> {
    let mut h = Harness {
        pool: KvPool::new(KvGroups::new(block_size).full(blocks).hash_key(7)).unwrap(),
        store: HashMap::new(),
        rows: Vec::new(),
        hits: 0,
        evictions_forgotten: 0,
    };
    for op in ops {
        match op {
            Op::Admit { tenant, doc, len } => h.admit(*tenant, *doc, *len as usize)?,
            Op::Step { rows, fail } => h.step(rows, *fail)?,
            Op::Finish { row } => {
                if !h.rows.is_empty() {
                    let r = h.rows.remove(*row as usize % h.rows.len());
                    h.pool.release(r.seq).unwrap();
                }
            }
            Op::Fork { row } => {
                if !h.rows.is_empty() {
                    let i = *row as usize % h.rows.len();
                    if let Ok(seq) = h.pool.fork(h.rows[i].seq) {
                        let r = &h.rows[i];
                        let (tenant, doc, len) = (r.tenant, r.doc.clone(), r.len);
                        h.rows.push(Row {
                            seq,
                            tenant,
                            doc,
                            len,
                        });
                    }
                }
            }
        }
        h.check()?;
    }
    for r in h.rows.drain(..) {
        h.pool.release(r.seq).unwrap();
    }
    let s = h.pool.stats().groups[0];
    prop_assert_eq!(s.used, 0, "blocks still held after every row finished");
    Ok((h.hits, h.evictions_forgotten))
}

#[test]
fn engine_order_schedules() {
    let hits = std::cell::Cell::new(0);
    let forgotten = std::cell::Cell::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 400,
        ..ProptestConfig::default()
    });
    let strategy = (
        prop_oneof![Just(2u32), Just(4), Just(8)],
        6u32..40,
        prop::collection::vec(op(), 1..80),
    );
    runner
        .run(&strategy, |(bs, blocks, ops)| {
            let (h, f) = run(bs, blocks, &ops)?;
            hits.set(hits.get() + h);
            forgotten.set(forgotten.get() + f);
            Ok(())
        })
        .unwrap();
    // The schedules must reach the paths this test exists for.
    let (hits, forgotten) = (hits.get(), forgotten.get());
    assert!(hits > 50, "only {hits} prefix hits");
    assert!(
        forgotten > 5,
        "rolled-back evictions seen {forgotten} times"
    );
}

#[test]
fn truncate_is_staged_and_bounded() {
    let mut pool = KvPool::new(KvGroups::new(4).full(16)).unwrap();
    let seq = pool.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    pool.append(seq, 5).unwrap();
    // Outside a step nothing can be taken back.
    assert!(matches!(
        pool.truncate(seq, 4),
        Err(KvError::BadTruncate { .. })
    ));
    pool.begin().unwrap();
    pool.append(seq, 6).unwrap();
    assert_eq!(pool.table(seq, 0).unwrap().blocks.len(), 3);
    // Not below what the step started from.
    assert!(matches!(
        pool.truncate(seq, 4),
        Err(KvError::BadTruncate { floor: 5, .. })
    ));
    pool.truncate(seq, 6).unwrap();
    assert_eq!(pool.sequence(seq).unwrap().len, 6);
    assert_eq!(pool.sequence(seq).unwrap().position, 6);
    assert_eq!(pool.table(seq, 0).unwrap().blocks.len(), 2);
    assert_eq!(pool.stats().groups[0].used, 2);
    pool.rollback().unwrap();
    assert_eq!(pool.sequence(seq).unwrap().len, 5);
    assert_eq!(pool.table(seq, 0).unwrap().blocks.len(), 2);
    pool.check_invariants().unwrap();
    pool.begin().unwrap();
    pool.append(seq, 6).unwrap();
    pool.truncate(seq, 7).unwrap();
    pool.commit().unwrap();
    assert_eq!(pool.sequence(seq).unwrap().len, 7);
    assert_eq!(pool.stats().groups[0].used, 2);
    pool.check_invariants().unwrap();
}
