//! End-to-end: a real Prometheus (Debian's package) scrapes a live `weft serve`
//! with Weft's rule files loaded: the target is up, the gateway gauges and
//! request counters arrive, every recording and alert rule evaluates without
//! error, and the recording rules produce series after traffic.

mod common;

use std::net::TcpListener as StdListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn get(url: &str) -> Option<Value> {
    let r = reqwest::get(url).await.ok()?;
    serde_json::from_slice(&r.bytes().await.ok()?).ok()
}

/// Polls `f` every 250 ms until it returns Some (or panics after `secs`).
async fn until<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what} within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_weft_and_evaluates_its_rules() {
    let s = Server::start(&["--metrics-aliases", "vllm"]).await;
    // Traffic, so histograms and counters have samples.
    let mut c = s.client().await;
    for i in 0..3 {
        c.generate(text_req(&format!("Count to {i}:"), 6))
            .await
            .expect("generate");
    }
    let dir = tempfile::tempdir().unwrap();
    let rules =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/prometheus/weft-rules.yml");
    let rules = rules.canonicalize().unwrap();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: weft\n    static_configs:\n      - targets: [\"{}\"]\n",
            rules.display(),
            s.metrics_addr
        ),
    )
    .unwrap();
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect(
            "prometheus not runnable: install Debian's prometheus package (scripts/setup.sh does)",
        );
    let _p = Prometheus(child);
    let api = format!("http://127.0.0.1:{port}/api/v1");
    let query = |q: &str| {
        let url = format!("{api}/query?query={}", urlencode(q));
        async move {
            let v = get(&url).await?;
            let r = v["data"]["result"].as_array()?.first()?.clone();
            r["value"][1].as_str()?.parse::<f64>().ok()
        }
    };
    let up = until("the weft target up", 60, || query("up{job=\"weft\"}")).await;
    assert_eq!(up, 1.0);
    for q in [
        "weft_build_info",
        "weft_num_requests_running",
        "vllm:kv_cache_usage_perc",
        "sum(weft_grpc_requests_total{code=\"ok\"})",
    ] {
        let v = until(q, 30, || query(q)).await;
        assert!(v >= 0.0, "{q} = {v}");
    }
    // Every rule group loaded and evaluates without error.
    let groups = until("rules evaluated", 60, || async {
        let v = get(&format!("{api}/rules")).await?;
        let groups = v["data"]["groups"].as_array()?.clone();
        let evaluated = groups.iter().all(|g| {
            g["rules"].as_array().is_some_and(|rs| {
                rs.iter().all(|r| {
                    r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
                })
            })
        });
        (groups.len() == 2 && evaluated).then_some(groups)
    })
    .await;
    for g in &groups {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "rule {} : {}", r["name"], r["lastError"]);
        }
    }
    // A recording rule over the request counters has a value after traffic.
    let ratio = until("weft:errors:ratio_5m", 60, || query("weft:errors:ratio_5m")).await;
    assert_eq!(ratio, 0.0, "no call failed");
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
