//! Shared helpers for tests that use mlx-lm as the oracle.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use std::collections::HashMap;

use mlx_rs::Array;
use weft_kv_pool::{KvPool, OwnerId, Salt, SeqId, SeqSpec};
use weft_models::{BatchRunner, KvMemory, LlamaModel, PagedKv, RowBlocks, RowStep, StorageOp};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python that has mlx and mlx-lm: `WEFT_PYTHON`, else the venv `.ci/run` makes.
pub fn python() -> PathBuf {
    let p = std::env::var_os("WEFT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    assert!(
        p.exists(),
        "mlx-lm oracle interpreter {} not found: run `bash .ci/run` once (it creates .venv) or set WEFT_PYTHON",
        p.display()
    );
    p
}

pub fn oracle(args: &[&str]) -> serde_json::Value {
    let script = workspace_root().join("tests/oracle/mlx_lm_oracle.py");
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .output()
        .expect("run oracle");
    assert!(
        out.status.success(),
        "oracle {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if out.stdout.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&out.stdout).expect("oracle JSON")
    }
}

pub fn to_vec_f32(a: &Array) -> Vec<f32> {
    a.as_dtype(mlx_rs::Dtype::Float32)
        .unwrap()
        .reshape(&[-1])
        .unwrap()
        .as_slice::<f32>()
        .to_vec()
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Single-row greedy decode: (last prompt position logits, generated ids).
/// The row's blocks are simply 0, 1, 2, ... of a private pool.
pub fn greedy(model: &LlamaModel, ids: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let bs = 16usize;
    let blocks = (ids.len() + n).div_ceil(bs) as u32 + 1;
    let kv = PagedKv::new(
        model.kv_shape(),
        bs as u32,
        KvMemory::Blocks(blocks),
        model.policy.kernels,
        false,
    )
    .unwrap();
    // The same private blocks in every KV group (sliding-window layers read
    // only the in-window ones).
    let table: Vec<RowBlocks> = kv
        .groups()
        .groups
        .iter()
        .map(|_| RowBlocks {
            offset: 0,
            blocks: (0..blocks).collect(),
        })
        .collect();
    let run = |tokens: &[u32], start: usize, decode: bool| -> Array {
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        let t = Array::from_slice(&ids, &[1, ids.len() as i32]);
        let mut step = kv
            .step(&[(&table[..], start, tokens.len())], decode)
            .unwrap();
        let l = model.forward(&t, &mut step, true).unwrap();
        drop(step);
        let mut pending = kv.arrays();
        pending.push(l.clone());
        mlx_rs::transforms::eval(pending.iter()).unwrap();
        l
    };
    let first = to_vec_f32(&run(ids, 0, false));
    let mut out = vec![argmax(&first)];
    while out.len() < n {
        let pos = ids.len() + out.len() - 1;
        let l = run(&[*out.last().unwrap()], pos, true);
        let next = mlx_rs::ops::indexing::argmax(l.reshape(&[-1]).unwrap(), None).unwrap();
        out.push(next.item_cast::<u32>());
    }
    (first, out)
}

/// The scheduler's half of a step, for tests that drive a `BatchRunner`
/// directly: a `KvPool` mirroring the runner's storage, one sequence per row.
pub struct Kv {
    pub pool: KvPool,
    seqs: HashMap<u64, SeqId>,
    /// Rows the open step created (gone again if it rolls back).
    created: Vec<u64>,
}

impl Kv {
    pub fn for_runner(r: &BatchRunner) -> Self {
        Self {
            pool: KvPool::new(r.kv_groups().clone().hash_key(7)).unwrap(),
            seqs: HashMap::new(),
            created: Vec::new(),
        }
    }

    /// Opens a step: appends every row's tokens (creating new rows, tenant
    /// salt 1) and fills their block tables. Returns the step's storage ops.
    pub fn plan(&mut self, steps: &mut [RowStep]) -> Vec<StorageOp> {
        self.pool.begin().unwrap();
        for s in steps.iter_mut() {
            let seq = match self.seqs.get(&s.row) {
                Some(&q) => q,
                None => {
                    // A recurrent model's rows each hold a state slot (and
                    // share no prefix).
                    let spec = if self.pool.slots().stats().total > 0 {
                        SeqSpec::new(OwnerId(0)).with_state_slot()
                    } else {
                        SeqSpec::new(OwnerId(0)).salted(Salt(1))
                    };
                    let q = self.pool.allocate(spec).unwrap();
                    self.seqs.insert(s.row, q);
                    self.created.push(s.row);
                    q
                }
            };
            assert_eq!(
                self.pool.sequence(seq).unwrap().len,
                s.start_pos,
                "row {}",
                s.row
            );
            self.pool.append_tokens(seq, &s.tokens).unwrap();
            s.state_slot = self.pool.sequence(seq).unwrap().state_slot;
            s.blocks = (0..self.pool.stats().groups.len())
                .map(|g| {
                    let mut b = RowBlocks::default();
                    b.copy_from(&self.pool.table(seq, g).unwrap());
                    b
                })
                .collect();
        }
        self.pool.step_ops().to_vec()
    }

    /// A new row starting from the tenant's cached prefix of `tokens` (all
    /// but the last offered); returns the tokens it covers.
    pub fn start_with_prefix(&mut self, row: u64, salt: u64, tokens: &[u32]) -> usize {
        let (seq, n) = self
            .pool
            .allocate_with_prefix(
                SeqSpec::new(OwnerId(salt as u32)).salted(Salt(salt)),
                &tokens[..tokens.len() - 1],
            )
            .unwrap();
        self.seqs.insert(row, seq);
        n
    }

    pub fn truncate(&mut self, row: u64, len: usize) {
        self.pool.truncate(self.seqs[&row], len).unwrap();
    }

    pub fn commit(&mut self) {
        self.pool.commit().unwrap();
        self.created.clear();
    }

    pub fn rollback(&mut self) {
        self.pool.rollback_after_writes().unwrap();
        for r in self.created.drain(..) {
            self.seqs.remove(&r);
        }
    }

    pub fn release(&mut self, row: u64) {
        if let Some(seq) = self.seqs.remove(&row) {
            self.pool.release(seq).unwrap();
        }
    }

    pub fn rows(&self) -> usize {
        self.seqs.len()
    }

    /// Row `row`'s block table in KV group `group`: (logical index of its
    /// first block, blocks held).
    pub fn table(&self, row: u64, group: usize) -> (usize, usize) {
        let t = self.pool.table(self.seqs[&row], group).unwrap();
        (t.offset, t.blocks.len())
    }
}

/// A runner over `model` with room for `blocks` KV blocks of 16 tokens.
pub fn runner(model: LlamaModel, blocks: u32) -> BatchRunner {
    BatchRunner::with_memory(model, 16, KvMemory::Blocks(blocks)).unwrap()
}

/// One step through the pool and the runner, committed.
pub fn step(
    runner: &mut BatchRunner,
    kv: &mut Kv,
    steps: &mut [RowStep],
) -> weft_models::StepLogits {
    let ops = kv.plan(steps);
    let l = runner.forward(&ops, steps).expect("step");
    runner.commit().unwrap();
    kv.commit();
    l
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vector lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn json_f32(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn json_f64(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

pub fn json_u32(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The model of `md` as `weft serve` loads it on the CPU (f32, dequantized,
/// CPU-tuned kernels), on the packed GEMM or on MLX's matmuls.
pub fn load_f32(md: &Path, host_gemm: bool) -> weft_models::LlamaModel {
    let config = weft_models::ModelConfig::load(md).unwrap();
    let weights = weft_models::weights::Weights::load_dir(md).unwrap();
    weft_models::LlamaModel::from_weights(
        config,
        weights,
        weft_models::WeightPolicy {
            dequantize: true,
            dtype: mlx_rs::Dtype::Float32,
            kernels: weft_models::Kernels::CpuTuned,
            host_gemm,
        },
    )
    .unwrap()
}

/// A row of a continuous-batching run: its prompt, tokens to generate, and
/// the step it joins at.
pub struct Row {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    pub join_step: usize,
}

pub fn log_softmax(v: &[f32]) -> Vec<f32> {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + v.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    v.iter().map(|x| x - lse).collect()
}

/// Per row: generated tokens and the full log-prob vector at each step.
pub type Trace = Vec<(Vec<u32>, Vec<Vec<f32>>)>;

/// Drives `BatchRunner` like a minimal scheduler (a `KvPool` holds the rows'
/// blocks): joiners prefill in the same step as decoding rows; finished rows
/// are released at once. `fail` may make a step fail (to be retried): the
/// pool rolls back after the forward wrote its blocks, as in the engine.
pub fn drive(runner: &mut BatchRunner, rows: &[Row], fail: impl FnMut(usize) -> bool) -> Trace {
    drive_watched(runner, rows, fail, |_, _| {})
}

/// As [`drive`], calling `watch(kv, active rows)` after every committed step.
pub fn drive_watched(
    runner: &mut BatchRunner,
    rows: &[Row],
    fail: impl FnMut(usize) -> bool,
    watch: impl FnMut(&Kv, &[usize]),
) -> Trace {
    drive_adapters(runner, rows, &[], fail, watch)
}

/// As [`drive_watched`], row `i` running with adapter `adapters[i]` (none
/// past the slice's end).
pub fn drive_adapters(
    runner: &mut BatchRunner,
    rows: &[Row],
    adapters: &[Option<weft_models::AdapterId>],
    mut fail: impl FnMut(usize) -> bool,
    mut watch: impl FnMut(&Kv, &[usize]),
) -> Trace {
    let mut kv = Kv::for_runner(runner);
    let mut out: Trace = rows.iter().map(|_| (vec![], vec![])).collect();
    let mut active: Vec<usize> = vec![];
    let mut step = 0;
    let mut retries = 0;
    while out.iter().zip(rows).any(|(o, r)| o.0.len() < r.max_tokens) {
        for (i, r) in rows.iter().enumerate() {
            if r.join_step == step && !active.contains(&i) && out[i].0.is_empty() {
                active.push(i);
            }
        }
        let mut steps: Vec<RowStep> = active
            .iter()
            .map(|&i| {
                let (gen, ids) = (&out[i].0, &rows[i].ids);
                if gen.is_empty() {
                    RowStep {
                        row: i as u64,
                        tokens: ids.clone(),
                        start_pos: 0,
                        want_logits: true,
                        adapter: adapters.get(i).copied().flatten(),
                        ..Default::default()
                    }
                } else {
                    RowStep {
                        row: i as u64,
                        tokens: vec![*gen.last().unwrap()],
                        start_pos: ids.len() + gen.len() - 1,
                        want_logits: true,
                        adapter: adapters.get(i).copied().flatten(),
                        ..Default::default()
                    }
                }
            })
            .collect();
        let ops = kv.plan(&mut steps);
        if fail(step) {
            match runner.forward(&ops, &steps) {
                Err(_) => {
                    retries += 1;
                    assert!(retries < 100, "fault injection never stopped");
                }
                Ok(_) => runner.rollback(), // a fault "after eval": drop the step
            }
            kv.rollback();
            continue;
        }
        let logits = runner.forward(&ops, &steps).expect("step");
        runner.commit().unwrap();
        kv.commit();
        for (k, &row) in logits.rows.iter().enumerate() {
            let i = row as usize;
            let lp = log_softmax(logits.row(k));
            out[i].0.push(argmax(&lp));
            out[i].1.push(lp);
        }
        watch(&kv, &active);
        active.retain(|&i| {
            let done = out[i].0.len() >= rows[i].max_tokens;
            if done {
                kv.release(i as u64);
            }
            !done
        });
        step += 1;
    }
    assert_eq!(kv.rows(), 0, "rows left behind after all finished");
    for (g, st) in kv.pool.stats().groups.iter().enumerate() {
        assert_eq!(st.used, 0, "blocks of group {g} left in use");
    }
    kv.pool.check_invariants().unwrap();
    out
}

/// Drives `rs` on a runner from `make` cleanly, then on a fresh one whose
/// steps 0, 3, 4, 9 and 20 each fail once mid-forward (after layer 1) and
/// once after evaluation, retried: tokens and logprobs must be identical.
pub fn faults_roll_back(
    rs: &[Row],
    md: &std::path::Path,
    make: impl Fn(&std::path::Path) -> BatchRunner,
) {
    faults_at_roll_back(rs, &[], &[0, 3, 4, 9, 20], || make(md));
}

/// [`faults_roll_back`] with row `i` on adapter `adapters[i]` and the faults
/// at steps `at`.
pub fn faults_at_roll_back(
    rs: &[Row],
    adapters: &[Option<weft_models::AdapterId>],
    at: &[usize],
    make: impl Fn() -> BatchRunner,
) {
    let mut runner = make();
    let clean = drive_adapters(&mut runner, rs, adapters, |_| false, |_, _| {});

    // Fail mid-forward (after layer 1) on some steps, and drop whole
    // successful steps on others ("fault after eval"), then retry.
    let mut runner = make();
    let arm = std::rc::Rc::new(std::cell::Cell::new(false));
    let armed = arm.clone();
    runner.set_layer_hook(Some(Box::new(move |layer| {
        if layer == 1 && armed.get() {
            armed.set(false);
            return Err(weft_models::ModelError::Invalid(
                "injected fault after layer 1".into(),
            ));
        }
        Ok(())
    })));
    let mut seen = std::collections::HashSet::new();
    let fail = |step: usize| {
        // Each of these steps fails once mid-forward, then once after eval.
        if !at.contains(&step) {
            return false;
        }
        match seen.iter().filter(|&&(s, _)| s == step).count() {
            0 => {
                seen.insert((step, 0));
                arm.set(true);
                true
            }
            1 => {
                seen.insert((step, 1));
                true
            }
            _ => false,
        }
    };
    let faulty = drive_adapters(&mut runner, rs, adapters, fail, |_, _| {});
    for (i, (c, f)) in clean.iter().zip(&faulty).enumerate() {
        assert_eq!(c.0, f.0, "row {i}: tokens changed by rolled-back faults");
        for (a, b) in c.1.iter().zip(&f.1) {
            assert_eq!(a, b, "row {i}: logprobs changed by rolled-back faults");
        }
    }
    assert_eq!(seen.len(), 2 * at.len(), "every planned fault fired");
}

/// mlx-lm's random fixture of `arch` written under `dir` (as `dir/m`).
pub fn fixture_dir(dir: &Path, arch: &str) -> PathBuf {
    let md = dir.join("m");
    oracle(&["fixture", "--arch", arch, "--out", md.to_str().unwrap()]);
    md
}
