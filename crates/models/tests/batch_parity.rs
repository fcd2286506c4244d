//! Continuous batching parity: rows that join and leave at different steps,
//! decoded together by `BatchRunner`, against mlx-lm's `BatchGenerator` at the
//! same batch size; plus step rollback under injected faults.

mod common;

use common::*;
use weft_models::{BatchRunner, Lanes, LlamaModel, RowStep};

fn rows() -> Vec<Row> {
    let r = |ids: &[u32], max_tokens, join_step| Row {
        ids: ids.to_vec(),
        max_tokens,
        join_step,
    };
    vec![
        r(&[1, 2, 3, 4, 5], 34, 0),
        r(&[7], 40, 0),
        r(&[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12], 32, 3),
        r(&[100, 200], 36, 5),
        r(
            &[
                401, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 60,
            ],
            33,
            9,
        ),
        // Same length and join step as the row above: prefilled as one group.
        r(&(250..272).collect::<Vec<u32>>(), 32, 9),
    ]
}

fn fixture(dir: &std::path::Path, quantize: bool) -> std::path::PathBuf {
    let md = dir.join("m");
    let mut args = vec!["fixture", "--arch", "llama", "--out", md.to_str().unwrap()];
    if quantize {
        args.push("--quantize");
    }
    oracle(&args);
    md
}

/// KV blocks every test runner gets (16 tokens each).
const BLOCKS: u32 = 256;

fn new_runner(md: &std::path::Path) -> BatchRunner {
    runner(load(md), BLOCKS)
}

fn load(md: &std::path::Path) -> LlamaModel {
    // What `weft serve` runs on CPU.
    load_f32(md, true)
}

/// Logprobs within this of mlx-lm's (f32 both sides; padding changes
/// summation order only).
const TOL: f32 = 1e-3;
/// Below this top-2 margin a token may legitimately differ.
const NEAR_TIE: f64 = 1e-3;

#[test]
fn joining_and_leaving_rows_match_batch_generator() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), false);
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

    let mut runner = new_runner(&md);
    let one_lane = drive(&mut runner, &rs, |_| false);
    // Two CPU lanes with every step eligible to split: prefill groups are
    // halved and forwards of one step built on two streams.
    let mut runner = two_lanes(&md);
    let two_lanes = drive(&mut runner, &rs, |_| false);
    for (lanes, got) in [(1, one_lane), (2, two_lanes)] {
        eprintln!("{lanes} lane(s):");
        for (i, (tokens, lps)) in got.iter().enumerate() {
            let w = &want["rows"][i];
            let wt = json_u32(&w["tokens"]);
            let margins = json_f64(&w["margins"]);
            let min_margin = margins.iter().copied().fold(f64::INFINITY, f64::min);
            eprintln!(
                "row {i}: {} tokens, min top-2 margin {min_margin:.2e}",
                wt.len()
            );
            // Compare up to the first near-tie (after it, histories may diverge legitimately).
            let upto = margins
                .iter()
                .position(|&m| m < NEAR_TIE)
                .map_or(wt.len(), |p| p + 1);
            assert!(
                upto >= 32 || upto == wt.len(),
                "row {i}: near-tie at token {upto}; pick other prompts"
            );
            assert_eq!(
                &tokens[..upto],
                &wt[..upto],
                "row {i}: greedy tokens differ from BatchGenerator"
            );
            for s in 0..upto {
                let diff = max_abs_diff(&lps[s], &json_f32(&w["full"][s]));
                assert!(
                    diff < TOL,
                    "{lanes} lane(s), row {i} step {s}: logprobs differ by {diff}"
                );
            }
        }
    }
}

/// A runner whose steps all split over two CPU lanes when they can.
fn two_lanes(md: &std::path::Path) -> BatchRunner {
    let mut runner = new_runner(md);
    runner.set_lanes(Lanes::cpu(2).with_min_tokens(1));
    runner
}

#[test]
fn failed_steps_roll_back_and_retry_to_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), true);
    faults_roll_back(&rows(), &md, new_runner);
    // The same with each step's forwards spread over two CPU lanes.
    faults_roll_back(&rows(), &md, two_lanes);
}

/// At the default split threshold: four fresh prompts of 128-140 tokens that
/// arrive while another row decodes are prefilled as two halves on two lanes
/// (the decode on the lighter one), and every row gets the tokens and logits
/// a one-lane runner gives it.
#[test]
fn two_lanes_match_one_lane_at_the_default_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), false);
    let prompts: Vec<Vec<u32>> = [10usize, 140, 136, 132, 128]
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..n)
                .map(|i| ((i * 31 + r * 7 + 3) % 500) as u32)
                .collect()
        })
        .collect();
    let drive = |runner: &mut BatchRunner| {
        let mut kv = Kv::for_runner(runner);
        let mut next: Vec<Option<RowStep>> = vec![None; prompts.len()];
        let mut out: Vec<Vec<(u32, Vec<f32>)>> = vec![vec![]; prompts.len()];
        let mut lanes = vec![];
        for n in 0..10 {
            // Row 0 starts at step 0, rows 1-4 join together at step 2.
            for (r, p) in prompts.iter().enumerate() {
                if n == if r == 0 { 0 } else { 2 } {
                    next[r] = Some(RowStep {
                        row: r as u64,
                        tokens: p.clone(),
                        start_pos: 0,
                        want_logits: true,
                        ..Default::default()
                    });
                }
            }
            let mut active: Vec<RowStep> = next.iter().flatten().cloned().collect();
            let l = step(runner, &mut kv, &mut active);
            lanes.push(runner.lanes_used());
            for (k, a) in active.iter().enumerate() {
                let t = argmax(l.row(k));
                out[a.row as usize].push((t, l.row(k).to_vec()));
                let s = next[a.row as usize].as_mut().unwrap();
                s.start_pos += s.tokens.len();
                s.tokens = vec![t];
            }
        }
        (out, lanes)
    };
    let (want, one) = drive(&mut new_runner(&md));
    let mut runner = new_runner(&md);
    runner.set_lanes(Lanes::cpu(2));
    let (got, two) = drive(&mut runner);
    assert!(one.iter().all(|&n| n == 1), "one-lane runner split a step");
    assert_eq!(two[2], 2, "the joining step ran on both lanes");
    assert!(
        two.iter().enumerate().all(|(s, &n)| s == 2 || n == 1),
        "only the joining step is big enough to split: {two:?}"
    );
    for (r, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.len(), g.len());
        for (i, ((wt, wl), (gt, gl))) in w.iter().zip(g).enumerate() {
            assert_eq!(wt, gt, "row {r} token {i} differs on two lanes");
            let d = max_abs_diff(wl, gl);
            assert!(d < 1e-4, "row {r} logits {i} differ by {d} on two lanes");
        }
    }
}

/// A row started from a cached prefix (same tenant) maps the cached blocks
/// into its table (no copy) and continues exactly like a cold row; another
/// tenant gets no hit.
#[test]
fn prefix_reuse_matches_a_cold_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), false);
    let shared: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
    let second: Vec<u32> = [shared.clone(), vec![5, 6, 7]].concat();
    let one = |runner: &mut BatchRunner, kv: &mut Kv, row: u64, tokens: Vec<u32>, start: usize| {
        let mut s = [RowStep {
            row,
            tokens,
            start_pos: start,
            want_logits: true,
            ..Default::default()
        }];
        step(runner, kv, &mut s).row(0).to_vec()
    };
    // Cold: the second prompt alone, then 8 greedy tokens.
    let greedy_from = |runner: &mut BatchRunner, kv: &mut Kv, row: u64, start: usize| {
        let mut logits = one(runner, kv, row, second[start..].to_vec(), start);
        let mut out = vec![];
        for i in 0..8 {
            let t = argmax(&logits);
            out.push((t, logits.clone()));
            logits = one(runner, kv, row, vec![t], second.len() + i);
        }
        out
    };
    let mut cold = new_runner(&md);
    let mut cold_kv = Kv::for_runner(&cold);
    let want = greedy_from(&mut cold, &mut cold_kv, 1, 0);

    let mut warm = new_runner(&md);
    let mut kv = Kv::for_runner(&warm);
    // Tenant 1 prefills the shared prompt and finishes: its two full blocks
    // stay cached.
    one(&mut warm, &mut kv, 7, shared.clone(), 0);
    kv.release(7);
    assert_eq!(kv.pool.stats().groups[0].cached, 2);
    assert_eq!(
        kv.start_with_prefix(3, 2, &second),
        0,
        "cross-tenant prefix hit"
    );
    kv.release(3);
    let n = kv.start_with_prefix(2, 1, &second);
    assert_eq!(n, 32, "block-aligned reuse of the 40 shared tokens");
    let got = greedy_from(&mut warm, &mut kv, 2, n);
    for (i, ((wt, wl), (gt, gl))) in want.iter().zip(&got).enumerate() {
        assert_eq!(wt, gt, "token {i} differs after a prefix hit");
        assert!(
            max_abs_diff(wl, gl) < 1e-4,
            "logits {i} differ by {}",
            max_abs_diff(wl, gl)
        );
    }
}

/// Fresh rows of different lengths prefilled in one right-padded group decode
/// exactly like each row prefilled alone. (mlx-lm 0.32.2's `BatchGenerator`
/// is not a usable oracle here: three ragged joiners next to decoding rows
/// give a uniform first distribution for the padded row on some runs.)
#[test]
fn ragged_prefill_group_matches_rows_prefilled_alone() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), false);
    let prompts: Vec<Vec<u32>> = [22u32, 19, 9, 1]
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..n)
                .map(|i| (i * 53 + r as u32 * 101 + 7) % 512)
                .collect()
        })
        .collect();
    // Greedy continuation of every row, the prompts all prefilled in step 0.
    let run = |runner: &mut BatchRunner, rows: &[usize]| -> Vec<Vec<(u32, Vec<f32>)>> {
        let mut kv = Kv::for_runner(runner);
        let mut out: Vec<Vec<(u32, Vec<f32>)>> = vec![vec![]; rows.len()];
        let mut steps: Vec<RowStep> = rows
            .iter()
            .map(|&r| RowStep {
                row: r as u64,
                tokens: prompts[r].clone(),
                start_pos: 0,
                want_logits: true,
                ..Default::default()
            })
            .collect();
        for _ in 0..8 {
            let l = step(runner, &mut kv, &mut steps);
            for (k, s) in steps.iter_mut().enumerate() {
                assert_eq!(l.rows[k], s.row);
                let t = argmax(l.row(k));
                out[k].push((t, l.row(k).to_vec()));
                s.start_pos += s.tokens.len();
                s.tokens = vec![t];
            }
        }
        out
    };
    let mut together = new_runner(&md);
    let got = run(&mut together, &[0, 1, 2, 3]);
    let alone: Vec<Vec<(u32, Vec<f32>)>> = (0..prompts.len())
        .map(|r| run(&mut new_runner(&md), &[r]).remove(0))
        .collect();
    let check = |r: usize, got: &[(u32, Vec<f32>)]| {
        for (i, ((wt, wl), (gt, gl))) in alone[r].iter().zip(got).enumerate() {
            assert_eq!(wt, gt, "row {r} token {i} differs from its solo prefill");
            let d = max_abs_diff(wl, gl);
            assert!(d < 1e-4, "row {r} logits {i} differ by {d}");
        }
    };
    for (r, got) in got.iter().enumerate() {
        check(r, got);
    }

    // The group breaks up before it joins the batch: row 1 is released after
    // its first token and row 2 sits out step 1.
    let mut split = new_runner(&md);
    let mut kv = Kv::for_runner(&split);
    let mut next: Vec<RowStep> = (0..prompts.len())
        .map(|r| RowStep {
            row: r as u64,
            tokens: prompts[r].clone(),
            start_pos: 0,
            want_logits: true,
            ..Default::default()
        })
        .collect();
    let mut out: Vec<Vec<(u32, Vec<f32>)>> = vec![vec![]; prompts.len()];
    for i in 0..8 {
        let mut active: Vec<RowStep> = next
            .iter()
            .filter(|s| {
                let released = i >= 1 && s.row == 1;
                let sits_out = i == 1 && s.row == 2;
                !released && !sits_out
            })
            .cloned()
            .collect();
        let l = step(&mut split, &mut kv, &mut active);
        for (k, a) in active.iter().enumerate() {
            let t = argmax(l.row(k));
            out[a.row as usize].push((t, l.row(k).to_vec()));
            let s = &mut next[a.row as usize];
            s.start_pos += s.tokens.len();
            s.tokens = vec![t];
        }
        if i == 0 {
            kv.release(1);
        }
    }
    for r in [0, 2, 3] {
        check(r, &out[r]);
    }
    assert_eq!(out[2].len(), 7);
}

/// Speculative decoding in the runner: rows verify drafts of 0-3 tokens, some
/// right, some wrong at a varying position, so rows keep different numbers of
/// tokens per step (the pool truncates what was rejected: no holes) while
/// others join and leave. Every row's tokens and log-probs equal plain
/// one-token decoding's.
#[test]
fn drafts_with_partial_acceptance_match_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let md = fixture(dir.path(), false);
    let rs = rows();
    let want = drive(&mut new_runner(&md), &rs, |_| false);

    let mut runner = new_runner(&md);
    let mut kv = Kv::for_runner(&runner);
    let mut out: Trace = rs.iter().map(|_| (vec![], vec![])).collect();
    let mut active: Vec<usize> = vec![];
    let (mut step, mut drafted, mut accepted, mut partial) = (0, 0, 0, 0);
    while out.iter().zip(&rs).any(|(o, r)| o.0.len() < r.max_tokens) {
        for (i, r) in rs.iter().enumerate() {
            if r.join_step == step && !active.contains(&i) && out[i].0.is_empty() {
                active.push(i);
            }
        }
        let mut steps: Vec<RowStep> = active
            .iter()
            .map(|&i| {
                let (gen, ids) = (&out[i].0, &rs[i].ids);
                if gen.is_empty() {
                    return RowStep {
                        row: i as u64,
                        tokens: ids.clone(),
                        start_pos: 0,
                        want_logits: true,
                        ..Default::default()
                    };
                }
                let g = gen.len();
                let k = ((step + i) % 4).min(rs[i].max_tokens - g - 1);
                let bad = (i * 3 + step) % 5;
                let mut tokens = vec![gen[g - 1]];
                for j in 0..k {
                    let right = want[i].0[g + j];
                    tokens.push(if j == bad { (right + 1) % 500 } else { right });
                }
                RowStep {
                    row: i as u64,
                    tokens,
                    start_pos: ids.len() + g - 1,
                    want_logits: true,
                    draft: k,
                    ..Default::default()
                }
            })
            .collect();
        let ops = kv.plan(&mut steps);
        let logits = runner.forward(&ops, &steps).expect("step");
        assert_eq!(logits.counts.len(), steps.len());
        let mut at = 0;
        for ((s, &n), &row) in steps.iter().zip(&logits.counts).zip(&logits.rows) {
            assert_eq!(row, s.row);
            assert_eq!(n, 1 + s.draft);
            let i = s.row as usize;
            let mut kept = 0;
            for j in 0..n {
                let lp = log_softmax(logits.row(at + j));
                let t = argmax(&lp);
                out[i].0.push(t);
                out[i].1.push(lp);
                kept += 1;
                if j + 1 == n || s.tokens[j + 1] != t {
                    break;
                }
            }
            if s.draft > 0 {
                kv.truncate(s.row, s.start_pos + kept);
                drafted += s.draft;
                accepted += kept - 1;
                partial += usize::from(kept - 1 < s.draft);
            }
            at += n;
        }
        runner.commit().unwrap();
        kv.commit();
        active.retain(|&i| {
            let done = out[i].0.len() >= rs[i].max_tokens;
            if done {
                kv.release(i as u64);
            }
            !done
        });
        step += 1;
    }
    assert_eq!(kv.rows(), 0);
    assert_eq!(kv.pool.stats().groups[0].used, 0);
    assert!(
        accepted > 20 && partial > 10,
        "{drafted} drafted, {accepted} accepted, {partial} partial"
    );
    for (i, ((gt, gl), (wt, wl))) in out.iter().zip(&want).enumerate() {
        assert_eq!(gt, wt, "row {i} tokens");
        for (k, (a, b)) in gl.iter().zip(wl).enumerate() {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(d < 1e-4, "row {i} token {k}: logprobs differ by {d}");
        }
    }
}
