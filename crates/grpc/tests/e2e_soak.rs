//! The soak benchmark's 2-minute CI version (issue 17 item 3): `weft bench
//! --scenario soak` against a real `weft serve` on the default model, two
//! tenants, mixed prompt and output lengths, cancels and disconnects. Every
//! request that was not dropped on purpose completes with all its tokens, KV
//! blocks and calls in flight return to their baseline, MLX's peak stays
//! inside the memory plan the server logged and exports, and MLX's buffer
//! cache inside its cap. (RSS flatness needs the long run: benches/RESULTS.md.)

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_run_loses_no_request_and_gives_every_block_back() {
    let tenants = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/tenant-mix.toml");
    let s = Server::start(&["--tenants", tenants.to_str().unwrap()]).await;
    let log = s.stderr();
    assert!(
        log.contains("memory plan: weights"),
        "no memory plan at startup:\n{log}"
    );
    let text = s.metrics().await;
    let plan = metric(&text, "weft_memory_plan_bytes", &["part=\"total\""])
        .expect("the plan's total is exported");
    let cache_cap = metric(&text, "weft_memory_plan_bytes", &["part=\"cache_limit\""])
        .expect("the cache cap is exported");
    assert!(
        plan > cache_cap && cache_cap > 0.0,
        "plan {plan}, cache cap {cache_cap}"
    );

    let json = s.dir.path().join("soak.json");
    let (target, metrics_url, json_arg) = (
        format!("grpc://{}", s.grpc_addr),
        format!("http://{}/metrics", s.metrics_addr),
        json.to_str().unwrap().to_string(),
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["bench", "--scenario", "soak", "--quiet"])
            .args(["--target", &target, "--metrics-url", &metrics_url])
            .args([
                "--tenant",
                "flood:flood-key:3",
                "--tenant",
                "light:light-key:1",
            ])
            .args(["-c", "6", "--duration", "120s", "--sample-every", "5s"])
            .args([
                "--prompt-tokens",
                "uniform:16:500",
                "--max-tokens",
                "uniform:4:64",
            ])
            .args(["--cancel-fraction", "0.15", "--disconnect-fraction", "0.1"])
            .args(["--seed", "7", "--timeout", "300s", "--json", &json_arg])
            .output()
            .expect("running weft bench")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "soak failed:\n{stdout}\n{stderr}\nserver:\n{}",
        s.stderr()
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON report")).unwrap();
    let o = &r["outcomes"];
    let n = |k: &str| o[k].as_u64().unwrap_or(0);
    assert_eq!(n("lost"), 0, "{stdout}");
    assert!(n("completed") >= 10, "{stdout}");
    assert!(n("cancelled") >= 1 && n("disconnected") >= 1, "{stdout}");
    assert_eq!(r["no_request_lost"], true, "{stdout}");
    assert_eq!(r["blocks_back"], true, "{stdout}");
    assert_eq!(r["end"]["kv_blocks_used"], r["baseline"]["kv_blocks_used"]);
    assert_eq!(r["within_plan"], true, "{stdout}");

    // After the run: MLX's cache within its cap, nothing running or waiting.
    let text = s.metrics().await;
    let cache = metric(&text, "weft_mlx_cache_memory_bytes", &[]).unwrap();
    assert!(
        cache <= cache_cap,
        "MLX cache {cache} over its cap {cache_cap}"
    );
    assert_eq!(metric(&text, "weft_num_requests_running", &[]), Some(0.0));
    assert_eq!(metric(&text, "weft_num_requests_waiting", &[]), Some(0.0));
}
