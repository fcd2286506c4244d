//! The OpenAI-compatible HTTP API, on its own listener (`--http-listen`):
//! `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming with
//! `stream_options.include_usage`), `GET /v1/models`, `GET /health`.
//!
//! Every request becomes a `weft.v1` `GenerateRequest` and runs through the
//! gRPC service's own path — the same tenants (`Authorization: Bearer`),
//! validation, admission, metrics and engine — so the two APIs cannot drift.
//! A status becomes an OpenAI error object with the matching HTTP status
//! (400 naming the parameter, 401, 429 with `Retry-After`, 503 while
//! draining). Both kinds of request consume the engine's event stream, so a
//! client that disconnects drops it and the request leaves the batch at the
//! next step — non-streaming requests included.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use super::service::{GenerationService, State};
use crate::pb;
use crate::pb::generation_server::Generation;

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 8 << 20;

#[derive(Clone)]
struct Api {
    svc: GenerationService,
    admin: Arc<super::admin::AdminService>,
    state: Arc<State>,
}

/// The HTTP routes over the shared server state.
pub fn router(state: Arc<State>) -> Router {
    let api = Api {
        svc: GenerationService::new(state.clone()),
        admin: Arc::new(super::admin::AdminService::new(state.clone())),
        state,
    };
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/health", get(health))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(api)
}

// ----- request bodies ------------------------------------------------------

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Parameters both endpoints take (plus Weft's extensions `top_k`, `min_p`,
/// `repetition_penalty`, `ignore_eos`, `priority`, `request_id`).
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
    /// Accepted for compatibility; tenants come from the API key.
    #[allow(dead_code)]
    user: Option<String>,
    #[serde(default)]
    ignore_eos: bool,
    priority: Option<i32>,
    request_id: Option<String>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`.
    response_format: Option<Value>,
    /// vLLM's names for the other constraints: a regex, a Lark grammar, a choice list.
    guided_regex: Option<String>,
    guided_grammar: Option<String>,
    guided_choice: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    #[serde(default)]
    echo: bool,
    best_of: Option<u32>,
    suffix: Option<String>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<u32>,
    tools: Option<Value>,
    #[serde(flatten)]
    common: Common,
}

// ----- errors --------------------------------------------------------------

/// An OpenAI-style error response.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<String>,
    retry_after_ms: Option<u64>,
}

impl ApiError {
    fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
            retry_after_ms: None,
        }
    }

    /// The HTTP form of a gRPC status from the shared path.
    fn from_status(s: &Status, chat: bool) -> Self {
        let (status, kind) = match s.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
            Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
            Code::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        let retry_after_ms = s
            .metadata()
            .get("retry-after-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Self {
            status,
            kind,
            message: s.message().to_string(),
            param: (status == StatusCode::BAD_REQUEST)
                .then(|| param_of(s.message(), chat))
                .flatten(),
            retry_after_ms,
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(ms) = self.retry_after_ms {
            let h = r.headers_mut();
            if let Ok(v) = HeaderValue::from_str(&ms.div_ceil(1000).max(1).to_string()) {
                h.insert(header::RETRY_AFTER, v);
            }
            if let Ok(v) = HeaderValue::from_str(&ms.to_string()) {
                h.insert("retry-after-ms", v);
            }
        }
        r
    }
}

/// The OpenAI parameter a `weft.v1` validation message is about.
fn param_of(message: &str, chat: bool) -> Option<String> {
    let head = message.split([' ', ':', '[']).next().unwrap_or("");
    let p = match head {
        h if h.starts_with("sampling.") => &h["sampling.".len()..],
        "input" | "input.text" | "input.tokens.ids" | "prompt" => {
            if chat {
                "messages"
            } else {
                "prompt"
            }
        }
        h if h.starts_with("input.chat") => "messages",
        "stop" => "stop",
        "max_tokens" => {
            if chat {
                "max_completion_tokens"
            } else {
                "max_tokens"
            }
        }
        "logprobs" => {
            if chat {
                "top_logprobs"
            } else {
                "logprobs"
            }
        }
        "priority" => "priority",
        "request_id" => "request_id",
        "constraint.json_schema" | "constraint.json_object" => "response_format",
        "constraint.regex" => "guided_regex",
        "constraint.grammar" => "guided_grammar",
        "constraint.choice" => "guided_choice",
        "model" => "model",
        _ => return None,
    };
    Some(p.to_string())
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let msg = e.to_string();
        // serde names missing fields and unknown variants in backticks.
        let param = msg
            .split('`')
            .nth(1)
            .filter(|_| msg.starts_with("missing field"))
            .unwrap_or("body")
            .to_string();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!("invalid request body: {msg}"),
            param: Some(param),
            retry_after_ms: None,
        }
    })
}

// ----- mapping to weft.v1 --------------------------------------------------

fn sampling(c: &Common) -> Result<pb::SamplingParams, ApiError> {
    let seed = match c.seed {
        None => None,
        Some(s) => {
            Some(u64::try_from(s).map_err(|_| ApiError::invalid("seed", "seed must be >= 0"))?)
        }
    };
    Ok(pb::SamplingParams {
        // OpenAI's default temperature is 1, as is its default top_p.
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(1.0),
        top_k: c.top_k.unwrap_or(0),
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(0.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        seed,
    })
}

/// The output constraint of `response_format` or one of the `guided_*` fields (at
/// most one of them).
fn constraint(c: &Common) -> Result<Option<pb::OutputConstraint>, ApiError> {
    use pb::output_constraint::Kind;
    let mut set: Vec<(&str, Kind)> = Vec::new();
    if let Some(f) = &c.response_format {
        let bad = |m: String| ApiError::invalid("response_format", m);
        let kind = f.get("type").and_then(Value::as_str).ok_or_else(|| {
            bad("response_format must be an object with a string \"type\"".into())
        })?;
        match kind {
            "text" => {}
            "json_object" => set.push(("response_format", Kind::JsonObject(true))),
            "json_schema" => {
                let schema = f
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| {
                        bad(
                            "response_format.json_schema.schema is required for type json_schema"
                                .into(),
                        )
                    })?;
                set.push(("response_format", Kind::JsonSchema(schema.to_string())));
            }
            other => {
                return Err(bad(format!(
                "response_format type {other:?} is not supported (text, json_object, json_schema)"
            )))
            }
        }
    }
    if let Some(r) = &c.guided_regex {
        set.push(("guided_regex", Kind::Regex(r.clone())));
    }
    if let Some(g) = &c.guided_grammar {
        set.push(("guided_grammar", Kind::Grammar(g.clone())));
    }
    if let Some(ch) = &c.guided_choice {
        set.push((
            "guided_choice",
            Kind::Choice(pb::Choices {
                choices: ch.clone(),
            }),
        ));
    }
    match set.len() {
        0 => Ok(None),
        1 => Ok(set
            .pop()
            .map(|(_, k)| pb::OutputConstraint { kind: Some(k) })),
        _ => Err(ApiError::invalid(
            set[1].0,
            format!(
                "{} and {} both constrain the output; set at most one of response_format \
                 (json_object, json_schema), guided_regex, guided_grammar, guided_choice",
                set[0].0, set[1].0
            ),
        )),
    }
}

fn base_request(c: &Common, max_tokens: Option<u32>) -> Result<pb::GenerateRequest, ApiError> {
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            format!("n = {n}: only one choice per request is served (n = 1)"),
        ));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    Ok(pb::GenerateRequest {
        model: c.model.clone().unwrap_or_default(),
        input: None,
        sampling: Some(sampling(c)?),
        max_tokens: max_tokens.unwrap_or(0),
        stop,
        stop_token_ids: Vec::new(),
        ignore_eos: c.ignore_eos,
        logprobs: 0,
        priority: c.priority.unwrap_or(0),
        request_id: c.request_id.clone().unwrap_or_default(),
        constraint: constraint(c)?,
        // `model` names the adapter on this API (`build` resolves it).
        adapter: String::new(),
    })
}

fn completion_request(b: &CompletionBody) -> Result<pb::GenerateRequest, ApiError> {
    if b.echo {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if let Some(n) = b.best_of.filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            "best_of",
            format!("best_of = {n}: only best_of = 1 is served"),
        ));
    }
    if b.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let mut r = base_request(&b.common, b.max_tokens.or(Some(16)))?;
    use pb::generate_request::Input;
    r.input = Some(match &b.prompt {
        Prompt::Text(t) => Input::Text(t.clone()),
        Prompt::Ids(ids) => Input::Tokens(pb::TokenIds { ids: ids.clone() }),
        Prompt::Texts(v) if v.len() == 1 => Input::Text(v[0].clone()),
        Prompt::IdLists(v) if v.len() == 1 => Input::Tokens(pb::TokenIds { ids: v[0].clone() }),
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt must be one string or one list of token ids (batches of prompts are not served)",
            ))
        }
    });
    // OpenAI's `logprobs: 0` still returns the chosen token's logprob.
    r.logprobs = b.logprobs.map_or(0, |n| n.max(1));
    Ok(r)
}

fn chat_request(b: &ChatBody) -> Result<pb::GenerateRequest, ApiError> {
    if b.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::invalid("tools", "tool calls are not supported"));
    }
    let max = b.max_completion_tokens.or(b.max_tokens);
    let mut r = base_request(&b.common, max)?;
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.iter().enumerate() {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                &format!("messages[{i}].content"),
                                format!(
                                    "content parts of type {kind:?} are not supported (text only)"
                                ),
                            ))
                        }
                    }
                }
                text
            }
        };
        messages.push(pb::ChatMessage {
            role: m.role.clone(),
            content,
        });
    }
    r.input = Some(pb::generate_request::Input::Chat(pb::Chat { messages }));
    if b.logprobs {
        r.logprobs = b.top_logprobs.unwrap_or(0).max(1);
    } else if b.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs = true",
        ));
    }
    Ok(r)
}

/// The gRPC request: the body plus the caller's `Authorization` header.
fn grpc_request<T>(headers: &HeaderMap, body: T) -> Result<tonic::Request<T>, ApiError> {
    let mut req = tonic::Request::new(body);
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v
            .to_str()
            .ok()
            .and_then(|s| MetadataValue::try_from(s).ok());
        match v {
            Some(v) => {
                req.metadata_mut().insert("authorization", v);
            }
            None => {
                return Err(ApiError::from_status(
                    &Status::unauthenticated(
                        "malformed authorization header: expected `Bearer <key>`",
                    ),
                    false,
                ))
            }
        }
    }
    Ok(req)
}

// ----- responses -----------------------------------------------------------

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn finish_reason(r: i32) -> Option<&'static str> {
    match pb::FinishReason::try_from(r).ok()? {
        pb::FinishReason::Length | pb::FinishReason::Deadline => Some("length"),
        pb::FinishReason::Stop | pb::FinishReason::Eos => Some("stop"),
        _ => None,
    }
}

fn usage(u: Option<&pb::Usage>) -> Value {
    let (p, g, c) = u.map_or((0, 0, 0), |u| {
        (u.prompt_tokens, u.generated_tokens, u.cached_prompt_tokens)
    });
    json!({
        "prompt_tokens": p,
        "completion_tokens": g,
        "total_tokens": p + g,
        "prompt_tokens_details": {"cached_tokens": c},
    })
}

/// What one endpoint's answer looks like.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<weft_models::Tokenizer>,
}

impl Shape {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id]).unwrap_or_default()
    }

    /// Logprobs of `lps` in the endpoint's format (`None`: none asked for).
    fn logprobs(&self, lps: &[pb::PositionLogprobs], offset: usize) -> Value {
        match self.kind {
            Kind::Completion => {
                let mut tokens = Vec::new();
                let mut token_logprobs = Vec::new();
                let mut top = Vec::new();
                let mut offsets = Vec::new();
                let mut at = offset;
                for p in lps {
                    let c = p.chosen.unwrap_or_default();
                    let t = self.token_text(c.id);
                    offsets.push(at);
                    at += t.len();
                    tokens.push(t);
                    token_logprobs.push(c.logprob);
                    let m: serde_json::Map<String, Value> = p
                        .top
                        .iter()
                        .map(|x| (self.token_text(x.id), json!(x.logprob)))
                        .collect();
                    top.push(Value::Object(m));
                }
                json!({"tokens": tokens, "token_logprobs": token_logprobs,
                       "top_logprobs": top, "text_offset": offsets})
            }
            Kind::Chat => {
                let content: Vec<Value> = lps
                    .iter()
                    .map(|p| {
                        let c = p.chosen.unwrap_or_default();
                        let t = self.token_text(c.id);
                        json!({
                            "token": t,
                            "logprob": c.logprob,
                            "bytes": t.as_bytes(),
                            "top_logprobs": p.top.iter().map(|x| {
                                let t = self.token_text(x.id);
                                json!({"token": t, "logprob": x.logprob, "bytes": t.as_bytes()})
                            }).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("choices".into(), choices);
        m
    }

    /// One streamed delta (or the final chunk, with `finish`).
    fn chunk(&self, text: &str, lps: Option<Value>, finish: Option<&str>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": text,
                "logprobs": lps, "finish_reason": finish}),
            Kind::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish})
            }
        };
        Value::Object(self.envelope(true, json!([choice])))
    }
}

/// Runs the request through the gRPC path: its event stream, or the error.
async fn start(
    api: &Api,
    headers: &HeaderMap,
    body: pb::GenerateRequest,
    chat: bool,
) -> Result<impl Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send + 'static, ApiError>
{
    let req = grpc_request(headers, body)?;
    let method = if chat {
        "openai.chat_completions"
    } else {
        "openai.completions"
    };
    match api.svc.stream_as(method, req) {
        Ok(r) => Ok(r.into_inner()),
        Err(s) => Err(ApiError::from_status(&s, chat)),
    }
}

/// `asked`: the request's `model`; responses echo an adapter's name when it
/// named one, else the served model's.
fn shape(api: &Api, kind: Kind, request_id: &str, asked: &str) -> Result<Shape, ApiError> {
    let ready = api.state.ready.get().ok_or_else(|| {
        ApiError::from_status(
            &Status::unavailable("the model is still loading; retry shortly"),
            false,
        )
    })?;
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    Ok(Shape {
        kind,
        id: format!("{prefix}-{request_id}"),
        created: now_unix(),
        model: match ready.model.adapter(asked) {
            Some(a) => a.name.clone(),
            None => ready.model.name.clone(),
        },
        tokenizer: ready.tokenizer.clone(),
    })
}

async fn respond(
    api: Api,
    headers: HeaderMap,
    req: pb::GenerateRequest,
    kind: Kind,
    stream: bool,
    include_usage: bool,
) -> Response {
    let chat = kind == Kind::Chat;
    let wants_logprobs = req.logprobs > 0;
    let asked_model = req.model.clone();
    let mut events = match start(&api, &headers, req, chat).await {
        Ok(s) => Box::pin(s),
        Err(e) => return e.into_response(),
    };
    // The first message names the request (admitted by now).
    let first = events.next().await;
    let request_id = match &first {
        Some(Ok(m)) => m.request_id.clone(),
        Some(Err(s)) => return ApiError::from_status(s, chat).into_response(),
        None => String::new(),
    };
    let sh = match shape(&api, kind, &request_id, &asked_model) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let events = stream::iter(first).chain(events);
    if stream {
        return Sse::new(sse(sh, events, wants_logprobs, include_usage))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    // Whole answer: the same event stream, collected (dropped if the client
    // goes away, which cancels the request).
    tokio::pin!(events);
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut fin: Option<pb::Finished> = None;
    while let Some(m) = events.next().await {
        match m {
            Err(s) => return ApiError::from_status(&s, chat).into_response(),
            Ok(m) => match m.event {
                Some(pb::generate_stream_response::Event::Delta(d)) => {
                    text.push_str(&d.text);
                    lps.extend(d.logprobs);
                }
                Some(pb::generate_stream_response::Event::Finished(f)) => fin = Some(f),
                None => {}
            },
        }
    }
    let Some(f) = fin else {
        return ApiError::from_status(
            &Status::internal("the request ended without a final event"),
            chat,
        )
        .into_response();
    };
    let reason = finish_reason(f.reason);
    let lp = wants_logprobs.then(|| sh.logprobs(&lps, 0));
    let choice = match kind {
        Kind::Completion => json!({"index": 0, "text": text, "logprobs": lp,
            "finish_reason": reason}),
        Kind::Chat => json!({"index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp, "finish_reason": reason}),
    };
    let mut body = sh.envelope(false, json!([choice]));
    body.insert("usage".into(), usage(f.usage.as_ref()));
    Json(Value::Object(body)).into_response()
}

/// The SSE events of a streamed answer: deltas, the final chunk, the usage
/// chunk when asked for, `[DONE]`; an error mid-stream is one error event.
fn sse(
    sh: Shape,
    events: impl Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send + 'static,
    wants_logprobs: bool,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    struct St<S> {
        sh: Shape,
        events: std::pin::Pin<Box<S>>,
        first: bool,
        offset: usize,
        done: bool,
    }
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let done_event = || SseEvent::default().data("[DONE]");
    let st = St {
        sh,
        events: Box::pin(events),
        first: true,
        offset: 0,
        done: false,
    };
    stream::unfold(st, move |mut st| async move {
        let chat = st.sh.kind == Kind::Chat;
        while !st.done {
            let mut out: Vec<SseEvent> = Vec::new();
            match st.events.next().await {
                None => {
                    st.done = true;
                    out.push(done_event());
                }
                Some(Err(s)) => {
                    st.done = true;
                    out.push(data(ApiError::from_status(&s, chat).body()));
                    out.push(done_event());
                }
                Some(Ok(m)) => match m.event {
                    Some(pb::generate_stream_response::Event::Delta(d)) => {
                        let lp = wants_logprobs.then(|| st.sh.logprobs(&d.logprobs, st.offset));
                        st.offset += d.text.len();
                        out.push(data(st.sh.chunk(&d.text, lp, None, st.first)));
                        st.first = false;
                    }
                    Some(pb::generate_stream_response::Event::Finished(f)) => {
                        st.done = true;
                        match finish_reason(f.reason) {
                            Some(r) => out.push(data(st.sh.chunk("", None, Some(r), st.first))),
                            None => {
                                let msg = if f.error.is_empty() {
                                    "the request ended early".to_string()
                                } else {
                                    f.error.clone()
                                };
                                out.push(data(
                                    ApiError::from_status(&Status::internal(msg), chat).body(),
                                ));
                            }
                        }
                        if include_usage {
                            let mut u = st.sh.envelope(true, json!([]));
                            u.insert("usage".into(), usage(f.usage.as_ref()));
                            out.push(data(Value::Object(u)));
                        }
                        out.push(done_event());
                    }
                    None => {}
                },
            }
            if !out.is_empty() {
                return Some((stream::iter(out), st));
            }
        }
        None
    })
    .flatten()
    .map(Ok)
}

// ----- handlers ------------------------------------------------------------

impl Common {
    /// (`stream`, `stream_options.include_usage`).
    fn streaming(&self) -> (bool, bool) {
        let usage = self
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        (self.stream, usage)
    }
}

/// An endpoint's request body.
trait Body: serde::de::DeserializeOwned {
    const KIND: Kind;
    fn common(&self) -> &Common;
    fn request(&self) -> Result<pb::GenerateRequest, ApiError>;
}

impl Body for CompletionBody {
    const KIND: Kind = Kind::Completion;
    fn common(&self) -> &Common {
        &self.common
    }
    fn request(&self) -> Result<pb::GenerateRequest, ApiError> {
        completion_request(self)
    }
}

impl Body for ChatBody {
    const KIND: Kind = Kind::Chat;
    fn common(&self) -> &Common {
        &self.common
    }
    fn request(&self) -> Result<pb::GenerateRequest, ApiError> {
        chat_request(self)
    }
}

/// Parses a body, maps it to a `weft.v1` request and answers it.
async fn handle<B: Body>(api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let b: B = match parse(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let (stream, usage) = b.common().streaming();
    match b.request() {
        Ok(r) => respond(api, headers, r, B::KIND, stream, usage).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(AxState(api): AxState<Api>, headers: HeaderMap, body: Bytes) -> Response {
    handle::<CompletionBody>(api, headers, body).await
}

async fn chat_completions(AxState(api): AxState<Api>, headers: HeaderMap, body: Bytes) -> Response {
    handle::<ChatBody>(api, headers, body).await
}

/// vLLM's run-time LoRA routes: `{"lora_name", "lora_path"}` (the path under
/// `--adapter-root`), the Admin service's LoadAdapter / UnloadAdapter with its
/// authorization and statuses.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoraBody {
    lora_name: String,
    #[serde(default)]
    lora_path: Option<String>,
}

/// The Admin call a LoRA route's body and headers make (`make` builds its
/// message from the body).
fn lora_call<T>(
    headers: &HeaderMap,
    body: &Bytes,
    make: impl FnOnce(LoraBody) -> Result<T, ApiError>,
) -> Result<tonic::Request<T>, ApiError> {
    grpc_request(headers, make(parse(body)?)?)
}

async fn load_lora_adapter(
    AxState(api): AxState<Api>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use pb::admin_server::Admin;
    let req = lora_call(&headers, &body, |b| {
        let path = b.lora_path.ok_or_else(|| {
            ApiError::invalid(
                "lora_path",
                "lora_path: the adapter's directory is required",
            )
        })?;
        Ok(pb::LoadAdapterRequest {
            name: b.lora_name,
            path,
        })
    });
    let out = match req {
        Ok(r) => api.admin.load_adapter(r).await,
        Err(e) => return e.into_response(),
    };
    match out {
        Ok(r) => {
            let a = r.into_inner();
            Json(
                json!({"object": "lora_adapter", "name": a.name, "rank": a.rank,
                        "scale": a.scale, "targets": a.targets, "format": a.format}),
            )
            .into_response()
        }
        Err(s) => admin_error(&s).into_response(),
    }
}

async fn unload_lora_adapter(
    AxState(api): AxState<Api>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use pb::admin_server::Admin;
    let req = lora_call(&headers, &body, |b| {
        Ok(pb::UnloadAdapterRequest { name: b.lora_name })
    });
    let out = match req {
        Ok(r) => api.admin.unload_adapter(r).await,
        Err(e) => return e.into_response(),
    };
    match out {
        Ok(r) => Json(json!({"object": "lora_adapter", "unloaded": true,
                             "live_requests": r.into_inner().live_requests}))
        .into_response(),
        Err(s) => admin_error(&s).into_response(),
    }
}

/// An Admin status over HTTP: a name in use is a conflict (409).
fn admin_error(s: &Status) -> ApiError {
    let mut e = ApiError::from_status(s, false);
    if s.code() == Code::AlreadyExists {
        e.status = StatusCode::CONFLICT;
        e.kind = "invalid_request_error";
    }
    e
}

async fn models(AxState(api): AxState<Api>, headers: HeaderMap) -> Response {
    let req = match grpc_request(&headers, pb::GenerateRequest::default()) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut lr = tonic::Request::new(pb::ListModelsRequest {});
    *lr.metadata_mut() = req.metadata().clone();
    match api.svc.list_models(lr).await {
        Ok(r) => {
            let created = now_unix();
            // The model, then each adapter as a model of its own (`parent`: the
            // base), which is what `model` names to run with it (vLLM's way).
            let data: Vec<Value> = r
                .into_inner()
                .models
                .iter()
                .flat_map(|m| {
                    std::iter::once(json!({"id": m.name, "object": "model", "created": created,
                           "owned_by": "weft", "max_model_len": m.context_length}))
                    .chain(m.adapters.iter().map(|a| {
                        json!({"id": a.name, "object": "model", "created": created,
                               "owned_by": "weft", "max_model_len": m.context_length,
                               "parent": m.name})
                    }))
                })
                .collect();
            Json(json!({"object": "list", "data": data})).into_response()
        }
        Err(s) => ApiError::from_status(&s, false).into_response(),
    }
}

async fn health(AxState(api): AxState<Api>) -> Response {
    if api.state.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response()
    } else if api.state.ready.get().is_none() {
        (StatusCode::SERVICE_UNAVAILABLE, "loading\n").into_response()
    } else {
        (StatusCode::OK, "ok\n").into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_messages_name_the_openai_parameter() {
        let p = |m: &str, chat| param_of(m, chat);
        assert_eq!(
            p("sampling.temperature must be in [0, 100], got 200", false).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            p("stop[2] must not be empty", true).as_deref(),
            Some("stop")
        );
        assert_eq!(
            p("max_tokens 9000 does not fit", true).as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(
            p("input.chat.messages must not be empty", true).as_deref(),
            Some("messages")
        );
        assert_eq!(
            p("prompt is 9000 tokens; the model context", false).as_deref(),
            Some("prompt")
        );
        assert_eq!(p("something else", false), None);
    }

    #[test]
    fn request_mapping_and_refusals() {
        let b: CompletionBody = serde_json::from_str(
            r#"{"model": "m", "prompt": "hi", "max_tokens": 5, "stop": "x", "seed": 3, "user": "u"}"#,
        )
        .unwrap();
        let r = completion_request(&b).unwrap();
        assert_eq!(r.max_tokens, 5);
        assert_eq!(r.stop, vec!["x"]);
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.seed), (1.0, Some(3)));
        let bad: CompletionBody =
            serde_json::from_str(r#"{"prompt": ["a", "b"], "n": 1}"#).unwrap();
        assert_eq!(
            completion_request(&bad).err().unwrap().param.as_deref(),
            Some("prompt")
        );
        let n2: ChatBody =
            serde_json::from_str(r#"{"messages": [{"role": "user", "content": "hi"}], "n": 2}"#)
                .unwrap();
        assert_eq!(chat_request(&n2).err().unwrap().param.as_deref(), Some("n"));
        let parts: ChatBody = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 2}"#,
        )
        .unwrap();
        let r = chat_request(&parts).unwrap();
        assert_eq!((r.max_tokens, r.logprobs), (7, 2));
        match r.input {
            Some(pb::generate_request::Input::Chat(c)) => assert_eq!(c.messages[0].content, "ab"),
            _ => panic!("chat input"),
        }
        let e = parse::<CompletionBody>(&Bytes::from_static(b"{\"max_tokens\": 3}"))
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn statuses_map_to_http() {
        let mut s = Status::resource_exhausted("queue full; retry after 1500 ms");
        s.metadata_mut()
            .insert("retry-after-ms", MetadataValue::from(1500u64));
        let e = ApiError::from_status(&s, false);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        assert_eq!(
            ApiError::from_status(&Status::unauthenticated("no"), false).status,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            ApiError::from_status(&Status::unavailable("draining"), false).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
