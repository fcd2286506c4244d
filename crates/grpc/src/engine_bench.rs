//! `weft bench-engine`: batched generation throughput of the engine in-process
//! (no gRPC), the counterpart of mlx-lm's `BatchGenerator` in
//! `benches/batch_throughput.py`.

use std::time::Instant;

use clap::Args;
use serde::Serialize;
use weft_scheduler::{Engine, Event, Request, SchedulerConfig};

use crate::generate::ComputeArgs;
use crate::runtime;

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    /// Concurrent requests, all submitted at once.
    #[arg(long, default_value_t = 8)]
    pub streams: usize,
    /// Prompt length in tokens (each prompt is different).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Model directory or a known model's name (default: SmolLM2-135M-Instruct).
    #[arg(long, default_value = "")]
    pub model: String,
    /// Prefill chunk size of the scheduler.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Tokens (decode + prefill) in one forward call [default: 2048 + streams,
    /// as `weft serve` sizes it, so the engine is measured as it serves].
    #[arg(long)]
    pub max_step_tokens: Option<usize>,
    /// Prefill tokens in a step that also decodes (as `weft serve
    /// --decode-prefill-tokens`).
    #[arg(long)]
    pub decode_prefill_tokens: Option<usize>,
    /// Draft tokens a stream verifies per step (as `weft serve --speculate`);
    /// off by default, so the engine alone is compared with the peer.
    #[arg(long, default_value_t = 0)]
    pub speculate: usize,
    /// As `weft serve --speculate-step-tokens`.
    #[arg(long, default_value_t = 8)]
    pub speculate_step_tokens: usize,
    /// Runs of the whole workload in one process; the last is reported
    /// (a GPU backend compiles and loads kernels per shape on first use).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// throughput: every stream submitted at once (the default). long-prompts:
    /// `--streams` decode while `--long-prompts` join, then one prompt of
    /// `--cancel-prompt` tokens is cancelled halfway through its prefill; reports
    /// the streams' inter-token latency against the ITL target and how soon the
    /// cancelled prompt's blocks are back (see benches/RESULTS.md).
    #[arg(long, value_enum, default_value_t = Scenario::Throughput)]
    pub scenario: Scenario,
    /// As `weft serve --itl-target-ms` [default: off for throughput, auto for
    /// long-prompts, as `weft serve`].
    #[arg(long, value_name = "MS|auto|off", value_parser = crate::server::config::parse_itl_target)]
    pub itl_target_ms: Option<crate::server::config::ItlSetting>,
    /// long-prompts: the prompts (tokens) that join the decoding streams, a
    /// second apart.
    #[arg(long, value_delimiter = ',', default_value = "2048,7000")]
    pub long_prompts: Vec<usize>,
    /// long-prompts: the prompt cancelled mid-prefill (tokens).
    #[arg(long, default_value_t = 7000)]
    pub cancel_prompt: usize,
    /// Streams (of `--streams`) whose output is constrained by a JSON schema: the
    /// constrained-output benchmark (e.g. `--streams 32 --constrained 16` against
    /// `--streams 32`). Their masks are computed on the engine thread each step.
    #[arg(long, default_value_t = 0)]
    pub constrained: usize,
    /// The JSON schema file those streams follow [default: a list of at least 64
    /// objects, so no stream can complete it before `--gen-tokens`].
    #[arg(long)]
    pub json_schema: Option<std::path::PathBuf>,
    /// LoRA adapters served (the adapter benchmark of issue 18): this many
    /// random mlx-lm adapters are written (`--adapter-rank`, on all seven
    /// projections of every layer, seeds 1..=N) and loaded, and stream `i` runs
    /// with adapter `i % N + 1`. 0: no adapters.
    #[arg(long, default_value_t = 0)]
    pub adapters: usize,
    /// Rank of the `--adapters`.
    #[arg(long, default_value_t = 16)]
    pub adapter_rank: usize,
    /// Where the `--adapters` are written (DIR/adapter-1 ... DIR/adapter-N) and
    /// kept, e.g. for mlx-lm to load the same files [default: a temporary
    /// directory, removed once the engine has loaded them].
    #[arg(long, value_name = "DIR")]
    pub adapter_dir: Option<std::path::PathBuf>,
    /// The `--adapters`' stored dtype. bf16 (the default): an mlx-lm
    /// `LoRALinear` loading them into a bf16 model computes its low-rank
    /// product in bf16, as Weft does (Weft casts any adapter to the model's
    /// compute dtype); f32 (what mlx-lm's trainer saves) makes mlx-lm's in f32.
    #[arg(long, value_enum, default_value_t = AdapterDtype::Bf16)]
    pub adapter_dtype: AdapterDtype,
    #[command(flatten)]
    pub kv_quant: crate::server::config::KvQuantArgs,
    /// Bytes of freed buffers MLX keeps for reuse, as `weft serve
    /// --mlx-cache-limit` (auto: one full decode step; off: MLX's default).
    /// Every scenario's engine takes it.
    #[arg(
        long,
        env = "WEFT_MLX_CACHE_LIMIT",
        value_name = "BYTES|auto|off",
        default_value = "auto"
    )]
    pub mlx_cache_limit: crate::memory_plan::CacheLimit,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AdapterDtype {
    Bf16,
    F32,
}

/// `lora_parameters.scale` of the benchmark's adapters. Their values are
/// uniform in [-0.5, 0.5) (see [`weft_models::write_random_mlx_lm`]); at rank
/// 16 over the 1.2B model's 2048 inputs this makes a projection's LoRA delta
/// about as large as its base output, so activations stay in range.
pub const BENCH_ADAPTER_SCALE: f32 = 0.05;

/// Writes `n` random adapters of rank `rank` (all seven projections, seeds
/// 1..=n) for `model_dir`'s model into `dir/adapter-1` ... `dir/adapter-n`.
pub fn write_bench_adapters(
    model_dir: &std::path::Path,
    dir: &std::path::Path,
    n: usize,
    rank: usize,
    dtype: AdapterDtype,
) -> anyhow::Result<Vec<runtime::AdapterSpec>> {
    use anyhow::Context as _;
    let base = weft_models::ModelConfig::load(model_dir)?;
    (1..=n)
        .map(|i| {
            let name = format!("adapter-{i}");
            let path = dir.join(&name);
            let spec = weft_models::RandomAdapter {
                rank,
                targets: weft_models::Target::ALL.to_vec(),
                scale: BENCH_ADAPTER_SCALE,
                seed: i as u64,
                bf16: dtype == AdapterDtype::Bf16,
            };
            weft_models::write_random_mlx_lm(&path, &base, &spec)
                .with_context(|| format!("writing adapter {}", path.display()))?;
            Ok(runtime::AdapterSpec { name, dir: path })
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    Throughput,
    LongPrompts,
}

/// The ITL target a bench run plans under.
pub(crate) fn itl_target(
    s: Option<crate::server::config::ItlSetting>,
    default: crate::server::config::ItlSetting,
    gpu: bool,
) -> anyhow::Result<weft_scheduler::ItlTarget> {
    use crate::server::config::ItlSetting;
    use weft_scheduler::ItlTarget;
    Ok(match s.unwrap_or(default) {
        ItlSetting::Auto => ItlTarget::auto(gpu),
        ItlSetting::Off => ItlTarget::Off,
        ItlSetting::Ms(0) => anyhow::bail!("--itl-target-ms must be at least 1"),
        ItlSetting::Ms(ms) => ItlTarget::Fixed(std::time::Duration::from_millis(ms)),
    })
}

#[derive(Debug, Serialize)]
pub struct EngineBenchReport {
    pub streams: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub wall_seconds: f64,
    /// All generated tokens / wall time (prefill included).
    pub generation_tok_per_s: f64,
    /// Tokens generated after every stream had its first token / that span.
    pub steady_decode_tok_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_max_ms: f64,
    /// Of the reported round: draft tokens verified and accepted.
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    pub openblas: Option<String>,
    /// Of the reported round: engine steps, and per step the wall time, the
    /// model's forward (all of it), its graph build and its evaluation wait.
    pub steps: u64,
    pub step_ms: f64,
    pub forward_ms: f64,
    pub build_ms: f64,
    pub eval_ms: f64,
    /// Streams with a JSON-schema constraint, and of the reported round: steps that
    /// ran pipelined, the host time computing masks per step and per mask, and how
    /// many generated tokens the constrained streams had (they end early only by
    /// completing the schema).
    pub constrained_streams: usize,
    pub pipelined_steps: u64,
    pub mask_ms_per_step: f64,
    pub mask_us_per_row: f64,
    pub constrained_tokens: usize,
    /// LoRA adapters served, the streams spread over them round-robin (0: none),
    /// and their rank.
    pub adapters: usize,
    pub adapter_rank: Option<usize>,
}

/// The default schema of `--constrained`: records in an array of at least 64, so a
/// stream cannot complete it inside a benchmark's generation length.
pub const BENCH_SCHEMA: &str = r#"{"type": "object",
 "properties": {"records": {"type": "array", "minItems": 64,
   "items": {"type": "object",
     "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                    "ok": {"type": "boolean"}},
     "required": ["id", "name", "ok"], "additionalProperties": false}}},
 "required": ["records"], "additionalProperties": false}"#;

pub fn run(args: EngineBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.adapters == 0 || args.scenario == Scenario::Throughput,
        "--adapters is measured by the throughput scenario only"
    );
    match args.scenario {
        Scenario::Throughput => throughput(args).map(|_| ()),
        Scenario::LongPrompts => crate::engine_bench_long::run(args).map(|_| ()),
    }
}

pub fn throughput(args: EngineBenchArgs) -> anyhow::Result<EngineBenchReport> {
    let dir = runtime::resolve_model(&args.model, false)?;
    let opts = args.compute.load_options()?;
    let gpu = opts.device == weft_models::Device::Gpu;
    let config = SchedulerConfig {
        itl_target: itl_target(
            args.itl_target_ms,
            crate::server::config::ItlSetting::Off,
            gpu,
        )?,
        max_batch_rows: args.streams.max(1),
        max_step_tokens: args
            .max_step_tokens
            .unwrap_or(2048 + args.streams)
            .max(args.streams),
        prefill_chunk: args.prefill_chunk,
        decode_prefill_tokens: args.decode_prefill_tokens,
        speculate: args.speculate,
        speculate_step_tokens: args.speculate_step_tokens,
        prefill_granule: if gpu {
            weft_scheduler::GPU_PREFILL_GRANULE
        } else {
            1
        },
        amortized_bound: crate::server::config::amortized_bound(gpu)?,
        strict_bound: crate::server::config::strict_bound()?,
        ..SchedulerConfig::default()
    };
    // Room for every stream's whole context (16-token blocks, each row's last
    // one partial), as the peer's dense cache has.
    let per_row = (args.prompt_tokens + args.gen_tokens).div_ceil(16) + 1;
    let blocks = args.streams.max(1) * per_row + 64;
    // The adapters' files: kept in --adapter-dir, else in a temporary directory
    // that lives until the engine has loaded them.
    let mut adapter_tmp = None;
    let adapters = if args.adapters > 0 {
        let root = match &args.adapter_dir {
            Some(d) => d.clone(),
            None => adapter_tmp
                .insert(
                    tempfile::Builder::new()
                        .prefix("weft-bench-adapters")
                        .tempdir()?,
                )
                .path()
                .to_path_buf(),
        };
        let t = Instant::now();
        let specs = write_bench_adapters(
            &dir,
            &root,
            args.adapters,
            args.adapter_rank,
            args.adapter_dtype,
        )?;
        eprintln!(
            "{} random adapters of rank {} written to {} in {} ms",
            args.adapters,
            args.adapter_rank,
            root.display(),
            t.elapsed().as_millis()
        );
        specs
    } else {
        Vec::new()
    };
    let (engine, tok, served) = runtime::start_engine_with(
        &dir,
        opts,
        config,
        runtime::KvSpec {
            block_size: 16,
            memory: weft_models::KvMemory::Blocks(u32::try_from(blocks)?),
            max_batch_rows: args.streams,
            cache_limit: args.mlx_cache_limit,
            quant: args.kv_quant.quant()?,
        },
        Default::default(),
        &adapters,
        &Default::default(),
    )?;
    drop(adapter_tmp);
    let registered = served.adapters.list().len();
    anyhow::ensure!(
        registered == args.adapters,
        "{} adapters written, {registered} registered",
        args.adapters,
    );
    let constraint = if args.constrained > 0 {
        anyhow::ensure!(
            args.constrained <= args.streams,
            "--constrained {} is more than --streams {}",
            args.constrained,
            args.streams
        );
        let schema = match &args.json_schema {
            Some(p) => std::fs::read_to_string(p)?,
            None => BENCH_SCHEMA.to_string(),
        };
        let g = crate::constraints::grammars(&tok, &served)?;
        let t = Instant::now();
        let c = g
            .compile(&weft_scheduler::ConstraintSpec::JsonSchema(schema))
            .map_err(|e| anyhow::anyhow!("--json-schema: {e}"))?;
        eprintln!(
            "json schema compiled in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        Some(c)
    } else {
        None
    };
    let vocab = served.vocab_size as u32;
    // Distinct prompts: no prefix sharing between streams.
    let prompts: Vec<Vec<u32>> = (0..args.streams)
        .map(|s| {
            (0..args.prompt_tokens)
                .map(|i| 100 + ((s * 7919 + i * 104_729) as u32 % (vocab - 200)))
                .collect()
        })
        .collect();
    // Like the peer's harness: one short request at the measured prompt length
    // first, so first-use costs (GPU kernel loading, allocator growth) stay out
    // of the numbers. Its own tenant: no prefix reuse for the measured prompts.
    if let Some(p) = prompts.first() {
        let mut r = Request::new("warmup", p.clone(), 4);
        r.ignore_eos = true;
        r.adapter = (args.adapters > 0).then_some(1);
        let mut s = engine.submit(r)?;
        while let Some(ev) = s.blocking_recv() {
            if let Event::Finished(f) = ev {
                if let Some(e) = f.error {
                    anyhow::bail!("the warm-up request failed: {e}");
                }
            }
        }
    }
    let mut last = None;
    let mut before = weft_scheduler::Stats::default();
    let mut times_before = runtime::forward_times();
    for round in 0..args.rounds.max(1) {
        before = engine.stats();
        times_before = runtime::forward_times();
        // A tenant per round: no prefix reuse from the round before.
        last = Some(one_round(
            &engine,
            &prompts,
            args.gen_tokens,
            &format!("bench-{round}"),
            constraint.as_ref().map(|c| (c, args.constrained)),
            args.adapters,
        )?);
    }
    let Some(Round {
        wall,
        tokens,
        steady,
        steady_span,
        ttft,
        constrained_tokens,
    }) = last
    else {
        anyhow::bail!("no round ran");
    };
    let after = engine.stats();
    let t = runtime::forward_times();
    let calls = (t.calls - times_before.calls).max(1) as f64;
    let per = |a: u64, b: u64| (a - b) as f64 / calls / 1e6;
    let steps = after.steps - before.steps;
    let report = EngineBenchReport {
        steps,
        step_ms: wall * 1e3 / steps.max(1) as f64,
        forward_ms: per(t.total_ns, times_before.total_ns),
        build_ms: per(t.build_ns, times_before.build_ns),
        eval_ms: per(t.eval_ns, times_before.eval_ns),
        draft_tokens: after.draft_tokens - before.draft_tokens,
        accepted_tokens: after.accepted_tokens - before.accepted_tokens,
        streams: args.streams,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        wall_seconds: wall,
        generation_tok_per_s: tokens as f64 / wall,
        steady_decode_tok_per_s: steady as f64 / steady_span.max(1e-9),
        ttft_p50_ms: ttft[ttft.len() / 2],
        ttft_max_ms: ttft[ttft.len() - 1],
        openblas: crate::blas::active(),
        constrained_streams: if constraint.is_some() {
            args.constrained
        } else {
            0
        },
        pipelined_steps: after.pipelined_steps - before.pipelined_steps,
        mask_ms_per_step: (after.constraint_mask_seconds - before.constraint_mask_seconds) * 1e3
            / steps.max(1) as f64,
        mask_us_per_row: (after.constraint_mask_seconds - before.constraint_mask_seconds) * 1e6
            / (after.constraint_masks - before.constraint_masks).max(1) as f64,
        constrained_tokens,
        adapters: args.adapters,
        adapter_rank: (args.adapters > 0).then_some(args.adapter_rank),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(report)
}

struct Round {
    wall: f64,
    tokens: usize,
    steady: usize,
    steady_span: f64,
    /// Sorted, ms.
    ttft: Vec<f64>,
    constrained_tokens: usize,
}

/// Submits every prompt at once and times the streams until all finish;
/// with `adapters` > 0, stream `i` runs with adapter `i % adapters + 1`.
fn one_round(
    engine: &Engine,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    tenant: &str,
    constrained: Option<(&weft_scheduler::Constraint, usize)>,
    adapters: usize,
) -> anyhow::Result<Round> {
    let start = Instant::now();
    let mut streams = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut r = Request::new(tenant, p.clone(), gen_tokens);
        r.ignore_eos = true;
        if adapters > 0 {
            r.adapter = Some(u32::try_from(i % adapters + 1)?);
        }
        // `n` of the streams, spread evenly through the batch (half: every other).
        if let Some((c, n)) = constrained {
            if (i * n) % prompts.len() < n {
                r.constraint = Some(c.clone());
            }
        }
        let constrained = r.constraint.is_some();
        streams.push((constrained, engine.submit(r)?));
    }
    // One thread per stream keeps arrival times honest without a runtime.
    let handles: Vec<_> = streams
        .into_iter()
        .map(|(constrained, mut s)| {
            std::thread::spawn(move || {
                let mut first = None;
                let mut times = Vec::new();
                let mut err = None;
                while let Some(ev) = s.blocking_recv() {
                    match ev {
                        Event::Token(d) => {
                            let now = Instant::now();
                            first.get_or_insert(now);
                            times.extend(std::iter::repeat_n(now, d.ids.len()));
                        }
                        Event::Finished(f) => err = f.error,
                    }
                }
                (first, times, err, constrained)
            })
        })
        .collect();
    let mut firsts = Vec::new();
    let mut all_times = Vec::new();
    let mut constrained_tokens = 0;
    for h in handles {
        let (first, times, err, constrained) = h
            .join()
            .map_err(|_| anyhow::anyhow!("stream thread panicked"))?;
        if let Some(e) = err {
            anyhow::bail!("a request failed: {e}");
        }
        if constrained {
            constrained_tokens += times.len();
        }
        firsts.push(first.ok_or_else(|| anyhow::anyhow!("a stream produced no token"))?);
        all_times.extend(times);
    }
    let end = all_times.iter().copied().max().unwrap_or(start);
    let wall = (end - start).as_secs_f64();
    let last_first = firsts.iter().copied().max().unwrap_or(start);
    let steady: usize = all_times.iter().filter(|t| **t > last_first).count();
    let mut ttft: Vec<f64> = firsts
        .iter()
        .map(|f| (*f - start).as_secs_f64() * 1e3)
        .collect();
    ttft.sort_by(|a, b| a.total_cmp(b));
    Ok(Round {
        wall,
        tokens: all_times.len(),
        steady,
        steady_span: (end - last_first).as_secs_f64(),
        ttft,
        constrained_tokens,
    })
}
