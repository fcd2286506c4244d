//! Per-request measurements, their aggregation into histograms, and the report
//! (JSON and a printed table).
//!
//! Latencies are recorded in microseconds in HDR histograms (3 significant
//! digits, 1 µs to 1 h; longer values are clamped to 1 h) and reported in
//! milliseconds.
//!
//! Inter-token latency (ITL): servers send tokens in deltas that may carry
//! several tokens at once. A delta with `k` tokens that arrives `g` after the
//! previous delta contributes `k` samples of `g / k` — the gap is divided
//! across its tokens, so the ITL samples of a request add up to its decode
//! time (last token arrival minus first token arrival) and there is exactly
//! one sample per token after those of the first delta. The first delta's
//! tokens are covered by TTFT and give no ITL samples.
//!
//! Throughput counts only successful requests: requests/s is successful
//! completions per second and output tokens/s is their tokens per second, both
//! over the measured wall time (from the end of warm-up to the last
//! completion, or to Ctrl-C).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Status of a successful request.
pub const OK: &str = "OK";

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct RequestRecord {
    /// Index into the tenant list.
    pub tenant: usize,
    /// `OK`, a gRPC code name (`RESOURCE_EXHAUSTED`), `HTTP 429`, or a client
    /// side failure (`TIMEOUT`, `CONNECT_ERROR`, `INCOMPLETE_STREAM`, ...).
    pub status: String,
    /// Time to the first delta with at least one token.
    pub ttft: Option<Duration>,
    /// ITL samples (see the module docs).
    pub itl: Vec<Duration>,
    /// Send to end of stream.
    pub e2e: Duration,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Prompt length as the server reported it.
    pub prompt_tokens: Option<u64>,
    /// Finish reason as the server gave it (`length`, `eos`, `stop`, ...).
    pub finish_reason: Option<String>,
    /// Error detail, for the report's examples.
    pub error: Option<String>,
}

impl RequestRecord {
    /// A failed request.
    pub fn failed(tenant: usize, status: impl Into<String>, error: impl Into<String>) -> Self {
        Self {
            tenant,
            status: status.into(),
            error: Some(error.into()),
            ..Self::default()
        }
    }

    /// Whether the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == OK
    }
}

/// Records token arrivals of one stream into TTFT and ITL.
#[derive(Debug)]
pub struct TokenClock {
    start: std::time::Instant,
    last: Option<std::time::Instant>,
    /// Time to the first token, once one arrived.
    pub ttft: Option<Duration>,
    /// ITL samples so far.
    pub itl: Vec<Duration>,
    /// Tokens so far.
    pub tokens: u64,
}

impl TokenClock {
    /// Starts the clock (call right before sending the request).
    pub fn start() -> Self {
        Self::started_at(std::time::Instant::now())
    }

    /// A clock started at `start`.
    pub fn started_at(start: std::time::Instant) -> Self {
        Self {
            start,
            last: None,
            ttft: None,
            itl: Vec::new(),
            tokens: 0,
        }
    }

    /// `k` tokens arrived now.
    pub fn tokens_arrived(&mut self, k: u64) {
        self.tokens_arrived_at(k, std::time::Instant::now());
    }

    /// `k` tokens arrived at `now`. Deltas with no tokens are ignored.
    pub fn tokens_arrived_at(&mut self, k: u64, now: std::time::Instant) {
        if k == 0 {
            return;
        }
        match self.last {
            None => self.ttft = Some(now.saturating_duration_since(self.start)),
            Some(last) => {
                let share = now.saturating_duration_since(last) / k as u32;
                self.itl.extend(std::iter::repeat_n(share, k as usize));
            }
        }
        self.last = Some(now);
        self.tokens += k;
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

const MAX_US: u64 = 3_600_000_000;

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_US, 3).expect("valid histogram bounds")
}

fn us(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, MAX_US)
}

/// Aggregates of one group (all requests, or one tenant).
#[derive(Debug, Clone)]
pub struct Aggregate {
    ttft: Histogram<u64>,
    itl: Histogram<u64>,
    e2e: Histogram<u64>,
    ok: u64,
    statuses: BTreeMap<String, u64>,
    finish: BTreeMap<String, u64>,
    output_tokens: u64,
    prompt_tokens_sum: u64,
    prompt_tokens_n: u64,
}

impl Default for Aggregate {
    fn default() -> Self {
        Self {
            ttft: hist(),
            itl: hist(),
            e2e: hist(),
            ok: 0,
            statuses: BTreeMap::new(),
            finish: BTreeMap::new(),
            output_tokens: 0,
            prompt_tokens_sum: 0,
            prompt_tokens_n: 0,
        }
    }
}

impl Aggregate {
    /// Adds one request. Only successful requests enter the latency
    /// histograms and token counts; failures count by status.
    pub fn add(&mut self, r: &RequestRecord) {
        *self.statuses.entry(r.status.clone()).or_default() += 1;
        if !r.is_ok() {
            return;
        }
        self.ok += 1;
        if let Some(t) = r.ttft {
            self.ttft.saturating_record(us(t));
        }
        for &g in &r.itl {
            self.itl.saturating_record(us(g));
        }
        self.e2e.saturating_record(us(r.e2e));
        self.output_tokens += r.output_tokens;
        if let Some(p) = r.prompt_tokens {
            self.prompt_tokens_sum += p;
            self.prompt_tokens_n += 1;
        }
        if let Some(f) = &r.finish_reason {
            *self.finish.entry(f.clone()).or_default() += 1;
        }
    }

    /// Requests seen (successful or not).
    pub fn requests(&self) -> u64 {
        self.statuses.values().sum()
    }

    /// Successful requests.
    pub fn ok(&self) -> u64 {
        self.ok
    }

    /// Failed requests.
    pub fn errors(&self) -> u64 {
        self.requests() - self.ok
    }

    /// Output tokens of successful requests.
    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// The report of this group over `wall` seconds.
    pub fn report(&self, name: &str, wall: f64) -> GroupReport {
        let per_s = |x: u64| if wall > 0.0 { x as f64 / wall } else { 0.0 };
        GroupReport {
            name: name.to_string(),
            requests: self.requests(),
            ok: self.ok,
            errors: self.errors(),
            errors_by_status: self
                .statuses
                .iter()
                .filter(|(k, _)| k.as_str() != OK)
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            finish_reasons: self.finish.clone(),
            requests_per_s: per_s(self.ok),
            output_tokens: self.output_tokens,
            output_tokens_per_s: per_s(self.output_tokens),
            mean_output_tokens: if self.ok > 0 {
                self.output_tokens as f64 / self.ok as f64
            } else {
                0.0
            },
            mean_prompt_tokens: (self.prompt_tokens_n > 0)
                .then(|| self.prompt_tokens_sum as f64 / self.prompt_tokens_n as f64),
            ttft_ms: LatencySummary::of(&self.ttft),
            itl_ms: LatencySummary::of(&self.itl),
            e2e_ms: LatencySummary::of(&self.e2e),
        }
    }
}

/// Latency percentiles in milliseconds (all 0 when `count` is 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl LatencySummary {
    fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self {
                count: 0,
                mean: 0.0,
                p50: 0.0,
                p90: 0.0,
                p99: 0.0,
                max: 0.0,
            };
        }
        let ms = |v: u64| v as f64 / 1000.0;
        Self {
            count: h.len(),
            mean: h.mean() / 1000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
        }
    }
}

/// One group's numbers (overall or one tenant).
#[derive(Debug, Clone, Serialize)]
pub struct GroupReport {
    /// `overall` or the tenant's name.
    pub name: String,
    /// Measured requests that ended (successful or not).
    pub requests: u64,
    /// Successful requests.
    pub ok: u64,
    /// Failed requests.
    pub errors: u64,
    /// Failed requests by status (gRPC code name, `HTTP nnn`, client error).
    pub errors_by_status: BTreeMap<String, u64>,
    /// Successful requests by finish reason.
    pub finish_reasons: BTreeMap<String, u64>,
    /// Successful requests per second of measured wall time.
    pub requests_per_s: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Output tokens per second of measured wall time.
    pub output_tokens_per_s: f64,
    /// Mean output tokens per successful request.
    pub mean_output_tokens: f64,
    /// Mean prompt tokens as the server reported them (absent when it didn't).
    pub mean_prompt_tokens: Option<f64>,
    /// Time to first token.
    pub ttft_ms: LatencySummary,
    /// Inter-token latency.
    pub itl_ms: LatencySummary,
    /// End-to-end latency.
    pub e2e_ms: LatencySummary,
}

/// The whole run's report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Where the load went.
    pub target: String,
    /// `weft` (gRPC) or `openai` (HTTP SSE).
    pub api: String,
    /// How load was generated, e.g. `closed loop, concurrency 8`.
    pub mode: String,
    /// The settings the run used.
    pub config: serde_json::Value,
    /// Unix time (seconds) the measured phase started.
    pub started_at_unix_s: f64,
    /// Measured wall time in seconds.
    pub duration_s: f64,
    /// True when Ctrl-C ended the run early (requests still in flight then
    /// were dropped, not counted).
    pub interrupted: bool,
    /// Warm-up requests sent (excluded from every number below).
    pub warmup_requests: u64,
    /// Warm-up requests that failed.
    pub warmup_errors: u64,
    /// All tenants together.
    pub overall: GroupReport,
    /// One entry per tenant, in the order given.
    pub tenants: Vec<GroupReport>,
    /// A few distinct error messages (status: detail).
    pub error_examples: Vec<String>,
}

/// Collects records into overall and per-tenant aggregates.
#[derive(Debug, Clone)]
pub struct Collector {
    names: Vec<String>,
    overall: Aggregate,
    tenants: Vec<Aggregate>,
    examples: Vec<String>,
}

/// Distinct error examples kept for the report.
const MAX_EXAMPLES: usize = 10;

impl Collector {
    /// A collector for these tenant names.
    pub fn new(names: Vec<String>) -> Self {
        let tenants = names.iter().map(|_| Aggregate::default()).collect();
        Self {
            names,
            overall: Aggregate::default(),
            tenants,
            examples: Vec::new(),
        }
    }

    /// Adds one measured request.
    pub fn add(&mut self, r: &RequestRecord) {
        self.overall.add(r);
        if let Some(t) = self.tenants.get_mut(r.tenant) {
            t.add(r);
        }
        if let Some(e) = &r.error {
            let mut line = format!("{}: {}", r.status, e.trim());
            if line.len() > 300 {
                let mut cut = 300;
                while !line.is_char_boundary(cut) {
                    cut -= 1;
                }
                line.truncate(cut);
                line.push('…');
            }
            if self.examples.len() < MAX_EXAMPLES && !self.examples.contains(&line) {
                self.examples.push(line);
            }
        }
    }

    /// All tenants together.
    pub fn overall(&self) -> &Aggregate {
        &self.overall
    }

    /// (overall, per tenant, error examples) over `wall` seconds.
    pub fn reports(&self, wall: f64) -> (GroupReport, Vec<GroupReport>, Vec<String>) {
        (
            self.overall.report("overall", wall),
            self.tenants
                .iter()
                .zip(&self.names)
                .map(|(a, n)| a.report(n, wall))
                .collect(),
            self.examples.clone(),
        )
    }
}

/// Renders the report as an aligned text table: one column per group
/// (overall first, then tenants when there is more than one), one row per
/// metric.
pub fn render_table(r: &BenchReport) -> String {
    let mut groups: Vec<&GroupReport> = vec![&r.overall];
    if r.tenants.len() > 1 {
        groups.extend(r.tenants.iter());
    }
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let f0 = |x: u64| x.to_string();
    let f2 = |x: f64| format!("{x:.2}");
    let row = |label: &str, f: &dyn Fn(&GroupReport) -> String| {
        (label.to_string(), groups.iter().map(|g| f(g)).collect())
    };
    rows.push(row("requests ok", &|g| f0(g.ok)));
    rows.push(row("errors", &|g| f0(g.errors)));
    let mut statuses: Vec<&String> = groups
        .iter()
        .flat_map(|g| g.errors_by_status.keys())
        .collect();
    statuses.sort();
    statuses.dedup();
    for s in statuses {
        rows.push(row(&format!("  {s}"), &|g| {
            f0(g.errors_by_status.get(s).copied().unwrap_or(0))
        }));
    }
    rows.push(row("requests/s", &|g| f2(g.requests_per_s)));
    rows.push(row("output tokens/s", &|g| f2(g.output_tokens_per_s)));
    rows.push(row("mean output tokens", &|g| f2(g.mean_output_tokens)));
    if groups.iter().any(|g| g.mean_prompt_tokens.is_some()) {
        rows.push(row("mean prompt tokens", &|g| {
            g.mean_prompt_tokens.map(f2).unwrap_or_else(|| "-".into())
        }));
    }
    let mut reasons: Vec<&String> = groups
        .iter()
        .flat_map(|g| g.finish_reasons.keys())
        .collect();
    reasons.sort();
    reasons.dedup();
    for s in reasons {
        rows.push(row(&format!("finish {s}"), &|g| {
            f0(g.finish_reasons.get(s).copied().unwrap_or(0))
        }));
    }
    type Pick = fn(&GroupReport) -> &LatencySummary;
    let lat: [(&str, Pick); 3] = [
        ("TTFT", |g| &g.ttft_ms),
        ("ITL", |g| &g.itl_ms),
        ("E2E", |g| &g.e2e_ms),
    ];
    for (name, pick) in lat {
        type Stat = fn(&LatencySummary) -> f64;
        let stats: [(&str, Stat); 4] = [
            ("mean", |l| l.mean),
            ("p50", |l| l.p50),
            ("p90", |l| l.p90),
            ("p99", |l| l.p99),
        ];
        for (sname, stat) in stats {
            rows.push(row(&format!("{name} {sname} (ms)"), &|g| {
                let l = pick(g);
                if l.count == 0 {
                    "-".into()
                } else {
                    f2(stat(l))
                }
            }));
        }
    }

    let header: Vec<String> = groups.iter().map(|g| g.name.clone()).collect();
    let label_w = rows
        .iter()
        .map(|(l, _)| l.chars().count())
        .max()
        .unwrap_or(0);
    let col_w: Vec<usize> = (0..groups.len())
        .map(|i| {
            rows.iter()
                .map(|(_, v)| v[i].chars().count())
                .chain(std::iter::once(header[i].chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} -> {} ({}), {}: {:.2} s measured{}",
        r.api,
        r.target,
        r.mode,
        if r.warmup_requests > 0 {
            format!("{} warm-up excluded", r.warmup_requests)
        } else {
            "no warm-up".into()
        },
        r.duration_s,
        if r.interrupted { " (interrupted)" } else { "" }
    );
    let _ = write!(out, "{:label_w$}", "");
    for (h, w) in header.iter().zip(&col_w) {
        let _ = write!(out, "  {h:>w$}");
    }
    out.push('\n');
    let total: usize = label_w + col_w.iter().map(|w| w + 2).sum::<usize>();
    out.push_str(&"-".repeat(total));
    out.push('\n');
    for (label, vals) in &rows {
        let _ = write!(out, "{label:label_w$}");
        for (v, w) in vals.iter().zip(&col_w) {
            let _ = write!(out, "  {v:>w$}");
        }
        out.push('\n');
    }
    if !r.error_examples.is_empty() {
        out.push_str("error examples:\n");
        for e in &r.error_examples {
            let _ = writeln!(out, "  {e}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    fn ok(tenant: usize, ttft: u64, e2e: u64, tokens: u64) -> RequestRecord {
        RequestRecord {
            tenant,
            status: OK.into(),
            ttft: Some(ms(ttft)),
            itl: vec![ms(10); tokens.saturating_sub(1) as usize],
            e2e: ms(e2e),
            output_tokens: tokens,
            prompt_tokens: Some(100),
            finish_reason: Some("length".into()),
            error: None,
        }
    }

    #[test]
    fn token_clock_divides_gaps_across_delta_tokens() {
        let t0 = Instant::now();
        let mut c = TokenClock::started_at(t0);
        c.tokens_arrived_at(0, t0 + ms(5)); // empty delta: ignored
        c.tokens_arrived_at(2, t0 + ms(100)); // first delta, 2 tokens: TTFT only
        c.tokens_arrived_at(1, t0 + ms(130));
        c.tokens_arrived_at(3, t0 + ms(190)); // 60 ms over 3 tokens
        assert_eq!(c.ttft, Some(ms(100)));
        assert_eq!(c.tokens, 6);
        assert_eq!(c.itl, vec![ms(30), ms(20), ms(20), ms(20)]);
        // ITL samples add up to last-minus-first arrival.
        assert_eq!(c.itl.iter().sum::<Duration>(), ms(90));
    }

    #[test]
    fn percentiles_of_known_data() {
        let mut a = Aggregate::default();
        // TTFTs 1..=100 ms: p50 = 50, p90 = 90, p99 = 99, mean = 50.5.
        for i in 1..=100u64 {
            a.add(&ok(0, i, 1000 + i, 5));
        }
        let r = a.report("overall", 10.0);
        let close = |x: f64, y: f64| (x - y).abs() <= y * 0.001 + 1e-9;
        assert!(close(r.ttft_ms.p50, 50.0), "{:?}", r.ttft_ms);
        assert!(close(r.ttft_ms.p90, 90.0), "{:?}", r.ttft_ms);
        assert!(close(r.ttft_ms.p99, 99.0), "{:?}", r.ttft_ms);
        assert!(close(r.ttft_ms.max, 100.0), "{:?}", r.ttft_ms);
        assert!((r.ttft_ms.mean - 50.5).abs() < 0.05, "{:?}", r.ttft_ms);
        assert_eq!(r.ttft_ms.count, 100);
        assert_eq!(r.itl_ms.count, 400);
        assert!(close(r.itl_ms.p99, 10.0));
        assert!(close(r.e2e_ms.p50, 1050.0), "{:?}", r.e2e_ms);
        assert_eq!(r.requests_per_s, 10.0);
        assert_eq!(r.output_tokens, 500);
        assert_eq!(r.output_tokens_per_s, 50.0);
        assert_eq!(r.mean_output_tokens, 5.0);
        assert_eq!(r.mean_prompt_tokens, Some(100.0));
        assert_eq!(r.finish_reasons.get("length"), Some(&100));
    }

    #[test]
    fn aggregates_by_tenant_and_status() {
        let mut c = Collector::new(vec!["a".into(), "b".into()]);
        c.add(&ok(0, 10, 100, 4));
        c.add(&ok(0, 20, 200, 4));
        c.add(&ok(1, 30, 300, 8));
        for _ in 0..3 {
            c.add(&RequestRecord::failed(
                1,
                "RESOURCE_EXHAUSTED",
                "tenant b over quota",
            ));
        }
        c.add(&RequestRecord::failed(
            0,
            "UNAVAILABLE",
            "connection refused",
        ));
        let (all, per, examples) = c.reports(2.0);
        assert_eq!((all.requests, all.ok, all.errors), (7, 3, 4));
        assert_eq!(all.errors_by_status["RESOURCE_EXHAUSTED"], 3);
        assert_eq!(all.errors_by_status["UNAVAILABLE"], 1);
        assert!(!all.errors_by_status.contains_key(OK));
        assert_eq!(all.output_tokens, 16);
        assert_eq!(all.requests_per_s, 1.5);
        assert_eq!(per.len(), 2);
        assert_eq!(
            (per[0].name.as_str(), per[0].ok, per[0].errors),
            ("a", 2, 1)
        );
        assert_eq!(
            (per[1].name.as_str(), per[1].ok, per[1].errors),
            ("b", 1, 3)
        );
        assert_eq!(per[1].output_tokens_per_s, 4.0);
        assert_eq!(per[1].errors_by_status["RESOURCE_EXHAUSTED"], 3);
        // Failures do not enter latency histograms.
        assert_eq!(per[1].ttft_ms.count, 1);
        assert!(
            (per[1].e2e_ms.p50 - 300.0).abs() < 0.3,
            "{:?}",
            per[1].e2e_ms
        );
        // Distinct examples only.
        assert_eq!(
            examples,
            vec![
                "RESOURCE_EXHAUSTED: tenant b over quota".to_string(),
                "UNAVAILABLE: connection refused".to_string()
            ]
        );
    }

    #[test]
    fn empty_group_reports_zeros_and_table_renders() {
        let c = Collector::new(vec!["a".into(), "b".into()]);
        let (all, per, ex) = c.reports(0.0);
        assert_eq!(all.ttft_ms.count, 0);
        assert_eq!(all.requests_per_s, 0.0);
        let report = BenchReport {
            target: "grpc://127.0.0.1:1".into(),
            api: "weft".into(),
            mode: "closed loop, concurrency 1".into(),
            config: serde_json::json!({}),
            started_at_unix_s: 0.0,
            duration_s: 0.0,
            interrupted: true,
            warmup_requests: 0,
            warmup_errors: 0,
            overall: all,
            tenants: per,
            error_examples: ex,
        };
        let t = render_table(&report);
        assert!(t.contains("(interrupted)"));
        assert!(t.contains("TTFT p99 (ms)"));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["overall"]["ttft_ms"]["count"], 0);
    }

    #[test]
    fn table_has_a_column_per_tenant_and_error_rows() {
        let mut c = Collector::new(vec!["alice".into(), "bob".into()]);
        c.add(&ok(0, 10, 100, 4));
        c.add(&RequestRecord::failed(1, "HTTP 429", "slow down"));
        let (all, per, ex) = c.reports(1.0);
        let report = BenchReport {
            target: "http://127.0.0.1:8080".into(),
            api: "openai".into(),
            mode: "open loop".into(),
            config: serde_json::json!({}),
            started_at_unix_s: 0.0,
            duration_s: 1.0,
            interrupted: false,
            warmup_requests: 2,
            warmup_errors: 0,
            overall: all,
            tenants: per,
            error_examples: ex,
        };
        let t = render_table(&report);
        let header = t.lines().nth(1).unwrap();
        assert!(header.contains("overall") && header.contains("alice") && header.contains("bob"));
        let row = t
            .lines()
            .find(|l| l.trim_start().starts_with("HTTP 429"))
            .unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[cells.len() - 3..], ["1", "0", "1"]);
        assert!(t.contains("2 warm-up excluded"));
        assert!(t.contains("HTTP 429: slow down"));
        // Every row is equally wide (aligned).
        let widths: Vec<usize> = t
            .lines()
            .skip(1)
            .take_while(|l| !l.starts_with("error"))
            .map(|l| l.chars().count())
            .collect();
        assert!(widths.windows(2).all(|w| w[0] == w[1]), "{widths:?}");
    }
}
