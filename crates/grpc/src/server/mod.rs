//! `weft serve`: the gRPC front end over the engine.
//!
//! Startup: settings are resolved and checked (an open server on a
//! non-loopback address is refused before anything loads), the Prometheus
//! recorder is installed (the scheduler resolves its metric handles when it
//! starts), both listeners are bound and serving — `grpc.health.v1` answers
//! NOT_SERVING and generation calls UNAVAILABLE — while the model loads and
//! warms on the engine thread; then health turns SERVING.
//!
//! Shutdown (SIGTERM or SIGINT): generation calls get UNAVAILABLE, health
//! turns NOT_SERVING, in-flight requests run to completion for up to
//! `--drain-timeout`; what is still running then ends with UNAVAILABLE as the
//! engine stops. A second signal skips the rest of the drain. Exit status 0.
//!
//! Engine failure (a panic on the engine thread): every request it held ends
//! with INTERNAL naming the panic, new ones get UNAVAILABLE, health turns
//! NOT_SERVING (for a second at least, so probes see it), then the listeners
//! close and the process exits 1 for its supervisor to restart it.
//!
//! Request path, per call: authenticate (`authorization: Bearer <key>` ->
//! tenant), validate every field ([`validate`]), tokenize, take one of the
//! tenant's concurrency slots, submit to the engine (which applies the queue
//! cap and the tenant's token rate at once), then relay events. Dropping the
//! response (client gone) drops the engine's event stream, which cancels the
//! request within one step.

// `tonic::Status` (176 bytes) is the error of every handler and of the
// helpers that build its answers; boxing it would only move the allocation.
#![allow(clippy::result_large_err)]

pub mod admin;
pub mod config;
pub mod metrics;
pub mod openai;
pub mod service;
pub mod tenants;
pub mod tls;
pub mod validate;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use tracing::{error, info, warn};
use weft_scheduler::{Engine, TenantLimits};

pub use config::ServeArgs;
use config::Settings;
use service::{GenerationService, Ready, State};
use tenants::Tenants;

use crate::pb;
use crate::pb::generation_server::GenerationServer;

/// How long the gRPC server gets to close connections after the drain.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// How long finished-by-shutdown requests get to deliver their last status.
const ABANDON_GRACE: Duration = Duration::from_secs(2);
/// How long health answers NOT_SERVING after the engine failed, before the
/// listeners close and the process exits 1.
const FAILURE_LINGER: Duration = Duration::from_secs(1);

/// Runs `weft serve` to completion (Ok after a clean drain).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings = Settings::resolve(args)?;
    settings.check_exposure()?;
    let tenants = match &settings.tenants {
        Some(p) => Tenants::load(p)?,
        None => Tenants::open(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.worker_threads)
        .enable_all()
        .thread_name("weft-grpc")
        .build()
        .context("starting the async runtime")?;
    let out = rt.block_on(serve(settings, tenants));
    // A model load still running on a blocking thread must not hold the exit.
    rt.shutdown_timeout(Duration::from_millis(500));
    out
}

/// Prints a line on stdout (addresses, readiness) and flushes it, for
/// people and for scripts that wait for it.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "weft: {line}");
    let _ = out.flush();
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Signal {
    Terminate,
    Interrupt,
}

/// SIGTERM / SIGINT as a stream of events.
fn signals() -> anyhow::Result<tokio::sync::mpsc::UnboundedReceiver<Signal>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let s = tokio::select! {
                _ = term.recv() => Signal::Terminate,
                _ = int.recv() => Signal::Interrupt,
            };
            if tx.send(s).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

async fn serve(settings: Settings, tenants: Tenants) -> anyhow::Result<()> {
    let mut sig = signals()?;
    let tls = match &settings.tls {
        Some(files) => Some(files.load()?),
        None => None,
    };
    let prom = metrics::install()?;
    metrics::spawn_upkeep(prom.clone());

    let listener = TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("binding the gRPC address {}", settings.listen))?;
    let grpc_addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let state = Arc::new(State::new(tenants, settings.default_max_tokens));
    if let Some(addr) = settings.metrics_listen {
        let ml = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the metrics address {addr}"))?;
        let maddr = ml.local_addr()?;
        let (st, aliases) = (state.clone(), settings.metrics_aliases);
        let refresh: metrics::Refresh = Arc::new(move || {
            crate::memory_plan::refresh();
            if let Some(r) = st.ready.get() {
                let s = r.engine.stats();
                metrics::set_load(
                    s.waiting,
                    s.running,
                    s.kv_blocks_used,
                    s.kv_blocks_total,
                    aliases,
                );
                metrics::set_adapters(&s, &r.model.adapters, aliases);
            }
        });
        tokio::spawn(metrics::serve(ml, prom.clone(), refresh, stop_rx.clone()));
        say(&format!("metrics listening on http://{maddr}/metrics"));
    }

    let http = match settings.http_listen {
        Some(addr) => {
            let hl = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the HTTP address {addr}"))?;
            let haddr = hl.local_addr()?;
            let mut http_stop = stop_rx.clone();
            let app = openai::router(state.clone());
            let scheme = if tls.is_some() { "https" } else { "http" };
            say(&format!(
                "http listening on {scheme}://{haddr} (OpenAI-compatible /v1)"
            ));
            Some(match &tls {
                Some(t) => tokio::spawn(tls::serve_http(hl, app, t.http_acceptor()?, http_stop)),
                None => tokio::spawn(async move {
                    let r = axum::serve(hl, app)
                        .with_graceful_shutdown(async move {
                            let _ = http_stop.wait_for(|s| *s).await;
                        })
                        .await;
                    if let Err(e) = r {
                        warn!(error = %e, "HTTP server failed");
                    }
                }),
            })
        }
        None => None,
    };
    let (mut health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<GenerationServer<GenerationService>>()
        .await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("building the reflection service")?;

    let mut grpc_stop = stop_rx.clone();
    // Server::tcp_nodelay only applies to sockets tonic binds itself; ours come
    // from our own listener, so TcpIncoming sets it. Without it Nagle holds the
    // small frames ending a stream until the client's delayed ACK (~40 ms), and
    // closed-loop clients' next requests arrive in late waves.
    let incoming = tonic::transport::server::TcpIncoming::from_listener(listener, true, None)
        .map_err(|e| anyhow::anyhow!("gRPC listener: {e}"))?;
    let mut builder = Server::builder();
    if let Some(t) = &tls {
        builder = builder
            .tls_config(t.grpc())
            .context("the gRPC listener's TLS configuration")?;
        info!(mutual = t.mutual(), "TLS on the gRPC and HTTP listeners");
    }
    let router = builder
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(health_svc)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(GenerationServer::new(GenerationService::new(state.clone())))
        .add_service(crate::pb::admin_server::AdminServer::new(
            admin::AdminService::new(state.clone()),
        ));
    let server = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async move {
        let _ = grpc_stop.wait_for(|s| *s).await;
    }));
    say(&format!("grpc listening on {grpc_addr}"));
    info!(addr = %grpc_addr, tenants = ?state.tenants.all().iter().map(|t| t.name.clone()).collect::<Vec<_>>(), "gRPC listening; loading the model");

    // Load and warm the model off the async threads.
    let t0 = Instant::now();
    let load_settings = settings.clone();
    let tenant_list = state.tenants.all();
    let mut load = tokio::task::spawn_blocking(move || load_engine(&load_settings, &tenant_list));
    let loaded = tokio::select! {
        r = &mut load => r.context("the model loader panicked")?,
        s = sig.recv() => {
            info!(signal = ?s, "signal during model load; exiting");
            say("stopped (during model load)");
            let _ = stop_tx.send(true);
            return Ok(());
        }
    };
    let (engine, ready) = match loaded {
        Ok(x) => x,
        Err(e) => {
            let _ = stop_tx.send(true);
            return Err(e);
        }
    };
    // If the engine thread panics, health turns NOT_SERVING on that thread before
    // any in-flight request gets its INTERNAL status: a client that saw its request
    // fail never finds the server healthy afterwards.
    let hook_health = health.clone();
    let rt = tokio::runtime::Handle::current();
    ready.engine.on_failure(Box::new(move |_| {
        let mut h = hook_health;
        ::metrics::gauge!(metrics::SERVING).set(0.0);
        rt.block_on(async move {
            h.set_service_status("", ServingStatus::NotServing).await;
            h.set_not_serving::<GenerationServer<GenerationService>>()
                .await;
        });
    }));
    let model_name = ready.model.name.clone();
    let kv = ready.engine.stats();
    metrics::set_kv_config(settings.kv_block_size, kv.kv_blocks_total);
    ready.model.memory.export();
    let _ = state.ready.set(ready);
    health.set_service_status("", ServingStatus::Serving).await;
    health
        .set_serving::<GenerationServer<GenerationService>>()
        .await;
    ::metrics::gauge!(metrics::SERVING).set(1.0);
    info!(model = %model_name, load_seconds = t0.elapsed().as_secs_f64(), "serving");
    say(&format!(
        "ready: serving {model_name} (loaded in {:.1}s)",
        t0.elapsed().as_secs_f64()
    ));

    // Serve until a signal (or the server itself fails).
    let mut server = server;
    let mut engine_lost = state.engine_lost.subscribe();
    let engine_handle = engine.handle();
    let first = tokio::select! {
        s = sig.recv() => s,
        _ = async {
            tokio::select! {
                _ = engine_handle.stopped() => {}
                _ = engine_lost.wait_for(|lost| *lost) => {}
            }
        } => {
            // The engine thread died (a panic): every request it held has had its
            // final event (INTERNAL). Nothing will be served again; turn unhealthy,
            // let those statuses reach their clients, and exit non-zero so the
            // supervisor restarts the process.
            let why = engine_handle.failure().unwrap_or_else(|| "it stopped".into());
            error!(reason = %why, "the engine stopped unexpectedly; shutting down");
            say(&format!("engine failed: {why}"));
            state.start_draining();
            ::metrics::gauge!(metrics::SERVING).set(0.0);
            health.set_service_status("", ServingStatus::NotServing).await;
            health.set_not_serving::<GenerationServer<GenerationService>>().await;
            let _ = tokio::time::timeout(ABANDON_GRACE, state.wait_idle()).await;
            // Probes and load balancers see NOT_SERVING before the port closes.
            tokio::time::sleep(FAILURE_LINGER).await;
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(CLOSE_GRACE, server).await;
            drop(engine);
            return Err(anyhow::anyhow!("the engine stopped unexpectedly: {why}"));
        }
        r = &mut server => {
            let _ = stop_tx.send(true);
            drop(engine);
            return match r {
                Ok(Ok(())) => Err(anyhow::anyhow!("the gRPC server stopped unexpectedly")),
                Ok(Err(e)) => Err(anyhow::Error::new(e).context("the gRPC server failed")),
                Err(e) => Err(anyhow::Error::new(e).context("the gRPC server panicked")),
            };
        }
    };

    // Drain.
    state.start_draining();
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<GenerationServer<GenerationService>>()
        .await;
    let n = state.in_flight();
    info!(signal = ?first, in_flight = n, timeout_s = settings.drain_timeout.as_secs_f64(), "draining");
    say(&format!("draining ({n} requests in flight)"));
    let drained = tokio::select! {
        r = tokio::time::timeout(settings.drain_timeout, state.wait_idle()) => r.is_ok(),
        s = sig.recv() => {
            warn!(signal = ?s, "second signal: skipping the rest of the drain");
            false
        }
    };
    if !drained {
        service::warn_abandoned(&state);
        state.mark_stopping();
    }
    // Stop the engine: anything still running ends with UNAVAILABLE.
    let stop_engine = tokio::task::spawn_blocking(move || engine.shutdown());
    if stop_engine.await.is_err() {
        error!("the engine thread panicked while stopping");
    }
    if !drained {
        let _ = tokio::time::timeout(ABANDON_GRACE, state.wait_idle()).await;
    }
    let _ = stop_tx.send(true);
    if let Some(h) = http {
        match tokio::time::timeout(CLOSE_GRACE, h).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "HTTP server task failed while closing"),
            Err(_) => warn!("HTTP connections still open after the drain; closing anyway"),
        }
    }
    match tokio::time::timeout(CLOSE_GRACE, server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => warn!(error = %e, "gRPC server error while closing"),
        Ok(Err(e)) => warn!(error = %e, "gRPC server task failed while closing"),
        Err(_) => warn!("connections still open after the drain; closing anyway"),
    }
    info!(drained, "stopped");
    say("stopped");
    Ok(())
}

/// Resolves (fetching on first use), loads and warms the model; returns the
/// engine and what calls need.
fn load_engine(s: &Settings, tenants: &[Arc<tenants::Tenant>]) -> anyhow::Result<(Engine, Ready)> {
    let dir = crate::runtime::resolve_model(&s.model, true)?;
    // Adapter names are checked before the load: `model` may name an adapter,
    // so none may be the model's own name, and a tenant's list names served ones.
    let model_name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    for a in &s.adapters {
        if Some(&a.name) == model_name.as_ref() {
            anyhow::bail!(
                "adapter {:?} has the served model's name; give it another",
                a.name
            );
        }
    }
    // With run-time loading a tenant's list may name adapters mounted later.
    for t in tenants.iter().filter(|_| s.adapter_pool.root.is_none()) {
        for name in t.adapters.iter().flatten().filter(|n| !n.ends_with('*')) {
            if !s.adapters.iter().any(|a| &a.name == name) {
                anyhow::bail!(
                    "tenant {:?} may use adapter {name:?}, which is not served (--adapter NAME=DIR)",
                    t.name
                );
            }
        }
    }
    let opts = s.compute.load_options()?;
    let kv_memory = s.kv_memory(weft_models::Device::detect())?;
    let mut sc = s.scheduler_config();
    let mut model_faults = crate::runtime::ModelFaults::default();
    if let Ok(spec) = std::env::var(FAULT_ENV) {
        (sc.faults, model_faults) = parse_faults(&spec)?;
        warn!(spec = %spec, "{FAULT_ENV} is set: injecting engine faults (testing only)");
    }
    for t in tenants {
        sc.tenants.insert(
            t.name.clone(),
            TenantLimits {
                max_running: t.max_running.unwrap_or(usize::MAX),
                max_waiting: t.max_waiting.unwrap_or(s.max_waiting),
                tokens_per_minute: t.tokens_per_minute,
            },
        );
    }
    info!(
        dir = %dir.display(),
        kv_memory = ?kv_memory,
        kv_block_size = s.kv_block_size,
        kv_quant = ?s.kv_quant,
        max_batch_rows = s.max_batch_rows,
        blas = crate::blas::active().as_deref().unwrap_or("none"),
        "loading the model"
    );
    let (engine, tokenizer, model) = crate::runtime::start_engine_with(
        &dir,
        opts,
        sc,
        crate::runtime::KvSpec {
            block_size: s.kv_block_size as u32,
            memory: kv_memory,
            quant: s.kv_quant,
            max_batch_rows: s.max_batch_rows,
            cache_limit: s.mlx_cache_limit,
        },
        model_faults,
        &s.adapters,
        &s.adapter_pool,
    )?;
    let t = std::time::Instant::now();
    let grammars = match crate::constraints::grammars(&tokenizer, &model) {
        Ok(g) => {
            info!(
                ms = t.elapsed().as_millis() as u64,
                "output constraints (JSON schema, regex, grammar, choice) ready"
            );
            Some(g)
        }
        Err(e) => {
            warn!(error = %e, "output constraints unavailable for this tokenizer; constrained requests will be refused");
            None
        }
    };
    let ready = Ready {
        engine: engine.handle(),
        tokenizer,
        model,
        grammars,
    };
    Ok((engine, ready))
}

/// Testing only: injects engine faults, to exercise the failure paths end to
/// end. A comma-separated list of `point:from[-to]` (1-based occurrence
/// numbers; every attempt that reaches the point counts):
/// - `after_plan`, `after_forward`, `sampling`, `commit_bookkeeping`: the step
///   fails there and rolls back (retried, then bisected);
/// - `alloc`: the model's Nth forward first asks MLX for a 64 TiB array, so the
///   step fails with MLX's own allocation error (the batch is split);
/// - `panic:N`: the engine thread panics in its Nth step that runs rows (every
///   in-flight request fails with INTERNAL, health turns NOT_SERVING, the
///   process exits 1).
pub const FAULT_ENV: &str = "WEFT_TEST_FAULTS";

fn parse_faults(
    spec: &str,
) -> anyhow::Result<(weft_scheduler::FaultPlan, crate::runtime::ModelFaults)> {
    use weft_scheduler::FaultPoint;
    let mut plan = weft_scheduler::FaultPlan::default();
    let mut model = crate::runtime::ModelFaults::default();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || anyhow::anyhow!("{FAULT_ENV}: {part:?} is not point:from[-to]");
        let (point, range) = part.split_once(':').ok_or_else(bad)?;
        let (from, to) = match range.split_once('-') {
            Some((a, b)) => (a.parse::<u64>(), b.parse::<u64>()),
            None => (range.parse::<u64>(), range.parse::<u64>()),
        };
        let (from, to) = (from.map_err(|_| bad())?, to.map_err(|_| bad())?);
        if from == 0 || to < from || to - from > 10_000 {
            return Err(bad());
        }
        let point = match point {
            "after_plan" => FaultPoint::AfterPlan,
            "after_forward" => FaultPoint::AfterForward,
            "sampling" => FaultPoint::Sampling,
            "commit_bookkeeping" => FaultPoint::CommitBookkeeping,
            "alloc" => {
                model.alloc_calls.extend(from..=to);
                continue;
            }
            "panic" if from == to => {
                plan = plan.panic_at_step(from);
                continue;
            }
            _ => return Err(bad()),
        };
        for k in from..=to {
            plan = plan.at(point, k);
        }
    }
    Ok((plan, model))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs() {
        let (plan, model) = parse_faults("after_plan:2-3, alloc:4-5 ,panic:7").unwrap();
        assert_eq!(plan.at.len(), 2);
        assert_eq!(plan.panic_at_step, Some(7));
        assert_eq!(model.alloc_calls, vec![4, 5]);
        for bad in ["panic:2-3", "alloc:0", "nope:1", "after_plan", "sampling:x"] {
            assert!(parse_faults(bad).is_err(), "{bad}");
        }
    }
}
