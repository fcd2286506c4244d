//! Gemma 3 text against mlx-lm's `gemma3_text` on a random-weight fixture
//! mlx-lm makes (5 layers, a global layer every third, a sliding window of 8
//! tokens, GQA, q/k norms, `query_pre_attn_scalar` != head_dim, untied head):
//! one row at a time past the window, and rows that join and leave a batch
//! after they passed it, each against the oracle running that row alone
//! (mlx-lm's own batching of sliding-window caches is not the oracle:
//! ml-explore/mlx-lm #983, #1776).

mod common;

use common::*;
use weft_models::{LlamaModel, ModelConfig};

const N: usize = 32;
/// Both sides f32; differences are summation order.
const TOL: f32 = 2e-3;
/// Below this top-2 margin a greedy pick may legitimately differ.
const NEAR_TIE: f64 = 1e-3;
const WINDOW: usize = 8;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5],
        vec![17],
        (100..121).collect(),
        // Longer than the window and two blocks: the prefill itself slides.
        (0..40).map(|i| (i * 37 % 511) as u32 + 1).collect(),
    ]
}

/// mlx-lm on each prompt alone: last-position logits, greedy tokens, margins.
fn oracle_runs(md: &std::path::Path, ps: &[Vec<u32>], n: usize) -> serde_json::Value {
    let dir = md.parent().unwrap();
    let req = dir.join("req.json");
    let prompts: Vec<_> = ps.iter().map(|p| serde_json::json!({"ids": p})).collect();
    std::fs::write(
        &req,
        serde_json::json!({"max_tokens": n, "prompts": prompts}).to_string(),
    )
    .unwrap();
    oracle(&[
        "run",
        "--model",
        md.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
    ])
}

fn fixture(dir: &std::path::Path) -> std::path::PathBuf {
    let md = dir.join("m");
    oracle(&["fixture", "--arch", "gemma3", "--out", md.to_str().unwrap()]);
    md
}

/// Greedy tokens may differ only after a near-tie of the oracle's picks.
fn agreed_prefix(margins: &[f64]) -> usize {
    margins
        .iter()
        .position(|&m| m < NEAR_TIE)
        .map_or(margins.len(), |p| p + 1)
}

#[test]
fn config_reads_gemma3_layers_and_scales() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    let c = ModelConfig::load(&md).unwrap();
    assert_eq!(c.sliding_layers, vec![true, true, false, true, true]);
    assert_eq!(c.sliding_window, Some(WINDOW as i32));
    assert_eq!(c.rope_local_theta, Some(10000.0));
    assert!((c.attn_scale - 24f32.powf(-0.5)).abs() < 1e-7);
    // sqrt(128) = 11.3137 rounded to bf16 as mlx-lm does.
    assert_eq!(c.embed_scale, Some(11.3125));
}

#[test]
fn one_row_matches_mlx_lm_past_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    let ps = prompts();
    let want = oracle_runs(&md, &ps, N);
    for policy in ["mlx", "cpu"] {
        let model: LlamaModel = load_f32(&md, policy == "cpu");
        for (i, p) in ps.iter().enumerate() {
            let w = &want["results"][i];
            let (logits, tokens) = greedy(&model, p, N);
            let diff = max_abs_diff(&logits, &json_f32(&w["logits"]));
            eprintln!(
                "{policy} prompt {i} ({} tokens): max |dlogit| {diff:.2e}",
                p.len()
            );
            assert!(diff < TOL, "prompt {i}: logits differ by {diff}");
            let wt = json_u32(&w["greedy"]);
            let upto = agreed_prefix(&json_f64(&w["margins"]));
            assert!(
                upto >= 24,
                "prompt {i}: near-tie at {upto}; pick other prompts"
            );
            assert_eq!(&tokens[..upto], &wt[..upto], "prompt {i} ({policy})");
        }
    }
}

#[test]
fn batched_rows_joining_and_leaving_match_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    let r = |ids: Vec<u32>, max_tokens, join_step| Row {
        ids,
        max_tokens,
        join_step,
    };
    let ps = prompts();
    let rows = vec![
        r(ps[0].clone(), 34, 0),
        r(ps[1].clone(), 40, 0),
        r(ps[2].clone(), 30, 3),
        r(ps[3].clone(), 26, 6),
        r(vec![300, 301], 30, 11),
    ];
    let n = rows.iter().map(|r| r.max_tokens).max().unwrap();
    let all: Vec<Vec<u32>> = rows.iter().map(|r| r.ids.clone()).collect();
    let want = oracle_runs(&md, &all, n);
    let mut runner = runner(load_f32(&md, true), 256);
    // Every long row's sliding-window table must shed the blocks behind its
    // window while it decodes (the full-attention table keeps them all). The
    // pool drops them at a row's next append, so after a decode step a row
    // holds the blocks of its last window: 2 blocks of 16 cover 8 keys.
    let mut shed = vec![false; rows.len()];
    let mut steps_seen = vec![0usize; rows.len()];
    let got = drive_watched(
        &mut runner,
        &rows,
        |_| false,
        |kv, active| {
            for &i in active {
                steps_seen[i] += 1;
                let (full_first, full_len) = kv.table(i as u64, 0);
                let (slide_first, slide_len) = kv.table(i as u64, 1);
                assert_eq!(
                    full_first, 0,
                    "row {i}: a full-attention table drops nothing"
                );
                assert!(
                    steps_seen[i] == 1 || slide_len <= WINDOW.div_ceil(16) + 1,
                    "row {i}: {slide_len} sliding-window blocks held (full table {full_len})"
                );
                shed[i] |= slide_first > 0;
            }
        },
    );
    for (i, (tokens, _)) in got.iter().enumerate() {
        let w = &want["results"][i];
        let wt = json_u32(&w["greedy"]);
        let upto = agreed_prefix(&json_f64(&w["margins"])).min(rows[i].max_tokens);
        eprintln!(
            "row {i}: {} prompt tokens, {upto} compared",
            rows[i].ids.len()
        );
        assert!(
            upto >= 24,
            "row {i}: near-tie at {upto}; pick other prompts"
        );
        assert_eq!(
            &tokens[..upto],
            &wt[..upto],
            "row {i}: batched tokens differ from mlx-lm alone"
        );
        let total = rows[i].ids.len() + rows[i].max_tokens;
        if total > 2 * 16 {
            assert!(
                shed[i],
                "row {i} ({total} tokens) never released a sliding-window block"
            );
        }
    }
}
