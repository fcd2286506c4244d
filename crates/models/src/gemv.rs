//! Few-row matrix products on the GPU for decode steps: `x [B, K] @ W^T`
//! for dense and MLX affine 4-bit weights (dequantized in registers): one
//! row on CUDA cores, one warp per output feature streaming its weight row
//! in 16-byte loads; 2-16 rows on tensor cores (`mma.sync`, the rows padded
//! to the 8-wide side of the tile, the weights on the 16-wide side, so the
//! weights are read once whatever the rows). Each is optionally fused with
//! what surrounds it in a decode layer: the RMS
//! norm of its input ([`Pre::Norm`]), and the residual add or the SwiGLU of
//! a fused gate/up projection on its output ([`Post`]). A one-row decode
//! step is a chain of such products over ~2.3 GB of weights at the 1.2B
//! shape, and on the GPU every primitive costs host time too (see
//! [`crate::decode_kernels`]), so fusing the norms and the element-wise
//! epilogues removes four kernels per layer.
//!
//! The kernels are `kernels/gemv_head.cu` (the norm prologue and the
//! epilogue, shared), then `gemv_cols.cu`, `gemv_dense.cu` or `gemv_q4.cu`,
//! `gemv_tail.cu` (CUDA cores, [`GEMV_COLS`] columns per warp for several
//! rows where the tensor-core kernels do not take the layer), or
//! `mma_open.cu`, `mma_a_dense.cu` or `mma_a_q4.cu`, `mma_close.cu` (tensor
//! cores); `benches/gemv_probe.py` measures them against MLX's own matmul /
//! quantized matmul chains at the model's shapes (benches/RESULTS.md).
//!
//! CUDA only (MLX's NVRTC path), used by the compiled GPU decode step for
//! inputs of at most [`GEMV_MAX_ROWS`] / [`GEMV_MAX_ROWS_Q4`] rows
//! (`WEFT_GEMV_MAX_ROWS`); anything the kernels do not
//! take (other dtypes or widths, 2/3/5/6/8-bit weights, groups below 32, a
//! bias before an epilogue) runs MLX's ops instead, with the same rounding.

use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::Kernel;
use crate::error::{ModelError, Result};
use crate::linear::Linear;

/// Input rows up to which decode steps of a model with dense (bf16/f16/f32)
/// weights use these kernels (0: never): measured on the H200 at the 1.2B
/// shape, one-row steps were no faster (391 vs 376 tok/s; the device time
/// the kernels add offsets the host time they save), so off.
/// `WEFT_GEMV_MAX_ROWS` overrides both defaults.
pub const GEMV_MAX_ROWS: i32 = 0;
/// The same for a model with 4-bit weights: one-row steps went from 310 to
/// 387 tok/s (MLX's 4-bit matrix-vector product streams ~600 GB/s, these
/// ~870), and the tensor-core kernels take 2-16 rows. Built per capacity (8 or
/// 16 rows, the row count read from the input), they start in seconds: on an
/// H100 (2026-12-07) `bench-engine` at 8 streams of the 1.2B 4-bit model made
/// 1677 steady tok/s with them (step 4.9 ms) against 766 without (10.6 ms, the
/// weights dequantized in the step), and its whole run with mlx-lm's beside it
/// took 53 s (benches/RESULTS.md). Before the per-capacity builds a start that
/// warmed the 2-8-row buckets did not finish in 120-150 s.
pub const GEMV_MAX_ROWS_Q4: i32 = 16;

/// Shared memory that may stage a normalized input, in 16-byte words: the
/// GEMV kernels take 16 KB up to 4 rows and 40 KB beyond (more would cut the
/// blocks an SM holds); the tensor-core ones none (each block reads each
/// input element once per tile, and normalizes it as it loads it).
const GEMV_XS: &str = "constexpr int XS_CAP = (NB <= 4 ? 1024 : 2560);\n";
const MMA_XS: &str = "constexpr int XS_CAP = 1;\n";
const GEMV_DENSE: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/gemv_cols.cu"),
    include_str!("kernels/gemv_dense.cu"),
    include_str!("kernels/gemv_tail.cu")
);
const GEMV_Q4: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/gemv_cols.cu"),
    include_str!("kernels/gemv_q4.cu"),
    include_str!("kernels/gemv_tail.cu")
);
const MMA_DENSE: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/mma_open.cu"),
    include_str!("kernels/mma_a_dense.cu"),
    include_str!("kernels/mma_close.cu")
);
const MMA_Q4: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/mma_open.cu"),
    include_str!("kernels/mma_a_q4.cu"),
    include_str!("kernels/mma_close.cu")
);
/// Rows up to which the tensor-core kernels take inputs of two or more rows
/// (their tile pads the rows to 8 or 16).
const MMA_MAX_ROWS: i32 = 16;
/// Rows up to which the CUDA-core kernels take several rows where the
/// tensor-core ones do not (beyond, MLX's ops are faster: at 8-16 rows they
/// took 1.5-8x MLX's time on the H200).
const COLS_MAX_ROWS: i32 = 4;
/// Threads of a tensor-core kernel's block (`MW` warps in mma_open.cu).
const MMA_THREADS: i32 = 128;
const THREADS: i32 = 256;
/// Output columns each CUDA-core warp computes for inputs of several rows
/// that the tensor-core kernels do not take (each input vector a warp loads
/// serves all of them; one row keeps one column per warp, the most
/// parallel): 4-bit at 2-4 rows on the H200, 4 columns took 0.5-0.9x the
/// time of 1, and mostly less than 2. `WEFT_GEMV_COLS` overrides it (1, 2
/// or 4).
pub const GEMV_COLS: i32 = 4;
/// Thread blocks per launch at most (columns beyond them loop): bounds the
/// norm prologue, which every block runs over the whole input.
const MAX_BLOCKS: i32 = 1024;

/// Input rows up to which the GEMV kernels run for a model whose weights are
/// `quantized` or not (see [`GEMV_MAX_ROWS`], [`GEMV_MAX_ROWS_Q4`]).
pub(crate) fn max_rows(quantized: bool) -> i32 {
    static ROWS: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    let set = *ROWS.get_or_init(|| {
        std::env::var("WEFT_GEMV_MAX_ROWS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|&r: &i32| (0..=64).contains(&r))
    });
    set.unwrap_or(if quantized {
        GEMV_MAX_ROWS_Q4
    } else {
        GEMV_MAX_ROWS
    })
}

/// Columns per warp for an input of `rows` rows and `n` output columns
/// (`n` must be a multiple of it).
/// The row capacity a tensor-core kernel is built for: rows padded to whole
/// 8-row tiles (8 or 16).
pub fn mma_capacity(rows: i32) -> i32 {
    (rows + 7) / 8 * 8
}

fn cols_per_warp(rows: i32, n: i32) -> i32 {
    static COLS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let cols = *COLS.get_or_init(|| {
        std::env::var("WEFT_GEMV_COLS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|c: &i32| matches!(c, 1 | 2 | 4))
            .unwrap_or(GEMV_COLS)
    });
    if rows == 1 || n % cols != 0 {
        1
    } else {
        cols
    }
}

/// What a product does to its input first.
#[derive(Clone, Copy)]
pub(crate) enum Pre<'a> {
    None,
    /// `rms_norm(x) * w` (`w` `[K]` of x's dtype, `eps` `[1]` f32; `eps_f`
    /// the same value for MLX's op when the kernels do not take the layer).
    Norm {
        w: &'a Array,
        eps: &'a Array,
        eps_f: f32,
    },
}

/// What a product does to its output.
#[derive(Clone, Copy)]
pub(crate) enum Post<'a> {
    None,
    /// `res + y` (`res` `[B, N]`).
    Residual(&'a Array),
    /// `silu(gate) * up` of a fused `[gate; up]` projection: `[B, N / 2]`.
    SiluPair,
}

/// One kernel object's NVRTC source as [`Gemv`] builds it: its name, input
/// names and body (the `XS_CAP` line included). For checks outside MLX
/// (`crates/models/tests/cuda_sources.rs` compiles every variant with NVRTC).
pub struct KernelSource {
    pub name: &'static str,
    pub inputs: &'static [&'static str],
    /// Whether its weight is MLX's packed 4-bit (`uint32`) with scales and
    /// biases, and its template arguments include the group `G`.
    pub quantized: bool,
    /// Tensor-core kernel (template argument `BF16`; 2-16 rows) or CUDA-core
    /// (`NC`; any rows).
    pub mma: bool,
    pub source: String,
}

const DENSE_INPUTS: &[&str] = &["x", "w", "nw", "eps", "res"];
const Q4_INPUTS: &[&str] = &["x", "w", "scales", "biases", "nw", "eps", "res"];

/// Every kernel object's source.
pub fn kernel_sources() -> Vec<KernelSource> {
    let k = |name, inputs, quantized, mma, xs: &str, body: &str| KernelSource {
        name,
        inputs,
        quantized,
        mma,
        source: crate::cuda_kernel::compact(&format!("{xs}{body}")),
    };
    vec![
        k(
            "weft_gemv_dense",
            DENSE_INPUTS,
            false,
            false,
            GEMV_XS,
            GEMV_DENSE,
        ),
        k("weft_gemv_q4", Q4_INPUTS, true, false, GEMV_XS, GEMV_Q4),
        k(
            "weft_mma_dense",
            DENSE_INPUTS,
            false,
            true,
            MMA_XS,
            MMA_DENSE,
        ),
        k("weft_mma_q4", Q4_INPUTS, true, true, MMA_XS, MMA_Q4),
    ]
}

/// Whether inputs of 2-16 rows take the tensor-core kernels
/// (`WEFT_GEMV_MMA=0`: the CUDA-core kernels instead, at any row count up
/// to the GEMV limit: a measurement knob, and the way around them on a GPU
/// older than compute capability 8.0, whose NVRTC build of their bf16/f16
/// `mma.sync` fails when the server traces its decode steps at startup).
fn mma_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WEFT_GEMV_MMA").map_or(true, |v| v != "0"))
}

/// The kernel objects (NVRTC compiles one per row count, mode and dtype at
/// first use).
pub(crate) struct Gemv {
    dense: Kernel,
    q4: Kernel,
    mma_dense: Kernel,
    mma_q4: Kernel,
}

impl Gemv {
    pub(crate) fn new() -> Result<Self> {
        let mut k = kernel_sources()
            .into_iter()
            .map(|s| Kernel::new(s.name, s.inputs, &["y"], &s.source));
        let mut next = || {
            k.next()
                .ok_or_else(|| ModelError::Invalid("gemv: a kernel source is missing".into()))?
        };
        Ok(Self {
            dense: next()?,
            q4: next()?,
            mma_dense: next()?,
            mma_q4: next()?,
        })
    }

    /// `post(pre(x) @ W^T (+ bias))` for `x` `[B, K]`, or None when the
    /// layer, its dtype, the row count or the modes are not ones these
    /// kernels take.
    pub(crate) fn apply(
        &self,
        lin: &Linear,
        x: &Array,
        pre: Pre<'_>,
        post: Post<'_>,
    ) -> Result<Option<Array>> {
        let s = x.shape();
        let quantized = matches!(lin, Linear::Quantized { .. });
        if s.len() != 2 || s[0] < 1 || s[0] > max_rows(quantized) {
            return Ok(None);
        }
        let (b, k, dt) = (s[0], s[1], x.dtype());
        let (norm, nw, eps) = match pre {
            Pre::None => (0, x, x),
            Pre::Norm { w, eps, .. } => {
                if w.shape() != [k] || w.dtype() != dt || eps.dtype() != Dtype::Float32 {
                    return Ok(None);
                }
                (1, w, eps)
            }
        };
        let (inputs, n, quant, g, bias): (Vec<&Array>, i32, bool, Option<i32>, _) = match lin {
            Linear::Dense { weight, bias, .. } => {
                let vec = match dt {
                    Dtype::Bfloat16 | Dtype::Float16 => 8,
                    Dtype::Float32 => 4,
                    _ => return Ok(None),
                };
                if weight.dtype() != dt || weight.shape() != [weight.dim(0), k] || k % vec != 0 {
                    return Ok(None);
                }
                (vec![x, weight], weight.dim(0), false, None, bias)
            }
            Linear::Quantized {
                weight,
                scales,
                biases,
                bias,
                group_size,
                bits,
            } => {
                let two_bytes = matches!(dt, Dtype::Bfloat16 | Dtype::Float16);
                if *bits != 4
                    || !two_bytes
                    || *group_size < 32
                    || group_size % 32 != 0
                    || k % group_size != 0
                    || weight.shape() != [weight.dim(0), k / 8]
                    || scales.dtype() != dt
                    || biases.dtype() != dt
                {
                    return Ok(None);
                }
                (
                    vec![x, weight, scales, biases],
                    weight.dim(0),
                    true,
                    Some(*group_size),
                    bias,
                )
            }
            Linear::Host { .. } => return Ok(None),
        };
        // A bias lands between the product and its epilogue: only without one.
        if bias.is_some() && !matches!(post, Post::None) {
            return Ok(None);
        }
        let (epi, res, out_n) = match post {
            Post::None => (0, x, n),
            Post::Residual(r) => {
                if r.shape() != [b, n] || r.dtype() != dt {
                    return Ok(None);
                }
                (1, r, n)
            }
            Post::SiluPair => {
                if n % 2 != 0 {
                    return Ok(None);
                }
                (2, x, n / 2)
            }
        };
        let mut all = inputs;
        all.extend([nw, eps, res]);
        let two_bytes = matches!(dt, Dtype::Bfloat16 | Dtype::Float16);
        let mma = (2..=MMA_MAX_ROWS).contains(&b) && two_bytes && k % 128 == 0 && out_n % 16 == 0;
        let mut t: Vec<(&str, i32)> = vec![("NORM", norm), ("EPI", epi)];
        let (kernel, blocks, threads) = if mma && mma_on() {
            // Built for 8 or 16 rows, taking the row count from `x`: every
            // bucket of 2-8 (9-16) rows shares one build.
            t.extend([("NB", mma_capacity(b)), ("ROWS_RT", 1)]);
            t.push(("BF16", i32::from(dt == Dtype::Bfloat16)));
            let kernel = if quant { &self.mma_q4 } else { &self.mma_dense };
            (kernel, (out_n / 16).min(MAX_BLOCKS), MMA_THREADS)
        } else if b <= COLS_MAX_ROWS || !mma_on() {
            let nc = cols_per_warp(b, out_n);
            t.extend([("NB", b), ("ROWS_RT", 0), ("NC", nc)]);
            let per_block = THREADS / 32 * nc;
            let kernel = if quant { &self.q4 } else { &self.dense };
            let blocks = ((out_n + per_block - 1) / per_block).min(MAX_BLOCKS);
            (kernel, blocks, THREADS)
        } else {
            return Ok(None);
        };
        if let Some(g) = g {
            t.push(("G", g));
        }
        let mut out = kernel.apply(
            &all,
            &[(&[b, out_n], dt)],
            (blocks * threads, 1),
            threads,
            &t,
            ("DT", dt),
        )?;
        let y = out
            .pop()
            .ok_or_else(|| ModelError::Invalid("gemv: the kernel returned no output".into()))?;
        Ok(Some(match bias {
            Some(bias) => mlx_rs::ops::add(&y, bias)?,
            None => y,
        }))
    }
}
