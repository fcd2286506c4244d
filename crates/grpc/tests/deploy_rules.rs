//! The deployment files stay true to the server: Prometheus rules pass
//! `promtool check` and their unit tests (`promtool test rules`), the scrape
//! config is valid, and every series the Grafana dashboard queries is one
//! Weft exports (or a recording rule of ours). Needs `promtool` (Debian's
//! `prometheus` package, which scripts/setup.sh installs).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn promtool(args: &[&str], dir: &Path) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool not runnable ({e}): install Debian's prometheus package (scripts/setup.sh does)")
        });
    assert!(
        out.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_rules_check_and_pass_their_unit_tests() {
    let dir = root().join("deploy/prometheus");
    promtool(&["check", "rules", "weft-rules.yml"], &dir);
    promtool(&["test", "rules", "weft-rules.test.yml"], &dir);
    promtool(&["check", "config", "prometheus.yml"], &dir);
}

/// Identifiers that look like Weft series in a PromQL expression.
fn series(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts = expr[i..].starts_with("weft_") || expr[i..].starts_with("weft:");
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if starts && boundary {
            let end = expr[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .map_or(expr.len(), |e| i + e);
            out.push(expr[i..end].to_string());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// The metric family of a series name (a histogram's `_bucket`, `_count`,
/// `_sum` series belong to it).
fn family(name: &str) -> &str {
    ["_bucket", "_count", "_sum"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

#[test]
fn the_dashboard_queries_only_exported_series() {
    let r = root();
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(r.join("deploy/grafana-weft.json")).unwrap())
            .expect("dashboard JSON");
    let rules = std::fs::read_to_string(r.join("deploy/prometheus/weft-rules.yml")).unwrap();
    let recorded: HashSet<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(|s| s.trim().to_string())
        .collect();
    // Metric names are string constants in these files.
    let sources: String = [
        "crates/scheduler/src/metrics.rs",
        "crates/grpc/src/server/metrics.rs",
        "crates/grpc/src/runtime.rs",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(r.join(p)).unwrap())
    .collect();
    let mut checked = 0;
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8);
    for p in panels {
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            for name in series(expr) {
                checked += 1;
                if name.contains(':') {
                    assert!(recorded.contains(&name), "{name} is not a recording rule");
                    continue;
                }
                assert!(
                    sources.contains(&format!("\"{}\"", family(&name))),
                    "the dashboard queries {name}, which Weft does not export"
                );
            }
        }
    }
    assert!(checked > 15, "{checked} series checked");
    // Recording rules only use exported series too.
    for line in rules.lines().filter(|l| l.contains("weft_")) {
        for name in series(line).into_iter().filter(|n| !n.contains(':')) {
            assert!(
                sources.contains(&format!("\"{}\"", family(&name))),
                "a rule uses {name}, which Weft does not export"
            );
        }
    }
}
