//! End-to-end speculative decoding: a real `weft serve` (default model) whose
//! greedy requests verify prompt-lookup drafts streams exactly the tokens of the
//! same request decoded one token per step.

mod common;

use common::*;
use weft_grpc::pb::{self, output_constraint::Kind};

async fn accepted(s: &Server) -> f64 {
    metric(&s.metrics().await, "weft_spec_accepted_tokens_total", &[]).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculated_streams_equal_plain_decoding() {
    let s = Server::start(&["--speculate", "4"]).await;
    let mut total = 0.0;
    for prompt in [
        "one two three four, one two three four, one two three four,",
        "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3",
        "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n",
        "The capital of France is",
    ] {
        let mut req = text_req(prompt, 48);
        req.ignore_eos = true;
        total += speculated_equals_plain(&s, req).await;
    }
    assert!(
        total > 16.0,
        "repetitive prompts should accept drafts: {total}"
    );
}

/// Constrained greedy requests speculate too: their drafts are checked against the
/// constraint (cut where it rejects them, each position picked under its own mask),
/// and they stream exactly the tokens of the same request decoded a token per step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_speculated_streams_equal_plain_decoding() {
    let s = Server::start(&["--speculate", "4"]).await;
    let mut total = 0.0;
    for (prompt, kind) in [
        (
            "one two three four, one two three four, one two three four,",
            Kind::Regex("( ?(one|two|three|four),?){4,40}".into()),
        ),
        (
            "[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
            Kind::JsonSchema(
                r#"{"type": "object", "properties": {"xs": {"type": "array",
                "items": {"type": "integer"}, "maxItems": 30}}, "required": ["xs"]}"#
                    .into(),
            ),
        ),
    ] {
        let mut req = text_req(prompt, 48);
        req.constraint = Some(pb::OutputConstraint { kind: Some(kind) });
        total += speculated_equals_plain(&s, req).await;
    }
    assert!(
        total > 4.0,
        "repetitive constrained output should accept drafts: {total}"
    );
}

/// Runs `req` without speculation (a stop string that never matches: requests with
/// stop strings do not speculate) and as it is, asserts both stream the same tokens
/// and text, and returns the draft tokens the second accepted.
async fn speculated_equals_plain(s: &Server, req: pb::GenerateRequest) -> f64 {
    let mut c = s.client().await;
    let mut plain = req.clone();
    plain.stop = vec!["\u{1}never\u{1}".into()];
    let before = accepted(s).await;
    let want = c.generate(plain).await.unwrap().into_inner();
    assert_eq!(
        accepted(s).await,
        before,
        "a stop-string request speculated"
    );
    let got = c.generate(req.clone()).await.unwrap().into_inner();
    let gained = accepted(s).await - before;
    let prompt = &req.input;
    assert_eq!(
        got.ids, want.ids,
        "{prompt:?}: speculation changed the tokens"
    );
    assert_eq!(got.text, want.text);
    eprintln!("{prompt:?}: {gained} draft tokens accepted: {:?}", got.text);
    gained
}
