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
/// integer, which then sits in the low mantissa bits of the sum.
const ROUND_MAGIC: f32 = 12_582_912.0;
const ROUND_MAGIC_BITS: i32 = 0x4B40_0000;
/// ln 2 split so that `n * LN2_HI` is exact for |n| < 2^12 (Cody-Waite):
/// the reduced argument keeps full precision however large x is.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// e^r on [-ln2/2, ln2/2], lowest order first: a least-squares fit of
/// relative error at Chebyshev nodes (max relative error 1.5e-7 in f32).
const EXP_POLY: [f32; 6] = [
    1.000_000_1,
    0.999_999_64,
    0.499_989,
    0.166_676_63,
    0.041_915_03,
    0.008_291_717,
];

fn scalar(x: f32) -> Array {
    Array::from_f32(x)
}

/// `e^(k * x)` for an f32 array, relative error under 3e-7. Arguments below
/// about -87.7 give exactly 0 (so `-inf` mask entries vanish from a softmax, and the
/// subnormal range is flushed), above +88 they saturate at about 1.6e38.
pub fn exp_scaled(x: &Array, k: f32) -> Result<Array> {
    let kx = if k == 1.0 {
        x.clone()
    } else {
        ops::multiply(x, scalar(k))?
    };
    let kx = ops::clip(&kx, (-88.0f32, 88.0f32))?;
    // n = round(kx / ln 2), kept both as a float and in the sum's low bits.
    let y = ops::add(
        ops::multiply(&kx, scalar(std::f32::consts::LOG2_E))?,
        scalar(ROUND_MAGIC),
    )?;
    let n = ops::subtract(&y, scalar(ROUND_MAGIC))?;
    let r = ops::subtract(
        ops::subtract(&kx, ops::multiply(&n, scalar(LN2_HI))?)?,
        ops::multiply(&n, scalar(LN2_LO))?,
    )?;
    let mut p = ops::add(ops::multiply(&r, scalar(EXP_POLY[5]))?, scalar(EXP_POLY[4]))?;
    for c in EXP_POLY[..4].iter().rev() {
        p = ops::add(ops::multiply(&p, &r)?, scalar(*c))?;
    }
    // (n + 127) << 23 is the bit pattern of 2^n; n = -127 gives +0.0.
    let bits = ops::multiply(
        ops::subtract(
            y.view_dtype(Dtype::Int32)?,
            Array::from_int(ROUND_MAGIC_BITS - 127),
        )?,
        Array::from_int(1 << 23),
    )?;
    Ok(ops::multiply(&p, bits.view_dtype(Dtype::Float32)?)?)
}

/// `silu(gate) * up` = `gate * up / (1 + e^-gate)`.
pub fn silu_mul(gate: &Array, up: &Array) -> Result<Array> {
    let denom = ops::add(exp_scaled(gate, -1.0)?, scalar(1.0))?;
    Ok(ops::divide(ops::multiply(gate, up)?, &denom)?)
}

/// `softmax(q k^T * scale + mask) v` for grouped-query heads.
///
/// `q` is `[B, Hq, T, D]`, `k`/`v` are `[B, Hkv, S, D]` with `Hq` a multiple
/// of `Hkv` (query head `h` reads kv head `h / (Hq / Hkv)`, as in MLX), and
/// `mask` is additive (0 or -inf), broadcastable to `[B, 1, 1, T, S]`.
/// The `Hq / Hkv` query heads sharing a kv head go through one matmul, so K and
/// V are never repeated.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<&Array>,
) -> Result<Array> {
    let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (hkv, s) = (k.dim(1), k.dim(2));
    let rep = hq / hkv;
    let qg = ops::multiply(q, scalar(scale))?.reshape(&[b, hkv, rep * t, d])?;
    let mut scores = ops::matmul(&qg, k.swap_axes(-1, -2)?)?;
    if let Some(m) = mask {
        scores =
            ops::add(scores.reshape(&[b, hkv, rep, t, s])?, m)?.reshape(&[b, hkv, rep * t, s])?;
    }
    let max = scores.max_axis(-1, true)?;
    let e = exp_scaled(&ops::subtract(&scores, &max)?, 1.0)?;
    let p = ops::divide(&e, e.sum_axis(-1, true)?)?;
    Ok(ops::matmul(&p, v)?.reshape(&[b, hq, t, d])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<f32> {
        a.as_slice::<f32>().to_vec()
    }

    #[test]
    fn exp_matches_libm_to_float_precision() {
        let xs: Vec<f32> = (-8700..=8700).map(|i| i as f32 * 0.01).collect();
        let got = values(&exp_scaled(&Array::from_slice(&xs, &[xs.len() as i32]), 1.0).unwrap());
        for (x, g) in xs.iter().zip(&got) {
            let want = (*x as f64).exp();
            let rel = ((*g as f64) - want).abs() / want;
            assert!(rel < 3e-7, "exp({x}) = {g}, want {want} (rel {rel:e})");
        }
    }

    #[test]
    fn exp_saturates_instead_of_producing_nan() {
        let xs = [f32::NEG_INFINITY, -1e30, -100.0, 100.0, 1e30];
        let got = values(&exp_scaled(&Array::from_slice(&xs, &[5]), 1.0).unwrap());
        assert_eq!(&got[..3], &[0.0, 0.0, 0.0]);
        assert!(got[3..].iter().all(|g| g.is_finite() && *g > 1e38));
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

    #[test]
    fn attention_matches_mlx_sdpa_with_gqa_and_mask() {
        use mlx_rs::fast;
        let (b, hq, hkv, t, s, d) = (2, 6, 2, 3, 7, 8);
        let normal = |seed: u64, shape: &[i32]| {
            let key = mlx_rs::random::key(seed).unwrap();
            mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
        };
        let q = normal(0, &[b, hq, t, d]);
        let k = normal(1, &[b, hkv, s, d]);
        let v = normal(2, &[b, hkv, s, d]);
        // Row 0 sees everything up to its query's column, row 1 has 2 padding columns.
        let mut visible = Vec::new();
        let mut additive = Vec::new();
        for row in 0..b {
            for qi in 0..t {
                for j in 0..s {
                    let ok = j <= s - t + qi && (row == 0 || j >= 2);
                    visible.push(ok);
                    additive.push(if ok { 0.0f32 } else { f32::NEG_INFINITY });
                }
            }
        }
        let bool_mask = Array::from_slice(&visible, &[b, 1, t, s]);
        let add_mask = Array::from_slice(&additive, &[b, 1, 1, t, s]);
        let want = fast::scaled_dot_product_attention(&q, &k, &v, 0.35, &bool_mask, None).unwrap();
        let got = attention(&q, &k, &v, 0.35, Some(&add_mask)).unwrap();
        let diff = ops::abs(ops::subtract(&want, &got).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .as_slice::<f32>()[0];
        assert!(diff < 1e-5, "max |sdpa - attention| = {diff}");
    }
}
