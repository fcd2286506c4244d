//! MLX storage: one decode step's batched write and batched read against a
//! dense `[B, kv_heads, capacity, head_dim]` cache of the same shapes.
//!
//! One layer, SmolLM2-like attention (kv_heads 3, head_dim 64, 9 query
//! heads), rows of unequal lengths in 512..=1024 whose blocks were allocated
//! interleaved (chunks of 16 tokens round-robin), so tables are fragmented
//! the way a busy pool's are.
//!
//! * `write/*`: the step's new K and V (`T = 1` per row) into the pool
//!   (`paged`: one scatter per array at per-row slots) or at the dense cache's
//!   shared cursor (`dense`: one slice update), evaluated.
//! * `write30/*`: the same for 30 layers' writes evaluated once (a decode
//!   step's eval; the single-write numbers are dominated by MLX's per-eval
//!   overhead of ~15 µs on this CPU).
//! * `read/*`: K and V materialized in the attention layout: `paged` gathers
//!   blocks (block and head indices together, one op per array),
//!   `paged_take_transpose` is the alternative gather (take blocks, then
//!   transpose), `dense` copies the cache's `[.., .., :L, ..]` slice.
//! * `attend/*`: read plus SDPA with the boolean mask (what a decode step pays).
//! * `layout`: host cost of `StepLayout::new` (once per step and group,
//!   shared by every layer of the group).
//!
//! Allocator: MLX's CPU backend takes every buffer from `malloc`. glibc
//! serves the multi-MiB outputs of a read from fresh `mmap`s and unmaps them
//! on free once its dynamic threshold stops adapting, so each step pays a page
//! fault per 4 KiB of output (in this VM ~1M faults in a run, and `read` at
//! B=32 went from 6 ms to 40-50 ms). The bench therefore pins glibc's mmap and
//! trim thresholds first (both sides get the same allocator); set
//! `WEFT_BENCH_DEFAULT_MALLOC=1` to measure the default behaviour. A serving
//! binary on glibc wants the same setting (`mallopt` or
//! `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`).
//!
//! Run: `cargo bench -p weft-kv-pool --bench storage -- --warm-up-time 0.5 --measurement-time 2`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{fast, transforms::eval, Array, Dtype};
use weft_kv_pool::storage::{AffineQuant, KvStorage, KvStorageConfig, RowStep, StepLayout};
use weft_kv_pool::{AttentionKind, KvGroups, KvPool, OwnerId, SeqId, SeqSpec};

const H: i32 = 3;
const HQ: i32 = 9;
const D: i32 = 64;
const DT: Dtype = Dtype::Float32;

struct Setup {
    pool: KvPool,
    seqs: Vec<SeqId>,
    max_len: usize,
    num_blocks: u32,
}

fn lengths(b: usize) -> Vec<usize> {
    // Deterministic spread over 512..=1024.
    (0..b).map(|i| 512 + (i * 389 + 97) % 513).collect()
}

fn setup(b: usize, bs: u32) -> Setup {
    let lens = lengths(b);
    let num_blocks = (b * 1024 / bs as usize + 2 * b + 16) as u32;
    let mut pool = KvPool::new(KvGroups::new(bs).full(num_blocks)).unwrap();
    let seqs: Vec<SeqId> = (0..b)
        .map(|_| pool.allocate(SeqSpec::new(OwnerId(0))).unwrap())
        .collect();
    // Interleaved growth to the length before the step.
    let mut have = vec![0usize; b];
    loop {
        let mut grew = false;
        for i in 0..b {
            let want = lens[i] - 1;
            if have[i] < want {
                let n = 16.min(want - have[i]);
                pool.append(seqs[i], n).unwrap();
                have[i] += n;
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    // The step: one token per row.
    pool.begin().unwrap();
    for &s in &seqs {
        pool.append(s, 1).unwrap();
    }
    pool.commit().unwrap();
    Setup {
        pool,
        seqs,
        max_len: *lens.iter().max().unwrap(),
        num_blocks,
    }
}

fn layout(s: &Setup) -> StepLayout {
    let rows: Vec<RowStep> = s
        .seqs
        .iter()
        .map(|&q| RowStep::from_pool(&s.pool, 0, q, 1).unwrap())
        .collect();
    StepLayout::new(&rows, AttentionKind::Full, 1).unwrap()
}

fn rand(shape: &[i32]) -> Array {
    let a = mlx_rs::random::normal::<f32>(shape, None, None, None)
        .unwrap()
        .as_dtype(DT)
        .unwrap();
    a.eval().unwrap();
    a
}

fn storage(s: &Setup, bs: u32, quant: Option<AffineQuant>) -> KvStorage {
    let mut cfg = KvStorageConfig::dense(0, 1, s.num_blocks, bs, H as u32, D as u32, DT);
    cfg.quant = quant;
    let mut st = KvStorage::new(cfg).unwrap();
    // Fill every row's history so reads see real data.
    let rows: Vec<RowStep> = s
        .seqs
        .iter()
        .map(|&q| {
            let len = s.pool.sequence(q).unwrap().len;
            RowStep::from_pool(&s.pool, 0, q, len).unwrap()
        })
        .collect();
    for r in rows {
        let lay = StepLayout::new(&[r], AttentionKind::Full, 1).unwrap();
        let t = r.tokens as i32;
        let x = rand(&[1, H, t, D]);
        st.write(0, &lay, &x, &x).unwrap();
        eval(st.arrays()).unwrap();
    }
    st
}

/// Dense left-padded cache: rows end at a shared cursor (`max_len`), the
/// capacity grown in 256-column steps like `weft_models`' cache.
struct Dense {
    k: Array,
    v: Array,
    cursor: i32,
    mask: Array,
}

fn dense(s: &Setup, b: usize) -> Dense {
    let cursor = s.max_len as i32;
    let cap = (cursor + 256) / 256 * 256;
    let lens = lengths(b);
    let mut m = Vec::with_capacity(b * cursor as usize);
    for &len in &lens {
        let pad = cursor as usize - len;
        m.extend((0..cursor as usize).map(|j| j >= pad));
    }
    Dense {
        k: rand(&[b as i32, H, cap, D]),
        v: rand(&[b as i32, H, cap, D]),
        cursor,
        mask: Array::from_slice(&m, &[b as i32, 1, 1, cursor]),
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn pin_malloc_thresholds() {
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    const M_TRIM_THRESHOLD: i32 = -1;
    const M_MMAP_THRESHOLD: i32 = -3;
    if std::env::var_os("WEFT_BENCH_DEFAULT_MALLOC").is_none() {
        // SAFETY: glibc's mallopt only adjusts allocator tunables; called
        // before any benchmark allocates.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn pin_malloc_thresholds() {}

fn bench(c: &mut Criterion) {
    pin_malloc_thresholds();
    for &(b, bs) in &[(8usize, 16u32), (8, 32), (32, 16), (32, 32)] {
        let s = setup(b, bs);
        let lay = layout(&s);
        let mut st = storage(&s, bs, None);
        let mut dn = dense(&s, b);
        let l = lay.read_len() as i32;
        let new = rand(&[b as i32, H, 1, D]);
        let q = rand(&[b as i32, HQ, 1, D]);
        let scale = 1.0 / (D as f32).sqrt();
        let read_bytes = 2 * b as u64 * H as u64 * l as u64 * D as u64 * 4;
        let id = |name: &str| BenchmarkId::new(name, format!("B{b}_bs{bs}"));

        let mut g = c.benchmark_group("write");
        g.throughput(Throughput::Elements(b as u64));
        g.bench_function(id("paged"), |it| {
            it.iter(|| {
                st.write(0, &lay, &new, &new).unwrap();
                eval(st.arrays()).unwrap();
            })
        });
        g.bench_function(id("dense"), |it| {
            let c0 = dn.cursor - 1;
            it.iter(|| {
                dn.k.try_index_mut((.., .., c0..c0 + 1, ..), &new).unwrap();
                dn.v.try_index_mut((.., .., c0..c0 + 1, ..), &new).unwrap();
                eval([&dn.k, &dn.v]).unwrap();
            })
        });
        g.finish();

        // A step's writes for a 30-layer model (chained on one layer's
        // storage: the same ops), evaluated once, as in a decode step.
        let mut g = c.benchmark_group("write30");
        g.throughput(Throughput::Elements(30 * b as u64));
        g.bench_function(id("paged"), |it| {
            it.iter(|| {
                for _ in 0..30 {
                    st.write(0, &lay, &new, &new).unwrap();
                }
                eval(st.arrays()).unwrap();
            })
        });
        g.bench_function(id("dense"), |it| {
            let c0 = dn.cursor - 1;
            it.iter(|| {
                for _ in 0..30 {
                    dn.k.try_index_mut((.., .., c0..c0 + 1, ..), &new).unwrap();
                    dn.v.try_index_mut((.., .., c0..c0 + 1, ..), &new).unwrap();
                }
                eval([&dn.k, &dn.v]).unwrap();
            })
        });
        g.finish();

        let mut g = c.benchmark_group("read");
        g.throughput(Throughput::Bytes(read_bytes));
        g.bench_function(id("paged"), |it| {
            it.iter(|| {
                let (k, v) = st.read(0, &lay).unwrap();
                eval([&k, &v]).unwrap();
            })
        });
        g.bench_function(id("paged_take_transpose"), |it| {
            let arrays: Vec<&Array> = st.arrays().collect();
            let nb = lay.blocks_per_row() as i32;
            let ids = Array::from_slice(lay.block_table(), &[b as i32 * nb]);
            it.iter(|| {
                let out: Vec<Array> = arrays
                    .iter()
                    .map(|a| {
                        a.take_axis(&ids, 0)
                            .unwrap()
                            .reshape(&[b as i32, nb, H, bs as i32, D])
                            .unwrap()
                            .transpose_axes(&[0, 2, 1, 3, 4])
                            .unwrap()
                            .reshape(&[b as i32, H, l, D])
                            .unwrap()
                    })
                    .collect();
                eval(&out).unwrap();
            })
        });
        g.bench_function(id("dense"), |it| {
            let end = dn.cursor;
            it.iter(|| {
                let k =
                    dn.k.try_index((.., .., ..end, ..))
                        .unwrap()
                        .contiguous()
                        .unwrap();
                let v =
                    dn.v.try_index((.., .., ..end, ..))
                        .unwrap()
                        .contiguous()
                        .unwrap();
                eval([&k, &v]).unwrap();
            })
        });
        g.finish();

        let mut g = c.benchmark_group("attend");
        g.throughput(Throughput::Elements(b as u64));
        g.bench_function(id("paged"), |it| {
            it.iter(|| {
                let (k, v) = st.read(0, &lay).unwrap();
                let o = fast::scaled_dot_product_attention(&q, &k, &v, scale, lay.mask(), None)
                    .unwrap();
                o.eval().unwrap();
            })
        });
        g.bench_function(id("dense"), |it| {
            let end = dn.cursor;
            it.iter(|| {
                let k = dn.k.try_index((.., .., ..end, ..)).unwrap();
                let v = dn.v.try_index((.., .., ..end, ..)).unwrap();
                let o =
                    fast::scaled_dot_product_attention(&q, &k, &v, scale, &dn.mask, None).unwrap();
                o.eval().unwrap();
            })
        });
        g.finish();

        let mut g = c.benchmark_group("layout");
        g.throughput(Throughput::Elements(b as u64));
        g.bench_function(id("step_layout_new"), |it| it.iter(|| layout(&s)));
        g.finish();

        if (b, bs) == (32, 16) {
            for bits in [8u8, 4] {
                let mut st = storage(&s, bs, Some(AffineQuant::new(bits, 64)));
                let name = format!("q{bits}");
                let mut g = c.benchmark_group("write");
                g.throughput(Throughput::Elements(b as u64));
                g.bench_function(id(&format!("paged_{name}")), |it| {
                    it.iter(|| {
                        st.write(0, &lay, &new, &new).unwrap();
                        eval(st.arrays()).unwrap();
                    })
                });
                g.finish();
                let mut g = c.benchmark_group("read");
                g.throughput(Throughput::Bytes(read_bytes));
                g.bench_function(id(&format!("paged_{name}_dequant")), |it| {
                    it.iter(|| {
                        let (k, v) = st.read(0, &lay).unwrap();
                        eval([&k, &v]).unwrap();
                    })
                });
                g.bench_function(id(&format!("paged_{name}_packed")), |it| {
                    it.iter(|| {
                        let (k, v) = st.read_quantized(0, &lay).unwrap();
                        eval([
                            &k.packed, &k.scales, &k.biases, &v.packed, &v.scales, &v.biases,
                        ])
                        .unwrap();
                    })
                });
                g.finish();
            }
        }
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench
}
criterion_main!(benches);
