//! `weft bench-engine --scenario long-prompts`: steps bounded in time (issue 17
//! item 1) on the real model, in process.
//!
//! 1. `--streams` requests decode (prompts of `--prompt-tokens`); once all stream,
//!    a few seconds of decoding alone give the step-cost model and the baseline
//!    inter-token latency.
//! 2. The `--long-prompts` (2048 and 7000 tokens by default) join one second apart;
//!    every gap between two tokens of a decoding stream from the first join to the
//!    last long prompt's first token is an ITL sample, compared with the ITL target
//!    the engine planned under (`Stats::itl_target`, polled).
//! 3. A `--cancel-prompt` prompt joins the still decoding streams and is cancelled
//!    once it holds half of its blocks; the time from the cancel to its final event
//!    (sent when the engine has released its blocks) and to the published stats
//!    showing them back are compared with the target.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use weft_scheduler::{EventStream, FinishReason, Request, SchedulerConfig};

use crate::engine_bench::EngineBenchArgs;
use crate::runtime;

/// Tokens each decoding stream may generate: more than the scenario takes.
const STREAM_TOKENS: usize = 3000;

#[derive(Debug, Serialize)]
pub struct LongPromptsReport {
    pub streams: usize,
    pub stream_prompt_tokens: usize,
    pub long_prompts: Vec<usize>,
    /// The setting (`auto`, `off`, `N ms`) and the target it came to (median of
    /// the values polled during the joins; None: no target).
    pub itl_setting: String,
    pub itl_target_ms: Option<f64>,
    pub itl_target_ms_range: Option<(f64, f64)>,
    /// Decoding alone, before the joins.
    pub decode_only_itl_p50_ms: f64,
    pub decode_only_itl_p99_ms: f64,
    /// While the long prompts joined.
    pub join_itl_samples: usize,
    pub join_itl_p50_ms: f64,
    pub join_itl_p99_ms: f64,
    pub join_itl_max_ms: f64,
    /// join_itl_p99 / target, and samples above 1.5x the target.
    pub p99_over_target: Option<f64>,
    pub samples_over_1_5x_target: Option<usize>,
    /// p99 over the gaps of each gap / the target in effect when it ended.
    pub p99_gap_over_its_target: Option<f64>,
    /// Time to first token of each long prompt.
    pub long_ttft_ms: Vec<f64>,
    pub cancel_prompt: usize,
    /// Blocks the cancelled prompt held (over the streams' own) when cancelled.
    pub cancel_blocks_held: usize,
    /// Cancel -> the request's final event (its blocks released by then).
    pub cancel_to_final_ms: f64,
    /// Cancel -> engine stats (published after each step) showing the blocks back.
    pub cancel_to_stats_ms: f64,
    pub cancel_reason: String,
    pub openblas: Option<String>,
}

/// When a stream ended, why, and its error.
type Ending = (Instant, FinishReason, Option<String>);

/// A stream's token arrival times, filled by its own thread.
struct Tracked {
    times: Arc<Mutex<Vec<Instant>>>,
    finish: Arc<Mutex<Option<Ending>>>,
    thread: std::thread::JoinHandle<()>,
}

fn track(mut s: EventStream) -> Tracked {
    let times = Arc::new(Mutex::new(Vec::new()));
    let finish = Arc::new(Mutex::new(None));
    let (t, f) = (times.clone(), finish.clone());
    let thread = std::thread::spawn(move || {
        while let Some(ev) = s.blocking_recv() {
            match ev {
                weft_scheduler::Event::Token(d) => {
                    let now = Instant::now();
                    let mut v = t.lock().unwrap();
                    v.extend(std::iter::repeat_n(now, d.ids.len()));
                }
                weft_scheduler::Event::Finished(x) => {
                    *f.lock().unwrap() = Some((Instant::now(), x.reason, x.error));
                }
            }
        }
    });
    Tracked {
        times,
        finish,
        thread,
    }
}

impl Tracked {
    fn count(&self) -> usize {
        self.times.lock().unwrap().len()
    }
    fn finished(&self) -> Option<Ending> {
        self.finish.lock().unwrap().clone()
    }
    fn first(&self) -> Option<Instant> {
        self.times.lock().unwrap().first().copied()
    }
}

/// Gaps between consecutive tokens of `streams` whose later token falls in
/// `[from, to]`, in ms.
fn gaps(streams: &[Tracked], from: Instant, to: Instant) -> Vec<f64> {
    let mut out = Vec::new();
    for s in streams {
        let v = s.times.lock().unwrap();
        for w in v.windows(2) {
            if w[1] > from && w[1] <= to && w[1] > w[0] {
                out.push((w[1] - w[0]).as_secs_f64() * 1e3);
            }
        }
    }
    out.sort_by(|a, b| a.total_cmp(b));
    out
}

/// Each gap (ms) of `streams` ending in (from, to] over the latest target polled
/// (`targets`, in time order) at its end.
fn gap_ratios(
    streams: &[Tracked],
    from: Instant,
    to: Instant,
    targets: &[(Instant, f64)],
) -> Vec<f64> {
    let mut out = Vec::new();
    for s in streams {
        let v = s.times.lock().unwrap();
        for w in v.windows(2) {
            if w[1] > from && w[1] <= to && w[1] > w[0] {
                let i = targets.partition_point(|(at, _)| *at <= w[1]);
                if let Some((_, t)) = targets.get(i.saturating_sub(1)) {
                    out.push((w[1] - w[0]).as_secs_f64() * 1e3 / t);
                }
            }
        }
    }
    out
}

fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 100 + ((seed * 7919 + i * 104_729) as u32 % (vocab - 200)))
        .collect()
}

/// Waits until `done` holds, polling the engine's stats for the ITL target on
/// the way; gives up after `limit`.
fn wait_until(
    engine: &weft_scheduler::Engine,
    limit: Duration,
    targets: &mut Vec<(Instant, f64)>,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let end = Instant::now() + limit;
    while !done() {
        if Instant::now() > end {
            anyhow::bail!("the scenario did not progress within {limit:?}");
        }
        if let Some(t) = engine.stats().itl_target {
            targets.push((Instant::now(), t * 1e3));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

pub fn run(args: EngineBenchArgs) -> anyhow::Result<LongPromptsReport> {
    let dir = runtime::resolve_model(&args.model, false)?;
    let opts = args.compute.load_options()?;
    let gpu = opts.device == weft_models::Device::Gpu;
    let setting = args
        .itl_target_ms
        .unwrap_or(crate::server::config::ItlSetting::Auto);
    let rows = args.streams + args.long_prompts.len() + 2;
    let config = SchedulerConfig {
        max_batch_rows: rows,
        max_step_tokens: args.max_step_tokens.unwrap_or(2048 + rows).max(rows),
        prefill_chunk: args.prefill_chunk,
        // As `weft serve` on this device.
        decode_prefill_tokens: args
            .decode_prefill_tokens
            .or((!gpu).then_some(crate::server::config::DEFAULT_CPU_DECODE_PREFILL_TOKENS)),
        itl_target: crate::engine_bench::itl_target(Some(setting), setting, gpu)?,
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
    let tokens = args.streams * (args.prompt_tokens + STREAM_TOKENS)
        + args.long_prompts.iter().sum::<usize>()
        + args.cancel_prompt;
    let blocks = tokens.div_ceil(16) + 16 * rows + 64;
    let (engine, _tok, served) = runtime::start_engine(
        &dir,
        opts,
        config,
        runtime::KvSpec {
            block_size: 16,
            memory: weft_models::KvMemory::Blocks(u32::try_from(blocks)?),
            max_batch_rows: rows,
            cache_limit: args.mlx_cache_limit,
            quant: args.kv_quant.quant()?,
        },
    )?;
    let vocab = served.vocab_size as u32;
    let submit = |tenant: &str, id: &str, p: Vec<u32>, n: usize| {
        let mut r = Request::new(tenant, p, n);
        r.ignore_eos = true;
        r.request_id = Some(id.to_string());
        engine.submit(r).map(track)
    };
    let mut targets = Vec::new();

    // 1. The streams decode alone.
    let streams: Vec<Tracked> = (0..args.streams)
        .map(|i| {
            submit(
                "decode",
                &format!("d{i}"),
                prompt(i, args.prompt_tokens, vocab),
                STREAM_TOKENS,
            )
        })
        .collect::<Result<_, _>>()?;
    let limit = Duration::from_secs(1800);
    wait_until(&engine, limit, &mut targets, || {
        streams.iter().all(|s| s.count() > 0)
    })?;
    let streaming = Instant::now();
    eprintln!("long-prompts: {} streams decoding", args.streams);
    std::thread::sleep(Duration::from_secs(4));
    let joined = Instant::now();
    let alone = gaps(&streams, streaming, joined);

    // 2. The long prompts join, a second apart.
    targets.clear();
    let mut longs = Vec::new();
    for (j, &len) in args.long_prompts.iter().enumerate() {
        if j > 0 {
            let next = Instant::now() + Duration::from_secs(1);
            wait_until(&engine, limit, &mut targets, || Instant::now() >= next)?;
        }
        let at = Instant::now();
        longs.push((
            at,
            submit("long", &format!("long{j}"), prompt(1000 + j, len, vocab), 1)?,
        ));
    }
    wait_until(&engine, limit, &mut targets, || {
        longs.iter().all(|(_, s)| s.finished().is_some())
    })?;
    let mut long_ttft_ms = Vec::new();
    let mut last_first = joined;
    for (at, s) in &longs {
        let first = s
            .first()
            .ok_or_else(|| anyhow::anyhow!("a long prompt produced no token"))?;
        long_ttft_ms.push((first - *at).as_secs_f64() * 1e3);
        last_first = last_first.max(first);
    }
    let join = gaps(&streams, joined, last_first);
    eprintln!("long-prompts: joined, TTFT {long_ttft_ms:?} ms");
    // Each gap against the target the scheduler had when the gap ended (auto
    // follows the decoding rows' own cost, which grows with their context).
    let mut ratios = gap_ratios(&streams, joined, last_first, &targets);
    ratios.sort_by(|a, b| a.total_cmp(b));
    let mut targets: Vec<f64> = targets.into_iter().map(|(_, t)| t).collect();
    targets.sort_by(|a, b| a.total_cmp(b));
    let target = (!targets.is_empty()).then(|| pct(&targets, 0.5));

    // 3. A long prompt cancelled mid-prefill.
    std::thread::sleep(Duration::from_millis(500));
    let base = engine.stats().kv_blocks_used;
    let need = args.cancel_prompt.div_ceil(16);
    let victim = submit(
        "long",
        "cancel-me",
        prompt(2000, args.cancel_prompt, vocab),
        1,
    )?;
    let mut ignore = Vec::new();
    wait_until(&engine, limit, &mut ignore, || {
        engine.stats().kv_blocks_used >= base + need / 2 || victim.finished().is_some()
    })?;
    // The streams' own blocks, from their lengths (they grew since `base`).
    let own: usize = streams
        .iter()
        .map(|s| (args.prompt_tokens + s.count()).div_ceil(16))
        .sum();
    let used = engine.stats().kv_blocks_used;
    let held = used.saturating_sub(own);
    eprintln!("long-prompts: cancelling a prompt holding {held} blocks");
    let cancelled = Instant::now();
    engine.cancel("long", "cancel-me");
    // The streams grow by a block each now and then: back means within that.
    let back = own + 2 * args.streams;
    wait_until(&engine, limit, &mut ignore, || {
        engine.stats().kv_blocks_used <= back
    })?;
    let stats_ms = cancelled.elapsed().as_secs_f64() * 1e3;
    wait_until(&engine, limit, &mut ignore, || victim.finished().is_some())?;
    let (at, reason, _) = victim.finished().expect("finished");
    let final_ms = at.saturating_duration_since(cancelled).as_secs_f64() * 1e3;

    for (i, _) in streams.iter().enumerate() {
        engine.cancel("decode", &format!("d{i}"));
    }
    for s in streams {
        let _ = s.thread.join();
    }
    for (_, s) in longs {
        let _ = s.thread.join();
    }
    let _ = victim.thread.join();
    drop(engine);

    let report = LongPromptsReport {
        streams: args.streams,
        stream_prompt_tokens: args.prompt_tokens,
        long_prompts: args.long_prompts.clone(),
        itl_setting: match setting {
            crate::server::config::ItlSetting::Auto => "auto".into(),
            crate::server::config::ItlSetting::Off => "off".into(),
            crate::server::config::ItlSetting::Ms(ms) => format!("{ms} ms"),
        },
        itl_target_ms: target,
        itl_target_ms_range: (!targets.is_empty())
            .then(|| (targets[0], targets[targets.len() - 1])),
        decode_only_itl_p50_ms: pct(&alone, 0.5),
        decode_only_itl_p99_ms: pct(&alone, 0.99),
        join_itl_samples: join.len(),
        join_itl_p50_ms: pct(&join, 0.5),
        join_itl_p99_ms: pct(&join, 0.99),
        join_itl_max_ms: join.last().copied().unwrap_or(0.0),
        p99_over_target: target.map(|t| pct(&join, 0.99) / t),
        p99_gap_over_its_target: (!ratios.is_empty()).then(|| pct(&ratios, 0.99)),
        samples_over_1_5x_target: target.map(|t| join.iter().filter(|&&g| g > 1.5 * t).count()),
        long_ttft_ms,
        cancel_prompt: args.cancel_prompt,
        cancel_blocks_held: held,
        cancel_to_final_ms: final_ms,
        cancel_to_stats_ms: stats_ms,
        cancel_reason: format!("{reason:?}"),
        openblas: crate::blas::active(),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(report)
}
