//! `weft bench`: a load generator for Weft's gRPC API and, for side-by-side
//! numbers, for OpenAI-compatible streaming HTTP servers (`mlx_lm.server`).
//!
//! Load:
//! - closed loop (`--concurrency N`): N workers, each sending its next request
//!   when the previous one has finished;
//! - open loop (`--rate R`): Poisson arrivals at R requests/s, sent whether or
//!   not earlier requests have finished;
//! - per tenant (`--tenant-rate name:R`): that tenant gets its own Poisson
//!   process; the other tenants share `--rate` (open loop) or the
//!   `--concurrency` workers (closed loop), split by their `share`. So one
//!   flooding tenant at a high rate beside steady closed-loop tenants is
//!   `--tenant flood:k1 --tenant a:k2 --tenant b:k3 --tenant-rate flood:50
//!   --concurrency 2`.
//!
//! A run ends after `--requests` measured requests were sent or `--duration`
//! passed (whichever first; 100 requests if neither is given); requests still
//! in flight then are waited for (each bounded by `--timeout`). Ctrl-C stops at
//! once: in-flight requests are dropped and what finished is reported.
//!
//! `--warmup N` requests go first (closed loop, all tenants by share, at the
//! run's concurrency) and are excluded from every number.
//!
//! Reproducibility: with the same `--seed`, request `j` of a load source gets
//! the same tenant, prompt length, output length and prompt words, and every
//! open-loop source the same arrival times. Prompts still differ between runs
//! (a per-run nonce heads each prompt), so a server's prefix cache cannot
//! carry over. See [`stats`] for how latencies and throughput are defined.

pub mod arrivals;
pub mod client;
pub mod dist;
pub mod mix;
pub mod prompt;
pub mod soak;
pub mod sse;
pub mod stats;
pub mod tenant;

#[cfg(test)]
mod e2e_tests;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{mpsc, watch};

pub use client::Client;
pub use dist::LengthDist;
pub use stats::{BenchReport, GroupReport, LatencySummary, RequestRecord};
pub use tenant::{TenantRate, TenantSpec};

use crate::units::parse_positive_duration;
use arrivals::PoissonArrivals;
use client::{Planned, RequestOptions};
use stats::Collector;

/// Which API the target speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// From the target's scheme: grpc:// is weft, http(s):// is openai.
    Auto,
    /// Weft's gRPC `GenerateStream`.
    Weft,
    /// OpenAI-compatible `POST /v1/completions` with `"stream": true` (SSE).
    Openai,
}

/// Flags of `weft bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Server to load: grpc://HOST:PORT (Weft) or http://HOST:PORT (OpenAI
    /// compatible; a path, if given, replaces /v1/completions).
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    pub target: String,

    /// API of the target (auto: from the scheme).
    #[arg(long, value_enum, default_value_t = Api::Auto)]
    pub api: Api,

    /// Model name sent with each request (default: the server's own).
    #[arg(long)]
    pub model: Option<String>,

    /// Closed loop: this many concurrent streams, each sending its next
    /// request when the previous finished [default: 1 unless --rate].
    #[arg(long, short = 'c')]
    pub concurrency: Option<u32>,

    /// Open loop: Poisson arrivals at this many requests/s (shared by the
    /// tenants without --tenant-rate, split by share).
    #[arg(long)]
    pub rate: Option<f64>,

    /// Stop after this many measured requests were sent [default: 100 when
    /// --duration is not given].
    #[arg(long, short = 'n')]
    pub requests: Option<u64>,

    /// Stop sending after this long (e.g. 30, 30s, 2m, 500ms); in-flight
    /// requests are waited for.
    #[arg(long, short = 'd', value_parser = parse_positive_duration)]
    pub duration: Option<Duration>,

    /// Prompt length in tokens (approximate: ~one word per token; the
    /// server-reported length is in the report): N, uniform:LO:HI or
    /// normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    pub prompt_tokens: LengthDist,

    /// Tokens to generate per request (sent as max_tokens with ignore_eos):
    /// N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "128")]
    pub max_tokens: LengthDist,

    /// A tenant to send as, NAME:APIKEY[:SHARE] (repeatable). The key goes in
    /// `authorization: Bearer <key>`; an empty key sends none. SHARE (default
    /// 1) weights how requests are split between tenants.
    #[arg(long = "tenant", value_name = "NAME:APIKEY[:SHARE]")]
    pub tenants: Vec<TenantSpec>,

    /// Give a tenant its own open-loop Poisson rate, NAME:R requests/s
    /// (repeatable).
    #[arg(long = "tenant-rate", value_name = "NAME:R")]
    pub tenant_rates: Vec<TenantRate>,

    /// API key when no --tenant is given.
    #[arg(long, env = "WEFT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Requests sent first and left out of the numbers.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,

    /// Seed for arrivals, lengths, tenant choice and prompt words.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,

    /// Don't ask the server to ignore end-of-sequence (outputs may then be
    /// shorter than --max-tokens).
    #[arg(long)]
    pub no_ignore_eos: bool,

    /// Per-request time limit (counted as TIMEOUT when passed).
    #[arg(long, value_parser = parse_positive_duration, default_value = "600s")]
    pub timeout: Duration,

    /// gRPC: HTTP/2 connections to spread requests over.
    #[arg(long, default_value_t = 1)]
    pub connections: u32,

    /// OpenAI: a JSON object merged into every request body, e.g.
    /// '{"min_tokens": 128}'.
    #[arg(long, value_name = "JSON")]
    pub extra_body: Option<String>,

    /// Write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long, short = 'q')]
    pub quiet: bool,

    /// load: the load the flags above describe. tenant-mix: latency isolation
    /// between two tenants (the first --tenant floods with --flood-streams
    /// streams, the second sends short requests one at a time), measured alone
    /// and together in three phases of --phase-duration; see bench/mix.rs.
    #[arg(long, value_enum, default_value_t = Scenario::Load)]
    pub scenario: Scenario,

    /// tenant-mix: the flooding tenant's closed-loop streams (its requests are
    /// --prompt-tokens / --max-tokens).
    #[arg(long, default_value_t = 32)]
    pub flood_streams: u32,

    /// tenant-mix: prompt length of the light tenant's requests.
    #[arg(long, default_value = "32")]
    pub light_prompt_tokens: LengthDist,

    /// tenant-mix: tokens the light tenant's requests generate.
    #[arg(long, default_value = "16")]
    pub light_max_tokens: LengthDist,

    /// tenant-mix: length of each phase (light alone, flood alone, both).
    #[arg(long, value_parser = parse_positive_duration, default_value = "60s")]
    pub phase_duration: Duration,

    /// soak: the server's Prometheus endpoint, read every --sample-every
    /// (e.g. http://127.0.0.1:9464/metrics).
    #[arg(long, value_name = "URL")]
    pub metrics_url: Option<String>,

    /// soak: how often the server's gauges are read.
    #[arg(long, value_parser = parse_positive_duration, default_value = "10s")]
    pub sample_every: Duration,

    /// soak: share of requests the client cancels after a random number of
    /// tokens.
    #[arg(long, default_value_t = 0.1)]
    pub cancel_fraction: f64,

    /// soak: share of requests sent on a connection of their own that is
    /// closed after a random number of tokens.
    #[arg(long, default_value_t = 0.05)]
    pub disconnect_fraction: f64,

    /// soak: share of --duration counted as warm-up (RSS after it is compared
    /// with RSS during it).
    #[arg(long, default_value_t = 0.2)]
    pub soak_warmup: f64,
}

/// What `weft bench` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    Load,
    TenantMix,
    /// Memory and KV blocks over a long mixed run with cancels and
    /// disconnects (bench/soak.rs).
    Soak,
}

/// One source of load in the measured phase.
#[derive(Debug, Clone)]
enum Source {
    /// `workers` closed-loop workers over these tenants.
    Closed { workers: u32, tenants: Vec<usize> },
    /// A Poisson process at `rate` over these tenants.
    Open { rate: f64, tenants: Vec<usize> },
}

/// Validated settings.
#[derive(Debug)]
struct Plan {
    api: Api,
    tenants: Vec<TenantSpec>,
    sources: Vec<Source>,
    limit: Option<u64>,
    duration: Option<Duration>,
    warmup_concurrency: u32,
    mode: String,
}

fn plan(args: &BenchArgs) -> anyhow::Result<Plan> {
    let api = match args.api {
        Api::Auto if args.target.starts_with("http://") || args.target.starts_with("https://") => {
            Api::Openai
        }
        Api::Auto => Api::Weft,
        a => a,
    };
    let tenants = if args.tenants.is_empty() {
        if !args.tenant_rates.is_empty() {
            bail!("--tenant-rate needs --tenant NAME:APIKEY for that tenant");
        }
        vec![TenantSpec {
            name: "default".into(),
            api_key: args.api_key.clone().filter(|k| !k.is_empty()),
            share: 1.0,
        }]
    } else {
        args.tenants.clone()
    };
    tenant::validate(&tenants, &args.tenant_rates).map_err(anyhow::Error::msg)?;
    if let Some(r) = args.rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--rate must be a positive number of requests/s");
        }
    }
    if args.concurrency == Some(0) {
        bail!("--concurrency must be at least 1");
    }
    if args.rate.is_some() && args.concurrency.is_some() {
        bail!("--rate (open loop) and --concurrency (closed loop) exclude each other");
    }
    if args.connections == 0 {
        bail!("--connections must be at least 1");
    }
    if args.requests == Some(0) {
        bail!("--requests must be at least 1");
    }

    let rated: Vec<usize> = args
        .tenant_rates
        .iter()
        .map(|r| {
            tenants
                .iter()
                .position(|t| t.name == r.name)
                .expect("validated")
        })
        .collect();
    let rest: Vec<usize> = (0..tenants.len()).filter(|i| !rated.contains(i)).collect();
    let mut sources: Vec<Source> = args
        .tenant_rates
        .iter()
        .zip(&rated)
        .map(|(r, &i)| Source::Open {
            rate: r.rate,
            tenants: vec![i],
        })
        .collect();
    let mut mode = Vec::new();
    for r in &args.tenant_rates {
        mode.push(format!("{} open loop {} req/s", r.name, r.rate));
    }
    if rest.is_empty() {
        if args.rate.is_some() {
            bail!("--rate has no tenant left: every tenant has a --tenant-rate");
        }
        if args.concurrency.is_some() {
            bail!("--concurrency has no tenant left: every tenant has a --tenant-rate");
        }
    } else if let Some(rate) = args.rate {
        sources.push(Source::Open {
            rate,
            tenants: rest.clone(),
        });
        mode.push(format!("open loop {rate} req/s"));
    } else {
        let workers = args.concurrency.unwrap_or(1);
        sources.push(Source::Closed {
            workers,
            tenants: rest.clone(),
        });
        mode.push(format!("closed loop, concurrency {workers}"));
    }
    let limit = match (args.requests, args.duration) {
        (None, None) => Some(100),
        (n, _) => n,
    };
    Ok(Plan {
        api,
        tenants,
        sources,
        limit,
        duration: args.duration,
        warmup_concurrency: args.concurrency.unwrap_or(1),
        mode: mode.join("; "),
    })
}

/// State shared by all load sources of a phase.
struct Shared {
    client: Client,
    opts: RequestOptions,
    shares: Vec<f64>,
    prompt: LengthDist,
    max_tokens: LengthDist,
    /// Per tenant: (prompt, max_tokens) in place of the shared ones.
    lengths: Vec<Option<(LengthDist, LengthDist)>>,
    seed: u64,
    /// Unique request numbers (prompt headers, request ids).
    next_index: AtomicU64,
    cancel: watch::Receiver<bool>,
}

/// A phase: warm-up or measured.
struct Phase {
    claimed: AtomicU64,
    limit: Option<u64>,
    deadline: Option<Instant>,
    stop: AtomicBool,
    /// Separates the per-request random streams of phases and sources.
    key_base: u64,
}

impl Phase {
    fn claim(&self) -> bool {
        if self.stop.load(Ordering::Relaxed) || self.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        let n = self.claimed.fetch_add(1, Ordering::Relaxed);
        self.limit.is_none_or(|l| n < l)
    }
}

impl Shared {
    /// Decides request `key` of a source: tenant (by share among
    /// `tenants`), lengths and prompt, all from the per-key random stream.
    fn plan(&self, key: u64, tenants: &[usize]) -> Planned {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(key);
        let total: f64 = tenants.iter().map(|&t| self.shares[t]).sum();
        let mut x = rng.random::<f64>() * total;
        let mut tenant = *tenants.last().expect("a source has tenants");
        for &t in tenants {
            if x < self.shares[t] {
                tenant = t;
                break;
            }
            x -= self.shares[t];
        }
        let (prompt, max_tokens) = self
            .lengths
            .get(tenant)
            .copied()
            .flatten()
            .unwrap_or((self.prompt, self.max_tokens));
        let prompt_len = prompt.sample(&mut rng);
        let max_tokens = max_tokens.sample(&mut rng);
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        Planned {
            index,
            tenant,
            prompt: prompt::make_prompt(self.opts.nonce, index, prompt_len, &mut rng),
            max_tokens,
        }
    }

    /// Runs one request unless the run is cancelled first (then `None`).
    async fn execute(&self, p: Planned) -> Option<RequestRecord> {
        let mut cancel = self.cancel.clone();
        tokio::select! {
            r = self.client.execute(&p, &self.opts) => Some(r),
            _ = cancel.wait_for(|c| *c) => None,
        }
    }
}

/// Starts the load sources of a phase; they send records to `tx` and drop
/// their senders when done.
fn start_phase(
    shared: &Arc<Shared>,
    phase: &Arc<Phase>,
    sources: &[Source],
    tx: &mpsc::UnboundedSender<RequestRecord>,
) {
    let start = Instant::now();
    for (s, source) in sources.iter().enumerate() {
        let source_key = phase.key_base + ((s as u64) << 40);
        match source.clone() {
            Source::Closed { workers, tenants } => {
                // Keys of a closed source come from the phase's claim order,
                // so the set of requests is the same whatever the timing.
                let next_key = Arc::new(AtomicU64::new(0));
                for _ in 0..workers {
                    let (shared, phase, tx, tenants, next_key) = (
                        shared.clone(),
                        phase.clone(),
                        tx.clone(),
                        tenants.clone(),
                        next_key.clone(),
                    );
                    tokio::spawn(async move {
                        while phase.claim() {
                            let j = next_key.fetch_add(1, Ordering::Relaxed);
                            let p = shared.plan(source_key + j, &tenants);
                            match shared.execute(p).await {
                                Some(r) => {
                                    if tx.send(r).is_err() {
                                        break;
                                    }
                                }
                                None => break,
                            }
                        }
                    });
                }
            }
            Source::Open { rate, tenants } => {
                let (shared, phase, tx) = (shared.clone(), phase.clone(), tx.clone());
                tokio::spawn(async move {
                    let mut cancel = shared.cancel.clone();
                    let arrivals = PoissonArrivals::new(rate, shared.seed, source_key);
                    for (j, t) in arrivals.enumerate() {
                        let at = start + Duration::from_secs_f64(t);
                        if phase.deadline.is_some_and(|d| at >= d) {
                            break;
                        }
                        tokio::select! {
                            _ = tokio::time::sleep_until(at.into()) => {}
                            _ = cancel.wait_for(|c| *c) => break,
                        }
                        if !phase.claim() {
                            break;
                        }
                        let p = shared.plan(source_key + j as u64, &tenants);
                        let (shared, tx) = (shared.clone(), tx.clone());
                        tokio::spawn(async move {
                            if let Some(r) = shared.execute(p).await {
                                let _ = tx.send(r);
                            }
                        });
                    }
                });
            }
        }
    }
}

fn progress_bar(
    quiet: bool,
    limit: Option<u64>,
    duration: Option<Duration>,
) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressStyle};
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (len, template) = match (limit, duration) {
        (Some(n), _) => (n, "{spinner} {elapsed:>4} [{bar:30}] {pos}/{len} {msg}"),
        (None, Some(d)) => (
            d.as_millis() as u64,
            "{spinner} {elapsed:>4} [{bar:30}] {percent:>3}% of the duration {msg}",
        ),
        (None, None) => (0, "{spinner} {elapsed:>4} {msg}"),
    };
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb
}

/// Runs the benchmark, prints the table to stdout, writes
/// `--json`, and returns the report. Ctrl-C ends the run early with what was
/// measured so far (`interrupted: true`).
pub async fn run(args: BenchArgs) -> anyhow::Result<BenchReport> {
    let (cancel_tx, cancel_rx) = watch::channel(false);
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let report = run_until(args.clone(), cancel_tx, cancel_rx, ctrl_c).await?;
    print!("{}", stats::render_table(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the JSON report to {}", path.display()))?;
    }
    Ok(report)
}

/// [`run`] (or [`mix::run`] for `--scenario tenant-mix`) on a new multi-threaded
/// Tokio runtime, for a synchronous `main`.
pub fn run_blocking(args: BenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the Tokio runtime")?;
    match args.scenario {
        Scenario::Load => rt.block_on(run(args)).map(|_| ()),
        Scenario::TenantMix => rt.block_on(mix::run(args)).map(|_| ()),
        Scenario::Soak => rt.block_on(soak::run(args)).and_then(|r| {
            if r.no_request_lost && r.blocks_back {
                Ok(())
            } else {
                anyhow::bail!("soak: a request was lost or blocks did not return to baseline")
            }
        }),
    }
}

fn config_json(args: &BenchArgs, plan: &Plan, nonce: u32) -> serde_json::Value {
    serde_json::json!({
        "target": args.target,
        "api": plan.api,
        "model": args.model,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "requests": plan.limit,
        "duration_s": plan.duration.map(|d| d.as_secs_f64()),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "tenants": plan.tenants,
        "tenant_rates": args.tenant_rates,
        "warmup": args.warmup,
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": !args.no_ignore_eos,
        "timeout_s": args.timeout.as_secs_f64(),
        "connections": args.connections,
        "extra_body": args.extra_body,
        "nonce": format!("{nonce:08x}"),
    })
}

/// The run itself; `interrupt` resolving acts as Ctrl-C.
async fn run_until(
    args: BenchArgs,
    cancel_tx: watch::Sender<bool>,
    cancel_rx: watch::Receiver<bool>,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<BenchReport> {
    let plan = plan(&args)?;
    let keys: Vec<Option<String>> = plan.tenants.iter().map(|t| t.api_key.clone()).collect();
    let client = match plan.api {
        Api::Openai => {
            let extra = match &args.extra_body {
                None => serde_json::Map::new(),
                Some(s) => match serde_json::from_str::<serde_json::Value>(s) {
                    Ok(serde_json::Value::Object(m)) => m,
                    _ => bail!("--extra-body must be a JSON object"),
                },
            };
            Client::openai(&args.target, &keys, extra)
        }
        _ => {
            if args.extra_body.is_some() {
                bail!("--extra-body applies to --api openai only");
            }
            Client::grpc(&args.target, args.connections as usize, &keys)
        }
    }
    .map_err(anyhow::Error::msg)?;
    // Nonce: differs per run (time and process), independent of --seed.
    let nonce = {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (t.as_nanos() as u32) ^ std::process::id().rotate_left(16)
    };
    let shared = Arc::new(Shared {
        client,
        opts: RequestOptions {
            model: args.model.clone(),
            temperature: args.temperature,
            ignore_eos: !args.no_ignore_eos,
            timeout: args.timeout,
            nonce,
        },
        shares: plan.tenants.iter().map(|t| t.share).collect(),
        prompt: args.prompt_tokens,
        max_tokens: args.max_tokens,
        lengths: Vec::new(),
        seed: args.seed,
        next_index: AtomicU64::new(0),
        cancel: cancel_rx,
    });
    let names: Vec<String> = plan.tenants.iter().map(|t| t.name.clone()).collect();
    tokio::pin!(interrupt);
    let mut interrupted = false;

    // Warm-up.
    let mut warmup_errors = 0;
    if args.warmup > 0 {
        let phase = Arc::new(Phase {
            claimed: AtomicU64::new(0),
            limit: Some(args.warmup),
            deadline: None,
            stop: AtomicBool::new(false),
            key_base: 1 << 62,
        });
        let workers = plan.warmup_concurrency.min(args.warmup as u32).max(1);
        let (tx, mut rx) = mpsc::unbounded_channel();
        start_phase(
            &shared,
            &phase,
            &[Source::Closed {
                workers,
                tenants: (0..plan.tenants.len()).collect(),
            }],
            &tx,
        );
        drop(tx);
        let pb = progress_bar(args.quiet, Some(args.warmup), None);
        pb.set_message("warm-up");
        loop {
            tokio::select! {
                r = rx.recv() => match r {
                    Some(r) => {
                        if !r.is_ok() {
                            warmup_errors += 1;
                        }
                        pb.inc(1);
                    }
                    None => break,
                },
                _ = &mut interrupt => {
                    interrupted = true;
                    phase.stop.store(true, Ordering::Relaxed);
                    let _ = cancel_tx.send(true);
                    break;
                }
            }
        }
        pb.finish_and_clear();
    }

    // Measured phase.
    let mut collector = Collector::new(names);
    let started_at_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let start = Instant::now();
    let mut end = start;
    if !interrupted {
        let phase = Arc::new(Phase {
            claimed: AtomicU64::new(0),
            limit: plan.limit,
            deadline: plan.duration.map(|d| start + d),
            stop: AtomicBool::new(false),
            key_base: 0,
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        start_phase(&shared, &phase, &plan.sources, &tx);
        drop(tx);
        let pb = progress_bar(args.quiet, plan.limit, plan.duration);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut give_up: Option<tokio::time::Instant> = None;
        loop {
            let give_up_at = give_up;
            tokio::select! {
                r = rx.recv() => match r {
                    Some(r) => {
                        collector.add(&r);
                        end = Instant::now();
                        if plan.limit.is_some() {
                            pb.inc(1);
                        }
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    let o = collector.overall();
                    let secs = start.elapsed().as_secs_f64();
                    if plan.limit.is_none() {
                        if let Some(d) = plan.duration {
                            pb.set_position((start.elapsed().min(d)).as_millis() as u64);
                        }
                    }
                    pb.set_message(format!(
                        "ok {} err {} | {:.1} tok/s",
                        o.ok(),
                        o.errors(),
                        o.output_tokens() as f64 / secs.max(1e-9)
                    ));
                }
                _ = &mut interrupt, if !interrupted => {
                    interrupted = true;
                    end = Instant::now();
                    phase.stop.store(true, Ordering::Relaxed);
                    let _ = cancel_tx.send(true);
                    // Cancelled requests return at once; don't hang on any
                    // that doesn't.
                    give_up = Some(tokio::time::Instant::now() + Duration::from_secs(3));
                }
                _ = async move {
                    match give_up_at {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                } => break,
            }
        }
        pb.finish_and_clear();
        if !interrupted && collector.overall().requests() == 0 {
            end = Instant::now();
        }
    }
    let wall = end.duration_since(start).as_secs_f64();
    let (overall, tenants, error_examples) = collector.reports(wall);
    Ok(BenchReport {
        target: args.target.clone(),
        api: match plan.api {
            Api::Openai => "openai",
            _ => "weft",
        }
        .into(),
        mode: plan.mode.clone(),
        config: config_json(&args, &plan, nonce),
        started_at_unix_s,
        duration_s: wall,
        interrupted,
        warmup_requests: args.warmup,
        warmup_errors,
        overall,
        tenants,
        error_examples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn args(line: &str) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(line.split_whitespace()))
            .map(|c| c.bench)
    }

    #[test]
    fn cli_parses_and_plans() {
        let a = args("--target http://127.0.0.1:8080 -c 8 -n 50 --prompt-tokens uniform:64:256 --max-tokens normal:128:32").unwrap();
        let p = plan(&a).unwrap();
        assert_eq!(p.api, Api::Openai);
        assert_eq!(p.limit, Some(50));
        assert_eq!(p.tenants[0].name, "default");
        assert!(matches!(
            &p.sources[..],
            [Source::Closed { workers: 8, .. }]
        ));
        assert_eq!(a.prompt_tokens, LengthDist::Uniform { lo: 64, hi: 256 });

        let a = args("--rate 5 -d 10s").unwrap();
        let p = plan(&a).unwrap();
        assert_eq!(p.api, Api::Weft);
        assert_eq!(p.limit, None);
        assert!(matches!(&p.sources[..], [Source::Open { rate, .. }] if *rate == 5.0));

        // A flooding tenant at its own rate beside closed-loop others.
        let a = args(
            "--tenant flood:k1 --tenant a:k2:2 --tenant b:k3 --tenant-rate flood:50 -c 2 -d 5",
        )
        .unwrap();
        let p = plan(&a).unwrap();
        assert_eq!(p.sources.len(), 2);
        assert!(
            matches!(&p.sources[0], Source::Open { rate, tenants } if *rate == 50.0 && tenants == &[0])
        );
        assert!(
            matches!(&p.sources[1], Source::Closed { workers: 2, tenants } if tenants == &[1, 2])
        );
        assert!(p.mode.contains("flood open loop 50 req/s"), "{}", p.mode);
        // Neither --requests nor --duration: 100 requests.
        assert_eq!(plan(&args("").unwrap()).unwrap().limit, Some(100));
    }

    #[test]
    fn cli_errors_are_clear() {
        let e = args("--tenant alice").unwrap_err().to_string();
        assert!(e.contains("missing `:apikey`"), "{e}");
        let e = args("--max-tokens uniform:9:1").unwrap_err().to_string();
        assert!(e.contains("LO <= HI"), "{e}");
        let err = |l: &str| plan(&args(l).unwrap()).unwrap_err().to_string();
        assert!(err("--rate 5 -c 3").contains("exclude each other"));
        assert!(err("--tenant-rate a:3").contains("needs --tenant"));
        assert!(err("--tenant a:k --tenant-rate b:3").contains("unknown tenant `b`"));
        assert!(err("--tenant a:k --tenant-rate a:3 --rate 2").contains("no tenant left"));
        assert!(err("--tenant a:k --tenant-rate a:3 -c 2").contains("no tenant left"));
        assert!(err("-c 0").contains("at least 1"));
        assert!(err("--rate 0").contains("positive"));
        assert!(err("-n 0").contains("at least 1"));
    }

    #[tokio::test]
    async fn planning_is_reproducible_and_follows_shares() {
        use std::collections::HashSet;
        let (_tx, rx) = watch::channel(false);
        let mk = || Shared {
            client: Client::grpc("grpc://127.0.0.1:9", 1, &[None, None]).unwrap(),
            opts: RequestOptions {
                model: None,
                temperature: 0.0,
                ignore_eos: true,
                timeout: Duration::from_secs(1),
                nonce: 7,
            },
            shares: vec![3.0, 1.0],
            prompt: "uniform:10:100".parse().unwrap(),
            max_tokens: "normal:50:10".parse().unwrap(),
            lengths: Vec::new(),
            seed: 5,
            next_index: AtomicU64::new(0),
            cancel: rx.clone(),
        };
        let (a, b) = (mk(), mk());
        let pa: Vec<Planned> = (0..4000).map(|k| a.plan(k, &[0, 1])).collect();
        let pb: Vec<Planned> = (0..4000).map(|k| b.plan(k, &[0, 1])).collect();
        for (x, y) in pa.iter().zip(&pb) {
            assert_eq!(
                (x.tenant, x.max_tokens, &x.prompt),
                (y.tenant, y.max_tokens, &y.prompt)
            );
        }
        // 3:1 shares: tenant 0 gets ~75% (4 sigma of a binomial ~ 2.7%).
        let t0 = pa.iter().filter(|p| p.tenant == 0).count() as f64 / 4000.0;
        assert!((t0 - 0.75).abs() < 0.027, "{t0}");
        // Every prompt is unique.
        let mut prompts: Vec<&String> = pa.iter().map(|p| &p.prompt).collect();
        prompts.sort();
        prompts.dedup();
        assert_eq!(prompts.len(), 4000);
        // A single-tenant source always picks that tenant.
        assert!((0..100).all(|k| a.plan(k, &[1]).tenant == 1));

        // Per-tenant lengths (tenant-mix's light tenant) replace the shared ones
        // for that tenant only.
        let mut c = mk();
        c.lengths = vec![None, Some(("5".parse().unwrap(), "3".parse().unwrap()))];
        let words = |p: &Planned| p.prompt.split(' ').count();
        let (mut light, mut other) = (HashSet::new(), HashSet::new());
        for k in 0..200 {
            let (p0, p1) = (c.plan(k, &[0]), c.plan(k, &[1]));
            assert_eq!(p1.max_tokens, 3);
            assert_ne!(p0.max_tokens, 3, "request {k} of tenant 0 kept its lengths");
            assert!(words(&p1) <= words(&p0), "request {k}");
            light.insert(words(&p1));
            other.insert(words(&p0));
        }
        assert_eq!(light.len(), 1, "a fixed prompt length: {light:?}");
        assert!(other.len() > 10, "tenant 0's uniform:10:100: {other:?}");
    }

    #[tokio::test]
    async fn tenant_mix_needs_a_flood_and_a_light_tenant() {
        let err = |l: &str| {
            let a = args(l).unwrap();
            async move { mix::run(a).await.unwrap_err().to_string() }
        };
        assert!(err("--scenario tenant-mix").await.contains("two --tenant"));
        assert!(err("--scenario tenant-mix --tenant a:k --tenant b:k -c 3")
            .await
            .contains("sets its own load"));
        assert!(
            err("--scenario tenant-mix --tenant a:k --tenant b:k --flood-streams 0")
                .await
                .contains("at least 1")
        );
        let a = args("--scenario tenant-mix --flood-streams 48 --phase-duration 2m").unwrap();
        assert_eq!((a.scenario, a.flood_streams), (Scenario::TenantMix, 48));
        assert_eq!(a.phase_duration, Duration::from_secs(120));
    }
}
