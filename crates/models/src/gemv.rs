//! Few-row matrix products on the GPU for decode steps: `x [B, K] @ W^T`
//! with one warp per output feature streaming its weight row in 16-byte
//! loads, for dense and MLX affine 4-bit weights (dequantized in registers),
//! each optionally fused with what surrounds it in a decode layer: the RMS
//! norm of its input ([`Pre::Norm`]), and the residual add or the SwiGLU of
//! a fused gate/up projection on its output ([`Post`]). A one-row decode
//! step is a chain of such products over ~2.3 GB of weights at the 1.2B
//! shape, and on the GPU every primitive costs host time too (see
//! [`crate::decode_kernels`]), so fusing the norms and the element-wise
//! epilogues removes four kernels per layer.
//!
//! The kernels are `kernels/gemv_head.cu`, then `gemv_dense.cu` or
//! `gemv_q4.cu`, then `gemv_tail.cu`; `benches/gemv_probe.py` measures them
//! against MLX's own matmul / quantized matmul chains at the model's shapes
//! (benches/RESULTS.md).
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
/// ~870), so on for one row; at 2-8 rows MLX's own products are faster.
pub const GEMV_MAX_ROWS_Q4: i32 = 1;

const DENSE_SOURCE: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/gemv_dense.cu"),
    include_str!("kernels/gemv_tail.cu")
);
const Q4_SOURCE: &str = concat!(
    include_str!("kernels/gemv_head.cu"),
    include_str!("kernels/gemv_q4.cu"),
    include_str!("kernels/gemv_tail.cu")
);
const THREADS: i32 = 256;
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

/// The two kernel objects (NVRTC compiles one per row count, mode and dtype
/// at first use).
pub(crate) struct Gemv {
    dense: Kernel,
    q4: Kernel,
}

impl Gemv {
    pub(crate) fn new() -> Result<Self> {
        Ok(Self {
            dense: Kernel::new(
                "weft_gemv_dense",
                &["x", "w", "nw", "eps", "res"],
                &["y"],
                DENSE_SOURCE,
            )?,
            q4: Kernel::new(
                "weft_gemv_q4",
                &["x", "w", "scales", "biases", "nw", "eps", "res"],
                &["y"],
                Q4_SOURCE,
            )?,
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
        let (inputs, n, kernel, g, bias): (Vec<&Array>, i32, &Kernel, Option<i32>, _) = match lin {
            Linear::Dense { weight, bias, .. } => {
                let vec = match dt {
                    Dtype::Bfloat16 | Dtype::Float16 => 8,
                    Dtype::Float32 => 4,
                    _ => return Ok(None),
                };
                if weight.dtype() != dt || weight.shape() != [weight.dim(0), k] || k % vec != 0 {
                    return Ok(None);
                }
                (vec![x, weight], weight.dim(0), &self.dense, None, bias)
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
                    &self.q4,
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
        let blocks = ((out_n + 7) / 8).min(MAX_BLOCKS);
        let mut t: Vec<(&str, i32)> = vec![("NB", b), ("NORM", norm), ("EPI", epi)];
        if let Some(g) = g {
            t.push(("G", g));
        }
        let mut out = kernel.apply(
            &all,
            &[(&[b, out_n], dt)],
            (blocks * THREADS, 1),
            THREADS,
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
