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
//! With adapters (a dense adapter pool) the three kernels that read a
//! projection's output read its LoRA expand with it ([`lora_prelude`]), so
//! an adapted projection adds one primitive, its shrink matmul.
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
/// block per row: [`ADD_NORM_HEAD`] (the row and its offset `base`; a
/// LoRA prologue, [`lora_prologue`], may follow it) then this.
const ADD_NORM_HEAD: &str = r#"
    const int N = h_shape[0];
    const int H = h_shape[1];
    const int row = blockIdx.x;
    if (row >= N) {
        return;
    }
    const size_t base = (size_t)row * H;
"#;

/// The rest of the add-norm kernel, after [`ADD_NORM_HEAD`].
const ADD_NORM_SOURCE: &str = r#"
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const DT s = static_cast<DT>(static_cast<float>(h[base + i]) + ld(a[base + i], row, i));
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

/// The epilogue of the add-norm and (row-wise) SwiGLU kernels that also
/// computes the next projection's LoRA shrink of the row they wrote
/// (`crate::lora::fused_shrink`): `src` `[N, len]` is that row's output, `sz`
/// `[N, SQ * SS * SR]` in the dense stack `sa` `[len, SQ * SS * SR]`'s
/// (part, slot, rank) column order, only the row's own slot's block written
/// (the consumer's [`lora_prelude`] reads no other; slot 0 rows write
/// nothing). The kernel's block (`ST` threads) is one row (`row`, `base =
/// row * len`), so few warps share an SM and each waits on its loads: the
/// loads are what this is built around. `LN = SR / SV` neighbouring threads
/// cover a part's rank columns, each `SV` of them with one 16-byte load
/// (`SV` elements of the dtype), and every `G`-th input element (`G = ST /
/// LN`), four a turn with their loads issued together. (Measured on an H100,
/// 64 rows: with one scalar load a turn the step waited 7.5 ms for the
/// device, with four 3.6 ms.) Partial sums meet by warp shuffles, then
/// across warps in shared memory.
fn shrink_epilogue(src: &str, len: &str) -> String {
    let store = "sz[(size_t)row * W + (size_t)(p * SS + @SLOT@) * SR + rr] = static_cast<DT>(v);";
    format!(
        r#"
    __syncthreads();
    const int s_slot = (int)sslots[row / (N / sslots_shape[0])];
    if (s_slot != 0) {{{}
    }}
"#,
        shrink_loop(&ShrinkLoop {
            src,
            base: "base",
            len,
            stack: "sa",
            parts: "SQ",
            slots: "SS",
            rank: "SR",
            vector: "SV",
            slot: "s_slot",
            red: "sred",
            store,
        })
    )
}

/// The names one shrink loop ([`shrink_loop`]) reads and writes.
struct ShrinkLoop<'a> {
    /// The row's input (`src[base + k]`, `k < len`).
    src: &'a str,
    base: &'a str,
    len: &'a str,
    /// The dense stack `[len, parts * slots * rank]` and its template sizes.
    stack: &'a str,
    parts: &'a str,
    slots: &'a str,
    rank: &'a str,
    /// Elements of one load ([`ShrinkIn::vector`]).
    vector: &'a str,
    /// The row's slot (not 0).
    slot: &'a str,
    /// The shared partial sums' name.
    red: &'a str,
    /// Stores the sum `v` of part `p`, rank column `rr` (`@SLOT@` is the
    /// slot, `W` the stack's width).
    store: &'a str,
}

/// The body of a block-per-row LoRA shrink of the row's own slot (see
/// [`shrink_epilogue`]), over the names `n` says: every thread of the
/// block takes part, and the block's threads meet at a barrier inside.
fn shrink_loop(n: &ShrinkLoop<'_>) -> String {
    let code = r#"
        constexpr int LN = @R@ / @V@;
        constexpr int W = @Q@ * @S@ * @R@;
        struct alignas(sizeof(DT) * @V@) SVec {
            DT v[@V@];
        };
        __shared__ float @RED@[ST / 32][@Q@ * @R@];
        const int t = threadIdx.x;
        const int lane = t % LN;
        const int G = blockDim.x / LN;
        const int g = t / LN;
        float acc[@Q@][@V@];
        #pragma unroll
        for (int p = 0; p < @Q@; ++p) {
            #pragma unroll
            for (int v = 0; v < @V@; ++v) {
                acc[p][v] = 0.f;
            }
        }
        const size_t col0 = (size_t)@SLOT@ * @R@ + (size_t)lane * @V@;
        int k = g;
        for (; k + 3 * G < @LEN@; k += 4 * G) {
            float xv[4];
            SVec av[4][@Q@];
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int ku = k + u * G;
                xv[u] = static_cast<float>(@SRC@[@BASE@ + ku]);
                #pragma unroll
                for (int p = 0; p < @Q@; ++p) {
                    av[u][p] = *reinterpret_cast<const SVec*>(&@A@[(size_t)ku * W + (size_t)p * @S@ * @R@ + col0]);
                }
            }
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                #pragma unroll
                for (int p = 0; p < @Q@; ++p) {
                    #pragma unroll
                    for (int v = 0; v < @V@; ++v) {
                        acc[p][v] += xv[u] * static_cast<float>(av[u][p].v[v]);
                    }
                }
            }
        }
        for (; k < @LEN@; k += G) {
            const float xk = static_cast<float>(@SRC@[@BASE@ + k]);
            #pragma unroll
            for (int p = 0; p < @Q@; ++p) {
                const SVec a1 = *reinterpret_cast<const SVec*>(&@A@[(size_t)k * W + (size_t)p * @S@ * @R@ + col0]);
                #pragma unroll
                for (int v = 0; v < @V@; ++v) {
                    acc[p][v] += xk * static_cast<float>(a1.v[v]);
                }
            }
        }
        #pragma unroll
        for (int p = 0; p < @Q@; ++p) {
            #pragma unroll
            for (int v = 0; v < @V@; ++v) {
                #pragma unroll
                for (int o = 16; o >= LN; o >>= 1) {
                    acc[p][v] += __shfl_xor_sync(0xffffffffu, acc[p][v], o);
                }
            }
        }
        if ((t & 31) < LN) {
            #pragma unroll
            for (int p = 0; p < @Q@; ++p) {
                #pragma unroll
                for (int v = 0; v < @V@; ++v) {
                    @RED@[t >> 5][p * @R@ + lane * @V@ + v] = acc[p][v];
                }
            }
        }
        __syncthreads();
        for (int c = t; c < @Q@ * @R@; c += blockDim.x) {
            const int p = c / @R@;
            const int rr = c % @R@;
            float v = 0.f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
                v += @RED@[w][c];
            }
            @STORE@
        }"#;
    code.replace("@STORE@", n.store)
        .replace("@SRC@", n.src)
        .replace("@BASE@", n.base)
        .replace("@LEN@", n.len)
        .replace("@A@", n.stack)
        .replace("@Q@", n.parts)
        .replace("@S@", n.slots)
        .replace("@R@", n.rank)
        .replace("@V@", n.vector)
        .replace("@SLOT@", n.slot)
        .replace("@RED@", n.red)
}

/// The add-norm kernel's LoRA prologue for the output projection's
/// adapter (the default; `WEFT_LORA_O_SHRINK=matmul` opts out): after
/// [`ADD_NORM_HEAD`], the block computes its row's shrink of the output
/// projection's input `px` `[N, px_shape[1]]` by the dense stack `pa`
/// `[K, LS * LR]` ([`shrink_loop`], loads of `PV` elements) into shared
/// memory, rounded to the dtype as a matmul's output would be, then reads
/// `a` (the base projection's output) plus the expand `z @ lb0[slot]` on
/// columns `LOFF0 .. LOFF0 + LW0`, as [`lora_prelude`] does from a shrink
/// matmul's output: so the output projection's shrink costs no primitive.
fn lora_prologue() -> String {
    let store = "pz[p * LR + rr] = static_cast<float>(static_cast<DT>(v));";
    format!(
        r#"
    const int p_slot = (int)lslots[row / (N / lslots_shape[0])];
    __shared__ float pz[LR];
    if (p_slot != 0) {{{}
    }}
    __syncthreads();
    auto ld = [&](DT v, int, int j) -> float {{
        if (p_slot == 0 || j < LOFF0 || j >= LOFF0 + LW0) {{
            return static_cast<float>(v);
        }}
        float acc = 0.f;
        const size_t bb = (size_t)p_slot * LR * LW0 + (j - LOFF0);
        #pragma unroll 8
        for (int r = 0; r < LR; ++r) {{
            acc += pz[r] * static_cast<float>(lb0[bb + (size_t)r * LW0]);
        }}
        return static_cast<float>(static_cast<DT>(static_cast<float>(v) + static_cast<float>(static_cast<DT>(acc))));
    }};
"#,
        shrink_loop(&ShrinkLoop {
            src: "px",
            base: "(size_t)row * px_shape[1]",
            len: "px_shape[1]",
            stack: "pa",
            parts: "1",
            slots: "LS",
            rank: "LR",
            vector: "PV",
            slot: "p_slot",
            red: "pred",
            store,
        })
    )
}

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
        const float x1 = ld(qkv[src], b, h * HD + i);
        const float x2 = ld(qkv[src + HALF], b, h * HD + i + HALF);
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
        v_out[dst] = static_cast<DT>(ld(qkv[src], b, h * HD + i));
        v_out[dst + HALF] = static_cast<DT>(ld(qkv[src + HALF], b, h * HD + i + HALF));
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
    const float g = ld(gu[n * 2 * F + j], (int)n, (int)j);
    const float u = ld(gu[n * 2 * F + F + j], (int)n, (int)(F + j));
    const DT sig = static_cast<DT>(1.f / (1.f + expf(-g)));
    const DT gs = static_cast<DT>(g * static_cast<float>(sig));
    out[idx] = static_cast<DT>(static_cast<float>(gs) * u);
"#;

/// [`SILU_MUL_SOURCE`] one thread block per row, for the variant that also
/// computes the down projection's LoRA shrink ([`shrink_epilogue`]).
const SILU_MUL_ROW_SOURCE: &str = r#"
    const int N = gu_shape[0];
    const int F = gu_shape[1] / 2;
    const int row = blockIdx.x;
    if (row >= N) {
        return;
    }
    const size_t base = (size_t)row * F;
    for (int j = threadIdx.x; j < F; j += blockDim.x) {
        const float g = ld(gu[base * 2 + j], row, j);
        const float u = ld(gu[base * 2 + F + j], row, F + j);
        const DT sig = static_cast<DT>(1.f / (1.f + expf(-g)));
        const DT gs = static_cast<DT>(g * static_cast<float>(sig));
        out[base + j] = static_cast<DT>(static_cast<float>(gs) * u);
    }
"#;

/// The adapted parts (up to three) of one fused projection.
pub const LORA_MAX_PARTS: usize = 3;

/// The start of a fused decode kernel that reads a projection's output:
/// `ld(v, n, j)` reads element `v` of row `n`, column `j` as f32. With
/// `parts` adapted parts (0: none) it adds the row's adapter delta
/// `z[slot] @ b[slot]` first: `lz` `[N, LP * LS * LR]` is every slot's
/// shrink of the projection's input (part, slot, rank order), `lslots`
/// `[B]` the slot of each of the `B` rows (`N / B` tokens each), `lb{k}`
/// `[LS, LR, LW{k}]` part `k`'s expand onto columns `LOFF{k} .. LOFF{k} +
/// LW{k}`. The delta is rounded to the dtype and so is the sum, as a
/// matmul's output and then an add round them; slot 0 (no adapter) and
/// columns of no part read `v` unchanged. So the expand and add of an
/// adapter cost no primitive of their own: they ride in the kernel that
/// consumes the projection.
pub fn lora_prelude(parts: usize) -> String {
    if parts == 0 {
        return "\n    auto ld = [](DT v, int, int) -> float { return static_cast<float>(v); };\n"
            .into();
    }
    let mut body = String::from(
        r#"
    const int l_per = lz_shape[0] / lslots_shape[0];
    auto ld = [&](DT v, int n, int j) -> float {
        const int s = (int)lslots[n / l_per];
        if (s == 0) {
            return static_cast<float>(v);
        }
        float acc = 0.f;
        bool hit = false;
"#,
    );
    for k in 0..parts {
        body.push_str(&format!(
            r#"
        if (j >= LOFF{k} && j < LOFF{k} + LW{k}) {{
            const size_t zb = (size_t)n * (LP * LS * LR) + (size_t)({k} * LS + s) * LR;
            const size_t bb = (size_t)s * LR * LW{k} + (j - LOFF{k});
            #pragma unroll 8
            for (int r = 0; r < LR; ++r) {{
                acc += static_cast<float>(lz[zb + r]) * static_cast<float>(lb{k}[bb + (size_t)r * LW{k}]);
            }}
            hit = true;
        }}
"#
        ));
    }
    body.push_str(
        r#"
        return hit
            ? static_cast<float>(static_cast<DT>(static_cast<float>(v) + static_cast<float>(static_cast<DT>(acc))))
            : static_cast<float>(v);
    };
"#,
    );
    body
}

/// One fused decode kernel variant: its name, inputs, outputs and source.
#[derive(Debug, Clone)]
pub struct KernelSource {
    pub name: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<&'static str>,
    pub source: String,
}

/// Which fused decode kernel reads a projection's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// The residual add and the next RMS norm (after the output and down
    /// projections).
    AddNorm,
    /// RoPE of the fused QKV projection.
    RopeQkv,
    /// SwiGLU of the fused gate/up projection.
    SiluMul,
}

impl Consumer {
    pub const ALL: [Consumer; 3] = [Consumer::AddNorm, Consumer::RopeQkv, Consumer::SiluMul];

    /// The kernel with `parts` adapted parts of its projection (0: none).
    pub fn source(self, parts: usize) -> KernelSource {
        self.source_with_shrink(parts, 0)
    }

    /// [`Self::source`], the add-norm or SwiGLU kernel also computing the
    /// next projection's LoRA shrink over `shrink` parts (0: none;
    /// [`shrink_epilogue`]; the SwiGLU variant runs a block per row).
    pub fn source_with_shrink(self, parts: usize, shrink: usize) -> KernelSource {
        let (name, inputs, outputs, body): (_, &[&str], _, _) = match self {
            Self::AddNorm => (
                "weft_add_rms_norm",
                &["h", "a", "w", "eps"],
                vec!["sum", "normed"],
                format!("{ADD_NORM_HEAD}{ADD_NORM_SOURCE}"),
            ),
            Self::RopeQkv => (
                "weft_rope_qkv",
                &["qkv", "start", "inv_freq", "scale"],
                vec!["q_out", "k_out", "v_out"],
                ROPE_QKV_SOURCE.to_string(),
            ),
            Self::SiluMul => (
                "weft_silu_mul",
                &["gu"],
                vec!["out"],
                SILU_MUL_SOURCE.to_string(),
            ),
        };
        let mut inputs: Vec<String> = inputs.iter().map(|s| s.to_string()).collect();
        let name = if parts == 0 {
            name.to_string()
        } else {
            inputs.extend(["lz".into(), "lslots".into()]);
            inputs.extend((0..parts).map(|k| format!("lb{k}")));
            format!("{name}_lora{parts}")
        };
        let mut outputs = outputs;
        let shrink = if self == Self::RopeQkv { 0 } else { shrink };
        let mut source = lora_prelude(parts);
        let name = if shrink > 0 {
            inputs.extend(["sa".into(), "sslots".into()]);
            outputs.push("sz");
            if self == Self::AddNorm {
                source.push_str(&body);
                source.push_str(&shrink_epilogue("normed", "H"));
            } else {
                source.push_str(SILU_MUL_ROW_SOURCE);
                source.push_str(&shrink_epilogue("out", "F"));
            }
            format!("{name}_shrink{shrink}")
        } else {
            source.push_str(&body);
            name
        };
        KernelSource {
            name,
            inputs,
            outputs,
            source: crate::cuda_kernel::compact(&source),
        }
    }

    /// The most adapted parts its projection has.
    pub fn max_parts(self) -> usize {
        match self {
            Self::AddNorm => 1,
            Self::RopeQkv => 3,
            Self::SiluMul => 2,
        }
    }
}

/// The add-norm kernel after the output projection with that projection's
/// LoRA shrink and expand in its prologue ([`lora_prologue`]; inputs `lslots`
/// `[B]`, `lb0` `[LS, LR, H]`, `px` the projection's input `[N, K]`, `pa` its
/// dense stack `[K, LS * LR]`), also with the next projection's shrink over
/// `shrink` parts (0: none; [`shrink_epilogue`]).
pub fn add_norm_prologue_source(shrink: usize) -> KernelSource {
    let mut inputs: Vec<String> = ["h", "a", "w", "eps", "lslots", "lb0", "px", "pa"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut outputs = vec!["sum", "normed"];
    let mut source = format!("{ADD_NORM_HEAD}{}{ADD_NORM_SOURCE}", lora_prologue());
    let mut name = "weft_add_rms_norm_olora".to_string();
    if shrink > 0 {
        inputs.extend(["sa".into(), "sslots".into()]);
        outputs.push("sz");
        source.push_str(&shrink_epilogue("normed", "H"));
        name = format!("{name}_shrink{shrink}");
    }
    KernelSource {
        name,
        inputs,
        outputs,
        source: crate::cuda_kernel::compact(&source),
    }
}

/// A fused projection's adapters, for the kernel that reads its output
/// ([`lora_prelude`]): `z` `[N, P * S * R]` is the rows' input times every
/// slot's dense `A` (part, slot, rank order), `slots` `[B]` uint32 each
/// row's slot, `b[k]` `[S, R, width]` part `k`'s expand onto the columns
/// `cols[k]` (offset, width).
pub struct LoraIn {
    pub z: Array,
    pub slots: Array,
    pub b: Vec<Array>,
    pub cols: Vec<(i32, i32)>,
}

impl LoraIn {
    /// The same with `z` and the expand stacks in `dt` (the kernel reads
    /// them in the dtype of the output they add to).
    pub fn cast(self, dt: Dtype) -> Result<Self> {
        let to =
            |a: Array| -> Result<Array> { Ok(if a.dtype() == dt { a } else { a.as_dtype(dt)? }) };
        Ok(Self {
            z: to(self.z)?,
            b: self.b.into_iter().map(to).collect::<Result<_>>()?,
            ..self
        })
    }

    /// Adds the inputs and template arguments of a consumer of `y` `[N, O]`
    /// to `inputs` and `ints`, checked against it.
    fn push_args<'a>(
        &'a self,
        (n, o): (i32, i32),
        dt: Dtype,
        inputs: &mut Vec<&'a Array>,
        ints: &mut Vec<(String, i32)>,
    ) -> Result<()> {
        let p = self.b.len();
        let bad = |why: &str| {
            Err(ModelError::Invalid(format!(
                "LoRA input: {why} (output [{n}, {o}], z {:?}, slots {:?}, {p} parts)",
                self.z.shape(),
                self.slots.shape()
            )))
        };
        if p == 0 || p > LORA_MAX_PARTS || self.cols.len() != p {
            return bad("parts");
        }
        let (s, r) = (self.b[0].dim(0), self.b[0].dim(1));
        let rows = self.slots.dim(0);
        if self.z.shape() != [n, p as i32 * s * r]
            || self.z.dtype() != dt
            || rows == 0
            || n % rows != 0
            || self.slots.dtype() != Dtype::Uint32
        {
            return bad("shapes");
        }
        ints.extend([("LP".into(), p as i32), ("LS".into(), s), ("LR".into(), r)]);
        for (k, (bk, &(off, w))) in self.b.iter().zip(&self.cols).enumerate() {
            if bk.shape() != [s, r, w] || bk.dtype() != dt || off < 0 || off + w > o {
                return bad("expand stacks");
            }
            ints.push((format!("LOFF{k}"), off));
            ints.push((format!("LW{k}"), w));
        }
        inputs.extend([&self.z, &self.slots]);
        inputs.extend(self.b.iter());
        Ok(())
    }
}

const THREADS: i32 = 256;

/// Threads of a block (one row) of the kernels that also compute a LoRA
/// shrink ([`shrink_epilogue`]): 1024, or `WEFT_LORA_SHRINK_THREADS` (256 or
/// 512). More warps a row hide more of the loads' latency: on an H100 at 64
/// rows the step waited 0.92 / 0.30 / 0.19 ms for the device at 256 / 512 /
/// 1024 (benches/RESULTS.md).
fn shrink_threads() -> i32 {
    static T: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        std::env::var("WEFT_LORA_SHRINK_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|t| [256, 512].contains(t))
            .unwrap_or(1024)
    })
}

/// The fused decode kernels; live on the engine thread with the model.
pub struct DecodeKernels {
    /// Each by the adapted parts of the projection it reads (0: none).
    add_norm: Vec<Kernel>,
    /// `add_norm` with the next projection's LoRA shrink: by its parts
    /// (1 ..= [`LORA_MAX_PARTS`]), then as `add_norm`.
    add_norm_shrink: Vec<Vec<Kernel>>,
    /// `silu_mul` a block per row with the down projection's (one part)
    /// LoRA shrink, as `silu_mul`.
    silu_mul_shrink: Vec<Kernel>,
    /// [`add_norm_prologue_source`] by the next projection's shrink parts
    /// (0 ..= [`LORA_MAX_PARTS`]).
    add_norm_pro: Vec<Kernel>,
    rope_qkv: Vec<Kernel>,
    silu_mul: Vec<Kernel>,
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
            add_norm: variants(Consumer::AddNorm)?,
            add_norm_shrink: (1..=LORA_MAX_PARTS)
                .map(|q| shrink_variants(Consumer::AddNorm, q))
                .collect::<Result<_>>()?,
            silu_mul_shrink: shrink_variants(Consumer::SiluMul, 1)?,
            add_norm_pro: (0..=LORA_MAX_PARTS)
                .map(|q| {
                    let k = add_norm_prologue_source(q);
                    let ins: Vec<&str> = k.inputs.iter().map(String::as_str).collect();
                    Kernel::new(&k.name, &ins, &k.outputs, &k.source)
                })
                .collect::<Result<_>>()?,
            rope_qkv: variants(Consumer::RopeQkv)?,
            silu_mul: variants(Consumer::SiluMul)?,
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
            Post::SiluPair => Ok(self.silu_mul(&y, None, None)?.0),
        }
    }

    /// `(h + a, rms_norm(h + a) * w)` for `h`, `a` `[N, H]` and `w` `[H]`
    /// (`eps` `[1]` f32), `a` plus its adapters' delta where `lora` says;
    /// with `shrink` also the next projection's LoRA shrink of the normed
    /// rows (the `z` its consumer's [`lora_prelude`] reads; only each row's
    /// own slot's block is written).
    pub(crate) fn add_rms_norm(
        &self,
        h: &Array,
        a: &Array,
        w: &Array,
        eps: &Array,
        lora: Option<&LoraIn>,
        shrink: Option<&ShrinkIn>,
    ) -> Result<(Array, Array, Option<Array>)> {
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
        let Some(sh) = shrink else {
            let mut out = launch(
                &self.add_norm,
                vec![h, a, w, eps],
                lora,
                (s[0], s[1]),
                &[(s, dt), (s, dt)],
                (s[0] * THREADS, THREADS),
                &[],
                &[],
            )?;
            let normed = out.pop();
            return match (out.pop(), normed) {
                (Some(sum), Some(normed)) => Ok((sum, normed, None)),
                _ => Err(ModelError::Invalid(
                    "add_rms_norm: expected 2 outputs".into(),
                )),
            };
        };
        let (width, sv) = sh.check("add_rms_norm", s[0], s[1], dt)?;
        let st = shrink_threads();
        let kernels = &self.add_norm_shrink[sh.parts as usize - 1];
        let mut out = launch(
            kernels,
            vec![h, a, w, eps],
            lora,
            (s[0], s[1]),
            &[(s, dt), (s, dt), (&[s[0], width], dt)],
            (s[0] * st, st),
            &sh.ints(sv, st),
            &[&sh.a, &sh.slots],
        )?;
        let z = out.pop();
        let normed = out.pop();
        match (out.pop(), normed, z) {
            (Some(sum), Some(normed), Some(z)) => Ok((sum, normed, Some(z))),
            _ => Err(ModelError::Invalid(
                "add_rms_norm: expected 3 outputs".into(),
            )),
        }
    }

    /// [`Self::add_rms_norm`] after the output projection, `a` its base
    /// output, with its adapters' shrink and expand computed in the kernel
    /// ([`add_norm_prologue_source`]) from `pro`, and optionally the next
    /// projection's shrink.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rms_norm_pro(
        &self,
        h: &Array,
        a: &Array,
        w: &Array,
        eps: &Array,
        pro: &ProShrink,
        shrink: Option<&ShrinkIn>,
    ) -> Result<(Array, Array, Option<Array>)> {
        let s = h.shape();
        let dt = h.dtype();
        let (n, hd) = (
            s.first().copied().unwrap_or(0),
            s.get(1).copied().unwrap_or(0),
        );
        let (sl, r) = (pro.b.dim(0), pro.b.dim(1));
        let k = pro.x.dim(-1);
        let pv = ShrinkIn::vector(r, dt);
        let rows = pro.slots.dim(0);
        if s.len() != 2
            || a.shape() != s
            || a.dtype() != dt
            || w.shape() != [hd]
            || pro.b.shape() != [sl, r, hd]
            || pro.x.shape() != [n, k]
            || pro.a.shape() != [k, sl * r]
            || [pro.b.dtype(), pro.x.dtype(), pro.a.dtype()] != [dt, dt, dt]
            || pro.slots.dtype() != Dtype::Uint32
            || rows == 0
            || n % rows != 0
            || pv.is_none()
        {
            return Err(ModelError::Invalid(format!(
                "add_rms_norm_pro: h {s:?} {dt:?}, a {:?}, w {:?}, b {:?} {:?}, x {:?} {:?}, a-stack {:?} {:?}, slots {:?}",
                a.shape(),
                w.shape(),
                pro.b.shape(),
                pro.b.dtype(),
                pro.x.shape(),
                pro.x.dtype(),
                pro.a.shape(),
                pro.a.dtype(),
                pro.slots.shape()
            )));
        }
        let st = shrink_threads();
        let mut ints = vec![
            ("LS", sl),
            ("LR", r),
            ("LOFF0", 0),
            ("LW0", hd),
            ("PV", pv.unwrap_or(1)),
        ];
        let mut inputs = vec![h, a, w, eps, &pro.slots, &pro.b, &pro.x, &pro.a];
        let mut outputs: Vec<(&[i32], Dtype)> = vec![(s, dt), (s, dt)];
        let width;
        let parts = match shrink {
            Some(sh) => {
                let (wd, sv) = sh.check("add_rms_norm_pro", n, hd, dt)?;
                width = [n, wd];
                ints.extend(sh.ints(sv, st));
                inputs.extend([&sh.a, &sh.slots]);
                outputs.push((&width, dt));
                sh.parts as usize
            }
            None => {
                ints.push(("ST", st));
                0
            }
        };
        let kernel = self.add_norm_pro.get(parts).ok_or_else(|| {
            ModelError::Invalid(format!("no add-norm prologue kernel for {parts} parts"))
        })?;
        let mut out = kernel.apply(&inputs, &outputs, (n * st, 1), st, &ints, ("DT", dt))?;
        let z = if parts > 0 { out.pop() } else { None };
        let normed = out.pop();
        match (out.pop(), normed) {
            (Some(sum), Some(normed)) => Ok((sum, normed, z)),
            _ => Err(ModelError::Invalid(
                "add_rms_norm_pro: expected its outputs".into(),
            )),
        }
    }

    /// Rotated queries `[B, HQ, 1, D]` and keys, and values, both `[B, 1,
    /// KVH, 1, D]` (the pool scatter's update shape), of the fused
    /// projection `qkv` `[B, (HQ + 2 KVH) * D]` at each row's position
    /// `start` `[B]` int32. `inv_freq` `[D / 2]` and `scale` `[1]` are f32.
    /// `qkv` plus its adapters' delta where `lora` says.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_qkv(
        &self,
        qkv: &Array,
        lora: Option<&LoraIn>,
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
        let out = launch(
            &self.rope_qkv,
            vec![qkv, start, inv_freq, scale],
            lora,
            (b, width),
            &[(&q, dt), (&kv, dt), (&kv, dt)],
            (grid, THREADS),
            &[("HQ", heads.q), ("KVH", heads.kv), ("HD", heads.dim)],
            &[],
        )?;
        let [q, k, v]: [Array; 3] = out
            .try_into()
            .map_err(|_| ModelError::Invalid("rope_qkv: expected 3 outputs".into()))?;
        Ok((q, k, v))
    }

    /// `silu(g) * u` `[N, F]` of the fused gate/up projection `gu` `[N, 2F]`,
    /// plus its adapters' delta where `lora` says.
    /// With `shrink`, also the down projection's LoRA shrink of the output
    /// (as [`Self::add_rms_norm`]'s).
    pub(crate) fn silu_mul(
        &self,
        gu: &Array,
        lora: Option<&LoraIn>,
        shrink: Option<&ShrinkIn>,
    ) -> Result<(Array, Option<Array>)> {
        let s = gu.shape();
        if s.len() != 2 || s[1] % 2 != 0 {
            return Err(ModelError::Invalid(format!("silu_mul: gate/up {s:?}")));
        }
        let (n, f) = (s[0], s[1] / 2);
        let dt = gu.dtype();
        let Some(sh) = shrink else {
            let grid = (n * f + THREADS - 1) / THREADS * THREADS;
            let mut out = launch(
                &self.silu_mul,
                vec![gu],
                lora,
                (n, 2 * f),
                &[(&[n, f], dt)],
                (grid, THREADS),
                &[],
                &[],
            )?;
            let act = out
                .pop()
                .ok_or_else(|| ModelError::Invalid("silu_mul: no output".into()))?;
            return Ok((act, None));
        };
        let (width, sv) = sh.check("silu_mul", n, f, dt)?;
        let st = shrink_threads();
        let mut out = launch(
            &self.silu_mul_shrink,
            vec![gu],
            lora,
            (n, 2 * f),
            &[(&[n, f], dt), (&[n, width], dt)],
            (n * st, st),
            &sh.ints(sv, st),
            &[&sh.a, &sh.slots],
        )?;
        let z = out.pop();
        match (out.pop(), z) {
            (Some(act), Some(z)) => Ok((act, Some(z))),
            _ => Err(ModelError::Invalid("silu_mul: expected 2 outputs".into())),
        }
    }
}

/// A consumer kernel's variants, by adapted parts (0 ..= its most).
fn variants(c: Consumer) -> Result<Vec<Kernel>> {
    (0..=c.max_parts())
        .map(|p| {
            let k = c.source(p);
            let ins: Vec<&str> = k.inputs.iter().map(String::as_str).collect();
            Kernel::new(&k.name, &ins, &k.outputs, &k.source)
        })
        .collect()
}

/// The add-norm or SwiGLU kernel's variants with a shrink of `shrink`
/// parts, by the adapted parts of the projection it reads.
fn shrink_variants(c: Consumer, shrink: usize) -> Result<Vec<Kernel>> {
    (0..=c.max_parts())
        .map(|p| {
            let k = c.source_with_shrink(p, shrink);
            let ins: Vec<&str> = k.inputs.iter().map(String::as_str).collect();
            Kernel::new(&k.name, &ins, &k.outputs, &k.source)
        })
        .collect()
}

/// The next projection's LoRA shrink, computed by the add-norm kernel that
/// makes its input: `a` `[H, parts * slots_n * rank]` the dense stack of
/// `A`s (in the rows' dtype), `slots` `[B]` uint32 each row's slot.
pub struct ShrinkIn {
    pub a: Array,
    pub slots: Array,
    pub parts: i32,
    pub slots_n: i32,
    pub rank: i32,
}

/// The output projection's adapters for [`DecodeKernels::add_rms_norm_pro`]:
/// `x` `[N, K]` the projection's input, `a` its dense stack of `A`s `[K,
/// slots * rank]`, `b` `[slots, rank, H]` its expand, `slots` `[B]` uint32
/// each row's slot (all in the rows' dtype but `slots`).
pub struct ProShrink {
    pub x: Array,
    pub a: Array,
    pub b: Array,
    pub slots: Array,
}

impl ShrinkIn {
    /// Elements of the dtype `dt` one load of a stack row reads in the
    /// shrink epilogue (up to 16 bytes), or None where a `rank`'s columns do
    /// not split into a power of two of at most 32 threads' loads (the
    /// caller shrinks by a matmul then).
    pub fn vector(rank: i32, dt: Dtype) -> Option<i32> {
        let bytes = match dt {
            Dtype::Bfloat16 | Dtype::Float16 => 2,
            Dtype::Float32 => 4,
            _ => return None,
        };
        let mut sv = 16 / bytes;
        while sv > 1 && rank % sv != 0 {
            sv /= 2;
        }
        let lanes = rank / sv;
        (rank >= 1 && lanes <= 32 && (lanes as u32).is_power_of_two()).then_some(sv)
    }

    /// The template arguments of a kernel with this shrink
    /// ([`shrink_epilogue`]): its sizes, `sv` elements a load and `st`
    /// threads a block.
    fn ints(&self, sv: i32, st: i32) -> [(&'static str, i32); 5] {
        [
            ("SQ", self.parts),
            ("SS", self.slots_n),
            ("SR", self.rank),
            ("SV", sv),
            ("ST", st),
        ]
    }

    /// Checks it against the `[n, len]` rows it shrinks (dtype `dt`);
    /// returns the shrink's width (`parts * slots_n * rank`) and the
    /// elements a load reads ([`Self::vector`]).
    fn check(&self, what: &str, n: i32, len: i32, dt: Dtype) -> Result<(i32, i32)> {
        let width = self.parts * self.slots_n * self.rank;
        let rows = self.slots.dim(0);
        let sv = Self::vector(self.rank, dt);
        if self.parts < 1
            || self.parts as usize > LORA_MAX_PARTS
            || sv.is_none()
            || self.a.shape() != [len, width]
            || self.a.dtype() != dt
            || self.slots.dtype() != Dtype::Uint32
            || rows == 0
            || n % rows != 0
        {
            return Err(ModelError::Invalid(format!(
                "{what}: LoRA shrink a {:?} {:?} for {} parts x {} slots x rank {}, slots {:?}, rows [{n}, {len}] {dt:?}",
                self.a.shape(),
                self.a.dtype(),
                self.parts,
                self.slots_n,
                self.rank,
                self.slots.shape()
            )));
        }
        Ok((width, sv.unwrap_or(1)))
    }
}

/// Launches the variant of `kernels` for `lora`'s parts (none without it)
/// over `inputs`, `lora`'s inputs and then `extra`; `y` (rows, columns) is
/// the shape of the projection output the kernel reads; `grid` is (threads
/// in all, threads a block).
#[allow(clippy::too_many_arguments)]
fn launch<'a>(
    kernels: &[Kernel],
    mut inputs: Vec<&'a Array>,
    lora: Option<&'a LoraIn>,
    y: (i32, i32),
    outputs: &[(&[i32], Dtype)],
    grid: (i32, i32),
    ints: &[(&str, i32)],
    extra: &[&'a Array],
) -> Result<Vec<Array>> {
    let dt = inputs[0].dtype();
    let mut ints: Vec<(String, i32)> = ints.iter().map(|&(k, v)| (k.to_string(), v)).collect();
    let parts = match lora {
        Some(l) => {
            l.push_args(y, dt, &mut inputs, &mut ints)?;
            l.b.len()
        }
        None => 0,
    };
    inputs.extend_from_slice(extra);
    let kernel = kernels.get(parts).ok_or_else(|| {
        ModelError::Invalid(format!("no fused decode kernel for {parts} adapted parts"))
    })?;
    let ints: Vec<(&str, i32)> = ints.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    kernel.apply(&inputs, outputs, (grid.0, 1), grid.1, &ints, ("DT", dt))
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
