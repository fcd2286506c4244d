//! Exp-based ops rewritten for MLX's CPU backend.
//!
//! The x86 `mlx-cpu` wheel evaluates `exp` (and so `sigmoid` and `softmax`)
//! with scalar libm calls, about 13 ns per element against 0.3-0.5 ns for an
//! add or multiply. That made SiLU and attention's softmax half of every
//! forward pass on CPU (an `[8, 128]` prefill layer: 26 ms of SiLU and 23 ms of
//! attention beside 40 ms of matmuls). Here exp is assembled from ops MLX runs
//! fast: `e^x = 2^n * e^r` with `n = round(x / ln 2)` written straight into the float
//! exponent bits and the rest from a polynomial, relative error under 3e-7.
//! Results differ from the stock ops by float rounding, which is why this is a
//! kernel choice (`Kernels`) and the stock path stays for exact parity runs.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::error::Result;

/// Which formulation of the exp-based ops a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// MLX's own `sigmoid` and `fast::scaled_dot_product_attention`:
    /// bit-identical to mlx-lm.
    #[default]
    Stock,
    /// This module's exp, SiLU and attention: f32 activations on the CPU.
    CpuTuned,
}

/// Adding 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to the nearest
/// integer, which then sits in the low mantissa bits of the sum; the extra
/// 127 is the exponent bias, so those bits are already `n + 127`.
const ROUND_BIASED: f32 = 12_582_912.0 + 127.0;
/// 2^f on [-1/2, 1/2], lowest order first: a least-squares fit of relative
/// error at Chebyshev nodes (max relative error 7.7e-8).
const EXP2_POLY: [f32; 6] = [
    1.000_000_1,
    0.693_146_95,
    0.240_221_22,
    0.055_507_427,
    0.009_675_46,
    0.001_326_697,
];

fn scalar(x: f32) -> Array {
    Array::from_f32(x)
}

/// `2^t` for an f32 array in 16 elementwise passes, relative error under
/// 2e-7. Below -126.5 the result is exactly 0 (so `-inf` mask entries vanish
/// from a softmax, and the subnormal range is flushed); above 127 it
/// saturates at 2^127 (about 1.7e38) instead of overflowing.
pub fn exp2(t: &Array) -> Result<Array> {
    let t = ops::clip(t, (-127.0f32, 127.0f32))?;
    let y = ops::add(&t, scalar(ROUND_BIASED))?;
    let f = ops::subtract(&t, ops::subtract(&y, scalar(ROUND_BIASED))?)?;
    let mut p = ops::add(
        ops::multiply(&f, scalar(EXP2_POLY[5]))?,
        scalar(EXP2_POLY[4]),
    )?;
    for c in EXP2_POLY[..4].iter().rev() {
        p = ops::add(ops::multiply(&p, &f)?, scalar(*c))?;
    }
    // y's low 9 bits are n + 127; shifting them into the exponent field (an
    // unsigned multiply, which wraps, drops the rest) gives 2^n, and n = -127
    // gives +0.0.
    let two_n = ops::multiply(
        y.view_dtype(Dtype::Uint32)?,
        Array::from_slice(&[1u32 << 23], &[1]),
    )?;
    Ok(ops::multiply(&p, two_n.view_dtype(Dtype::Float32)?)?)
}

/// Below these sizes MLX's per-op dispatch (~10 µs) outweighs the scalar exp
/// it saves: the ~20 ops of `exp2` and its use lose to one `sigmoid` on a decode
/// step of a few rows (measured on the default model's shapes; SiLU breaks
/// even at ~8 rows of 1536, attention at ~4 rows of 9 heads x 192 keys).
const MIN_TUNED_SILU: usize = 8 * 1024;
const MIN_TUNED_SCORES: usize = 6 * 1024;

/// `silu(gate) * up` = `gate * up / (1 + e^-gate)`.
pub fn silu_mul(gate: &Array, up: &Array) -> Result<Array> {
    if gate.size() < MIN_TUNED_SILU {
        return Ok(ops::multiply(
            ops::multiply(gate, ops::sigmoid(gate)?)?,
            up,
        )?);
    }
    let e = exp2(&ops::multiply(gate, scalar(-std::f32::consts::LOG2_E))?)?;
    let denom = ops::add(e, scalar(1.0))?;
    Ok(ops::divide(ops::multiply(gate, up)?, &denom)?)
}

/// `softmax(q k^T * scale + mask) v` for grouped-query heads.
///
/// `q` is `[B, Hq, T, D]`, `k`/`v` are `[B, Hkv, S, D]` with `Hq` a multiple
/// of `Hkv` (query head `h` reads kv head `h / (Hq / Hkv)`, as in MLX), and
/// `mask` is additive (0 or -inf), `[B, 1, 1, T, S]` or `[T, S]`, and causal:
/// the `T` queries are the last `T` columns and none sees a column after its
/// own. The `Hq / Hkv` query heads sharing a kv head go through one matmul, so
/// K and V are never repeated; a long run of queries is split into blocks that
/// each read only the columns up to their last query (a causal prefill does
/// about half the score work, and the score buffers stay block-sized).
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<&Array>,
) -> Result<Array> {
    let (b, hq, t, s) = (q.dim(0), q.dim(1), q.dim(2), k.dim(2));
    let scores = [b, hq, t, s].iter().map(|&n| n as usize).product::<usize>();
    if scores < MIN_TUNED_SCORES {
        use mlx_rs::fast::scaled_dot_product_attention as sdpa;
        return Ok(match mask {
            None => sdpa(q, k, v, scale, None, None)?,
            Some(m) if m.ndim() == 2 => sdpa(q, k, v, scale, m, None)?,
            Some(m) => sdpa(q, k, v, scale, &m.reshape(&[b, 1, t, s])?, None)?,
        });
    }
    let blocks = (t / MIN_QUERY_BLOCK).min(MAX_QUERY_BLOCKS);
    if blocks < 2 {
        return grouped_attention_exp2(q, k, v, scale, mask);
    }
    let step = (t + blocks - 1) / blocks;
    let mut outs = Vec::with_capacity(blocks as usize);
    for q0 in (0..t).step_by(step as usize) {
        let q1 = (q0 + step).min(t);
        let seen = s - t + q1;
        let qb = q.try_index((.., .., q0..q1, ..))?;
        let kb = k.try_index((.., .., ..seen, ..))?;
        let vb = v.try_index((.., .., ..seen, ..))?;
        let mb = match mask {
            None => None,
            Some(m) if m.ndim() == 2 => Some(m.try_index((q0..q1, ..seen))?),
            Some(m) => Some(m.try_index((.., .., .., q0..q1, ..seen))?),
        };
        outs.push(grouped_attention_exp2(&qb, &kb, &vb, scale, mb.as_ref())?);
    }
    Ok(ops::concatenate(&outs, 2)?)
}

/// Query blocks for long prefills: at least this many queries per block (below
/// it MLX's per-op dispatch eats the saving) and at most this many blocks
/// (past it the saving grows little: n blocks do (n + 1) / 2n of the work).
const MIN_QUERY_BLOCK: i32 = 64;
const MAX_QUERY_BLOCKS: i32 = 8;

fn grouped_attention_exp2(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<&Array>,
) -> Result<Array> {
    let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (hkv, s) = (k.dim(1), k.dim(2));
    let rep = hq / hkv;
    // Scores come out in log2 units, so the softmax needs 2^x, not e^x.
    let qg = ops::multiply(q, scalar(scale * std::f32::consts::LOG2_E))?.reshape(&[
        b,
        hkv,
        rep * t,
        d,
    ])?;
    let mut scores = ops::matmul(&qg, k.swap_axes(-1, -2)?)?;
    if let Some(m) = mask {
        scores =
            ops::add(scores.reshape(&[b, hkv, rep, t, s])?, m)?.reshape(&[b, hkv, rep * t, s])?;
    }
    let max = scores.max_axis(-1, true)?;
    let e = exp2(&ops::subtract(&scores, &max)?)?;
    // Normalising after the value matmul divides D columns instead of S.
    let out = ops::divide(ops::matmul(&e, v)?, e.sum_axis(-1, true)?)?;
    Ok(out.reshape(&[b, hq, t, d])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<f32> {
        a.as_slice::<f32>().to_vec()
    }

    #[test]
    fn exp2_matches_libm_to_float_precision() {
        let xs: Vec<f32> = (-12600..=12600).map(|i| i as f32 * 0.01).collect();
        let got = values(&exp2(&Array::from_slice(&xs, &[xs.len() as i32])).unwrap());
        for (x, g) in xs.iter().zip(&got) {
            let want = (*x as f64).exp2();
            let rel = ((*g as f64) - want).abs() / want;
            assert!(rel < 3e-7, "exp({x}) = {g}, want {want} (rel {rel:e})");
        }
    }

    #[test]
    fn exp2_saturates_instead_of_producing_nan() {
        let xs = [f32::NEG_INFINITY, -1e30, -130.0, 130.0, 1e30];
        let got = values(&exp2(&Array::from_slice(&xs, &[5])).unwrap());
        assert_eq!(&got[..3], &[0.0, 0.0, 0.0]);
        assert!(got[3..].iter().all(|g| g.is_finite() && *g > 1.5e38));
    }

    #[test]
    fn silu_mul_matches_definition() {
        let g: Vec<f32> = (-400..400).map(|i| i as f32 * 0.05).collect();
        let u: Vec<f32> = g.iter().map(|x| 1.5 - x * 0.3).collect();
        let n = g.len() as i32;
        let got =
            values(&silu_mul(&Array::from_slice(&g, &[n]), &Array::from_slice(&u, &[n])).unwrap());
        for ((g, u), y) in g.iter().zip(&u).zip(&got) {
            let (g64, u64) = (*g as f64, *u as f64);
            let want = g64 / (1.0 + (-g64).exp()) * u64;
            assert!(
                ((*y as f64) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "silu({g})*{u}"
            );
        }
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        ops::abs(ops::subtract(a, b).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .as_slice::<f32>()[0]
    }

    fn normal(seed: u64, shape: &[i32]) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    /// Additive `[T, S]` causal bias: query `qi` sees columns up to `S - T + qi`.
    fn causal_bias(t: i32, s: i32) -> Vec<f32> {
        (0..t)
            .flat_map(|qi| {
                (0..s).map(move |j| {
                    if j <= s - t + qi {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect()
    }

    fn additive(visible: &[bool]) -> Vec<f32> {
        visible
            .iter()
            .map(|&ok| if ok { 0.0 } else { f32::NEG_INFINITY })
            .collect()
    }

    #[test]
    fn long_query_runs_split_into_blocks_match_mlx_sdpa() {
        use mlx_rs::fast::{scaled_dot_product_attention as sdpa, ScaledDotProductAttentionMask};
        // 200 queries after 30 cached columns: three query blocks.
        let (b, hq, hkv, t, s, d) = (2, 4, 2, 200, 230, 16);
        let (q, k, v) = (
            normal(11, &[b, hq, t, d]),
            normal(12, &[b, hkv, s, d]),
            normal(13, &[b, hkv, s, d]),
        );
        let causal = causal_bias(t, s);
        let want = sdpa(
            &q,
            &k,
            &v,
            0.25,
            ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap();
        let got = attention(&q, &k, &v, 0.25, Some(&Array::from_slice(&causal, &[t, s]))).unwrap();
        let diff = max_diff(&want, &got);
        assert!(diff < 1e-5, "causal: max |sdpa - attention| = {diff}");

        // Row 1 is left-padded by 40 columns (a padding query sees itself, as
        // in `KvCache`, so no row is fully masked).
        let mut visible = Vec::new();
        for row in 0..b {
            for qi in 0..t {
                for j in 0..s {
                    visible.push(j <= s - t + qi && (row == 0 || j >= 40) || j == s - t + qi);
                }
            }
        }
        let additive = additive(&visible);
        let want = sdpa(
            &q,
            &k,
            &v,
            0.25,
            &Array::from_slice(&visible, &[b, 1, t, s]),
            None,
        )
        .unwrap();
        let got = attention(
            &q,
            &k,
            &v,
            0.25,
            Some(&Array::from_slice(&additive, &[b, 1, 1, t, s])),
        )
        .unwrap();
        let diff = max_diff(&want, &got);
        assert!(diff < 1e-5, "padded: max |sdpa - attention| = {diff}");
    }

    #[test]
    fn attention_matches_mlx_sdpa_with_gqa_and_mask() {
        use mlx_rs::fast;
        let (b, hq, hkv, t, s, d) = (2, 6, 2, 3, 7, 8);
        let q = normal(0, &[b, hq, t, d]);
        let k = normal(1, &[b, hkv, s, d]);
        let v = normal(2, &[b, hkv, s, d]);
        // Row 0 sees everything up to its query's column, row 1 has 2 padding columns.
        let mut visible = Vec::new();
        for row in 0..b {
            for qi in 0..t {
                for j in 0..s {
                    visible.push(j <= s - t + qi && (row == 0 || j >= 2));
                }
            }
        }
        let additive = additive(&visible);
        let bool_mask = Array::from_slice(&visible, &[b, 1, t, s]);
        let add_mask = Array::from_slice(&additive, &[b, 1, 1, t, s]);
        let want = fast::scaled_dot_product_attention(&q, &k, &v, 0.35, &bool_mask, None).unwrap();
        let got = grouped_attention_exp2(&q, &k, &v, 0.35, Some(&add_mask)).unwrap();
        let diff = max_diff(&want, &got);
        assert!(diff < 1e-5, "max |sdpa - attention| = {diff}");

        // Without padding the mask is one `[T, S]` causal block for all rows.
        let causal = causal_bias(t, s);
        let causal = Array::from_slice(&causal, &[t, s]);
        let want = fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            0.35,
            fast::ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap();
        let got = grouped_attention_exp2(&q, &k, &v, 0.35, Some(&causal)).unwrap();
        let diff = max_diff(&want, &got);
        assert!(diff < 1e-5, "causal: max |sdpa - attention| = {diff}");
    }
}
