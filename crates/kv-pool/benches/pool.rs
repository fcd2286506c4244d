//! Hot paths of the accounting layer.
//!
//! Targets: one block alloc+free under 100 ns; prefix lookup under 1 µs per
//! block (lookup groups report elements = blocks, so criterion's throughput
//! line gives the per-block rate directly).

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use weft_kv_pool::{BlockPool, KvGroups, KvPool, OwnerId, Salt, SeqId, SeqSpec};

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_pool");
    g.throughput(Throughput::Elements(1));
    let mut pool = BlockPool::with_blocks(4096, 16).unwrap();
    // Half the pool in use, so the lists are not trivially empty.
    for _ in 0..2048 {
        pool.alloc().unwrap();
    }
    g.bench_function("alloc_free_one_block", |b| {
        b.iter(|| {
            let x = pool.alloc().unwrap();
            pool.release(black_box(x)).unwrap();
        })
    });
    g.finish();
}

fn doc(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 32_000)
        .collect()
}

fn prefix_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_lookup");
    for &bs in &[16u32, 64] {
        let blocks = 64usize;
        let tokens = doc(bs as usize * blocks, bs);
        let mut pool = KvPool::new(KvGroups::new(bs).full(4096).hash_key(1)).unwrap();
        let spec = SeqSpec::new(OwnerId(1)).salted(Salt(7));
        let s = pool.allocate(spec).unwrap();
        pool.append_tokens(s, &tokens).unwrap();
        pool.release(s).unwrap();
        assert_eq!(pool.lookup(Salt(7), &tokens).tokens, tokens.len());
        g.throughput(Throughput::Elements(blocks as u64));
        g.bench_function(format!("lookup_hit_{blocks}_blocks_bs{bs}"), |b| {
            b.iter(|| black_box(pool.lookup(Salt(7), black_box(&tokens))))
        });
        // Admission: lookup, take references (cached blocks leave the LRU
        // list), then release them back.
        g.bench_function(format!("admit_release_{blocks}_blocks_bs{bs}"), |b| {
            b.iter(|| {
                let (s, n) = pool.allocate_with_prefix(spec, black_box(&tokens)).unwrap();
                debug_assert_eq!(n, tokens.len());
                pool.release(s).unwrap();
            })
        });
    }
    g.finish();
}

/// 256 decode rows with ragged lengths (100..500 tokens), prefix-cached,
/// block size 16.
fn rows_256(pool: &mut KvPool) -> Vec<SeqId> {
    (0..256u32)
        .map(|r| {
            let spec = SeqSpec::new(OwnerId(r % 8)).salted(Salt(u64::from(r % 8)));
            let prompt = doc(100 + (r as usize * 37) % 400, r);
            let (s, n) = pool.allocate_with_prefix(spec, &prompt).unwrap();
            pool.append_tokens(s, &prompt[n..]).unwrap();
            s
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Step {
    /// Each append is its own step (commits on return).
    Auto,
    /// begin, 256 appends, commit.
    Commit,
    /// begin, 256 appends, rollback.
    Rollback,
}

/// Times `iters` decode steps of one token per row, in steady state: every
/// 64 steps the rows are released and re-admitted outside the timed region,
/// so rows stay at realistic lengths and the prefix cache keeps churning.
fn decode_steps(iters: u64, mode: Step) -> Duration {
    let mut pool = KvPool::new(KvGroups::new(16).full(32_768).hash_key(3)).unwrap();
    let mut rows = rows_256(&mut pool);
    let mut total = Duration::ZERO;
    for it in 0..iters {
        if it % 64 == 63 {
            for &s in &rows {
                pool.release(s).unwrap();
            }
            rows = rows_256(&mut pool);
        }
        pool.take_ops();
        let t = Instant::now();
        match mode {
            Step::Auto => {
                for (i, &s) in rows.iter().enumerate() {
                    pool.append_tokens(s, &[i as u32]).unwrap();
                }
            }
            Step::Commit => {
                pool.begin().unwrap();
                for (i, &s) in rows.iter().enumerate() {
                    pool.append_tokens(s, &[i as u32]).unwrap();
                }
                black_box(pool.commit().unwrap());
            }
            Step::Rollback => {
                pool.begin().unwrap();
                for (i, &s) in rows.iter().enumerate() {
                    pool.append_tokens(s, &[i as u32]).unwrap();
                }
                pool.rollback().unwrap();
            }
        }
        total += t.elapsed();
    }
    total
}

fn table_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("table_ops");
    g.throughput(Throughput::Elements(256));
    g.bench_function("append_1_token_256_rows", |b| {
        b.iter_custom(|iters| decode_steps(iters, Step::Auto))
    });
    g.bench_function("begin_append_commit_256_rows", |b| {
        b.iter_custom(|iters| decode_steps(iters, Step::Commit))
    });
    g.bench_function("begin_append_rollback_256_rows", |b| {
        b.iter_custom(|iters| decode_steps(iters, Step::Rollback))
    });
    g.finish();
}

criterion_group!(benches, alloc_free, prefix_lookup, table_ops);
criterion_main!(benches);
