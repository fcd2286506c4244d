//! `weft bench --scenario soak`: memory and KV blocks over a long mixed run
//! (issue 17 item 3). `--concurrency` closed-loop workers (default 16) send
//! gRPC `GenerateStream` requests for `--duration` (default 30 min) over the
//! `--tenant`s, prompts and outputs drawn from `--prompt-tokens` /
//! `--max-tokens`; a `--cancel-fraction` of them is cancelled after a random
//! number of tokens (the stream dropped) and a `--disconnect-fraction` sent on
//! a connection of its own that is closed mid-stream. Every `--sample-every`
//! the server's `/metrics` (`--metrics-url`) is read: its RSS, MLX's active,
//! cache and peak bytes, the memory plan's total, KV blocks used, requests
//! running and waiting.
//!
//! Reported (and judged):
//! - **no request lost**: every request that was not cancelled or
//!   disconnected on purpose ended with `finished` and exactly the tokens its
//!   usage counts (`max_tokens` of them: EOS is ignored); a refusal
//!   (`RESOURCE_EXHAUSTED`) is counted apart, anything else is lost;
//! - **blocks back to baseline**: once the load stops, KV blocks used, requests
//!   running and gRPC calls in flight return to what they were before it;
//! - **memory flat after warm-up**: the largest RSS after the first
//!   `--soak-warmup` of the run against the largest before it (goal: at most 5%
//!   more), and MLX's peak against the plan's total.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use super::client::grpc_uri;
use super::{prompt, BenchArgs};
use crate::pb;

/// RSS growth after warm-up that still counts as flat.
pub const FLAT_GROWTH: f64 = 0.05;

/// One read of the server's gauges.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub rss_bytes: f64,
    pub mlx_active_bytes: f64,
    pub mlx_cache_bytes: f64,
    pub mlx_peak_bytes: f64,
    pub kv_blocks_used: f64,
    pub requests_running: f64,
    pub requests_waiting: f64,
    pub grpc_in_flight: f64,
}

/// How each request ended.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcomes {
    /// Finished with every token its usage counts.
    pub completed: u64,
    /// Dropped by the client on purpose after some tokens.
    pub cancelled: u64,
    /// Their connection closed mid-stream on purpose.
    pub disconnected: u64,
    /// `RESOURCE_EXHAUSTED` (honest backpressure; retried after the hint).
    pub refused: u64,
    /// Anything else: an error status, a stream without `finished`, a token
    /// count that does not match, a timeout.
    pub lost: u64,
    /// The first few lost requests, for the report.
    pub lost_examples: Vec<String>,
    pub tokens: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub target: String,
    pub metrics_url: String,
    pub config: serde_json::Value,
    pub duration_s: f64,
    pub outcomes: Outcomes,
    pub baseline: Sample,
    pub samples: Vec<Sample>,
    /// After the load stopped, when blocks, running rows and calls in flight
    /// were back to the baseline (None: not within 60 s).
    pub drained_after_s: Option<f64>,
    pub end: Sample,
    pub plan_total_bytes: Option<f64>,
    pub rss_warm_max_bytes: f64,
    pub rss_after_max_bytes: f64,
    pub rss_growth: f64,
    pub mlx_peak_bytes: f64,
    pub no_request_lost: bool,
    pub blocks_back: bool,
    pub memory_flat: bool,
    /// MLX's peak within the plan's total (None: the plan has no total).
    pub within_plan: Option<bool>,
}

/// Reads the gauges of one `/metrics` text.
pub fn parse_sample(text: &str, t_s: f64) -> (Sample, Option<f64>) {
    let get = |name: &str, label: Option<&str>| -> f64 {
        let mut sum = 0.0;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let base = series.split('{').next().unwrap_or("");
            if base == name && label.is_none_or(|l| series.contains(l)) {
                sum += value.parse::<f64>().unwrap_or(0.0);
            }
        }
        sum
    };
    let plan = text
        .lines()
        .any(|l| l.starts_with("weft_memory_plan_bytes{part=\"total\"}"))
        .then(|| get("weft_memory_plan_bytes", Some("part=\"total\"")));
    (
        Sample {
            t_s,
            rss_bytes: get(crate::memory_plan::RESIDENT, None),
            mlx_active_bytes: get(crate::memory_plan::MLX_ACTIVE, None),
            mlx_cache_bytes: get(crate::memory_plan::MLX_CACHE, None),
            mlx_peak_bytes: get(crate::memory_plan::MLX_PEAK, None),
            kv_blocks_used: get(weft_scheduler::metrics::KV_BLOCKS_USED, None),
            requests_running: get(crate::server::metrics::REQUESTS_RUNNING_ALL, None),
            requests_waiting: get(crate::server::metrics::REQUESTS_WAITING_ALL, None),
            grpc_in_flight: get(crate::server::metrics::GRPC_IN_FLIGHT, None),
        },
        plan,
    )
}

async fn scrape(
    http: &reqwest::Client,
    url: &str,
    t_s: f64,
) -> anyhow::Result<(Sample, Option<f64>)> {
    let text = http
        .get(url)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("GET {url}"))?
        .text()
        .await?;
    Ok(parse_sample(&text, t_s))
}

/// What a request does on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Complete,
    /// Drop the stream after this many tokens.
    Cancel(u32),
    /// Close the connection after this many tokens.
    Disconnect(u32),
}

enum Ended {
    Completed(u64),
    Cancelled(u64),
    Disconnected(u64),
    Refused(u64),
    Lost(String),
}

struct Worker {
    uri: String,
    shared: Channel,
    auth: Vec<Option<MetadataValue<Ascii>>>,
    timeout: Duration,
    nonce: u32,
}

impl Worker {
    async fn run(
        &self,
        index: u64,
        tenant: usize,
        prompt: String,
        max_tokens: u32,
        fate: Fate,
    ) -> Ended {
        use pb::generate_stream_response::Event;
        let channel = match fate {
            Fate::Disconnect(_) => match Endpoint::from_shared(self.uri.clone()) {
                Ok(e) => match e.connect().await {
                    Ok(c) => c,
                    Err(e) => return Ended::Lost(format!("request {index}: connect: {e}")),
                },
                Err(e) => return Ended::Lost(format!("bad URI: {e}")),
            },
            _ => self.shared.clone(),
        };
        let mut client = pb::generation_client::GenerationClient::new(channel);
        let body = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Text(prompt)),
            max_tokens,
            ignore_eos: true,
            request_id: format!("soak-{:08x}-{index}", self.nonce),
            ..Default::default()
        };
        let mut req = tonic::Request::new(body);
        req.set_timeout(self.timeout);
        if let Some(a) = &self.auth[tenant] {
            req.metadata_mut().insert("authorization", a.clone());
        }
        let run = async {
            let mut stream = match client.generate_stream(req).await {
                Ok(r) => r.into_inner(),
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    let ms = s
                        .metadata()
                        .get("retry-after-ms")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(100);
                    return Ended::Refused(ms);
                }
                Err(s) => return Ended::Lost(format!("request {index}: {s}")),
            };
            let mut tokens = 0u64;
            loop {
                match stream.message().await {
                    Ok(Some(msg)) => match msg.event {
                        Some(Event::Delta(d)) => {
                            tokens += d.ids.len() as u64;
                            match fate {
                                Fate::Cancel(k) if tokens >= u64::from(k) => {
                                    return Ended::Cancelled(tokens)
                                }
                                Fate::Disconnect(k) if tokens >= u64::from(k) => {
                                    return Ended::Disconnected(tokens)
                                }
                                _ => {}
                            }
                        }
                        Some(Event::Finished(f)) => {
                            let usage = f.usage.unwrap_or_default();
                            let reason = f.reason();
                            return if reason != pb::FinishReason::Length
                                || u64::from(usage.generated_tokens) != tokens
                                || tokens != u64::from(max_tokens)
                            {
                                Ended::Lost(format!(
                                    "request {index}: finished {reason:?} with {tokens} tokens \
                                     streamed, usage {}, max_tokens {max_tokens} {}",
                                    usage.generated_tokens, f.error
                                ))
                            } else {
                                Ended::Completed(tokens)
                            };
                        }
                        None => {}
                    },
                    Ok(None) => {
                        return Ended::Lost(format!(
                            "request {index}: stream ended after {tokens} tokens without `finished`"
                        ))
                    }
                    Err(s) => return Ended::Lost(format!("request {index}: {s}")),
                }
            }
        };
        match tokio::time::timeout(self.timeout, run).await {
            Ok(e) => e,
            Err(_) => Ended::Lost(format!(
                "request {index}: no answer within {:.0} s",
                self.timeout.as_secs_f64()
            )),
        }
    }
}

/// Counts one ended request; a refusal returns how long to wait first.
fn record(outcomes: &Mutex<Outcomes>, ended: Ended) -> Option<u64> {
    let mut o = outcomes.lock().expect("outcomes");
    match ended {
        Ended::Completed(t) => {
            o.completed += 1;
            o.tokens += t;
        }
        Ended::Cancelled(t) => {
            o.cancelled += 1;
            o.tokens += t;
        }
        Ended::Disconnected(t) => {
            o.disconnected += 1;
            o.tokens += t;
        }
        Ended::Refused(ms) => {
            o.refused += 1;
            return Some(ms);
        }
        Ended::Lost(why) => {
            o.lost += 1;
            if o.lost_examples.len() < 10 {
                o.lost_examples.push(why);
            }
        }
    }
    None
}

pub async fn run(args: BenchArgs) -> anyhow::Result<SoakReport> {
    if args.rate.is_some() || !args.tenant_rates.is_empty() {
        bail!("--scenario soak is closed loop: give --concurrency, not --rate / --tenant-rate");
    }
    let metrics_url = args
        .metrics_url
        .clone()
        .context("--scenario soak needs --metrics-url http://HOST:PORT/metrics (the server's)")?;
    for (name, f) in [
        ("--cancel-fraction", args.cancel_fraction),
        ("--disconnect-fraction", args.disconnect_fraction),
        ("--soak-warmup", args.soak_warmup),
    ] {
        if !(0.0..1.0).contains(&f) {
            bail!("{name} must be in [0, 1)");
        }
    }
    if args.cancel_fraction + args.disconnect_fraction >= 1.0 {
        bail!("--cancel-fraction + --disconnect-fraction must leave requests that complete");
    }
    let duration = args.duration.unwrap_or(Duration::from_secs(1800));
    let workers = args.concurrency.unwrap_or(16).max(1);
    let tenants = if args.tenants.is_empty() {
        vec![super::TenantSpec {
            name: "default".into(),
            api_key: args.api_key.clone().filter(|k| !k.is_empty()),
            share: 1.0,
        }]
    } else {
        args.tenants.clone()
    };
    super::tenant::validate(&tenants, &[]).map_err(anyhow::Error::msg)?;
    let uri = grpc_uri(&args.target).map_err(anyhow::Error::msg)?;
    let shared = Endpoint::from_shared(uri.clone())
        .with_context(|| format!("`{}`: bad URI", args.target))?
        .tcp_nodelay(true)
        .connect_lazy();
    let auth = tenants
        .iter()
        .map(|t| {
            t.api_key
                .as_ref()
                .map(|k| format!("Bearer {k}").parse::<MetadataValue<Ascii>>())
                .transpose()
                .context("API key can't be sent as metadata")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let nonce = {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (t.as_nanos() as u32) ^ std::process::id().rotate_left(16)
    };
    let worker = Arc::new(Worker {
        uri,
        shared,
        auth,
        timeout: args.timeout,
        nonce,
    });
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;

    let (baseline, _) = scrape(&http, &metrics_url, 0.0).await?;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicU64::new(0));
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let shares: Vec<f64> = tenants.iter().map(|t| t.share).collect();
    let share_total: f64 = shares.iter().sum();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (worker, stop, next, outcomes, shares) = (
            worker.clone(),
            stop.clone(),
            next.clone(),
            outcomes.clone(),
            shares.clone(),
        );
        let (seed, prompt_len, max_len) = (args.seed, args.prompt_tokens, args.max_tokens);
        let (cancel_f, disconnect_f) = (args.cancel_fraction, args.disconnect_fraction);
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(index);
                let mut x = rng.random::<f64>() * share_total;
                let mut tenant = shares.len() - 1;
                for (i, s) in shares.iter().enumerate() {
                    if x < *s {
                        tenant = i;
                        break;
                    }
                    x -= s;
                }
                let len = prompt_len.sample(&mut rng);
                let max_tokens = max_len.sample(&mut rng).max(2);
                let text = prompt::make_prompt(nonce, index, len, &mut rng);
                let f = rng.random::<f64>();
                let fate = if f < cancel_f {
                    Fate::Cancel(rng.random_range(1..max_tokens))
                } else if f < cancel_f + disconnect_f {
                    Fate::Disconnect(rng.random_range(1..max_tokens))
                } else {
                    Fate::Complete
                };
                let ended = worker.run(index, tenant, text, max_tokens, fate).await;
                let pause = record(&outcomes, ended);
                if let Some(ms) = pause {
                    tokio::time::sleep(Duration::from_millis(ms.min(5000))).await;
                }
            }
        }));
    }

    let every = args.sample_every;
    let mut samples = Vec::new();
    let mut plan_total = None;
    let end_at = start + duration;
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let now = Instant::now();
        match scrape(&http, &metrics_url, start.elapsed().as_secs_f64()).await {
            Ok((s, plan)) => {
                plan_total = plan.or(plan_total);
                if !args.quiet {
                    eprintln!(
                        "soak {:>6.0} s: RSS {:>7.1} MiB, MLX active {:>7.1} / cache {:>6.1} / peak {:>7.1} MiB, blocks {:>5}, running {:>3}",
                        s.t_s,
                        s.rss_bytes / MIB,
                        s.mlx_active_bytes / MIB,
                        s.mlx_cache_bytes / MIB,
                        s.mlx_peak_bytes / MIB,
                        s.kv_blocks_used,
                        s.requests_running
                    );
                }
                samples.push(s);
            }
            Err(e) => eprintln!("soak: {e:#}"),
        }
        if now >= end_at {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let load_s = start.elapsed().as_secs_f64();

    // Drain: blocks, running rows and calls in flight back to the baseline.
    let stopped = Instant::now();
    let mut drained_after_s = None;
    let mut end = baseline;
    while stopped.elapsed() < Duration::from_secs(60) {
        if let Ok((s, _)) = scrape(&http, &metrics_url, start.elapsed().as_secs_f64()).await {
            end = s;
            if s.kv_blocks_used <= baseline.kv_blocks_used
                && s.requests_running <= baseline.requests_running
                && s.grpc_in_flight <= baseline.grpc_in_flight
            {
                drained_after_s = Some(stopped.elapsed().as_secs_f64());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let warm_end = duration.as_secs_f64() * args.soak_warmup;
    let max_of = |pred: &dyn Fn(&Sample) -> bool| {
        samples
            .iter()
            .filter(|s| pred(s))
            .map(|s| s.rss_bytes)
            .fold(0.0, f64::max)
    };
    let rss_warm_max = max_of(&|s| s.t_s <= warm_end);
    let rss_after_max = max_of(&|s| s.t_s > warm_end);
    let rss_growth = if rss_warm_max > 0.0 {
        rss_after_max / rss_warm_max - 1.0
    } else {
        f64::NAN
    };
    let mlx_peak = samples
        .iter()
        .chain(std::iter::once(&end))
        .map(|s| s.mlx_peak_bytes)
        .fold(0.0, f64::max);
    let outcomes = outcomes.lock().expect("outcomes").clone();
    let report = SoakReport {
        target: args.target.clone(),
        metrics_url,
        config: serde_json::json!({
            "scenario": "soak",
            "tenants": tenants,
            "concurrency": workers,
            "duration_s": duration.as_secs_f64(),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "cancel_fraction": args.cancel_fraction,
            "disconnect_fraction": args.disconnect_fraction,
            "sample_every_s": every.as_secs_f64(),
            "soak_warmup": args.soak_warmup,
            "seed": args.seed,
            "nonce": format!("{nonce:08x}"),
        }),
        duration_s: load_s,
        no_request_lost: outcomes.lost == 0 && outcomes.completed > 0,
        outcomes,
        baseline,
        blocks_back: drained_after_s.is_some(),
        drained_after_s,
        end,
        plan_total_bytes: plan_total,
        rss_warm_max_bytes: rss_warm_max,
        rss_after_max_bytes: rss_after_max,
        memory_flat: rss_growth <= FLAT_GROWTH,
        rss_growth,
        mlx_peak_bytes: mlx_peak,
        within_plan: plan_total.map(|p| mlx_peak <= p),
        samples,
    };
    print!("{}", render(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the JSON report to {}", path.display()))?;
    }
    Ok(report)
}

const MIB: f64 = 1024.0 * 1024.0;

/// The verdict lines.
pub fn render(r: &SoakReport) -> String {
    use std::fmt::Write as _;
    let o = &r.outcomes;
    let yes = |b: bool| if b { "met" } else { "NOT met" };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "soak {:.0} s: {} completed, {} cancelled, {} disconnected, {} refused, {} lost; {} tokens",
        r.duration_s, o.completed, o.cancelled, o.disconnected, o.refused, o.lost, o.tokens
    );
    for e in &o.lost_examples {
        let _ = writeln!(s, "  lost: {e}");
    }
    let _ = writeln!(s, "no request lost: {}", yes(r.no_request_lost));
    let _ = writeln!(
        s,
        "blocks back to baseline ({} used before, {} after): {}{}",
        r.baseline.kv_blocks_used,
        r.end.kv_blocks_used,
        yes(r.blocks_back),
        r.drained_after_s
            .map(|d| format!(" after {d:.1} s"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "RSS: max {:.1} MiB in the warm-up, {:.1} MiB after it ({:+.1}%; flat within {:.0}%: {})",
        r.rss_warm_max_bytes / MIB,
        r.rss_after_max_bytes / MIB,
        r.rss_growth * 100.0,
        FLAT_GROWTH * 100.0,
        yes(r.memory_flat)
    );
    match (r.plan_total_bytes, r.within_plan) {
        (Some(p), Some(w)) => {
            let _ = writeln!(
                s,
                "MLX peak {:.1} MiB of the memory plan's {:.1} MiB: {}",
                r.mlx_peak_bytes / MIB,
                p / MIB,
                yes(w)
            );
        }
        _ => {
            let _ = writeln!(
                s,
                "MLX peak {:.1} MiB (the server's plan has no total: --mlx-cache-limit off)",
                r.mlx_peak_bytes / MIB
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_gauges_of_a_metrics_text() {
        let text = "# HELP x\n\
            weft_process_resident_memory_bytes 1048576\n\
            weft_mlx_active_memory_bytes 2097152\n\
            weft_kv_blocks_used 7\n\
            weft_num_requests_running 3\n\
            weft_grpc_requests_in_flight 2\n\
            weft_memory_plan_bytes{part=\"kv\"} 5\n\
            weft_memory_plan_bytes{part=\"total\"} 99\n";
        let (s, plan) = parse_sample(text, 1.5);
        assert_eq!(s.t_s, 1.5);
        assert_eq!(s.rss_bytes, 1048576.0);
        assert_eq!(s.mlx_active_bytes, 2097152.0);
        assert_eq!(s.kv_blocks_used, 7.0);
        assert_eq!(s.requests_running, 3.0);
        assert_eq!(s.grpc_in_flight, 2.0);
        assert_eq!(plan, Some(99.0));
        let (_, none) = parse_sample("weft_kv_blocks_used 1\n", 0.0);
        assert_eq!(none, None);
    }
}
