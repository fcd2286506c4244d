//! Parity with mlx-lm on random-weight fixtures mlx-lm itself creates:
//! a GQA Llama, a Qwen2 (q/k/v biases), a Qwen3 (q/k norms, explicit head_dim, tied head), and a
//! quantized Llama with a per-module override (8-bit embedding, 4-bit rest).

mod common;

use common::*;
use mlx_rs::Dtype;
use weft_models::{Kernels, LlamaModel, ModelConfig, WeightPolicy};

const PROMPTS: &[&[u32]] = &[
    &[1, 2, 3, 4, 5],
    &[17],
    &[
        300, 12, 99, 4, 4, 4, 250, 511, 0, 8, 16, 32, 64, 128, 256, 7, 3,
    ],
];
const N: usize = 32;
/// Both sides run f32; differences are summation-order noise.
const TOL: f32 = 2e-3;

fn check(arch: &str, quantize: bool, policy: WeightPolicy) {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("m");
    let md = model_dir.to_str().unwrap();
    let mut args = vec!["fixture", "--arch", arch, "--out", md];
    if quantize {
        args.push("--quantize");
    }
    oracle(&args);
    let prompts: Vec<_> = PROMPTS
        .iter()
        .map(|p| serde_json::json!({"ids": p}))
        .collect();
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::json!({"max_tokens": N, "prompts": prompts}).to_string(),
    )
    .unwrap();
    let want = oracle(&["run", "--model", md, "--requests", req.to_str().unwrap()]);

    let config = ModelConfig::load(&model_dir).unwrap();
    let weights = weft_models::weights::Weights::load_dir(&model_dir).unwrap();
    let model = LlamaModel::from_weights(config, weights, policy).unwrap();
    for (i, p) in PROMPTS.iter().enumerate() {
        let w = &want["results"][i];
        let (logits, tokens) = greedy(&model, p, N);
        let diff = max_abs_diff(&logits, &json_f32(&w["logits"]));
        eprintln!(
            "{arch} q={quantize} prompt {i}: max |dlogit| {diff:.2e}, margin {}",
            w["margin"]
        );
        assert!(
            diff < TOL,
            "{arch} prompt {i}: logits differ by {diff} (tolerance {TOL})"
        );
        assert_eq!(
            tokens,
            json_u32(&w["greedy"]),
            "{arch} prompt {i}: greedy tokens differ"
        );
    }
}

const DENSE_F32: WeightPolicy = WeightPolicy {
    dequantize: true,
    dtype: Dtype::Float32,
    kernels: Kernels::Stock,
    host_gemm: false,
};
const QUANT_F32: WeightPolicy = WeightPolicy {
    dequantize: false,
    dtype: Dtype::Float32,
    kernels: Kernels::Stock,
    host_gemm: false,
};
/// Weft's CPU default: this crate's exp, SiLU and attention, and the packed
/// GEMM for every linear.
const DENSE_F32_TUNED: WeightPolicy = WeightPolicy {
    kernels: Kernels::CpuTuned,
    host_gemm: true,
    ..DENSE_F32
};

#[test]
fn llama_gqa_matches_mlx_lm() {
    // Prefills of 5, 1 and 17 tokens and single-token decodes: the compiled
    // (shapeless) MLP activation traces once on this thread, never again.
    let before = weft_models::compile_traces();
    check("llama", false, DENSE_F32);
    assert_eq!(
        weft_models::compile_traces() - before,
        1,
        "the compiled MLP activation retraced across shapes"
    );
}

#[test]
fn llama_gqa_with_cpu_tuned_kernels_matches_mlx_lm() {
    check("llama", false, DENSE_F32_TUNED);
}

#[test]
fn llama_gqa_with_cpu_tuned_kernels_and_mlx_matmuls_matches_mlx_lm() {
    check(
        "llama",
        false,
        WeightPolicy {
            host_gemm: false,
            ..DENSE_F32_TUNED
        },
    );
}

#[test]
fn qwen2_with_qkv_bias_matches_mlx_lm() {
    check("qwen2", false, DENSE_F32);
}

/// Biases on packed linears.
#[test]
fn qwen2_with_qkv_bias_on_the_packed_gemm_matches_mlx_lm() {
    check("qwen2", false, DENSE_F32_TUNED);
}

#[test]
fn qwen3_matches_mlx_lm() {
    check("qwen3", false, DENSE_F32);
}

#[test]
fn quantized_llama_dequantized_matches_mlx_lm() {
    check("llama", true, DENSE_F32);
}

#[test]
fn quantized_llama_quantized_matmul_matches_mlx_lm() {
    check("llama", true, QUANT_F32);
}

/// Quantized weights kept quantized on the packed GEMM (the CPU default with
/// AVX-512).
#[test]
fn quantized_llama_on_the_packed_gemm_matches_mlx_lm() {
    check(
        "llama",
        true,
        WeightPolicy {
            kernels: Kernels::CpuTuned,
            host_gemm: true,
            ..QUANT_F32
        },
    );
}
