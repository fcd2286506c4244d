//! Decode attention over the paged KV pool on the CPU, computed in Rust.
//!
//! On the CPU, MLX reads a paged pool by gathering every row's blocks into a
//! padded copy and running masked SDPA over it; at 32 rows of a few hundred
//! tokens that copy is ~45 ms of a ~250 ms decode step on the 2-core dev
//! machine (the dense batch cache it replaced was read in place). This is the
//! CPU counterpart of [`crate::paged_attention`]: after the step's K/V writes
//! are evaluated, the pool is read where it lies, through each row's block
//! table, with an online softmax per query, in parallel over (row, KV head)
//! pairs so the query heads sharing a KV head read its keys once.
//!
//! Queries of a row see the keys `0 ..= start + t`; queries past a row's
//! `tokens` (padding of a ragged step) repeat its last query, as the GPU
//! kernel does.

use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// Shapes of one call.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Query positions per row (1 + the longest draft).
    pub t: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Block-table entries per row.
    pub table_width: usize,
}

/// `q` `[rows, heads, t, head_dim]` (already scaled), pools `[blocks,
/// kv_heads, block_size, head_dim]`, `table` `[rows, table_width]`; returns
/// `[rows, heads, t, head_dim]`.
pub fn decode(
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    table: &[i32],
    start: &[usize],
    ntok: &[usize],
    d: Dims,
) -> Result<Vec<f32>> {
    let Dims {
        rows,
        heads,
        kv_heads,
        t,
        head_dim: hd,
        block_size: bs,
        table_width: tw,
    } = d;
    if kv_heads == 0 || heads % kv_heads != 0 || q.len() != rows * heads * t * hd {
        return Err(ModelError::Invalid(format!(
            "host attention: q of {} values for {d:?}",
            q.len()
        )));
    }
    if table.len() != rows * tw || start.len() != rows || ntok.len() != rows {
        return Err(ModelError::Invalid(format!(
            "host attention: table/start/ntok sizes for {d:?}"
        )));
    }
    let block_elems = kv_heads * bs * hd;
    let blocks = k_pool.len() / block_elems.max(1);
    if v_pool.len() != k_pool.len() {
        return Err(ModelError::Invalid(
            "host attention: K and V pools differ".into(),
        ));
    }
    for (r, row) in table.chunks(tw.max(1)).enumerate() {
        let need = (start[r] + ntok[r].max(1)).div_ceil(bs);
        if need > tw || row[..need].iter().any(|&b| b < 0 || b as usize >= blocks) {
            return Err(ModelError::Invalid(format!(
                "host attention: row {r}'s table does not hold its {} keys",
                start[r] + ntok[r]
            )));
        }
    }
    let group = heads / kv_heads;
    let mut out = vec![0f32; q.len()];
    // One task per (row, KV head), its `group` query heads x `t` positions,
    // laid out contiguously in `out` only per query head, so each task writes
    // through its own disjoint slices. (Splitting a KV head's query heads
    // into tasks of their own, for more tasks than a row's few KV heads, was
    // no faster on 2 cores: each then transposes and reads the keys.)
    let per_head = t * hd;
    let per_task = group;
    let mut tasks: Vec<(usize, usize, Vec<&mut [f32]>)> = Vec::with_capacity(rows * heads);
    {
        let mut heads_out: Vec<&mut [f32]> = out.chunks_mut(per_head).collect();
        heads_out.reverse();
        for r in 0..rows {
            for h0 in (0..heads).step_by(per_task) {
                let mut mine = Vec::with_capacity(per_task);
                for _ in 0..per_task {
                    mine.push(heads_out.pop().expect("one slice per query head"));
                }
                tasks.push((r, h0, mine));
            }
        }
    }
    let isa = crate::cpu_gemm::Isa::detect();
    tasks.par_iter_mut().for_each(|(r, h0, outs)| {
        let (r, h0) = (*r, *h0);
        let task = Task {
            q,
            k_pool,
            v_pool,
            table: &table[r * tw..(r + 1) * tw],
            start: start[r],
            ntok: ntok[r].max(1),
            r,
            h: h0 / group,
            first: h0,
            d,
        };
        #[cfg(target_arch = "x86_64")]
        if isa.is_vectorized() {
            // SAFETY: `Isa::detect` found AVX2 and FMA (or AVX-512, a superset).
            unsafe { task.run_avx2(outs) };
            return;
        }
        let _ = isa;
        task.run::<false>(outs);
    });
    Ok(out)
}

/// One (row, KV head) of a call, or one query head of it: its query heads
/// (`first..`, one output slice each) attend the row's keys through its block
/// table.
struct Task<'a> {
    q: &'a [f32],
    k_pool: &'a [f32],
    v_pool: &'a [f32],
    table: &'a [i32],
    start: usize,
    ntok: usize,
    r: usize,
    /// The KV head.
    h: usize,
    /// The first query head.
    first: usize,
    d: Dims,
}

impl Task<'_> {
    /// # Safety
    /// AVX2 and FMA available (the same loops, compiled 8 lanes wide).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, outs: &mut [&mut [f32]]) {
        self.run::<true>(outs)
    }

    /// Online softmax over the row's keys a block at a time: each block's keys
    /// are transposed once (`[head_dim][block]`) for all of the task's queries
    /// (`group` heads x `t` positions), so a query's block of scores is
    /// `head_dim` vector multiply-adds with no horizontal sums, and its values
    /// are added 8 lanes of the output at a time, held in registers.
    #[inline(always)]
    fn run<const FMA: bool>(&self, outs: &mut [&mut [f32]]) {
        match self.d.block_size {
            16 => self.run_bs::<16, FMA>(outs),
            32 => self.run_bs::<32, FMA>(outs),
            _ => self.run_any(outs),
        }
    }

    /// Query `i` of the task: head `h * group + i / t`, position `i % t` (a
    /// padding position past the row's tokens repeats its last query), and the
    /// keys it sees.
    #[inline(always)]
    fn query(&self, i: usize) -> (&[f32], usize) {
        let Dims {
            heads,
            t,
            head_dim: hd,
            ..
        } = self.d;
        let (g, ti) = (i / t, i % t);
        let hq = self.first + g;
        let q = &self.q[((self.r * heads + hq) * t + ti) * hd..][..hd];
        (q, self.start + ti.min(self.ntok - 1) + 1)
    }

    #[inline(always)]
    fn run_bs<const BS: usize, const FMA: bool>(&self, outs: &mut [&mut [f32]]) {
        let Dims {
            kv_heads,
            t,
            head_dim: hd,
            ..
        } = self.d;
        let nq = outs.len() * t;
        let keys = self.start + t.min(self.ntok);
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0f32; nq];
        let mut acc = vec![0f32; nq * hd];
        let mut kt = vec![0f32; hd * BS];
        for (bi, &blk) in self.table.iter().enumerate().take(keys.div_ceil(BS)) {
            let base = (blk as usize * kv_heads + self.h) * BS * hd;
            let kb = &self.k_pool[base..base + BS * hd];
            let vb = &self.v_pool[base..base + BS * hd];
            for (j, kj) in kb.chunks_exact(hd).enumerate() {
                for (d, &x) in kj.iter().enumerate() {
                    kt[d * BS + j] = x;
                }
            }
            let k0 = bi * BS;
            for i in 0..nq {
                let (qv, visible) = self.query(i);
                let n = visible.saturating_sub(k0).min(BS);
                if n == 0 {
                    continue;
                }
                // Four partial sums over head_dim, so four independent
                // chains of multiply-adds per lane (one chain waits on each
                // add's latency).
                let mut part = [[0f32; BS]; 4];
                let (qc, kc) = (qv.chunks_exact(4), kt.chunks_exact(4 * BS));
                for (&qd, row) in qc.remainder().iter().zip(kc.remainder().chunks_exact(BS)) {
                    for (sj, &kj) in part[0].iter_mut().zip(row) {
                        *sj = madd::<FMA>(qd, kj, *sj);
                    }
                }
                for (q4, k4) in qc.zip(kc) {
                    for (u, pu) in part.iter_mut().enumerate() {
                        let row = &k4[u * BS..(u + 1) * BS];
                        for (sj, &kj) in pu.iter_mut().zip(row) {
                            *sj = madd::<FMA>(q4[u], kj, *sj);
                        }
                    }
                }
                let mut s = [0f32; BS];
                for (j, sj) in s.iter_mut().enumerate() {
                    *sj = (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]);
                }
                let s = &mut s[..n];
                let mt = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mi = m[i].max(mt);
                let corr = exp(m[i] - mi);
                m[i] = mi;
                for sj in s.iter_mut() {
                    *sj = exp(*sj - mi);
                }
                l[i] = l[i] * corr + s.iter().sum::<f32>();
                add_weighted::<FMA>(&mut acc[i * hd..(i + 1) * hd], corr, s, vb, hd);
            }
        }
        self.finish(outs, &acc, &l);
    }

    /// [`run_bs`](Self::run_bs) for a block size it is not instantiated for.
    fn run_any(&self, outs: &mut [&mut [f32]]) {
        let Dims {
            kv_heads,
            t,
            head_dim: hd,
            block_size: bs,
            ..
        } = self.d;
        let nq = outs.len() * t;
        let keys = self.start + t.min(self.ntok);
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0f32; nq];
        let mut acc = vec![0f32; nq * hd];
        let mut s = vec![0f32; bs];
        for (bi, &blk) in self.table.iter().enumerate().take(keys.div_ceil(bs)) {
            let base = (blk as usize * kv_heads + self.h) * bs * hd;
            let kb = &self.k_pool[base..base + bs * hd];
            let vb = &self.v_pool[base..base + bs * hd];
            for i in 0..nq {
                let (qv, visible) = self.query(i);
                let n = visible.saturating_sub(bi * bs).min(bs);
                if n == 0 {
                    continue;
                }
                for (sj, kj) in s[..n].iter_mut().zip(kb.chunks_exact(hd)) {
                    *sj = qv.iter().zip(kj).map(|(a, b)| a * b).sum();
                }
                let mt = s[..n].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mi = m[i].max(mt);
                let corr = exp(m[i] - mi);
                m[i] = mi;
                for sj in &mut s[..n] {
                    *sj = exp(*sj - mi);
                }
                l[i] = l[i] * corr + s[..n].iter().sum::<f32>();
                add_weighted::<false>(&mut acc[i * hd..(i + 1) * hd], corr, &s[..n], vb, hd);
            }
        }
        self.finish(outs, &acc, &l);
    }

    /// Each query's accumulated values over its softmax denominator, into its
    /// head's output.
    fn finish(&self, outs: &mut [&mut [f32]], acc: &[f32], l: &[f32]) {
        let (t, hd) = (self.d.t, self.d.head_dim);
        for (i, a) in acc.chunks_exact(hd).enumerate() {
            let (g, ti) = (i / t, i % t);
            let inv = 1.0 / l[i];
            let o = &mut outs[g][ti * hd..(ti + 1) * hd];
            for (x, &v) in o.iter_mut().zip(a) {
                *x = v * inv;
            }
        }
    }
}

/// `a * b + c`, fused where the caller's code is compiled for FMA (elsewhere
/// `mul_add` is a libm call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `acc = acc * corr + sum_j p[j] * v[j]` over the block's value rows
/// (`[p.len()][hd]` at the start of `vb`), 32 output lanes at a time: the
/// running sums stay in registers across the block's rows, four independent
/// vector chains.
#[inline(always)]
fn add_weighted<const FMA: bool>(acc: &mut [f32], corr: f32, p: &[f32], vb: &[f32], hd: usize) {
    let mut c0 = 0;
    let mut wide = acc.chunks_exact_mut(32);
    for ac in &mut wide {
        lanes::<32, FMA>(ac, corr, p, vb, hd, c0);
        c0 += 32;
    }
    let mut narrow = wide.into_remainder().chunks_exact_mut(8);
    for ac in &mut narrow {
        lanes::<8, FMA>(ac, corr, p, vb, hd, c0);
        c0 += 8;
    }
    for (k, a) in narrow.into_remainder().iter_mut().enumerate() {
        let sum: f32 = p
            .iter()
            .enumerate()
            .map(|(j, &pj)| pj * vb[j * hd + c0 + k])
            .sum();
        *a = *a * corr + sum;
    }
}

/// [`add_weighted`] for `L` output lanes starting at column `c0`.
#[inline(always)]
fn lanes<const L: usize, const FMA: bool>(
    ac: &mut [f32],
    corr: f32,
    p: &[f32],
    vb: &[f32],
    hd: usize,
    c0: usize,
) {
    let mut r = [0f32; L];
    for (x, &a) in r.iter_mut().zip(ac.iter()) {
        *x = a * corr;
    }
    for (j, &pj) in p.iter().enumerate() {
        let v = &vb[j * hd + c0..j * hd + c0 + L];
        for (x, &vv) in r.iter_mut().zip(v) {
            *x = madd::<FMA>(pj, vv, *x);
        }
    }
    ac.copy_from_slice(&r);
}

/// `e^x`, to within a few ulps of f32 over the range a softmax sees (`x <= 0`;
/// below about -87 it is 0): `2^n * e^r` with `r = x - n ln 2` in `[-ln 2 / 2,
/// ln 2 / 2]` (ln 2 split in two, so `r` keeps its bits) by a degree-6
/// polynomial. Branch-free, so a loop of it vectorizes.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    // Round to nearest by the 1.5 * 2^23 trick (`round` is a libm call that
    // keeps the loop scalar).
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor to degree 6 (|r| <= 0.35: error < 1.3e-7).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let bits = ((n as i32 + 127).max(0) as u32) << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention over explicit keys, in f64.
    fn reference(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>]) -> Vec<f32> {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum()
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        (0..q.len())
            .map(|i| {
                (w.iter()
                    .zip(vals)
                    .map(|(w, v)| w * v[i] as f64)
                    .sum::<f64>()
                    / z) as f32
            })
            .collect()
    }

    #[test]
    fn exp_is_within_a_few_ulps_of_libm_where_a_softmax_uses_it() {
        for i in 0..=86_900 {
            let x = -(i as f32) * 1e-3;
            let (got, want) = (exp(x), (x as f64).exp());
            let rel = ((got as f64) - want).abs() / want;
            assert!(rel < 4e-7, "exp({x}) = {got}, want {want} (rel {rel:e})");
        }
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }

    /// A prefill chunk deep in a row (16 queries after 100 keys, head_dim 64):
    /// the blocked kernel against attention over the keys laid out in order.
    #[test]
    fn a_chunk_at_depth_matches_attention_over_its_context() {
        let (heads, kvh, t, hd, bs) = (6, 2, 16, 64, 16);
        let start: usize = 100;
        let tw = (start + t).div_ceil(bs) + 1;
        let nblocks = tw * 2;
        let val = |i: usize| ((i * 7919 + 13) % 1000) as f32 / 500.0 - 1.0;
        let k_pool: Vec<f32> = (0..nblocks * kvh * bs * hd).map(val).collect();
        let v_pool: Vec<f32> = (0..nblocks * kvh * bs * hd).map(|i| val(i + 5)).collect();
        // Every other block, backwards.
        let table: Vec<i32> = (0..tw).map(|j| (nblocks - 1 - 2 * j) as i32).collect();
        let q: Vec<f32> = (0..heads * t * hd).map(|i| 0.2 * val(i + 101)).collect();
        let d = Dims {
            rows: 1,
            heads,
            kv_heads: kvh,
            t,
            head_dim: hd,
            block_size: bs,
            table_width: tw,
        };
        let out = decode(&q, &k_pool, &v_pool, &table, &[start], &[t], d).unwrap();
        for hq in 0..heads {
            let h = hq / (heads / kvh);
            let at = |pool: &[f32], key: usize| {
                let blk = table[key / bs] as usize;
                let base = (blk * kvh + h) * bs * hd + (key % bs) * hd;
                pool[base..base + hd].to_vec()
            };
            for ti in 0..t {
                let len = start + ti + 1;
                let keys: Vec<Vec<f32>> = (0..len).map(|k| at(&k_pool, k)).collect();
                let vals: Vec<Vec<f32>> = (0..len).map(|k| at(&v_pool, k)).collect();
                let qi = (hq * t + ti) * hd;
                let want = reference(&q[qi..qi + hd], &keys, &vals);
                for (a, b) in want.iter().zip(&out[qi..qi + hd]) {
                    assert!((a - b).abs() < 1e-5, "head {hq} query {ti}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn matches_softmax_attention_through_fragmented_tables() {
        let (rows, heads, kvh, t, hd, bs) = (3, 4, 2, 2, 8, 4);
        let nblocks = 12;
        let val = |i: usize| ((i * 7919 + 13) % 1000) as f32 / 500.0 - 1.0;
        let k_pool: Vec<f32> = (0..nblocks * kvh * bs * hd).map(val).collect();
        let v_pool: Vec<f32> = (0..nblocks * kvh * bs * hd).map(|i| val(i + 5)).collect();
        let tw = 4;
        // Row r's blocks interleaved with the others': r, r + 3, r + 6, r + 9.
        let table: Vec<i32> = (0..rows)
            .flat_map(|r| (0..tw).map(move |j| (r + j * rows) as i32))
            .collect();
        let start = [5usize, 0, 11];
        let ntok = [2usize, 1, 2];
        let q: Vec<f32> = (0..rows * heads * t * hd).map(|i| val(i + 101)).collect();
        let d = Dims {
            rows,
            heads,
            kv_heads: kvh,
            t,
            head_dim: hd,
            block_size: bs,
            table_width: tw,
        };
        let out = decode(&q, &k_pool, &v_pool, &table, &start, &ntok, d).unwrap();
        for r in 0..rows {
            for hq in 0..heads {
                let h = hq / (heads / kvh);
                for ti in 0..t {
                    let len = start[r] + ti.min(ntok[r] - 1) + 1;
                    let at = |pool: &[f32], key: usize| {
                        let blk = table[r * tw + key / bs] as usize;
                        let base = (blk * kvh + h) * bs * hd + (key % bs) * hd;
                        pool[base..base + hd].to_vec()
                    };
                    let keys: Vec<Vec<f32>> = (0..len).map(|k| at(&k_pool, k)).collect();
                    let vals: Vec<Vec<f32>> = (0..len).map(|k| at(&v_pool, k)).collect();
                    let qi = ((r * heads + hq) * t + ti) * hd;
                    let want = reference(&q[qi..qi + hd], &keys, &vals);
                    let got = &out[qi..qi + hd];
                    for (a, b) in want.iter().zip(got) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "row {r} head {hq} query {ti}: {a} vs {b}"
                        );
                    }
                }
            }
        }
        // A table that does not hold a row's keys is an error, not a read out of bounds.
        let short = [5usize, 0, 15];
        assert!(decode(&q, &k_pool, &v_pool, &table, &short, &ntok, d).is_err());
    }
}
