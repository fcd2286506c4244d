//! Sending one request and timing its stream: Weft gRPC (`GenerateStream`)
//! or an OpenAI-compatible `/v1/completions` with `"stream": true` (SSE).
//!
//! Every failure becomes a [`RequestRecord`] with a status, never a panic or
//! an early return of the whole run.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use super::sse::{parse_chunk, SseEvent, SseParser};
use super::stats::{RequestRecord, TokenClock, OK};
use crate::pb;

/// One request, fully decided before it is sent.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Unique request number of this run (warm-up included).
    pub index: u64,
    /// Index into the tenant list.
    pub tenant: usize,
    /// Prompt text.
    pub prompt: String,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// Per-request settings shared by all requests.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    /// Model name; `None` = the server's default.
    pub model: Option<String>,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Ask the server to keep generating past end-of-sequence.
    pub ignore_eos: bool,
    /// Per-request time limit.
    pub timeout: Duration,
    /// Tells this run's request ids apart from other runs'.
    pub nonce: u32,
}

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Client {
    /// Weft's gRPC `GenerateStream`, over one or more HTTP/2 connections
    /// (request `i` uses connection `i mod n`).
    Grpc {
        /// Lazily connected channels (connection errors surface per request).
        channels: Vec<Channel>,
        /// `authorization` value per tenant.
        auth: Vec<Option<MetadataValue<Ascii>>>,
    },
    /// OpenAI-compatible streaming completions over HTTP.
    OpenAi {
        /// Connection-pooling HTTP client.
        http: reqwest::Client,
        /// Full URL of the completions endpoint.
        url: String,
        /// `Authorization` value per tenant.
        auth: Vec<Option<reqwest::header::HeaderValue>>,
        /// Extra JSON fields merged into every request body.
        extra: serde_json::Map<String, serde_json::Value>,
    },
}

/// The gRPC URI for a `grpc://` (or `http://`) target.
pub fn grpc_uri(target: &str) -> Result<String, String> {
    if let Some(rest) = target.strip_prefix("grpc://") {
        Ok(format!("http://{rest}"))
    } else if target.starts_with("http://") {
        Ok(target.to_string())
    } else if target.starts_with("grpcs://") || target.starts_with("https://") {
        Err(format!(
            "`{target}`: TLS gRPC targets are not supported yet (use grpc://host:port)"
        ))
    } else {
        Err(format!(
            "`{target}`: expected grpc://host:port for the weft API"
        ))
    }
}

/// The completions URL for an `http(s)://` target: the target itself when it
/// has a path, else `<target>/v1/completions`.
pub fn completions_url(target: &str) -> Result<String, String> {
    let rest = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
        .ok_or_else(|| format!("`{target}`: expected http://host:port for the openai API"))?;
    match rest.find('/') {
        Some(i) if rest[i..].trim_end_matches('/').len() > 1 => Ok(target.to_string()),
        _ => Ok(format!("{}/v1/completions", target.trim_end_matches('/'))),
    }
}

impl Client {
    /// A gRPC client with `connections` channels; `keys` per tenant.
    pub fn grpc(target: &str, connections: usize, keys: &[Option<String>]) -> Result<Self, String> {
        let uri = grpc_uri(target)?;
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("`{target}`: bad URI: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10));
        let channels = (0..connections.max(1))
            .map(|_| endpoint.connect_lazy())
            .collect();
        let auth = keys
            .iter()
            .map(|k| {
                k.as_ref()
                    .map(|k| {
                        format!("Bearer {k}")
                            .parse::<MetadataValue<Ascii>>()
                            .map_err(|e| format!("API key can't be sent as metadata: {e}"))
                    })
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(Client::Grpc { channels, auth })
    }

    /// An OpenAI-compatible client; `keys` per tenant; `extra` fields are
    /// merged into each request body (and override the bench's own).
    pub fn openai(
        target: &str,
        keys: &[Option<String>],
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, String> {
        let url = completions_url(target)?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(4096)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let auth = keys
            .iter()
            .map(|k| {
                k.as_ref()
                    .map(|k| {
                        reqwest::header::HeaderValue::from_str(&format!("Bearer {k}"))
                            .map_err(|e| format!("API key can't be sent as a header: {e}"))
                    })
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(Client::OpenAi {
            http,
            url,
            auth,
            extra,
        })
    }

    /// Sends one request and measures it. Never fails: errors are statuses.
    pub async fn execute(&self, p: &Planned, o: &RequestOptions) -> RequestRecord {
        let clock = TokenClock::start();
        let fut = async {
            match self {
                Client::Grpc { channels, auth } => {
                    let ch = channels[(p.index % channels.len() as u64) as usize].clone();
                    grpc_request(ch, auth[p.tenant].clone(), p, o, clock).await
                }
                Client::OpenAi {
                    http,
                    url,
                    auth,
                    extra,
                } => openai_request(http, url, auth[p.tenant].clone(), extra, p, o, clock).await,
            }
        };
        match tokio::time::timeout(o.timeout, fut).await {
            Ok(r) => r,
            Err(_) => RequestRecord::failed(
                p.tenant,
                "TIMEOUT",
                format!("no complete answer within {:.1} s", o.timeout.as_secs_f64()),
            ),
        }
    }
}

/// The canonical gRPC name of a status code (`RESOURCE_EXHAUSTED`).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

fn status_record(tenant: usize, s: &tonic::Status) -> RequestRecord {
    let code = code_name(s.code());
    let mut msg = s.message().to_string();
    if let Some(src) = std::error::Error::source(s) {
        msg = format!("{msg} ({src})");
    }
    if let Some(ms) = s
        .metadata()
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
    {
        msg = format!("{msg} [retry-after-ms {ms}]");
    }
    RequestRecord::failed(tenant, code, msg)
}

async fn grpc_request(
    channel: Channel,
    auth: Option<MetadataValue<Ascii>>,
    p: &Planned,
    o: &RequestOptions,
    mut clock: TokenClock,
) -> RequestRecord {
    use pb::generate_stream_response::Event;
    let mut client = pb::generation_client::GenerationClient::new(channel);
    let body = pb::GenerateRequest {
        model: o.model.clone().unwrap_or_default(),
        input: Some(pb::generate_request::Input::Text(p.prompt.clone())),
        sampling: Some(pb::SamplingParams {
            temperature: o.temperature,
            ..Default::default()
        }),
        max_tokens: p.max_tokens,
        ignore_eos: o.ignore_eos,
        request_id: format!("bench-{:08x}-{}", o.nonce, p.index),
        ..Default::default()
    };
    let mut req = tonic::Request::new(body);
    req.set_timeout(o.timeout);
    if let Some(a) = auth {
        req.metadata_mut().insert("authorization", a);
    }
    let mut stream = match client.generate_stream(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => return status_record(p.tenant, &s),
    };
    loop {
        match stream.message().await {
            Ok(Some(msg)) => match msg.event {
                Some(Event::Delta(d)) => clock.tokens_arrived(d.ids.len() as u64),
                Some(Event::Finished(f)) => {
                    let e2e = clock.elapsed();
                    let reason = f.reason();
                    let (status, finish) = match reason {
                        pb::FinishReason::Length => (OK, "length"),
                        pb::FinishReason::Stop => (OK, "stop"),
                        pb::FinishReason::Eos => (OK, "eos"),
                        pb::FinishReason::Unspecified => (OK, "unspecified"),
                        pb::FinishReason::Cancelled => ("FINISHED_CANCELLED", "cancelled"),
                        pb::FinishReason::Error => ("FINISHED_ERROR", "error"),
                        pb::FinishReason::Deadline => ("FINISHED_DEADLINE", "deadline"),
                    };
                    let usage = f.usage.unwrap_or_default();
                    let tokens = if clock.tokens == 0 {
                        usage.generated_tokens as u64
                    } else {
                        clock.tokens
                    };
                    return RequestRecord {
                        tenant: p.tenant,
                        status: status.to_string(),
                        ttft: clock.ttft,
                        itl: std::mem::take(&mut clock.itl),
                        e2e,
                        output_tokens: tokens,
                        prompt_tokens: (usage.prompt_tokens > 0)
                            .then_some(usage.prompt_tokens as u64),
                        finish_reason: Some(finish.to_string()),
                        error: (status != OK).then(|| {
                            if f.error.is_empty() {
                                format!("stream finished with reason {finish}")
                            } else {
                                f.error.clone()
                            }
                        }),
                    };
                }
                None => {}
            },
            Ok(None) => {
                return RequestRecord::failed(
                    p.tenant,
                    "INCOMPLETE_STREAM",
                    format!(
                        "stream ended after {} tokens without a `finished` message",
                        clock.tokens
                    ),
                )
            }
            Err(s) => return status_record(p.tenant, &s),
        }
    }
}

fn reqwest_status(e: &reqwest::Error) -> &'static str {
    if e.is_connect() {
        "CONNECT_ERROR"
    } else if e.is_timeout() {
        "TIMEOUT"
    } else if e.is_body() || e.is_decode() {
        "STREAM_ERROR"
    } else {
        "HTTP_ERROR"
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// The JSON body of one streaming completion request.
pub fn openai_body(
    p: &Planned,
    o: &RequestOptions,
    extra: &serde_json::Map<String, serde_json::Value>,
) -> serde_json::Value {
    let mut body = serde_json::json!({
        "prompt": p.prompt,
        "max_tokens": p.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": o.temperature,
    });
    let obj = body.as_object_mut().expect("object");
    if let Some(m) = &o.model {
        obj.insert("model".into(), m.clone().into());
    }
    if o.ignore_eos {
        // vLLM/SGLang honour this; mlx_lm.server ignores unknown fields.
        obj.insert("ignore_eos".into(), true.into());
    }
    for (k, v) in extra {
        obj.insert(k.clone(), v.clone());
    }
    body
}

async fn openai_request(
    http: &reqwest::Client,
    url: &str,
    auth: Option<reqwest::header::HeaderValue>,
    extra: &serde_json::Map<String, serde_json::Value>,
    p: &Planned,
    o: &RequestOptions,
    mut clock: TokenClock,
) -> RequestRecord {
    let body = openai_body(p, o, extra);
    let mut req = http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .body(serde_json::to_vec(&body).expect("JSON body"));
    if let Some(a) = auth {
        req = req.header(reqwest::header::AUTHORIZATION, a);
    }
    let mut resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return RequestRecord::failed(p.tenant, reqwest_status(&e), error_chain(&e)),
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let text: String = text.chars().take(300).collect();
        return RequestRecord::failed(p.tenant, format!("HTTP {}", status.as_u16()), text);
    }
    let mut parser = SseParser::new();
    let mut done = false;
    let mut finish: Option<String> = None;
    let mut usage_tokens: Option<u64> = None;
    let mut prompt_tokens: Option<u64> = None;
    while !done {
        let events = match resp.chunk().await {
            Ok(Some(bytes)) => parser.push(&bytes),
            Ok(None) => {
                let ev = parser.finish();
                done = true;
                ev
            }
            Err(e) => {
                return RequestRecord::failed(
                    p.tenant,
                    "STREAM_ERROR",
                    format!("after {} tokens: {}", clock.tokens, error_chain(&e)),
                )
            }
        };
        let mut saw_done = false;
        for ev in events {
            match ev {
                SseEvent::Done => saw_done = true,
                SseEvent::Data(d) => {
                    let c = match parse_chunk(&d) {
                        Ok(c) => c,
                        Err(e) => return RequestRecord::failed(p.tenant, "BAD_CHUNK", e),
                    };
                    if let Some(e) = c.error {
                        return RequestRecord::failed(p.tenant, "STREAM_ERROR", e);
                    }
                    // SSE chunks carry no token count: each chunk with text
                    // is taken as one token (mlx_lm.server sends one per
                    // token, unless its detokenizer held text back).
                    if !c.text.is_empty() {
                        clock.tokens_arrived(1);
                    }
                    if c.finish_reason.is_some() {
                        finish = c.finish_reason;
                    }
                    if c.completion_tokens.is_some() {
                        usage_tokens = c.completion_tokens;
                    }
                    if c.prompt_tokens.is_some() {
                        prompt_tokens = c.prompt_tokens;
                    }
                }
            }
        }
        if saw_done {
            let e2e = clock.elapsed();
            return RequestRecord {
                tenant: p.tenant,
                status: OK.into(),
                ttft: clock.ttft,
                itl: std::mem::take(&mut clock.itl),
                e2e,
                output_tokens: usage_tokens.unwrap_or(clock.tokens),
                prompt_tokens,
                finish_reason: finish.or_else(|| Some("unspecified".into())),
                error: None,
            };
        }
    }
    // The body ended without `[DONE]`: fine if a finish reason came.
    if finish.is_some() {
        let e2e = clock.elapsed();
        return RequestRecord {
            tenant: p.tenant,
            status: OK.into(),
            ttft: clock.ttft,
            itl: std::mem::take(&mut clock.itl),
            e2e,
            output_tokens: usage_tokens.unwrap_or(clock.tokens),
            prompt_tokens,
            finish_reason: finish,
            error: None,
        };
    }
    RequestRecord::failed(
        p.tenant,
        "INCOMPLETE_STREAM",
        format!(
            "body ended after {} chunks without [DONE] or a finish reason",
            clock.tokens
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            grpc_uri("grpc://127.0.0.1:50051").unwrap(),
            "http://127.0.0.1:50051"
        );
        assert_eq!(grpc_uri("http://[::1]:1").unwrap(), "http://[::1]:1");
        assert!(grpc_uri("grpcs://x:1").unwrap_err().contains("TLS"));
        assert!(grpc_uri("127.0.0.1:1").unwrap_err().contains("grpc://"));
        assert_eq!(
            completions_url("http://127.0.0.1:8080").unwrap(),
            "http://127.0.0.1:8080/v1/completions"
        );
        assert_eq!(
            completions_url("http://127.0.0.1:8080/").unwrap(),
            "http://127.0.0.1:8080/v1/completions"
        );
        assert_eq!(
            completions_url("https://h/v1/chat/completions").unwrap(),
            "https://h/v1/chat/completions"
        );
        assert!(completions_url("grpc://h:1").is_err());
    }

    #[test]
    fn code_names_are_canonical() {
        assert_eq!(
            code_name(tonic::Code::ResourceExhausted),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(code_name(tonic::Code::Unauthenticated), "UNAUTHENTICATED");
        assert_eq!(
            code_name(tonic::Code::DeadlineExceeded),
            "DEADLINE_EXCEEDED"
        );
    }

    #[test]
    fn openai_body_fields() {
        let p = Planned {
            index: 3,
            tenant: 0,
            prompt: "hi".into(),
            max_tokens: 64,
        };
        let mut o = RequestOptions {
            model: None,
            temperature: 0.0,
            ignore_eos: true,
            timeout: Duration::from_secs(1),
            nonce: 1,
        };
        let mut extra = serde_json::Map::new();
        let b = openai_body(&p, &o, &extra);
        assert_eq!(b["max_tokens"], 64);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert!(b.get("model").is_none());
        assert!(b.get("seed").is_none(), "a seed serializes mlx_lm.server");
        o.model = Some("m".into());
        o.ignore_eos = false;
        extra.insert("min_tokens".into(), 64.into());
        extra.insert("temperature".into(), 0.7.into());
        let b = openai_body(&p, &o, &extra);
        assert_eq!(b["model"], "m");
        assert!(b.get("ignore_eos").is_none());
        assert_eq!(b["min_tokens"], 64);
        assert_eq!(b["temperature"], 0.7);
    }
}
