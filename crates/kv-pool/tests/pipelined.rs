//! Two open steps, as a pipelined engine drives the pool: step A is open (its
//! forward computing) when step B opens on top of it, appending for each row
//! that keeps decoding a placeholder for the token A will pick. Then A commits,
//! the placeholders get their real ids (`set_tokens`), and B commits — or B, or
//! both, roll back.
//!
//! Every property compares against the one-step-at-a-time order the pool
//! already guarantees, by exact snapshot: pipelining must not change a single
//! table, refcount, list position, cache entry or storage operation.

use proptest::prelude::*;
use weft_kv_pool::*;

const PLACEHOLDER: u32 = 0;

#[derive(Debug, Clone)]
enum AOp {
    /// Row `row` (by index among live rows) appends `n` tokens of its document.
    Append { row: u8, n: u8 },
    /// A new row following document `doc`, `len` tokens, with a prefix lookup.
    Admit { doc: u8, len: u8 },
    /// A row finishes.
    Release { row: u8 },
}

fn doc(d: u8) -> Vec<u32> {
    // Documents share their first 8 tokens pairwise: prefix hits happen.
    (0..400u32)
        .map(|i| {
            if i < 8 {
                (d as u32 / 2) * 1000 + i + 1
            } else {
                d as u32 * 1000 + i + 1
            }
        })
        .collect()
}

#[derive(Clone)]
struct Row {
    seq: SeqId,
    doc: Vec<u32>,
    len: usize,
}

#[derive(Clone)]
struct World {
    pool: KvPool,
    rows: Vec<Row>,
}

const SALT: Salt = Salt(7);

impl World {
    /// A pool after `setup` admissions, the first `finished` of them released
    /// again (their full blocks cached and evictable, so steps evict).
    fn new(block_size: u32, blocks: u32, setup: &[(u8, u8)], finished: usize) -> Self {
        let pool = KvPool::new(KvGroups::new(block_size).full(blocks)).expect("pool");
        let mut w = World {
            pool,
            rows: Vec::new(),
        };
        for &(d, len) in setup {
            w.admit(d, len);
        }
        for _ in 0..finished.min(w.rows.len()) {
            w.apply(&AOp::Release { row: 0 });
        }
        w
    }

    /// Admits a row (prefix lookup, then its prompt appended); failures leave
    /// nothing, as every pool call is atomic.
    fn admit(&mut self, d: u8, len: u8) {
        let doc = doc(d);
        let len = (len as usize).clamp(1, 60);
        let spec = SeqSpec::new(OwnerId(0)).salted(SALT);
        let Ok((seq, cached)) = self.pool.allocate_with_prefix(spec, &doc[..len - 1]) else {
            return;
        };
        if self.pool.append_tokens(seq, &doc[cached..len]).is_err() {
            let _ = self.pool.release(seq);
            return;
        }
        self.rows.push(Row { seq, doc, len });
    }

    fn apply(&mut self, op: &AOp) {
        match *op {
            AOp::Append { row, n } => {
                if self.rows.is_empty() {
                    return;
                }
                let i = row as usize % self.rows.len();
                let r = &self.rows[i];
                let n = (n as usize % 6).min(r.doc.len() - r.len);
                if self
                    .pool
                    .append_tokens(r.seq, &r.doc[r.len..r.len + n])
                    .is_ok()
                {
                    self.rows[i].len += n;
                }
            }
            AOp::Admit { doc, len } => self.admit(doc, len),
            AOp::Release { row } => {
                if self.rows.is_empty() {
                    return;
                }
                let i = row as usize % self.rows.len();
                let r = self.rows.remove(i);
                self.pool.release(r.seq).expect("release");
            }
        }
    }

    /// Step B's work: the rows in `follow` (indices) append one token each,
    /// the real one or a placeholder; returns (sequence, position, real token)
    /// of every append that went in.
    fn follow(&mut self, follow: &[u8], real: bool) -> Vec<(SeqId, usize, u32)> {
        let mut done = Vec::new();
        if self.rows.is_empty() {
            return done;
        }
        let mut seen = Vec::new();
        for &f in follow {
            let i = f as usize % self.rows.len();
            if seen.contains(&i) {
                continue;
            }
            seen.push(i);
            let r = &self.rows[i];
            if r.len >= r.doc.len() {
                continue;
            }
            let t = r.doc[r.len];
            let fed = if real { t } else { PLACEHOLDER };
            if self.pool.append_tokens(r.seq, &[fed]).is_ok() {
                done.push((r.seq, r.len, t));
                self.rows[i].len += 1;
            }
        }
        done
    }
}

fn a_op() -> impl Strategy<Value = AOp> {
    prop_oneof![
        4 => (any::<u8>(), any::<u8>()).prop_map(|(row, n)| AOp::Append { row, n }),
        2 => (0u8..6, 1u8..40).prop_map(|(doc, len)| AOp::Admit { doc, len }),
        1 => any::<u8>().prop_map(|row| AOp::Release { row }),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    block_size: u32,
    blocks: u32,
    setup: Vec<(u8, u8)>,
    finished: usize,
    a: Vec<AOp>,
    b: Vec<u8>,
    /// A release in step B (a row that finished in A, released while B is open).
    b_release: Option<u8>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(2u32), Just(4)],
        8u32..30,
        prop::collection::vec((0u8..6, 1u8..40), 0..6),
        0usize..4,
        prop::collection::vec(a_op(), 0..8),
        prop::collection::vec(any::<u8>(), 0..6),
        prop::option::of(any::<u8>()),
    )
        .prop_map(
            |(block_size, blocks, setup, finished, a, b, b_release)| Case {
                block_size,
                blocks,
                setup,
                finished,
                a,
                b,
                b_release,
            },
        )
}

fn release_in_b(w: &mut World, r: Option<u8>) {
    if let (Some(r), false) = (r, w.rows.is_empty()) {
        w.apply(&AOp::Release { row: r });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// A, then B opened on top with placeholders, A committed, placeholders
    /// replaced, B committed == A committed, then B with the real tokens.
    #[test]
    fn pipelined_steps_equal_sequential_ones(c in case()) {
        let start = World::new(c.block_size, c.blocks, &c.setup, c.finished);

        let mut seq = start.clone();
        seq.pool.begin().unwrap();
        for op in &c.a { seq.apply(op); }
        let ops_a = seq.pool.commit().unwrap();
        seq.pool.begin().unwrap();
        seq.follow(&c.b, true);
        release_in_b(&mut seq, c.b_release);
        let ops_b = seq.pool.commit().unwrap();

        let mut pip = start.clone();
        pip.pool.begin().unwrap();
        for op in &c.a { pip.apply(op); }
        prop_assert!(pip.pool.begin().is_err(), "begin with a step open");
        pip.pool.begin_next().unwrap();
        prop_assert_eq!(pip.pool.open_steps(), 2);
        prop_assert!(pip.pool.begin_next().is_err(), "a third step opened");
        let fed = pip.follow(&c.b, false);
        release_in_b(&mut pip, c.b_release);
        let p_ops_a = pip.pool.commit().unwrap();
        prop_assert_eq!(pip.pool.open_steps(), 1);
        for &(s, pos, t) in &fed {
            // A row released in B keeps no tokens to fix.
            if pip.pool.sequence(s).is_ok() {
                pip.pool.set_tokens(s, pos, &[t]).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        let p_ops_b = pip.pool.commit().unwrap();

        prop_assert_eq!(ops_a, p_ops_a);
        prop_assert_eq!(ops_b, p_ops_b);
        pip.pool.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(seq.pool.snapshot(), pip.pool.snapshot());
    }

    /// B rolled back after A committed == A committed, then B opened and rolled
    /// back on its own; both rolled back == A and B as one step rolled back.
    #[test]
    fn rolling_back_the_younger_or_both_equals_the_one_step_order(c in case(), written: bool) {
        let start = World::new(c.block_size, c.blocks, &c.setup, c.finished);
        let undo = |w: &mut World| if written {
            w.pool.rollback_after_writes().unwrap()
        } else {
            w.pool.rollback().unwrap()
        };

        let mut seq = start.clone();
        seq.pool.begin().unwrap();
        for op in &c.a { seq.apply(op); }
        seq.pool.commit().unwrap();
        seq.pool.begin().unwrap();
        seq.follow(&c.b, false);
        release_in_b(&mut seq, c.b_release);
        undo(&mut seq);

        let mut pip = start.clone();
        pip.pool.begin().unwrap();
        for op in &c.a { pip.apply(op); }
        pip.pool.begin_next().unwrap();
        pip.follow(&c.b, false);
        release_in_b(&mut pip, c.b_release);
        pip.pool.commit().unwrap();
        undo(&mut pip);
        prop_assert!(!pip.pool.in_transaction());
        pip.pool.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(seq.pool.snapshot(), pip.pool.snapshot());

        let mut one = start.clone();
        one.pool.begin().unwrap();
        for op in &c.a { one.apply(op); }
        one.follow(&c.b, false);
        release_in_b(&mut one, c.b_release);
        undo(&mut one);

        let mut both = start.clone();
        both.pool.begin().unwrap();
        for op in &c.a { both.apply(op); }
        both.pool.begin_next().unwrap();
        both.follow(&c.b, false);
        release_in_b(&mut both, c.b_release);
        undo(&mut both);
        prop_assert_eq!(both.pool.open_steps(), 1);
        undo(&mut both);
        prop_assert_eq!(both.pool.open_steps(), 0);
        both.pool.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(one.pool.snapshot(), both.pool.snapshot());
        if !written {
            prop_assert_eq!(start.pool.snapshot(), both.pool.snapshot());
        }
    }
}

/// Committing the older step never files a block holding the younger step's
/// placeholder: a lookup then covers only what A computed; after the real
/// token is set and B commits, the block is a hit.
#[test]
fn a_placeholder_is_never_a_prefix_hit() {
    let mut pool = KvPool::new(KvGroups::new(4).full(16)).unwrap();
    let toks = [11u32, 12, 13, 14, 15, 16, 17, 18];
    let seq = pool
        .allocate(SeqSpec::new(OwnerId(0)).salted(SALT))
        .unwrap();
    pool.begin().unwrap();
    pool.append_tokens(seq, &toks[..7]).unwrap();
    pool.begin_next().unwrap();
    pool.append_tokens(seq, &[PLACEHOLDER]).unwrap();
    pool.commit().unwrap();
    // Block 0 (A's) is filed; block 1 holds B's placeholder and is not.
    assert_eq!(pool.lookup(SALT, &toks).tokens, 4);
    let mut with_placeholder = toks;
    with_placeholder[7] = PLACEHOLDER;
    assert_eq!(pool.lookup(SALT, &with_placeholder).tokens, 4);
    // Refused: positions A committed, past the end, no open step.
    let before = pool.snapshot();
    assert!(matches!(
        pool.set_tokens(seq, 6, &[17, 18]),
        Err(KvError::BadTokens { .. })
    ));
    assert!(pool.set_tokens(seq, 8, &[1]).is_err());
    assert_eq!(pool.snapshot(), before);
    pool.set_tokens(seq, 7, &[18]).unwrap();
    pool.commit().unwrap();
    assert_eq!(pool.lookup(SALT, &toks).tokens, 8);
    assert_eq!(pool.lookup(SALT, &with_placeholder).tokens, 4);
    assert!(pool.set_tokens(seq, 7, &[18]).is_err(), "no step open");
    pool.check_invariants().unwrap();
}

/// A placeholder replaced and then rolled back with its step leaves nothing.
#[test]
fn set_tokens_is_undone_with_its_step() {
    let mut pool = KvPool::new(KvGroups::new(4).full(16)).unwrap();
    let seq = pool
        .allocate(SeqSpec::new(OwnerId(0)).salted(SALT))
        .unwrap();
    pool.append_tokens(seq, &[1, 2, 3]).unwrap();
    let before = pool.snapshot();
    pool.begin().unwrap();
    pool.append_tokens(seq, &[PLACEHOLDER]).unwrap();
    pool.set_tokens(seq, 3, &[4]).unwrap();
    assert_eq!(pool.tokens(seq).unwrap(), &[1, 2, 3, 4]);
    pool.rollback().unwrap();
    assert_eq!(pool.snapshot(), before);
}

/// With a sliding-window group, the younger step keeps every block of the older
/// step's window: the older step may still roll back and run again from its
/// base, reading them, so the younger step's appends release none of them and no
/// sequence allocating in the younger step gets one to overwrite. Once the older
/// step has committed, the next step releases them.
#[test]
fn a_younger_step_keeps_the_older_steps_window() {
    let mut pool = KvPool::new(KvGroups::new(4).full(64).sliding(6, 64)).unwrap();
    let a = pool.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    pool.append(a, 8).unwrap();
    let before = pool.snapshot();
    // The older step: 8 tokens from 8 (its forward reads the window of position 8).
    pool.begin().unwrap();
    pool.append(a, 8).unwrap();
    let older = pool.table(a, 1).unwrap();
    let (offset, window) = (older.offset, older.blocks.to_vec());
    assert!(
        offset < 2,
        "the older step dropped blocks its forward reads"
    );
    assert_eq!(pool.releasable_on_append(a, 1).unwrap(), 0);
    // The younger step: one more token of `a`, and a new sequence's 12.
    pool.begin_next().unwrap();
    let out = pool.append(a, 1).unwrap();
    assert_eq!(out.released, 0);
    assert_eq!(pool.table(a, 1).unwrap().offset, offset);
    let b = pool.allocate(SeqSpec::new(OwnerId(1))).unwrap();
    pool.append(b, 12).unwrap();
    let taken = pool.table(b, 1).unwrap().blocks.to_vec();
    assert!(
        taken.iter().all(|x| !window.contains(x)),
        "the younger step handed {taken:?} of the older step's window {window:?} to another sequence"
    );
    pool.check_invariants().unwrap();
    // Both roll back: exactly the state before the older step.
    pool.rollback_after_writes().unwrap();
    pool.rollback_after_writes().unwrap();
    assert_eq!(pool.snapshot(), before);

    // Committed in order, the step after them drops what is behind the window.
    pool.begin().unwrap();
    pool.append(a, 8).unwrap();
    pool.begin_next().unwrap();
    pool.append(a, 1).unwrap();
    pool.commit().unwrap();
    pool.commit().unwrap();
    let held = pool.table(a, 1).unwrap().offset;
    assert_eq!(held, offset);
    let releasable = pool.releasable_on_append(a, 1).unwrap();
    assert!(releasable > 0);
    let out = pool.append(a, 1).unwrap();
    assert_eq!(out.released, releasable);
    assert!(pool.table(a, 1).unwrap().offset > held);
    pool.check_invariants().unwrap();
}
