//! End-to-end: a real Prometheus (Debian's package) scrapes a live `weft serve`
//! (two tenants, a short load with one refusal) with Weft's rule files loaded:
//! the target is up, the gateway gauges and request counters arrive, every
//! recording and alert rule evaluates without error, and every expression the
//! Grafana dashboard, the rules and the prometheus-adapter rule (the HPA's
//! metric) ship is evaluated through Prometheus's HTTP API: it must parse and
//! every Weft series it selects must exist.

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener as StdListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use tonic::Code;
use weft_grpc::server::tenants::hash_key;

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
    let dir = tempfile::tempdir().unwrap();
    // Two tenants, so the per-tenant series and the dashboard's tenant
    // variable have values; bob's small budget makes one refusal.
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"alice\"\napi_key_sha256 = \"{}\"\nweight = 2.0\n\n\
             [[tenant]]\nname = \"bob\"\napi_key_sha256 = \"{}\"\ntokens_per_minute = 60\n",
            hash_key(ALICE),
            hash_key(BOB)
        ),
    )
    .unwrap();
    let s = Server::start(&[
        "--metrics-aliases",
        "vllm",
        "--tenants",
        tenants.to_str().unwrap(),
    ])
    .await;
    // Traffic, so histograms and counters have samples.
    let mut c = s.client().await;
    for i in 0..3 {
        c.generate(with(
            text_req(&format!("Count to {i}:"), 6),
            Some(ALICE),
            None,
        ))
        .await
        .expect("generate");
    }
    // ~40 of bob's 60 tokens a minute pass; the same again is refused at once.
    let bob = || {
        let mut r = text_req("Count", 36);
        r.ignore_eos = true;
        with(r, Some(BOB), None)
    };
    c.generate(bob()).await.expect("bob's first call");
    assert_code(
        c.generate(bob()).await,
        Code::ResourceExhausted,
        "tokens/minute",
    );
    let rules =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/prometheus/weft-rules.yml");
    let rules = rules.canonicalize().unwrap();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: weft\n    static_configs:\n      - targets: [\"{}\"]\n\
             \x20       labels: {{namespace: {NAMESPACE}, pod: {POD}}}\n",
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

    // Every expression the rules and the dashboard ship, evaluated live.
    let mut exprs: Vec<(String, String)> = Vec::new();
    for g in &groups {
        for r in g["rules"].as_array().unwrap() {
            let q = r["query"].as_str().expect("rule query").to_string();
            exprs.push((format!("rule {}", r["name"]), q));
        }
    }
    let rules_n = exprs.len();
    assert!(rules_n >= 15, "{rules_n} rules");
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana-weft.json"),
        )
        .unwrap(),
    )
    .expect("dashboard JSON");
    let vars = dashboard_variables(&api, &dash).await;
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            let raw = t["expr"].as_str().expect("expr");
            let q = substitute(raw, &vars);
            exprs.push((format!("panel {:?} {raw:?}", p["title"]), q));
        }
    }
    assert!(exprs.len() - rules_n >= 15, "dashboard expressions");
    exprs.extend(adapter_queries());
    let t0 = Instant::now();
    for (from, q) in &exprs {
        // Recording rules' series appear at their group's next evaluation.
        loop {
            match check_expr(&api, q).await {
                Ok(()) => break,
                Err(e) if t0.elapsed() > Duration::from_secs(120) => {
                    panic!("{from}: {q}: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    // The check can fail: a series Weft does not export, a label its series
    // lack, a label value no series has, and an expression that does not parse.
    for bad in [
        "rate(weft_not_exported_total[1m])",
        "sum(weft:not_recorded:rate1m)",
        "sum by (tenant) (weft_requests_waiting{tennant=~\"alice\"})",
        "weft_grpc_requests_total{code=\"no_such_code\"}",
        "sum(rate(weft_generation_tokens_total[1m]) by (tenant)",
    ] {
        assert!(
            check_expr(&api, bad).await.is_err(),
            "{bad} passed the check"
        );
    }
}

/// The labels a ServiceMonitor scrape gives a pod's series (the static
/// target here carries them too), which prometheus-adapter maps to objects.
const NAMESPACE: &str = "weft-test";
const POD: &str = "weft-0";

/// prometheus-adapter's queries (deploy/kubernetes/prometheus-adapter-values.yaml)
/// as the adapter runs them for the HPA: the series query, and the metrics
/// query with its template filled in for one pod.
fn adapter_queries() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/kubernetes/prometheus-adapter-values.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    // Single-quoted YAML scalars on one line.
    let values = |key: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| {
                let v = l.trim().trim_start_matches("- ").strip_prefix(key)?.trim();
                let v = v.strip_prefix('\'')?.strip_suffix('\'')?;
                Some(v.replace("''", "'"))
            })
            .collect()
    };
    let series = values("seriesQuery:");
    let metrics = values("metricsQuery:");
    assert!(
        !series.is_empty() && series.len() == metrics.len(),
        "adapter rules"
    );
    let mut out = Vec::new();
    for (sq, mq) in series.iter().zip(&metrics) {
        let name = sq.split('{').next().unwrap().to_string();
        let q = mq
            .replace("<<.Series>>", &name)
            .replace(
                "<<.LabelMatchers>>",
                &format!("namespace=\"{NAMESPACE}\",pod=~\"{POD}\""),
            )
            .replace("<<.GroupBy>>", "pod");
        assert!(!q.contains("<<"), "adapter template left in {q}");
        out.push((format!("adapter seriesQuery {sq}"), sq.clone()));
        out.push((format!("adapter metricsQuery {mq}"), q));
    }
    out
}

const ALICE: &str = "alice-prometheus-key";
const BOB: &str = "bob-prometheus-key";

/// Selectors whose series only exist after failures, which this run has
/// none of: their metric and label names must exist, their values need not.
const ONLY_AFTER_FAILURES: &[&str] = &["code=~\"internal|unknown|data_loss\""];

/// Concrete values for the dashboard's template variables and Grafana's
/// built-in ones. A `label_values(metric, label)` variable takes a value that
/// label has in Prometheus (there must be one).
async fn dashboard_variables(api: &str, dash: &Value) -> BTreeMap<String, String> {
    let mut vars: BTreeMap<String, String> = [
        ("__rate_interval", "1m"),
        ("__interval", "15s"),
        ("__range", "5m"),
        ("__range_s", "300"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for v in dash["templating"]["list"].as_array().expect("templating") {
        let name = v["name"].as_str().expect("variable name").to_string();
        let value = match v["type"].as_str().expect("variable type") {
            // Picks the data source; no expression names it.
            "datasource" => continue,
            "query" => {
                let def = v["query"]["query"]
                    .as_str()
                    .or_else(|| v["query"].as_str())
                    .expect("query variable");
                let args = def
                    .strip_prefix("label_values(")
                    .and_then(|a| a.strip_suffix(')'))
                    .unwrap_or_else(|| panic!("variable {name}: {def} is not label_values(..)"));
                let (metric, label) = args
                    .rsplit_once(',')
                    .unwrap_or_else(|| panic!("variable {name}: {def}"));
                let url = format!(
                    "{api}/label/{}/values?match[]={}",
                    label.trim(),
                    urlencode(metric.trim())
                );
                let values = until(&format!("values of ${name}"), 60, || async {
                    let r = get(&url).await?;
                    let vs = r["data"].as_array()?.clone();
                    (!vs.is_empty()).then_some(vs)
                })
                .await;
                values[0].as_str().unwrap().to_string()
            }
            "custom" => v["query"]
                .as_str()
                .and_then(|q| q.split(',').next())
                .expect("custom variable")
                .trim()
                .to_string(),
            other => panic!("variable {name}: type {other} has no test value here"),
        };
        vars.insert(name, value);
    }
    vars
}

/// `$name`, `${name}` and `[[name]]` replaced by the variables' values; no
/// variable may be left over.
fn substitute(expr: &str, vars: &BTreeMap<String, String>) -> String {
    let mut q = expr.to_string();
    // Longest names first, so `$__range_s` is not read as `$__range` + `_s`.
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for n in names {
        let v = &vars[n];
        q = q
            .replace(&format!("${{{n}}}"), v)
            .replace(&format!("[[{n}]]"), v)
            .replace(&format!("${n}"), v);
    }
    assert!(
        !q.contains('$') && !q.contains("[["),
        "{expr}: a template variable without a test value"
    );
    q
}

/// A series selector in a PromQL expression: the metric name and the
/// matchers' label names.
#[derive(Debug, PartialEq)]
struct Selector {
    text: String,
    name: String,
    labels: Vec<String>,
}

/// The selectors of Weft's series (`weft_*`, recording rules' `weft:*`, the
/// `vllm:*` aliases) in an expression; string literals are skipped.
fn selectors(expr: &str) -> Vec<Selector> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'"' || c == b'\'' || c == b'`' {
            i = skip_string(b, i);
            continue;
        }
        if !ident(c) || c.is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && ident(b[i]) {
            i += 1;
        }
        let name = &expr[start..i];
        if !["weft_", "weft:", "vllm:"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            continue;
        }
        let mut j = i;
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        let mut labels = Vec::new();
        let mut end = i;
        if j < b.len() && b[j] == b'{' {
            let mut k = j + 1;
            let mut label = String::new();
            while k < b.len() && b[k] != b'}' {
                match b[k] {
                    b'"' | b'\'' | b'`' => {
                        if !label.is_empty() {
                            labels.push(std::mem::take(&mut label));
                        }
                        k = skip_string(b, k);
                        continue;
                    }
                    c if c.is_ascii_alphanumeric() || c == b'_' => label.push(c as char),
                    _ => {
                        if !label.is_empty() {
                            labels.push(std::mem::take(&mut label));
                        }
                    }
                }
                k += 1;
            }
            end = (k + 1).min(b.len());
            i = end;
        }
        out.push(Selector {
            text: format!("{name}{}", &expr[i.min(j)..end].trim_start()),
            name: name.to_string(),
            labels,
        });
    }
    out
}

/// The index just past the string literal starting at `i`.
fn skip_string(b: &[u8], i: usize) -> usize {
    let quote = b[i];
    let mut k = i + 1;
    while k < b.len() && b[k] != quote {
        if b[k] == b'\\' && quote != b'`' {
            k += 1;
        }
        k += 1;
    }
    k + 1
}

/// Evaluates `q` through `/api/v1/query` (it must succeed) and checks that
/// every Weft series it selects exists (`/api/v1/series`): the metric, each
/// label its matchers name, and the whole selector.
async fn check_expr(api: &str, q: &str) -> Result<(), String> {
    let r = get(&format!("{api}/query?query={}", urlencode(q)))
        .await
        .ok_or("no JSON answer")?;
    if r["status"] != "success" {
        return Err(format!("{}: {}", r["errorType"], r["error"]));
    }
    let sels = selectors(q);
    if sels.is_empty() {
        return Err("selects no Weft series".into());
    }
    let series = |m: String| async move {
        let r = get(&format!("{api}/series?match[]={}", urlencode(&m))).await?;
        r["data"].as_array().cloned()
    };
    for s in sels {
        let named = series(s.name.clone()).await.unwrap_or_default();
        if named.is_empty() {
            return Err(format!("no series {}", s.name));
        }
        for l in &s.labels {
            if !named.iter().any(|x| x.get(l).is_some()) {
                return Err(format!("no series {} has a label {l}", s.name));
            }
        }
        if ONLY_AFTER_FAILURES.iter().any(|f| s.text.contains(f)) {
            continue;
        }
        if series(s.text.clone()).await.unwrap_or_default().is_empty() {
            return Err(format!("no series matches {}", s.text));
        }
    }
    Ok(())
}

#[test]
fn selectors_are_found_outside_strings() {
    let s = selectors(
        r#"sum by (le) (rate(weft_x_bucket{le="2", code=~"a|b}"}[5m])) / weft:y + on(t) vllm:z{} + label_replace(up, "d", "weft_no", "", "")"#,
    );
    let got: Vec<(&str, &str, Vec<&str>)> = s
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.text.as_str(),
                s.labels.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "weft_x_bucket",
                r#"weft_x_bucket{le="2", code=~"a|b}"}"#,
                vec!["le", "code"]
            ),
            ("weft:y", "weft:y", vec![]),
            ("vllm:z", "vllm:z{}", vec![]),
        ]
    );
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
