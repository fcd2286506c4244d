//! The default model (SmolLM2-135M-Instruct, converted from the PyPI GGUF)
//! against mlx-lm loading the same converted directory: tokenization, last
//! position logits and 32+ greedy tokens per prompt.

mod common;

use common::*;
use mlx_rs::Dtype;
use weft_models::{Device, Kernels, LoadOptions};

fn default_model_dir() -> std::path::PathBuf {
    let cache = std::env::var_os("WEFT_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(weft_gguf::default_cache_dir);
    weft_gguf::pull_default(&cache, false).expect("fetch and convert the default model")
}

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Les 3 plus grandes villes du Japon sont",
];
const N: usize = 32;
/// f32 on both sides with the same kernels (MLX quantized matmul, or dense
/// matmul over weights dequantized at load, which is Weft's CPU default and
/// what the oracle's `--dequantize` reproduces): differences are summation
/// order only. (Across kernels, quantized vs dequantized, MLX itself differs
/// by up to ~0.07 in these logits.)
const TOL: f32 = 2e-3;
const NEAR_TIE: f64 = 1e-3;

#[test]
fn default_model_matches_mlx_lm() {
    let dir = default_model_dir();
    let tmp = tempfile::tempdir().unwrap();
    let prompts: Vec<_> = PROMPTS
        .iter()
        .map(|p| serde_json::json!({"text": p}))
        .collect();
    let req = tmp.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::json!({"max_tokens": N, "prompts": prompts}).to_string(),
    )
    .unwrap();
    for dequantize in [false, true] {
        let mut args = vec![
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--requests",
            req.to_str().unwrap(),
        ];
        if dequantize {
            args.push("--dequantize");
        }
        let want = oracle(&args);
        for (kernels, host_gemm) in [
            (Kernels::Stock, false),
            (Kernels::CpuTuned, false),
            (Kernels::CpuTuned, true),
        ] {
            check(&dir, &want, dequantize, kernels, host_gemm, TOL);
        }
    }
}

fn check(
    dir: &std::path::Path,
    want: &serde_json::Value,
    dequantize: bool,
    kernels: Kernels,
    host_gemm: bool,
    tol: f32,
) {
    let opts = LoadOptions {
        dtype: Some(Dtype::Float32),
        dequantize: Some(dequantize),
        device: Device::Cpu,
        kernels: Some(kernels),
        cpu_lanes: None,
        host_gemm: Some(host_gemm),
    };
    let loaded = weft_models::load(dir, opts).unwrap();
    for (i, p) in PROMPTS.iter().enumerate() {
        let w = &want["results"][i];
        let ids = loaded.tokenizer.encode(p).unwrap();
        assert_eq!(
            ids,
            json_u32(&w["ids"]),
            "prompt {i}: token ids differ from mlx-lm's tokenizer"
        );
        let (logits, tokens) = greedy(&loaded.model, &ids, N);
        let diff = max_abs_diff(&logits, &json_f32(&w["logits"]));
        let margins = json_f64(&w["margins"]);
        let upto = margins
            .iter()
            .position(|&m| m < NEAR_TIE)
            .map_or(N, |p| p + 1);
        eprintln!(
            "dequantize={dequantize} {kernels:?} host_gemm={host_gemm} prompt {i}: max |dlogit| {diff:.2e}; greedy compared over {upto} tokens; min margin {:.3}",
            margins.iter().copied().fold(f64::INFINITY, f64::min)
        );
        assert!(
            diff < tol,
            "dequantize={dequantize} {kernels:?} host_gemm={host_gemm} prompt {i}: logits differ by {diff} (tolerance {tol})"
        );
        assert!(
            upto >= 32,
            "prompt {i}: near-tie at token {upto}, choose another prompt"
        );
        assert_eq!(
            tokens[..upto],
            json_u32(&w["greedy"])[..upto],
            "prompt {i}: greedy tokens differ"
        );
    }
    let text = loaded
        .tokenizer
        .decode(
            &greedy(
                &loaded.model,
                &loaded.tokenizer.encode(PROMPTS[0]).unwrap(),
                4,
            )
            .1,
        )
        .unwrap();
    assert!(
        text.contains("Paris"),
        "the default model should say Paris, said {text:?}"
    );
}
