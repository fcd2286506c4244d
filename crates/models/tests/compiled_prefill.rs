//! Compiled prefill against the op-by-op forward with a real model (mlx-lm's
//! fixture, f32 on MLX's CPU backend): ragged prompts padded into a bucket
//! give the op-by-op logits within a stated tolerance, and the K/V they
//! write is what the op-by-op step writes (the decode steps after them agree
//! too, so padding tokens wrote nothing a row reads); a prompt joining
//! decoding rows runs compiled beside them, and so does its later chunk over
//! the context already in the pool; a fault inside a compiled prefill rolls
//! the step back; every bucket traces once.

mod common;

use common::*;
use weft_models::runner::MixedSteps;
use weft_models::{AffineQuant, BatchRunner, KvMemory, RowStep};

/// f32 logits of the compiled and op-by-op forwards agree this closely
/// (different op order; measured ~1e-6).
const TOLERANCE: f32 = 1e-4;

const PROMPTS: [&[u32]; 3] = [
    &[1, 2, 3, 4, 5, 6, 7],
    &[42],
    &[9, 9, 9, 3, 200, 17, 5, 5, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
];

struct Rows {
    runner: BatchRunner,
    kv: Kv,
    /// (next token, committed length) per decoding row.
    at: Vec<(u32, usize)>,
}

impl Rows {
    fn new(runner: BatchRunner) -> Self {
        let kv = Kv::for_runner(&runner);
        Self {
            runner,
            kv,
            at: Vec::new(),
        }
    }

    /// One step of the decoding rows and `prompts` (row id, tokens, start),
    /// committed; the prompts decode from the next step. Its logits.
    fn step(&mut self, prompts: &[(u64, &[u32], usize)]) -> Vec<f32> {
        let mut steps = self.steps(prompts);
        let l = step(&mut self.runner, &mut self.kv, &mut steps);
        let v = l.vocab;
        self.at = steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (
                    argmax(&l.data[i * v..(i + 1) * v]),
                    s.start_pos + s.tokens.len(),
                )
            })
            .collect();
        l.data
    }

    fn steps(&self, prompts: &[(u64, &[u32], usize)]) -> Vec<RowStep> {
        let mut steps: Vec<RowStep> = self
            .at
            .iter()
            .enumerate()
            .map(|(i, &(t, pos))| RowStep {
                row: i as u64,
                tokens: vec![t],
                start_pos: pos,
                want_logits: true,
                ..Default::default()
            })
            .collect();
        steps.extend(prompts.iter().map(|&(row, tokens, start)| RowStep {
            row,
            tokens: tokens.to_vec(),
            start_pos: start,
            want_logits: true,
            ..Default::default()
        }));
        steps
    }
}

fn compiled(runner: BatchRunner) -> BatchRunner {
    let mut r = runner;
    r.set_compiled_prefill(true).unwrap();
    r
}

/// `steps` greedy decode steps of every row on both runners: the same logits
/// within the tolerance and the same picks at each.
fn decode_both(plain: &mut Rows, comp: &mut Rows, steps: usize, when: &str) {
    for s in 0..steps {
        agree(
            &plain.step(&[]),
            &comp.step(&[]),
            &format!("decode step {s} {when}"),
        );
        assert_eq!(plain.at, comp.at, "decode step {s} {when}: greedy picks");
    }
}

/// `WEFT_TEST_TOLERANCE` overrides [`TOLERANCE`] (a GPU run: other kernels,
/// other rounding), and prints each comparison.
fn agree(want: &[f32], got: &[f32], what: &str) {
    let d = max_abs_diff(want, got);
    let tolerance = match std::env::var("WEFT_TEST_TOLERANCE") {
        Ok(t) => {
            let t = t.parse().expect("WEFT_TEST_TOLERANCE is a number");
            println!("{what}: max |logit diff| {d}");
            t
        }
        Err(_) => TOLERANCE,
    };
    assert!(d <= tolerance, "{what}: max |logit diff| {d}");
}

#[test]
fn compiled_prefill_matches_the_op_by_op_forward_and_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    matches_op_by_op(
        runner(load_f32(&md, false), 64),
        compiled(runner(load_f32(&md, false), 64)),
    );
}

/// The same over K/V stored quantized (8 and 4 bits): the trace quantizes
/// the prompts' K/V as the storage's write does, and attends them as stored.
#[test]
fn compiled_prefill_over_quantized_kv_matches() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "llama-wide");
    let quantized = |q| {
        BatchRunner::with_memory_use(
            load_f32(&md, false),
            16,
            KvMemory::Blocks(64),
            None,
            Some(q),
        )
        .unwrap()
    };
    for q in [AffineQuant::new(8, 64), AffineQuant::new(4, 32)] {
        matches_op_by_op(quantized(q), compiled(quantized(q)));
    }
}

fn matches_op_by_op(plain: BatchRunner, comp: BatchRunner) {
    let mut plain = Rows::new(plain);
    let mut comp = Rows::new(comp);
    let prompts: Vec<(u64, &[u32], usize)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64, *p, 0))
        .collect();
    // A fault at layer 1 of the compiled prefill: the step rolls back and
    // the redone step is unharmed.
    let mut fired = false;
    comp.runner.set_layer_hook(Some(Box::new(move |layer| {
        if layer == 1 && !fired {
            fired = true;
            return Err(weft_models::ModelError::Invalid("injected".into()));
        }
        Ok(())
    })));
    let mut steps = comp.steps(&prompts);
    let ops = comp.kv.plan(&mut steps);
    assert!(comp.runner.forward(&ops, &steps).is_err());
    comp.runner.rollback();
    comp.kv.rollback();
    comp.runner.set_layer_hook(None);
    agree(&plain.step(&prompts), &comp.step(&prompts), "prefill");
    assert_eq!(plain.at, comp.at, "first tokens");
    let c = comp.runner.compiled_prefill().unwrap();
    // Prompts of 7, 1 and 18 tokens: 18 pads to 32, 7 and 1 to 16, so
    // buckets of 1 row x 32 tokens and 2 x 16, each traced once (the failed
    // step traced them; the redone one replayed them).
    assert_eq!(
        c.buckets().iter().copied().collect::<Vec<_>>(),
        [(1, 32, 0), (2, 16, 0)]
    );
    assert_eq!(c.traces(), 2);
    decode_both(&mut plain, &mut comp, 4, "");
    prompts_beside_decoding_rows(&mut plain, &mut comp, false);
    submit_blocks_only_for_its_own_forwards(&mut comp);
    let c = comp.runner.compiled_prefill().unwrap();
    assert_eq!(
        c.buckets().iter().copied().collect::<Vec<_>>(),
        [(1, 16, 0), (1, 16, 8), (1, 32, 0), (2, 16, 0), (2, 32, 8)],
        "the 24-token prompt replays 1 x 32, its second chunk is one row of 16 over 8 \
         blocks; the two prompts' first chunks (20 and 9 tokens) pad to 32 and 16, apart; \
         their second chunks (18 and 17) share 2 x 32 over 8 blocks"
    );
    assert_eq!(c.traces(), 5);
}

/// The step of the decoding rows and `prompts` on `r`, failing at layer 1 (an
/// injected fault), rolled back: `r` is as it was.
fn fails_at_layer_1_and_rolls_back(r: &mut Rows, prompts: &[(u64, &[u32], usize)]) {
    let mut fired = false;
    r.runner.set_layer_hook(Some(Box::new(move |layer| {
        if layer == 1 && !fired {
            fired = true;
            return Err(weft_models::ModelError::Invalid("injected".into()));
        }
        Ok(())
    })));
    let mut steps = r.steps(prompts);
    let ops = r.kv.plan(&mut steps);
    assert!(r.runner.forward(&ops, &steps).is_err());
    r.runner.rollback();
    r.kv.rollback();
    r.runner.set_layer_hook(None);
}

/// A fresh prompt joins the decoding rows, then the rest of it at position 24
/// (a deep chunk: RoPE from 24, the row's table gathered, its first 24 tokens
/// in context); then two prompts whose second chunks start at different depths
/// share one forward (each row's own RoPE offset and causal edge). Both
/// runners agree at every step; with `fault`, the compiled side's first try
/// of the fresh prompt's step fails at layer 1 and is rolled back first.
fn prompts_beside_decoding_rows(plain: &mut Rows, comp: &mut Rows, fault: bool) {
    let late: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 200).collect();
    let fresh = [(3, &late[..24], 0)];
    if fault {
        fails_at_layer_1_and_rolls_back(comp, &fresh);
    }
    agree(
        &plain.step(&fresh),
        &comp.step(&fresh),
        "fresh prompt beside decoding rows",
    );
    assert_eq!(plain.at, comp.at);
    plain.at.pop();
    comp.at.pop();
    let rest = [(3, &late[24..], 24)];
    agree(
        &plain.step(&rest),
        &comp.step(&rest),
        "a prompt's second chunk beside decoding rows",
    );
    assert_eq!(plain.at, comp.at);
    decode_both(plain, comp, 3, "after");
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..38).map(|i| i % 97).collect(), (0..26).collect());
    let first = [(4, &a[..20], 0), (5, &b[..9], 0)];
    agree(&plain.step(&first), &comp.step(&first), "two first chunks");
    for r in [&mut *plain, &mut *comp] {
        r.at.truncate(4);
    }
    let second = [(4, &a[20..], 20), (5, &b[9..], 9)];
    agree(
        &plain.step(&second),
        &comp.step(&second),
        "two chunks at 20 and 9 beside decoding rows",
    );
    assert_eq!(plain.at, comp.at);
    decode_both(plain, comp, 2, "at the end");
}

/// A submitted step of several forwards (a compiled prompt chunk beside
/// decoding rows) evaluates all but its last inside the submit and says how
/// long it waited; a one-forward step (decoding rows alone) waits for nothing.
/// Both rolled back, leaving `r` as it was.
fn submit_blocks_only_for_its_own_forwards(r: &mut Rows) {
    let greedy = |steps: &[RowStep]| vec![weft_models::SampleRow::default(); steps.len()];
    let mut steps = r.steps(&[]);
    let ops = r.kv.plan(&mut steps);
    r.runner
        .submit_sampled(&ops, &steps, &greedy(&steps), &[])
        .unwrap();
    assert_eq!(
        r.runner.last_submit_blocked(),
        std::time::Duration::ZERO,
        "decoding rows alone: one forward, queued"
    );
    r.runner.collect().unwrap();
    r.runner.rollback();
    r.kv.rollback();
    let chunk: Vec<u32> = (0..20).collect();
    let mut steps = r.steps(&[(9, &chunk, 0)]);
    let ops = r.kv.plan(&mut steps);
    r.runner
        .submit_sampled(&ops, &steps, &greedy(&steps), &[])
        .unwrap();
    assert!(
        r.runner.last_submit_blocked() > std::time::Duration::ZERO,
        "a chunk beside decoding rows: its first forward evaluated in the submit"
    );
    r.runner.collect().unwrap();
    r.runner.rollback();
    r.kv.rollback();
}

/// `warm_prefill` traces every bucket once, writing only the null block: the
/// steps after it match the op-by-op forward and trace nothing.
#[test]
fn warmed_prefill_buckets_are_not_traced_while_serving() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut plain = Rows::new(runner(load_f32(&md, false), 64));
    let mut comp = Rows::new(compiled(runner(load_f32(&md, false), 64)));
    let all = weft_models::compiled_prefill::CompiledPrefill::warm_buckets(
        weft_models::runner::COMPILED_MIN_CONTEXT,
        16,
    )
    .len();
    assert_eq!(
        comp.runner
            .warm_prefill(weft_models::runner::COMPILED_MIN_CONTEXT)
            .unwrap(),
        all
    );
    assert_eq!(
        comp.runner
            .warm_prefill(weft_models::runner::COMPILED_MIN_CONTEXT)
            .unwrap(),
        0,
        "warming twice"
    );
    let prompts: Vec<(u64, &[u32], usize)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64, *p, 0))
        .collect();
    agree(&plain.step(&prompts), &comp.step(&prompts), "prefill");
    decode_both(&mut plain, &mut comp, 4, "");
    assert_eq!(
        comp.runner.compiled_prefill().unwrap().traces(),
        all as u64,
        "a warmed bucket traced again"
    );
}

/// The op-by-op runner and one with compiled decode, prefill and mixed steps
/// (`mode`) over the llama fixture (made under `dir`), both past the prefill of
/// [`PROMPTS`] (agreeing).
fn prefilled_mixed(dir: &std::path::Path, mode: MixedSteps) -> (Rows, Rows) {
    let md = dir.join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut plain = Rows::new(runner(load_f32(&md, false), 64));
    let mut r = runner(load_f32(&md, false), 64);
    r.set_compiled_decode(true).unwrap();
    r.set_compiled_prefill(true).unwrap();
    r.set_compiled_mixed(mode).unwrap();
    let mut comp = Rows::new(r);
    let prompts: Vec<(u64, &[u32], usize)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64, *p, 0))
        .collect();
    agree(&plain.step(&prompts), &comp.step(&prompts), "prefill");
    (plain, comp)
}

/// A chunk group beside decoding rows as one compiled forward (every token
/// one row: shared projections, one write per layer, split attention) gives
/// the op-by-op step's logits and K/V: fresh prompts joining, a prompt's
/// later chunk over its context, two chunks at different depths; a fault
/// inside it rolls the step back; each bucket traces once.
#[test]
fn mixed_steps_match_the_op_by_op_forward() {
    let dir = tempfile::tempdir().unwrap();
    let (mut plain, mut comp) = prefilled_mixed(dir.path(), MixedSteps::OnDemand);
    assert!(
        comp.runner.compiled_mixed().unwrap().buckets().is_empty(),
        "no decoding rows yet: no mixed step"
    );
    decode_both(&mut plain, &mut comp, 2, "");
    prompts_beside_decoding_rows(&mut plain, &mut comp, true);
    let m = comp.runner.compiled_mixed().unwrap();
    let shapes: Vec<(usize, usize, usize, usize)> = m
        .buckets()
        .iter()
        .map(|b| (b.decode_rows, b.chunk_rows, b.chunk_tokens, b.chunk_width))
        .collect();
    assert_eq!(
        shapes,
        [(8, 1, 16, 8), (8, 1, 32, 8), (8, 2, 32, 8)],
        "3 decoding rows (padded to 8) beside the 24-token prompt (32 tokens) then its 16-token rest; \
         the two first chunks (20 and 9) are two prefill groups (apart: two forwards \
         beside the rows), their rest (18 and 17) one group of 2 x 32 beside 4 rows (padded to 8)"
    );
    assert_eq!(
        m.traces(),
        m.buckets().len() as u64,
        "a bucket traced twice"
    );
}

/// With mixed steps only for warmed buckets (the GPU's default): before
/// `warm_mixed` a chunk beside decoding rows runs as two forwards and traces
/// no mixed bucket; after it, the same kind of step runs mixed without a
/// trace, and both match the op-by-op forward.
#[test]
fn warmed_mixed_buckets_run_without_tracing() {
    let dir = tempfile::tempdir().unwrap();
    let (mut plain, mut comp) = prefilled_mixed(dir.path(), MixedSteps::Warmed);
    let late: Vec<u32> = (0..60).map(|i| (i * 37 + 11) % 200).collect();
    let first = [(3, &late[..20], 0)];
    agree(
        &plain.step(&first),
        &comp.step(&first),
        "a chunk beside decoding rows, not warmed",
    );
    let m = comp.runner.compiled_mixed().unwrap();
    assert!(
        m.steps() == 0 && m.traces() == 0,
        "an unwarmed bucket ran mixed"
    );
    for r in [&mut plain, &mut comp] {
        r.at.pop();
    }
    let warmed = comp.runner.warm_mixed(8, 64).unwrap();
    // Decode rows padded to 8 (their tables to 64 tokens, 4 blocks); chunk
    // tables up to 64 tokens are the narrowest width (8 blocks, 128 tokens):
    // one chunk of each compiled length that fits it (16, 32, 64, 128).
    assert_eq!(warmed, 4);
    assert_eq!(comp.runner.warm_mixed(8, 64).unwrap(), 0, "warming twice");
    let steps = comp.runner.compiled_mixed().unwrap().steps();
    let rest = [(3, &late[20..40], 20)];
    agree(
        &plain.step(&rest),
        &comp.step(&rest),
        "a warmed chunk beside decoding rows",
    );
    assert!(!comp.runner.last_build_traced(), "the warmed step traced");
    let m = comp.runner.compiled_mixed().unwrap();
    assert_eq!(m.steps(), steps + 1, "the warmed step did not run mixed");
    assert_eq!(m.traces(), warmed as u64, "a warmed bucket traced again");
    assert_eq!(plain.at, comp.at);
    decode_both(&mut plain, &mut comp, 2, "after the warmed mixed step");
    // The short fresh prompts warmed beside wider batches (where decode
    // batches are bucketed, the GPU) are the buckets such steps meet: a
    // prompt of 16 to 128 tokens beside 40 or 64 decoding rows.
    let m = comp.runner.compiled_mixed().unwrap();
    let fresh = m.fresh_buckets([40usize, 64, 64].into_iter(), 128);
    assert_eq!(
        fresh.len(),
        8,
        "two batches x 16, 32, 64, 128 tokens: {fresh:?}"
    );
    for rows in [40, 64] {
        for (len, t) in [(5, 16), (20, 32), (64, 64), (100, 128), (128, 128)] {
            let b = m
                .bucket(
                    std::iter::repeat_n(63, rows),
                    rows,
                    std::iter::once((0, len)),
                )
                .unwrap();
            assert_eq!((b.decode_rows, b.chunk_rows, b.chunk_tokens), (rows, 1, t));
            assert!(fresh.contains(&b), "{b:?} is not among {fresh:?}");
        }
    }
}

/// One step of the decoding rows and `prompts` on both runners: the same
/// logits within the tolerance and the same picks, the compiled side having
/// run `rows` decoding rows for the prompts' chunks (0: a prefill forward).
fn short_step(
    plain: &mut Rows,
    comp: &mut Rows,
    prompts: &[(u64, &[u32], usize)],
    what: &str,
    rows: usize,
) {
    agree(&plain.step(prompts), &comp.step(prompts), what);
    assert_eq!(comp.runner.last_short_chunk_rows(), rows, "{what}");
    assert_eq!(plain.at, comp.at, "{what}: greedy picks");
}

/// Short prompt chunks run as decoding rows of the compiled decode step
/// (each chunk token one row at its position over its chunk's table) and
/// give the op-by-op forward's logits and K/V: prompts alone, a fresh
/// prompt beside decoding rows, a prompt's later chunk over its context;
/// a fault inside such a step rolls it back; a chunk past the limit, or a
/// step whose decode bucket is not traced, runs as a prefill forward.
#[test]
fn short_chunks_run_as_decoding_rows_and_match_the_op_by_op_forward() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut plain = Rows::new(runner(load_f32(&md, false), 64));
    let mut r = runner(load_f32(&md, false), 64);
    r.set_compiled_decode(true).unwrap();
    r.set_short_chunks(32).unwrap();
    // One decoding row's buckets, plus the 32 rows of short chunks beside it.
    let traced = r.warm_decode(1, 64).unwrap();
    assert!(traced >= 33, "{traced} decode buckets traced");
    let traces = r.compiled_decode().unwrap().traces();
    let mut comp = Rows::new(r);
    // Three prompts alone (7 + 1 + 18 tokens): 26 decoding rows.
    let prompts: Vec<(u64, &[u32], usize)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64, *p, 0))
        .collect();
    short_step(
        &mut plain,
        &mut comp,
        &prompts,
        "prompts alone as decoding rows",
        26,
    );
    decode_both(&mut plain, &mut comp, 2, "after prompts as decoding rows");
    // A fresh prompt beside the 3 decoding rows, with a fault at layer 1 on
    // the compiled side's first try.
    let late: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 200).collect();
    let fresh = [(3, &late[..20], 0)];
    fails_at_layer_1_and_rolls_back(&mut comp, &fresh);
    short_step(
        &mut plain,
        &mut comp,
        &fresh,
        "a fresh prompt beside decoding rows, after a rolled-back try",
        20,
    );
    plain.at.pop();
    comp.at.pop();
    // Its rest over its first 20 tokens: RoPE from 20, those in context.
    let rest = [(3, &late[20..30], 20)];
    short_step(
        &mut plain,
        &mut comp,
        &rest,
        "a prompt's later chunk beside decoding rows",
        10,
    );
    decode_both(&mut plain, &mut comp, 3, "after chunks as decoding rows");
    // 4 decoding rows + 30 prompt tokens: a bucket of 34 rows, not traced:
    // a prefill forward beside the rows.
    let long: Vec<u32> = (0..33).map(|i| (i * 13 + 5) % 200).collect();
    let cold = [(4, &long[..30], 0)];
    short_step(&mut plain, &mut comp, &cold, "an untraced bucket", 0);
    // Past the limit (32 tokens): a prefill forward too.
    let big = [(5, &long[..], 0)];
    short_step(&mut plain, &mut comp, &big, "a chunk past the limit", 0);
    decode_both(&mut plain, &mut comp, 2, "at the end");
    assert_eq!(
        comp.runner.compiled_decode().unwrap().traces(),
        traces,
        "short chunks traced a decode bucket"
    );
}
