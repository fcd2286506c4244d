//! Linear layers and embeddings, dense or MLX-affine quantized.

use mlx_rs::{ops, Array, Dtype};

use crate::error::{ModelError, Result};
use crate::weights::Weights;

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
}

#[derive(Debug, Clone)]
pub enum Linear {
    Dense {
        weight: Array, // [out, in]
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
            return Ok(Linear::Dense {
                weight: weight.as_dtype(policy.dtype)?,
                bias,
            });
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
            return Ok(Linear::Dense {
                weight: dense,
                bias,
            });
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
    pub fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight, .. } | Linear::Quantized { weight, .. } => weight.dim(0),
        }
    }

    /// One layer computing all of `parts` (stacked outputs), or None when their
    /// layouts differ. Fewer, larger matmuls cut per-kernel overhead.
    pub fn fuse(parts: &[&Linear]) -> Result<Option<Linear>> {
        let cat = |xs: Vec<&Array>| ops::concatenate(&xs, 0);
        let biases: Vec<Option<&Array>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
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
                Ok(Some(Linear::Dense {
                    weight: cat(ws)?,
                    bias,
                }))
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
            None => Ok(None),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias } => (ops::matmul(x, weight.t())?, bias),
            Linear::Quantized {
                weight,
                scales,
                biases,
                bias,
                group_size,
                bits,
            } => (
                ops::quantized_matmul(x, weight, scales, biases, true, *group_size, *bits)?,
                bias,
            ),
        };
        Ok(match bias {
            Some(b) => ops::add(&y, b)?,
            None => y,
        })
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
        }
    }
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
