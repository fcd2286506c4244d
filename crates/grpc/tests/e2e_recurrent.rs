//! Recurrent hybrids served end to end: `weft serve` on mlx-lm's random
//! Qwen3.5 fixture (Gated DeltaNet layers beside gated attention) and its
//! Nemotron-H fixture (Mamba-2 blocks beside attention and MLP blocks), each
//! with a word-level tokenizer `w0 .. w511` written beside it, and 4 state
//! slots.
//! Six concurrent greedy requests of different lengths (more than there are
//! slots, so rows wait for one and take over released ones) must each equal
//! mlx-lm running that prompt alone; the API reports the layer kinds and the
//! state slots, the metrics the slots' use. Then the same burst on a server
//! whose steps fail to allocate (the scheduler splits and retries them, the
//! recurrent state rolled back each time) must give the same tokens.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use weft_grpc::pb;

const NEW_TOKENS: u32 = 12;
/// The oracle's top-2 logit margin below which our pick may legitimately
/// differ.
const NEAR_TIE: f64 = 1e-3;
const SLOTS: u32 = 4;

fn oracle(args: &[&str]) -> serde_json::Value {
    let out = Command::new(oracle_python())
        .arg(workspace_root().join("tests/oracle/mlx_lm_oracle.py"))
        .args(args)
        .output()
        .expect("running the oracle");
    assert!(
        out.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if out.stdout.is_empty() {
        return serde_json::Value::Null;
    }
    serde_json::from_slice(&out.stdout).expect("oracle JSON")
}

/// The fixture plus a whitespace word-level tokenizer: word `wN` is token N.
fn model_dir(dir: &Path, arch: &str) -> PathBuf {
    let md = dir.join(format!("{arch}-fixture"));
    oracle(&[
        "fixture",
        "--arch",
        arch,
        "--out",
        md.to_str().expect("utf-8 path"),
    ]);
    let vocab: serde_json::Map<String, serde_json::Value> = (0..512)
        .map(|i| (format!("w{i}"), serde_json::json!(i)))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(md.join("tokenizer.json"), tok.to_string()).expect("tokenizer");
    md
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5],
        vec![7, 8],
        (100..121).collect(),
        (0..37).map(|i| (i * 37 % 511) + 1).collect(),
        vec![300, 301, 302],
        (40..58).collect(),
    ]
}

fn text(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn burst(s: &Server) -> Vec<Collected> {
    let ch = s.channel().await;
    let calls = prompts().into_iter().map(|p| {
        let mut c = pb::generation_client::GenerationClient::new(ch.clone());
        async move {
            let mut r = text_req(&text(&p), NEW_TOKENS);
            r.ignore_eos = true;
            collect(&mut c, with(r, None, Some(Duration::from_secs(600))))
                .await
                .expect("stream")
        }
    });
    futures_util::future::join_all(calls).await
}

/// Each completion equals mlx-lm's greedy tokens on its prompt alone, up to
/// the oracle's first near-tie.
fn check(got: &[Collected], want: &serde_json::Value, what: &str) {
    for (i, c) in got.iter().enumerate() {
        assert!(c.status.is_none(), "{what}: request {i}: {:?}", c.status);
        let w = &want["results"][i];
        let greedy: Vec<u32> = w["greedy"]
            .as_array()
            .expect("greedy")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let upto = w["margins"]
            .as_array()
            .expect("margins")
            .iter()
            .position(|m| m.as_f64().expect("margin") < NEAR_TIE)
            .map_or(greedy.len(), |p| p + 1);
        assert!(
            upto >= 8,
            "request {i}: near-tie at {upto}; pick other prompts"
        );
        eprintln!("{what}: request {i}: {} ids, {upto} compared", c.ids.len());
        assert_eq!(c.ids.len(), NEW_TOKENS as usize, "{what}: request {i}");
        assert_eq!(
            &c.ids[..upto],
            &greedy[..upto],
            "{what}: request {i}: tokens differ from mlx-lm alone"
        );
        assert_eq!(c.text, text(&c.ids), "{what}: request {i}: text");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_5_serves_more_rows_than_slots_as_each_runs_alone() {
    // Per recurrent layer: the convolution's 3 x 256 inputs and 4 heads of
    // 32 x 32 delta-rule state, f32 on the CPU; two such layers.
    serves(
        "qwen3_5",
        &[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        2 * (3 * 256 + 4 * 32 * 32) * 4,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemotron_h_serves_more_rows_than_slots_as_each_runs_alone() {
    // Per Mamba-2 block: the convolution's 3 x 128 inputs and 4 heads of
    // 16 x 16 SSM state, f32 on the CPU; two such blocks.
    serves(
        "nemotron_h",
        &[
            "linear_attention",
            "full_attention",
            "mlp",
            "linear_attention",
            "mlp",
            "full_attention",
        ],
        2 * (3 * 128 + 4 * 16 * 16) * 4,
    )
    .await;
}

async fn serves(arch: &str, kinds: &[&str], state_bytes: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let md = model_dir(dir.path(), arch);
    let req = dir.path().join("req.json");
    let ps: Vec<serde_json::Value> = prompts()
        .iter()
        .map(|p| serde_json::json!({ "ids": p }))
        .collect();
    std::fs::write(
        &req,
        serde_json::json!({ "max_tokens": NEW_TOKENS, "prompts": ps }).to_string(),
    )
    .expect("requests");
    let want = oracle(&[
        "run",
        "--model",
        md.to_str().expect("utf-8"),
        "--requests",
        req.to_str().expect("utf-8"),
    ]);
    let slots = SLOTS.to_string();
    let args = [
        "--model",
        md.to_str().expect("utf-8"),
        "--max-batch-rows",
        slots.as_str(),
    ];

    let s = Server::start(&args).await;
    let mut c = s.client().await;
    let m = c
        .get_model(with(
            pb::GetModelRequest {
                name: String::new(),
            },
            None,
            None,
        ))
        .await
        .expect("GetModel")
        .into_inner();
    assert_eq!(m.architecture, arch);
    assert_eq!(m.layer_kinds, kinds);
    assert_eq!(m.state_slots, SLOTS);
    assert_eq!(m.state_bytes_per_row, state_bytes);
    let groups: Vec<(&str, u32)> = m
        .kv_groups
        .iter()
        .map(|g| (g.kind.as_str(), g.layers))
        .collect();
    assert_eq!(
        groups,
        [("full", 2)],
        "K/V blocks for the attention layers only"
    );
    assert!(
        s.stderr().contains(&format!("{SLOTS} slots")),
        "the startup log states the state slots"
    );

    let got = burst(&s).await;
    check(&got, &want, "served");
    let text = s.metrics().await;
    assert_eq!(
        metric(&text, "weft_state_slots", &["state=\"used\""]),
        Some(0.0),
        "every slot back once the requests finished"
    );
    assert_eq!(
        metric(&text, "weft_state_slots", &["state=\"free\""]),
        Some(f64::from(SLOTS))
    );
    drop(s);

    // Steps 3 to 6 fail to allocate: split, retried, nothing lost.
    let s = Server::start_env(&args, &[("WEFT_TEST_FAULTS", "alloc:3-6")]).await;
    let got = burst(&s).await;
    check(&got, &want, "with failed steps");
    assert!(
        s.stderr().contains("injected allocation failure"),
        "the faults fired"
    );
}
