//! Qwen3.5 (Gated DeltaNet layers beside gated full attention) against
//! mlx-lm's `qwen3_5` on a random-weight fixture mlx-lm makes: rows that join
//! and leave a batch against mlx-lm's `BatchGenerator` (its `ArraysCache`
//! rows) at the same schedule; a prompt prefilled in chunks against the
//! oracle running it alone; and steps that fail mid-forward or after
//! evaluation, rolled back and retried, giving bit-identical results (the
//! recurrent state is replaced in place, so rollback must write it back).

mod common;

use common::*;
use weft_models::{BatchRunner, Lanes, ModelConfig, RowStep};

/// Both sides f32; differences are summation order.
const TOL: f32 = 2e-3;
/// Below this top-2 margin a greedy pick may legitimately differ.
const NEAR_TIE: f64 = 1e-3;

fn fixture(dir: &std::path::Path) -> std::path::PathBuf {
    fixture_dir(dir, "qwen3_5")
}

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
fn config_reads_the_layer_kinds_and_the_recurrent_shape() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
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
fn joining_and_leaving_rows_match_batch_generator() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    let rs = rows();
    let req = serde_json::json!({
        "batch_size": rs.len(),
        "rows": rs.iter().map(|r| serde_json::json!({"ids": r.ids, "max_tokens": r.max_tokens, "join_step": r.join_step})).collect::<Vec<_>>(),
    });
    let req_path = dir.path().join("b.json");
    std::fs::write(&req_path, req.to_string()).unwrap();
    let want = oracle(&[
        "batch",
        "--model",
        md.to_str().unwrap(),
        "--requests",
        req_path.to_str().unwrap(),
    ]);
    let runs: Vec<(&str, BatchRunner)> = vec![
        ("mlx", runner(load_f32(&md, false), 128)),
        ("host gemm", runner(load_f32(&md, true), 128)),
        ("two lanes", {
            let mut r = runner(load_f32(&md, true), 128);
            r.set_lanes(Lanes::cpu(2).with_min_tokens(1));
            r
        }),
    ];
    for (name, mut runner) in runs {
        assert!(runner.kv().has_state());
        let got = drive(&mut runner, &rs, |_| false);
        for (i, (tokens, lps)) in got.iter().enumerate() {
            let w = &want["rows"][i];
            let wt = json_u32(&w["tokens"]);
            let upto = agreed_prefix(&json_f64(&w["margins"]));
            eprintln!("{name}: row {i}: {} of {} tokens compared", upto, wt.len());
            assert!(
                upto >= 24 || upto == wt.len(),
                "row {i}: near-tie at token {upto}; pick other prompts"
            );
            assert_eq!(
                &tokens[..upto],
                &wt[..upto],
                "{name}: row {i}: greedy tokens differ from BatchGenerator"
            );
            let mut worst = 0f32;
            for s in 0..upto {
                worst = worst.max(max_abs_diff(&lps[s], &json_f32(&w["full"][s])));
            }
            eprintln!("{name}: row {i}: worst |dlogprob| {worst:.2e}");
            assert!(worst < TOL, "{name}: row {i}: logprobs differ by {worst}");
        }
    }
}

/// A 40-token prompt prefilled as chunks of 7, 16 and 17 tokens (the state
/// carried across steps), then decoded: the same as mlx-lm on the prompt
/// alone, and as the prompt in one step.
#[test]
fn chunked_prefill_carries_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
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
    eprintln!("chunked: max |dlogit| vs mlx-lm {diff:.2e}");
    assert!(diff < TOL, "chunked prefill logits differ by {diff}");
    assert!(max_abs_diff(&logits, &one_logits) < TOL);
    let upto = agreed_prefix(&json_f64(&w["margins"])).min(n);
    assert!(upto >= 16, "near-tie at {upto}; pick another prompt");
    let wt = json_u32(&w["greedy"]);
    assert_eq!(&tokens[..upto], &wt[..upto], "chunked prefill tokens");
    assert_eq!(&one_tokens[..upto], &wt[..upto], "one-step prefill tokens");
}

#[test]
fn failed_steps_roll_back_the_state_and_retry_to_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path());
    // Layer 0 is recurrent: a fault after layer 1 strikes after its state
    // was written, and so does every fault after evaluation.
    faults_roll_back(&rows(), &md, |md| runner(load_f32(md, false), 128));
    faults_roll_back(&rows(), &md, |md| runner(load_f32(md, true), 128));
}
