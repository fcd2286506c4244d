//! Checks compiled decode steps (on the GPU: the fused decode kernels,
//! `weft_models::decode_kernels`) against op-by-op steps of the same model,
//! both measured against an f32 op-by-op reference: three runners over three
//! loads of one model directory (compiled and op-by-op in the device's dtype,
//! the reference in f32), the same ragged prompts, then greedy decode in
//! lockstep, every runner fed the reference's picks. Per step it prints each
//! side's largest logit error against the reference (absolute, and relative
//! to the step's largest logit) and how many rows' picks differ from the
//! reference's. It exits non-zero when the compiled side is less accurate
//! than the op-by-op side by more than `SLACK` (default 1.5x its worst
//! relative error, plus 0.002) or flips more picks than `SLACK` times the
//! op-by-op side's flips plus 1% of picks: rounding may differ (bf16 has 8
//! bits of mantissa, the fused kernels round where MLX does but reduce in
//! their own order), accuracy may not drop.
//!
//! `cargo run --release -p weft-models --example fused_decode_check -- <model dir> [rows] [prompt] [steps]`
//! (`WEFT_FUSED=off` checks compiled steps without the fused kernels.)
use weft_kv_pool::{KvPool, OwnerId, Salt, SeqId, SeqSpec};
use weft_models::{load, BatchRunner, KvMemory, LoadOptions, RowBlocks, RowStep};

struct Side {
    runner: BatchRunner,
    pool: KvPool,
    seqs: Vec<SeqId>,
}

impl Side {
    fn new(
        dir: &std::path::Path,
        rows: usize,
        blocks: u32,
        compiled: bool,
        dtype: Option<mlx_rs::Dtype>,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        // The compiled step traces MLX linears (no packed host GEMM on the CPU).
        let opts = LoadOptions {
            host_gemm: Some(false),
            dtype,
            ..LoadOptions::default()
        };
        let m = load(dir, opts)?.model;
        let mut runner = BatchRunner::with_memory(m, 16, KvMemory::Blocks(blocks))?;
        runner.set_compiled_decode(compiled)?;
        let mut pool = KvPool::new(runner.kv_groups().clone().hash_key(1))?;
        let seqs = (0..rows)
            .map(|_| pool.allocate(SeqSpec::new(OwnerId(0)).salted(Salt(1))))
            .collect::<Result<_, _>>()?;
        Ok(Self { runner, pool, seqs })
    }

    /// One step of `tokens[r]` per row; the logits of each row's last token.
    fn step(
        &mut self,
        tokens: &[Vec<u32>],
    ) -> Result<(Vec<f32>, usize), Box<dyn std::error::Error>> {
        self.pool.begin()?;
        let mut steps = Vec::with_capacity(tokens.len());
        for (r, (t, &q)) in tokens.iter().zip(&self.seqs).enumerate() {
            let start = self.pool.sequence(q)?.len;
            self.pool.append_tokens(q, t)?;
            let mut b = RowBlocks::default();
            b.copy_from(&self.pool.table(q, 0)?);
            steps.push(RowStep {
                row: r as u64,
                tokens: t.clone(),
                start_pos: start,
                want_logits: true,
                blocks: vec![b],
                ..Default::default()
            });
        }
        let ops = self.pool.step_ops().to_vec();
        let l = self.runner.forward(&ops, &steps)?;
        self.runner.commit()?;
        self.pool.commit()?;
        Ok((l.data, l.vocab))
    }
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// Largest absolute and relative (to the reference's largest logit) error
/// of `x` against `y`, and whether the picks differ.
fn error(x: &[f32], y: &[f32]) -> (f32, f32, bool) {
    let top = y.iter().fold(0f32, |m, &t| m.max(t.abs())).max(1e-6);
    let d = x.iter().zip(y).fold(0f32, |m, (p, q)| {
        let e = (p - q).abs();
        if e.is_nan() {
            f32::NAN
        } else {
            m.max(e)
        }
    });
    (d, d / top, argmax(x) != argmax(y))
}

#[derive(Default)]
struct Tally {
    worst: f32,
    flips: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1)
            .ok_or("usage: fused_decode_check <model dir> [rows] [prompt] [steps]")?,
    );
    let rows: usize = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let prompt: usize = args.get(3).map_or(Ok(40), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(24), |s| s.parse())?;
    let slack: f32 = std::env::var("SLACK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.5);
    let blocks = (rows * ((prompt + 8 + steps).div_ceil(16) + 1) + 16) as u32;
    let mut sides = [
        Side::new(&dir, rows, blocks, true, None)?,
        Side::new(&dir, rows, blocks, false, None)?,
        Side::new(&dir, rows, blocks, false, Some(mlx_rs::Dtype::Float32))?,
    ];
    println!(
        "compiled side: dtype {:?}, paged kernel {}, compiled decode {}",
        sides[0].runner.model().dtype(),
        sides[0].runner.kv().uses_kernel(),
        sides[0].runner.compiled_decode().is_some()
    );
    // Ragged prompts: rows at different positions and table widths.
    let mut next: Vec<Vec<u32>> = (0..rows)
        .map(|r| {
            (0..prompt + r % 5)
                .map(|i| (100 + ((r * 31 + i) * 7919) % 30000) as u32)
                .collect()
        })
        .collect();
    let mut tally = [Tally::default(), Tally::default()];
    let mut picks = 0usize;
    for s in 0..=steps {
        let mut out = Vec::with_capacity(3);
        for side in sides.iter_mut() {
            out.push(side.step(&next)?);
        }
        let v = out[2].1;
        let reference = &out[2].0;
        let mut line = format!(
            "step {s:3} ({}):",
            if s == 0 { "prefill" } else { "decode" }
        );
        for (k, name) in ["compiled", "op-by-op"].iter().enumerate() {
            let (mut abs, mut rel, mut flips) = (0f32, 0f32, 0usize);
            for r in 0..rows {
                let span = r * v..(r + 1) * v;
                let (a, e, f) = error(&out[k].0[span.clone()], &reference[span]);
                if !a.is_finite() {
                    return Err(format!("step {s} row {r}: {name} logits not finite").into());
                }
                abs = abs.max(a);
                rel = rel.max(e);
                flips += f as usize;
            }
            if s > 0 {
                tally[k].worst = tally[k].worst.max(rel);
                tally[k].flips += flips;
            }
            line += &format!(" {name} max err {abs:.4} ({rel:.4}), flips {flips}/{rows};");
        }
        if s > 0 {
            picks += rows;
        }
        println!("{line}");
        next = (0..rows)
            .map(|r| vec![argmax(&reference[r * v..(r + 1) * v]) as u32])
            .collect();
    }
    if let Some(c) = sides[0].runner.compiled_decode() {
        println!(
            "compiled traces {} over buckets {:?}",
            c.traces(),
            c.buckets()
        );
    }
    let [c, o] = &tally;
    println!(
        "decode steps vs the f32 reference: compiled worst relative error {:.4}, picks differing {}/{picks}; op-by-op {:.4}, {}/{picks}",
        c.worst, c.flips, o.worst, o.flips
    );
    let err_ok = c.worst <= slack * o.worst + 0.002;
    let flips_ok = c.flips as f32 <= slack * o.flips as f32 + 0.01 * picks as f32;
    if !(err_ok && flips_ok) {
        return Err("compiled decode steps are less accurate than op-by-op steps".into());
    }
    println!("ok");
    Ok(())
}
