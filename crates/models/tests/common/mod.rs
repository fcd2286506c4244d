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
    let table = [RowBlocks {
        offset: 0,
        blocks: (0..blocks).collect(),
    }];
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
                    let q = self
                        .pool
                        .allocate(SeqSpec::new(OwnerId(0)).salted(Salt(1)))
                        .unwrap();
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
            let t = self.pool.table(seq, 0).unwrap();
            let mut b = RowBlocks::default();
            b.copy_from(&t);
            s.blocks = vec![b];
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
