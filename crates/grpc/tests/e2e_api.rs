//! End-to-end: one real `weft serve` (open mode, default model) shared by the
//! tests in this file, which run concurrently against it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::sync::OnceCell;
use tonic::Code;
use weft_grpc::pb;

static SERVER: OnceCell<Server> = OnceCell::const_new();

async fn server() -> &'static Server {
    SERVER.get_or_init(|| Server::start(&[])).await
}

const VOCAB: u32 = 49152;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection() {
    let s = server().await;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(s.health("").await.unwrap(), serving);
    assert_eq!(s.health("weft.v1.Generation").await.unwrap(), serving);
    assert_eq!(
        s.health("no.such.Service").await.unwrap_err().code(),
        Code::NotFound
    );

    // What `grpcurl list` asks.
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut r = ServerReflectionClient::new(s.channel().await);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut resp = r
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer {msg:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["weft.v1.Generation", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_tokenize_detokenize() {
    let s = server().await;
    let mut c = s.client().await;
    let list = c
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.models.len(), 1);
    let m = &list.models[0];
    assert_eq!(m.name, "SmolLM2-135M-Instruct");
    assert_eq!((m.vocab_size, m.context_length), (VOCAB, 8192));
    assert_eq!(m.architecture, "llama");
    assert!(m.has_chat_template);
    assert!(!m.dtype.is_empty() && !m.quantization.is_empty());
    // Layer kinds and the KV pool: 30 full-attention layers, one group.
    assert_eq!(m.sliding_window, 0);
    assert_eq!(m.layer_kinds.len(), 30);
    assert!(m.layer_kinds.iter().all(|k| k == "full_attention"));
    assert_eq!(m.kv_dtype, m.dtype);
    assert_eq!(m.kv_block_size, 16);
    assert_eq!(m.kv_groups.len(), 1, "{:?}", m.kv_groups);
    let g = &m.kv_groups[0];
    assert_eq!((g.kind.as_str(), g.layers), ("full", 30));
    // The per-kind gauges cover the same blocks.
    let text = s.metrics().await;
    let kind = |state: &str| {
        metric(
            &text,
            "weft_kv_kind_blocks",
            &["kind=\"full\"", &format!("state=\"{state}\"")],
        )
        .unwrap_or_else(|| panic!("weft_kv_kind_blocks{{kind=full,state={state}}}"))
    };
    assert_eq!(
        kind("used") + kind("free") + kind("cached"),
        f64::from(g.blocks)
    );
    assert_eq!(
        metric(&text, "weft_kv_kind_blocks", &["kind=\"sliding_window\""]),
        None
    );
    let got = c
        .get_model(pb::GetModelRequest {
            name: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&got, m);
    let got = c
        .get_model(pb::GetModelRequest {
            name: m.name.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&got, m);
    assert_code(
        c.get_model(pb::GetModelRequest {
            name: "gpt-9".into(),
        })
        .await,
        Code::NotFound,
        "gpt-9",
    );

    let ids = c
        .tokenize(pb::TokenizeRequest {
            model: String::new(),
            text: "Hello, world! 123".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ids;
    assert!(ids.len() >= 5, "{ids:?}");
    // Digits are split one by one by this tokenizer.
    let text = c
        .detokenize(pb::DetokenizeRequest {
            model: String::new(),
            ids: ids.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .text;
    assert_eq!(text, "Hello, world! 123");
    assert_code(
        c.detokenize(pb::DetokenizeRequest {
            model: String::new(),
            ids: vec![1, VOCAB],
        })
        .await,
        Code::InvalidArgument,
        "ids[1]",
    );
    assert_code(
        c.tokenize(pb::TokenizeRequest {
            model: "nope".into(),
            text: "x".into(),
        })
        .await,
        Code::NotFound,
        "nope",
    );
}

/// The real model answers the classic prompt; text, token ids and
/// detokenization agree; chat and pre-tokenized input work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_text_tokens_and_chat() {
    let s = server().await;
    let mut c = s.client().await;
    let r = c
        .generate(text_req("The capital of France is", 3))
        .await
        .unwrap()
        .into_inner();
    assert!(r.text.contains("Paris"), "{:?}", r.text);
    assert_eq!(r.ids.len(), 3);
    assert_eq!(
        pb::FinishReason::try_from(r.finish_reason).unwrap(),
        pb::FinishReason::Length
    );
    assert!(!r.request_id.is_empty());
    let u = r.usage.unwrap();
    assert_eq!(u.generated_tokens, 3);
    assert!(u.prompt_tokens >= 5, "{u:?}");
    assert!(
        u.ttft_seconds > 0.0 && u.total_seconds >= u.ttft_seconds,
        "{u:?}"
    );
    let detok = c
        .detokenize(pb::DetokenizeRequest {
            model: String::new(),
            ids: r.ids.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .text;
    assert_eq!(detok, r.text);

    // The same prompt as token ids gives the same tokens.
    let ids = c
        .tokenize(pb::TokenizeRequest {
            model: String::new(),
            text: "The capital of France is".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ids;
    let mut tr = text_req("", 3);
    tr.input = Some(pb::generate_request::Input::Tokens(pb::TokenIds { ids }));
    let r2 = c.generate(tr).await.unwrap().into_inner();
    assert_eq!(r2.ids, r.ids);

    // Chat input goes through the chat template.
    let mut cr = text_req("", 8);
    cr.input = Some(pb::generate_request::Input::Chat(pb::Chat {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }],
    }));
    let r3 = c.generate(cr).await.unwrap().into_inner();
    let u3 = r3.usage.unwrap();
    // The template adds role markers: more tokens than the bare question.
    assert!(u3.prompt_tokens > 10, "{u3:?}");
    assert!(r3.text.contains("Paris"), "{:?}", r3.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_and_unary_agree_for_a_seed() {
    let s = server().await;
    let mut c = s.client().await;
    let req = |seed| {
        let mut r = sampled(text_req("Once upon a time", 10), 0.9, seed);
        r.ignore_eos = true;
        r
    };
    let unary = c.generate(req(7)).await.unwrap().into_inner();
    let stream = collect(&mut c, with(req(7), None, None)).await.unwrap();
    assert!(stream.status.is_none(), "{:?}", stream.status);
    assert_eq!(stream.after_finished, 0);
    let f = stream.finished.as_ref().expect("a finished message");
    assert_eq!(reason(f), pb::FinishReason::Length);
    assert_eq!(unary.ids.len(), 10);
    assert_eq!(stream.ids, unary.ids, "same seed, same tokens");
    assert_eq!(stream.text, unary.text);
    assert_eq!(f.usage.as_ref().unwrap().generated_tokens, 10);
    assert!(stream.deltas >= 1);
    // And again (seeded sampling does not depend on the batch).
    let again = c.generate(req(7)).await.unwrap().into_inner();
    assert_eq!(again.ids, unary.ids);
    // Different seeds give different continuations (10 tokens at T=0.9).
    let mut differ = false;
    for seed in [8, 9, 10] {
        if c.generate(req(seed)).await.unwrap().into_inner().ids != unary.ids {
            differ = true;
            break;
        }
    }
    assert!(differ, "the seed has no effect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams() {
    let s = server().await;
    let prompts = [
        "The capital of France is",
        "Water boils at",
        "The largest planet in the solar system is",
        "def fibonacci(n):",
    ];
    let req = |i: usize| {
        let mut r = text_req(prompts[i % prompts.len()], 4);
        r.ignore_eos = true;
        r.request_id = format!("c32-{i}");
        r
    };
    // References, one at a time.
    let mut c = s.client().await;
    let mut want = Vec::new();
    for i in 0..prompts.len() {
        want.push(c.generate(req(i)).await.unwrap().into_inner().ids);
    }
    let channel = s.channel().await;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..32 {
        let mut client = pb::generation_client::GenerationClient::new(channel.clone());
        let r = req(i);
        tasks.push(tokio::spawn(async move {
            (i, collect(&mut client, with(r, None, None)).await)
        }));
    }
    for t in tasks {
        let (i, got) = t.await.unwrap();
        let got = got.unwrap_or_else(|e| panic!("stream {i}: {e:?}"));
        assert!(got.status.is_none(), "stream {i}: {:?}", got.status);
        assert_eq!(got.request_id, format!("c32-{i}"));
        let f = got
            .finished
            .unwrap_or_else(|| panic!("stream {i}: no finished"));
        assert_eq!(reason(&f), pb::FinishReason::Length, "stream {i}");
        assert_eq!(
            got.ids,
            want[i % prompts.len()],
            "stream {i}: batched != alone"
        );
    }
    eprintln!("32 streams in {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_and_stop_strings() {
    let s = server().await;
    let mut c = s.client().await;
    let mut r = text_req("The capital of France is", 4);
    r.logprobs = 3;
    let out = c.generate(r).await.unwrap().into_inner();
    assert_eq!(out.logprobs.len(), out.ids.len());
    for (p, &id) in out.logprobs.iter().zip(&out.ids) {
        let chosen = p.chosen.as_ref().unwrap();
        assert_eq!(chosen.id, id);
        assert!(chosen.logprob <= 0.0);
        assert_eq!(p.top.len(), 3);
        assert!(p.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(p.top[0].id, id);
    }

    // Stop strings: cut where the string starts, reason STOP.
    let base = c
        .generate(text_req("The capital of France is", 6))
        .await
        .unwrap()
        .into_inner();
    let cut = base.text.find("Paris").expect("Paris in the greedy output");
    let mut r = text_req("The capital of France is", 6);
    r.stop = vec!["aris".into()];
    let stopped = c.generate(r.clone()).await.unwrap().into_inner();
    assert_eq!(stopped.text, base.text[..cut + 1]);
    assert_eq!(
        pb::FinishReason::try_from(stopped.finish_reason).unwrap(),
        pb::FinishReason::Stop
    );
    let streamed = collect(&mut c, with(r, None, None)).await.unwrap();
    assert_eq!(streamed.text, stopped.text);
    assert_eq!(
        reason(streamed.finished.as_ref().unwrap()),
        pb::FinishReason::Stop
    );

    // Stop token ids: the first greedy token stops at once and is not returned.
    let mut r = text_req("The capital of France is", 6);
    r.stop_token_ids = vec![base.ids[0]];
    let out = c.generate(r).await.unwrap().into_inner();
    assert!(out.ids.is_empty(), "{:?}", out.ids);
    assert_eq!(
        pb::FinishReason::try_from(out.finish_reason).unwrap(),
        pb::FinishReason::Stop
    );
    assert_eq!(out.text, "");
    // Usage counts the ids returned: the stop token is neither.
    assert_eq!(out.usage.as_ref().map(|u| u.generated_tokens), Some(0));
    // One token, then the second greedy token stops.
    assert_ne!(
        base.ids[0], base.ids[1],
        "the greedy output starts with a repeat"
    );
    let mut r = text_req("The capital of France is", 6);
    r.stop_token_ids = vec![base.ids[1]];
    let out = c.generate(r).await.unwrap().into_inner();
    assert_eq!(out.ids, base.ids[..1].to_vec());
    assert_eq!(out.usage.as_ref().map(|u| u.generated_tokens), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status() {
    use pb::generate_request::Input;
    let s = server().await;
    let mut c = s.client().await;
    let ok = || text_req("Hello", 2);
    let sp = |f: fn(&mut pb::SamplingParams)| {
        let mut r = ok();
        let mut p = pb::SamplingParams::default();
        f(&mut p);
        r.sampling = Some(p);
        r
    };
    let cases: Vec<(pb::GenerateRequest, Code, &str)> = vec![
        (
            pb::GenerateRequest {
                max_tokens: 2,
                ..Default::default()
            },
            Code::InvalidArgument,
            "input",
        ),
        (text_req("", 2), Code::InvalidArgument, "input.text"),
        (
            pb::GenerateRequest {
                input: Some(Input::Tokens(pb::TokenIds { ids: vec![] })),
                ..ok()
            },
            Code::InvalidArgument,
            "input.tokens.ids",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Tokens(pb::TokenIds {
                    ids: vec![1, 2, VOCAB],
                })),
                ..ok()
            },
            Code::InvalidArgument,
            "input.tokens.ids[2] = 49152",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Tokens(pb::TokenIds { ids: vec![5; 9000] })),
                ..ok()
            },
            Code::InvalidArgument,
            "8192",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Chat(pb::Chat { messages: vec![] })),
                ..ok()
            },
            Code::InvalidArgument,
            "input.chat.messages",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Chat(pb::Chat {
                    messages: vec![pb::ChatMessage {
                        role: String::new(),
                        content: "x".into(),
                    }],
                })),
                ..ok()
            },
            Code::InvalidArgument,
            "role",
        ),
        (
            sp(|p| p.temperature = -0.5),
            Code::InvalidArgument,
            "sampling.temperature",
        ),
        (
            sp(|p| p.temperature = 101.0),
            Code::InvalidArgument,
            "[0, 100]",
        ),
        (
            sp(|p| p.temperature = f32::NAN),
            Code::InvalidArgument,
            "sampling.temperature",
        ),
        (
            sp(|p| p.top_p = 1.01),
            Code::InvalidArgument,
            "sampling.top_p",
        ),
        (
            sp(|p| p.min_p = 1.0),
            Code::InvalidArgument,
            "sampling.min_p",
        ),
        (
            sp(|p| p.repetition_penalty = -1.0),
            Code::InvalidArgument,
            "sampling.repetition_penalty",
        ),
        (
            sp(|p| p.presence_penalty = 2.5),
            Code::InvalidArgument,
            "sampling.presence_penalty must be in [-2, 2]",
        ),
        (
            sp(|p| p.frequency_penalty = -2.5),
            Code::InvalidArgument,
            "sampling.frequency_penalty",
        ),
        (
            pb::GenerateRequest {
                logprobs: 21,
                ..ok()
            },
            Code::InvalidArgument,
            "logprobs must be at most 20",
        ),
        (
            pb::GenerateRequest {
                stop: (0..9).map(|i| i.to_string()).collect(),
                ..ok()
            },
            Code::InvalidArgument,
            "at most 8",
        ),
        (
            pb::GenerateRequest {
                stop: vec!["x".repeat(65)],
                ..ok()
            },
            Code::InvalidArgument,
            "stop[0]: 65 bytes",
        ),
        (
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..ok()
            },
            Code::InvalidArgument,
            "stop[0]",
        ),
        (
            pb::GenerateRequest {
                stop_token_ids: vec![VOCAB + 5],
                ..ok()
            },
            Code::InvalidArgument,
            "stop_token_ids[0]",
        ),
        (
            pb::GenerateRequest {
                max_tokens: 9000,
                ..ok()
            },
            Code::InvalidArgument,
            "max_tokens 9000",
        ),
        (
            pb::GenerateRequest {
                input: Some(Input::Tokens(pb::TokenIds { ids: vec![5; 8000] })),
                max_tokens: 500,
                ..ok()
            },
            Code::InvalidArgument,
            "exceeds the model context of 8192",
        ),
        (
            pb::GenerateRequest {
                request_id: "r".repeat(129),
                ..ok()
            },
            Code::InvalidArgument,
            "request_id",
        ),
        (
            pb::GenerateRequest {
                model: "other-model".into(),
                ..ok()
            },
            Code::NotFound,
            "other-model",
        ),
    ];
    for (req, code, needle) in cases {
        assert_code(c.generate(req.clone()).await, code, needle);
        // Streams refuse the same way, before any message.
        assert_code(c.generate_stream(req).await.map(|_| ()), code, needle);
    }
    // A request id in use by a live request of the same tenant.
    let mut long = text_req("Tell me a long story", 200);
    long.ignore_eos = true;
    long.request_id = "dup-id".into();
    let mut live = c.generate_stream(long.clone()).await.unwrap().into_inner();
    live.message().await.unwrap().unwrap();
    assert_code(c.generate(long).await, Code::InvalidArgument, "dup-id");
    drop(live);
    // The server survived all of it.
    assert!(c.generate(ok()).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_by_client_and_server_ids() {
    let s = server().await;
    let mut c = s.client().await;
    let mut r = text_req("Write a very long essay about rivers", 300);
    r.ignore_eos = true;
    r.request_id = "to-cancel".into();
    let mut st = c.generate_stream(r.clone()).await.unwrap().into_inner();
    let first = st.message().await.unwrap().unwrap();
    assert_eq!(first.request_id, "to-cancel");
    let t0 = Instant::now();
    let yes = c
        .cancel(pb::CancelRequest {
            request_id: "to-cancel".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(yes.cancelled);
    let mut finished = None;
    while let Some(m) = st.message().await.unwrap() {
        if let Some(pb::generate_stream_response::Event::Finished(f)) = m.event {
            finished = Some(f);
        }
    }
    let f = finished.expect("finished after cancel");
    assert_eq!(reason(&f), pb::FinishReason::Cancelled);
    assert!(f.usage.unwrap().generated_tokens < 300);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Gone now.
    let again = c
        .cancel(pb::CancelRequest {
            request_id: "to-cancel".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.cancelled);
    assert_code(
        c.cancel(pb::CancelRequest {
            request_id: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "request_id",
    );

    // A server-assigned id works the same, and unary calls can be cancelled.
    r.request_id.clear();
    let mut st = c.generate_stream(r.clone()).await.unwrap().into_inner();
    let id = st.message().await.unwrap().unwrap().request_id;
    assert!(id.starts_with("weft-"), "{id}");
    assert!(
        c.cancel(pb::CancelRequest { request_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    r.request_id = "unary-cancel".into();
    let mut c2 = s.client().await;
    let unary = tokio::spawn(async move { c2.generate(r).await });
    let t0 = Instant::now();
    loop {
        let ok = c
            .cancel(pb::CancelRequest {
                request_id: "unary-cancel".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .cancelled;
        if ok {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "unary request never became cancellable"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = unary.await.unwrap().unwrap().into_inner();
    assert_eq!(
        pb::FinishReason::try_from(out.finish_reason).unwrap(),
        pb::FinishReason::Cancelled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines() {
    let s = server().await;
    let mut c = s.client().await;
    let mut r = text_req("Write a very long essay about mountains", 400);
    r.ignore_eos = true;
    let t0 = Instant::now();
    assert_code(
        c.generate(with(r.clone(), None, Some(Duration::from_millis(1500))))
            .await,
        Code::DeadlineExceeded,
        "deadline",
    );
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "answered after {took:?}"
    );

    let t0 = Instant::now();
    let got = collect(&mut c, with(r, None, Some(Duration::from_millis(1500))))
        .await
        .unwrap();
    let took = t0.elapsed();
    let st = got.status.expect("the stream ends with an error status");
    assert_eq!(st.code(), Code::DeadlineExceeded, "{st:?}");
    assert!(got.ids.len() < 400);
    assert!(took < Duration::from_millis(2500), "ended after {took:?}");
    if let Some(f) = &got.finished {
        assert_eq!(reason(f), pb::FinishReason::Deadline);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_families() {
    let s = server().await;
    let mut c = s.client().await;
    c.generate(text_req("Metrics please", 3)).await.unwrap();
    let _ = c.generate(text_req("", 3)).await;
    let text = s.metrics().await;
    for family in [
        "weft_grpc_requests_total",
        "weft_time_to_first_token_seconds_bucket",
        "weft_inter_token_latency_seconds_bucket",
        "weft_request_e2e_seconds_bucket",
        "weft_request_queue_seconds_bucket",
        "weft_step_duration_seconds_bucket",
        "weft_forward_build_seconds_bucket",
        "weft_forward_eval_seconds_bucket",
        "weft_forward_other_seconds_bucket",
        "weft_compile_traces_total",
        "weft_batch_size_bucket",
        "weft_prompt_tokens_total",
        "weft_generation_tokens_total",
        "weft_requests_running",
        "weft_requests_waiting",
        "weft_kv_blocks_used",
        "weft_kv_blocks_free",
        "weft_kv_blocks_cached",
        "weft_kv_usage_ratio",
        "weft_requests_finished_total",
        "weft_serving",
    ] {
        assert!(
            text.contains(family),
            "{family} missing from /metrics:\n{text}"
        );
    }
    // SLO thresholds are buckets.
    for le in ["0.05", "0.1", "0.25", "0.5", "1", "2", "5", "10"] {
        assert!(
            text.contains(&format!(
                "weft_time_to_first_token_seconds_bucket{{le=\"{le}\"}}"
            )),
            "TTFT bucket {le} missing"
        );
    }
    assert!(text.contains("weft_request_e2e_seconds_bucket{le=\"120\"}"));
    let ok = metric(
        &text,
        "weft_grpc_requests_total",
        &["method=\"Generate\"", "code=\"ok\"", "tenant=\"default\""],
    )
    .unwrap();
    assert!(ok >= 1.0);
    let bad = metric(
        &text,
        "weft_grpc_requests_total",
        &["method=\"Generate\"", "code=\"invalid_argument\""],
    )
    .unwrap();
    assert!(bad >= 1.0);
    let gen = metric(
        &text,
        "weft_generation_tokens_total",
        &["tenant=\"default\""],
    )
    .unwrap();
    assert!(gen >= 3.0, "{gen}");
    let ttft_count = metric(&text, "weft_time_to_first_token_seconds_count", &[]).unwrap();
    let ttft_sum = metric(&text, "weft_time_to_first_token_seconds_sum", &[]).unwrap();
    assert!(ttft_count >= 1.0 && ttft_sum > 0.0 && ttft_sum / ttft_count < 60.0);
    assert_eq!(metric(&text, "weft_serving", &[]), Some(1.0));
    let total = metric(&text, "weft_kv_blocks_used", &[]).unwrap()
        + metric(&text, "weft_kv_blocks_free", &[]).unwrap()
        + metric(&text, "weft_kv_blocks_cached", &[]).unwrap();
    // The CPU's default pool: 1 GiB of 16-token blocks of the default model's
    // f32 K/V (30 layers x 3 KV heads x 64 dims x K and V x 4 bytes a token).
    let per_block = 30 * 3 * 64 * 2 * 4 * 16;
    assert_eq!(total, ((1u64 << 30) / per_block) as f64);
    // Other paths are 404.
    let r = reqwest::get(format!("http://{}/nope", s.metrics_addr))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

/// A gRPC request whose body is raw bytes (not necessarily a valid message).
#[derive(Clone, Default)]
struct RawCodec;
struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use prost::bytes::BufMut;
        buf.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::GenerateResponse;
    type Encoder = RawEncoder;
    type Decoder = <tonic::codec::ProstCodec<pb::GenerateRequest, pb::GenerateResponse> as tonic::codec::Codec>::Decoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> Self::Decoder {
        tonic::codec::ProstCodec::<pb::GenerateRequest, pb::GenerateResponse>::raw_decoder(
            Default::default(),
        )
    }
}

/// Undecodable request bodies (truncated field, invalid UTF-8 in a string, a
/// bad wire type) get INVALID_ARGUMENT naming the message type — not INTERNAL,
/// which the contract keeps for engine failures — and the same connection keeps
/// serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_get_invalid_argument() {
    let s = server().await;
    let ch = s.channel().await;
    let mut g = tonic::client::Grpc::new(ch.clone());
    for (what, body) in [
        ("truncated field", vec![0x12u8, 100, b'x']),
        ("invalid UTF-8", vec![0x12, 2, 0xff, 0xfe]),
        ("bad wire type", vec![0x17, 1]),
        ("varint past the end", vec![0x30, 0xff]),
    ] {
        for path in [
            "/weft.v1.Generation/Generate",
            "/weft.v1.Generation/GenerateStream",
        ] {
            g.ready().await.unwrap();
            let p = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            let st = if path.ends_with("Stream") {
                g.server_streaming(tonic::Request::new(body.clone()), p, RawCodec)
                    .await
                    .map(|_| ())
                    .unwrap_err()
            } else {
                g.unary(tonic::Request::new(body.clone()), p, RawCodec)
                    .await
                    .map(|_| ())
                    .unwrap_err()
            };
            assert_eq!(st.code(), Code::InvalidArgument, "{what} {path}: {st:?}");
            assert!(
                st.message().contains("weft.v1.GenerateRequest"),
                "{what}: {}",
                st.message()
            );
        }
    }
    // A valid message as raw bytes on the same channel is served.
    use prost::Message;
    g.ready().await.unwrap();
    let out = g
        .unary(
            tonic::Request::new(text_req("The capital of France is", 3).encode_to_vec()),
            tonic::codegen::http::uri::PathAndQuery::from_static("/weft.v1.Generation/Generate"),
            RawCodec,
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.ids.len(), 3);
    let mut c = pb::generation_client::GenerationClient::new(ch);
    assert!(c.generate(text_req("Hello", 2)).await.is_ok());
}

/// `usage.generated_tokens` is `len(ids)` on both RPCs: a stop token id ends the
/// request and is neither returned nor counted; an EOS id that ends it is both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_exactly_the_ids_returned() {
    let s = server().await;
    let mut c = s.client().await;
    let base = c
        .generate(text_req("The capital of France is", 6))
        .await
        .unwrap()
        .into_inner();
    let mut r = text_req("The capital of France is", 6);
    r.stop_token_ids = vec![base.ids[2]];
    let unary = c.generate(r.clone()).await.unwrap().into_inner();
    let streamed = collect(&mut c, with(r, None, None)).await.unwrap();
    let f = streamed.finished.expect("finished");
    assert_eq!(streamed.ids, unary.ids);
    assert!(!unary.ids.contains(&base.ids[2]));
    let u = f.usage.unwrap();
    assert_eq!(u.generated_tokens as usize, streamed.ids.len());
    assert_eq!(
        unary.usage.unwrap().generated_tokens as usize,
        unary.ids.len()
    );
    // A chat answer that ends by EOS: the EOS id is the last id and counted.
    let mut r = text_req("", 64);
    r.input = Some(pb::generate_request::Input::Chat(pb::Chat {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Say yes.".into(),
        }],
    }));
    let out = c.generate(r).await.unwrap().into_inner();
    if out.finish_reason == pb::FinishReason::Eos as i32 {
        assert_eq!(out.usage.unwrap().generated_tokens as usize, out.ids.len());
    }
}
