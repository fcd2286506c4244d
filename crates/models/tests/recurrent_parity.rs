//! Hybrid models with recurrent layers against mlx-lm on random-weight
//! fixtures mlx-lm makes: Qwen3.5 (`qwen3_5`: Gated DeltaNet layers beside
//! gated full attention) and Nemotron-H (`nemotron_h`: Mamba-2 blocks beside
//! attention and ReLU² MLP blocks). For each: rows that join and leave a
//! batch against each row run alone in mlx-lm, and for Qwen3.5 also against
//! mlx-lm's `BatchGenerator` (its `ArraysCache` rows) at the same schedule;
//! a prompt prefilled in chunks against the oracle running it
//! alone; and steps that fail mid-forward or after evaluation, rolled back and
//! retried, giving bit-identical results (the recurrent state is replaced in
//! place, so rollback must write it back).

mod common;

use common::*;
use weft_models::{BatchRunner, Lanes, ModelConfig, RowStep};

/// Both sides f32; differences are summation order.
const TOL: f32 = 2e-3;
/// Below this top-2 margin a greedy pick may legitimately differ.
const NEAR_TIE: f64 = 1e-3;

fn rows() -> Vec<Row> {
    let r = |ids: Vec<u32>, max_tokens, join_step| Row {
        ids,
        max_tokens,
        join_step,
    };
    vec![
        // Joined together, different lengths: one right-padded forward whose
        // shorter rows' state must stop at their own last token.
        r(vec![1, 2, 3, 4, 5], 30, 0),
        r(vec![7, 8], 36, 0),
        r((100..121).collect(), 28, 3),
        // Two blocks of 16 and a bit: attention layers span blocks.
        r((0..37).map(|i| (i * 37 % 511) as u32 + 1).collect(), 26, 6),
        r(vec![300, 301, 302], 30, 11),
    ]
}

/// Greedy tokens may differ only after a near-tie of the oracle's picks.
fn agreed_prefix(margins: &[f64]) -> usize {
    margins
        .iter()
        .position(|&m| m < NEAR_TIE)
        .map_or(margins.len(), |p| p + 1)
}

#[test]
fn qwen3_5_config_reads_the_layer_kinds_and_the_recurrent_shape() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "qwen3_5");
    let c = ModelConfig::load(&md).unwrap();
    assert_eq!(c.arch, weft_models::Arch::Qwen3_5);
    assert_eq!(c.recurrent_layers, vec![true, false, true, false]);
    assert!(c.attn_output_gate);
    // head_dim 32 x partial_rotary_factor 0.25.
    assert_eq!(c.rotary_dim, 8);
    let d = c.delta.expect("a Gated DeltaNet shape");
    assert_eq!(
        (d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.kernel),
        (2, 4, 32, 32, 4)
    );
    let model = load_f32(&md, false);
    let shape = model.kv_shape();
    // K/V only for the two attention layers; state for the two others.
    assert_eq!(shape.layer_counts(), (2, 0));
    assert_eq!(shape.recurrent.map(|r| r.count()), Some(2));
}

#[test]
fn nemotron_h_config_reads_the_blocks_and_the_mamba_shape() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "nemotron_h");
    let c = ModelConfig::load(&md).unwrap();
    assert_eq!(c.arch, weft_models::Arch::NemotronH);
    assert_eq!(c.num_layers, 6);
    assert_eq!(c.recurrent_layers, [true, false, false, true, false, false]);
    assert_eq!(c.mlp_layers, [false, false, true, false, true, false]);
    assert!(!c.use_rope && c.single_mixer);
    let m = c.mamba.expect("a Mamba-2 shape");
    assert_eq!(
        (m.heads, m.head_dim, m.state, m.groups, m.kernel),
        (4, 16, 16, 2, 4)
    );
    assert_eq!(m.conv_dim(), 128);
    let model = load_f32(&md, false);
    let shape = model.kv_shape();
    // K/V for the two attention blocks only; state for the two Mamba-2 ones.
    assert_eq!(shape.layer_counts(), (2, 0));
    assert_eq!(shape.recurrent.map(|r| r.count()), Some(2));
}

/// Qwen3.5's rows against mlx-lm's `BatchGenerator` at the same schedule,
/// and against each row run alone.
#[test]
fn qwen3_5_rows_joining_and_leaving_match_batch_generator_and_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "qwen3_5");
    batch_parity(
        "qwen3_5",
        &md,
        &batch_generator(&md, dir.path()),
        "BatchGenerator",
    );
    batch_parity("qwen3_5", &md, &alone(&md, dir.path()), "mlx-lm alone");
}

/// Nemotron-H's rows against each row run alone in mlx-lm. Not against
/// `BatchGenerator`: on this fixture its left-padded rows differ from mlx-lm's
/// own single-row run (the 2-token row padded by 3 by up to 4.7e-2 in
/// log-probability; the others exactly), and Weft's rows equal the
/// single-row run.
#[test]
fn nemotron_h_rows_joining_and_leaving_match_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), "nemotron_h");
    batch_parity("nemotron_h", &md, &alone(&md, dir.path()), "mlx-lm alone");
}

/// Per row: the oracle's greedy tokens, their top-2 margins and the full
/// log-probability vector at each step.
type Want = Vec<(Vec<u32>, Vec<f64>, Vec<Vec<f32>>)>;

fn batch_generator(md: &std::path::Path, dir: &std::path::Path) -> Want {
    let rs = rows();
    let req = serde_json::json!({
        "batch_size": rs.len(),
        "rows": rs.iter().map(|r| serde_json::json!({"ids": r.ids, "max_tokens": r.max_tokens, "join_step": r.join_step})).collect::<Vec<_>>(),
    });
    let req_path = dir.join("b.json");
    std::fs::write(&req_path, req.to_string()).unwrap();
    let want = oracle(&[
        "batch",
        "--model",
        md.to_str().unwrap(),
        "--requests",
        req_path.to_str().unwrap(),
    ]);
    (0..rs.len())
        .map(|i| {
            let w = &want["rows"][i];
            let full = (0..rs[i].max_tokens)
                .map(|s| json_f32(&w["full"][s]))
                .collect();
            (json_u32(&w["tokens"]), json_f64(&w["margins"]), full)
        })
        .collect()
}

fn alone(md: &std::path::Path, dir: &std::path::Path) -> Want {
    let rs = rows();
    let n = rs.iter().map(|r| r.max_tokens).max().unwrap();
    let prompts: Vec<_> = rs
        .iter()
        .map(|r| serde_json::json!({"ids": r.ids}))
        .collect();
    let req = dir.join("alone.json");
    std::fs::write(
        &req,
        serde_json::json!({"max_tokens": n, "full": true, "prompts": prompts}).to_string(),
    )
    .unwrap();
    let want = oracle(&[
        "run",
        "--model",
        md.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
    ]);
    rs.iter()
        .enumerate()
        .map(|(i, r)| {
            let w = &want["results"][i];
            let k = r.max_tokens;
            let full = (0..k).map(|s| json_f32(&w["steps"][s])).collect();
            (
                json_u32(&w["greedy"])[..k].to_vec(),
                json_f64(&w["margins"])[..k].to_vec(),
                full,
            )
        })
        .collect()
}

/// Weft's rows (MLX linears, the host GEMM, two CPU lanes) against `want`.
fn batch_parity(arch: &str, md: &std::path::Path, want: &Want, what: &str) {
    let rs = rows();
    let runs: Vec<(&str, BatchRunner)> = vec![
        ("mlx", runner(load_f32(md, false), 128)),
        ("host gemm", runner(load_f32(md, true), 128)),
        ("two lanes", {
            let mut r = runner(load_f32(md, true), 128);
            r.set_lanes(Lanes::cpu(2).with_min_tokens(1));
            r
        }),
    ];
    for (name, mut runner) in runs {
        assert!(runner.kv().has_state());
        let got = drive(&mut runner, &rs, |_| false);
        for (i, (tokens, lps)) in got.iter().enumerate() {
            let (wt, margins, full) = &want[i];
            let upto = agreed_prefix(margins);
            assert!(
                upto >= 24 || upto == wt.len(),
                "row {i}: near-tie at token {upto}; pick other prompts"
            );
            assert_eq!(
                &tokens[..upto],
                &wt[..upto],
                "{arch} {name}: row {i}: greedy tokens differ from {what}"
            );
            let mut worst = 0f32;
            for s in 0..upto {
                worst = worst.max(max_abs_diff(&lps[s], &full[s]));
            }
            eprintln!(
                "{arch} {name} vs {what}: row {i}: {upto} of {} tokens, worst |dlogprob| {worst:.2e}",
                wt.len()
            );
            assert!(
                worst < TOL,
                "{arch} {name}: row {i}: logprobs differ from {what} by {worst}"
            );
        }
    }
}

/// A 40-token prompt prefilled as chunks of 7, 16 and 17 tokens (the state
/// carried across steps), then decoded: the same as mlx-lm on the prompt
/// alone, and as the prompt in one step.
#[test]
fn qwen3_5_chunked_prefill_carries_the_state() {
    chunked_prefill("qwen3_5");
}

#[test]
fn nemotron_h_chunked_prefill_carries_the_state() {
    chunked_prefill("nemotron_h");
}

fn chunked_prefill(arch: &str) {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture_dir(dir.path(), arch);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 53 % 509) as u32 + 2).collect();
    let n = 24;
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::json!({"max_tokens": n, "prompts": [{"ids": prompt}]}).to_string(),
    )
    .unwrap();
    let want = oracle(&[
        "run",
        "--model",
        md.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
    ]);
    let w = &want["results"][0];
    let run = |chunks: &[usize]| -> (Vec<f32>, Vec<u32>) {
        let mut runner = runner(load_f32(&md, false), 64);
        let mut kv = Kv::for_runner(&runner);
        let mut at = 0;
        let mut first = Vec::new();
        for &c in chunks {
            let mut steps = vec![RowStep {
                row: 1,
                tokens: prompt[at..at + c].to_vec(),
                start_pos: at,
                want_logits: at + c == prompt.len(),
                ..Default::default()
            }];
            let l = step(&mut runner, &mut kv, &mut steps);
            at += c;
            if at == prompt.len() {
                first = l.row(0).to_vec();
            }
        }
        let mut out = vec![argmax(&first)];
        while out.len() < n {
            let mut steps = vec![RowStep {
                row: 1,
                tokens: vec![*out.last().unwrap()],
                start_pos: prompt.len() + out.len() - 1,
                want_logits: true,
                ..Default::default()
            }];
            let l = step(&mut runner, &mut kv, &mut steps);
            out.push(argmax(l.row(0)));
        }
        (first, out)
    };
    let (one_logits, one_tokens) = run(&[40]);
    let (logits, tokens) = run(&[7, 16, 17]);
    let diff = max_abs_diff(&logits, &json_f32(&w["logits"]));
    eprintln!("{arch} chunked: max |dlogit| vs mlx-lm {diff:.2e}");
    assert!(diff < TOL, "chunked prefill logits differ by {diff}");
    assert!(max_abs_diff(&logits, &one_logits) < TOL);
    let upto = agreed_prefix(&json_f64(&w["margins"])).min(n);
    assert!(upto >= 16, "near-tie at {upto}; pick another prompt");
    let wt = json_u32(&w["greedy"]);
    assert_eq!(&tokens[..upto], &wt[..upto], "chunked prefill tokens");
    assert_eq!(&one_tokens[..upto], &wt[..upto], "one-step prefill tokens");
}

#[test]
fn qwen3_5_failed_steps_roll_back_the_state_and_retry_to_the_same_tokens() {
    faults(&fixture_dir(tempfile::tempdir().unwrap().path(), "qwen3_5"));
}

#[test]
fn nemotron_h_failed_steps_roll_back_the_state_and_retry_to_the_same_tokens() {
    faults(&fixture_dir(
        tempfile::tempdir().unwrap().path(),
        "nemotron_h",
    ));
}

fn faults(md: &std::path::Path) {
    // Layer 0 is recurrent in both: a fault after layer 1 strikes after its
    // state was written, and so does every fault after evaluation.
    faults_roll_back(&rows(), md, |md| runner(load_f32(md, false), 128));
    faults_roll_back(&rows(), md, |md| runner(load_f32(md, true), 128));
}
