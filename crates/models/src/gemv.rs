//! Few-row matrix products on the GPU for decode steps: `x [B, K] @ W^T`
//! with one warp per output feature streaming its weight row in 16-byte
//! loads, for dense (`kernels/gemv.cu`) and MLX affine 4-bit weights
//! (`kernels/qgemv4.cu`, dequantized in registers). A one-row decode step
//! is a chain of such products over ~2.3 GB of weights at the 1.2B shape;
//! `benches/gemv_probe.py` measures them against MLX's own matmul and
//! quantized matmul at the model's shapes (benches/RESULTS.md).
//!
//! CUDA only (MLX's NVRTC path), used by the compiled GPU decode step
//! ([`crate::decode_kernels::DecodeKernels::linear`]) for inputs of at most
//! `WEFT_GEMV_MAX_ROWS` rows; anything the kernels do not take (other dtypes
//! or widths, 2/3/5/6/8-bit weights, groups below 32) falls back to the
//! layer's own forward.
//!
//! **Off by default** ([`GEMV_MAX_ROWS`] = 0): written without device time,
//! not yet compiled by NVRTC nor measured on a GPU. `benches/gpu_decode.sh`
//! stages `STEPS=gemv` (the probe) and `GEMV_SWEEP="0 8"` (the engine at
//! each setting) for the session that measures it; the default changes only
//! with those numbers in benches/RESULTS.md.

use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::Kernel;
use crate::error::Result;
use crate::linear::Linear;

/// Input rows up to which decode steps use these kernels (0: never);
/// `WEFT_GEMV_MAX_ROWS` overrides it.
pub const GEMV_MAX_ROWS: i32 = 0;

const DENSE_SOURCE: &str = include_str!("kernels/gemv.cu");
const Q4_SOURCE: &str = include_str!("kernels/qgemv4.cu");
const THREADS: i32 = 256;

fn max_rows() -> i32 {
    static ROWS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("WEFT_GEMV_MAX_ROWS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|&r: &i32| (0..=64).contains(&r))
            .unwrap_or(GEMV_MAX_ROWS)
    })
}

/// The two kernel objects (NVRTC compiles one per row count and dtype at
/// first use).
pub(crate) struct Gemv {
    dense: Kernel,
    q4: Kernel,
}

impl Gemv {
    pub(crate) fn new() -> Result<Self> {
        Ok(Self {
            dense: Kernel::new("weft_gemv", &["x", "w"], &["y"], DENSE_SOURCE)?,
            q4: Kernel::new(
                "weft_qgemv4",
                &["x", "w", "scales", "biases"],
                &["y"],
                Q4_SOURCE,
            )?,
        })
    }

    /// `x @ W^T (+ bias)` for `x` `[B, K]`, or None when the layer, its
    /// dtype or the row count is not one these kernels take.
    pub(crate) fn apply(&self, lin: &Linear, x: &Array) -> Result<Option<Array>> {
        let s = x.shape();
        if s.len() != 2 || s[0] < 1 || s[0] > max_rows() {
            return Ok(None);
        }
        let (b, k, dt) = (s[0], s[1], x.dtype());
        let (y, bias) = match lin {
            Linear::Dense { weight, bias, .. } => {
                let vec = match dt {
                    Dtype::Bfloat16 | Dtype::Float16 => 8,
                    Dtype::Float32 => 4,
                    _ => return Ok(None),
                };
                if weight.dtype() != dt || weight.shape() != [weight.dim(0), k] || k % vec != 0 {
                    return Ok(None);
                }
                let n = weight.dim(0);
                (self.launch(&self.dense, &[x, weight], n, b, &[], dt)?, bias)
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
                let n = weight.dim(0);
                let y = self.launch(
                    &self.q4,
                    &[x, weight, scales, biases],
                    n,
                    b,
                    &[("G", *group_size)],
                    dt,
                )?;
                (y, bias)
            }
            Linear::Host { .. } => return Ok(None),
        };
        Ok(Some(match bias {
            Some(bias) => mlx_rs::ops::add(&y, bias)?,
            None => y,
        }))
    }

    fn launch(
        &self,
        kernel: &Kernel,
        inputs: &[&Array],
        n: i32,
        b: i32,
        ints: &[(&str, i32)],
        dt: Dtype,
    ) -> Result<Array> {
        let warps = n as i64 * 32;
        let grid = ((warps + THREADS as i64 - 1) / THREADS as i64 * THREADS as i64) as i32;
        let mut t: Vec<(&str, i32)> = vec![("NB", b)];
        t.extend_from_slice(ints);
        let mut out = kernel.apply(inputs, &[(&[b, n], dt)], (grid, 1), THREADS, &t, ("DT", dt))?;
        out.pop().ok_or_else(|| {
            crate::error::ModelError::Invalid("gemv: the kernel returned no output".into())
        })
    }
}
