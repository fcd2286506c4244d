//! Linear layers and embeddings, dense or MLX-affine quantized.

use std::sync::Arc;

use mlx_rs::{ops, Array, Dtype};

use crate::cpu_gemm::PackedWeight;
use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// Input rows (tokens) from which a quantized layer computes through a
/// dequantized copy of its weight instead of MLX's quantized matmul, whose
/// cost grows with the batch (on an H200, 4-bit decode at 64 rows ran ~4x
/// slower than bf16, and at 8 rows MLX's quantized matmul made the step
/// device-bound at 2.2x the bf16 step, while the dequantized path holds
/// ~0.85x of bf16 whatever the rows; benches/RESULTS.md, issue 14).
/// `WEFT_QMM_MAX_ROWS` overrides it (a measurement knob).
pub const QMM_MAX_ROWS: usize = 8;

fn qmm_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("WEFT_QMM_MAX_ROWS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|&r: &usize| r >= 1)
            .unwrap_or(QMM_MAX_ROWS)
    })
}

/// How weights are held in memory for compute, and the kernels that use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightPolicy {
    /// Dequantize quantized weights once at load (fast on CPU, where MLX's
    /// quantized matmul is single-threaded and BLAS is not).
    pub dequantize: bool,
    /// Dtype of activations and dense weights.
    pub dtype: Dtype,
    /// Formulation of SiLU and attention (`Kernels::CpuTuned` needs f32).
    pub kernels: crate::cpu_kernels::Kernels,
    /// Dense f32 linears run on [`crate::cpu_gemm`] (CPU only) instead of
    /// MLX's matmul.
    pub host_gemm: bool,
}

#[derive(Debug, Clone)]
pub enum Linear {
    Dense {
        weight: Array, // [out, in]
        /// `weight` transposed, `[in, out]`: a view of the same buffer,
        /// evaluated at load, so a step's matmul reads it without a
        /// transpose of its own in every step's graph.
        wt: Array,
        bias: Option<Array>,
    },
    Quantized {
        weight: Array, // packed uint32 [out, in * bits / 32]
        scales: Array,
        biases: Array,
        bias: Option<Array>,
        group_size: i32,
        bits: i32,
    },
    /// Packed for the CPU GEMM: computed outside MLX's graph, so calling
    /// `forward` evaluates its input.
    Host {
        weight: Arc<PackedWeight>,
        bias: Option<Array>,
    },
}

impl Linear {
    /// Loads `{prefix}.weight` (+ scales/biases when quantized, + bias).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<(i32, i32)>,
        policy: WeightPolicy,
    ) -> Result<Self> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let bias = w
            .take_opt(&format!("{prefix}.bias"))
            .map(|b| b.as_dtype(policy.dtype))
            .transpose()?;
        let is_quantized = weight.dtype() == Dtype::Uint32;
        if !is_quantized {
            return Linear::dense(weight.as_dtype(policy.dtype)?, bias);
        }
        let (group_size, bits) = quant.ok_or_else(|| ModelError::Tensor {
            name: format!("{prefix}.weight"),
            message: "is packed uint32 but config.json declares no quantization for it".into(),
        })?;
        let scales = w.take(&format!("{prefix}.scales"))?;
        let biases = w.take(&format!("{prefix}.biases"))?;
        check_quant_shapes(prefix, &weight, &scales, group_size, bits)?;
        if policy.dequantize {
            let dense = ops::dequantize(&weight, &scales, &biases, group_size, bits)?
                .as_dtype(policy.dtype)?;
            return Linear::dense(dense, bias);
        }
        Ok(Linear::Quantized {
            weight,
            scales: scales.as_dtype(policy.dtype)?,
            biases: biases.as_dtype(policy.dtype)?,
            bias,
            group_size,
            bits,
        })
    }

    /// Output features.
    /// A dense layer of `weight` `[out, in]`.
    pub fn dense(weight: Array, bias: Option<Array>) -> Result<Self> {
        let wt = weight.t();
        Ok(Linear::Dense { weight, wt, bias })
    }

    pub fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight, .. } | Linear::Quantized { weight, .. } => weight.dim(0),
            Linear::Host { weight, .. } => weight.out_features() as i32,
        }
    }

    /// This layer packed for [`crate::cpu_gemm`] (dense f32, or 2/4/8-bit
    /// affine where AVX-512 runs the quantized kernel), or None when the
    /// packed kernels cannot take it.
    pub fn to_host(&self) -> Result<Option<Linear>> {
        if let Linear::Quantized {
            weight,
            scales,
            biases,
            bias,
            group_size,
            bits,
        } = self
        {
            return Self::affine_to_host(weight, scales, biases, bias, *group_size, *bits);
        }
        let Linear::Dense { weight, bias, .. } = self else {
            return Ok(None);
        };
        if weight.dtype() != Dtype::Float32 || weight.ndim() != 2 {
            return Ok(None);
        }
        let (n, k) = (weight.dim(0) as usize, weight.dim(1) as usize);
        let w = weight.contiguous()?;
        let data = w.try_as_slice::<f32>().map_err(|e| ModelError::Tensor {
            name: format!("[{n}, {k}] weight"),
            message: format!("cannot read for packing: {e}"),
        })?;
        Ok(Some(Linear::Host {
            weight: Arc::new(PackedWeight::pack(data, n, k)),
            bias: bias.clone(),
        }))
    }

    /// A quantized layer packed for the CPU GEMM as it is (2, 4, 8 bits),
    /// or None for widths the packed kernels do not read.
    fn affine_to_host(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        bias: &Option<Array>,
        group_size: i32,
        bits: i32,
    ) -> Result<Option<Linear>> {
        // Without AVX-512 only the portable loop reads quantized blocks,
        // slower than MLX's own quantized matmul.
        let fast = crate::cpu_gemm::Isa::detect() == crate::cpu_gemm::Isa::Avx512;
        if !fast || !matches!(bits, 2 | 4 | 8) || weight.ndim() != 2 {
            return Ok(None);
        }
        let n = weight.dim(0) as usize;
        let k = weight.dim(1) as usize * 32 / bits as usize;
        let read = |what: &str, e: mlx_rs::error::AsSliceError| ModelError::Tensor {
            name: format!("quantized [{n}, {k}] weight"),
            message: format!("cannot read its {what} for packing: {e}"),
        };
        let wq = weight.contiguous()?;
        let sc = scales.as_dtype(Dtype::Float32)?.contiguous()?;
        let bi = biases.as_dtype(Dtype::Float32)?.contiguous()?;
        let packed = PackedWeight::pack_affine(
            wq.try_as_slice::<u32>().map_err(|e| read("words", e))?,
            sc.try_as_slice::<f32>().map_err(|e| read("scales", e))?,
            bi.try_as_slice::<f32>().map_err(|e| read("biases", e))?,
            n,
            k,
            group_size as usize,
            bits as usize,
        )
        .map_err(|message| ModelError::Tensor {
            name: format!("quantized [{n}, {k}] weight"),
            message,
        })?;
        Ok(Some(Linear::Host {
            weight: Arc::new(packed),
            bias: bias.clone(),
        }))
    }

    /// One layer computing all of `parts` (stacked outputs), or None when their
    /// layouts differ. Fewer, larger matmuls cut per-kernel overhead.
    pub fn fuse(parts: &[&Linear]) -> Result<Option<Linear>> {
        let cat = |xs: Vec<&Array>| ops::concatenate(&xs, 0);
        let biases: Vec<Option<&Array>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { bias, .. }
                | Linear::Quantized { bias, .. }
                | Linear::Host { bias, .. } => bias.as_ref(),
            })
            .collect();
        let bias = if biases.iter().all(|b| b.is_none()) {
            None
        } else if biases.iter().all(|b| b.is_some()) {
            Some(cat(biases.into_iter().flatten().collect())?)
        } else {
            return Ok(None);
        };
        match parts.first() {
            Some(Linear::Dense { weight: w0, .. }) => {
                let mut ws = Vec::new();
                for p in parts {
                    match p {
                        Linear::Dense { weight, .. } if weight.dtype() == w0.dtype() => {
                            ws.push(weight)
                        }
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Linear::dense(cat(ws)?, bias)?))
            }
            Some(Linear::Quantized {
                group_size: g0,
                bits: b0,
                ..
            }) => {
                let (mut ws, mut ss, mut bs) = (Vec::new(), Vec::new(), Vec::new());
                for p in parts {
                    match p {
                        Linear::Quantized {
                            weight,
                            scales,
                            biases,
                            group_size,
                            bits,
                            ..
                        } if group_size == g0 && bits == b0 => {
                            ws.push(weight);
                            ss.push(scales);
                            bs.push(biases);
                        }
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Linear::Quantized {
                    weight: cat(ws)?,
                    scales: cat(ss)?,
                    biases: cat(bs)?,
                    bias,
                    group_size: *g0,
                    bits: *b0,
                }))
            }
            // Fusing happens before packing.
            Some(Linear::Host { .. }) | None => Ok(None),
        }
    }

    /// `x @ W^T (+ bias)`. A quantized layer multiplies quantized below
    /// [`QMM_MAX_ROWS`] input rows, and dequantizes into a transient dense
    /// weight for wider inputs.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (y, bias) = match self {
            Linear::Dense { wt, bias, .. } => (ops::matmul(x, wt)?, bias),
            Linear::Quantized {
                weight,
                scales,
                biases,
                bias,
                group_size,
                bits,
            } => {
                let rows = x.size() / x.dim(-1).max(1) as usize;
                let y = if rows >= qmm_max_rows() {
                    // MLX's quantized matmul reads the weights once per few
                    // rows: a wide batch is faster dequantized in the step (one
                    // read of the packed weights, one dense matmul).
                    let w = ops::dequantize(weight, scales, biases, *group_size, *bits)?;
                    let w = if w.dtype() == x.dtype() {
                        w
                    } else {
                        w.as_dtype(x.dtype())?
                    };
                    ops::matmul(x, w.t())?
                } else {
                    ops::quantized_matmul(x, weight, scales, biases, true, *group_size, *bits)?
                };
                (y, bias)
            }
            Linear::Host { weight, bias } => (host_matmul(weight, &x.contiguous()?)?, bias),
        };
        with_bias(y, bias)
    }

    /// As `forward`, but a packed layer first queues its input's evaluation
    /// and yields, so an interleaved executor ([`crate::llama::LlamaModel::
    /// forward_interleaved`]) can run another forward's GEMM while MLX
    /// computes this input.
    pub async fn forward_async(&self, x: &Array) -> Result<Array> {
        let Linear::Host { weight, bias } = self else {
            return self.forward(x);
        };
        let x = x.contiguous()?;
        mlx_rs::transforms::async_eval([&x])?;
        YieldOnce(false).await;
        with_bias(host_matmul(weight, &x)?, bias)
    }

    /// Rows of the weight matrix as dense vectors: the embedding lookup.
    pub fn embed(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        match self {
            Linear::Dense { weight, .. } => Ok(weight.take_axis(ids, 0)?),
            Linear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
                ..
            } => {
                let w = weight.take_axis(ids, 0)?;
                let s = scales.take_axis(ids, 0)?;
                let b = biases.take_axis(ids, 0)?;
                Ok(ops::dequantize(&w, &s, &b, *group_size, *bits)?.as_dtype(dtype)?)
            }
            Linear::Host { .. } => Err(ModelError::Invalid(
                "a packed layer cannot serve embedding lookups".into(),
            )),
        }
    }
}

fn with_bias(y: Array, bias: &Option<Array>) -> Result<Array> {
    Ok(match bias {
        Some(b) => ops::add(&y, b)?,
        None => y,
    })
}

/// `x · wᵀ` on the CPU GEMM: evaluates `x` (`[..., k]`, f32, row-contiguous:
/// callers pass `contiguous()`) and wraps the product in a new array.
fn host_matmul(w: &PackedWeight, x: &Array) -> Result<Array> {
    let shape = x.shape();
    let k = shape.last().copied().unwrap_or(0) as usize;
    if k != w.in_features() || x.dtype() != Dtype::Float32 {
        return Err(ModelError::Invalid(format!(
            "packed linear takes f32 [..., {}], got {:?} {shape:?}",
            w.in_features(),
            x.dtype()
        )));
    }
    let m = x.size() / k.max(1);
    let mut out = shape.to_vec();
    if let Some(last) = out.last_mut() {
        *last = w.out_features() as i32;
    }
    if m == 0 {
        return Ok(Array::zeros::<f32>(&out)?);
    }
    let xs = x
        .try_as_slice::<f32>()
        .map_err(|e| ModelError::Invalid(format!("packed linear input: {e}")))?;
    let mut y = vec![0f32; m * w.out_features()];
    w.matmul(xs, m, &mut y);
    Ok(array_from_vec(y, &out))
}

fn check_quant_shapes(
    prefix: &str,
    weight: &Array,
    scales: &Array,
    group_size: i32,
    bits: i32,
) -> Result<()> {
    let (ws, ss) = (weight.shape(), scales.shape());
    let ok =
        ws.len() == 2 && ss.len() == 2 && ws[0] == ss[0] && ws[1] * 32 / bits == ss[1] * group_size;
    if !ok {
        return Err(ModelError::Tensor {
            name: format!("{prefix}.weight"),
            message: format!(
                "packed shape {ws:?} and scales {ss:?} disagree with group_size {group_size}, bits {bits}"
            ),
        });
    }
    Ok(())
}

/// Returns `Pending` once: the point where an interleaved executor moves to
/// the next forward.
pub(crate) struct YieldOnce(pub bool);

impl std::future::Future for YieldOnce {
    type Output = ();
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            std::task::Poll::Ready(())
        } else {
            self.0 = true;
            std::task::Poll::Pending
        }
    }
}

/// An f32 array over `data` without copying it: MLX frees it through the
/// destructor when the array's last reference goes.
fn array_from_vec(data: Vec<f32>, shape: &[i32]) -> Array {
    unsafe extern "C" fn free_vec(payload: *mut std::ffi::c_void) {
        // SAFETY: payload is the Box<Vec<f32>> leaked below, freed once.
        drop(unsafe { Box::from_raw(payload as *mut Vec<f32>) });
    }
    debug_assert_eq!(
        data.len(),
        shape.iter().map(|&d| d as usize).product::<usize>()
    );
    let boxed = Box::new(data);
    let ptr = boxed.as_ptr() as *mut std::ffi::c_void;
    let payload = Box::into_raw(boxed) as *mut std::ffi::c_void;
    // SAFETY: ptr addresses len f32s matching shape, valid until free_vec
    // runs; MLX takes ownership of payload.
    unsafe {
        Array::from_ptr(mlx_sys::mlx_array_new_data_managed_payload(
            ptr,
            shape.as_ptr(),
            shape.len() as i32,
            mlx_sys::mlx_dtype__MLX_FLOAT32,
            payload,
            Some(free_vec),
        ))
    }
}
