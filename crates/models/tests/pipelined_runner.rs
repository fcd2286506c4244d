//! Pipelined steps through `BatchRunner` with a real model: each decode step is
//! submitted on the previous step's picks (still on the device) before those
//! are read, as the engine's pipelined loop does. The tokens must be exactly
//! those of one step at a time, also when rows join mid-way (a prefill beside
//! following rows), when a prompt goes in chunks each queued behind the step that
//! fed the one before, when the queued step is rolled back, and when both open
//! steps are rolled back after both wrote their KV. Runs on MLX's CPU backend
//! (the same graph the GPU runs; there, the overlap is what it buys).

mod common;

use common::*;
use weft_kv_pool::{KvPool, OwnerId, Salt, SeqId, SeqSpec};
use weft_models::{BatchRunner, RowBlocks, RowStep, SampleRow};

/// (prompt, step it joins at).
fn rows() -> Vec<(Vec<u32>, usize)> {
    vec![
        (vec![1, 2, 3, 4, 5], 0),
        (vec![7], 0),
        (vec![9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12], 0),
        (vec![100, 200, 300], 4),
        ((250..272).collect(), 9),
        ((300..340).collect(), 12),
    ]
}

/// Rows whose prompt is fed in chunks of this many tokens, one a step (the last
/// wants logits), as the engine chains a long prompt's chunks: each chunk is
/// queued behind the step that fed the one before, its KV not read yet.
fn chunk_of(row: usize) -> Option<usize> {
    (row == 5).then_some(8)
}

const STEPS: usize = 24;

/// What goes wrong, and at which step.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    None,
    /// The step queued behind step `s - 1` is rolled back before `s - 1` is read;
    /// step `s` then runs again without following.
    DropQueued(usize),
    /// Step `s - 1` "fails" when read with step `s` queued: both roll back (both
    /// wrote KV by then) and both run again.
    DropBoth(usize),
}

struct Driver {
    runner: BatchRunner,
    pool: KvPool,
    seqs: Vec<Option<SeqId>>,
    /// Generated tokens per row.
    out: Vec<Vec<u32>>,
    /// Sample with penalties over each row's output so far and a mask that
    /// bans its last pick (parameters that depend on the step before), and
    /// submit pipelined steps unsampled, their sampling once that step is read.
    deferred: bool,
    /// The rows of the step submitted unsampled whose sampling is due.
    unsampled: Option<Vec<RowStep>>,
}

/// A row's sampling parameters from its output so far: a temperature draw
/// (a fixed function of row and position) under repetition and frequency
/// penalties over what it generated, with its last pick banned.
fn stateful(row: usize, out: &[u32], vocab: usize) -> SampleRow {
    let mut seen: Vec<(u32, u32)> = Vec::new();
    for &t in out {
        match seen.iter_mut().find(|(id, _)| *id == t) {
            Some((_, n)) => *n += 1,
            None => seen.push((t, 1)),
        }
    }
    let mut words = vec![u32::MAX; vocab.div_ceil(32)];
    if let Some(&t) = out.last() {
        words[t as usize / 32] &= !(1 << (t % 32));
    }
    SampleRow {
        temperature: 0.8,
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        seen,
        uniforms: vec![((row * 7919 + out.len() * 104_729) % 1000) as f64 / 1000.0],
        allowed: vec![words.into()],
        ..SampleRow::default()
    }
}

impl Driver {
    fn new(runner: BatchRunner) -> Self {
        let pool = KvPool::new(runner.kv_groups().clone().hash_key(3)).unwrap();
        let n = rows().len();
        Self {
            runner,
            pool,
            seqs: vec![None; n],
            out: vec![Vec::new(); n],
            deferred: false,
            unsampled: None,
        }
    }

    fn deferred(mut self) -> Self {
        self.deferred = true;
        self
    }

    /// Sampling parameters of the rows of `steps` that want logits, from the rows'
    /// output now.
    fn sampling(&self, steps: &[RowStep]) -> Vec<SampleRow> {
        let wanting = steps.iter().filter(|s| s.want_logits);
        if !self.deferred {
            return vec![SampleRow::default(); wanting.count()];
        }
        let vocab = self.runner.model().config.vocab_size as usize;
        wanting
            .map(|s| stateful(s.row as usize, &self.out[s.row as usize], vocab))
            .collect()
    }

    /// Queues the sampling of the step submitted unsampled, if any.
    fn sample_pending(&mut self) {
        if let Some(steps) = self.unsampled.take() {
            let sampling = self.sampling(&steps);
            self.runner.submit_sampling(&sampling).unwrap();
        }
    }

    /// Opens step `s` and builds its rows. With `follow`, rows that decode take
    /// the pick of the step before (outstanding): a placeholder here.
    /// Returns the rows, their follow flags and where each placeholder sits.
    fn open(&mut self, s: usize, follow: bool) -> (Vec<RowStep>, Vec<bool>, Vec<(usize, usize)>) {
        if self.pool.in_transaction() {
            self.pool.begin_next().unwrap();
        } else {
            self.pool.begin().unwrap();
        }
        let mut steps = Vec::new();
        let mut follows = Vec::new();
        let mut holes = Vec::new();
        for (i, (prompt, join)) in rows().into_iter().enumerate() {
            if s < join {
                continue;
            }
            let chunk = chunk_of(i).unwrap_or(prompt.len());
            let fed = (s - join) * chunk;
            let (tokens, start, f) = if s == join {
                let q = self
                    .pool
                    .allocate(SeqSpec::new(OwnerId(0)).salted(Salt(1)))
                    .unwrap();
                self.seqs[i] = Some(q);
                (prompt[..chunk.min(prompt.len())].to_vec(), 0, false)
            } else if fed < prompt.len() {
                // The prompt's next chunk: known on the host, never a pick.
                let end = (fed + chunk).min(prompt.len());
                (prompt[fed..end].to_vec(), fed, false)
            } else {
                let q = self.seqs[i].unwrap();
                let start = self.pool.sequence(q).unwrap().len;
                if follow {
                    holes.push((i, start));
                    (vec![0], start, true)
                } else {
                    (vec![*self.out[i].last().unwrap()], start, false)
                }
            };
            let q = self.seqs[i].unwrap();
            self.pool.append_tokens(q, &tokens).unwrap();
            let mut b = RowBlocks::default();
            b.copy_from(&self.pool.table(q, 0).unwrap());
            // A prompt's chunk wants logits only where the prompt ends.
            let want_logits = start + tokens.len() >= prompt.len();
            steps.push(RowStep {
                row: i as u64,
                tokens,
                start_pos: start,
                want_logits,
                blocks: vec![b],
                ..Default::default()
            });
            follows.push(f);
        }
        (steps, follows, holes)
    }

    /// Deferred, a step that follows another is sampled once that one is read
    /// (`settle`); one that does not, at once.
    fn submit(&mut self, s: usize, follow: bool) -> Vec<(usize, usize)> {
        let (steps, follows, holes) = self.open(s, follow);
        let ops = self.pool.step_ops().to_vec();
        if self.deferred {
            self.runner
                .submit_unsampled(&ops, &steps, &follows)
                .unwrap();
            self.unsampled = Some(steps);
            if !follow {
                self.sample_pending();
            }
        } else {
            let greedy = self.sampling(&steps);
            self.runner
                .submit_sampled(&ops, &steps, &greedy, &follows)
                .unwrap();
        }
        holes
    }

    /// Reads the oldest step, commits it, and fills the queued step's holes.
    fn settle(&mut self, holes: &[(usize, usize)]) {
        let picks = self.runner.collect().unwrap();
        self.runner.commit().unwrap();
        self.pool.commit().unwrap();
        for (&row, &t) in picks.rows.iter().zip(&picks.picked.tokens) {
            self.out[row as usize].push(t);
        }
        for &(i, pos) in holes {
            let t = *self.out[i].last().unwrap();
            self.pool
                .set_tokens(self.seqs[i].unwrap(), pos, &[t])
                .unwrap();
        }
        self.sample_pending();
    }

    fn undo_newest(&mut self) {
        // The newest step is the unsampled one, if one is.
        self.unsampled = None;
        self.runner.rollback();
        self.pool.rollback_after_writes().unwrap();
        // A row the undone step created is gone again.
        for q in self.seqs.iter_mut() {
            if q.is_some_and(|q| self.pool.sequence(q).is_err()) {
                *q = None;
            }
        }
    }

    /// One step at a time: forward, read, commit.
    fn plain(&mut self) -> Vec<Vec<u32>> {
        for s in 0..STEPS {
            let (steps, _, _) = self.open(s, false);
            let greedy = self.sampling(&steps);
            let ops = self.pool.step_ops().to_vec();
            let picks = self.runner.forward_sampled(&ops, &steps, &greedy).unwrap();
            self.runner.commit().unwrap();
            self.pool.commit().unwrap();
            for (&row, &t) in picks.rows.iter().zip(&picks.picked.tokens) {
                self.out[row as usize].push(t);
            }
        }
        self.out.clone()
    }

    /// Step s+1 queued on step s's picks before step s is read.
    fn pipelined(&mut self, fault: Fault) -> Vec<Vec<u32>> {
        self.submit(0, false);
        for s in 1..STEPS {
            let next = self.submit(s, true);
            match fault {
                Fault::DropQueued(f) if f == s => {
                    self.undo_newest();
                    self.settle(&[]);
                    self.submit(s, false);
                }
                Fault::DropBoth(f) if f == s => {
                    self.undo_newest();
                    self.undo_newest();
                    // Step s - 1 again, plainly (its inputs are committed tokens),
                    // then the pipeline resumes.
                    assert!(self.submit(s - 1, false).is_empty());
                    let next = self.submit(s, true);
                    self.settle(&next);
                }
                _ => self.settle(&next),
            }
        }
        self.settle(&[]);
        assert!(!self.pool.in_transaction());
        self.pool.check_invariants().unwrap();
        self.out.clone()
    }

    /// (traces, buckets) of the runner's compiled decode steps; every
    /// bucket traced exactly once (a retrace would recompile every step of
    /// that shape) and some steps ran compiled.
    fn compiled_traces(&self) -> (u64, usize) {
        let c = self.runner.compiled_decode().expect("compiled decode on");
        let (t, b) = (c.traces(), c.buckets().len());
        assert_eq!(t, b as u64, "traces vs buckets {:?}", c.buckets());
        (t, b)
    }
}

#[test]
fn pipelined_steps_pick_exactly_what_one_step_at_a_time_picks() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    for host_gemm in [false, true] {
        let want = Driver::new(runner(load_f32(&md, host_gemm), 128)).plain();
        assert!(want.iter().all(|t| !t.is_empty()));
        for fault in [
            Fault::None,
            Fault::DropQueued(6),
            Fault::DropQueued(9),
            Fault::DropBoth(5),
            Fault::DropBoth(9),
            // While row 5's prompt goes in chunks, each queued behind the last.
            Fault::DropQueued(14),
            Fault::DropBoth(15),
        ] {
            let got = Driver::new(runner(load_f32(&md, host_gemm), 128)).pipelined(fault);
            assert_eq!(got, want, "host_gemm {host_gemm}, {fault:?}");
        }
    }
}

/// Steps submitted unsampled and sampled once the step before is read (as the
/// engine does for penalized and constrained rows, whose parameters depend on
/// that step's picks) pick exactly what one step at a time picks with the same
/// parameters, also through rollbacks of the queued step and of both; compiled
/// too.
#[test]
fn deferred_sampling_picks_exactly_what_one_step_at_a_time_picks() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let want = Driver::new(runner(load_f32(&md, false), 128))
        .deferred()
        .plain();
    // Not what greedy picks: the parameters matter.
    let greedy = Driver::new(runner(load_f32(&md, false), 128)).plain();
    assert_ne!(want, greedy);
    for t in &want {
        assert!(t.windows(2).all(|w| w[0] != w[1]), "a banned pick: {t:?}");
    }
    for compiled in [false, true] {
        for fault in [Fault::None, Fault::DropQueued(6), Fault::DropBoth(9)] {
            let mut r = runner(load_f32(&md, false), 128);
            r.set_compiled_decode(compiled).unwrap();
            let got = Driver::new(r).deferred().pipelined(fault);
            assert_eq!(got, want, "compiled {compiled}, {fault:?}");
        }
    }
}

/// Compiled decode steps (the forward traced once per (rows, table width)
/// bucket and replayed, every per-step value an array input) pick exactly
/// what op-by-op steps pick: one step at a time, pipelined, and through
/// rollbacks of the queued step and of both open steps. Rows join at steps 4
/// and 9 (those mixed steps run uncompiled) and tables grow, so several
/// buckets are met, each traced once.
#[test]
fn compiled_decode_steps_pick_exactly_what_op_by_op_steps_pick() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let want = Driver::new(runner(load_f32(&md, false), 128)).plain();
    let compiled = || {
        let mut r = runner(load_f32(&md, false), 128);
        r.set_compiled_decode(true).unwrap();
        Driver::new(r)
    };
    let mut d = compiled();
    assert_eq!(d.plain(), want, "one step at a time");
    let (_, buckets) = d.compiled_traces();
    assert!(buckets >= 3, "{buckets} buckets: rows 3, 4 and 5 at least");
    for fault in [Fault::None, Fault::DropQueued(6), Fault::DropBoth(7)] {
        let mut d = compiled();
        assert_eq!(d.pipelined(fault), want, "{fault:?}");
        d.compiled_traces();
    }
    // Compiled steps refuse the packed host GEMM, which cannot be traced.
    assert!(runner(load_f32(&md, true), 16)
        .set_compiled_decode(true)
        .is_err());
}

/// Contract checks: a third open step, following with nothing outstanding, a
/// following row that does not decode, committing a step not yet read.
#[test]
fn pipelined_contract_violations_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "llama", "--out", md.to_str().unwrap()]);
    let mut d = Driver::new(runner(load_f32(&md, false), 64));
    let (steps, _, _) = d.open(0, false);
    let greedy = vec![SampleRow::default(); steps.len()];
    let ops = d.pool.step_ops().to_vec();
    // Following with no step outstanding.
    let all = vec![true; steps.len()];
    assert!(d
        .runner
        .submit_sampled(&ops, &steps, &greedy, &all)
        .is_err());
    d.runner.rollback();
    d.runner.submit_sampled(&ops, &steps, &greedy, &[]).unwrap();
    assert!(d.runner.commit().is_err(), "committed a step not read yet");
    // A prefill row may not follow.
    assert!(d
        .runner
        .submit_sampled(&ops, &steps, &greedy, &all)
        .is_err());
    d.runner.rollback();
    d.runner.collect().unwrap();
    d.runner.commit().unwrap();
    // An unsampled step: neither collected nor followed nor committed before
    // its sampling; sampling it twice, or with rows missing, is refused.
    d.runner.submit_unsampled(&ops, &steps, &[]).unwrap();
    assert!(d.runner.collect().is_err(), "collected an unsampled step");
    assert!(d.runner.commit().is_err(), "committed an unsampled step");
    assert!(d
        .runner
        .submit_sampled(&ops, &steps, &greedy, &all)
        .is_err());
    d.runner.rollback();
    assert!(d.runner.submit_sampling(&greedy[1..]).is_err());
    d.runner.submit_sampling(&greedy).unwrap();
    assert!(d.runner.submit_sampling(&greedy).is_err(), "sampled twice");
    d.runner.collect().unwrap();
    d.runner.commit().unwrap();
    d.pool.commit().unwrap();
}
