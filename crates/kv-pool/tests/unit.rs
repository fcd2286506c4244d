//! Targeted tests: LRU eviction order, sliding-window release, copy-on-write,
//! salts, transactions, slots, sizing.

use weft_kv_pool::*;

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn spec(salt: u64) -> SeqSpec {
    SeqSpec::new(OwnerId(1)).salted(Salt(salt))
}

fn check(p: &KvPool) {
    p.check_invariants().unwrap();
}

#[test]
fn layout_sizes_from_bytes() {
    let l = KvLayout {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        block_size: 16,
    };
    assert_eq!(l.bytes_per_token(), 2 * 32 * 8 * 128 * 2);
    assert_eq!(l.bytes_per_block(), 16 * 131_072);
    assert_eq!(
        l.blocks_for_budget(10 * l.bytes_per_block() + 5).unwrap(),
        10
    );
    let p = BlockPool::with_budget(l, 3 * l.bytes_per_block()).unwrap();
    assert_eq!(p.total(), 3);
    assert!(matches!(
        KvLayout {
            block_size: 24,
            ..l
        }
        .blocks_for_budget(1 << 30),
        Err(KvError::InvalidConfig(_))
    ));
}

#[test]
fn block_pool_alloc_free_and_errors() {
    let mut p = BlockPool::with_blocks(2, 16).unwrap();
    let a = p.alloc().unwrap();
    let b = p.alloc().unwrap();
    assert_ne!(a, b);
    assert_eq!(
        p.alloc(),
        Err(KvError::PoolExhausted {
            group: 0,
            needed: 1,
            available: 0
        })
    );
    p.retain(a).unwrap();
    p.release(a).unwrap();
    p.release(a).unwrap();
    assert_eq!(
        p.release(a),
        Err(KvError::DoubleFree { group: 0, block: a })
    );
    assert_eq!(
        p.retain(a),
        Err(KvError::NotAllocated { group: 0, block: a })
    );
    assert_eq!(
        p.stats(),
        BlockStats {
            total: 2,
            free: 1,
            cached: 0,
            used: 1
        }
    );
    p.check_invariants().unwrap();
}

/// Hits are verified against the stored salt, parent and tokens, so even a
/// hash collision cannot cross tenants or return other tokens' KV.
#[test]
fn block_lookup_verifies_entry() {
    let mut p = BlockPool::with_blocks(2, 2).unwrap();
    let b = p.alloc().unwrap();
    assert!(p.register(b, 42, Salt(1), 7, &[1, 2]).unwrap());
    assert_eq!(p.lookup(42, Salt(1), 7, &[1, 2]), Some(b));
    assert_eq!(p.lookup(42, Salt(2), 7, &[1, 2]), None);
    assert_eq!(p.lookup(42, Salt(1), 8, &[1, 2]), None);
    assert_eq!(p.lookup(42, Salt(1), 7, &[1, 3]), None);
    // A second block under the same hash is not indexed.
    let c = p.alloc().unwrap();
    assert!(!p.register(c, 42, Salt(1), 7, &[1, 2]).unwrap());
    p.release(c).unwrap();
    assert_eq!(p.stats().free, 1);
    p.release(b).unwrap();
    assert_eq!(p.stats().cached, 1);
    p.check_invariants().unwrap();
}

#[test]
fn block_pool_transaction_restores_order() {
    let mut p = BlockPool::with_blocks(6, 4).unwrap();
    let bs: Vec<_> = (0..6).map(|_| p.alloc().unwrap()).collect();
    for (i, &b) in bs.iter().enumerate().take(4) {
        p.register(b, i as u64 + 1, Salt(1), 0, &[i as u32; 4])
            .unwrap();
    }
    for &b in &bs {
        p.release(b).unwrap();
    }
    let before = p.snapshot();
    p.begin().unwrap();
    let x = p.alloc().unwrap();
    let y = p.alloc().unwrap();
    let z = p.alloc().unwrap(); // evicts
    p.retain(bs[2]).unwrap(); // hit in the middle of the LRU list
    p.release(x).unwrap();
    p.release(z).unwrap();
    assert_ne!(p.snapshot(), before);
    p.rollback().unwrap();
    assert_eq!(p.snapshot(), before);
    let _ = y;
    p.check_invariants().unwrap();
}

/// Blocks are evicted least recently released first, only when the free list
/// is empty, and a hit refreshes a block's recency.
#[test]
fn lru_eviction_order() {
    let mut p = KvPool::new(KvGroups::new(4).full(4).hash_key(7)).unwrap();
    let docs: Vec<Vec<u32>> = (0..3).map(|d| toks(d + 1, 4)).collect();
    let seqs: Vec<SeqId> = docs
        .iter()
        .map(|d| {
            let s = p.allocate(spec(1)).unwrap();
            p.append_tokens(s, d).unwrap();
            s
        })
        .collect();
    // Release A, B, C: cached LRU order is A, B, C; one block stays free.
    for &s in &seqs {
        p.release(s).unwrap();
    }
    let g = p.group(0).unwrap();
    assert_eq!(g.stats().cached, 3);
    assert_eq!(g.stats().free, 1);
    let cached_order = g.snapshot().cached_order;
    assert_eq!(cached_order.len(), 3);

    // Re-hit B: it leaves the LRU list; releasing it makes it most recent.
    let (b2, hit) = p.allocate_with_prefix(spec(1), &docs[1]).unwrap();
    assert_eq!(hit, 4);
    p.release(b2).unwrap();
    // Order now A, C, B.
    let order = p.group(0).unwrap().snapshot().cached_order;
    assert_eq!(
        order,
        vec![cached_order[0], cached_order[2], cached_order[1]]
    );

    // A new 8-token sequence needs 2 blocks: the free one first, then evicts A.
    let s = p.allocate(spec(2)).unwrap();
    p.append_tokens(s, &toks(9, 8)).unwrap();
    check(&p);
    assert_eq!(p.lookup(Salt(1), &docs[0]).tokens, 0, "A evicted");
    assert_eq!(p.lookup(Salt(1), &docs[1]).tokens, 4);
    assert_eq!(p.lookup(Salt(1), &docs[2]).tokens, 4);
    // One more block: evicts C (older than B).
    p.append_tokens(s, &[1]).unwrap();
    assert_eq!(p.lookup(Salt(1), &docs[2]).tokens, 0, "C evicted");
    assert_eq!(p.lookup(Salt(1), &docs[1]).tokens, 4);
    check(&p);
}

/// Within one released sequence, later blocks are evicted before earlier ones,
/// so the surviving part of the chain stays reachable.
#[test]
fn released_sequence_evicts_tail_first() {
    let mut p = KvPool::new(KvGroups::new(2).full(4).hash_key(1)).unwrap();
    let doc = toks(1, 8);
    let s = p.allocate(spec(1)).unwrap();
    p.append_tokens(s, &doc).unwrap();
    p.release(s).unwrap();
    let t = p.allocate(spec(1)).unwrap();
    p.append_tokens(t, &toks(2, 2)).unwrap(); // evicts one block
    assert_eq!(p.lookup(Salt(1), &doc).tokens, 6, "last block went first");
    p.append_tokens(t, &toks(3, 2)).unwrap();
    assert_eq!(p.lookup(Salt(1), &doc).tokens, 4);
    check(&p);
}

#[test]
fn sliding_window_releases_blocks_outside_window() {
    // Window 8 tokens, blocks of 4.
    let mut p = KvPool::new(KvGroups::new(4).full(16).sliding(8, 16)).unwrap();
    let s = p.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    let mut released = 0;
    for i in 1..=20usize {
        released += p.append(s, 1).unwrap().released;
        check(&p);
        let full = p.table(s, 0).unwrap();
        assert_eq!(full.offset, 0);
        assert_eq!(full.blocks.len(), i.div_ceil(4));
        let win = p.table(s, 1).unwrap();
        // Released against the length before this append: blocks ending at or
        // before (i - 1) - 8.
        let pre = i - 1;
        let expect_offset = pre.saturating_sub(8) / 4;
        assert_eq!(win.offset, expect_offset, "after {i} tokens");
        assert_eq!(win.offset + win.blocks.len(), i.div_ceil(4));
        // Every token the next step can attend to is still mapped.
        for t in i.saturating_sub(8)..i {
            assert!(win.locate(t).is_some(), "token {t} of {i}");
        }
    }
    assert_eq!(released, 2);
    let st = p.stats();
    assert_eq!(st.groups[1].used, 3);
    assert_eq!(st.groups[1].free, 13);
    assert_eq!(st.groups[0].used, 5);
}

#[test]
fn sliding_window_prefix_hit_needs_only_window_blocks() {
    let mut p = KvPool::new(KvGroups::new(4).full(32).sliding(8, 32).hash_key(3)).unwrap();
    let doc = toks(5, 24);
    let s = p.allocate(spec(1)).unwrap();
    for c in doc.chunks(4) {
        p.append_tokens(s, c).unwrap();
    }
    // The sliding group dropped its first blocks already.
    assert!(p.table(s, 1).unwrap().offset > 0);
    let hit = p.lookup(Salt(1), &doc);
    assert_eq!(hit.tokens, 24);
    assert_eq!(hit.groups[0].offset, 0);
    assert_eq!(hit.groups[0].blocks.len(), 6);
    assert_eq!(hit.groups[1].offset, (24 - 8) / 4);
    assert_eq!(hit.groups[1].blocks.len(), 2);
    let (t, n) = p.allocate_with_prefix(spec(1), &doc).unwrap();
    assert_eq!(n, 24);
    assert_eq!(p.table(t, 1).unwrap().offset, 4);
    check(&p);
}

#[test]
fn fork_copy_on_write_reports_copy() {
    let mut p = KvPool::new(KvGroups::new(4).full(8)).unwrap();
    let a = p.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    p.append(a, 6).unwrap();
    p.take_ops();
    let b = p.fork(a).unwrap();
    let shared = p.table(a, 0).unwrap().blocks.to_vec();
    assert_eq!(p.table(b, 0).unwrap().blocks, &shared[..]);
    assert_eq!(p.group(0).unwrap().refcount(shared[1]), Ok(2));
    // b writes into the shared partial block: private copy.
    let r = p.append(b, 1).unwrap();
    assert_eq!(r.copies, 1);
    let bt = p.table(b, 0).unwrap().blocks.to_vec();
    assert_eq!(bt[0], shared[0]);
    assert_ne!(bt[1], shared[1]);
    assert_eq!(
        p.take_ops(),
        vec![StorageOp::CopyBlock {
            group: 0,
            src: shared[1],
            dst: bt[1]
        }]
    );
    // a is now the only holder: writes in place.
    let r = p.append(a, 1).unwrap();
    assert_eq!(r.copies, 0);
    assert_eq!(p.table(a, 0).unwrap().blocks, &shared[..]);
    check(&p);
    p.release(a).unwrap();
    p.release(b).unwrap();
    assert_eq!(p.stats().groups[0].free, 8);
    assert_eq!(p.fork(a), Err(KvError::UnknownSequence(a)));
}

#[test]
fn salts_isolate_tenants() {
    let mut p = KvPool::new(KvGroups::new(4).full(8)).unwrap();
    let doc = toks(1, 8);
    let s = p.allocate(spec(1)).unwrap();
    p.append_tokens(s, &doc).unwrap();
    assert_eq!(p.lookup(Salt(1), &doc).tokens, 8);
    assert_eq!(p.lookup(Salt(2), &doc).tokens, 0);
    let (t, n) = p.allocate_with_prefix(spec(2), &doc).unwrap();
    assert_eq!(n, 0);
    p.append_tokens(t, &doc).unwrap();
    // Same tokens, two salts, four distinct blocks, each indexed once.
    let cached = p.group(0).unwrap().cached_blocks();
    assert_eq!(cached.len(), 4);
    assert_eq!(cached.iter().filter(|c| c.salt == Salt(1)).count(), 2);
    assert_eq!(p.stats().prefix.lookups, 1);
    check(&p);
}

#[test]
fn exhaustion_is_typed_and_atomic() {
    let mut p = KvPool::new(KvGroups::new(4).full(3).sliding(4, 1)).unwrap();
    let s = p.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    p.append(s, 4).unwrap();
    let before = p.snapshot();
    // Full group has 2 free blocks but 3 are needed.
    assert_eq!(
        p.append(s, 12),
        Err(KvError::PoolExhausted {
            group: 0,
            needed: 3,
            available: 2
        })
    );
    assert_eq!(p.snapshot(), before);
    // The sliding group's only block is in use and not yet outside the window.
    assert_eq!(
        p.append(s, 1),
        Err(KvError::PoolExhausted {
            group: 1,
            needed: 1,
            available: 0
        })
    );
    assert_eq!(p.snapshot(), before);
    check(&p);
}

#[test]
fn step_rollback_is_exact_and_registration_waits_for_commit() {
    let mut p = KvPool::new(KvGroups::new(4).full(16).state_slots(2).hash_key(9)).unwrap();
    let doc = toks(1, 12);
    let a = p.allocate(spec(1)).unwrap();
    p.append_tokens(a, &doc[..6]).unwrap();
    let b = p.fork(a).unwrap();
    let c = p
        .allocate(SeqSpec::new(OwnerId(2)).with_state_slot())
        .unwrap();
    assert_eq!(p.take_ops(), vec![StorageOp::ResetSlot(0)]);
    let before = p.snapshot();

    p.begin().unwrap();
    p.append_tokens(a, &doc[6..10]).unwrap();
    assert_eq!(p.fork(a), Err(KvError::ForkOfPendingSequence(a)));
    p.release(b).unwrap();
    p.fork(c).unwrap();
    let d = p.allocate(spec(1)).unwrap();
    p.append_tokens(d, &doc[..4]).unwrap();
    // Nothing new is cached before commit.
    assert_eq!(p.lookup(Salt(1), &doc).tokens, 4);
    check(&p);
    p.rollback().unwrap();
    assert_eq!(p.snapshot(), before);
    check(&p);

    p.begin().unwrap();
    p.append_tokens(a, &doc[6..10]).unwrap();
    let ops = p.commit().unwrap();
    assert_eq!(ops.len(), 1, "a's partial block was shared with b: {ops:?}");
    assert_eq!(p.lookup(Salt(1), &doc).tokens, 8);
    check(&p);
    assert_eq!(p.rollback(), Err(KvError::NoTransaction));
}

#[test]
fn slot_batches() {
    let mut p = KvPool::new(KvGroups::new(16).full(4).state_slots(3)).unwrap();
    let ss = SeqSpec::new(OwnerId(0)).with_state_slot();
    let a = p.allocate(ss).unwrap();
    let b = p.allocate(ss).unwrap();
    let c = p.allocate(ss).unwrap();
    assert_eq!(
        p.allocate(ss),
        Err(KvError::SlotsExhausted {
            needed: 1,
            available: 0
        })
    );
    assert_eq!(
        p.take_ops(),
        vec![
            StorageOp::ResetSlot(0),
            StorageOp::ResetSlot(1),
            StorageOp::ResetSlot(2)
        ]
    );
    let mut x = p.slot_batch(&[a, b]).unwrap();
    let y = p.slot_batch(&[c]).unwrap();
    x.merge(y);
    assert_eq!(x.rows(), &[0, 1, 2]);
    x.filter(&[2, 0]).unwrap();
    assert_eq!(x.rows(), &[2, 0]);
    assert_eq!(x.filter(&[0, 0]), Err(KvError::BadRow { row: 0, len: 2 }));
    assert_eq!(x.extract(0), Ok(2));
    assert_eq!(x.rows(), &[0]);
    p.release(b).unwrap();
    let d = p.fork(a).unwrap();
    assert_eq!(p.sequence(d).unwrap().state_slot, Some(1));
    assert_eq!(p.take_ops(), vec![StorageOp::CopySlot { src: 0, dst: 1 }]);
    let plain = p.allocate(SeqSpec::new(OwnerId(0))).unwrap();
    assert_eq!(p.slot_batch(&[a, plain]), Err(KvError::NoStateSlot(plain)));
    check(&p);
}

#[test]
fn stats_per_owner() {
    let mut p = KvPool::new(KvGroups::new(4).full(8)).unwrap();
    let a = p.allocate(SeqSpec::new(OwnerId(1))).unwrap();
    p.append(a, 5).unwrap();
    let _b = p.fork(a).unwrap();
    let c = p.allocate(SeqSpec::new(OwnerId(2))).unwrap();
    p.append(c, 1).unwrap();
    let st = p.stats();
    assert_eq!(st.sequences, 3);
    assert_eq!(st.owners[&OwnerId(1)].sequences, 2);
    assert_eq!(st.owners[&OwnerId(1)].block_refs, 4);
    assert_eq!(st.owners[&OwnerId(2)].block_refs, 1);
    let g = st.groups[0];
    assert_eq!(g.free + g.cached + g.used, g.total);
    assert_eq!(g.used, 3);
}

#[test]
fn tokens_required_for_cached_sequences() {
    let mut p = KvPool::new(KvGroups::new(4).full(8)).unwrap();
    let a = p.allocate(spec(1)).unwrap();
    assert_eq!(p.append(a, 1), Err(KvError::TokensRequired(a)));
    assert!(matches!(
        KvPool::new(KvGroups::new(16).sliding(0, 4)),
        Err(KvError::InvalidConfig(_))
    ));
}

#[test]
fn groups_from_layer_kinds() {
    let sw = AttentionKind::SlidingWindow { window: 512 };
    let kinds = [sw, sw, AttentionKind::Full, sw, AttentionKind::Full];
    let (cfg, map) = KvGroups::from_layer_kinds(16, &kinds, |_, layers| layers * 10);
    assert_eq!(map, vec![0, 0, 1, 0, 1]);
    assert_eq!(cfg.groups[0], GroupSpec::new(sw, 30));
    assert_eq!(cfg.groups[1], GroupSpec::new(AttentionKind::Full, 20));
}
