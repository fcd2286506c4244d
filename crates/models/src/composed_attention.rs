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
//! It materializes the `[rows, heads, queries, keys]` scores, so it is used only
//! while those stay within [`MAX_SCORES`]; larger steps (long prompts in big
//! chunks) take SDPA, whose plan cost their compute amortizes.

use mlx_rs::{ops, Array, Dtype};

use crate::error::Result;

/// Most score elements (rows x query heads x queries x keys) composed attention
/// materializes: 2^26, i.e. 256 MiB of f32 softmax input for one layer at a time.
pub const MAX_SCORES: i64 = 1 << 26;

/// Which prefill attention a KV uses for multi-token queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillAttention {
    /// MLX's fused SDPA for every shape (bit-identical to mlx-lm's model code).
    Sdpa,
    /// [`attention`] where its scores fit [`MAX_SCORES`], SDPA beyond.
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

    /// Whether a query of `q`'s shape over `keys` keys is composed.
    pub fn composes(self, q: &Array, keys: i32) -> bool {
        let (b, h, t) = (q.dim(0), q.dim(1), q.dim(2));
        self == Self::Composed
            && t > 1
            && i64::from(b) * i64::from(h) * i64::from(t) * i64::from(keys) <= MAX_SCORES
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
    let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (hkv, l) = (k.dim(1), k.dim(2));
    let g = hq / hkv;
    // [B, Hkv, G, T, D] x [B, Hkv, 1, D, L] -> [B, Hkv, G, T, L]
    let qg = ops::multiply(q, Array::from_f32(scale).as_dtype(q.dtype())?)?
        .reshape(&[b, hkv, g, t, d])?;
    let kt = ops::expand_dims(k, 2)?.swap_axes(-1, -2)?;
    let scores = ops::matmul(&qg, &kt)?.as_dtype(Dtype::Float32)?;
    let masked_out = Array::from_f32(f32::MIN);
    // A mask `[T, L]` or `[B | 1, 1, T, L]`, as `[B | 1, 1, 1, T, L]` over the groups.
    let grouped = |m: &Array| -> Result<Array> {
        let m = if m.ndim() == 2 {
            m.reshape(&[1, 1, 1, t, l])?
        } else {
            ops::expand_dims(m, 2)?
        };
        Ok(m)
    };
    let scores = match visible {
        Visible::Causal => {
            let qi = ops::add(Array::from_iter(0..t, &[t, 1]), Array::from_int(l - t))?;
            let kj = Array::from_iter(0..l, &[1, l]);
            ops::select(&kj.le(&qi)?, &scores, &masked_out)?
        }
        Visible::Bool(m) => ops::select(&grouped(m)?, &scores, &masked_out)?,
        Visible::Additive(m) => {
            let a = ops::maximum(&m.as_dtype(Dtype::Float32)?, &masked_out)?;
            ops::add(&scores, &grouped(&a)?)?
        }
    };
    let p = ops::softmax_axis(&scores, -1, None)?.as_dtype(q.dtype())?;
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
    }

    #[test]
    fn composes_only_multi_token_queries_within_the_bound() {
        let q = Array::zeros::<f32>(&[4, 32, 128, 64]).unwrap();
        assert!(PrefillAttention::Composed.composes(&q, 128));
        assert!(!PrefillAttention::Sdpa.composes(&q, 128));
        // 4 x 32 x 128 x 4096 = 2^26: still composed; one more key is not.
        assert!(PrefillAttention::Composed.composes(&q, 4096));
        assert!(!PrefillAttention::Composed.composes(&q, 4097));
        let one = Array::zeros::<f32>(&[64, 32, 1, 64]).unwrap();
        assert!(!PrefillAttention::Composed.composes(&one, 128));
    }
}
