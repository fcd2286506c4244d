//! `weft bench --scenario tenant-mix`: latency isolation between tenants (issue 17
//! item 2). Two tenants, the first given with `--tenant` the flood and the second
//! the light one, in three phases of `--phase-duration` each:
//!
//! 1. the light tenant alone: one closed-loop stream of short requests
//!    (`--light-prompt-tokens`, `--light-max-tokens`), each sent when the previous
//!    one ended;
//! 2. the flood alone: `--flood-streams` closed-loop streams of `--prompt-tokens` /
//!    `--max-tokens` requests;
//! 3. both at once.
//!
//! Reported: the light tenant's TTFT alone and under the flood (the goal: p99
//! within 1.5x), and the total output throughput under both against the flood's
//! alone (the goal: within 5%). The server must know both tenants (a tenant file),
//! or both land in one and nothing is isolated.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use super::client::RequestOptions;
use super::stats::Collector;
use super::{start_phase, BenchArgs, Client, GroupReport, Phase, Shared, Source};

/// One phase's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct MixPhase {
    pub name: String,
    pub duration_s: f64,
    pub overall: GroupReport,
    pub flood: GroupReport,
    pub light: GroupReport,
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantMixReport {
    pub target: String,
    pub config: serde_json::Value,
    pub phases: Vec<MixPhase>,
    /// Light tenant's p99 TTFT under the flood / alone (goal <= 1.5).
    pub light_ttft_p99_ratio: f64,
    /// Output tokens/s of both tenants under the flood / the flood's alone (goal
    /// >= 0.95).
    pub throughput_ratio: f64,
    pub ttft_goal_met: bool,
    pub throughput_goal_met: bool,
}

/// Runs one phase of `sources` for `duration` and waits for its requests.
async fn phase(
    shared: &Arc<Shared>,
    sources: &[Source],
    duration: Duration,
    key_base: u64,
    names: &[String],
    name: &str,
) -> MixPhase {
    let start = Instant::now();
    let p = Arc::new(Phase {
        claimed: AtomicU64::new(0),
        limit: None,
        deadline: Some(start + duration),
        stop: AtomicBool::new(false),
        key_base,
    });
    let (tx, mut rx) = mpsc::unbounded_channel();
    start_phase(shared, &p, sources, &tx);
    drop(tx);
    let mut c = Collector::new(names.to_vec());
    let mut end = start;
    while let Some(r) = rx.recv().await {
        c.add(&r);
        end = Instant::now();
    }
    let wall = end.duration_since(start).as_secs_f64();
    let (overall, tenants, errors) = c.reports(wall);
    for e in errors {
        eprintln!("{name}: {e}");
    }
    eprintln!(
        "{name}: {:.1} s, light TTFT p99 {:.0} ms ({} requests), {:.1} output tok/s",
        wall, tenants[1].ttft_ms.p99, tenants[1].ok, overall.output_tokens_per_s
    );
    MixPhase {
        name: name.into(),
        duration_s: wall,
        overall,
        flood: tenants[0].clone(),
        light: tenants[1].clone(),
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<TenantMixReport> {
    if args.tenants.len() != 2 {
        bail!(
            "--scenario tenant-mix takes two --tenant NAME:APIKEY: the flood first, the light one second"
        );
    }
    if args.rate.is_some() || !args.tenant_rates.is_empty() || args.concurrency.is_some() {
        bail!("--scenario tenant-mix sets its own load: --flood-streams, one light stream");
    }
    if args.flood_streams == 0 {
        bail!("--flood-streams must be at least 1");
    }
    super::tenant::validate(&args.tenants, &[]).map_err(anyhow::Error::msg)?;
    let keys: Vec<Option<String>> = args.tenants.iter().map(|t| t.api_key.clone()).collect();
    let client = match args.api {
        super::Api::Openai => Client::openai(&args.target, &keys, serde_json::Map::new()),
        _ if args.target.starts_with("http") && args.api == super::Api::Auto => {
            Client::openai(&args.target, &keys, serde_json::Map::new())
        }
        _ => Client::grpc(&args.target, args.connections as usize, &keys),
    }
    .map_err(anyhow::Error::msg)?;
    let nonce = {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (t.as_nanos() as u32) ^ std::process::id().rotate_left(16)
    };
    let (_cancel_tx, cancel_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        client,
        opts: RequestOptions {
            model: args.model.clone(),
            temperature: args.temperature,
            ignore_eos: !args.no_ignore_eos,
            timeout: args.timeout,
            nonce,
        },
        shares: vec![1.0, 1.0],
        prompt: args.prompt_tokens,
        max_tokens: args.max_tokens,
        lengths: vec![
            None,
            Some((args.light_prompt_tokens, args.light_max_tokens)),
        ],
        seed: args.seed,
        next_index: AtomicU64::new(0),
        cancel: cancel_rx,
    });
    let names: Vec<String> = args.tenants.iter().map(|t| t.name.clone()).collect();
    let flood = Source::Closed {
        workers: args.flood_streams,
        tenants: vec![0],
    };
    let light = Source::Closed {
        workers: 1,
        tenants: vec![1],
    };
    let d = args.phase_duration;
    if args.warmup > 0 {
        // Both tenants' shapes once (GPU kernels, allocator growth), not measured.
        let p = Arc::new(Phase {
            claimed: AtomicU64::new(0),
            limit: Some(args.warmup),
            deadline: None,
            stop: AtomicBool::new(false),
            key_base: 1 << 62,
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        start_phase(&shared, &p, &[light.clone(), flood.clone()], &tx);
        drop(tx);
        while rx.recv().await.is_some() {}
    }
    let mut phases = Vec::new();
    phases.push(
        phase(
            &shared,
            std::slice::from_ref(&light),
            d,
            1 << 50,
            &names,
            "light alone",
        )
        .await,
    );
    phases.push(
        phase(
            &shared,
            std::slice::from_ref(&flood),
            d,
            2 << 50,
            &names,
            "flood alone",
        )
        .await,
    );
    phases.push(
        phase(
            &shared,
            &[flood, light],
            d,
            3 << 50,
            &names,
            "flood + light",
        )
        .await,
    );
    let solo = phases[0].light.ttft_ms.p99;
    let mixed = phases[2].light.ttft_ms.p99;
    let ttft_ratio = if solo > 0.0 { mixed / solo } else { f64::NAN };
    let flood_alone = phases[1].overall.output_tokens_per_s;
    let tput_ratio = if flood_alone > 0.0 {
        phases[2].overall.output_tokens_per_s / flood_alone
    } else {
        f64::NAN
    };
    let report = TenantMixReport {
        target: args.target.clone(),
        config: serde_json::json!({
            "scenario": "tenant-mix",
            "tenants": args.tenants,
            "flood_streams": args.flood_streams,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "light_prompt_tokens": args.light_prompt_tokens,
            "light_max_tokens": args.light_max_tokens,
            "phase_duration_s": d.as_secs_f64(),
            "warmup": args.warmup,
            "seed": args.seed,
            "nonce": format!("{nonce:08x}"),
        }),
        phases,
        light_ttft_p99_ratio: ttft_ratio,
        throughput_ratio: tput_ratio,
        ttft_goal_met: ttft_ratio <= 1.5,
        throughput_goal_met: tput_ratio >= 0.95,
    };
    print!("{}", render(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the JSON report to {}", path.display()))?;
    }
    Ok(report)
}

/// The report as a table: one row per phase, then the two ratios.
pub fn render(r: &TenantMixReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<14} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "phase",
        "wall s",
        "light ok",
        "TTFT p50",
        "TTFT p99",
        "TTFT max",
        "flood tok/s",
        "total tok/s"
    );
    for p in &r.phases {
        let _ = writeln!(
            s,
            "{:<14} {:>7.1} {:>9} {:>9.0} {:>9.0} {:>9.0} {:>11.1} {:>11.1}",
            p.name,
            p.duration_s,
            p.light.ok,
            p.light.ttft_ms.p50,
            p.light.ttft_ms.p99,
            p.light.ttft_ms.max,
            p.flood.output_tokens_per_s,
            p.overall.output_tokens_per_s
        );
    }
    let yes = |b: bool| if b { "met" } else { "NOT met" };
    let _ = writeln!(
        s,
        "light TTFT p99 under the flood / alone: {:.2}x (goal <= 1.5x: {})",
        r.light_ttft_p99_ratio,
        yes(r.ttft_goal_met)
    );
    let _ = writeln!(
        s,
        "total throughput under both / flood alone: {:.3} (goal >= 0.95: {})",
        r.throughput_ratio,
        yes(r.throughput_goal_met)
    );
    s
}
