//! Decode attention straight over the paged KV pool, as a custom CUDA kernel.
//!
//! Gathering every row's blocks into a padded `[B, kv_heads, L, head_dim]`
//! layout and running masked SDPA over it costs far more than the attention
//! itself on a GPU (measured on an H200, `benches/paged_attention_probe.py`:
//! at 256 rows of 2K context, 7.5 ms per layer against 0.4 ms for SDPA over a
//! dense cache). This kernel reads K and V where they are: one warp per
//! (row, query head, query position, context split) walks the row's block
//! table, keeps an online softmax in registers and writes a partial result;
//! the splits (chosen so that rows x heads x splits fill the GPU) are then
//! merged by a second small kernel, in the query's dtype (two launches per
//! layer instead of a chain of MLX reductions). Query heads that share a KV head are
//! neighbouring warps of one thread block, so they read the same K/V lines
//! through L1.
//!
//! It is compiled once per (head_dim, block_size, kv_heads, dtype) by MLX's
//! NVRTC path (`mlx_fast_cuda_kernel`); batch size, context and splits are
//! runtime values, so a serving run compiles it once.
//!
//! Queries of a row see the keys `0 ..= start + t` (`start` is the row's
//! length before the step, `t` the query's index in the step); queries past a
//! row's `tokens` (padding of a ragged decode step) repeat its last query.

use mlx_rs::{Array, Dtype};

use weft_kv_pool::storage::{AffineQuant, QuantPool};

use crate::cuda_kernel::Kernel;
use crate::error::{ModelError, Result};

/// The decode kernel's body; `LOAD_K` and `LOAD_V` read the lane's `E`
/// elements of the key's (or value's) head vector at token slot `slot` into
/// `kv` as f32 ([`DENSE_LOAD`] or [`QUANT_LOAD`]).
const SOURCE: &str = r#"
    const int B = q_shape[0];
    const int HQ = q_shape[1];
    const int TQ = q_shape[2];
    const int MAXB = table_shape[1];
    const int S = gridDim.y;
    const int s = blockIdx.y;
    constexpr int E = 8;
    constexpr int L = HD / E;
    constexpr int KPW = 32 / L;
    const int GRP = HQ / KVH;
    const int NCH = GRP / GQ;
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= B * KVH * NCH * TQ) {
        return;
    }
    const int t = w % TQ;
    const int ch = (w / TQ) % NCH;
    const int h = (w / (TQ * NCH)) % KVH;
    const int b = w / (TQ * NCH * KVH);
    const int hq0 = h * GRP + ch * GQ;
    const int nt = ntok[b];
    const int tq = t < nt ? t : nt - 1;
    const int len = start[b] + tq + 1;
    const int chunk = ((MAXB * BS + S - 1) / S + BS - 1) / BS * BS;
    const int k0 = s * chunk;
    const int k1 = min(len, k0 + chunk);
    const int sub = lane % L;
    const int kg = lane / L;
    const float qscale = scale[0];
    const float NEG = __int_as_float(0xff800000);
    float qv[GQ][E];
    float acc[GQ][E];
    float m[GQ];
    float l[GQ];
    #pragma unroll
    for (int g = 0; g < GQ; ++g) {
        const size_t qb = ((size_t)(b * HQ + hq0 + g) * TQ + t) * HD + sub * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            qv[g][e] = static_cast<float>(q[qb + e]) * qscale;
            acc[g][e] = 0.f;
        }
        m[g] = NEG;
        l[g] = 0.f;
    }
    const int* row_table = table + (size_t)b * MAXB;
    for (int kb = k0; kb < k1; kb += KPW) {
        const int key = kb + kg;
        const bool valid = key < k1;
        float kv[E];
        size_t slot = 0;
        if (valid) {
            const int blk = row_table[key / BS];
            slot = ((size_t)blk * KVH + h) * BS + key % BS;
            LOAD_K
        } else {
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[e] = 0.f;
            }
        }
        float d[GQ];
        #pragma unroll
        for (int g = 0; g < GQ; ++g) {
            float x = 0.f;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                x += qv[g][e] * kv[e];
            }
            d[g] = x;
        }
        #pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) {
            #pragma unroll
            for (int g = 0; g < GQ; ++g) {
                d[g] += __shfl_xor_sync(0xffffffffu, d[g], o);
            }
        }
        if (valid) {
            LOAD_V
            #pragma unroll
            for (int g = 0; g < GQ; ++g) {
                const float mn = fmaxf(m[g], d[g]);
                const float c = __expf(m[g] - mn);
                const float p = __expf(d[g] - mn);
                l[g] = l[g] * c + p;
                #pragma unroll
                for (int e = 0; e < E; ++e) {
                    acc[g][e] = acc[g][e] * c + p * kv[e];
                }
                m[g] = mn;
            }
        }
    }
    #pragma unroll
    for (int o = L; o < 32; o <<= 1) {
        #pragma unroll
        for (int g = 0; g < GQ; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float c1 = m[g] == NEG ? 0.f : __expf(m[g] - mn);
            const float c2 = mo == NEG ? 0.f : __expf(mo - mn);
            l[g] = l[g] * c1 + lo * c2;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                acc[g][e] = acc[g][e] * c1 + ao * c2;
            }
            m[g] = mn;
        }
    }
    if (kg == 0) {
        #pragma unroll
        for (int g = 0; g < GQ; ++g) {
            const size_t part = ((size_t)(b * HQ + hq0 + g) * TQ + t) * S + s;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                o_part[part * HD + sub * E + e] = acc[g][e];
            }
            if (sub == 0) {
                m_part[part] = m[g];
                l_part[part] = l[g];
            }
        }
    }
"#;

/// A dense pool's read: `P_pool` `[blocks, KVH, BS, HD]` in the dtype.
const DENSE_LOAD: &str = r#"
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[e] = static_cast<float>(P_pool[slot * HD + sub * E + e]);
            }
"#;

/// A quantized pool's read (MLX affine, `BITS` 4 or 8, groups of `G`, a
/// multiple of `E`): the lane's `E` elements share one group's scale and
/// bias, and take `E * BITS / 32` whole words of `P_packed` (element `i` of a
/// word in its bits `i * BITS ..`); each is `scale * q + bias`, in f32.
const QUANT_LOAD: &str = r#"
            {
                const size_t gi = slot * (HD / G) + (sub * E) / G;
                const float sc = static_cast<float>(P_scales[gi]);
                const float bi = static_cast<float>(P_biases[gi]);
                const uint32_t* pw = P_packed + slot * (HD * BITS / 32) + (sub * E * BITS) / 32;
                #pragma unroll
                for (int e = 0; e < E; ++e) {
                    const uint32_t word = pw[(e * BITS) / 32];
                    const uint32_t qq = (word >> ((e * BITS) % 32)) & ((1u << BITS) - 1u);
                    kv[e] = sc * static_cast<float>(qq) + bi;
                }
            }
"#;

/// The decode kernel's source reading dense or quantized pools.
pub fn decode_source(quantized: bool) -> String {
    let load = if quantized { QUANT_LOAD } else { DENSE_LOAD };
    crate::cuda_kernel::compact(
        &SOURCE
            .replace("LOAD_K", &load.replace("P_", "k_"))
            .replace("LOAD_V", &load.replace("P_", "v_")),
    )
}

/// Input names of [`decode_source`]'s kernel.
pub fn decode_inputs(quantized: bool) -> Vec<&'static str> {
    let pools: &[&str] = if quantized {
        &[
            "k_packed", "k_scales", "k_biases", "v_packed", "v_scales", "v_biases",
        ]
    } else {
        &["k_pool", "v_pool"]
    };
    let mut v = vec!["q"];
    v.extend(pools);
    v.extend(["table", "start", "ntok", "scale"]);
    v
}

/// Merges the splits of every warp's partial result in one launch (instead
/// of a chain of MLX reductions): one warp per (row, head, query), each lane
/// `HD / 32` output elements, written in the query's dtype.
const COMBINE_SOURCE: &str = r#"
    const int W = m_part_shape[0];
    const int S = m_part_shape[1];
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= W) {
        return;
    }
    constexpr int E = HD / 32;
    float mx = __int_as_float(0xff800000);
    for (int s = 0; s < S; ++s) {
        mx = fmaxf(mx, m_part[(size_t)w * S + s]);
    }
    float acc[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        acc[e] = 0.f;
    }
    float den = 0.f;
    for (int s = 0; s < S; ++s) {
        const size_t part = (size_t)w * S + s;
        const float c = __expf(m_part[part] - mx);
        den += c * l_part[part];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[e] += c * o_part[part * HD + lane * E + e];
        }
    }
    const float inv = 1.f / den;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        out[(size_t)w * HD + lane * E + e] = acc[e] * inv;
    }
"#;

/// Warps one thread block runs (neighbouring query heads of one KV head).
const WARPS_PER_BLOCK: i32 = 4;
/// Aim for at least this many warps in flight (an H200 has 132 SMs).
const TARGET_WARPS: usize = 4096;
/// Fewest keys a context split should cover.
const MIN_SPLIT_KEYS: usize = 128;
/// Most splits of one row's context.
const MAX_SPLITS: usize = 64;

/// The compiled kernel; lives on the engine thread with the model.
pub struct PagedAttention {
    kernel: Kernel,
    /// The same over quantized pools.
    quantized: Kernel,
    combine: Kernel,
}

/// The pools a decode reads: dense K and V, or quantized ones.
#[derive(Clone, Copy)]
pub enum Pools<'a> {
    Dense(&'a Array, &'a Array),
    Quantized(QuantPool<'a>, QuantPool<'a>),
}

impl<'a> Pools<'a> {
    /// One layer's pools from its arrays in `KvStorage::pool_arrays` order
    /// (K then V: one array each dense, packed / scales / biases quantized).
    pub fn from_arrays(a: &'a [Array], quant: Option<AffineQuant>) -> Result<Self> {
        match (a, quant) {
            ([k, v], None) => Ok(Self::Dense(k, v)),
            ([kp, ks, kb, vp, vs, vb], Some(q)) => Ok(Self::Quantized(
                QuantPool {
                    packed: kp,
                    scales: ks,
                    biases: kb,
                    quant: q,
                },
                QuantPool {
                    packed: vp,
                    scales: vs,
                    biases: vb,
                    quant: q,
                },
            )),
            _ => Err(ModelError::Invalid(format!(
                "paged decode: {} pool arrays for {quant:?}",
                a.len()
            ))),
        }
    }
}

/// How many context splits a decode step of `warps` warps (rows x query
/// heads x query positions) over at most `keys` keys per row should use.
pub fn splits_for(warps: usize, keys: usize) -> usize {
    splits_with(warps, keys, min_split_keys())
}

/// [`MIN_SPLIT_KEYS`], or `WEFT_SPLIT_KEYS` (a measurement knob: fewer keys
/// per split give a small batch more warps, each a shorter walk).
fn min_split_keys() -> usize {
    static KEYS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEYS.get_or_init(|| {
        std::env::var("WEFT_SPLIT_KEYS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|&k: &usize| k >= 8)
            .unwrap_or(MIN_SPLIT_KEYS)
    })
}

fn splits_with(warps: usize, keys: usize, min_keys: usize) -> usize {
    let by_occupancy = TARGET_WARPS.div_ceil(warps.max(1));
    let by_length = keys.div_ceil(min_keys).max(1);
    by_occupancy.min(by_length).clamp(1, MAX_SPLITS)
}

impl PagedAttention {
    /// Builds the kernel objects (compilation happens at the first use).
    pub fn new() -> Result<Self> {
        Ok(Self {
            kernel: Kernel::new(
                "weft_paged_decode",
                &decode_inputs(false),
                &["o_part", "m_part", "l_part"],
                &decode_source(false),
            )?,
            quantized: Kernel::new(
                "weft_paged_decode_quantized",
                &decode_inputs(true),
                &["o_part", "m_part", "l_part"],
                &decode_source(true),
            )?,
            combine: Kernel::new(
                "weft_paged_combine",
                &["o_part", "m_part", "l_part"],
                &["out"],
                COMBINE_SOURCE,
            )?,
        })
    }

    /// Attention of `q` `[B, HQ, T, D]`, scaled by `scale` (`[1]` f32) in the
    /// kernel, over each row's paged context. The pools are `[num_blocks,
    /// KVH, BS, D]` when dense; quantized, `packed` is `[num_blocks, KVH, BS,
    /// D * bits / 32]` and the scales and biases `[num_blocks, KVH, BS, D /
    /// group]`, dequantized as they are read.
    /// `table` `[B, max_blocks]` int32, `start` and `ntok` `[B]` int32 (the
    /// row's length before the step and its tokens in the step; T >= every
    /// `ntok`). `max_keys` bounds `start + ntok` over the batch (it sizes the
    /// splits). Returns `[B, HQ, T, D]` in `q`'s dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        q: &Array,
        pools: Pools<'_>,
        table: &Array,
        start: &Array,
        ntok: &Array,
        scale: &Array,
        max_keys: usize,
    ) -> Result<Array> {
        let out = q.shape().to_vec();
        self.run(q, pools, table, start, ntok, scale, max_keys, &out)
    }

    /// As [`decode`](Self::decode) for one query per row (`q` `[B, HQ, 1,
    /// D]`), returning `[B, HQ * D]`: the layout the output projection takes,
    /// with no reshape between.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_rows(
        &self,
        q: &Array,
        pools: Pools<'_>,
        table: &Array,
        start: &Array,
        ntok: &Array,
        scale: &Array,
        max_keys: usize,
    ) -> Result<Array> {
        let qs = q.shape();
        if qs.len() != 4 || qs[2] != 1 {
            return Err(ModelError::Invalid(format!(
                "paged decode_rows: q {qs:?} is not one query per row"
            )));
        }
        let out = [qs[0], qs[1] * qs[3]];
        self.run(q, pools, table, start, ntok, scale, max_keys, &out)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        q: &Array,
        pools: Pools<'_>,
        table: &Array,
        start: &Array,
        ntok: &Array,
        scale: &Array,
        max_keys: usize,
        out_shape: &[i32],
    ) -> Result<Array> {
        let qs = q.shape();
        // [blocks, KVH, BS, D] (the packed pool's last axis is D * bits / 32).
        let (ps, d_pool) = match pools {
            Pools::Dense(k, _) => (k.shape(), k.shape().last().copied().unwrap_or(0)),
            Pools::Quantized(k, _) => {
                let s = k.packed.shape();
                (
                    s,
                    s.last().copied().unwrap_or(0) * 32 / i32::from(k.quant.bits),
                )
            }
        };
        if qs.len() != 4 || ps.len() != 4 || qs[3] != d_pool || !matches!(qs[3], 64 | 128 | 256) {
            return Err(ModelError::Invalid(format!(
                "paged decode: q {qs:?} / pool {ps:?} (head_dim must match and be 64, 128 or 256)"
            )));
        }
        let (b, hq, t, d) = (qs[0], qs[1], qs[2], qs[3]);
        let (kvh, bs) = (ps[1], ps[2]);
        if hq % kvh != 0 {
            return Err(ModelError::Invalid(format!(
                "paged decode: {hq} query heads over {kvh} KV heads"
            )));
        }
        // Query heads a warp serves (all its KV head's, up to 8: each lane
        // keeps 8 elements of each one's query and output in registers).
        let group = hq / kvh;
        let gq = (1..=group.min(8))
            .rev()
            .find(|g| group % g == 0)
            .unwrap_or(1);
        let warps = (b * kvh * (group / gq) * t) as usize;
        let s = splits_for(warps, max_keys) as i32;
        let threads = 32 * WARPS_PER_BLOCK;
        let grid_x = (warps.div_ceil(WARPS_PER_BLOCK as usize) as i32) * threads;
        // Both kernels index the parts linearly; the combine kernel reads
        // them as [W, S, D] and [W, S] (no reshape primitive between).
        let w_all = b * hq * t;
        let o_shape = [w_all, s, d];
        let ml_shape = [w_all, s];
        let dtype = q.dtype();
        let mut ints = vec![("HD", d), ("BS", bs), ("KVH", kvh), ("GQ", gq)];
        let (kernel, inputs) = match pools {
            Pools::Dense(k, v) => (&self.kernel, vec![q, k, v, table, start, ntok, scale]),
            Pools::Quantized(k, v) => {
                ints.extend([
                    ("BITS", i32::from(k.quant.bits)),
                    ("G", i32::from(k.quant.group_size)),
                ]);
                let ins = vec![
                    q, k.packed, k.scales, k.biases, v.packed, v.scales, v.biases, table, start,
                    ntok, scale,
                ];
                (&self.quantized, ins)
            }
        };
        let parts = kernel.apply(
            &inputs,
            &[
                (&o_shape, Dtype::Float32),
                (&ml_shape, Dtype::Float32),
                (&ml_shape, Dtype::Float32),
            ],
            (grid_x, s),
            threads,
            &ints,
            ("DT", dtype),
        )?;
        let [o, m, l]: [Array; 3] = parts
            .try_into()
            .map_err(|_| ModelError::Invalid("paged decode: expected 3 outputs".into()))?;
        let combine_x = ((w_all as usize).div_ceil(WARPS_PER_BLOCK as usize) as i32) * threads;
        let mut out = self.combine.apply(
            &[&o, &m, &l],
            &[(out_shape, dtype)],
            (combine_x, 1),
            threads,
            &[("HD", d)],
            ("DT", dtype),
        )?;
        out.pop()
            .ok_or_else(|| ModelError::Invalid("paged combine: no output".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_gpu_but_not_past_the_context() {
        // 256 rows x 32 heads already fill it.
        let k = MIN_SPLIT_KEYS;
        assert_eq!(splits_with(256 * 32, 8192, k), 1);
        // One row of 8K context: split, but each split keeps >= 128 keys.
        assert_eq!(splits_with(32, 8192, k), 64);
        assert_eq!(splits_with(32, 512, k), 4);
        assert_eq!(splits_with(32, 1, k), 1);
        assert_eq!(splits_with(32, 512, 32), 16);
    }
}
