//! Prometheus: the recorder (installed before the engine starts, so the
//! scheduler's handles resolve to it), the `/metrics` HTTP endpoint, and the
//! server's own request counter.

use std::convert::Infallible;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use metrics::{counter, describe_counter, describe_gauge, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Code;
use weft_scheduler::metrics as m;

pub const GRPC_REQUESTS: &str = "weft_grpc_requests_total";
pub const GRPC_IN_FLIGHT: &str = "weft_grpc_requests_in_flight";
pub const SERVING: &str = "weft_serving";
pub const BUILD_INFO: &str = "weft_build_info";
pub const KV_CONFIG_INFO: &str = "weft_kv_cache_config_info";
/// Aggregates over tenants, refreshed at every scrape: what autoscalers and the
/// Kubernetes inference gateway read (with `--metrics-aliases vllm` also under
/// the vLLM names its model-server protocol defaults to).
pub const REQUESTS_WAITING_ALL: &str = "weft_num_requests_waiting";
pub const REQUESTS_RUNNING_ALL: &str = "weft_num_requests_running";
pub const KV_USAGE: &str = "weft_kv_cache_usage_perc";
pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
pub const VLLM_KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// Live requests per served LoRA adapter (`adapter`; `state` running or
/// waiting): bounded by the adapters served.
pub const ADAPTER_REQUESTS: &str = "weft_adapter_requests";
/// The Kubernetes inference gateway's LoRA affinity input, in vLLM's shape:
/// labels `running_lora_adapters` and `waiting_lora_adapters` (comma-separated
/// names) and `max_lora` (adapters a batch may mix); value: the unix time it was
/// last refreshed. The series of the last adapter set is set to 0 when the set
/// changes, so the current one is the newest.
pub const LORA_INFO: &str = "weft_lora_requests_info";
/// Adapters copied into the device pool, and resident adapters evicted to make
/// room (`--max-loras` fewer than the adapters in use).
pub const ADAPTER_LOADS: &str = "weft_adapter_loads_total";
pub const ADAPTER_EVICTIONS: &str = "weft_adapter_evictions_total";
/// Host memory the registered adapters' files take (each stays in host memory
/// while registered, resident or not).
pub const ADAPTER_HOST_BYTES: &str = "weft_adapter_host_bytes";
pub const VLLM_LORA_INFO: &str = "vllm:lora_requests_info";

/// Extra names for the gateway gauges (`--metrics-aliases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Aliases {
    #[default]
    None,
    /// `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc`.
    Vllm,
}

impl std::str::FromStr for Aliases {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "" | "none" => Ok(Self::None),
            "vllm" => Ok(Self::Vllm),
            other => anyhow::bail!("metrics aliases {other:?}: expected none or vllm"),
        }
    }
}

/// The gateway gauges from one snapshot of the engine: requests waiting and
/// running (all tenants) and the KV pool's used fraction (0-1).
pub fn set_load(waiting: usize, running: usize, kv_used: usize, kv_total: usize, aliases: Aliases) {
    let usage = if kv_total == 0 {
        0.0
    } else {
        kv_used as f64 / kv_total as f64
    };
    gauge!(REQUESTS_WAITING_ALL).set(waiting as f64);
    gauge!(REQUESTS_RUNNING_ALL).set(running as f64);
    gauge!(KV_USAGE).set(usage);
    if aliases == Aliases::Vllm {
        gauge!(VLLM_WAITING).set(waiting as f64);
        gauge!(VLLM_RUNNING).set(running as f64);
        gauge!(VLLM_KV_USAGE).set(usage);
    }
}

/// The per-adapter gauges, the adapter pool's load and eviction counters and
/// the gateway's LoRA info gauge from one engine snapshot and the adapters
/// served now.
pub fn set_adapters(
    stats: &weft_scheduler::Stats,
    catalog: &crate::adapters::AdapterCatalog,
    aliases: Aliases,
) {
    if catalog.slots == 0 {
        return;
    }
    counter!(ADAPTER_LOADS).absolute(stats.adapter_loads);
    counter!(ADAPTER_EVICTIONS).absolute(stats.adapter_evictions);
    gauge!(ADAPTER_HOST_BYTES).set(catalog.host_bytes() as f64);
    let served = catalog.list();
    let live = &stats.adapters;
    // Adapters unmounted since the last refresh drop to 0.
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    {
        let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
        for gone in seen
            .iter()
            .filter(|n| !served.iter().any(|a| &a.name == *n))
        {
            for state in ["running", "waiting"] {
                gauge!(ADAPTER_REQUESTS, "adapter" => gone.clone(), "state" => state).set(0.0);
            }
        }
        *seen = served.iter().map(|a| a.name.clone()).collect();
    }
    let mut running = Vec::new();
    let mut waiting = Vec::new();
    for a in &served {
        let s = live.iter().find(|s| s.adapter == a.id);
        let (r, w) = s.map_or((0, 0), |s| (s.running, s.waiting));
        gauge!(ADAPTER_REQUESTS, "adapter" => a.name.clone(), "state" => "running").set(r as f64);
        gauge!(ADAPTER_REQUESTS, "adapter" => a.name.clone(), "state" => "waiting").set(w as f64);
        if r > 0 {
            running.push(a.name.as_str());
        }
        if w > 0 {
            waiting.push(a.name.as_str());
        }
    }
    let labels = (
        running.join(","),
        waiting.join(","),
        catalog.slots.to_string(),
    );
    static LAST: std::sync::Mutex<Option<(String, String, String)>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let names: &[&'static str] = match aliases {
        Aliases::None => &[LORA_INFO],
        Aliases::Vllm => &[LORA_INFO, VLLM_LORA_INFO],
    };
    let set = |l: &(String, String, String), v: f64| {
        for &n in names {
            gauge!(
                n,
                "running_lora_adapters" => l.0.clone(),
                "waiting_lora_adapters" => l.1.clone(),
                "max_lora" => l.2.clone()
            )
            .set(v);
        }
    };
    if let Some(old) = last.as_ref().filter(|old| **old != labels) {
        set(old, 0.0);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    set(&labels, now);
    *last = Some(labels);
}

/// `weft_kv_cache_config_info{block_size, num_blocks} 1`, once the pool exists.
pub fn set_kv_config(block_size: usize, num_blocks: usize) {
    gauge!(
        KV_CONFIG_INFO,
        "block_size" => block_size.to_string(),
        "num_blocks" => num_blocks.to_string()
    )
    .set(1.0);
}

/// Time to first token: SLO thresholds users set (a 2 s bucket among them).
pub const TTFT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];
/// Inter-token latency.
pub const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
];
/// End-to-end and queue time.
pub const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// One engine step.
pub const STEP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Builds and installs the global recorder. Call once, before the engine
/// starts.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let b = PrometheusBuilder::new()
        .set_buckets(E2E_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::TTFT.into()), TTFT_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::ITL.into()), ITL_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::E2E.into()), E2E_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::QUEUE_TIME.into()), E2E_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::STEP_DURATION.into()), STEP_BUCKETS)?
        // The model's share of a step: graph build, evaluation wait, the rest.
        .set_buckets_for_metric(Matcher::Prefix("weft_forward_".into()), STEP_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(m::BATCH_SIZE.into()), m::BATCH_BUCKETS)?;
    let recorder = b.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    m::describe();
    describe_counter!(
        GRPC_REQUESTS,
        "Finished calls by method (gRPC methods; openai.completions and openai.chat_completions for the HTTP API), status code (gRPC names) and tenant"
    );
    describe_gauge!(GRPC_IN_FLIGHT, "Generation calls admitted and not finished");
    describe_gauge!(
        SERVING,
        "1 while the server admits requests (model warm, not draining)"
    );
    describe_gauge!(BUILD_INFO, "1, labelled with the weft version");
    describe_gauge!(
        KV_CONFIG_INFO,
        "1, labelled with the KV pool's block size (tokens) and block count"
    );
    describe_gauge!(
        REQUESTS_WAITING_ALL,
        "Requests waiting (queued or preempted), all tenants; refreshed at each scrape"
    );
    describe_gauge!(
        REQUESTS_RUNNING_ALL,
        "Requests with a row in the batch, all tenants; refreshed at each scrape"
    );
    describe_gauge!(
        KV_USAGE,
        "Fraction (0-1) of KV pool blocks in use by running rows; refreshed at each scrape"
    );
    describe_gauge!(
        ADAPTER_REQUESTS,
        "Live requests per LoRA adapter (adapter), running or waiting (state); refreshed at each scrape"
    );
    describe_counter!(
        ADAPTER_LOADS,
        "LoRA adapters copied into the device pool (at start, and each time a step needs one that is not resident)"
    );
    describe_counter!(
        ADAPTER_EVICTIONS,
        "Resident LoRA adapters evicted (least recently used) to load another: more adapters in use than --max-loras"
    );
    describe_gauge!(
        ADAPTER_HOST_BYTES,
        "Host memory of the registered LoRA adapters' files (refreshed at each scrape)"
    );
    describe_gauge!(
        LORA_INFO,
        "Unix time of the last refresh, labelled with the adapters of running and waiting requests and max_lora (the inference gateway's LoRA affinity input)"
    );
    crate::memory_plan::describe();
    gauge!(SERVING).set(0.0);
    gauge!(GRPC_IN_FLIGHT).set(0.0);
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    Ok(handle)
}

/// Drains histogram samples into their buckets now and then (the exporter
/// does that on render too; this bounds memory between scrapes).
pub fn spawn_upkeep(handle: PrometheusHandle) {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(5));
        loop {
            t.tick().await;
            handle.run_upkeep();
        }
    });
}

/// Called before each render: refreshes gauges computed at scrape time.
pub type Refresh = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Serves `GET /metrics` (Prometheus text) and `GET /healthz` until
/// `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    refresh: Refresh,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let handle = handle.clone();
        let refresh = refresh.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let handle = handle.clone();
                let refresh = refresh.clone();
                async move {
                    if req.uri().path() == "/metrics" {
                        refresh();
                    }
                    Ok::<_, Infallible>(respond(&req, &handle))
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .await
            {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}

fn respond<B>(req: &Request<B>, handle: &PrometheusHandle) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, ctype: &'static str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    match req.uri().path() {
        "/metrics" => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            handle.render(),
        ),
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics\n".into(),
        ),
    }
}

/// Counts one finished call. `tenant` is a configured tenant name or "none"
/// (unauthenticated), so label values stay bounded.
pub fn record(method: &'static str, code: Code, tenant: &str) {
    counter!(
        GRPC_REQUESTS,
        "method" => method,
        "code" => code_label(code),
        "tenant" => tenant.to_string()
    )
    .increment(1);
}

/// gRPC status codes as fixed label values.
pub fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}
