//! Turning a `GenerateRequest` into a scheduler `Request`: every field is
//! checked, and a bad one is INVALID_ARGUMENT naming the field and its limit.
//! Nothing here panics on client input.

use std::time::{Duration, Instant};

use tonic::Status;
use weft_models::{ChatMessage, Tokenizer};
use weft_scheduler::{Constraint, ConstraintSpec, Grammars, Request, SamplingParams};

use super::tenants::Tenant;
use crate::pb;
use crate::runtime::ServedModel;

pub const MAX_STOP_STRINGS: usize = 8;
pub const MAX_STOP_BYTES: usize = 64;
pub const MAX_STOP_TOKEN_IDS: usize = 64;
pub const MAX_LOGPROBS: u32 = 20;
pub const MAX_REQUEST_ID_BYTES: usize = 128;
pub const MAX_TEMPERATURE: f32 = 100.0;
pub const MAX_CHAT_MESSAGES: usize = 4096;

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// What the model and the server allow, for building requests.
pub struct Limits<'a> {
    pub model: &'a ServedModel,
    pub tokenizer: &'a Tokenizer,
    pub default_max_tokens: usize,
    /// Compiles output constraints against the served tokenizer (None: the tokenizer
    /// could not be adapted, and constrained requests are refused).
    pub grammars: Option<&'a Grammars>,
}

/// The request's output constraint, compiled; INVALID_ARGUMENT naming
/// `constraint.<kind>` and what is wrong with it.
pub fn constraint(
    c: Option<&pb::OutputConstraint>,
    grammars: Option<&Grammars>,
) -> Result<Option<Constraint>, Status> {
    use pb::output_constraint::Kind;
    let Some(c) = c else { return Ok(None) };
    let spec = match &c.kind {
        None => return Ok(None),
        Some(Kind::JsonSchema(s)) => ConstraintSpec::JsonSchema(s.clone()),
        Some(Kind::JsonObject(true)) => ConstraintSpec::JsonObject,
        Some(Kind::JsonObject(false)) => {
            return Err(invalid(
                "constraint.json_object must be true when set (leave the constraint unset for free text)",
            ))
        }
        Some(Kind::Regex(s)) => ConstraintSpec::Regex(s.clone()),
        Some(Kind::Grammar(s)) => ConstraintSpec::Lark(s.clone()),
        Some(Kind::Choice(c)) => ConstraintSpec::Choice(c.choices.clone()),
    };
    let kind = spec.kind();
    let Some(g) = grammars else {
        return Err(invalid(format!(
            "constraint.{kind}: constrained output is not available for this model's tokenizer"
        )));
    };
    g.compile(&spec)
        .map(Some)
        .map_err(|e| invalid(format!("constraint.{kind}: {e}")))
}

/// Checks a model name: empty, the served model's name, or one of its
/// adapters' (the same model and tokenizer, run with that adapter).
pub fn check_model(field: &str, name: &str, model: &ServedModel) -> Result<(), Status> {
    if name.is_empty() || name == model.name || model.adapter(name).is_some() {
        Ok(())
    } else if model.adapters.is_empty() {
        Err(Status::not_found(format!(
            "{field}: unknown model {name:?}; this server serves {:?}",
            model.name
        )))
    } else {
        Err(Status::not_found(format!(
            "{field}: unknown model {name:?}; this server serves {:?} and its adapters {}",
            model.name,
            adapter_names(model)
        )))
    }
}

fn adapter_names(model: &ServedModel) -> String {
    model.adapters.names()
}

/// The adapter a request runs with: `adapter`, else the adapter `model` names
/// (the OpenAI API's way), else none. INVALID_ARGUMENT for an unknown one,
/// PERMISSION_DENIED for one the tenant may not use.
pub fn adapter(
    r: &pb::GenerateRequest,
    tenant: &Tenant,
    model: &ServedModel,
) -> Result<Option<u32>, Status> {
    let model_names_adapter = r.model != model.name && model.adapter(&r.model).is_some();
    if model_names_adapter && !r.adapter.is_empty() && r.adapter != r.model {
        return Err(invalid(format!(
            "adapter: {:?} conflicts with model {:?}, which names another adapter; give one",
            r.adapter, r.model
        )));
    }
    let (field, name) = if !r.adapter.is_empty() {
        ("adapter", r.adapter.as_str())
    } else if model_names_adapter {
        ("model", r.model.as_str())
    } else {
        return Ok(None);
    };
    let Some(a) = model.adapter(name) else {
        return Err(invalid(if model.adapters.is_empty() {
            format!("{field}: unknown adapter {name:?}; this server serves no adapters")
        } else {
            format!(
                "{field}: unknown adapter {name:?}; served: {}",
                adapter_names(model)
            )
        }));
    };
    if !tenant.may_use_adapter(name) {
        return Err(Status::permission_denied(format!(
            "{field}: tenant {:?} may not use adapter {name:?}",
            tenant.name
        )));
    }
    Ok(Some(a.id))
}

/// Checks a client request id; None when the server should assign one.
pub fn check_request_id(id: &str) -> Result<Option<String>, Status> {
    if id.is_empty() {
        return Ok(None);
    }
    if id.len() > MAX_REQUEST_ID_BYTES {
        return Err(invalid(format!(
            "request_id: {} bytes, at most {MAX_REQUEST_ID_BYTES} allowed",
            id.len()
        )));
    }
    if id.chars().any(char::is_control) {
        return Err(invalid("request_id: control characters are not allowed"));
    }
    Ok(Some(id.to_string()))
}

fn check_ids(field: &str, ids: &[u32], vocab: usize) -> Result<(), Status> {
    if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(invalid(format!(
            "{field}[{i}] = {t} is outside the vocabulary (ids must be < {vocab})"
        )));
    }
    Ok(())
}

/// Prompt token ids from the request's input.
pub fn prompt_ids(
    input: Option<&pb::generate_request::Input>,
    l: &Limits,
) -> Result<Vec<u32>, Status> {
    use pb::generate_request::Input;
    let tok_err = |e: weft_models::ModelError| Status::internal(format!("tokenizer failed: {e}"));
    let ids = match input {
        None => return Err(invalid("input: one of text, tokens or chat is required")),
        Some(Input::Text(t)) => {
            if t.is_empty() {
                return Err(invalid("input.text must not be empty"));
            }
            l.tokenizer.encode(t).map_err(tok_err)?
        }
        Some(Input::Tokens(t)) => {
            if t.ids.is_empty() {
                return Err(invalid("input.tokens.ids must not be empty"));
            }
            check_ids("input.tokens.ids", &t.ids, l.model.vocab_size)?;
            t.ids.clone()
        }
        Some(Input::Chat(c)) => {
            if c.messages.is_empty() {
                return Err(invalid("input.chat.messages must not be empty"));
            }
            if c.messages.len() > MAX_CHAT_MESSAGES {
                return Err(invalid(format!(
                    "input.chat.messages: {} messages, at most {MAX_CHAT_MESSAGES} allowed",
                    c.messages.len()
                )));
            }
            if let Some(i) = c.messages.iter().position(|m| m.role.is_empty()) {
                return Err(invalid(format!(
                    "input.chat.messages[{i}].role must not be empty"
                )));
            }
            if !l.tokenizer.has_chat_template() {
                return Err(invalid(
                    "input.chat: the served model has no chat template; send text or tokens",
                ));
            }
            let msgs: Vec<ChatMessage> = c
                .messages
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect();
            let text = l
                .tokenizer
                .apply_chat_template(&msgs, true)
                .map_err(|e| invalid(format!("input.chat: the chat template failed: {e}")))?;
            l.tokenizer.encode(&text).map_err(tok_err)?
        }
    };
    if ids.is_empty() {
        return Err(invalid("input: the prompt tokenizes to no tokens"));
    }
    Ok(ids)
}

/// Sampling parameters, checked against the ranges in the .proto.
pub fn sampling(s: Option<&pb::SamplingParams>) -> Result<(SamplingParams, Option<u64>), Status> {
    let Some(s) = s else {
        return Ok((SamplingParams::default(), None));
    };
    let finite = |name: &str, v: f32| {
        if v.is_finite() {
            Ok(())
        } else {
            Err(invalid(format!(
                "sampling.{name} must be a finite number, got {v}"
            )))
        }
    };
    finite("temperature", s.temperature)?;
    if !(0.0..=MAX_TEMPERATURE).contains(&s.temperature) {
        return Err(invalid(format!(
            "sampling.temperature must be in [0, {MAX_TEMPERATURE}], got {}",
            s.temperature
        )));
    }
    finite("top_p", s.top_p)?;
    if !(0.0..=1.0).contains(&s.top_p) {
        return Err(invalid(format!(
            "sampling.top_p must be in (0, 1] (0 = off), got {}",
            s.top_p
        )));
    }
    finite("min_p", s.min_p)?;
    if !(0.0..1.0).contains(&s.min_p) {
        return Err(invalid(format!(
            "sampling.min_p must be in [0, 1), got {}",
            s.min_p
        )));
    }
    finite("repetition_penalty", s.repetition_penalty)?;
    if s.repetition_penalty < 0.0 {
        return Err(invalid(format!(
            "sampling.repetition_penalty must be > 0 (0 = off), got {}",
            s.repetition_penalty
        )));
    }
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        finite(name, v)?;
        if !(-2.0..=2.0).contains(&v) {
            return Err(invalid(format!(
                "sampling.{name} must be in [-2, 2], got {v}"
            )));
        }
    }
    Ok((
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
            min_p: s.min_p,
            repetition_penalty: if s.repetition_penalty == 0.0 {
                1.0
            } else {
                s.repetition_penalty
            },
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
        },
        s.seed,
    ))
}

/// Builds the scheduler request. `request_id` is the final id (client's or
/// server-assigned); `deadline` comes from the call's grpc-timeout.
pub fn build(
    r: &pb::GenerateRequest,
    tenant: &Tenant,
    l: &Limits,
    request_id: String,
    deadline: Option<Instant>,
) -> Result<Request, Status> {
    check_model("model", &r.model, l.model)?;
    let adapter = adapter(r, tenant, l.model)?;
    // Cheap checks first, before tokenizing.
    if r.priority < tenant.priority_min || r.priority > tenant.priority_max {
        return Err(invalid(format!(
            "priority {} is outside the range allowed for tenant {:?}: [{}, {}]",
            r.priority, tenant.name, tenant.priority_min, tenant.priority_max
        )));
    }
    let (sampling, seed) = sampling(r.sampling.as_ref())?;
    if r.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(format!(
            "stop: {} strings, at most {MAX_STOP_STRINGS} allowed",
            r.stop.len()
        )));
    }
    for (i, s) in r.stop.iter().enumerate() {
        if s.is_empty() {
            return Err(invalid(format!("stop[{i}] must not be empty")));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(invalid(format!(
                "stop[{i}]: {} bytes, at most {MAX_STOP_BYTES} allowed",
                s.len()
            )));
        }
    }
    if r.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid(format!(
            "stop_token_ids: {} ids, at most {MAX_STOP_TOKEN_IDS} allowed",
            r.stop_token_ids.len()
        )));
    }
    check_ids("stop_token_ids", &r.stop_token_ids, l.model.vocab_size)?;
    if r.logprobs > MAX_LOGPROBS {
        return Err(invalid(format!(
            "logprobs must be at most {MAX_LOGPROBS}, got {}",
            r.logprobs
        )));
    }
    let context = l.model.context_length;
    let tenant_max_tokens = tenant.max_tokens.unwrap_or(usize::MAX);
    if r.max_tokens as usize > tenant_max_tokens {
        return Err(invalid(format!(
            "max_tokens {} exceeds tenant {:?}'s limit of {tenant_max_tokens}",
            r.max_tokens, tenant.name
        )));
    }
    if r.max_tokens as usize >= context {
        return Err(invalid(format!(
            "max_tokens {} does not fit the model context of {context} tokens",
            r.max_tokens
        )));
    }

    let constraint = constraint(r.constraint.as_ref(), l.grammars)?;

    let prompt = prompt_ids(r.input.as_ref(), l)?;
    let n = prompt.len();
    if let Some(max) = tenant.max_prompt_tokens {
        if n > max {
            return Err(invalid(format!(
                "prompt is {n} tokens; tenant {:?} allows at most {max} (max_prompt_tokens)",
                tenant.name
            )));
        }
    }
    if n >= context {
        return Err(invalid(format!(
            "prompt is {n} tokens; the model context is {context} tokens (prompt + max_tokens must fit)"
        )));
    }
    let max_tokens = if r.max_tokens == 0 {
        l.default_max_tokens.min(tenant_max_tokens).min(context - n)
    } else {
        r.max_tokens as usize
    };
    if n + max_tokens > context {
        return Err(invalid(format!(
            "prompt ({n} tokens) + max_tokens ({max_tokens}) = {} exceeds the model context of {context} tokens",
            n + max_tokens
        )));
    }

    let mut req = Request::new(tenant.name.clone(), prompt, max_tokens);
    req.tenant_weight = tenant.weight;
    req.priority = r.priority;
    req.sampling = sampling;
    req.seed = seed;
    req.stop_strings = r.stop.clone();
    req.stop_token_ids = r.stop_token_ids.clone();
    req.ignore_eos = r.ignore_eos;
    req.logprobs = (r.logprobs > 0).then_some(r.logprobs as usize);
    req.request_id = Some(request_id);
    req.deadline = deadline;
    req.constraint = constraint;
    req.adapter = adapter;
    Ok(req)
}

/// The `grpc-timeout` header value ("<digits><unit>", unit one of H M S m u n).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    // ASCII only: the unit is split off by byte, and a multi-byte last
    // character would not be a char boundary (found by tests/fuzz_inputs.rs).
    if v.len() < 2 || v.len() > 9 || !v.is_ascii() {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        for bad in [
            "",
            "m",
            "10",
            "1x",
            "-1S",
            "1234567890S",
            "1\u{e9}",
            "12\u{20ac}",
        ] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn sampling_ranges() {
        let ok = |s: pb::SamplingParams| sampling(Some(&s)).map(|x| x.0);
        let d = pb::SamplingParams::default();
        let p = ok(d).unwrap();
        assert_eq!((p.top_p, p.repetition_penalty), (1.0, 1.0));
        for (s, field) in [
            (
                pb::SamplingParams {
                    temperature: -1.0,
                    ..d
                },
                "temperature",
            ),
            (
                pb::SamplingParams {
                    temperature: 101.0,
                    ..d
                },
                "temperature",
            ),
            (
                pb::SamplingParams {
                    temperature: f32::NAN,
                    ..d
                },
                "temperature",
            ),
            (pb::SamplingParams { top_p: 1.5, ..d }, "top_p"),
            (pb::SamplingParams { top_p: -0.1, ..d }, "top_p"),
            (pb::SamplingParams { min_p: 1.0, ..d }, "min_p"),
            (
                pb::SamplingParams {
                    repetition_penalty: -1.0,
                    ..d
                },
                "repetition_penalty",
            ),
            (
                pb::SamplingParams {
                    presence_penalty: 2.5,
                    ..d
                },
                "presence_penalty",
            ),
            (
                pb::SamplingParams {
                    frequency_penalty: -3.0,
                    ..d
                },
                "frequency_penalty",
            ),
            (
                pb::SamplingParams {
                    frequency_penalty: f32::INFINITY,
                    ..d
                },
                "frequency_penalty",
            ),
        ] {
            let e = ok(s).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(field), "{}", e.message());
        }
    }

    #[test]
    fn request_ids() {
        assert_eq!(check_request_id("").unwrap(), None);
        assert_eq!(check_request_id("abc").unwrap().as_deref(), Some("abc"));
        assert!(check_request_id(&"x".repeat(129)).is_err());
        assert!(check_request_id("a\nb").is_err());
    }
}
