//! Loading a model directory under a device/dtype policy.

use std::path::Path;

use mlx_rs::Dtype;

use crate::config::ModelConfig;
use crate::cpu_kernels::Kernels;
use crate::error::{ModelError, Result};
use crate::lanes::Lanes;
use crate::linear::WeightPolicy;
use crate::llama::LlamaModel;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

/// Whether this libmlx runs on a CUDA GPU.
pub fn cuda_available() -> bool {
    // SAFETY: a plain query with an out-parameter.
    unsafe {
        let mut ok = false;
        mlx_sys::mlx_cuda_is_available(&mut ok) == 0 && ok
    }
}

/// Where MLX runs, as far as weight layout is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    /// The GPU when this libmlx has a usable CUDA or Metal backend.
    pub fn detect() -> Self {
        let cuda = cuda_available();
        let metal = unsafe {
            let mut ok = false;
            mlx_sys::mlx_metal_is_available(&mut ok) == 0 && ok
        };
        if cuda || metal {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Activation/weight dtype; None picks per device (f32 on CPU, bf16 on GPU).
    pub dtype: Option<Dtype>,
    /// Dequantize at load; None picks per device (no on GPU; on the CPU no
    /// where the packed GEMM runs quantized weights (AVX-512), else yes).
    pub dequantize: Option<bool>,
    pub device: Device,
    /// SiLU/attention formulation; None picks per device and dtype
    /// (`Kernels::CpuTuned` for f32 on CPU, stock MLX ops otherwise).
    pub kernels: Option<Kernels>,
    /// Parallel CPU lanes for batched steps ([`crate::Lanes`]); None picks
    /// per device (up to 2 on the CPU, 1 on the GPU).
    pub cpu_lanes: Option<usize>,
    /// Dense f32 linears on [`crate::cpu_gemm`]; None picks it on the CPU
    /// with the tuned kernels where the CPU has AVX2 or AVX-512.
    pub host_gemm: Option<bool>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            dequantize: None,
            device: Device::detect(),
            kernels: None,
            cpu_lanes: None,
            host_gemm: None,
        }
    }
}

impl LoadOptions {
    /// The lanes a [`crate::BatchRunner`] should spread steps over.
    pub fn lanes(&self) -> Lanes {
        match (self.device, self.cpu_lanes) {
            (Device::Gpu, _) => Lanes::single(),
            (Device::Cpu, None) => Lanes::auto_cpu(),
            (Device::Cpu, Some(n)) => Lanes::cpu(n),
        }
    }

    pub fn policy(&self) -> WeightPolicy {
        let cpu = self.device == Device::Cpu;
        let dtype = self
            .dtype
            .unwrap_or(if cpu { Dtype::Float32 } else { Dtype::Bfloat16 });
        let tuned_fits = cpu && dtype == Dtype::Float32;
        let kernels = match self.kernels {
            Some(Kernels::CpuTuned) if !tuned_fits => Kernels::Stock,
            Some(k) => k,
            None if tuned_fits => Kernels::CpuTuned,
            None => Kernels::Stock,
        };
        // Stock kernels promise mlx-lm's exact numbers, so their matmuls
        // stay MLX's.
        let host_gemm = tuned_fits
            && kernels == Kernels::CpuTuned
            && self
                .host_gemm
                .unwrap_or_else(|| crate::cpu_gemm::Isa::detect().is_vectorized());
        // On the CPU, MLX's quantized matmul is slow, so quantized weights are
        // dequantized once at load, unless the packed GEMM can multiply them
        // as they are (AVX-512: a fused dequantizing kernel, 3x less memory
        // than f32 and a faster single-stream decode).
        let keep_quantized =
            host_gemm && crate::cpu_gemm::Isa::detect() == crate::cpu_gemm::Isa::Avx512;
        WeightPolicy {
            dtype,
            dequantize: self.dequantize.unwrap_or(cpu && !keep_quantized),
            kernels,
            host_gemm,
        }
    }
}

pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
}

pub fn load(dir: &Path, opts: LoadOptions) -> Result<LoadedModel> {
    if !dir.is_dir() {
        return Err(ModelError::Invalid(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let config = ModelConfig::load(dir)?;
    let tokenizer = Tokenizer::load(dir)?;
    let weights = Weights::load_dir(dir)?;
    let model = LlamaModel::from_weights(config, weights, opts.policy())?;
    if model.policy.host_gemm {
        crate::lanes::single_threaded_blas_for_good();
    }
    Ok(LoadedModel { model, tokenizer })
}
