//! Prefill attention composed of MLX matmuls and a softmax, for the GPU.
//!
//! MLX's CUDA `fast::scaled_dot_product_attention` builds a kernel plan per new
//! shape of a multi-token query: measured on an H200 (benches/RESULTS.md, "the
//! cold server"), 60-880 ms on the first call of each (rows, query tokens, keys),
//! 0.3-0.6 ms after. A server meets a new shape at nearly every ragged or chunked
//! prefill step, so those first calls, not the math, were its prefill time. The
//! same attention as two matmuls and a softmax has no such cost (0.6-9 ms on its
//! first call, 0.3-0.5 ms after) and agrees with SDPA to bf16 rounding.
//!
//! It materializes the `[rows, heads, queries, keys]` scores, so queries go in
//! chunks whose scores stay within [`MAX_SCORES`] (a causal chunk reads only the
//! keys up to its last query). Chunking, not SDPA, serves the large steps too: a
//! prompt chunk deep into a long prompt is a new (queries, keys) shape nearly
//! every step, and with SDPA the 7000-token prompt of `bench-engine --scenario
//! long-prompts` stalled decoding rows for up to 1 s on such first calls.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::error::Result;

/// Most score elements (rows x query heads x queries x keys) composed attention
/// materializes at once: 2^26, i.e. 128 MiB of bf16 softmax input for one
/// chunk of one layer.
pub const MAX_SCORES: i64 = 1 << 26;

/// Bytes live per score element at the peak of one chunk, by activation size,
/// an upper bound for both multi-token attentions: composed attention holds at
/// most the matmul's scores, the masked scores and the softmax, each in the
/// activation dtype (`3 * act_bytes`); MLX's CPU SDPA may take f32 copies.
pub const fn bytes_per_score(act_bytes: u64) -> u64 {
    act_bytes + 12
}

/// Which prefill attention a KV uses for multi-token queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillAttention {
    /// MLX's fused SDPA for every shape (bit-identical to mlx-lm's model code).
    Sdpa,
    /// [`attention`] for every multi-token query (chunked past [`MAX_SCORES`]).
    Composed,
}

impl PrefillAttention {
    /// Composed on the GPU, SDPA elsewhere (the CPU has no per-shape cost, and its
    /// parity with mlx-lm is exact with SDPA); `WEFT_PREFILL_ATTENTION=sdpa` or
    /// `composed` overrides.
    pub fn for_device(gpu: bool) -> Self {
        match std::env::var("WEFT_PREFILL_ATTENTION").ok().as_deref() {
            Some("sdpa") => Self::Sdpa,
            Some("composed") => Self::Composed,
            _ if gpu => Self::Composed,
            _ => Self::Sdpa,
        }
    }

    /// Whether a query of `q`'s shape is composed (multi-token queries, when
    /// composed attention is on).
    pub fn composes(self, q: &Array) -> bool {
        self == Self::Composed && q.dim(2) > 1
    }
}

/// What a query position may see.
pub enum Visible<'a> {
    /// Key `j` for query `i` where `j <= i + keys - queries` (the queries are the
    /// last positions of the keys).
    Causal,
    /// Booleans `[queries, keys]` or `[rows | 1, 1, queries, keys]`.
    Bool(&'a Array),
    /// 0 / -inf added to the scores, shaped as [`Visible::Bool`]'s.
    Additive(&'a Array),
}

/// Attention of `q` `[B, Hq, T, D]` over `k`, `v` `[B, Hkv, L, D]` (grouped query
/// heads: `Hq` a multiple of `Hkv`), softmax in f32, output `[B, Hq, T, D]` in
/// `q`'s dtype. A query that sees no key gets finite garbage, never NaN (masked
/// scores are the f32 minimum, not -inf), as padding rows need.
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, visible: Visible) -> Result<Array> {
    let (b, hq, t) = (q.dim(0), q.dim(1), q.dim(2));
    let l = k.dim(2);
    let per_query = i64::from(b) * i64::from(hq) * i64::from(l);
    let chunk = (MAX_SCORES / per_query.max(1)).clamp(1, i64::from(t.max(1))) as i32;
    if chunk >= t {
        return attend(q, k, v, scale, visible);
    }
    let mut outs = Vec::with_capacity(((t + chunk - 1) / chunk) as usize);
    for q0 in (0..t).step_by(chunk as usize) {
        let q1 = (q0 + chunk).min(t);
        let qc = q.try_index((.., .., q0..q1, ..))?;
        let out = match visible {
            // The queries are the last `t` keys' positions: the chunk's last
            // query sees the keys up to `l - t + q1`, and the chunk's queries
            // are the last of those.
            Visible::Causal => {
                let seen = l - t + q1;
                let kc = k.try_index((.., .., ..seen, ..))?;
                let vc = v.try_index((.., .., ..seen, ..))?;
                attend(&qc, &kc, &vc, scale, Visible::Causal)?
            }
            Visible::Bool(m) => attend(&qc, k, v, scale, Visible::Bool(&rows_of(m, q0, q1)?))?,
            Visible::Additive(m) => {
                attend(&qc, k, v, scale, Visible::Additive(&rows_of(m, q0, q1)?))?
            }
        };
        outs.push(out);
    }
    Ok(ops::concatenate(&outs, 2)?)
}

/// Query rows `q0..q1` of a mask `[T, L]` or `[B | 1, 1, T, L]`.
fn rows_of(m: &Array, q0: i32, q1: i32) -> Result<Array> {
    Ok(if m.ndim() == 2 {
        m.try_index((q0..q1, ..))?
    } else {
        m.try_index((.., .., q0..q1, ..))?
    })
}

/// The most negative finite value of `dtype`: what a masked score becomes,
/// so a query that sees no key gets a uniform softmax, not NaN (`-inf` minus
/// `-inf`). bf16's range is f32's less its last mantissa bits, which round
/// f32's own minimum to `-inf`.
fn masked_score(dtype: Dtype) -> Result<Array> {
    let min = match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => -3.38e38,
        _ => f32::MIN,
    };
    Ok(Array::from_f32(min).as_dtype(dtype)?)
}

/// One chunk of [`attention`]: all of `q`'s queries at once.
///
/// The scores stay in the activation dtype through the mask and the softmax
/// (MLX's precise softmax reads bf16, reduces in f32 and writes bf16): the
/// matmul rounds them to that dtype anyway, so an f32 copy held nothing more,
/// and each pass over the `[rows, heads, queries, keys]` scores is the cost
/// of a prompt chunk deep in a long prompt. Per score: the matmul writes it,
/// the mask reads and writes it, the softmax reads it twice and writes it, the
/// second matmul reads it (14 bytes in bf16; 36 with the f32 copies).
fn attend(q: &Array, k: &Array, v: &Array, scale: f32, visible: Visible) -> Result<Array> {
    let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (hkv, l) = (k.dim(1), k.dim(2));
    let g = hq / hkv;
    // [B, Hkv, G, T, D] x [B, Hkv, 1, D, L] -> [B, Hkv, G, T, L]
    let qg = ops::multiply(q, Array::from_f32(scale).as_dtype(q.dtype())?)?
        .reshape(&[b, hkv, g, t, d])?;
    let kt = ops::expand_dims(k, 2)?.swap_axes(-1, -2)?;
    let scores = ops::matmul(&qg, &kt)?;
    let masked_out = masked_score(scores.dtype())?;
    // A mask `[T, L]` or `[B | 1, 1, T, L]`, as `[B | 1, 1, 1, T, L]` over the groups.
    let grouped = |m: &Array| -> Result<Array> {
        let m = if m.ndim() == 2 {
            m.reshape(&[1, 1, 1, t, l])?
        } else {
            ops::expand_dims(m, 2)?
        };
        Ok(m)
    };
    let seen = match visible {
        Visible::Causal => {
            let qi = ops::add(Array::from_iter(0..t, &[t, 1]), Array::from_int(l - t))?;
            let kj = Array::from_iter(0..l, &[1, l]);
            kj.le(&qi)?
        }
        Visible::Bool(m) => grouped(m)?,
        // 0 where a key is seen, -inf where not: as booleans (the mask is
        // `heads` times smaller than the scores), so the masked scores stay
        // finite in a narrow dtype.
        Visible::Additive(m) => grouped(&m.eq(Array::from_f32(0.0))?)?,
    };
    let scores = ops::select(&seen, &scores, &masked_out)?;
    let p = ops::softmax_axis(&scores, -1, Some(true))?;
    let out = ops::matmul(&p, &ops::expand_dims(v, 2)?)?;
    Ok(out.reshape(&[b, hq, t, d])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast::{self, ScaledDotProductAttentionMask};

    fn rand(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let d = ops::abs(ops::subtract(a, b).unwrap()).unwrap();
        d.as_slice::<f32>().iter().fold(0.0, |m, &x| m.max(x))
    }

    #[test]
    fn equals_sdpa_for_causal_boolean_and_additive_masks() {
        let (b, hq, hkv, t, l, d) = (3, 8, 2, 5, 9, 16);
        let q = rand(&[b, hq, t, d], 1);
        let k = rand(&[b, hkv, l, d], 2);
        let v = rand(&[b, hkv, l, d], 3);
        let scale = 0.25;
        // Causal, queries at the end of the keys.
        let want = fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Causal).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_diff(&got, &want) < 1e-5, "causal");
        // A ragged boolean mask per row: row r sees keys r..=i + l - t.
        let mut m = Vec::new();
        for r in 0..b {
            for i in 0..t {
                for j in 0..l {
                    m.push(j >= r && j <= i + l - t);
                }
            }
        }
        let m = Array::from_slice(&m, &[b, 1, t, l]);
        let want = fast::scaled_dot_product_attention(&q, &k, &v, scale, &m, None).unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Bool(&m)).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "boolean");
        // The same as an additive 0 / -inf mask.
        let zero = Array::from_f32(0.0);
        let ninf = Array::from_f32(f32::NEG_INFINITY);
        let a = ops::select(&m, &zero, &ninf).unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Additive(&a)).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "additive");
        // One `[T, L]` mask for every row (a sliding window's fresh prefill).
        let w: Vec<bool> = (0..t * l)
            .map(|x| x % l <= x / l + l - t && x % l + 3 > x / l + l - t)
            .collect();
        let w = Array::from_slice(&w, &[t, l]);
        let want = fast::scaled_dot_product_attention(&q, &k, &v, scale, &w, None).unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Bool(&w)).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "2-D mask");
        // bf16 in, bf16 out, within bf16 rounding of SDPA.
        let (qb, kb, vb) = (
            q.as_dtype(Dtype::Bfloat16).unwrap(),
            k.as_dtype(Dtype::Bfloat16).unwrap(),
            v.as_dtype(Dtype::Bfloat16).unwrap(),
        );
        let got = attention(&qb, &kb, &vb, scale, Visible::Bool(&m)).unwrap();
        assert_eq!(got.dtype(), Dtype::Bfloat16);
        let want = fast::scaled_dot_product_attention(&qb, &kb, &vb, scale, &m, None).unwrap();
        let diff = max_diff(
            &got.as_dtype(Dtype::Float32).unwrap(),
            &want.as_dtype(Dtype::Float32).unwrap(),
        );
        assert!(diff < 0.05, "bf16 {diff}");
    }

    #[test]
    fn a_query_that_sees_nothing_stays_finite() {
        let q = rand(&[1, 2, 2, 4], 4);
        let k = rand(&[1, 1, 3, 4], 5);
        let v = rand(&[1, 1, 3, 4], 6);
        let m = Array::from_slice(&[false, false, false, true, true, false], &[1, 1, 2, 3]);
        let out = attention(&q, &k, &v, 0.5, Visible::Bool(&m)).unwrap();
        assert!(out.as_slice::<f32>().iter().all(|x| x.is_finite()));
        // The same in bf16 and f16, whose masked scores are their own minimum
        // (f32's rounds to -inf in either), and through an additive mask.
        let a = ops::select(&m, Array::from_f32(0.0), Array::from_f32(f32::NEG_INFINITY)).unwrap();
        for dt in [Dtype::Bfloat16, Dtype::Float16] {
            let (qh, kh, vh) = (
                q.as_dtype(dt).unwrap(),
                k.as_dtype(dt).unwrap(),
                v.as_dtype(dt).unwrap(),
            );
            for visible in [Visible::Bool(&m), Visible::Additive(&a)] {
                let out = attention(&qh, &kh, &vh, 0.5, visible).unwrap();
                assert_eq!(out.dtype(), dt);
                let out = out.as_dtype(Dtype::Float32).unwrap();
                assert!(
                    out.as_slice::<f32>().iter().all(|x| x.is_finite()),
                    "{dt:?}"
                );
            }
        }
    }

    #[test]
    fn composes_only_multi_token_queries() {
        let q = Array::zeros::<f32>(&[4, 32, 128, 64]).unwrap();
        assert!(PrefillAttention::Composed.composes(&q));
        assert!(!PrefillAttention::Sdpa.composes(&q));
        let one = Array::zeros::<f32>(&[64, 32, 1, 64]).unwrap();
        assert!(!PrefillAttention::Composed.composes(&one));
    }

    /// Past [`MAX_SCORES`] the queries go in chunks: the same attention as
    /// SDPA for a causal prefill (keys cut per chunk), and ragged boolean and
    /// additive masks (mask rows cut per chunk). 1 row x 8 heads x 1000
    /// queries x 9000 keys = 72M scores: two chunks, of 932 and 68 queries.
    #[test]
    fn chunks_past_the_bound_equal_sdpa() {
        let (b, hq, hkv, t, l, d) = (1, 8, 2, 1000, 9000, 8);
        assert!(i64::from(b * hq * t) * i64::from(l) > MAX_SCORES);
        let q = rand(&[b, hq, t, d], 11);
        let k = rand(&[b, hkv, l, d], 12);
        let v = rand(&[b, hkv, l, d], 13);
        let scale = 0.3;
        let want = fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Causal).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_diff(&got, &want) < 1e-5, "causal, chunked");
        // A boolean mask that hides the first 100 keys from every query.
        let m: Vec<bool> = (0..t * l)
            .map(|x| {
                let (i, j) = (x / l, x % l);
                j >= 100 && j <= i + l - t
            })
            .collect();
        let m = Array::from_slice(&m, &[b, 1, t, l]);
        let want = fast::scaled_dot_product_attention(&q, &k, &v, scale, &m, None).unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Bool(&m)).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "boolean, chunked");
        let a = ops::select(&m, Array::from_f32(0.0), Array::from_f32(f32::NEG_INFINITY)).unwrap();
        let got = attention(&q, &k, &v, scale, Visible::Additive(&a)).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "additive, chunked");
    }
}
