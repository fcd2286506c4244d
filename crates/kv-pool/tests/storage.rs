//! MLX storage against naive references.
//!
//! A seeded driver runs random schedules through the accounting (prefill
//! chunks and decode steps of unequal lengths in one batch, prefix reuse,
//! forks with copy-on-write, releases that recycle blocks) and checks after
//! every step, for every row of the step:
//!
//! * the batched read equals a dense per-row reference (exact for float
//!   storage; quantized storage equals the reference's own
//!   quantize→dequantize exactly and stays within `range / 2^bits` of the
//!   raw values, see `AffineQuant::max_error`);
//! * the mask is exactly the visibility the definition gives;
//! * sliding-window rows see exactly what a rotating cache of `window` slots
//!   holds at every query, before and after it wraps;
//! * SDPA over the gathered layout and mask equals SDPA per row over the
//!   reference.
//!
//! K/V values are a function of (layer, token, position), so a block reused
//! through the prefix cache holds exactly what the reusing row would write.

#![cfg(feature = "mlx")]
// Index loops mirror the tensor layouts the references are checked against.
#![allow(clippy::needless_range_loop)]

use mlx_rs::{fast, ops, transforms::eval, Array, Dtype};
use weft_kv_pool::storage::*;
use weft_kv_pool::*;

const H: usize = 2;
const HQ: usize = 4;
const D: usize = 32;

fn on_gpu() -> bool {
    mlx_rs::Device::try_default()
        .and_then(|d| d.get_type())
        .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// K (`which` 0) or V (1) of one token: multiples of 1/64 in [-4, 4), exact
/// in f16 and bf16.
fn token_kv(layer: usize, which: usize, tok: u32, pos: usize) -> Vec<f32> {
    (0..H * D)
        .map(|i| {
            let h = mix((layer as u64) << 56
                ^ (which as u64) << 52
                ^ u64::from(tok) << 20
                ^ (pos as u64) << 8
                ^ i as u64);
            (h % 512) as f32 / 64.0 - 4.0
        })
        .collect()
}

fn host(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// A rotating cache of `window` slots, written at `pos % window`.
#[derive(Clone)]
struct Ring {
    window: usize,
    slots: Vec<Vec<f32>>,
    n: usize,
}

impl Ring {
    fn new(window: usize) -> Self {
        Self {
            window,
            slots: vec![Vec::new(); window],
            n: 0,
        }
    }
    fn push(&mut self, x: Vec<f32>) {
        let i = self.n % self.window;
        self.slots[i] = x;
        self.n += 1;
    }
    /// Contents oldest first.
    fn ordered(&self) -> Vec<&Vec<f32>> {
        let k = self.n.min(self.window);
        (self.n - k..self.n)
            .map(|p| &self.slots[p % self.window])
            .collect()
    }
}

/// Reference for one row: token ids, per layer a dense K/V history and a
/// rotating K/V cache.
#[derive(Clone)]
struct RowRef {
    seq: SeqId,
    tokens: Vec<u32>,
    /// Prompt tokens not yet written.
    pending: Vec<u32>,
    dense: Vec<[Vec<Vec<f32>>; 2]>,
    ring: Vec<[Ring; 2]>,
}

impl RowRef {
    fn new(seq: SeqId, layers: usize, window: usize) -> Self {
        Self {
            seq,
            tokens: Vec::new(),
            pending: Vec::new(),
            dense: (0..layers).map(|_| [Vec::new(), Vec::new()]).collect(),
            ring: (0..layers)
                .map(|_| [Ring::new(window), Ring::new(window)])
                .collect(),
        }
    }
    fn push(&mut self, tok: u32) {
        let pos = self.tokens.len();
        self.tokens.push(tok);
        for l in 0..self.dense.len() {
            for w in 0..2 {
                let x = token_kv(l, w, tok, pos);
                self.dense[l][w].push(x.clone());
                self.ring[l][w].push(x);
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Scenario {
    seed: u64,
    steps: usize,
    layers: usize,
    block_size: u32,
    /// `Some(window)` adds a sliding-window group next to the full group.
    window: Option<u32>,
    dtype: Dtype,
    quant: Option<AffineQuant>,
    attention: bool,
    bucket: usize,
}

fn quant_roundtrip(rows: &[Vec<f32>], q: AffineQuant) -> Vec<f32> {
    let n = rows.len() as i32;
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    let a = Array::from_slice(&flat, &[n, H as i32, D as i32]);
    let (w, s, b) = ops::quantize(&a, i32::from(q.group_size), i32::from(q.bits)).unwrap();
    host(&ops::dequantize(&w, &s, &b, i32::from(q.group_size), i32::from(q.bits)).unwrap())
}

fn run(sc: Scenario) {
    let mut rng = Rng(sc.seed);
    let bs = sc.block_size as usize;
    let mut cfg = KvGroups::new(sc.block_size).full(160).hash_key(7);
    let mut kinds = vec![AttentionKind::Full];
    if let Some(w) = sc.window {
        cfg = cfg.sliding(w, 64);
        kinds.push(AttentionKind::SlidingWindow { window: w });
    }
    let window = sc.window.unwrap_or(1) as usize;
    let mut pool = KvPool::new(cfg.clone()).unwrap();
    let mut stores: Vec<KvStorage> = cfg
        .groups
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            let mut c = KvStorageConfig::dense(
                g,
                sc.layers,
                spec.num_blocks,
                sc.block_size,
                H as u32,
                D as u32,
                sc.dtype,
            );
            c.quant = sc.quant;
            KvStorage::new(c).unwrap()
        })
        .collect();
    // A few prompt families so prefix hits happen.
    let families: Vec<Vec<u32>> = (0..3)
        .map(|f| (0..64).map(|i| 100 * f + i).collect())
        .collect();
    let mut rows: Vec<RowRef> = Vec::new();
    let mut checked_tokens = 0usize;
    let mut wrapped = false;
    let mut forks = 0;
    let mut hits = 0;
    let mut worst_quant_ratio = 0f32;

    for step in 0..sc.steps {
        // Admissions, forks and releases between steps.
        if rows.len() < 6 && rng.chance(0.5) {
            let fam = &families[rng.below(families.len())];
            let mut prompt = fam[..8 + rng.below(40)].to_vec();
            prompt.extend((0..rng.below(12)).map(|_| 1000 + rng.below(50) as u32));
            let (seq, n) = pool
                .allocate_with_prefix(
                    SeqSpec::new(OwnerId(1)).salted(Salt(3)),
                    &prompt[..prompt.len() - 1],
                )
                .unwrap();
            hits += usize::from(n > 0);
            let mut r = RowRef::new(seq, sc.layers, window);
            for &t in &prompt[..n] {
                r.push(t);
            }
            r.pending = prompt[n..].to_vec();
            rows.push(r);
        }
        if !rows.is_empty() && rng.chance(0.08) {
            let i = rng.below(rows.len());
            if rows[i].pending.is_empty() && !rows[i].tokens.is_empty() {
                let child = pool.fork(rows[i].seq).unwrap();
                let mut c = rows[i].clone();
                c.seq = child;
                rows.push(c);
                forks += 1;
            }
        }
        if rows.len() > 2 && rng.chance(0.1) {
            let i = rng.below(rows.len());
            pool.release(rows.remove(i).seq).unwrap();
        }
        let ops = pool.take_ops();
        apply_storage_ops(&ops, &mut stores, None).unwrap();
        if rows.is_empty() {
            continue;
        }

        // Plan: a random subset; prompt rows write a chunk, others one token.
        let mut chosen: Vec<usize> = (0..rows.len()).filter(|_| rng.chance(0.7)).collect();
        if chosen.is_empty() {
            chosen.push(rng.below(rows.len()));
        }
        let mut new_toks: Vec<Vec<u32>> = Vec::new();
        pool.begin().unwrap();
        let mut ok = true;
        for &i in &chosen {
            let r = &rows[i];
            let toks: Vec<u32> = if r.pending.is_empty() {
                vec![2000 + rng.below(100) as u32]
            } else {
                let n = (1 + rng.below(12)).min(r.pending.len());
                r.pending[..n].to_vec()
            };
            if pool.append_tokens(r.seq, &toks).is_err() {
                ok = false;
                break;
            }
            new_toks.push(toks);
        }
        if !ok {
            pool.rollback().unwrap();
            // Free room for later steps.
            let i = rng.below(rows.len());
            pool.release(rows.remove(i).seq).unwrap();
            continue;
        }
        let ops = pool.commit().unwrap();
        apply_storage_ops(&ops, &mut stores, None).unwrap();

        let b = chosen.len();
        let t = new_toks.iter().map(Vec::len).max().unwrap();
        let layouts: Vec<StepLayout> = kinds
            .iter()
            .enumerate()
            .map(|(g, &kind)| {
                if g == 0 {
                    let spec: Vec<(SeqId, usize)> = chosen
                        .iter()
                        .zip(&new_toks)
                        .map(|(&i, toks)| (rows[i].seq, toks.len()))
                        .collect();
                    return StepLayout::from_pool(&pool, g, &spec, sc.bucket).unwrap();
                }
                let rs: Vec<RowStep> = chosen
                    .iter()
                    .zip(&new_toks)
                    .map(|(&i, toks)| {
                        RowStep::from_pool(&pool, g, rows[i].seq, toks.len()).unwrap()
                    })
                    .collect();
                StepLayout::new(&rs, kind, sc.bucket).unwrap()
            })
            .collect();

        // New K/V per layer, [B, H, T, D]; padding is garbage that must not land.
        let mut inputs: Vec<[Array; 2]> = Vec::new();
        for l in 0..sc.layers {
            let mk = |w: usize| {
                let mut buf = vec![1.0e6f32; b * H * t * D];
                for (ri, (&i, toks)) in chosen.iter().zip(&new_toks).enumerate() {
                    let start = rows[i].tokens.len();
                    for (j, &tok) in toks.iter().enumerate() {
                        let x = token_kv(l, w, tok, start + j);
                        for h in 0..H {
                            let dst = ((ri * H + h) * t + j) * D;
                            buf[dst..dst + D].copy_from_slice(&x[h * D..(h + 1) * D]);
                        }
                    }
                }
                Array::from_slice(&buf, &[b as i32, H as i32, t as i32, D as i32])
                    .as_dtype(sc.dtype)
                    .unwrap()
            };
            inputs.push([mk(0), mk(1)]);
        }
        let q_host: Vec<f32> = (0..b * HQ * t * D).map(|_| rng.f32()).collect();
        let queries = Array::from_slice(&q_host, &[b as i32, HQ as i32, t as i32, D as i32])
            .as_dtype(sc.dtype)
            .unwrap();

        // Writes (all groups, all layers), then reads.
        let mut reads: Vec<Vec<(Array, Array)>> = Vec::new();
        for (g, store) in stores.iter_mut().enumerate() {
            let mut per_layer = Vec::new();
            for (l, kv) in inputs.iter().enumerate() {
                per_layer.push(
                    store
                        .update_and_fetch(l, &layouts[g], &kv[0], &kv[1])
                        .unwrap(),
                );
            }
            reads.push(per_layer);
        }
        let arrays: Vec<&Array> = stores.iter().flat_map(|s| s.arrays()).collect();
        eval(arrays).unwrap();

        // Reference rows advance (dense history + ring, token by token inside
        // the per-query checks below).
        let before: Vec<RowRef> = chosen.iter().map(|&i| rows[i].clone()).collect();
        for (&i, toks) in chosen.iter().zip(&new_toks) {
            for &tok in toks {
                rows[i].push(tok);
            }
            let n = toks.len();
            let keep = n.min(rows[i].pending.len());
            rows[i].pending.drain(..keep);
        }

        for (g, &kind) in kinds.iter().enumerate() {
            let lay = &layouts[g];
            let l_max = lay.read_len();
            assert_eq!(l_max % bs, 0);
            assert_eq!(lay.blocks_per_row() % sc.bucket, 0);
            if let AttentionKind::SlidingWindow { window } = kind {
                // Only in-window blocks are gathered.
                let most = (window as usize - 1 + t).div_ceil(bs) + 1;
                assert!(lay.blocks_per_row() <= most.div_ceil(sc.bucket) * sc.bucket);
            }
            let mask = lay.mask();
            assert_eq!(mask.shape(), &[b as i32, 1, t as i32, l_max as i32]);
            mask.eval().unwrap();
            let mask_h: Vec<bool> = mask.as_slice::<bool>().to_vec();
            for (l, (k_read, v_read)) in reads[g].iter().enumerate() {
                assert_eq!(
                    k_read.shape(),
                    &[b as i32, H as i32, l_max as i32, D as i32]
                );
                assert_eq!(k_read.dtype(), sc.dtype);
                let kv_h = [host(k_read), host(v_read)];
                let sdpa = sc.attention.then(|| {
                    host(
                        &fast::scaled_dot_product_attention(
                            &queries,
                            k_read,
                            v_read,
                            1.0 / (D as f32).sqrt(),
                            mask,
                            None,
                        )
                        .unwrap(),
                    )
                });
                for (ri, &i) in chosen.iter().enumerate() {
                    let row = &rows[i];
                    let len = row.tokens.len();
                    let start = lay.starts()[ri];
                    assert_eq!(start, before[ri].tokens.len());
                    let base = lay.first_block()[ri] * bs;
                    // 1. Stored contents at every held column.
                    for w in 0..2 {
                        let reference = sc.quant.map(|q| quant_roundtrip(&row.dense[l][w], q));
                        for c in 0..l_max {
                            let a = base + c;
                            if a >= len {
                                break;
                            }
                            for h in 0..H {
                                let got = &kv_h[w][((ri * H + h) * l_max + c) * D..][..D];
                                let raw = &row.dense[l][w][a][h * D..(h + 1) * D];
                                match (sc.quant, &reference) {
                                    (Some(q), Some(rt)) => {
                                        let want = &rt[(a * H + h) * D..][..D];
                                        assert_eq!(got, want, "quantized step {step} row {ri} slot {a}");
                                        for grp in raw.chunks(q.group_size as usize).zip(got.chunks(q.group_size as usize)) {
                                            let (lo, hi) = grp.0.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                                            let bound = q.max_error(hi - lo) * (1.0 + 1e-4) + 1e-6;
                                            for (x, y) in grp.0.iter().zip(grp.1) {
                                                assert!((x - y).abs() <= bound, "quant error {} > step {bound}", (x - y).abs());
                                                worst_quant_ratio = worst_quant_ratio.max((x - y).abs() / q.max_error(hi - lo));
                                            }
                                        }
                                    }
                                    _ => assert_eq!(got, raw, "step {step} group {g} layer {l} row {ri} slot {a} head {h}"),
                                }
                            }
                        }
                    }
                    checked_tokens += len;
                    // 2. Mask and 3. rotating-cache equality, query by query.
                    let mut ring = before[ri].ring[l].clone();
                    let toks = &new_toks[ri];
                    for q in 0..t {
                        let p = start + q.min(toks.len() - 1);
                        if q < toks.len() {
                            for w in 0..2 {
                                ring[w].push(row.dense[l][w][p].clone());
                            }
                        }
                        let visible: Vec<usize> = (0..l_max)
                            .filter(|&c| mask_h[(ri * t + q) * l_max + c])
                            .collect();
                        let want: Vec<usize> = (0..l_max)
                            .filter(|&c| {
                                let a = base + c;
                                a <= p
                                    && match kind {
                                        AttentionKind::Full => true,
                                        AttentionKind::SlidingWindow { window } => {
                                            p - a < window as usize
                                        }
                                    }
                            })
                            .collect();
                        assert_eq!(
                            visible, want,
                            "mask step {step} group {g} row {ri} query {q}"
                        );
                        if let (AttentionKind::SlidingWindow { .. }, None) = (kind, sc.quant) {
                            for w in 0..2 {
                                let got: Vec<&[f32]> = visible
                                    .iter()
                                    .flat_map(|&c| (0..H).map(move |h| (h, c)))
                                    .map(|(h, c)| &kv_h[w][((ri * H + h) * l_max + c) * D..][..D])
                                    .collect();
                                let ring_rows = ring[w].ordered();
                                let want: Vec<&[f32]> = ring_rows
                                    .iter()
                                    .flat_map(|x| (0..H).map(move |h| &x[h * D..(h + 1) * D]))
                                    .collect();
                                assert_eq!(got, want, "ring step {step} row {ri} query {q}");
                            }
                            wrapped |= ring[0].n > window;
                        }
                        // 4. Attention against the per-row reference.
                        if let (Some(out), true) = (&sdpa, q < toks.len()) {
                            let keys: Vec<usize> = match kind {
                                AttentionKind::Full => (0..=p).collect(),
                                AttentionKind::SlidingWindow { window } => {
                                    (p + 1 - (p + 1).min(window as usize)..=p).collect()
                                }
                            };
                            let n = keys.len();
                            let gather = |w: usize| {
                                let mut buf = vec![0f32; H * n * D];
                                for (j, &a) in keys.iter().enumerate() {
                                    for h in 0..H {
                                        let src = match &sc.quant {
                                            None => row.dense[l][w][a][h * D..(h + 1) * D].to_vec(),
                                            Some(_) => kv_h[w]
                                                [((ri * H + h) * l_max + (a - base)) * D..][..D]
                                                .to_vec(),
                                        };
                                        buf[(h * n + j) * D..][..D].copy_from_slice(&src);
                                    }
                                }
                                Array::from_slice(&buf, &[1, H as i32, n as i32, D as i32])
                                    .as_dtype(sc.dtype)
                                    .unwrap()
                            };
                            let qrow = &q_host[(ri * HQ * t) * D..][..HQ * t * D];
                            let qv: Vec<f32> = (0..HQ)
                                .flat_map(|hq| qrow[(hq * t + q) * D..][..D].to_vec())
                                .collect();
                            let qa = Array::from_slice(&qv, &[1, HQ as i32, 1, D as i32])
                                .as_dtype(sc.dtype)
                                .unwrap();
                            let r = host(
                                &fast::scaled_dot_product_attention(
                                    &qa,
                                    gather(0),
                                    gather(1),
                                    1.0 / (D as f32).sqrt(),
                                    None,
                                    None,
                                )
                                .unwrap(),
                            );
                            let tol = match (sc.dtype, on_gpu()) {
                                (Dtype::Float32, false) => 1e-5,
                                // MLX CUDA's f32 matmuls run in TF32 by
                                // default (10-bit mantissa): logits of up to
                                // ~10 carry ~1e-2 error.
                                (Dtype::Float32, true) => 2e-2,
                                _ => 2e-2,
                            };
                            for hq in 0..HQ {
                                let got = &out[((ri * HQ + hq) * t + q) * D..][..D];
                                let want = &r[hq * D..(hq + 1) * D];
                                for (x, y) in got.iter().zip(want) {
                                    assert!(
                                        (x - y).abs() <= tol * (1.0 + y.abs()),
                                        "sdpa step {step} group {g} row {ri} q {q}: {x} vs {y}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        pool.check_invariants().unwrap();
    }
    assert!(
        checked_tokens > 1000,
        "too little checked: {checked_tokens}"
    );
    if let Some(q) = sc.quant {
        eprintln!(
            "{}-bit: worst |dequantized - raw| = {worst_quant_ratio:.6} of range / 2^bits",
            q.bits
        );
        assert!(
            worst_quant_ratio > 0.5,
            "quantization error suspiciously small"
        );
    }
    assert!(hits > 0, "no prefix hit exercised");
    assert!(forks > 0, "no fork exercised");
    if sc.window.is_some() && sc.quant.is_none() {
        assert!(wrapped, "no rotating cache wrapped");
    }
}

fn base(seed: u64) -> Scenario {
    Scenario {
        seed,
        steps: 120,
        layers: 2,
        block_size: 8,
        window: Some(20),
        dtype: Dtype::Float32,
        quant: None,
        attention: true,
        bucket: 1,
    }
}

#[test]
fn dense_f32_full_and_sliding_match_references() {
    for seed in 1..=3 {
        run(base(seed));
    }
}

#[test]
fn dense_f16_bucketed_is_exact() {
    run(Scenario {
        dtype: Dtype::Float16,
        bucket: 4,
        block_size: 4,
        window: Some(9),
        ..base(11)
    });
}

#[test]
fn dense_bf16_block16_is_exact() {
    run(Scenario {
        dtype: Dtype::Bfloat16,
        block_size: 16,
        window: Some(33),
        attention: false,
        ..base(12)
    });
}

#[test]
fn quantized_8bit_within_range_over_2_pow_bits() {
    run(Scenario {
        quant: Some(AffineQuant::new(8, 32)),
        ..base(21)
    });
}

#[test]
fn quantized_4bit_within_range_over_2_pow_bits() {
    run(Scenario {
        quant: Some(AffineQuant::new(4, 32)),
        window: None,
        ..base(22)
    });
}
