//! Compiled decode steps against the op-by-op forward with a real model
//! (mlx-lm's fixture, f32 on MLX's CPU backend, where the compiled step's
//! attention gathers each row's blocks): the same logits within a stated
//! tolerance at every step, a fault injected inside a compiled step rolls it
//! back like any other (the redone step gives the same logits), and a batch
//! that keeps its bucket never retraces.
//! (The pipelined form is in `pipelined_runner.rs`.)

mod common;

use common::*;
use weft_models::{AffineQuant, BatchRunner, KvMemory, RowStep};

/// f32 logits of the compiled and op-by-op forwards agree this closely
/// (different op order in attention; measured ~1e-6).
const TOLERANCE: f32 = 1e-4;

const PROMPTS: [&[u32]; 3] = [
    &[1, 2, 3, 4, 5, 6, 7],
    &[42],
    &[9, 9, 9, 3, 200, 17, 5, 5, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
];

struct Rows {
    runner: BatchRunner,
    kv: Kv,
    /// (next token, committed length) per row.
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

    fn prefill(&mut self) -> Vec<f32> {
        let mut steps: Vec<RowStep> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| RowStep {
                row: i as u64,
                tokens: p.to_vec(),
                start_pos: 0,
                want_logits: true,
                ..Default::default()
            })
            .collect();
        let l = step(&mut self.runner, &mut self.kv, &mut steps);
        self.settle(&l, &steps);
        l.data
    }

    fn decode_steps(&self) -> Vec<RowStep> {
        self.at
            .iter()
            .enumerate()
            .map(|(i, &(t, pos))| RowStep {
                row: i as u64,
                tokens: vec![t],
                start_pos: pos,
                want_logits: true,
                ..Default::default()
            })
            .collect()
    }

    fn settle(&mut self, l: &weft_models::StepLogits, steps: &[RowStep]) {
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
    }

    /// One greedy decode step of every row; its logits.
    fn decode(&mut self) -> Vec<f32> {
        let mut steps = self.decode_steps();
        let l = step(&mut self.runner, &mut self.kv, &mut steps);
        self.settle(&l, &steps);
        l.data
    }
}

fn compiled(md: &std::path::Path) -> BatchRunner {
    let mut r = runner(load_f32(md, false), 64);
    r.set_compiled_decode(true).unwrap();
    r
}

/// A runner of 64 blocks whose K/V are stored quantized with `quant`.
fn quantized(md: &std::path::Path, quant: Option<AffineQuant>) -> BatchRunner {
    let m = load_f32(md, false);
    BatchRunner::with_memory_use(m, 16, KvMemory::Blocks(64), None, quant).unwrap()
}

#[test]
fn compiled_decode_logits_match_and_a_fault_inside_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    compiled_matches(runner(load_f32(&md, false), 64), compiled(&md));
}

/// The same over K/V stored quantized (8 and 4 bits): the compiled step
/// quantizes its new tokens and writes the packed values, scales and biases
/// as the storage does, and reads them back dequantized.
#[test]
fn compiled_decode_over_quantized_kv_matches_and_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "llama-wide");
    for q in [AffineQuant::new(8, 64), AffineQuant::new(4, 32)] {
        let mut comp = quantized(&md, Some(q));
        comp.set_compiled_decode(true).unwrap();
        compiled_matches(quantized(&md, Some(q)), comp);
    }
}

/// Prefill, then 16 greedy decode steps of the three rows on `plain`
/// (op by op) and `compiled` (compiled decode), step 5 of the compiled one
/// failing once inside the forward first.
fn compiled_matches(plain: BatchRunner, compiled: BatchRunner) {
    let mut plain = Rows::new(plain);
    let mut comp = Rows::new(compiled);
    assert_eq!(plain.prefill(), comp.prefill(), "prefill is not compiled");
    assert_eq!(comp.runner.compiled_decode().unwrap().traces(), 0);
    const STEPS: usize = 16;
    for s in 0..STEPS {
        let want = plain.decode();
        if s == 5 {
            // A fault after layer 1 of a compiled step: the step fails, its
            // pool transaction rolls back, and the redone step is unharmed.
            let mut fired = false;
            comp.runner.set_layer_hook(Some(Box::new(move |layer| {
                if layer == 1 && !fired {
                    fired = true;
                    return Err(weft_models::ModelError::Invalid("injected".into()));
                }
                Ok(())
            })));
            let mut steps = comp.decode_steps();
            let ops = comp.kv.plan(&mut steps);
            assert!(comp.runner.forward(&ops, &steps).is_err());
            comp.kv.rollback();
            comp.runner.set_layer_hook(None);
        }
        let got = comp.decode();
        let d = max_abs_diff(&want, &got);
        assert!(d <= TOLERANCE, "step {s}: max |logit diff| {d}");
        assert_eq!(plain.at, comp.at, "step {s}: greedy picks");
    }
    let c = comp.runner.compiled_decode().unwrap();
    // Three rows throughout; tables of 2 blocks of 16 (the longest row at
    // 18..32 tokens), then 4 (33 tokens need 3): each bucket traced once.
    assert_eq!(c.traces(), c.buckets().len() as u64, "{:?}", c.buckets());
    assert!(
        c.buckets().iter().all(|&(rows, _)| rows == 3),
        "{:?}",
        c.buckets()
    );
    assert_eq!(c.buckets().len(), 2, "{:?}", c.buckets());
}

/// `warm_decode` traces every bucket a batch meets up front (each row count
/// at each table width up to the context asked for), writing only the null
/// block: decode steps after it match the op-by-op forward and trace nothing.
#[test]
fn warmed_buckets_are_not_traced_while_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut plain = Rows::new(runner(load_f32(&md, false), 64));
    let mut comp = Rows::new(compiled(&md));
    // Up to 3 rows (the CPU pads no batch), up to 40 tokens: tables of 1, 2
    // and 4 blocks of 16.
    assert_eq!(comp.runner.warm_decode(3, 40).unwrap(), 9);
    let c = comp.runner.compiled_decode().unwrap();
    let traced = c.traces();
    assert_eq!(traced, 9, "{:?}", c.buckets());
    assert_eq!(plain.prefill(), comp.prefill(), "prefill is not compiled");
    for s in 0..16 {
        let want = plain.decode();
        let got = comp.decode();
        let d = max_abs_diff(&want, &got);
        assert!(d <= TOLERANCE, "step {s}: max |logit diff| {d}");
        assert_eq!(plain.at, comp.at, "step {s}: greedy picks");
    }
    assert_eq!(
        comp.runner.compiled_decode().unwrap().traces(),
        traced,
        "a warmed bucket traced again"
    );
    assert_eq!(comp.runner.warm_decode(3, 40).unwrap(), 0, "warming twice");
}

/// A prompt fed in chunks beside decoding rows: a step with prompt chunks
/// runs its decoding rows through the compiled step too (after the chunk's
/// op-by-op forward), with the op-by-op forward's logits; a fault inside
/// that compiled part rolls the whole step back.
#[test]
fn a_step_with_prompt_chunks_runs_its_decoding_rows_compiled() {
    const CHUNK: usize = 5;
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut plain = Rows::new(runner(load_f32(&md, false), 64));
    let mut comp = Rows::new(compiled(&md));
    assert_eq!(plain.prefill(), comp.prefill(), "prefill is not compiled");
    let prompt: Vec<u32> = (0..4 * CHUNK as u32).map(|i| (i * 37 + 11) % 200).collect();
    let layers = comp.runner.model().num_layers();
    for s in 0..8 {
        let fed = s * CHUNK;
        let chunk = (fed < prompt.len()).then(|| (&prompt[fed..fed + CHUNK], fed));
        if s == 1 {
            // A fault at layer 1 of the compiled decode forward, which runs
            // after the chunk's forward (whose layers the hook sees first).
            let mut seen = 0;
            comp.runner.set_layer_hook(Some(Box::new(move |layer| {
                seen += 1;
                if seen == layers + 2 {
                    assert_eq!(layer, 1);
                    return Err(weft_models::ModelError::Invalid("injected".into()));
                }
                Ok(())
            })));
            let mut steps = mixed_steps(&comp, chunk);
            let ops = comp.kv.plan(&mut steps);
            assert!(comp.runner.forward(&ops, &steps).is_err());
            comp.kv.rollback();
            comp.runner.set_layer_hook(None);
        }
        let want = mixed(&mut plain, chunk, prompt.len());
        let got = mixed(&mut comp, chunk, prompt.len());
        let d = max_abs_diff(&want, &got);
        assert!(d <= TOLERANCE, "step {s}: max |logit diff| {d}");
        assert_eq!(plain.at, comp.at, "step {s}: greedy picks");
        if s == 0 {
            // No step so far decoded alone: the first mixed one traced.
            assert_eq!(comp.runner.compiled_decode().unwrap().traces(), 1);
        }
    }
    assert_eq!(comp.at.len(), 4, "the chunked prompt decodes at the end");
}

/// The decoding rows' steps and `chunk` (tokens, start) of a fourth row.
fn mixed_steps(r: &Rows, chunk: Option<(&[u32], usize)>) -> Vec<RowStep> {
    let mut steps = r.decode_steps();
    if let Some((tokens, start)) = chunk {
        steps.push(RowStep {
            row: 3,
            tokens: tokens.to_vec(),
            start_pos: start,
            want_logits: true,
            ..Default::default()
        });
    }
    steps
}

/// One step of the decoding rows and `chunk`; the fourth row decodes once
/// its `len` prompt tokens are in.
fn mixed(r: &mut Rows, chunk: Option<(&[u32], usize)>, len: usize) -> Vec<f32> {
    let mut steps = mixed_steps(r, chunk);
    let l = step(&mut r.runner, &mut r.kv, &mut steps);
    r.settle(&l, &steps);
    if chunk.is_some_and(|(t, start)| start + t.len() < len) {
        r.at.pop();
    }
    l.data
}
