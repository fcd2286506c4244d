//! The `weft.v1.Generation` service.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use metrics::gauge;
use tokio::sync::Notify;
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};
use tracing::{debug, info, warn};
use weft_models::Tokenizer;
use weft_scheduler::{
    EngineHandle, Event, EventStream, FinishReason, Finished, SubmitError, TokenDelta,
};

use super::metrics::{self as sm, record};
use super::tenants::{InFlight, Tenant, Tenants};
use super::validate::{self, Limits};
use crate::pb;
use crate::runtime::ServedModel;

/// Deadlines (`grpc-timeout`): the engine's deadline for the request is this
/// much before the client's, so the row leaves the batch (and the answer is
/// DEADLINE_EXCEEDED from us, with usage) before the client gives up.
const DEADLINE_MARGIN: Duration = Duration::from_millis(50);
/// Backstop of a unary call if the engine has not ended the request by then:
/// just before the transport's own timer (which would answer CANCELLED).
const UNARY_BACKSTOP_MARGIN: Duration = Duration::from_millis(5);
/// Backstop of a stream, after the engine's deadline (the client's deadline
/// does not cut a server stream's body, so there is no race to lose).
const STREAM_BACKSTOP_GRACE: Duration = Duration::from_millis(250);
/// Retry hint when a tenant has all its concurrency slots in use.
const CONCURRENCY_RETRY_AFTER: Duration = Duration::from_millis(500);
/// Largest Tokenize text and Detokenize id list.
const MAX_TOKENIZE_BYTES: usize = 4 << 20;
const MAX_DETOKENIZE_IDS: usize = 1 << 20;

/// What exists once the model is loaded and warm.
pub struct Ready {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub model: ServedModel,
    /// Output constraints compiled against the served tokenizer (None: it could not
    /// be adapted; constrained requests are refused with a reason).
    pub grammars: Option<weft_scheduler::Grammars>,
}

/// Shared by every call.
pub struct State {
    pub ready: OnceLock<Ready>,
    pub tenants: Tenants,
    pub default_max_tokens: usize,
    draining: AtomicBool,
    /// Set when draining ran out of time and the engine is being stopped.
    stopping: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
    next_id: AtomicU64,
    id_prefix: String,
    /// Turns true when a submit finds the engine gone outside a drain.
    pub engine_lost: tokio::sync::watch::Sender<bool>,
}

impl State {
    pub fn new(tenants: Tenants, default_max_tokens: usize) -> Self {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ u64::from(std::process::id()).rotate_left(32);
        Self {
            ready: OnceLock::new(),
            tenants,
            default_max_tokens,
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            next_id: AtomicU64::new(1),
            engine_lost: tokio::sync::watch::Sender::new(false),
            id_prefix: format!("weft-{:08x}", (nonce ^ (nonce >> 32)) as u32),
        }
    }

    /// Stop admitting generation requests.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
        gauge!(sm::SERVING).set(0.0);
    }

    pub fn mark_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no generation call is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    fn enter(self: &Arc<Self>) -> Active {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        gauge!(sm::GRPC_IN_FLIGHT).set(n as f64);
        Active(self.clone())
    }

    fn new_id(&self) -> String {
        format!(
            "{}-{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }

    pub(crate) fn ready(&self) -> Result<&Ready, Status> {
        self.ready
            .get()
            .ok_or_else(|| Status::unavailable("the model is still loading; retry shortly"))
    }
}

/// The tenant a call's `authorization: Bearer <key>` names (the open tenant
/// without a tenant file); UNAUTHENTICATED otherwise.
/// At which level [`counted_call`] logs a refused call.
#[derive(Clone, Copy)]
pub(crate) enum Refusals {
    /// Generation calls: refusals are the client's business.
    Debug,
    /// Admin calls: an operator wants to see them.
    Info,
}

/// Authenticates `req`, runs `f` for its tenant, and counts the call in
/// `weft_grpc_requests_total` under `method` (tenant `none` when the
/// caller is not known), logging a refusal at `refusals`' level.
pub(crate) async fn counted_call<T, R, F, Fut>(
    state: &State,
    method: &'static str,
    req: Request<T>,
    refusals: Refusals,
    f: F,
) -> Result<Response<R>, Status>
where
    F: FnOnce(Arc<Tenant>, Request<T>) -> Fut,
    Fut: std::future::Future<Output = Result<R, Status>>,
{
    let tenant = match authenticate(state, &req) {
        Ok(t) => t,
        Err(s) => {
            record(method, s.code(), "none");
            return Err(s);
        }
    };
    let name = tenant.name.clone();
    let out = f(tenant, req).await;
    match &out {
        Ok(_) => record(method, Code::Ok, &name),
        Err(s) => {
            let (code, message) = (s.code(), s.message());
            match refusals {
                Refusals::Debug => {
                    debug!(method, tenant = %name, ?code, message, "call refused")
                }
                Refusals::Info => {
                    tracing::info!(method, tenant = %name, ?code, message, "call refused")
                }
            }
            record(method, code, &name)
        }
    }
    out.map(Response::new)
}

pub(crate) fn authenticate<T>(state: &State, req: &Request<T>) -> Result<Arc<Tenant>, Status> {
    let header = req
        .metadata()
        .get("authorization")
        .map(|v| v.to_str().map_err(|_| ()));
    let value = match header {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(())) => {
            return Err(Status::unauthenticated(
                "malformed authorization header: expected `Bearer <key>`",
            ))
        }
    };
    state
        .tenants
        .authenticate(value)
        .map_err(|e| Status::unauthenticated(e.message()))
}

/// One generation call in flight (for draining).
struct Active(Arc<State>);

impl Drop for Active {
    fn drop(&mut self) {
        let n = self.0.in_flight.fetch_sub(1, Ordering::SeqCst) - 1;
        gauge!(sm::GRPC_IN_FLIGHT).set(n as f64);
        if n == 0 {
            self.0.idle.notify_waiters();
        }
    }
}

#[derive(Clone)]
pub struct GenerationService {
    state: Arc<State>,
}

impl GenerationService {
    pub fn new(state: Arc<State>) -> Self {
        Self { state }
    }

    fn authenticate<T>(&self, req: &Request<T>) -> Result<Arc<Tenant>, Status> {
        authenticate(&self.state, req)
    }

    /// Authenticates, runs `f`, and counts the call (unless `f` returns a
    /// stream, which counts itself when it ends).
    async fn call<T, R, F, Fut>(
        &self,
        method: &'static str,
        req: Request<T>,
        f: F,
    ) -> Result<Response<R>, Status>
    where
        F: FnOnce(Arc<Tenant>, Request<T>) -> Fut,
        Fut: std::future::Future<Output = Result<R, Status>>,
    {
        counted_call(&self.state, method, req, Refusals::Debug, f).await
    }

    /// A streamed generation, counted in `weft_grpc_requests_total` under
    /// `method` (the HTTP API's calls count as theirs, e.g. `openai.completions`).
    pub fn stream_as(
        &self,
        method: &'static str,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenStreamBox>, Status> {
        let tenant = match self.authenticate(&req) {
            Ok(t) => t,
            Err(s) => {
                record(method, s.code(), "none");
                return Err(s);
            }
        };
        match self.start(method, tenant.clone(), req) {
            Ok(flow) => Ok(Response::new(Box::pin(GenStream::new(flow)) as GenStreamBox)),
            Err(s) => {
                record(method, s.code(), &tenant.name);
                Err(s)
            }
        }
    }

    /// Validates and submits; returns the running request.
    fn start(
        &self,
        method: &'static str,
        tenant: Arc<Tenant>,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Flow, Status> {
        let arrival = Instant::now();
        let st = &self.state;
        if st.is_draining() {
            return Err(Status::unavailable(
                "the server is shutting down; retry on another instance",
            ));
        }
        let ready = st.ready()?;
        let deadline = req
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(validate::parse_grpc_timeout)
            .map(|t| {
                (
                    arrival + t.saturating_sub(DEADLINE_MARGIN),
                    arrival + t.saturating_sub(UNARY_BACKSTOP_MARGIN),
                )
            });
        let (deadline, unary_backstop) = (deadline.map(|d| d.0), deadline.map(|d| d.1));
        let body = req.into_inner();
        let client_id = validate::check_request_id(&body.request_id)?;
        let id = client_id.unwrap_or_else(|| st.new_id());
        let limits = Limits {
            model: &ready.model,
            tokenizer: &ready.tokenizer,
            default_max_tokens: st.default_max_tokens,
            grammars: ready.grammars.as_ref(),
        };
        let request = validate::build(&body, &tenant, &limits, id.clone(), deadline)?;
        let Some(slot) = tenant.acquire() else {
            return Err(exhausted(
                format!(
                    "tenant {:?} already has {max} requests in flight (max_concurrent {max})",
                    tenant.name,
                    max = tenant.max_concurrent.unwrap_or(0),
                ),
                CONCURRENCY_RETRY_AFTER,
            ));
        };
        let prompt_tokens = request.prompt.len();
        let max_tokens = request.max_tokens;
        let stop_ids = request.stop_token_ids.clone();
        let events = ready.engine.submit(request).map_err(|e| match e {
            SubmitError::Invalid(m) => Status::invalid_argument(m),
            SubmitError::Overloaded {
                retry_after,
                reason,
            } => exhausted(reason, retry_after),
            SubmitError::ShuttingDown => {
                if !st.is_draining() {
                    // The engine thread ended on its own: nothing will be
                    // served again; let the process report it and exit.
                    st.engine_lost.send_replace(true);
                }
                Status::unavailable("the engine is not running")
            }
        })?;
        debug!(method, tenant = %tenant.name, request_id = %id, prompt_tokens, max_tokens, "admitted");
        Ok(Flow {
            state: st.clone(),
            method,
            tenant,
            id,
            arrival,
            deadline,
            unary_backstop,
            prompt_tokens,
            stop_ids,
            first_token: None,
            generated: 0,
            done: false,
            events: Some(events),
            _slot: slot,
            _active: st.enter(),
        })
    }
}

fn exhausted(msg: String, retry_after: Duration) -> Status {
    let ms = retry_after.as_millis().clamp(1, u64::MAX as u128) as u64;
    let mut md = MetadataMap::new();
    md.insert("retry-after-ms", MetadataValue::from(ms));
    Status::with_metadata(
        Code::ResourceExhausted,
        format!("{msg}; retry after {ms} ms"),
        md,
    )
}

/// One admitted generation request: its events, and the bookkeeping that
/// ends with it (metrics, the completion log line, concurrency slots).
struct Flow {
    state: Arc<State>,
    method: &'static str,
    tenant: Arc<Tenant>,
    id: String,
    arrival: Instant,
    /// The engine's deadline for the request.
    deadline: Option<Instant>,
    unary_backstop: Option<Instant>,
    prompt_tokens: usize,
    stop_ids: Vec<u32>,
    first_token: Option<Instant>,
    generated: usize,
    done: bool,
    /// Dropping this cancels the request in the engine.
    events: Option<EventStream>,
    _slot: InFlight,
    _active: Active,
}

impl Flow {
    /// Accounts for a delta and drops stop token ids from it (the contract:
    /// a stop token id ends generation and is not returned, and
    /// `usage.generated_tokens` counts the ids returned). Returns false when
    /// nothing is left to send.
    fn on_delta(&mut self, d: &mut TokenDelta) -> bool {
        self.first_token.get_or_insert_with(Instant::now);
        if !self.stop_ids.is_empty() && d.ids.iter().any(|i| self.stop_ids.contains(i)) {
            let keep: Vec<bool> = d.ids.iter().map(|i| !self.stop_ids.contains(i)).collect();
            let mut k = keep.iter();
            d.ids.retain(|_| *k.next().unwrap_or(&true));
            if let Some(lps) = d.logprobs.as_mut() {
                let mut k = keep.iter();
                lps.retain(|_| *k.next().unwrap_or(&true));
            }
        }
        self.generated += d.ids.len();
        !(d.ids.is_empty() && d.text.is_empty())
    }

    /// The status a finished request ends with (None: OK).
    fn status_of(&self, f: &Finished) -> Option<Status> {
        match f.reason {
            FinishReason::Deadline => Some(Status::deadline_exceeded(format!(
                "the deadline passed after {} generated tokens",
                f.usage.generated_tokens
            ))),
            FinishReason::Error => {
                let msg = f.error.clone().unwrap_or_else(|| "engine failure".into());
                if self.state.stopping.load(Ordering::SeqCst) {
                    Some(Status::unavailable(format!(
                        "the server shut down before the request finished ({msg})"
                    )))
                } else {
                    Some(Status::internal(format!("generation failed: {msg}")))
                }
            }
            _ => None,
        }
    }

    fn usage(&self, f: Option<&Finished>) -> pb::Usage {
        let now = Instant::now();
        let ttft = self
            .first_token
            .map(|t| t.saturating_duration_since(self.arrival).as_secs_f64())
            .unwrap_or(0.0);
        let (cached, queue) = f
            .map(|f| {
                (
                    f.usage.cached_prompt_tokens as u32,
                    f.usage.queue_time.as_secs_f64(),
                )
            })
            .unwrap_or((0, 0.0));
        pb::Usage {
            prompt_tokens: self.prompt_tokens as u32,
            cached_prompt_tokens: cached,
            generated_tokens: self.generated as u32,
            queue_seconds: queue,
            ttft_seconds: ttft,
            total_seconds: now.saturating_duration_since(self.arrival).as_secs_f64(),
        }
    }

    /// Logs and counts the end of the request.
    fn end(&mut self, reason: &str, code: Code) {
        if self.done {
            return;
        }
        self.done = true;
        self.events = None;
        let ttft_ms = self
            .first_token
            .map(|t| t.saturating_duration_since(self.arrival).as_secs_f64() * 1e3);
        let total_ms = self.arrival.elapsed().as_secs_f64() * 1e3;
        info!(
            tenant = %self.tenant.name,
            request_id = %self.id,
            method = %self.method,
            prompt_tokens = self.prompt_tokens,
            generated_tokens = self.generated,
            finish_reason = %reason,
            code = %sm::code_label(code),
            ttft_ms = ttft_ms.map(|v| (v * 10.0).round() / 10.0),
            total_ms = (total_ms * 10.0).round() / 10.0,
            "request finished"
        );
        record(self.method, code, &self.tenant.name);
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        // Dropped before the end: the client went away (or the transport's
        // timer fired); dropping `events` cancels the request in the engine.
        self.end("client_gone", Code::Cancelled);
    }
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
        FinishReason::Error => pb::FinishReason::Error,
        FinishReason::Deadline => pb::FinishReason::Deadline,
    }
}

fn logprobs(d: &TokenDelta) -> Vec<pb::PositionLogprobs> {
    d.logprobs
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|l| pb::PositionLogprobs {
            chosen: Some(pb::TokenLogprob {
                id: l.id,
                logprob: l.logprob,
            }),
            top: l
                .top
                .iter()
                .map(|&(id, logprob)| pb::TokenLogprob { id, logprob })
                .collect(),
        })
        .collect()
}

fn deadline_status(generated: usize) -> Status {
    Status::deadline_exceeded(format!(
        "the deadline passed after {generated} generated tokens"
    ))
}

/// Server-streaming response: deltas, one `finished`, then (for deadline
/// and engine failures) the error status in the trailers.
struct GenStream {
    flow: Flow,
    timer: Option<Pin<Box<Sleep>>>,
    /// Sent after the `finished` message.
    trailer: Option<Status>,
    ended: bool,
}

impl GenStream {
    fn new(flow: Flow) -> Self {
        let timer = flow
            .deadline
            .map(|d| Box::pin(tokio::time::sleep_until((d + STREAM_BACKSTOP_GRACE).into())));
        Self {
            flow,
            timer,
            trailer: None,
            ended: false,
        }
    }

    fn message(&self, event: pb::generate_stream_response::Event) -> pb::GenerateStreamResponse {
        pb::GenerateStreamResponse {
            request_id: self.flow.id.clone(),
            event: Some(event),
        }
    }
}

impl Stream for GenStream {
    type Item = Result<pb::GenerateStreamResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use pb::generate_stream_response::Event as Ev;
        let this = &mut *self;
        if let Some(s) = this.trailer.take() {
            this.ended = true;
            return Poll::Ready(Some(Err(s)));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let polled = loop {
            let Some(events) = this.flow.events.as_mut() else {
                this.ended = true;
                return Poll::Ready(None);
            };
            match Pin::new(events).poll_next(cx) {
                Poll::Ready(Some(Event::Token(mut d))) => {
                    if this.flow.on_delta(&mut d) {
                        break Poll::Ready(Some(Event::Token(d)));
                    }
                }
                other => break other,
            }
        };
        match polled {
            Poll::Ready(Some(Event::Token(d))) => {
                let msg = this.message(Ev::Delta(pb::TokenDelta {
                    logprobs: logprobs(&d),
                    ids: d.ids,
                    text: d.text,
                }));
                return Poll::Ready(Some(Ok(msg)));
            }
            Poll::Ready(Some(Event::Finished(f))) => {
                let status = this.flow.status_of(&f);
                let usage = this.flow.usage(Some(&f));
                let code = status.as_ref().map_or(Code::Ok, |s| s.code());
                this.flow.end(f.reason.as_str(), code);
                let msg = this.message(Ev::Finished(pb::Finished {
                    reason: finish_reason(f.reason) as i32,
                    usage: Some(usage),
                    error: f.error.clone().unwrap_or_default(),
                }));
                match status {
                    Some(s) => this.trailer = Some(s),
                    None => this.ended = true,
                }
                return Poll::Ready(Some(Ok(msg)));
            }
            Poll::Ready(None) => {
                // The event stream always ends with Finished; be safe anyway.
                this.flow.end("error", Code::Internal);
                this.ended = true;
                return Poll::Ready(Some(Err(Status::internal(
                    "the request ended without a final event",
                ))));
            }
            Poll::Pending => {}
        }
        if let Some(t) = this.timer.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                this.timer = None;
                this.flow.end("deadline", Code::DeadlineExceeded);
                this.ended = true;
                return Poll::Ready(Some(Err(deadline_status(this.flow.generated))));
            }
        }
        Poll::Pending
    }
}

pub type GenStreamBox =
    Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let tenant = match self.authenticate(&req) {
            Ok(t) => t,
            Err(s) => {
                record("Generate", s.code(), "none");
                return Err(s);
            }
        };
        let mut flow = match self.start("Generate", tenant.clone(), req) {
            Ok(f) => f,
            Err(s) => {
                record("Generate", s.code(), &tenant.name);
                return Err(s);
            }
        };
        let mut text = String::new();
        let mut ids = Vec::new();
        let mut lps = Vec::new();
        let timer = flow
            .unary_backstop
            .map(|d| tokio::time::sleep_until(d.into()));
        tokio::pin!(timer);
        loop {
            let Some(events) = flow.events.as_mut() else {
                flow.end("error", Code::Internal);
                return Err(Status::internal("the request ended without a final event"));
            };
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = async { match timer.as_mut().as_pin_mut() {
                    Some(t) => t.await,
                    None => std::future::pending().await,
                } } => {
                    flow.end("deadline", Code::DeadlineExceeded);
                    return Err(deadline_status(flow.generated));
                }
            };
            match ev {
                Some(Event::Token(mut d)) => {
                    flow.on_delta(&mut d);
                    text.push_str(&d.text);
                    lps.extend(logprobs(&d));
                    ids.extend_from_slice(&d.ids);
                }
                Some(Event::Finished(f)) => {
                    let status = flow.status_of(&f);
                    let usage = flow.usage(Some(&f));
                    let code = status.as_ref().map_or(Code::Ok, |s| s.code());
                    flow.end(f.reason.as_str(), code);
                    if let Some(s) = status {
                        return Err(s);
                    }
                    return Ok(Response::new(pb::GenerateResponse {
                        request_id: flow.id.clone(),
                        text,
                        ids,
                        logprobs: lps,
                        finish_reason: finish_reason(f.reason) as i32,
                        usage: Some(usage),
                    }));
                }
                None => {
                    flow.end("error", Code::Internal);
                    return Err(Status::internal("the request ended without a final event"));
                }
            }
        }
    }

    type GenerateStreamStream = GenStreamBox;

    async fn generate_stream(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenStreamBox>, Status> {
        self.stream_as("GenerateStream", req)
    }

    async fn tokenize(
        &self,
        req: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let st = self.state.clone();
        self.call("Tokenize", req, |_, req| async move {
            let ready = st.ready()?;
            let r = req.into_inner();
            validate::check_model("model", &r.model, &ready.model)?;
            if r.text.len() > MAX_TOKENIZE_BYTES {
                return Err(Status::invalid_argument(format!(
                    "text: {} bytes, at most {MAX_TOKENIZE_BYTES} allowed",
                    r.text.len()
                )));
            }
            let ids = ready
                .tokenizer
                .encode(&r.text)
                .map_err(|e| Status::internal(format!("tokenizer failed: {e}")))?;
            Ok(pb::TokenizeResponse { ids })
        })
        .await
    }

    async fn detokenize(
        &self,
        req: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let st = self.state.clone();
        self.call("Detokenize", req, |_, req| async move {
            let ready = st.ready()?;
            let r = req.into_inner();
            validate::check_model("model", &r.model, &ready.model)?;
            if r.ids.len() > MAX_DETOKENIZE_IDS {
                return Err(Status::invalid_argument(format!(
                    "ids: {} ids, at most {MAX_DETOKENIZE_IDS} allowed",
                    r.ids.len()
                )));
            }
            let vocab = ready.model.vocab_size;
            if let Some((i, &t)) = r.ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return Err(Status::invalid_argument(format!(
                    "ids[{i}] = {t} is outside the vocabulary (ids must be < {vocab})"
                )));
            }
            let text = ready
                .tokenizer
                .decode(&r.ids)
                .map_err(|e| Status::internal(format!("tokenizer failed: {e}")))?;
            Ok(pb::DetokenizeResponse { text })
        })
        .await
    }

    async fn list_models(
        &self,
        req: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let st = self.state.clone();
        self.call("ListModels", req, |_, _| async move {
            let ready = st.ready()?;
            Ok(pb::ListModelsResponse {
                models: vec![model_info(ready)],
            })
        })
        .await
    }

    async fn get_model(
        &self,
        req: Request<pb::GetModelRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        let st = self.state.clone();
        self.call("GetModel", req, |_, req| async move {
            let ready = st.ready()?;
            validate::check_model("name", &req.get_ref().name, &ready.model)?;
            Ok(model_info(ready))
        })
        .await
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let st = self.state.clone();
        self.call("Cancel", req, |tenant, req| async move {
            let ready = st.ready()?;
            let id = req.into_inner().request_id;
            if id.is_empty() {
                return Err(Status::invalid_argument("request_id must not be empty"));
            }
            if id.len() > validate::MAX_REQUEST_ID_BYTES {
                // Could never have been admitted.
                return Ok(pb::CancelResponse { cancelled: false });
            }
            // Scoped to the caller's tenant: another tenant's id is unknown here.
            let cancelled = ready.engine.cancel(&tenant.name, &id);
            if cancelled {
                info!(tenant = %tenant.name, request_id = %id, "cancel requested");
            }
            Ok(pb::CancelResponse { cancelled })
        })
        .await
    }
}

fn model_info(ready: &Ready) -> pb::ModelInfo {
    let m = &ready.model;
    let kv = &ready.engine.model_info().kv;
    let layers = |kind: &str| m.layer_kinds.iter().filter(|k| *k == kind).count() as u32;
    pb::ModelInfo {
        name: m.name.clone(),
        context_length: m.context_length as u32,
        vocab_size: m.vocab_size as u32,
        dtype: m.dtype.clone(),
        quantization: m.quantization.clone(),
        architecture: m.architecture.clone(),
        has_chat_template: ready.tokenizer.has_chat_template(),
        sliding_window: m.sliding_window.unwrap_or(0),
        layer_kinds: m.layer_kinds.clone(),
        kv_dtype: m.kv_dtype.clone(),
        kv_block_size: kv.block_size,
        kv_groups: kv
            .groups
            .iter()
            .map(|g| pb::KvGroupInfo {
                kind: g.kind.label().to_string(),
                layers: match g.kind {
                    weft_scheduler::kv_pool::AttentionKind::Full => layers("full_attention"),
                    weft_scheduler::kv_pool::AttentionKind::SlidingWindow { .. } => {
                        layers("sliding_attention")
                    }
                },
                blocks: g.num_blocks,
            })
            .collect(),
        adapters: m.adapters.list().iter().map(|a| a.info()).collect(),
        state_slots: m.state_slots,
        state_bytes_per_row: m.state_bytes_per_row,
    }
}

/// Logs a warning for requests still running when draining gives up.
pub fn warn_abandoned(state: &State) {
    let n = state.in_flight();
    if n > 0 {
        warn!(
            in_flight = n,
            "drain timeout reached; stopping the engine under the remaining requests"
        );
    }
}
