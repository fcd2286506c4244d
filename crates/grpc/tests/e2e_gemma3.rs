//! Gemma 3 served end to end: a real `weft serve --model gemma3-270m` (pulled
//! into the cache on first use, ~240 MB; `WEFT_GEMMA3_TESTS=off` skips this
//! file) takes a burst of concurrent greedy requests of very different prompt
//! lengths — two longer than the 512-token sliding window, three of a few
//! tokens — which prefill and decode in the same batches. Each completion must
//! equal the same request run alone (batch invariance), and the short ones run
//! alone must agree with mlx-lm's `gemma3_text` on the same text up to its
//! first near-tie. The startup log must show the sliding-window layers holding only
//! their windows' blocks, and every block must come back afterwards.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use weft_grpc::pb;
use weft_grpc::server::tenants::hash_key;

const ALONE: &str = "alone-key";
const BATCH: &str = "batch-key";
const NEW_TOKENS: u32 = 8;
/// The oracle's top-2 logit margin below which our pick may legitimately
/// differ (the CPU's tuned kernels are within ~1e-4 of mlx-lm's logits).
const NEAR_TIE: f64 = 1e-2;

fn enabled() -> bool {
    let off = std::env::var("WEFT_GEMMA3_TESTS").is_ok_and(|v| v == "off" || v == "0");
    if off {
        eprintln!("skipped: WEFT_GEMMA3_TESTS=off");
    }
    !off
}

/// A prompt of `n` numbered notes (~20 tokens each) and a question.
fn long_prompt(n: usize, topic: &str) -> String {
    let colors = ["red", "green", "blue", "yellow", "white"];
    let animals = ["fox", "heron", "badger", "otter", "crow", "hare"];
    let places = ["river", "old mill", "orchard", "harbour", "hill"];
    let mut s = format!("These are notes about {topic}.\n");
    for i in 0..n {
        s.push_str(&format!(
            "Note {i}: the {} {} walked to the {} and counted {} stones.\n",
            colors[i % colors.len()],
            animals[i % animals.len()],
            places[i % places.len()],
            i * 7 % 31
        ));
    }
    s.push_str("Question: which animal walked to the river first? Answer:");
    s
}

fn requests() -> Vec<pb::GenerateRequest> {
    let prompts = [
        long_prompt(30, "a valley"),
        "Q: What is the capital of France?\nA:".to_string(),
        long_prompt(42, "a coast"),
        "The capital of France is".to_string(),
        "1, 2, 3, 4,".to_string(),
    ];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = text_req(p, NEW_TOKENS);
            r.ignore_eos = true;
            r.request_id = format!("g{i}");
            r
        })
        .collect()
}

async fn run(
    s: &Server,
    key: &str,
    reqs: &[pb::GenerateRequest],
    together: bool,
) -> Vec<Collected> {
    let call = |r: pb::GenerateRequest| {
        let key = key.to_string();
        async move {
            let mut c = s.client().await;
            collect(&mut c, with(r, Some(&key), Some(Duration::from_secs(900))))
                .await
                .expect("stream")
        }
    };
    if together {
        futures_util::future::join_all(reqs.iter().cloned().map(call)).await
    } else {
        let mut out = Vec::new();
        for r in reqs {
            out.push(call(r.clone()).await);
        }
        out
    }
}

/// mlx-lm's greedy ids and margins for each prompt text, run alone.
fn oracle(
    model: &std::path::Path,
    reqs: &[pb::GenerateRequest],
) -> Vec<(usize, Vec<u32>, Vec<f64>)> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("requests.json");
    let prompts: Vec<serde_json::Value> = reqs
        .iter()
        .map(|r| match &r.input {
            Some(pb::generate_request::Input::Text(t)) => serde_json::json!({ "text": t }),
            other => panic!("text requests only: {other:?}"),
        })
        .collect();
    std::fs::write(
        &path,
        serde_json::json!({ "max_tokens": NEW_TOKENS, "prompts": prompts }).to_string(),
    )
    .expect("write requests");
    let python = oracle_python();
    let out = Command::new(&python)
        .arg(workspace_root().join("tests/oracle/mlx_lm_oracle.py"))
        .args(["run", "--model"])
        .arg(model)
        .arg("--requests")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("oracle JSON");
    let nums = |x: &serde_json::Value| -> Vec<f64> {
        x.as_array()
            .expect("array")
            .iter()
            .map(|n| n.as_f64().expect("number"))
            .collect()
    };
    v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            let prompt = r["ids"].as_array().expect("ids").len();
            let greedy = nums(&r["greedy"]).into_iter().map(|x| x as u32).collect();
            (prompt, greedy, nums(&r["margins"]))
        })
        .collect()
}

/// Prompt tokens a finished stream reports.
fn prompt_tokens(c: &Collected) -> usize {
    c.finished
        .as_ref()
        .and_then(|f| f.usage)
        .map_or(0, |u| u.prompt_tokens as usize)
}

/// `key=value` of the server's KV startup line.
fn log_field(log: &str, key: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains("KV pool:"))?;
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_batches_mixed_lengths_as_each_runs_alone() {
    if !enabled() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"alone\"\napi_key_sha256 = \"{}\"\n\n\
             [[tenant]]\nname = \"batch\"\napi_key_sha256 = \"{}\"\n",
            hash_key(ALONE),
            hash_key(BATCH)
        ),
    )
    .expect("tenant file");
    // Two tenants: their prefix caches are apart, so the batch computes every
    // prompt afresh rather than from the blocks the lone runs left.
    let s = Server::start(&[
        "--model",
        "gemma3-270m",
        "--tenants",
        tenants.to_str().expect("utf-8 path"),
        "--max-batch-rows",
        "8",
        "--speculate",
        "0",
    ])
    .await;
    let log = s.stderr();
    let (full, sliding) = (
        log_field(&log, "kv_blocks").expect("kv_blocks in the startup log"),
        log_field(&log, "kv_sliding_blocks").expect("kv_sliding_blocks in the startup log"),
    );
    eprintln!("KV pool: full-attention group {full} blocks, sliding-window group {sliding}");
    // 8 rows x (32 window blocks + 2) + a step's 2056 tokens: the windows only.
    assert_eq!(sliding, 8 * 34 + 2056u64.div_ceil(16));
    assert!(full > 4 * sliding, "full {full}, sliding {sliding}");
    // The API and the metrics say the same: 5 local layers to 1 global.
    let mut c = s.client().await;
    let m = c
        .get_model(with(
            pb::GetModelRequest {
                name: String::new(),
            },
            Some(ALONE),
            None,
        ))
        .await
        .expect("GetModel")
        .into_inner();
    assert_eq!(m.architecture, "gemma3_text");
    assert_eq!(m.sliding_window, 512);
    let kinds: Vec<bool> = m
        .layer_kinds
        .iter()
        .map(|k| k == "sliding_attention")
        .collect();
    assert_eq!(kinds.len(), 18);
    assert!(kinds
        .iter()
        .enumerate()
        .all(|(i, &sliding)| sliding == (i % 6 != 5)));
    let groups: Vec<(&str, u32, u64)> = m
        .kv_groups
        .iter()
        .map(|g| (g.kind.as_str(), g.layers, u64::from(g.blocks)))
        .collect();
    assert_eq!(groups, [("full", 3, full), ("sliding_window", 15, sliding)]);
    let text = s.metrics().await;
    for (kind, blocks) in [("full", full), ("sliding_window", sliding)] {
        let k = format!("kind=\"{kind}\"");
        assert_eq!(
            metric(&text, "weft_kv_kind_blocks", &[&k]),
            Some(blocks as f64),
            "{kind}: used + free + cached"
        );
    }

    let reqs = requests();
    let alone = run(&s, ALONE, &reqs, false).await;
    let together = run(&s, BATCH, &reqs, true).await;

    let mut long = 0;
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        for (what, c) in [("alone", a), ("batched", b)] {
            assert!(c.status.is_none(), "request {i} {what}: {:?}", c.status);
            assert_eq!(c.ids.len(), NEW_TOKENS as usize, "request {i} {what}");
            assert!(!c.text.trim().is_empty(), "request {i} {what}: empty text");
        }
        let prompt = prompt_tokens(a);
        long += usize::from(prompt > 512);
        eprintln!("request {i}: {prompt} prompt tokens -> {:?}", a.text);
        assert_eq!(
            b.ids, a.ids,
            "request {i}: batched tokens differ from alone"
        );
        assert_eq!(
            b.text, a.text,
            "request {i}: batched text differs from alone"
        );
    }
    assert_eq!(long, 2, "two prompts longer than the 512-token window");

    // mlx-lm on the short prompts (on this CPU its full-vocabulary logits for
    // every position of a long prompt take minutes; parity past the window is
    // `crates/models/tests/gemma3_parity.rs`, on a fixture with an 8-token one).
    let model = weft_grpc::runtime::resolve_model("gemma3-270m", false).expect("cached model");
    let short: Vec<usize> = (0..reqs.len())
        .filter(|&i| prompt_tokens(&alone[i]) <= 64)
        .collect();
    assert_eq!(short.len(), 3);
    let picked: Vec<pb::GenerateRequest> = short.iter().map(|&i| reqs[i].clone()).collect();
    let want = oracle(&model, &picked);
    for (&i, (prompt, greedy, margins)) in short.iter().zip(&want) {
        let a = &alone[i];
        assert_eq!(prompt_tokens(a), *prompt, "request {i}: prompt ids");
        let agreed = margins
            .iter()
            .position(|&m| m < NEAR_TIE)
            .map_or(greedy.len(), |p| p + 1);
        assert_eq!(
            a.ids[..agreed],
            greedy[..agreed],
            "request {i}: differs from mlx-lm before its first near-tie"
        );
    }
    assert!(
        alone[1].text.contains("Paris"),
        "not sensible: {:?}",
        alone[1].text
    );
    wait_metric(
        &s,
        "weft_kv_blocks_used",
        &[],
        |v| v == 0.0,
        Duration::from_secs(10),
    )
    .await;
}
