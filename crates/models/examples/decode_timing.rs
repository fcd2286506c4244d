//! Times batched decode steps of a model directory through `BatchRunner` and
//! a kv-pool `KvPool` (the scheduler's half, played here):
//! `cargo run --release -p weft-models --example decode_timing -- <model dir> [batch] [prompt] [steps]`
//!
//! Environment: `HOST_GEMM=0|1` picks MLX matmuls or the packed CPU GEMM;
//! `DEQUANTIZE=0` keeps quantized weights quantized; `TWO_LANES=1` lets the
//! prefill split over two CPU lanes; `DECODE_T=k` times verify steps of k
//! tokens per row; `LEAVE=n` makes n rows finish after every decode step (the
//! step cost while rows leave the batch); `RAGGED=1` gives rows prompts of
//! `prompt + row % 8` tokens; `SAMPLE=host` copies the logits to the host
//! instead of picking greedy tokens on the device (the default);
//! `PIPELINE=1` queues each decode step on the previous one's picks before
//! reading them (the engine's pipelined loop: `submit_sampled`/`collect`, the
//! pool's `begin_next`). Each step's graph build and evaluation wait are
//! reported apart. `CENSUS=1` prints the primitives of the second decode
//! step's graph (one dispatch each); `DTYPE=bf16|f16|f32` overrides the
//! device's default dtype; `ADAPTERS=n` (`ADAPTER_RANK=r`, default 16) gives
//! the runner a pool of n random LoRA adapters on all seven projections and
//! spreads the rows over them round-robin (the step cost of mixed adapters).
//! `CHUNK=n` (with `DEPTH=d`, default 4096) adds a prompt of d tokens,
//! prefilled first in 512-token chunks, whose next n tokens join every timed
//! step beside the decoding rows (the mixed step of a long prompt joining
//! them; not with `PIPELINE=1`): the step's time, and of it the wait for the
//! chunk's forward that the step evaluates before building the decoding rows'.
//! `FRESH=1` (with `CHUNK=n`) makes each timed step's chunk a new request's
//! whole prompt instead (a fresh sequence of n tokens, released after the
//! step): the step a server runs when a short request joins a running batch.
//! `PROFILE=n` (with `PIPELINE=1`) samples the process's CPU time over the
//! steady steps (asked at 1999 Hz; the kernel's timer gives ~250 on the
//! device machines) and prints the n functions most often on the stack
//! (inclusive) and at its top (self): where the host's step goes on a
//! machine without perf; `PROFILE_OUT=file` writes every sampled stack there
//! too (folded: `thread;outer;...;inner count` a line, flamegraph's input).
use std::time::Instant;

use weft_kv_pool::{KvPool, OwnerId, Salt, SeqId, SeqSpec};
use weft_models::{
    load, write_random_mlx_lm, AdapterFiles, AdapterId, AdapterPoolConfig, BatchRunner, KvMemory,
    Lanes, LoadOptions, RandomAdapter, RowBlocks, RowStep, SampleRow, Target,
};

fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn plan(pool: &mut KvPool, seqs: &[SeqId], steps: &mut [RowStep]) -> Vec<weft_models::StorageOp> {
    pool.begin().expect("begin");
    for (s, &q) in steps.iter_mut().zip(seqs) {
        pool.append_tokens(q, &s.tokens)
            .expect("KV pool large enough");
        let mut b = RowBlocks::default();
        b.copy_from(&pool.table(q, 0).expect("live"));
        s.blocks = vec![b];
    }
    pool.step_ops().to_vec()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1)
            .ok_or("usage: decode_timing <model dir> [batch] [prompt] [steps]")?,
    );
    let b: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let p: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(10), |s| s.parse())?;
    let dt = env_num("DECODE_T", 1);
    let leave = env_num("LEAVE", 0);
    let ragged = std::env::var_os("RAGGED").is_some();
    let m = load(
        &dir,
        LoadOptions {
            host_gemm: std::env::var("HOST_GEMM").ok().map(|v| v != "0"),
            dequantize: std::env::var("DEQUANTIZE").ok().map(|v| v != "0"),
            dtype: match std::env::var("DTYPE").as_deref() {
                Ok("bf16") => Some(mlx_rs::Dtype::Bfloat16),
                Ok("f16") => Some(mlx_rs::Dtype::Float16),
                Ok("f32") => Some(mlx_rs::Dtype::Float32),
                _ => None,
            },
            ..LoadOptions::default()
        },
    )?
    .model;
    let config = m.config.clone();
    // CHUNK mode: a long prompt's row of DEPTH tokens, CHUNK more each step.
    let chunk = env_num("CHUNK", 0);
    let depth = env_num("DEPTH", 4096);
    let fresh = std::env::var("FRESH").is_ok_and(|v| v == "1");
    let per_row = (p + 8 + (steps + 1) * dt).div_ceil(16) + 1;
    // POOL_BLOCKS: a larger pool than the rows need (a step's cost must not grow with it).
    let long_blocks = match chunk {
        0 => 0,
        c => (depth + (steps + 1) * c).div_ceil(16) + 1,
    };
    let blocks = env_num("POOL_BLOCKS", b * per_row + long_blocks + 16);
    let mut runner = BatchRunner::with_memory(m, 16, KvMemory::Blocks(blocks as u32))?;
    if std::env::var_os("TWO_LANES").is_some() {
        runner.set_lanes(Lanes::cpu(2));
    }
    println!(
        "KV: {} blocks, {:.1} MiB, paged decode kernel: {}",
        runner.kv_groups().groups[0].num_blocks,
        runner.kv().bytes() as f64 / (1 << 20) as f64,
        runner.kv().uses_kernel()
    );
    // Random adapters, written to a temporary directory and loaded now.
    let n_adapters = env_num("ADAPTERS", 0);
    let adapter_of = |r: usize| (n_adapters > 0).then(|| AdapterId(1 + (r % n_adapters) as u64));
    if n_adapters > 0 {
        let rank = env_num("ADAPTER_RANK", 16);
        let tmp = tempfile::tempdir()?;
        runner.set_adapter_pool(Some(AdapterPoolConfig::new(n_adapters, rank)))?;
        for i in 0..n_adapters {
            let dir = tmp.path().join(format!("adapter-{i}"));
            let spec = RandomAdapter {
                rank,
                targets: Target::ALL.to_vec(),
                scale: 2.0,
                seed: i as u64 + 1,
                bf16: true,
            };
            write_random_mlx_lm(&dir, &config, &spec)?;
            runner.register_adapter(AdapterId(1 + i as u64), AdapterFiles::read(&dir)?)?;
        }
        let ids: Vec<AdapterId> = (1..=n_adapters as u64).map(AdapterId).collect();
        runner.preload_adapters(&ids)?;
        println!("{n_adapters} random adapters of rank {rank}, rows round-robin");
    }
    let mut pool = KvPool::new(runner.kv_groups().clone().hash_key(1))?;
    let seqs: Vec<SeqId> = (0..b)
        .map(|_| pool.allocate(SeqSpec::new(OwnerId(0)).salted(Salt(1))))
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<RowStep> = (0..b)
        .map(|r| {
            let n = if ragged { p + r % 8 } else { p };
            RowStep {
                row: r as u64,
                tokens: (0..n)
                    .map(|i| (100 + ((r * 31 + i) * 7919) % 40000) as u32)
                    .collect(),
                start_pos: 0,
                want_logits: true,
                adapter: adapter_of(r),
                ..Default::default()
            }
        })
        .collect();
    let t0 = Instant::now();
    let ops = plan(&mut pool, &seqs, &mut rows);
    runner.forward(&ops, &rows)?;
    runner.commit()?;
    pool.commit()?;
    println!(
        "prefill B={b} T={p}: {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let host_sampling = std::env::var("SAMPLE").is_ok_and(|v| v == "host");
    let census = std::env::var("CENSUS").is_ok_and(|v| v == "1");
    if std::env::var("PIPELINE").is_ok_and(|v| v == "1") {
        return pipelined(&mut runner, &mut pool, &seqs, steps, census, &adapter_of);
    }
    // A long prompt's row (row id `b`), prefilled to DEPTH, whose next CHUNK
    // tokens join each timed step.
    let long = if chunk > 0 {
        let q = pool.allocate(SeqSpec::new(OwnerId(0)).salted(Salt(2)))?;
        let t = Instant::now();
        let mut at = 0;
        while at < depth {
            let n = (depth - at).min(512);
            let mut one = vec![RowStep {
                row: b as u64,
                tokens: (at..at + n)
                    .map(|i| (300 + (i * 7) % 30000) as u32)
                    .collect(),
                start_pos: at,
                want_logits: true,
                ..Default::default()
            }];
            let ops = plan(&mut pool, &[q], &mut one);
            runner.forward(&ops, &one)?;
            runner.commit()?;
            pool.commit()?;
            at += n;
        }
        // Every bucket the chunks will meet traced now, as `weft serve` does at
        // startup (the chunk's table widens as it goes).
        let t1 = Instant::now();
        let traced = runner.warm_decode(b, depth + (steps + 1) * chunk)?
            + runner.warm_prefill(depth + (steps + 1) * chunk)?
            + runner.warm_mixed(b, depth + (steps + 1) * chunk)?;
        println!(
            "long prompt: {depth} tokens prefilled in {:.1} ms; {traced} decode, prefill and mixed buckets traced in {:.1} ms; {chunk} more join each step",
            (t1 - t).as_secs_f64() * 1e3,
            t1.elapsed().as_secs_f64() * 1e3
        );
        Some(q)
    } else {
        None
    };
    let mut chunk_wait = vec![];
    let mut live: Vec<usize> = (0..b).collect();
    let mut times = vec![];
    let (mut build, mut encode, mut eval) = (vec![], vec![], vec![]);
    for step in 0..steps {
        if live.is_empty() {
            break;
        }
        let mut batch: Vec<RowStep> = live
            .iter()
            .map(|&r| {
                let start = pool.sequence(seqs[r]).map(|s| s.len).unwrap_or(0);
                RowStep {
                    row: r as u64,
                    tokens: (0..dt).map(|i| (200 + r + i + step) as u32).collect(),
                    start_pos: start,
                    want_logits: true,
                    draft: dt - 1,
                    adapter: adapter_of(r),
                    ..Default::default()
                }
            })
            .collect();
        let mut q: Vec<SeqId> = live.iter().map(|&r| seqs[r]).collect();
        // FRESH: the chunk is a new sequence's whole prompt, released after the step.
        let fresh_q = if long.is_some() && fresh {
            Some(pool.allocate(SeqSpec::new(OwnerId(0)).salted(Salt(3 + step as u64)))?)
        } else {
            None
        };
        if let Some(lq) = fresh_q.or(long) {
            let start = pool.sequence(lq).map(|s| s.len).unwrap_or(0);
            batch.push(RowStep {
                row: b as u64,
                tokens: (0..chunk)
                    .map(|i| (400 + (i * 13 + step) % 30000) as u32)
                    .collect(),
                start_pos: start,
                want_logits: false,
                ..Default::default()
            });
            q.push(lq);
        }
        if census && step == 1 {
            runner.census_next_step();
        }
        let t = Instant::now();
        let ops = plan(&mut pool, &q, &mut batch);
        if host_sampling {
            runner.forward(&ops, &batch)?;
        } else {
            let greedy: Vec<SampleRow> = batch
                .iter()
                .filter(|s| s.want_logits)
                .map(|_| SampleRow {
                    uniforms: vec![0.0; dt],
                    ..Default::default()
                })
                .collect();
            runner.forward_sampled(&ops, &batch, &greedy)?;
        }
        runner.commit()?;
        pool.commit()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if let Some(fq) = fresh_q {
            pool.release(fq)?;
        }
        print_census(&mut runner);
        build.push(runner.last_timing().build.as_secs_f64() * 1e3);
        encode.push(runner.last_timing().encode.as_secs_f64() * 1e3);
        eval.push(runner.last_timing().eval.as_secs_f64() * 1e3);
        chunk_wait.push(runner.last_submit_blocked().as_secs_f64() * 1e3);
        for _ in 0..leave.min(live.len()) {
            if let Some(r) = live.pop() {
                pool.release(seqs[r])?;
            }
        }
    }
    let n = times.len();
    let rows_done: usize = (0..n).map(|i| b.saturating_sub(i * leave)).sum();
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "decode B={b}{}: median {:.2} ms/step, p90 {:.2} ms ({:.1} tok/s over {n} steps)",
        if leave > 0 {
            format!(" (-{leave} rows/step)")
        } else {
            String::new()
        },
        times[n / 2],
        times[(n * 9 / 10).min(n - 1)],
        rows_done as f64 * dt as f64 * 1e3 / times.iter().sum::<f64>()
    );
    for v in [&mut build, &mut encode, &mut eval, &mut chunk_wait] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    println!(
        "  graph build median {:.2} ms, MLX encode median {:.2} ms, evaluation wait median {:.2} ms ({} sampling)",
        build[n / 2],
        encode[n / 2],
        eval[n / 2],
        if host_sampling { "host" } else { "device" }
    );
    if let Some(lq) = long {
        println!(
            "  with a {chunk}-token chunk each step (context now {}): of the build, the wait for the chunk's forward median {:.2} ms; the last step ran it as {} decoding rows",
            pool.sequence(lq).map(|s| s.len).unwrap_or(0),
            chunk_wait[n / 2],
            runner.last_short_chunk_rows()
        );
    }
    Ok(())
}

/// Steady greedy decode of every row, each step submitted on the previous
/// step's picks before those are read.
fn pipelined(
    runner: &mut BatchRunner,
    pool: &mut KvPool,
    seqs: &[SeqId],
    steps: usize,
    census: bool,
    adapter_of: &dyn Fn(usize) -> Option<AdapterId>,
) -> Result<(), Box<dyn std::error::Error>> {
    let b = seqs.len();
    let greedy: Vec<SampleRow> = (0..b).map(|_| SampleRow::default()).collect();
    let submit = |runner: &mut BatchRunner, pool: &mut KvPool, follows: bool| {
        if follows {
            pool.begin_next()?;
        } else {
            pool.begin()?;
        }
        let mut batch: Vec<RowStep> = Vec::with_capacity(b);
        for (r, &q) in seqs.iter().enumerate() {
            let start = pool.sequence(q)?.len;
            pool.append_tokens(q, &[0])?;
            let mut blocks = RowBlocks::default();
            blocks.copy_from(&pool.table(q, 0)?);
            batch.push(RowStep {
                row: r as u64,
                tokens: vec![(200 + r) as u32],
                start_pos: start,
                want_logits: true,
                blocks: vec![blocks],
                adapter: adapter_of(r),
                ..Default::default()
            });
        }
        let ops = pool.step_ops().to_vec();
        let f = vec![follows; b];
        runner.submit_sampled(&ops, &batch, &greedy, &f)?;
        Ok::<Vec<usize>, Box<dyn std::error::Error>>(batch.iter().map(|s| s.start_pos).collect())
    };
    submit(runner, pool, false)?;
    let mut times = vec![];
    let (mut build, mut encode, mut eval) = (vec![], vec![], vec![]);
    let profile = env_num("PROFILE", 0);
    let guard = match profile {
        0 => None,
        _ => Some(
            pprof::ProfilerGuardBuilder::default()
                .frequency(1999)
                .build()?,
        ),
    };
    let mut last = Instant::now();
    for step in 0..steps {
        if census && step == 1 {
            runner.census_next_step();
        }
        let next = submit(runner, pool, true)?;
        print_census(runner);
        let picks = runner.collect()?;
        runner.commit()?;
        pool.commit()?;
        for ((&q, &t), &at) in seqs.iter().zip(&picks.picked.tokens).zip(&next) {
            pool.set_tokens(q, at, &[t])?;
        }
        let now = Instant::now();
        times.push((now - last).as_secs_f64() * 1e3);
        last = now;
        build.push(runner.last_timing().build.as_secs_f64() * 1e3);
        encode.push(runner.last_timing().encode.as_secs_f64() * 1e3);
        eval.push(runner.last_timing().eval.as_secs_f64() * 1e3);
    }
    if let Some(g) = guard {
        print_profile(&g.report().build()?, profile);
    }
    runner.collect()?;
    runner.commit()?;
    pool.commit()?;
    let n = times.len();
    let total: f64 = times.iter().sum();
    for v in [&mut times, &mut build, &mut encode, &mut eval] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    println!(
        "decode B={b} pipelined: median {:.2} ms/step, p90 {:.2} ms ({:.1} tok/s over {n} steps)",
        times[n / 2],
        times[(n * 9 / 10).min(n - 1)],
        (b * n) as f64 * 1e3 / total
    );
    println!(
        "  graph build median {:.2} ms (overlapped; of it MLX encode {:.2} ms), wait for picks median {:.2} ms",
        build[n / 2],
        encode[n / 2],
        eval[n / 2]
    );
    Ok(())
}

/// Prints the samples of each thread, then the `n` functions most often on
/// the main thread's sampled stacks (each counted once a sample) and most
/// often at their top.
fn print_profile(report: &pprof::Report, n: usize) {
    use std::collections::{HashMap, HashSet};
    let (mut inclusive, mut own) = (HashMap::<String, isize>::new(), HashMap::new());
    let mut threads = HashMap::<String, isize>::new();
    // SAFETY: pthread_self has no preconditions; the profiler keys its
    // samples by the same value.
    let main = unsafe { libc::pthread_self() } as u64;
    let mut total = 0;
    let mut folded = String::new();
    for (frames, &count) in &report.data {
        *threads.entry(frames.thread_name_or_id()).or_insert(0) += count;
        // Innermost first.
        let names: Vec<String> = frames
            .frames
            .iter()
            .flat_map(|f| f.iter().map(|s| s.name()))
            .collect();
        let is_main = frames.thread_id == main;
        let outer_first: Vec<String> = names.iter().rev().map(|n| n.replace(';', ",")).collect();
        let mark = if is_main { "main" } else { "other" };
        folded.push_str(&format!("{mark};{} {count}\n", outer_first.join(";")));
        if !is_main {
            continue;
        }
        total += count;
        if let Some(top) = names.first() {
            *own.entry(top.clone()).or_insert(0) += count;
        }
        for name in names.into_iter().collect::<HashSet<_>>() {
            *inclusive.entry(name).or_insert(0) += count;
        }
    }
    if let Ok(path) = std::env::var("PROFILE_OUT") {
        if let Err(e) = std::fs::write(&path, folded) {
            eprintln!("PROFILE_OUT {path}: {e}");
        }
    }
    let mut t: Vec<_> = threads.into_iter().collect();
    t.sort_by_key(|e| std::cmp::Reverse(e.1));
    let t: Vec<String> = t.iter().map(|(n, c)| format!("{n} {c}")).collect();
    println!("  profile samples by thread: {}", t.join(", "));
    for (title, map) in [
        ("main thread, inclusive", inclusive),
        ("main thread, self", own),
    ] {
        let mut v: Vec<_> = map.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        println!("  profile ({title}, {total} samples):");
        for (name, c) in v.into_iter().take(n) {
            let short: String = name.chars().take(150).collect();
            println!(
                "    {:5.1}% {short}",
                100.0 * c as f64 / total.max(1) as f64
            );
        }
    }
}

/// Prints the census a step recorded, if one did: primitives by count.
fn print_census(runner: &mut BatchRunner) {
    if let Some(c) = runner.take_census() {
        let mut v: Vec<_> = c.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: usize = v.iter().map(|e| e.1).sum();
        let list: Vec<String> = v.iter().map(|(n, c)| format!("{n} {c}")).collect();
        println!("  graph: {total} primitives: {}", list.join(", "));
    }
}
