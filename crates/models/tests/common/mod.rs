//! Shared helpers for tests that use mlx-lm as the oracle.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_rs::Array;
use weft_models::{KvCache, LlamaModel};

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
pub fn greedy(model: &LlamaModel, ids: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut cache = KvCache::new(model.num_layers(), 1);
    let ids: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]);
    let logits = model.forward(&tokens, &mut cache, true).unwrap();
    cache.commit();
    let first = to_vec_f32(&logits);
    let mut out = vec![argmax(&first)];
    while out.len() < n {
        let t = Array::from_slice(&[*out.last().unwrap() as i32], &[1, 1]);
        let l = model.forward(&t, &mut cache, true).unwrap();
        cache.commit();
        let next = mlx_rs::ops::indexing::argmax(l.reshape(&[-1]).unwrap(), None).unwrap();
        out.push(next.item_cast::<u32>());
    }
    (first, out)
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
