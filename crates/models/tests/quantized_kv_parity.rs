//! Batched quantized KV (`--kv-bits`): rows joining and leaving one batch
//! whose K/V the pool stores affine-quantized, each against mlx-lm running
//! that row alone over its `QuantizedKVCache` (mlx-lm cannot batch quantized
//! K/V: its `BatchGenerator` has no quantized cache); chunked prefill equal
//! to one-shot prefill; step rollback exact.

mod common;

use common::*;
use weft_models::{AffineQuant, BatchRunner, KvMemory, LlamaModel, RowStep};

fn rows() -> Vec<Row> {
    let r = |ids: Vec<u32>, max_tokens, join_step| Row {
        ids,
        max_tokens,
        join_step,
    };
    vec![
        r(vec![1, 2, 3, 4, 5], 24, 0),
        r(vec![7], 28, 0),
        // Past a 16-token block boundary before it decodes.
        r((30..51).collect(), 20, 2),
        r(vec![100, 200, 300], 22, 5),
        r((400..440).map(|x| x % 512).collect(), 20, 9),
    ]
}

/// Heads of 64, which groups of 32 and 64 divide.
fn fixture(dir: &std::path::Path) -> std::path::PathBuf {
    fixture_dir(dir, "llama-wide")
}

fn load(md: &std::path::Path) -> LlamaModel {
    // What `weft serve` runs on CPU.
    load_f32(md, true)
}

fn quantized_runner(md: &std::path::Path, q: AffineQuant) -> BatchRunner {
    BatchRunner::with_memory_use(load(md), 16, KvMemory::Blocks(64), None, Some(q)).unwrap()
}

/// mlx-lm on each row alone: per row, the log-probs of every step and the
/// top-2 margins; over its quantized cache with `q`, else full precision.
fn oracle_alone(
    dir: &std::path::Path,
    md: &std::path::Path,
    rs: &[Row],
    q: Option<AffineQuant>,
) -> serde_json::Value {
    let max = rs.iter().map(|r| r.max_tokens).max().unwrap_or(1);
    let req = serde_json::json!({
        "max_tokens": max,
        "full": true,
        "prompts": rs.iter().map(|r| serde_json::json!({"ids": r.ids})).collect::<Vec<_>>(),
    });
    let path = dir.join("alone.json");
    std::fs::write(&path, req.to_string()).unwrap();
    let mut args = vec![
        "run".to_string(),
        "--model".into(),
        md.to_str().unwrap().into(),
        "--requests".into(),
        path.to_str().unwrap().into(),
    ];
    if let Some(q) = q {
        args.extend([
            "--kv-bits".into(),
            q.bits.to_string(),
            "--kv-group-size".into(),
            q.group_size.to_string(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    oracle(&args)
}

/// Log-probs within this of mlx-lm's quantized run (f32 both sides: the same
/// values are quantized, so only a rare rounding flip of one element and the
/// summation order differ).
const TOL: f32 = 2e-3;
/// Below this top-2 margin a token may legitimately differ.
const NEAR_TIE: f64 = 1e-3;

#[test]
fn quantized_rows_joining_and_leaving_match_mlx_lm_quantized_cache_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    quantized_parity(
        dir.path(),
        &md,
        &[AffineQuant::new(8, 64), AffineQuant::new(4, 32)],
    );
}

/// The hybrids' attention layers over quantized K/V beside their recurrent
/// state (heads of 32: groups of 32), each row against mlx-lm alone over its
/// own cache with every attention layer's cache quantized.
#[test]
fn hybrid_rows_over_quantized_kv_match_mlx_lm_quantized_cache_alone() {
    for arch in ["qwen3_5", "nemotron_h"] {
        let dir = tempfile::tempdir().unwrap();
        let md = fixture_dir(dir.path(), arch);
        eprintln!("{arch}:");
        quantized_parity(
            dir.path(),
            &md,
            &[AffineQuant::new(8, 32), AffineQuant::new(4, 32)],
        );
    }
}

fn quantized_parity(dir: &std::path::Path, md: &std::path::Path, qs: &[AffineQuant]) {
    let md = md.to_path_buf();
    let rs = rows();
    let full = oracle_alone(dir, &md, &rs, None);
    for &q in qs {
        let want = oracle_alone(dir, &md, &rs, Some(q));
        let mut runner = quantized_runner(&md, q);
        assert_eq!(
            runner.kv().shape().kv_dtype(),
            format!("q{}g{}/float32", q.bits, q.group_size)
        );
        let got = drive(&mut runner, &rs, |_| false);
        // How far quantizing moves mlx-lm's own first log-probs, and how
        // far Weft is from mlx-lm's quantized run.
        let (mut moved, mut worst) = (0f32, 0f32);
        for (i, (tokens, lps)) in got.iter().enumerate() {
            let w = &want["results"][i];
            let wt = json_u32(&w["greedy"]);
            let n = rs[i].max_tokens;
            let margins = json_f64(&w["margins"]);
            let upto = margins[..n]
                .iter()
                .position(|&m| m < NEAR_TIE)
                .map_or(n, |p| p + 1);
            assert!(
                upto >= 8,
                "row {i}: near-tie at token {upto}; pick other prompts"
            );
            assert_eq!(
                &tokens[..upto],
                &wt[..upto],
                "{q:?} row {i}: greedy tokens differ from mlx-lm's quantized cache"
            );
            for (s, lp) in lps.iter().enumerate().take(upto) {
                let d = max_abs_diff(lp, &json_f32(&w["steps"][s]));
                worst = worst.max(d);
                assert!(d < TOL, "{q:?} row {i} step {s}: log-probs differ by {d}");
            }
            let f = json_f32(&full["results"][i]["steps"][0]);
            moved = moved.max(max_abs_diff(&f, &json_f32(&w["steps"][0])));
        }
        eprintln!(
            "{q:?}: worst |dlogprob| vs mlx-lm quantized {worst:.2e}; quantizing moved mlx-lm's first log-probs by up to {moved:.2e}"
        );
        // The match is the quantized cache's, not the model's: Weft is far
        // closer to mlx-lm's quantized run than that is to full precision.
        assert!(
            moved > 10.0 * worst,
            "{q:?}: quantization moved log-probs by {moved}, Weft differs by {worst}"
        );
    }
}

/// A prompt prefilled in two chunks (the second attends over the pool's
/// quantized blocks) gives the logits of one-shot prefill: a step's own
/// tokens are attended as the pool stores them.
#[test]
fn chunked_prefill_over_quantized_kv_equals_one_shot() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    let q = AffineQuant::new(4, 64);
    let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 512).collect();
    let last = |chunks: &[usize]| -> Vec<f32> {
        let mut runner = quantized_runner(&md, q);
        let mut kv = Kv::for_runner(&runner);
        let mut at = 0;
        let mut out = Vec::new();
        for &n in chunks {
            let mut steps = [RowStep {
                row: 0,
                tokens: prompt[at..at + n].to_vec(),
                start_pos: at,
                want_logits: true,
                ..Default::default()
            }];
            let l = step(&mut runner, &mut kv, &mut steps);
            out = l.row(0).to_vec();
            at += n;
        }
        out
    };
    let one = last(&[37]);
    let two = last(&[20, 17]);
    let three = last(&[5, 16, 16]);
    for (what, got) in [("two chunks", two), ("three chunks", three)] {
        let d = max_abs_diff(&one, &got);
        assert!(
            d < 1e-4,
            "{what}: last logits differ from one-shot prefill by {d}"
        );
    }
}

/// Faults mid-forward and after evaluation roll back the quantized pool's
/// writes: retried steps give the same tokens and log-probs.
#[test]
fn failed_steps_over_quantized_kv_roll_back_to_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    faults_roll_back(&rows(), &md, |md| {
        quantized_runner(md, AffineQuant::new(4, 64))
    });
}

/// Gemma 3's sliding-window layers over quantized K/V (both groups
/// quantized; a window of 8 that every row passes, rows of 1 to 40 tokens
/// joining and leaving): each row of the batch gets the tokens and log-probs
/// it gets alone. mlx-lm has no quantized rotating cache to compare with.
#[test]
fn sliding_window_rows_over_quantized_kv_match_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&["fixture", "--arch", "gemma3", "--out", md.to_str().unwrap()]);
    let q = AffineQuant::new(4, 32);
    let make = || {
        BatchRunner::with_memory_use(load(&md), 16, KvMemory::Blocks(96), None, Some(q)).unwrap()
    };
    let rs = rows();
    let mut batch = make();
    assert_eq!(batch.kv_groups().groups.len(), 2, "a sliding-window group");
    let together = drive(&mut batch, &rs, |_| false);
    for (i, r) in rs.iter().enumerate() {
        let alone_row = Row {
            ids: r.ids.clone(),
            max_tokens: r.max_tokens,
            join_step: 0,
        };
        let alone = drive(&mut make(), &[alone_row], |_| false);
        assert_eq!(
            together[i].0, alone[0].0,
            "row {i}: tokens differ in the batch"
        );
        for (s, (a, b)) in together[i].1.iter().zip(&alone[0].1).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(
                d < 1e-4,
                "row {i} step {s}: log-probs differ by {d} in the batch"
            );
        }
    }
}
