//! `weft generate`: one prompt through the real engine, streamed to stdout.

use std::io::Write;
use std::time::Instant;

use clap::Args;
use weft_models::{ChatMessage, Kernels, LoadOptions};
use weft_scheduler::{Event, Request, SamplingParams, SchedulerConfig};

use crate::runtime;

/// Device/dtype policy flags shared by `generate` and `serve`.
#[derive(Debug, Clone, Args)]
pub struct ComputeArgs {
    /// Activation dtype: auto (f32 on CPU, bf16 on GPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto", env = "WEFT_COMPUTE_DTYPE")]
    pub compute_dtype: String,
    /// Quantized weights: auto (keep on GPU and on CPUs where the packed GEMM
    /// multiplies them as they are, i.e. AVX-512; dequantize to f32 otherwise),
    /// keep or dequantize.
    #[arg(long, default_value = "auto", env = "WEFT_WEIGHTS")]
    pub weights: String,
    /// SiLU/attention kernels: auto (cpu-tuned for f32 on CPU, stock otherwise),
    /// stock (MLX's own ops, bit-identical to mlx-lm) or cpu-tuned (exp built
    /// from vectorised ops, as MLX's CPU exp is scalar; f32 on CPU only).
    #[arg(long, default_value = "auto", env = "WEFT_KERNELS")]
    pub kernels: String,
    /// Parallel CPU lanes a batched step is spread over: auto (up to 2 on
    /// the CPU, one per core; 1 on the GPU) or a count. 1 turns lanes off.
    #[arg(long, default_value = "auto", env = "WEFT_CPU_LANES")]
    pub cpu_lanes: String,
    /// Matmuls of dense f32 layers on the CPU: auto (packed where the CPU has
    /// AVX2 or AVX-512 and the kernels are cpu-tuned), packed (Weft's GEMM over
    /// weights packed once at load) or mlx (MLX's matmul through BLAS).
    #[arg(long, default_value = "auto", env = "WEFT_CPU_GEMM")]
    pub cpu_gemm: String,
}

impl ComputeArgs {
    pub fn load_options(&self) -> anyhow::Result<LoadOptions> {
        let dtype = match self.compute_dtype.as_str() {
            "auto" => None,
            "f32" | "float32" => Some(mlx_rs::Dtype::Float32),
            "f16" | "float16" => Some(mlx_rs::Dtype::Float16),
            "bf16" | "bfloat16" => Some(mlx_rs::Dtype::Bfloat16),
            other => anyhow::bail!("--compute-dtype {other:?}: expected auto, f32, f16 or bf16"),
        };
        let dequantize = match self.weights.as_str() {
            "auto" => None,
            "keep" => Some(false),
            "dequantize" => Some(true),
            other => anyhow::bail!("--weights {other:?}: expected auto, keep or dequantize"),
        };
        let kernels = match self.kernels.as_str() {
            "auto" => None,
            "stock" => Some(Kernels::Stock),
            "cpu-tuned" => Some(Kernels::CpuTuned),
            other => anyhow::bail!("--kernels {other:?}: expected auto, stock or cpu-tuned"),
        };
        let cpu_lanes = match self.cpu_lanes.as_str() {
            "auto" => None,
            n => match n.parse::<usize>() {
                Ok(n @ 1..=64) => Some(n),
                _ => anyhow::bail!("--cpu-lanes {n:?}: expected auto or a count from 1 to 64"),
            },
        };
        let host_gemm = match self.cpu_gemm.as_str() {
            "auto" => None,
            "packed" => Some(true),
            "mlx" => Some(false),
            other => anyhow::bail!("--cpu-gemm {other:?}: expected auto, packed or mlx"),
        };
        let opts = LoadOptions {
            dtype,
            dequantize,
            kernels,
            cpu_lanes,
            host_gemm,
            ..LoadOptions::default()
        };
        let policy = opts.policy();
        if kernels == Some(Kernels::CpuTuned) && policy.kernels != Kernels::CpuTuned {
            anyhow::bail!(
                "--kernels cpu-tuned needs f32 activations on the CPU (this run computes in {:?} on the {:?}); use --compute-dtype f32 or --kernels auto",
                policy.dtype,
                opts.device
            );
        }
        if host_gemm == Some(true) && !policy.host_gemm {
            anyhow::bail!(
                "--cpu-gemm packed needs f32 activations, cpu-tuned kernels and the CPU (this run: {:?}, {:?} kernels, {:?})",
                policy.dtype,
                policy.kernels,
                opts.device
            );
        }
        Ok(opts)
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt text.
    #[arg(long, short)]
    pub prompt: String,
    /// Model directory, or a known model's name (SmolLM2-135M-Instruct, the
    /// default; gemma3-270m), fetched and converted on first use.
    #[arg(long, short, default_value = "", env = "WEFT_MODEL")]
    pub model: String,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Apply the model's chat template to the prompt (as one user message).
    #[arg(long)]
    pub chat: bool,
    /// Keep generating past end-of-sequence.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Draft tokens verified per step when greedy (as `weft serve
    /// --speculate`; output unchanged). 0 turns speculation off.
    #[arg(long, env = "WEFT_SPECULATE", default_value_t = crate::server::config::DEFAULT_SPECULATE)]
    pub speculate: usize,
    #[command(flatten)]
    pub kv_quant: crate::server::config::KvQuantArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if args.temperature.is_nan() || args.temperature < 0.0 {
        anyhow::bail!("--temperature must be >= 0");
    }
    if args.top_p.is_nan() || args.top_p <= 0.0 || args.top_p > 1.0 {
        anyhow::bail!("--top-p must be in (0, 1]");
    }
    let dir = runtime::resolve_model(&args.model, true)?;
    let opts = args.compute.load_options()?;
    let config = SchedulerConfig {
        speculate: args.speculate,
        speculate_step_tokens: crate::server::config::DEFAULT_SPECULATE_STEP_TOKENS,
        ..SchedulerConfig::default()
    };
    let (engine, tokenizer, _served) = runtime::start_engine(
        &dir,
        opts,
        config,
        runtime::KvSpec {
            block_size: weft_models::DEFAULT_BLOCK_SIZE,
            // One request: its prompt and output, whatever their length, up
            // to the CPU's default budget.
            memory: weft_models::KvMemory::Bytes(crate::server::config::DEFAULT_CPU_KV_BYTES),
            max_batch_rows: 1,
            cache_limit: crate::memory_plan::CacheLimit::Auto,
            quant: args.kv_quant.quant()?,
        },
    )?;
    let text = if args.chat {
        tokenizer.apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            }],
            true,
        )?
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(&text)?;
    let mut req = Request::new("local", prompt, args.max_tokens);
    req.sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        ..SamplingParams::default()
    };
    req.seed = args.seed;
    req.ignore_eos = args.ignore_eos;
    let start = Instant::now();
    let mut stream = engine.submit(req)?;
    let mut first: Option<Instant> = None;
    let mut out = std::io::stdout().lock();
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Token(d) => {
                first.get_or_insert_with(Instant::now);
                out.write_all(d.text.as_bytes())?;
                out.flush()?;
            }
            Event::Finished(f) => {
                writeln!(out)?;
                let end = Instant::now();
                let u = &f.usage;
                let ttft = first.map(|t| t - start).unwrap_or_default();
                let decode = first.map(|t| end - t).unwrap_or_default();
                let decode_tps = if u.generated_tokens > 1 && decode.as_secs_f64() > 0.0 {
                    (u.generated_tokens - 1) as f64 / decode.as_secs_f64()
                } else {
                    0.0
                };
                eprintln!(
                    "-- {} prompt tokens, {} generated ({}); prefill {:.1} tok/s (TTFT {:.0} ms), decode {:.1} tok/s",
                    u.prompt_tokens,
                    u.generated_tokens,
                    f.reason.as_str(),
                    u.prompt_tokens as f64 / ttft.as_secs_f64().max(1e-9),
                    ttft.as_secs_f64() * 1e3,
                    decode_tps,
                );
                if let Some(e) = f.error {
                    anyhow::bail!("generation failed: {e}");
                }
            }
        }
    }
    Ok(())
}
