//! Fused one-token decode kernels for the compiled GPU decode step: fewer
//! MLX primitives per layer, because on the GPU a decode step's time is the
//! host's (MLX builds and encodes every primitive of the graph, measured at
//! ~3-4 us each on the H200's host; the device waits for it, see
//! benches/RESULTS.md).
//!
//! A Llama layer of a one-token step, op by op, is ~28 primitives (norm,
//! matmul, reshape, split, three transposes, two RoPEs, four reshapes and two
//! scatters for the K/V write, two attention kernels, ...). With these
//! kernels it is 12: `add_rms_norm` (residual add and the next norm in one
//! pass), the QKV matmul, `rope_qkv` (RoPE of the query and key heads read
//! straight from the fused projection, written in the shapes the attention
//! kernel and the pool's scatter take), two scatters, the paged attention
//! (two kernels, output already `[B, heads * head_dim]`), the output matmul,
//! `add_rms_norm`, the gate/up matmul, `silu_mul` (read from the fused
//! projection, no split), the down matmul.
//!
//! Each kernel rounds where MLX's own ops round (the residual sum to the
//! model dtype before its norm; the norm's `x * rsqrt(mean(x^2) + eps)` to
//! the dtype before the weight; RoPE in f32 with MLX's `exp2(-d * log2
//! base)` frequencies; sigmoid, `g * sigmoid(g)` and the product each in the
//! dtype), so fused and op-by-op steps agree to within bf16 rounding of the
//! matmuls' different reduction orders (`examples/fused_decode_check.rs`
//! measures it on the GPU). They are CUDA only (MLX's NVRTC path); the CPU
//! runs the op-by-op layer.

use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::Kernel;
use crate::error::{ModelError, Result};
use crate::gemv::{Gemv, Post, Pre};
use crate::linear::Linear;

/// `sum = h + a` (in the dtype), `normed = rms_norm(sum) * w`: one thread
/// block per row.
const ADD_NORM_SOURCE: &str = r#"
    const int N = h_shape[0];
    const int H = h_shape[1];
    const int row = blockIdx.x;
    if (row >= N) {
        return;
    }
    const size_t base = (size_t)row * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const DT s = static_cast<DT>(
            static_cast<float>(h[base + i]) + static_cast<float>(a[base + i]));
        sum[base + i] = s;
        const float f = static_cast<float>(s);
        ss += f * f;
    }
    __shared__ float red[32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    if ((threadIdx.x & 31) == 0) {
        red[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, o);
        }
        if (threadIdx.x == 0) {
            red[0] = v;
        }
    }
    __syncthreads();
    const float inv = rsqrtf(red[0] / H + eps[0]);
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const DT y = static_cast<DT>(static_cast<float>(sum[base + i]) * inv);
        normed[base + i] = static_cast<DT>(static_cast<float>(w[i]) * static_cast<float>(y));
    }
"#;

/// RoPE of the query and key heads of a fused `[B, (HQ + 2 KVH) * HD]`
/// projection (MLX's non-traditional layout: element `i` pairs with
/// `i + HD / 2`), the value heads copied: one thread per (row, head, pair).
const ROPE_QKV_SOURCE: &str = r#"
    const int B = qkv_shape[0];
    constexpr int HALF = HD / 2;
    constexpr int NH = HQ + 2 * KVH;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * HALF) {
        return;
    }
    const int i = idx % HALF;
    const int h = (idx / HALF) % NH;
    const int b = idx / (HALF * NH);
    const size_t src = ((size_t)b * NH + h) * HD + i;
    if (h < HQ + KVH) {
        const float x1 = static_cast<float>(qkv[src]);
        const float x2 = static_cast<float>(qkv[src + HALF]);
        const float L = scale[0] * static_cast<float>(start[b]);
        const float theta = L * inv_freq[i];
        const float c = cos(theta);
        const float s = sin(theta);
        const DT r1 = static_cast<DT>(x1 * c - x2 * s);
        const DT r2 = static_cast<DT>(x1 * s + x2 * c);
        if (h < HQ) {
            const size_t dst = ((size_t)b * HQ + h) * HD + i;
            q_out[dst] = r1;
            q_out[dst + HALF] = r2;
        } else {
            const size_t dst = ((size_t)b * KVH + (h - HQ)) * HD + i;
            k_out[dst] = r1;
            k_out[dst + HALF] = r2;
        }
    } else {
        const size_t dst = ((size_t)b * KVH + (h - HQ - KVH)) * HD + i;
        v_out[dst] = qkv[src];
        v_out[dst + HALF] = qkv[src + HALF];
    }
"#;

/// `silu(g) * u` of a fused `[N, 2F]` gate/up projection: one thread per
/// output element.
const SILU_MUL_SOURCE: &str = r#"
    const int N = gu_shape[0];
    const int F = gu_shape[1] / 2;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * F) {
        return;
    }
    const size_t n = idx / F;
    const size_t j = idx % F;
    const float g = static_cast<float>(gu[n * 2 * F + j]);
    const float u = static_cast<float>(gu[n * 2 * F + F + j]);
    const DT sig = static_cast<DT>(1.f / (1.f + expf(-g)));
    const DT gs = static_cast<DT>(g * static_cast<float>(sig));
    out[idx] = static_cast<DT>(static_cast<float>(gs) * u);
"#;

/// The adapted parts (up to three) of a fused projection whose adapters a
/// [`DecodeKernels::lora_add`] adds.
pub const LORA_MAX_PARTS: usize = 3;

/// `y + z[slot] @ b[slot]` over a fused projection's output `y` `[N, O]`:
/// `z` `[N, P * S * R]` is every slot's shrink of the row's input (part,
/// slot, rank order), `slots` `[B]` the slot of each of the `B` rows (`N / B`
/// tokens each), `b{k}` `[S, R, W{k}]` part `k`'s expand, adding to columns
/// `OFF{k} .. OFF{k} + W{k}`. One thread per output element; the delta is
/// rounded to the dtype before the add, as a matmul's output then an add
/// round it. Slot 0 (no adapter) copies `y`.
pub fn lora_add_source(parts: usize) -> String {
    let mut body = String::from(
        r#"
    const int N = y_shape[0];
    const int O = y_shape[1];
    const int B = slots_shape[0];
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * O) {
        return;
    }
    const int n = (int)(idx / O);
    const int j = (int)(idx % O);
    const int s = (int)slots[n / (N / B)];
    float acc = 0.f;
    bool hit = false;
"#,
    );
    body.push_str(&expand_parts(parts, "acc", "s != 0 && ", |k| {
        format!("static_cast<float>(z[(size_t)n * (P * S * R) + (size_t)({k} * S + s) * R + r])")
    }));
    body.push_str(
        r#"
    out[idx] = hit
        ? static_cast<DT>(static_cast<float>(y[idx]) + static_cast<float>(static_cast<DT>(acc)))
        : y[idx];
"#,
    );
    body
}

/// [`lora_add_source`] with the shrink inside: `x` `[N, IN]` is the rows'
/// input and `a` `[IN, P * S * R]` every slot's dense `A`. Thread block
/// `(n, c)` computes row `n`'s shrink by its own slot's `A` (rounded to the
/// dtype, as a matmul's output is), then the expand and add of its chunk
/// `c` of `CHUNK` output columns. One primitive per adapted projection, at
/// the price of the shrink once per chunk (`WEFT_LORA_KERNEL=onepass`).
pub fn lora_onepass_source(parts: usize) -> String {
    let mut body = String::from(
        r#"
    const int N = y_shape[0];
    const int O = y_shape[1];
    const int IN = x_shape[1];
    const int B = slots_shape[0];
    const int CH = (O + CHUNK - 1) / CHUNK;
    const int n = blockIdx.x / CH;
    const int c = blockIdx.x % CH;
    if (n >= N) {
        return;
    }
    const int s = (int)slots[n / (N / B)];
    const int j0 = c * CHUNK;
    const int j1 = min(O, j0 + CHUNK);
    const size_t row = (size_t)n * O;
    if (s == 0) {
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            out[row + j] = y[row + j];
        }
        return;
    }
    constexpr int G = 256 / R;
    __shared__ float red[G * P * R];
    __shared__ float zs[P * R];
    const int r = threadIdx.x % R;
    const int g = threadIdx.x / R;
    float acc[P];
    #pragma unroll
    for (int k = 0; k < P; ++k) {
        acc[k] = 0.f;
    }
    if (g < G) {
        for (int i = g; i < IN; i += G) {
            const float xv = static_cast<float>(x[(size_t)n * IN + i]);
            const size_t ab = (size_t)i * (P * S * R) + (size_t)s * R + r;
            #pragma unroll
            for (int k = 0; k < P; ++k) {
                acc[k] += xv * static_cast<float>(a[ab + (size_t)k * S * R]);
            }
        }
        #pragma unroll
        for (int k = 0; k < P; ++k) {
            red[(g * P + k) * R + r] = acc[k];
        }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < P * R; q += blockDim.x) {
        float t = 0.f;
        for (int gg = 0; gg < G; ++gg) {
            t += red[gg * P * R + q];
        }
        zs[q] = static_cast<float>(static_cast<DT>(t));
    }
    __syncthreads();
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        float d = 0.f;
        bool hit = false;
"#,
    );
    body.push_str(&expand_parts(parts, "d", "", |k| {
        format!("zs[{k} * R + r]")
    }));
    body.push_str(
        r#"
        out[row + j] = hit
            ? static_cast<DT>(static_cast<float>(y[row + j]) + static_cast<float>(static_cast<DT>(d)))
            : y[row + j];
    }
"#,
    );
    body
}

/// Input names of [`lora_onepass_source`]'s kernel of `parts` parts.
pub fn lora_onepass_inputs(parts: usize) -> Vec<String> {
    lora_inputs(&["y", "x", "slots", "a"], parts)
}

/// Output columns per thread block of the one-pass LoRA kernel.
pub const LORA_CHUNK: i32 = 2048;

/// Whether the fused decode layer adds LoRA deltas with the one-pass kernel
/// (`WEFT_LORA_KERNEL=onepass`) rather than a shrink matmul and
/// [`lora_add_source`]'s kernel.
pub fn lora_onepass() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WEFT_LORA_KERNEL").is_ok_and(|v| v == "onepass"))
}

/// The expand of each part `k` at column `j` of slot `s`: `{acc} += z_k[r]
/// * b{k}[s, r, j - OFF{k}]` over the rank, `hit` set where `j` is the
/// part's (and `guard` holds); `z(k)` reads part `k`'s shrink at rank `r`.
fn expand_parts(parts: usize, acc: &str, guard: &str, z: impl Fn(usize) -> String) -> String {
    (0..parts)
        .map(|k| {
            let zk = z(k);
            format!(
                r#"
    if ({guard}j >= OFF{k} && j < OFF{k} + W{k}) {{
        const size_t bb = (size_t)s * R * W{k} + (j - OFF{k});
        #pragma unroll 8
        for (int r = 0; r < R; ++r) {{
            {acc} += {zk} * static_cast<float>(b{k}[bb + (size_t)r * W{k}]);
        }}
        hit = true;
    }}
"#
            )
        })
        .collect()
}

/// Input names of the LoRA add kernel of `parts` parts.
pub fn lora_add_inputs(parts: usize) -> Vec<String> {
    lora_inputs(&["y", "z", "slots"], parts)
}

/// `first`, then one expand stack `b{k}` per part.
fn lora_inputs(first: &[&str], parts: usize) -> Vec<String> {
    let mut v: Vec<String> = first.iter().map(|s| s.to_string()).collect();
    v.extend((0..parts).map(|k| format!("b{k}")));
    v
}

/// One kernel object per number of adapted parts (1..=[`LORA_MAX_PARTS`]),
/// named `{name}{parts}`.
fn lora_kernels(
    name: &str,
    inputs: fn(usize) -> Vec<String>,
    source: fn(usize) -> String,
) -> Result<Vec<Kernel>> {
    (1..=LORA_MAX_PARTS)
        .map(|p| {
            let ins = inputs(p);
            let names: Vec<&str> = ins.iter().map(String::as_str).collect();
            Kernel::new(&format!("{name}{p}"), &names, &["out"], &source(p))
        })
        .collect()
}

const THREADS: i32 = 256;

/// The fused decode kernels; live on the engine thread with the model.
pub struct DecodeKernels {
    add_norm: Kernel,
    rope_qkv: Kernel,
    silu_mul: Kernel,
    /// LoRA shrink-and-expand add, by adapted parts (1..=3).
    lora_add: Vec<Kernel>,
    /// The same with the shrink inside, by adapted parts.
    lora_onepass: Vec<Kernel>,
    gemv: Gemv,
}

/// Head counts of the fused QKV projection.
#[derive(Debug, Clone, Copy)]
pub struct QkvHeads {
    pub q: i32,
    pub kv: i32,
    pub dim: i32,
}

impl DecodeKernels {
    /// Builds the kernel objects (NVRTC compiles each at its first use).
    pub fn new() -> Result<Self> {
        Ok(Self {
            add_norm: Kernel::new(
                "weft_add_rms_norm",
                &["h", "a", "w", "eps"],
                &["sum", "normed"],
                ADD_NORM_SOURCE,
            )?,
            rope_qkv: Kernel::new(
                "weft_rope_qkv",
                &["qkv", "start", "inv_freq", "scale"],
                &["q_out", "k_out", "v_out"],
                ROPE_QKV_SOURCE,
            )?,
            silu_mul: Kernel::new("weft_silu_mul", &["gu"], &["out"], SILU_MUL_SOURCE)?,
            lora_add: lora_kernels("weft_lora_add", lora_add_inputs, lora_add_source)?,
            lora_onepass: lora_kernels(
                "weft_lora_onepass",
                lora_onepass_inputs,
                lora_onepass_source,
            )?,
            gemv: Gemv::new()?,
        })
    }

    /// `lin`'s forward of a decode step's input `x` `[B, K]`: the few-row
    /// GEMV kernels ([`crate::gemv`]) where they take the layer and `B`, the
    /// layer's own forward otherwise.
    pub fn linear(&self, lin: &Linear, x: &Array) -> Result<Array> {
        self.product(lin, x, Pre::None, Post::None)
    }

    /// Whether a step of `rows` rows of a model whose weights are
    /// `quantized` runs its products through the GEMV kernels with the norms
    /// and epilogues fused into them ([`crate::gemv::GEMV_MAX_ROWS`]).
    pub(crate) fn gemv_rows(&self, rows: i32, quantized: bool) -> bool {
        rows >= 1 && rows <= crate::gemv::max_rows(quantized)
    }

    /// `post(pre(x) @ W^T)` for a decode step's input `x` `[B, K]`: one GEMV
    /// kernel where the kernels take the layer and `B`, MLX's ops (and this
    /// module's element-wise kernels) with the same rounding otherwise.
    pub(crate) fn product(
        &self,
        lin: &Linear,
        x: &Array,
        pre: Pre<'_>,
        post: Post<'_>,
    ) -> Result<Array> {
        if let Some(y) = self.gemv.apply(lin, x, pre, post)? {
            return Ok(y);
        }
        let normed;
        let x = match pre {
            Pre::None => x,
            Pre::Norm { w, eps_f, .. } => {
                normed = mlx_rs::fast::rms_norm(x, Some(w), eps_f)?;
                &normed
            }
        };
        let y = lin.forward(x)?;
        match post {
            Post::None => Ok(y),
            Post::Residual(r) => {
                let y = if y.dtype() == r.dtype() {
                    y
                } else {
                    y.as_dtype(r.dtype())?
                };
                Ok(mlx_rs::ops::add(r, &y)?)
            }
            Post::SiluPair => self.silu_mul(&y),
        }
    }

    /// `(h + a, rms_norm(h + a) * w)` for `h`, `a` `[N, H]` and `w` `[H]`
    /// (`eps` `[1]` f32).
    pub fn add_rms_norm(
        &self,
        h: &Array,
        a: &Array,
        w: &Array,
        eps: &Array,
    ) -> Result<(Array, Array)> {
        let s = h.shape();
        if s.len() != 2 || a.shape() != s || w.shape() != [s[1]] || h.dtype() != a.dtype() {
            return Err(ModelError::Invalid(format!(
                "add_rms_norm: h {s:?} {:?}, a {:?} {:?}, w {:?}",
                h.dtype(),
                a.shape(),
                a.dtype(),
                w.shape()
            )));
        }
        let dt = h.dtype();
        let mut out = self.add_norm.apply(
            &[h, a, w, eps],
            &[(s, dt), (s, dt)],
            (s[0] * THREADS, 1),
            THREADS,
            &[],
            ("DT", dt),
        )?;
        let normed = out.pop();
        match (out.pop(), normed) {
            (Some(sum), Some(normed)) => Ok((sum, normed)),
            _ => Err(ModelError::Invalid(
                "add_rms_norm: expected 2 outputs".into(),
            )),
        }
    }

    /// Rotated queries `[B, HQ, 1, D]` and keys, and values, both `[B, 1,
    /// KVH, 1, D]` (the pool scatter's update shape), of the fused
    /// projection `qkv` `[B, (HQ + 2 KVH) * D]` at each row's position
    /// `start` `[B]` int32. `inv_freq` `[D / 2]` and `scale` `[1]` are f32.
    pub fn rope_qkv(
        &self,
        qkv: &Array,
        start: &Array,
        inv_freq: &Array,
        scale: &Array,
        heads: QkvHeads,
    ) -> Result<(Array, Array, Array)> {
        let s = qkv.shape();
        let width = (heads.q + 2 * heads.kv) * heads.dim;
        if s.len() != 2
            || s[1] != width
            || heads.dim % 2 != 0
            || inv_freq.shape() != [heads.dim / 2]
        {
            return Err(ModelError::Invalid(format!(
                "rope_qkv: qkv {s:?} for {heads:?}, inv_freq {:?}",
                inv_freq.shape()
            )));
        }
        let (b, dt) = (s[0], qkv.dtype());
        let total = b * (heads.q + 2 * heads.kv) * heads.dim / 2;
        let grid = (total + THREADS - 1) / THREADS * THREADS;
        let q = [b, heads.q, 1, heads.dim];
        let kv = [b, 1, heads.kv, 1, heads.dim];
        let out = self.rope_qkv.apply(
            &[qkv, start, inv_freq, scale],
            &[(&q, dt), (&kv, dt), (&kv, dt)],
            (grid, 1),
            THREADS,
            &[("HQ", heads.q), ("KVH", heads.kv), ("HD", heads.dim)],
            ("DT", dt),
        )?;
        let [q, k, v]: [Array; 3] = out
            .try_into()
            .map_err(|_| ModelError::Invalid("rope_qkv: expected 3 outputs".into()))?;
        Ok((q, k, v))
    }

    /// `silu(g) * u` `[N, F]` of the fused gate/up projection `gu` `[N, 2F]`.
    pub fn silu_mul(&self, gu: &Array) -> Result<Array> {
        let s = gu.shape();
        if s.len() != 2 || s[1] % 2 != 0 {
            return Err(ModelError::Invalid(format!("silu_mul: gate/up {s:?}")));
        }
        let (n, f) = (s[0], s[1] / 2);
        let grid = (n * f + THREADS - 1) / THREADS * THREADS;
        let dt = gu.dtype();
        let mut out =
            self.silu_mul
                .apply(&[gu], &[(&[n, f], dt)], (grid, 1), THREADS, &[], ("DT", dt))?;
        out.pop()
            .ok_or_else(|| ModelError::Invalid("silu_mul: no output".into()))
    }
}

/// Where a [`DecodeKernels::lora_add`] gets each row's shrink.
pub(crate) enum Shrink<'a> {
    /// `z` `[N, P * S * R]`: the rows' input times every slot's `A`, done.
    Done(&'a Array),
    /// In the kernel, from the rows' input `x` `[N, IN]` and the dense `A`
    /// `[IN, P * S * R]` ([`lora_onepass`]).
    Inside { x: &'a Array, a: &'a Array },
}

impl DecodeKernels {
    /// `y` `[N, O]` plus each row's adapter delta, `z[slot] @ b[slot]`, on
    /// the columns `cols[k]` (offset, width) of part `k`: `slots` `[B]`
    /// uint32 is each row's slot, `b[k]` `[S, R, width]`, and `shrink` gives
    /// `z`. One primitive.
    pub(crate) fn lora_add(
        &self,
        y: &Array,
        shrink: Shrink<'_>,
        slots: &Array,
        b: &[Array],
        cols: &[(i32, i32)],
    ) -> Result<Array> {
        let p = b.len();
        let ys = y.shape();
        let bad = |why: &str| {
            Err(ModelError::Invalid(format!(
                "lora_add: {why} (y {ys:?}, slots {:?}, {p} parts)",
                slots.shape()
            )))
        };
        if p == 0 || p > LORA_MAX_PARTS || cols.len() != p || ys.len() != 2 {
            return bad("parts");
        }
        let (s, r) = (b[0].dim(0), b[0].dim(1));
        let (n, o) = (ys[0], ys[1]);
        let rows = slots.dim(0);
        let width = p as i32 * s * r;
        let shrink_ok = match &shrink {
            Shrink::Done(z) => z.shape() == [n, width] && z.dtype() == y.dtype(),
            Shrink::Inside { x, a } => {
                x.ndim() == 2
                    && x.dim(0) == n
                    && a.shape() == [x.dim(1), width]
                    && x.dtype() == y.dtype()
                    && a.dtype() == y.dtype()
                    && r <= 256
            }
        };
        if !shrink_ok || rows == 0 || n % rows != 0 || slots.dtype() != Dtype::Uint32 {
            return bad("shapes");
        }
        for (bk, &(off, w)) in b.iter().zip(cols) {
            if bk.shape() != [s, r, w] || bk.dtype() != y.dtype() || off < 0 || off + w > o {
                return bad("expand stacks");
            }
        }
        let mut ints: Vec<(String, i32)> =
            vec![("P".into(), p as i32), ("S".into(), s), ("R".into(), r)];
        for (k, &(off, w)) in cols.iter().enumerate() {
            ints.push((format!("OFF{k}"), off));
            ints.push((format!("W{k}"), w));
        }
        let dt = y.dtype();
        let (kernel, mut inputs, grid) = match shrink {
            Shrink::Done(z) => {
                let total = n * o;
                (
                    &self.lora_add[p - 1],
                    vec![y, z, slots],
                    (total + THREADS - 1) / THREADS * THREADS,
                )
            }
            Shrink::Inside { x, a } => {
                ints.push(("CHUNK".into(), LORA_CHUNK));
                let chunks = (o + LORA_CHUNK - 1) / LORA_CHUNK;
                (
                    &self.lora_onepass[p - 1],
                    vec![y, x, slots, a],
                    n * chunks * THREADS,
                )
            }
        };
        inputs.extend(b.iter());
        let ints: Vec<(&str, i32)> = ints.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let mut out = kernel.apply(&inputs, &[(ys, dt)], (grid, 1), THREADS, &ints, ("DT", dt))?;
        out.pop()
            .ok_or_else(|| ModelError::Invalid("lora_add: no output".into()))
    }
}

/// MLX's RoPE frequencies, `exp2(-(i / (dims / 2)) * log2(base))` for `i <
/// dims / 2`, or `1 / freqs[i]` for explicit frequencies (llama3 scaling).
pub fn inv_freq(dims: i32, base: Option<f32>, freqs: Option<&[f32]>) -> Vec<f32> {
    let half = (dims / 2).max(1);
    match (freqs, base) {
        (Some(f), _) => f.iter().map(|&x| 1.0 / x).collect(),
        (None, Some(base)) => {
            let l = base.log2();
            (0..half)
                .map(|i| (-(i as f32 / half as f32) * l).exp2())
                .collect()
        }
        (None, None) => vec![1.0; half as usize],
    }
}

/// The dtypes the kernels are built for.
pub fn supports(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast;

    /// The rotation `rope_qkv` computes from [`inv_freq`], written out on the
    /// host, against MLX's own RoPE (the op-by-op layer's) on the CPU.
    fn check(base: Option<f32>, freqs: Option<&[f32]>, scale: f32) {
        let (d, pos) = (64i32, [0i32, 5, 131, 1000]);
        let inv = inv_freq(d, base, freqs);
        let half = (d / 2) as usize;
        let x: Vec<f32> = (0..pos.len() * d as usize)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let xa = Array::from_slice(&x, &[pos.len() as i32, 1, 1, d]);
        let offs = Array::from_slice(&pos, &[pos.len() as i32]);
        let fa = freqs.map(|f| Array::from_slice(f, &[f.len() as i32]));
        let want = fast::rope_dynamic(&xa, d, false, base, scale, &offs, fa.as_ref()).unwrap();
        let want: Vec<f32> = want.as_slice().to_vec();
        for (r, &p) in pos.iter().enumerate() {
            for i in 0..half {
                let theta = scale * p as f32 * inv[i];
                let (c, s) = (theta.cos(), theta.sin());
                let (x1, x2) = (x[r * d as usize + i], x[r * d as usize + i + half]);
                let got = [x1 * c - x2 * s, x1 * s + x2 * c];
                let w = [want[r * d as usize + i], want[r * d as usize + i + half]];
                for k in 0..2 {
                    assert!(
                        (got[k] - w[k]).abs() < 2e-3,
                        "pos {p} pair {i}: {} vs MLX {}",
                        got[k],
                        w[k]
                    );
                }
            }
        }
    }

    #[test]
    fn rope_frequencies_match_mlx() {
        check(Some(10000.0), None, 1.0);
        check(Some(500000.0), None, 0.25);
        let freqs: Vec<f32> = (0..32).map(|i| 1.5f32.powi(i)).collect();
        check(None, Some(&freqs), 1.0);
    }
}
