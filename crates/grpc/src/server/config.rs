//! `weft serve` settings: flags, `WEFT_*` environment variables and an
//! optional TOML config file, in that order of precedence, over built-in
//! defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use serde::Deserialize;
use weft_scheduler::SchedulerConfig;

use crate::generate::ComputeArgs;
use crate::memory_plan::CacheLimit;
use crate::units::parse_duration;

/// [`SchedulerConfig::amortized_bound`] from `WEFT_AMORTIZED_BOUND` (ITL
/// targets a step may take for its prompt chunks to amortize the fixed cost of
/// prefilling; unless set, 1.0 on a GPU, 1.3 elsewhere).
pub(crate) fn amortized_bound(gpu: bool) -> anyhow::Result<f64> {
    match std::env::var("WEFT_AMORTIZED_BOUND") {
        Err(_) if gpu => Ok(weft_scheduler::step_cost::GPU_AMORTIZED_BOUND),
        Err(_) => Ok(weft_scheduler::step_cost::AMORTIZED_BOUND),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(b) if b.is_finite() && b >= 1.0 => Ok(b),
            _ => bail!("WEFT_AMORTIZED_BOUND={v}: expected a number of ITL targets, at least 1"),
        },
    }
}

/// [`SchedulerConfig::strict_bound`] from `WEFT_STRICT_BOUND` (`1`/`on` or
/// `0`/`off`; off unless set: on an H100 it held the long-prompts run's steps
/// nearer the target in one run of two, and in the other its 7000-token prompt
/// crept at 16-100 tokens a step, TTFT 3.1 s against 0.4-0.5 s, see
/// benches/RESULTS.md).
pub(crate) fn strict_bound() -> anyhow::Result<bool> {
    match std::env::var("WEFT_STRICT_BOUND").as_deref() {
        Err(_) | Ok("") => Ok(false),
        Ok("1") | Ok("on") => Ok(true),
        Ok("0") | Ok("off") => Ok(false),
        Ok(v) => bail!("WEFT_STRICT_BOUND={v}: expected on or off"),
    }
}

/// [`SchedulerConfig::starting_step`] from `WEFT_STARTING_STEP` (`alone` or
/// `rows`). Unless set: beside the rows on a GPU whose runner runs short
/// prompt chunks as decoding rows (`WEFT_SHORT_CHUNKS` not 0: the starting
/// prompt then adds ~1 ms to the rows' step, measured on an H100 at 48 rows),
/// else alone (on the CPU a 33-row decode doubles a short request's step).
pub(crate) fn starting_step(gpu: bool) -> anyhow::Result<weft_scheduler::StartingStep> {
    use weft_scheduler::StartingStep;
    match std::env::var("WEFT_STARTING_STEP").as_deref() {
        Err(_) | Ok("") if gpu && weft_models::runner::short_chunks_from_env() > 0 => {
            Ok(StartingStep::BesideRows)
        }
        Err(_) | Ok("") | Ok("alone") => Ok(StartingStep::Alone),
        Ok("rows") => Ok(StartingStep::BesideRows),
        Ok(v) => bail!("WEFT_STARTING_STEP={v}: expected alone or rows"),
    }
}

/// `--worker-threads` unless set: [`DEFAULT_WORKER_THREADS`], or the host's
/// cores if fewer.
fn default_worker_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(DEFAULT_WORKER_THREADS)
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8000";
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Burst-coalescing gap of the first step after idle (see `--coalesce`).
pub const DEFAULT_COALESCE: Duration = Duration::from_millis(10);
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// `--decode-prefill-tokens` on the CPU (see there).
pub const DEFAULT_CPU_DECODE_PREFILL_TOKENS: usize = 512;
/// `--speculate` and `--speculate-step-tokens` (see there; benches/RESULTS.md
/// has what they buy: on the CPU one stream gets ~1.9x on repetitive output,
/// while an 8-row step verifying drafts costs ~1.6x a plain one).
pub const DEFAULT_SPECULATE: usize = 4;
pub const DEFAULT_SPECULATE_STEP_TOKENS: usize = 8;
/// `--isolation-window-ms` unless set: see `SchedulerConfig::isolation_window`.
pub const DEFAULT_ISOLATION_WINDOW_MS: u64 = 5000;
/// `--anticipation-ms` unless set: see `SchedulerConfig::anticipation`. A client
/// chaining requests over loopback gRPC came back 0.9-2.6 ms after its last final
/// event on the CPU server (benches/RESULTS.md, issue 17).
pub const DEFAULT_ANTICIPATION_MS: u64 = 5;
/// `--worker-threads` unless set, at most (fewer on a host with fewer cores):
/// the gRPC/HTTP runtime's threads. The engine thread builds every step on the
/// host, and a runtime with a worker per core slowed it: on an H100 host (16
/// cores) `weft serve` at 256 streams made 17350 output tok/s with 16 workers and
/// 21978 with 4, against 22192 for the engine alone (benches/RESULTS.md, issue 14).
pub const DEFAULT_WORKER_THREADS: usize = 4;

/// Serve the weft.v1 gRPC API, health, reflection and Prometheus metrics
///
/// Services: weft.v1.Generation, grpc.health.v1.Health (NOT_SERVING until the
/// model is loaded and warm, and again while draining), server reflection.
///
/// Every option can also come from a `WEFT_*` environment variable (shown in
/// brackets) or from the config file given with `--config` (keys are the
/// option names with `_` for `-`, e.g. `metrics_listen = "0.0.0.0:9464"`);
/// flags win over the environment, which wins over the file.
///
/// Without `--tenants` the server is open (one tenant, "default", no API
/// keys) and refuses to bind anything but a loopback address. A tenant file:
///
///   [[tenant]]
///   name = "alice"
///   api_key_sha256 = "<`weft hash-key <key>` output>"   # or a list
///   weight = 2.0                # fair-share weight (default 1)
///   priority = [0, 10]          # allowed request priorities (default [0, 0])
///   max_concurrent = 16         # requests in flight
///   tokens_per_minute = 200000  # prompt + max_tokens, charged at admission
///   max_prompt_tokens = 4096
///   max_tokens = 1024
///   max_running = 8             # rows in the batch (optional)
///   max_waiting = 64            # queued requests (optional)
///
/// Clients send `authorization: Bearer <key>`.
///
/// SIGTERM / SIGINT: new requests get UNAVAILABLE, health turns NOT_SERVING,
/// in-flight requests finish (up to --drain-timeout; what is left then ends
/// with UNAVAILABLE), then the process exits 0. A second signal cuts the
/// drain short.
#[derive(Debug, Clone, Args)]
#[command(verbatim_doc_comment)]
pub struct ServeArgs {
    /// TOML config file with any of the options below.
    #[arg(long, env = "WEFT_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// gRPC address [default: 127.0.0.1:50051]. Port 0 picks a free port (the
    /// address is printed on stdout).
    #[arg(long, env = "WEFT_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Prometheus `/metrics` address [default: 127.0.0.1:9464]; "off" disables it.
    #[arg(long, env = "WEFT_METRICS_LISTEN", value_name = "ADDR|off")]
    pub metrics_listen: Option<String>,
    /// OpenAI-compatible HTTP API address (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/models`, `/health`) [default:
    /// 127.0.0.1:8000]; "off" disables it. Port 0 picks a free port.
    #[arg(long, env = "WEFT_HTTP_LISTEN", value_name = "ADDR|off")]
    pub http_listen: Option<String>,
    /// Also export the gateway gauges (requests waiting and running, KV cache
    /// usage 0-1) under another server's names: "vllm" adds
    /// `vllm:num_requests_waiting`, `vllm:num_requests_running` and
    /// `vllm:kv_cache_usage_perc`, the Kubernetes inference gateway's defaults
    /// [default: none].
    #[arg(long, env = "WEFT_METRICS_ALIASES", value_name = "none|vllm")]
    pub metrics_aliases: Option<String>,
    /// Serve gRPC and the HTTP API over TLS with this certificate chain (PEM);
    /// needs --tls-key. Metrics stay plaintext.
    #[arg(long, env = "WEFT_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "WEFT_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate signed by this CA (PEM).
    #[arg(long, env = "WEFT_TLS_CLIENT_CA", value_name = "PATH")]
    pub tls_client_ca: Option<PathBuf>,
    /// Model directory, or the name of a known model (SmolLM2-135M-Instruct,
    /// gemma3-270m; fetched and converted on first use) [default:
    /// SmolLM2-135M-Instruct].
    #[arg(long, short, env = "WEFT_MODEL")]
    pub model: Option<String>,
    /// Tenant file (TOML): tenants, API-key sha256 hashes, weights, priority
    /// ranges and limits. Required to bind a non-loopback address.
    #[arg(long, env = "WEFT_TENANTS", value_name = "PATH")]
    pub tenants: Option<PathBuf>,
    /// Rows (requests) in one forward call [default: 64].
    #[arg(long, env = "WEFT_MAX_BATCH_ROWS")]
    pub max_batch_rows: Option<usize>,
    /// Tokens (decode + prefill) in one forward call [default: 2048 + max-batch-rows, so
    /// a full decode batch leaves 2048 tokens of prefill].
    #[arg(long, env = "WEFT_MAX_STEP_TOKENS")]
    pub max_step_tokens: Option<usize>,
    /// Requests queued across all tenants before RESOURCE_EXHAUSTED [default: 1024].
    #[arg(long, env = "WEFT_MAX_WAITING")]
    pub max_waiting: Option<usize>,
    /// Threads of the async runtime that serves gRPC, HTTP and metrics (the
    /// engine runs on a thread of its own beside them). More workers than
    /// needed take host time from the engine thread, which builds every step
    /// [default: 4, or the host's cores if fewer].
    #[arg(long, env = "WEFT_WORKER_THREADS", value_name = "N")]
    pub worker_threads: Option<usize>,
    /// Largest prefill piece of one request in one step [default: 512].
    #[arg(long, env = "WEFT_PREFILL_CHUNK")]
    pub prefill_chunk: Option<usize>,
    /// Prefill tokens in a step that also decodes: bounds how long running
    /// requests wait between tokens while new prompts arrive [default: 512 on
    /// the CPU, no bound on a GPU; --max-step-tokens' value turns it off].
    #[arg(long, env = "WEFT_DECODE_PREFILL_TOKENS")]
    pub decode_prefill_tokens: Option<usize>,
    /// Inter-token latency target of a step that also decodes: its prefill is
    /// sized by the step cost the engine learns from the steps it runs, so long
    /// prompts join in chunks that keep running streams near it (on top of
    /// --decode-prefill-tokens). MS: that many milliseconds; "auto": 3x the
    /// learned cost of the step's decoding alone, at least 100 ms on the CPU and
    /// 20 ms on a GPU; "off": token budgets only [default: auto].
    #[arg(long, env = "WEFT_ITL_TARGET_MS", value_name = "MS|auto|off", value_parser = parse_itl_target)]
    pub itl_target_ms: Option<ItlSetting>,
    /// Latency isolation between tenants: while more than one tenant has had
    /// requests in the engine within this many milliseconds, steps with no
    /// decoding rows (a burst of prompts) are held to the ITL target too, so
    /// another tenant's next request waits for one bounded step (otherwise
    /// they are held to 4x the target). 0 turns it off [default: 5000].
    #[arg(long, env = "WEFT_ISOLATION_WINDOW_MS", value_name = "MS")]
    pub isolation_window_ms: Option<u64>,
    /// Anticipatory scheduling: when a tenant's last live request finishes while
    /// others' work runs, wait up to this many milliseconds before the next step
    /// for that tenant's next request, so a client chaining requests (chat turns,
    /// agents, pipelines) gets its prefill in the next step instead of waiting for
    /// all of it. Only for a tenant whose last return came within it; the wait ends
    /// when the request arrives, and waits take at most 5% of the engine's time.
    /// 0 turns it off [default: 5].
    #[arg(long, env = "WEFT_ANTICIPATION_MS", value_name = "MS")]
    pub anticipation_ms: Option<u64>,
    /// Speculative decoding by prompt lookup: the most draft tokens a greedy
    /// request verifies per step (drafts are what followed the latest earlier
    /// occurrence of its last tokens; output is unchanged). 0 turns it off
    /// [default: 4].
    #[arg(long, env = "WEFT_SPECULATE", value_name = "TOKENS")]
    pub speculate: Option<usize>,
    /// Most tokens a step's decoding rows feed, drafts included: drafts fill
    /// what the rows (1 token each) leave, so from this many rows on none are
    /// drafted (verifying costs compute only small steps have to spare)
    /// [default: 8].
    #[arg(long, env = "WEFT_SPECULATE_STEP_TOKENS", value_name = "TOKENS")]
    pub speculate_step_tokens: Option<usize>,
    /// KV cache size in blocks (instead of --kv-memory).
    #[arg(long, env = "WEFT_KV_BLOCKS", conflicts_with = "kv_memory")]
    pub kv_blocks: Option<usize>,
    /// Tokens per KV block, a power of two [default: 16].
    #[arg(long, env = "WEFT_KV_BLOCK_SIZE")]
    pub kv_block_size: Option<usize>,
    /// Memory the paged KV pool takes, allocated at startup: a size (2GiB,
    /// 512MiB) or a fraction of the device memory still free once the weights
    /// are loaded (0.9 or 90%) [default: 0.9 on a GPU, 1GiB on the CPU].
    #[arg(long, env = "WEFT_KV_MEMORY", value_name = "BYTES|FRACTION")]
    pub kv_memory: Option<String>,
    #[command(flatten)]
    pub kv_quant: KvQuantArgs,
    /// Freed buffers MLX keeps for reuse: a size, "auto" (what steady decode
    /// steps reuse: one decode step's bound on the CPU, two whole steps on a
    /// GPU; the startup memory plan states it) or "off" (MLX's own default,
    /// not bounded by the plan) [default: auto].
    #[arg(long, env = "WEFT_MLX_CACHE_LIMIT", value_name = "BYTES|auto|off")]
    pub mlx_cache_limit: Option<CacheLimit>,
    /// max_tokens of requests that leave it 0 [default: 256].
    #[arg(long, env = "WEFT_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<usize>,
    /// How long SIGTERM/SIGINT waits for in-flight requests, e.g. 30s, 500ms [default: 30s].
    #[arg(long, env = "WEFT_DRAIN_TIMEOUT", value_name = "DURATION")]
    pub drain_timeout: Option<String>,
    /// Burst coalescing: when nothing is running, the first step waits until no
    /// request has arrived for this long (at most 5x it), so requests sent
    /// together prefill as one batch. 0 turns it off [default: 10ms].
    #[arg(long, env = "WEFT_COALESCE", value_name = "DURATION")]
    pub coalesce: Option<String>,
    /// A LoRA adapter served beside the model (repeatable): NAME=DIR, DIR
    /// holding mlx-lm's `adapters.safetensors` or PEFT's
    /// `adapter_model.safetensors` with its `adapter_config.json`. Requests run
    /// with it by naming it (`GenerateRequest.adapter`, or `model` on the
    /// OpenAI API); rows with different adapters share a batch. The config
    /// file's `[adapters]` table adds more (NAME = "DIR").
    #[arg(long = "adapter", value_name = "NAME=DIR")]
    pub adapters: Vec<String>,
    /// LoRA adapters resident on the device at once: the running rows use at
    /// most this many different ones; the others wait in host memory and one
    /// no running row uses is evicted (least recently used) to load another
    /// [default: the --adapter count, at least 1].
    #[arg(long, env = "WEFT_MAX_LORAS", value_name = "N")]
    pub max_loras: Option<usize>,
    /// Largest LoRA rank served; the device pool is sized for it [default: the
    /// largest --adapter's, at least 16 with --adapter-root].
    #[arg(long, env = "WEFT_MAX_LORA_RANK", value_name = "RANK")]
    pub max_lora_rank: Option<usize>,
    /// Turns on run-time adapter loading (the Admin service's LoadAdapter /
    /// UnloadAdapter): mounted directories must lie under DIR. Off without it.
    #[arg(long, env = "WEFT_ADAPTER_ROOT", value_name = "DIR")]
    pub adapter_root: Option<PathBuf>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// The config file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    metrics_listen: Option<String>,
    http_listen: Option<String>,
    metrics_aliases: Option<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    model: Option<String>,
    tenants: Option<PathBuf>,
    max_batch_rows: Option<usize>,
    max_step_tokens: Option<usize>,
    max_waiting: Option<usize>,
    worker_threads: Option<usize>,
    prefill_chunk: Option<usize>,
    decode_prefill_tokens: Option<usize>,
    itl_target_ms: Option<ItlSetting>,
    isolation_window_ms: Option<u64>,
    anticipation_ms: Option<u64>,
    speculate: Option<usize>,
    speculate_step_tokens: Option<usize>,
    kv_blocks: Option<usize>,
    kv_block_size: Option<usize>,
    kv_memory: Option<String>,
    kv_bits: Option<u8>,
    kv_group_size: Option<u8>,
    mlx_cache_limit: Option<CacheLimit>,
    default_max_tokens: Option<usize>,
    drain_timeout: Option<String>,
    coalesce: Option<String>,
    compute_dtype: Option<String>,
    weights: Option<String>,
    /// LoRA adapters: NAME = "DIR" (relative to the file).
    #[serde(default)]
    adapters: std::collections::BTreeMap<String, PathBuf>,
    max_loras: Option<usize>,
    max_lora_rank: Option<usize>,
    adapter_root: Option<PathBuf>,
}

/// `--itl-target-ms` / `itl_target_ms`: milliseconds, `auto` or `off` (the file
/// takes a number or one of the words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "ItlSettingText")]
pub enum ItlSetting {
    Auto,
    Off,
    Ms(u64),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ItlSettingText {
    Ms(u64),
    Word(String),
}

impl TryFrom<ItlSettingText> for ItlSetting {
    type Error = String;
    fn try_from(t: ItlSettingText) -> Result<Self, String> {
        match t {
            ItlSettingText::Ms(ms) => Ok(ItlSetting::Ms(ms)),
            ItlSettingText::Word(w) => parse_itl_target(&w),
        }
    }
}

/// `MS`, `auto` or `off`.
pub fn parse_itl_target(s: &str) -> Result<ItlSetting, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(ItlSetting::Auto);
    }
    if t.eq_ignore_ascii_case("off") {
        return Ok(ItlSetting::Off);
    }
    t.parse()
        .map(ItlSetting::Ms)
        .map_err(|_| format!("{s:?}: expected milliseconds, auto or off"))
}

/// How the KV cache is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvSize {
    Blocks(usize),
    Bytes(u64),
    /// A fraction of the device memory free after the weights load.
    Fraction(f64),
    /// The device's default: [`DEFAULT_GPU_KV_FRACTION`] on a GPU,
    /// [`DEFAULT_CPU_KV_BYTES`] on the CPU.
    Auto,
}

/// Share of the free device memory the KV pool takes on a GPU by default
/// (vLLM's gpu-memory-utilization plays the same role).
pub const DEFAULT_GPU_KV_FRACTION: f64 = 0.9;
/// KV pool of the CPU by default: 1 GiB.
pub const DEFAULT_CPU_KV_BYTES: u64 = 1 << 30;

/// K/V quantization flags, shared by `serve`, `generate` and `bench-engine`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KvQuantArgs {
    /// Store K/V affine-quantized to 4 or 8 bits (MLX's quantizer: each
    /// group of a token's head vector gets a scale and a bias), so the same
    /// memory holds ~3.2x (4) or ~1.9x (8) the tokens of bf16 [default: off].
    #[arg(long, env = "WEFT_KV_BITS", value_name = "4|8")]
    pub kv_bits: Option<u8>,
    /// Elements per quantization group of --kv-bits: 32 or 64 [default: 64].
    #[arg(long, env = "WEFT_KV_GROUP_SIZE", value_name = "32|64")]
    pub kv_group_size: Option<u8>,
}

impl KvQuantArgs {
    /// The flags' quantization, checked.
    pub fn quant(&self) -> anyhow::Result<Option<weft_models::AffineQuant>> {
        kv_quant(self.kv_bits, self.kv_group_size)
    }
}

/// `--kv-bits` / `--kv-group-size`: K/V quantization, checked (the head
/// dimension is checked against the group when the pool is made).
pub fn kv_quant(
    bits: Option<u8>,
    group: Option<u8>,
) -> anyhow::Result<Option<weft_models::AffineQuant>> {
    let Some(bits) = bits else {
        if let Some(g) = group {
            bail!("--kv-group-size {g} needs --kv-bits (4 or 8)");
        }
        return Ok(None);
    };
    if !matches!(bits, 4 | 8) {
        bail!("--kv-bits {bits}: 4 or 8 bits are supported");
    }
    let group = group.unwrap_or(64);
    if !matches!(group, 32 | 64) {
        bail!("--kv-group-size {group}: 32 or 64 elements per group are supported");
    }
    Ok(Some(weft_models::AffineQuant::new(bits, group)))
}

/// `--kv-memory`: a byte size, or a fraction written as 0.9 or 90%.
pub fn parse_kv_memory(s: &str) -> anyhow::Result<KvSize> {
    let t = s.trim();
    let frac = if let Some(p) = t.strip_suffix('%') {
        Some(p.trim().parse::<f64>().map(|v| v / 100.0))
    } else if t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.') {
        Some(t.parse::<f64>())
    } else {
        None
    };
    match frac {
        Some(Ok(f)) if f > 0.0 && f < 1.0 => Ok(KvSize::Fraction(f)),
        Some(_) => bail!(
            "--kv-memory {s:?}: a fraction must be between 0 and 1 (exclusive), e.g. 0.9 or 90%"
        ),
        None => Ok(KvSize::Bytes(parse_bytes(t)?)),
    }
}

/// `--adapter NAME=DIR` flags, then the file's `[adapters]` (DIR relative to
/// the file): names are 1-64 of `A-Z a-z 0-9 . _ -`, unique.
fn adapter_specs(
    flags: &[String],
    file: &std::collections::BTreeMap<String, PathBuf>,
    base: &Path,
) -> anyhow::Result<Vec<crate::runtime::AdapterSpec>> {
    let mut out: Vec<crate::runtime::AdapterSpec> = Vec::new();
    let from_flags = flags.iter().map(|f| {
        f.split_once('=')
            .map(|(n, d)| (n.trim().to_string(), PathBuf::from(d.trim())))
            .ok_or_else(|| anyhow::anyhow!("--adapter {f:?}: expected NAME=DIR"))
    });
    let from_file = file.iter().map(|(n, d)| Ok((n.clone(), base.join(d))));
    for spec in from_flags.chain(from_file) {
        let (name, dir) = spec?;
        if !crate::adapters::valid_name(&name) {
            bail!("adapter name {name:?}: expected 1-64 characters of A-Z a-z 0-9 . _ -");
        }
        if out.iter().any(|a| a.name == name) {
            bail!("adapter {name:?} is given twice");
        }
        if dir.as_os_str().is_empty() {
            bail!("adapter {name:?}: empty directory");
        }
        out.push(crate::runtime::AdapterSpec { name, dir });
    }
    if out.len() > crate::adapters::MAX_ADAPTERS {
        bail!(
            "{} adapters given, at most {} are served at once",
            out.len(),
            crate::adapters::MAX_ADAPTERS
        );
    }
    Ok(out)
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    pub http_listen: Option<SocketAddr>,
    pub metrics_aliases: crate::server::metrics::Aliases,
    pub tls: Option<crate::server::tls::TlsFiles>,
    pub model: String,
    pub tenants: Option<PathBuf>,
    pub max_batch_rows: usize,
    pub max_step_tokens: usize,
    pub max_waiting: usize,
    /// Threads of the async runtime (`--worker-threads`).
    pub worker_threads: usize,
    pub prefill_chunk: usize,
    pub decode_prefill_tokens: Option<usize>,
    pub itl_target: weft_scheduler::ItlTarget,
    /// `SchedulerConfig::prefill_granule`: a KV block on a GPU, 1 on the CPU.
    pub prefill_granule: usize,
    /// `SchedulerConfig::amortized_bound` (`WEFT_AMORTIZED_BOUND`; unless set 1.0
    /// on a GPU, 1.3 elsewhere).
    pub amortized_bound: f64,
    /// `SchedulerConfig::strict_bound` (`WEFT_STRICT_BOUND`; off unless set).
    pub strict_bound: bool,
    pub isolation_window: Duration,
    pub anticipation: Duration,
    /// `SchedulerConfig::starting_step` (`WEFT_STARTING_STEP`; unless set, beside
    /// the rows on a GPU running short chunks as decoding rows, else alone).
    pub starting_step: weft_scheduler::StartingStep,
    pub speculate: usize,
    pub speculate_step_tokens: usize,
    pub kv_size: KvSize,
    pub kv_block_size: usize,
    /// K/V stored quantized (`--kv-bits`).
    pub kv_quant: Option<weft_models::AffineQuant>,
    pub mlx_cache_limit: CacheLimit,
    pub default_max_tokens: usize,
    pub drain_timeout: Duration,
    pub coalesce: Duration,
    pub compute: ComputeArgs,
    /// LoRA adapters to serve, in id order (flags first, then the file's).
    pub adapters: Vec<crate::runtime::AdapterSpec>,
    /// How the adapter pool is sized; run-time loading.
    pub adapter_pool: crate::adapters::AdapterPoolSpec,
}

impl Settings {
    pub fn resolve(args: ServeArgs) -> anyhow::Result<Self> {
        let file = match &args.config {
            Some(p) => load_file(p)?,
            None => FileConfig::default(),
        };
        // Relative paths in the file are relative to the file.
        let base = args
            .config
            .as_deref()
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let listen = match (args.listen, &file.listen) {
            (Some(a), _) => a,
            (None, Some(s)) => s
                .parse()
                .with_context(|| format!("config listen = {s:?}: expected host:port"))?,
            (None, None) => DEFAULT_LISTEN.parse()?,
        };
        let metrics = args
            .metrics_listen
            .or(file.metrics_listen)
            .unwrap_or_else(|| DEFAULT_METRICS_LISTEN.to_string());
        let metrics_listen = if metrics.eq_ignore_ascii_case("off") || metrics.is_empty() {
            None
        } else {
            Some(metrics.parse().with_context(|| {
                format!("metrics-listen {metrics:?}: expected host:port or off")
            })?)
        };
        let http = args
            .http_listen
            .or(file.http_listen)
            .unwrap_or_else(|| DEFAULT_HTTP_LISTEN.to_string());
        let http_listen = if http.eq_ignore_ascii_case("off") || http.is_empty() {
            None
        } else {
            Some(
                http.parse()
                    .with_context(|| format!("http-listen {http:?}: expected host:port or off"))?,
            )
        };
        let max_batch_rows = args.max_batch_rows.or(file.max_batch_rows).unwrap_or(64);
        let max_step_tokens = args
            .max_step_tokens
            .or(file.max_step_tokens)
            .unwrap_or(2048 + max_batch_rows);
        let kv_size = match (args.kv_blocks, &args.kv_memory) {
            (Some(b), _) => KvSize::Blocks(b),
            (None, Some(m)) => parse_kv_memory(m)?,
            (None, None) => match (file.kv_blocks, &file.kv_memory) {
                (Some(_), Some(_)) => bail!("config: give kv_blocks or kv_memory, not both"),
                (Some(b), None) => KvSize::Blocks(b),
                (None, Some(m)) => parse_kv_memory(m)?,
                (None, None) => KvSize::Auto,
            },
        };
        let drain = args
            .drain_timeout
            .or(file.drain_timeout)
            .map(|s| parse_duration(&s).map_err(anyhow::Error::msg))
            .transpose()
            .context("--drain-timeout")?
            .unwrap_or(DEFAULT_DRAIN_TIMEOUT);
        let mut compute = args.compute;
        // Flags and env already decided unless they were left at "auto".
        if compute.compute_dtype == "auto" {
            if let Some(d) = file.compute_dtype {
                compute.compute_dtype = d;
            }
        }
        if compute.weights == "auto" {
            if let Some(w) = file.weights {
                compute.weights = w;
            }
        }
        // On a CPU a prefill step of 16 prompts takes seconds, and every
        // decoding row waits for it: by default bound the prefill that rides
        // along with decoding rows there (measured: 32-stream ITL p99 3.1 s ->
        // 1.1-1.5 s for ~7% of throughput). GPU steps are short enough.
        let gpu = compute.load_options()?.device == weft_models::Device::Gpu;
        let decode_prefill_tokens = args
            .decode_prefill_tokens
            .or(file.decode_prefill_tokens)
            .or((!gpu).then_some(DEFAULT_CPU_DECODE_PREFILL_TOKENS));
        let itl_target = match args
            .itl_target_ms
            .or(file.itl_target_ms)
            .unwrap_or(ItlSetting::Auto)
        {
            ItlSetting::Auto => weft_scheduler::ItlTarget::auto(gpu),
            ItlSetting::Off => weft_scheduler::ItlTarget::Off,
            ItlSetting::Ms(0) => bail!("--itl-target-ms must be at least 1 (or auto, or off)"),
            ItlSetting::Ms(ms) => weft_scheduler::ItlTarget::Fixed(Duration::from_millis(ms)),
        };
        let s = Settings {
            listen,
            metrics_listen,
            http_listen,
            metrics_aliases: args
                .metrics_aliases
                .or(file.metrics_aliases)
                .unwrap_or_default()
                .parse()?,
            tls: match (
                args.tls_cert.or(file.tls_cert.map(|p| base.join(p))),
                args.tls_key.or(file.tls_key.map(|p| base.join(p))),
                args.tls_client_ca
                    .or(file.tls_client_ca.map(|p| base.join(p))),
            ) {
                (Some(cert), Some(key), client_ca) => Some(crate::server::tls::TlsFiles {
                    cert,
                    key,
                    client_ca,
                }),
                (None, None, None) => None,
                (None, None, Some(_)) => {
                    bail!("--tls-client-ca needs --tls-cert and --tls-key (the server's own certificate)")
                }
                _ => bail!("--tls-cert and --tls-key go together"),
            },
            model: args.model.or(file.model).unwrap_or_default(),
            tenants: args.tenants.or(file.tenants.map(|p| base.join(p))),
            max_batch_rows,
            max_step_tokens,
            max_waiting: args.max_waiting.or(file.max_waiting).unwrap_or(1024),
            worker_threads: args
                .worker_threads
                .or(file.worker_threads)
                .unwrap_or_else(default_worker_threads),
            prefill_chunk: args.prefill_chunk.or(file.prefill_chunk).unwrap_or(512),
            decode_prefill_tokens,
            itl_target,
            prefill_granule: if gpu {
                weft_scheduler::GPU_PREFILL_GRANULE
            } else {
                1
            },
            amortized_bound: amortized_bound(gpu)?,
            strict_bound: strict_bound()?,
            isolation_window: Duration::from_millis(
                args.isolation_window_ms
                    .or(file.isolation_window_ms)
                    .unwrap_or(DEFAULT_ISOLATION_WINDOW_MS),
            ),
            anticipation: Duration::from_millis(
                args.anticipation_ms
                    .or(file.anticipation_ms)
                    .unwrap_or(DEFAULT_ANTICIPATION_MS),
            ),
            starting_step: starting_step(gpu)?,
            speculate: args
                .speculate
                .or(file.speculate)
                .unwrap_or(DEFAULT_SPECULATE),
            speculate_step_tokens: args
                .speculate_step_tokens
                .or(file.speculate_step_tokens)
                .unwrap_or(DEFAULT_SPECULATE_STEP_TOKENS),
            kv_size,
            kv_block_size: args.kv_block_size.or(file.kv_block_size).unwrap_or(16),
            kv_quant: kv_quant(
                args.kv_quant.kv_bits.or(file.kv_bits),
                args.kv_quant.kv_group_size.or(file.kv_group_size),
            )?,
            mlx_cache_limit: args
                .mlx_cache_limit
                .or(file.mlx_cache_limit)
                .unwrap_or(CacheLimit::Auto),
            default_max_tokens: args
                .default_max_tokens
                .or(file.default_max_tokens)
                .unwrap_or(DEFAULT_MAX_TOKENS),
            drain_timeout: drain,
            coalesce: args
                .coalesce
                .or(file.coalesce)
                .map(|s| parse_duration(&s).map_err(anyhow::Error::msg))
                .transpose()
                .context("--coalesce")?
                .unwrap_or(DEFAULT_COALESCE),
            compute,
            adapters: adapter_specs(&args.adapters, &file.adapters, &base)?,
            adapter_pool: crate::adapters::AdapterPoolSpec {
                slots: args.max_loras.or(file.max_loras),
                max_rank: args.max_lora_rank.or(file.max_lora_rank),
                root: args
                    .adapter_root
                    .or(file.adapter_root.map(|p| base.join(p))),
            },
        };
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("max-batch-rows", self.max_batch_rows),
            ("max-step-tokens", self.max_step_tokens),
            ("max-waiting", self.max_waiting),
            ("worker-threads", self.worker_threads),
            ("prefill-chunk", self.prefill_chunk),
            (
                "decode-prefill-tokens",
                self.decode_prefill_tokens.unwrap_or(1),
            ),
            ("kv-block-size", self.kv_block_size),
            ("default-max-tokens", self.default_max_tokens),
        ] {
            if v == 0 {
                bail!("--{name} must be at least 1");
            }
        }
        if self.max_step_tokens < self.max_batch_rows {
            bail!(
                "--max-step-tokens ({}) must be >= --max-batch-rows ({}) so every decoding row advances each step",
                self.max_step_tokens,
                self.max_batch_rows
            );
        }
        if self.adapter_pool.slots == Some(0) {
            bail!("--max-loras must be at least 1");
        }
        if let Some(r) = self.adapter_pool.max_rank {
            if r == 0 || r > weft_models::adapter::MAX_RANK {
                bail!(
                    "--max-lora-rank {r}: 1..={} are served",
                    weft_models::adapter::MAX_RANK
                );
            }
        }
        if let Some(root) = &self.adapter_pool.root {
            if !root.is_dir() {
                bail!("--adapter-root {}: not a directory", root.display());
            }
        }
        if let KvSize::Blocks(0) | KvSize::Bytes(0) = self.kv_size {
            bail!("the KV cache must be larger than 0 (--kv-blocks / --kv-memory)");
        }
        if !self.kv_block_size.is_power_of_two() || self.kv_block_size > 1024 {
            bail!(
                "--kv-block-size {} must be a power of two up to 1024 (16 or 32 in practice)",
                self.kv_block_size
            );
        }
        self.compute.load_options()?;
        Ok(())
    }

    /// The open (no tenant file) mode is only for loopback: neither the API nor
    /// the metrics listener binds anything else without one.
    pub fn check_exposure(&self) -> anyhow::Result<()> {
        if self.tenants.is_some() {
            return Ok(());
        }
        if !self.listen.ip().is_loopback() {
            bail!(
                "refusing to serve {} without a tenant file: anyone who can reach that address \
                 could use the server. Pass --tenants PATH (or WEFT_TENANTS) with API keys \
                 (`weft hash-key <key>` makes their hashes), or listen on a loopback address \
                 such as 127.0.0.1",
                self.listen
            );
        }
        if let Some(h) = self.http_listen.filter(|h| !h.ip().is_loopback()) {
            bail!(
                "refusing to serve the HTTP API on {h} without a tenant file: anyone who can \
                 reach that address could use the server. Pass --tenants PATH (or WEFT_TENANTS), \
                 or give --http-listen a loopback address such as 127.0.0.1:8000 (or off)"
            );
        }
        if let Some(m) = self.metrics_listen.filter(|m| !m.ip().is_loopback()) {
            bail!(
                "refusing to expose metrics on {m} without a tenant file: the open mode is for \
                 loopback only. Pass --tenants PATH (or WEFT_TENANTS), or give --metrics-listen \
                 a loopback address such as 127.0.0.1:9464 (or off)"
            );
        }
        Ok(())
    }

    /// The KV pool's memory on `device`.
    pub fn kv_memory(&self, device: weft_models::Device) -> anyhow::Result<weft_models::KvMemory> {
        use weft_models::KvMemory;
        Ok(match self.kv_size {
            KvSize::Blocks(b) => KvMemory::Blocks(
                u32::try_from(b).map_err(|_| anyhow::anyhow!("--kv-blocks {b} is too large"))?,
            ),
            KvSize::Bytes(n) => KvMemory::Bytes(n),
            KvSize::Fraction(f) => KvMemory::FreeFraction(f),
            KvSize::Auto => match device {
                weft_models::Device::Gpu => KvMemory::FreeFraction(DEFAULT_GPU_KV_FRACTION),
                weft_models::Device::Cpu => KvMemory::Bytes(DEFAULT_CPU_KV_BYTES),
            },
        })
    }

    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_batch_rows: self.max_batch_rows,
            max_step_tokens: self.max_step_tokens,
            prefill_chunk: self.prefill_chunk,
            decode_prefill_tokens: self.decode_prefill_tokens,
            itl_target: self.itl_target,
            prefill_granule: self.prefill_granule,
            amortized_bound: self.amortized_bound,
            strict_bound: self.strict_bound,
            isolation_window: self.isolation_window,
            anticipation: self.anticipation,
            starting_step: self.starting_step,
            speculate: self.speculate,
            speculate_step_tokens: self.speculate_step_tokens,
            max_waiting: self.max_waiting,
            coalesce_gap: self.coalesce,
            coalesce_max: self.coalesce * 5,
            ..SchedulerConfig::default()
        }
    }
}

fn load_file(p: &Path) -> anyhow::Result<FileConfig> {
    let text =
        std::fs::read_to_string(p).with_context(|| format!("reading config {}", p.display()))?;
    toml::from_str(&text).with_context(|| format!("config {}", p.display()))
}

/// "2GiB", "512MiB", "1.5G", "1000000" (bytes).
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        _ => bail!("{s:?}: unknown unit (use B, KiB, MiB, GiB, KB, MB, GB)"),
    };
    let v: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .with_context(|| format!("{s:?}: expected a size such as 2GiB or 512MiB"))?;
    Ok((v * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn args(line: &str) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(line.split_whitespace()))
            .unwrap()
            .serve
    }

    #[test]
    fn defaults() {
        let s = Settings::resolve(args("")).unwrap();
        assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(
            s.metrics_listen.unwrap().to_string(),
            DEFAULT_METRICS_LISTEN
        );
        assert_eq!(s.model, "");
        assert_eq!(s.drain_timeout, DEFAULT_DRAIN_TIMEOUT);
        assert_eq!(s.kv_size, KvSize::Auto);
        use weft_models::{Device, KvMemory};
        assert_eq!(
            s.kv_memory(Device::Gpu).unwrap(),
            KvMemory::FreeFraction(DEFAULT_GPU_KV_FRACTION)
        );
        assert_eq!(
            s.kv_memory(Device::Cpu).unwrap(),
            KvMemory::Bytes(DEFAULT_CPU_KV_BYTES)
        );
        assert!(s.check_exposure().is_ok());
        let cpu = weft_models::Device::detect() == weft_models::Device::Cpu;
        assert_eq!(
            s.decode_prefill_tokens,
            cpu.then_some(DEFAULT_CPU_DECODE_PREFILL_TOKENS)
        );
        let s = Settings::resolve(args("--decode-prefill-tokens 2000")).unwrap();
        assert_eq!(s.decode_prefill_tokens, Some(2000));
        assert_eq!(s.scheduler_config().decode_prefill_tokens, Some(2000));
    }

    #[test]
    fn speculation_defaults_flags_and_file() {
        let c = Settings::resolve(args("")).unwrap().scheduler_config();
        assert_eq!(
            (c.speculate, c.speculate_step_tokens),
            (DEFAULT_SPECULATE, DEFAULT_SPECULATE_STEP_TOKENS)
        );
        let c = Settings::resolve(args("--speculate 0 --speculate-step-tokens 32"))
            .unwrap()
            .scheduler_config();
        assert_eq!((c.speculate, c.speculate_step_tokens), (0, 32));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(&p, "speculate = 2\nspeculate_step_tokens = 4\n").unwrap();
        let s =
            Settings::resolve(args(&format!("--config {} --speculate 3", p.display()))).unwrap();
        assert_eq!(
            (s.speculate, s.speculate_step_tokens),
            (3, 4),
            "flag beats file"
        );
    }

    #[test]
    fn anticipation_flag_and_file() {
        let c = Settings::resolve(args("")).unwrap().scheduler_config();
        assert_eq!(c.anticipation, Duration::from_millis(5), "5 ms by default");
        let c = Settings::resolve(args("--anticipation-ms 0"))
            .unwrap()
            .scheduler_config();
        assert!(c.anticipation.is_zero(), "0 turns it off");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(&p, "anticipation_ms = 12\n").unwrap();
        let c = Settings::resolve(args(&format!("--config {}", p.display())))
            .unwrap()
            .scheduler_config();
        assert_eq!(c.anticipation, Duration::from_millis(12));
    }

    #[test]
    fn worker_threads_flag_and_file() {
        let s = Settings::resolve(args("")).unwrap();
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(s.worker_threads, cores.min(DEFAULT_WORKER_THREADS));
        assert_eq!(
            Settings::resolve(args("--worker-threads 9"))
                .unwrap()
                .worker_threads,
            9
        );
        let e = Settings::resolve(args("--worker-threads 0")).unwrap_err();
        assert!(
            e.to_string()
                .contains("--worker-threads must be at least 1"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(&p, "worker_threads = 2\n").unwrap();
        let s = Settings::resolve(args(&format!("--config {}", p.display()))).unwrap();
        assert_eq!(s.worker_threads, 2);
    }

    #[test]
    fn isolation_window_flag_and_file() {
        let c = Settings::resolve(args("")).unwrap().scheduler_config();
        assert_eq!(c.isolation_window, Duration::from_secs(5), "5 s by default");
        let c = Settings::resolve(args("--isolation-window-ms 0"))
            .unwrap()
            .scheduler_config();
        assert!(c.isolation_window.is_zero(), "0 turns it off");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(&p, "isolation_window_ms = 1500\n").unwrap();
        let c = Settings::resolve(args(&format!("--config {}", p.display())))
            .unwrap()
            .scheduler_config();
        assert_eq!(c.isolation_window, Duration::from_millis(1500));
    }

    #[test]
    fn itl_target_flag_and_file() {
        use weft_scheduler::ItlTarget;
        let gpu = weft_models::Device::detect() == weft_models::Device::Gpu;
        let c = Settings::resolve(args("")).unwrap().scheduler_config();
        assert_eq!(c.itl_target, ItlTarget::auto(gpu), "auto by default");
        if std::env::var_os("WEFT_STARTING_STEP").is_none() && !gpu {
            assert_eq!(
                c.starting_step,
                weft_scheduler::StartingStep::Alone,
                "a starting tenant's step is its own on the CPU"
            );
        }
        assert!(matches!(
            ItlTarget::auto(false),
            ItlTarget::Auto { factor, min } if factor == 3.0 && min == Duration::from_millis(100)
        ));
        let c = Settings::resolve(args("--itl-target-ms 250"))
            .unwrap()
            .scheduler_config();
        assert_eq!(c.itl_target, ItlTarget::Fixed(Duration::from_millis(250)));
        let c = Settings::resolve(args("--itl-target-ms off"))
            .unwrap()
            .scheduler_config();
        assert_eq!(c.itl_target, ItlTarget::Off);
        let e = Settings::resolve(args("--itl-target-ms 0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--itl-target-ms must be at least 1"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        for (text, want) in [
            (
                "itl_target_ms = 80\n",
                ItlTarget::Fixed(Duration::from_millis(80)),
            ),
            ("itl_target_ms = \"off\"\n", ItlTarget::Off),
            ("itl_target_ms = \"auto\"\n", ItlTarget::auto(gpu)),
        ] {
            std::fs::write(&p, text).unwrap();
            let c = Settings::resolve(args(&format!("--config {}", p.display())))
                .unwrap()
                .scheduler_config();
            assert_eq!(c.itl_target, want, "{text}");
        }
        // The flag beats the file.
        let c = Settings::resolve(args(&format!(
            "--config {} --itl-target-ms 40",
            p.display()
        )))
        .unwrap()
        .scheduler_config();
        assert_eq!(c.itl_target, ItlTarget::Fixed(Duration::from_millis(40)));
        std::fs::write(&p, "itl_target_ms = \"soon\"\n").unwrap();
        let e = Settings::resolve(args(&format!("--config {}", p.display()))).unwrap_err();
        assert!(
            format!("{e:#}").contains("milliseconds, auto or off"),
            "{e:#}"
        );
        assert!(Cli::try_parse_from(["serve", "--itl-target-ms", "fast"]).is_err());
    }

    #[test]
    fn adapters_from_flags_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(
            &p,
            "[adapters]\nsql = \"adapters/sql\"\nchat-v2 = \"/abs/chat\"\n",
        )
        .unwrap();
        let s = Settings::resolve(args(&format!(
            "--config {} --adapter first=/x/first",
            p.display()
        )))
        .unwrap();
        let got: Vec<(String, PathBuf)> = s.adapters.into_iter().map(|a| (a.name, a.dir)).collect();
        assert_eq!(
            got,
            vec![
                ("first".into(), PathBuf::from("/x/first")),
                ("chat-v2".into(), PathBuf::from("/abs/chat")),
                ("sql".into(), dir.path().join("adapters/sql")),
            ]
        );
        for (line, needle) in [
            ("--adapter nodir", "expected NAME=DIR"),
            ("--adapter =/d", "adapter name \"\""),
            ("--adapter a/b=/d", "adapter name \"a/b\""),
            ("--adapter a=/d --adapter a=/e", "given twice"),
            ("--adapter a=", "empty directory"),
        ] {
            let e = Settings::resolve(args(line)).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }

    #[test]
    fn file_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("weft.toml");
        std::fs::write(
            &p,
            "listen = \"127.0.0.1:7000\"\nmetrics_listen = \"off\"\nmax_batch_rows = 8\n\
             tenants = \"t.toml\"\nkv_memory = \"1MiB\"\ndrain_timeout = \"500ms\"\n\
             compute_dtype = \"bf16\"\n",
        )
        .unwrap();
        let s = Settings::resolve(args(&format!(
            "--config {} --max-batch-rows 4",
            p.display()
        )))
        .unwrap();
        assert_eq!(s.listen.port(), 7000);
        assert!(s.metrics_listen.is_none());
        assert_eq!(s.max_batch_rows, 4);
        assert_eq!(s.tenants.unwrap(), dir.path().join("t.toml"));
        assert_eq!(s.kv_size, KvSize::Bytes(1 << 20));
        assert_eq!(s.drain_timeout, Duration::from_millis(500));
        assert_eq!(s.compute.compute_dtype, "bf16");
        std::fs::write(&p, "nope = 1\n").unwrap();
        let e = Settings::resolve(args(&format!("--config {}", p.display()))).unwrap_err();
        assert!(format!("{e:#}").contains("nope"), "{e:#}");
    }

    #[test]
    fn exposure_needs_tenants() {
        let s = Settings::resolve(args("--listen 0.0.0.0:50051")).unwrap();
        let e = s.check_exposure().unwrap_err().to_string();
        assert!(e.contains("without a tenant file"), "{e}");
        let s = Settings::resolve(args("--listen 0.0.0.0:50051 --tenants t.toml")).unwrap();
        assert!(s.check_exposure().is_ok());
        let s = Settings::resolve(args("--listen [::1]:50051")).unwrap();
        assert!(s.check_exposure().is_ok());
        // The metrics listener too.
        let s = Settings::resolve(args("--metrics-listen 0.0.0.0:9464")).unwrap();
        let e = s.check_exposure().unwrap_err().to_string();
        assert!(
            e.contains("metrics on 0.0.0.0:9464 without a tenant file"),
            "{e}"
        );
        let s = Settings::resolve(args("--metrics-listen 0.0.0.0:9464 --tenants t.toml")).unwrap();
        assert!(s.check_exposure().is_ok());
        let s = Settings::resolve(args("--metrics-listen off")).unwrap();
        assert!(s.check_exposure().is_ok());
    }

    #[test]
    fn bad_values() {
        for line in [
            "--max-batch-rows 0",
            "--max-batch-rows 64 --max-step-tokens 8",
            "--drain-timeout soon",
            "--kv-memory 3parsecs",
            "--kv-blocks 0",
            "--compute-dtype f8",
            "--metrics-listen nowhere",
            "--decode-prefill-tokens 0",
        ] {
            assert!(Settings::resolve(args(line)).is_err(), "{line}");
        }
    }

    #[test]
    fn units() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5G").unwrap(), 1_500_000_000);
        let s = Settings::resolve(args("--kv-memory 1MiB --kv-block-size 16")).unwrap();
        assert_eq!(s.kv_size, KvSize::Bytes(1 << 20));
        for (text, f) in [("0.9", 0.9), ("85%", 0.85), (" 50 % ", 0.5)] {
            assert_eq!(
                parse_kv_memory(text).unwrap(),
                KvSize::Fraction(f),
                "{text}"
            );
        }
        for bad in ["1.5", "0.0", "100%", "0%", "-3%", "lots"] {
            assert!(parse_kv_memory(bad).is_err(), "{bad}");
        }
        let s = Settings::resolve(args("--kv-memory 80%")).unwrap();
        assert_eq!(
            s.kv_memory(weft_models::Device::Cpu).unwrap(),
            weft_models::KvMemory::FreeFraction(0.8)
        );
        assert!(Settings::resolve(args("--kv-block-size 24")).is_err());
        let s = Settings::resolve(args("--kv-blocks 7")).unwrap();
        assert_eq!(
            s.kv_memory(weft_models::Device::Cpu).unwrap(),
            weft_models::KvMemory::Blocks(7)
        );
    }
}
