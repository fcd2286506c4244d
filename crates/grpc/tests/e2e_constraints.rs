//! Constrained output end to end: a real `weft serve` with the default model,
//! over gRPC and the OpenAI HTTP API. For JSON schemas, regexes, a Lark grammar
//! and a choice list, every completion parses / matches and ends with STOP, at
//! temperature 0 and 1, alone and in a batch of 32 mixed with unconstrained
//! requests (a constrained request decodes the same tokens either way); bad
//! constraints are INVALID_ARGUMENT / 400 naming the field; the mask time is a
//! metric. One server samples on the device (`WEFT_SAMPLE_ON=device`: the mask
//! as an array input of the device sampler, MLX's CPU backend here), the other
//! on the host.

mod common;

use common::*;
use pb::output_constraint::Kind;
use serde_json::{json, Value};
use tonic::Code;
use weft_grpc::pb;

const PERSON: &str = r#"{"type": "object",
  "properties": {"name": {"type": "string", "maxLength": 12},
                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                 "city": {"type": "string", "maxLength": 12}},
  "required": ["name", "age", "city"], "additionalProperties": false}"#;
const COLORS: &str = r#"{"type": "object",
  "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                            "items": {"enum": ["red", "green", "blue", "yellow"]}}},
  "required": ["colors"], "additionalProperties": false}"#;
const DATE_RX: &str = r"[0-9]{4}-[0-9]{2}-[0-9]{2}";
const ARITH: &str = r#"start: expr
expr: NUM | NUM " + " NUM | NUM " * " NUM
NUM: /[1-9][0-9]?/"#;

struct Case {
    prompt: &'static str,
    kind: Kind,
    check: fn(&str) -> Result<(), String>,
}

fn full_match(rx: &str, s: &str) -> Result<(), String> {
    let re = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
    re.is_match(s)
        .then_some(())
        .ok_or_else(|| format!("{s:?} does not match /{rx}/"))
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            prompt: "Describe a person as JSON with name, age and city:",
            kind: Kind::JsonSchema(PERSON.into()),
            check: |s| {
                let v: Value = serde_json::from_str(s).map_err(|e| format!("{s:?}: {e}"))?;
                let ok = v.as_object().is_some_and(|o| o.len() == 3)
                    && v["name"].as_str().is_some_and(|n| n.chars().count() <= 12)
                    && v["age"].as_u64().is_some_and(|a| a <= 120)
                    && v["city"].as_str().is_some_and(|c| c.chars().count() <= 12);
                ok.then_some(()).ok_or(format!("{s} breaks the schema"))
            },
        },
        Case {
            prompt: "Name some colors of the rainbow, as JSON:",
            kind: Kind::JsonSchema(COLORS.into()),
            check: |s| {
                let v: Value = serde_json::from_str(s).map_err(|e| format!("{s:?}: {e}"))?;
                let c = v["colors"].as_array().cloned().unwrap_or_default();
                let ok = v.as_object().is_some_and(|o| o.len() == 1)
                    && (1..=3).contains(&c.len())
                    && c.iter().all(|x| {
                        ["red", "green", "blue", "yellow"].contains(&x.as_str().unwrap_or(""))
                    });
                ok.then_some(()).ok_or(format!("{s} breaks the schema"))
            },
        },
        Case {
            prompt: "The date of the first moon landing was",
            kind: Kind::Regex(DATE_RX.into()),
            check: |s| full_match(DATE_RX, s),
        },
        Case {
            prompt: "Write a small arithmetic expression:",
            kind: Kind::Grammar(ARITH.into()),
            check: |s| full_match(r"[1-9][0-9]?( \+ [1-9][0-9]?| \* [1-9][0-9]?)?", s),
        },
        Case {
            prompt: "Is the sky blue? Answer:",
            kind: Kind::Choice(pb::Choices {
                choices: vec!["yes".into(), "no".into()],
            }),
            check: |s| {
                ["yes", "no"]
                    .contains(&s)
                    .then_some(())
                    .ok_or(format!("{s:?} is not a choice"))
            },
        },
    ]
}

fn constrained(case: &Case, temperature: f32, seed: u64) -> pb::GenerateRequest {
    let mut r = sampled(text_req(case.prompt, 64), temperature, seed);
    r.constraint = Some(pb::OutputConstraint {
        kind: Some(case.kind.clone()),
    });
    r
}

fn check(case: &Case, c: &Collected, what: &str) {
    assert!(c.status.is_none(), "{what}: {:?}", c.status);
    let f = c.finished.as_ref().expect("finished");
    assert_eq!(
        reason(f),
        pb::FinishReason::Stop,
        "{what}: {:?} after {:?}",
        f,
        c.text
    );
    if let Err(e) = (case.check)(&c.text) {
        panic!("{what}: {e}");
    }
}

/// The batch: 32 requests, every other one constrained (cycling through the
/// cases), the rest free text; returns them with their case.
fn batch(temperature: f32) -> Vec<(Option<usize>, pb::GenerateRequest)> {
    let cases = cases();
    (0..32)
        .map(|i| {
            let seed = 100 + i as u64;
            if i % 2 == 0 {
                let c = (i / 2) % cases.len();
                (Some(c), constrained(&cases[c], temperature, seed))
            } else {
                let mut r = sampled(text_req("Tell me about rivers.", 24), temperature, seed);
                r.ignore_eos = true;
                (None, r)
            }
        })
        .collect()
}

async fn run_batch(s: &Server, reqs: &[(Option<usize>, pb::GenerateRequest)]) -> Vec<Collected> {
    let mut tasks = Vec::new();
    for (_, r) in reqs {
        let mut c = s.client().await;
        let r = r.clone();
        tasks.push(tokio::spawn(async move {
            collect(&mut c, tonic::Request::new(r)).await.unwrap()
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn grpc_cases(s: &Server) {
    let cases = cases();
    for temperature in [0.0, 1.0] {
        let reqs = batch(temperature);
        let got = run_batch(s, &reqs).await;
        let mut c = s.client().await;
        for (i, ((case, r), b)) in reqs.iter().zip(&got).enumerate() {
            let Some(k) = case else {
                assert!(b.status.is_none(), "free request {i}: {:?}", b.status);
                assert_eq!(b.ids.len(), 24, "free request {i}");
                continue;
            };
            check(&cases[*k], b, &format!("T={temperature} batched {i}"));
            // Alone: the same tokens (a row's picks do not depend on its batch).
            if i < 10 {
                let a = collect(&mut c, tonic::Request::new(r.clone()))
                    .await
                    .unwrap();
                check(&cases[*k], &a, &format!("T={temperature} alone {i}"));
                assert_eq!(
                    a.ids, b.ids,
                    "T={temperature} request {i}: alone vs batched"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_completions_parse_on_device_and_host_sampling() {
    let dev = Server::start_env(&[], &[("WEFT_SAMPLE_ON", "device")]).await;
    grpc_cases(&dev).await;
    let m = dev.metrics().await;
    let masks = metric(&m, "weft_constraint_masks_total", &[]).unwrap_or(0.0);
    let timed = metric(&m, "weft_constraint_mask_seconds_count", &[]).unwrap_or(0.0);
    assert!(
        masks > 100.0 && timed > 10.0,
        "masks {masks}, timed steps {timed}"
    );
    // Free rows still pipeline between the batches' constrained steps.
    let pipelined = metric(&m, "weft_steps_pipelined_total", &[]).unwrap_or(0.0);
    assert!(pipelined > 0.0, "{pipelined} pipelined steps");
    drop(dev);
    let host = Server::start_env(&[], &[("WEFT_SAMPLE_ON", "host")]).await;
    grpc_cases(&host).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constraints_are_invalid_argument_and_openai_400s() {
    let s = Server::start(&[]).await;
    let mut c = s.client().await;
    let bad = |kind: Kind| {
        let mut r = text_req("hi", 4);
        r.constraint = Some(pb::OutputConstraint { kind: Some(kind) });
        r
    };
    for (kind, needle) in [
        (
            Kind::JsonSchema("{oops".into()),
            "constraint.json_schema: the JSON schema is not valid JSON",
        ),
        (
            Kind::JsonSchema(r#"{"type": "wat"}"#.into()),
            "constraint.json_schema: ",
        ),
        (
            Kind::JsonObject(false),
            "constraint.json_object must be true",
        ),
        (Kind::Regex("(a".into()), "constraint.regex: "),
        (Kind::Grammar("start: nope".into()), "constraint.grammar: "),
        (
            Kind::Choice(pb::Choices { choices: vec![] }),
            "constraint.choice: the choice list is empty",
        ),
    ] {
        assert_code(c.generate(bad(kind)).await, Code::InvalidArgument, needle);
    }

    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", s.http_addr.as_deref().unwrap());
    let post = |path: &str, body: Value| {
        http.post(format!("{base}/{path}"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    // response_format json_schema through the chat API.
    let schema: Value = serde_json::from_str(PERSON).unwrap();
    let r = post(
        "chat/completions",
        json!({"messages": [{"role": "user", "content": "Describe a person as JSON."}],
               "max_tokens": 64, "temperature": 0,
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": schema, "strict": true}}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    (cases()[0].check)(content).unwrap();
    // json_object, streamed.
    let r = post(
        "chat/completions",
        json!({"messages": [{"role": "user", "content": "Give a JSON object with a key \"a\" set to 1."}],
               "max_tokens": 64, "temperature": 0, "stream": true,
               "response_format": {"type": "json_object"}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let mut text = String::new();
    let mut finish = Value::Null;
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(line).unwrap();
        if let Some(t) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if !chunk["choices"][0]["finish_reason"].is_null() {
            finish = chunk["choices"][0]["finish_reason"].clone();
        }
    }
    if finish == "stop" {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v.is_object(), "{text}");
    } else {
        assert_eq!(finish, "length", "{body}");
    }
    // vLLM's guided_* fields on the completions API.
    let r = post(
        "completions",
        json!({"prompt": "Is water wet? Answer:", "max_tokens": 8, "temperature": 1, "seed": 3,
               "guided_choice": ["yes", "no", "sometimes"]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(["yes", "no", "sometimes"].contains(&t), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = post(
        "completions",
        json!({"prompt": "Apollo 11 landed on", "max_tokens": 16, "temperature": 0,
               "guided_regex": DATE_RX}),
    )
    .await
    .unwrap();
    let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    full_match(DATE_RX, v["choices"][0]["text"].as_str().unwrap()).unwrap();
    // Refusals: 400 with an OpenAI error naming the parameter.
    for (body, param, needle) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}),
            "response_format",
            "constraint.json_schema",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format",
            "json_schema.schema is required",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "xml"}}),
            "response_format",
            "not supported",
        ),
        (
            json!({"prompt": "x", "guided_regex": "(unclosed"}),
            "guided_regex",
            "constraint.regex",
        ),
        (
            json!({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
            "at most one",
        ),
    ] {
        let path = if body.get("messages").is_some() {
            "chat/completions"
        } else {
            "completions"
        };
        let r = post(path, body.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
        assert_eq!(e["error"]["param"], param, "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{msg}");
    }
}
