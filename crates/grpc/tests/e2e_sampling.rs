//! End-to-end sampling sites: a real `weft serve` that samples on the device
//! (`WEFT_SAMPLE_ON=device`: MLX ops over the logits, here on MLX's CPU
//! backend, the same ops a GPU runs) against one that samples on the host
//! (the contract's reference implementation). Greedy tokens, with and
//! without penalties, are identical; seeded draws use the same random point,
//! so they agree too; logprobs match; a seeded request decodes the same
//! alone and beside other requests; and steps that fail after the device
//! sampled (injected faults) roll back and retry without changing a stream.

mod common;

use common::*;
use weft_grpc::pb;

fn with_params(prompt: &str, max_tokens: u32, p: pb::SamplingParams) -> pb::GenerateRequest {
    let mut r = text_req(prompt, max_tokens);
    r.ignore_eos = true;
    r.sampling = Some(p);
    r
}

fn requests() -> Vec<pb::GenerateRequest> {
    let mut lp = text_req("The capital of France is", 12);
    lp.ignore_eos = true;
    lp.logprobs = 3;
    vec![
        with_params(
            "The capital of France is",
            24,
            pb::SamplingParams::default(),
        ),
        with_params(
            "Once upon a time",
            24,
            pb::SamplingParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                ..Default::default()
            },
        ),
        with_params(
            "List three colors:",
            24,
            pb::SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                top_k: 40,
                seed: Some(7),
                ..Default::default()
            },
        ),
        with_params(
            "def fib(n):",
            24,
            pb::SamplingParams {
                temperature: 1.0,
                min_p: 0.05,
                seed: Some(11),
                ..Default::default()
            },
        ),
        lp,
    ]
}

async fn run_all(s: &Server, concurrent: bool) -> Vec<Collected> {
    let reqs = requests();
    if concurrent {
        let mut tasks = Vec::new();
        for r in reqs {
            let mut c = s.client().await;
            tasks.push(tokio::spawn(async move {
                collect(&mut c, tonic::Request::new(r)).await.unwrap()
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    } else {
        let mut c = s.client().await;
        let mut out = Vec::new();
        for r in reqs {
            out.push(collect(&mut c, tonic::Request::new(r)).await.unwrap());
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_sampling_streams_what_host_sampling_streams() {
    let host = Server::start_env(&[], &[("WEFT_SAMPLE_ON", "host")]).await;
    let want = run_all(&host, false).await;
    drop(host);
    let dev = Server::start_env(&[], &[("WEFT_SAMPLE_ON", "device")]).await;
    let alone = run_all(&dev, false).await;
    let batched = run_all(&dev, true).await;
    for (i, ((w, a), b)) in want.iter().zip(&alone).zip(&batched).enumerate() {
        assert!(w.status.is_none() && a.status.is_none() && b.status.is_none());
        assert_eq!(
            a.ids, w.ids,
            "request {i}: device sampling differs from host"
        );
        assert_eq!(b.ids, a.ids, "request {i}: batched differs from alone");
        assert_eq!(a.logprobs.len(), w.logprobs.len(), "request {i}");
        for (x, y) in a.logprobs.iter().zip(&w.logprobs) {
            assert_eq!(
                format!("{:?}", x.top.iter().map(|t| t.id).collect::<Vec<_>>()),
                format!("{:?}", y.top.iter().map(|t| t.id).collect::<Vec<_>>())
            );
            let (xc, yc) = (x.chosen.as_ref().unwrap(), y.chosen.as_ref().unwrap());
            assert_eq!(xc.id, yc.id);
            assert!(
                (xc.logprob - yc.logprob).abs() < 1e-3,
                "request {i}: {x:?} vs {y:?}"
            );
        }
    }
    assert_eq!(want[4].logprobs.len(), 12, "logprobs were asked for");
    // Device sampling pipelines decode steps: each queued on its predecessor's picks.
    let pipelined = metric(&dev.metrics().await, "weft_steps_pipelined_total", &[]).unwrap_or(0.0);
    assert!(pipelined > 20.0, "{pipelined} pipelined steps");
    drop(dev);

    // Steps failing after the forward (its KV writes and device picks done),
    // during sampling bookkeeping and before commit roll back and retry: the
    // streams are still exactly the fault-free ones (seeded draws included,
    // their randomness being indexed by token, not by attempt).
    // One request at a time without drafts, so most steps (all but the penalized
    // request's) pipeline: the faults hit steps queued on their predecessors.
    let faulty = Server::start_env(
        &["--speculate", "0"],
        &[
            ("WEFT_SAMPLE_ON", "device"),
            (
                "WEFT_TEST_FAULTS",
                "after_forward:3,after_forward:8-9,sampling:14,commit_bookkeeping:18",
            ),
        ],
    )
    .await;
    let retried = run_all(&faulty, false).await;
    let rollbacks =
        metric(&faulty.metrics().await, "weft_step_rollbacks_total", &[]).unwrap_or(0.0);
    assert!(
        rollbacks >= 5.0,
        "faults were injected: {rollbacks} rollbacks"
    );
    let pipelined =
        metric(&faulty.metrics().await, "weft_steps_pipelined_total", &[]).unwrap_or(0.0);
    assert!(pipelined > 0.0, "the faulty server pipelined no step");
    for (i, (w, r)) in want.iter().zip(&retried).enumerate() {
        assert!(r.status.is_none(), "request {i}: {:?}", r.status);
        assert_eq!(
            r.ids, w.ids,
            "request {i}: a rolled-back step changed the stream"
        );
        assert_eq!(r.logprobs.len(), w.logprobs.len(), "request {i}");
    }
}

/// Requests that arrive while steps compute join the step queued behind the one in
/// flight, their admission part of that step's transaction: each streams what it
/// streams alone with host sampling — also with faults injected into the steps,
/// where an admission whose step rolls back is undone and the request joins again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_arriving_mid_decode_join_the_queued_step() {
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        "List three colors:",
        "def fib(n):",
        "The weather today",
        "In the beginning",
    ];
    let reqs: Vec<pb::GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = if i % 2 == 0 {
                pb::SamplingParams::default()
            } else {
                pb::SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    seed: Some(i as u64),
                    ..Default::default()
                }
            };
            with_params(p, 32, params)
        })
        .collect();
    let host = Server::start_env(&["--speculate", "0"], &[("WEFT_SAMPLE_ON", "host")]).await;
    let mut want = Vec::new();
    let mut c = host.client().await;
    for r in &reqs {
        want.push(
            collect(&mut c, tonic::Request::new(r.clone()))
                .await
                .unwrap(),
        );
    }
    drop(host);
    // Besides the step faults, every other plan from the 41st fails as its inputs
    // are filled: a step queued with a request joining it then undoes that admission
    // (when one is: arrivals are timed, steps are not; the fake-model simulations
    // undo admissions deterministically).
    let mut faults = String::from(
        "after_plan:7,after_plan:15,after_forward:10,after_forward:21-22,\
         after_forward:33,commit_bookkeeping:27",
    );
    for k in (41..140).step_by(2) {
        faults.push_str(&format!(",after_plan:{k}"));
    }
    for faulty in [false, true] {
        let mut env = vec![("WEFT_SAMPLE_ON", "device")];
        if faulty {
            env.push(("WEFT_TEST_FAULTS", faults.as_str()));
        }
        let s = Server::start_env(&["--speculate", "0"], &env).await;
        let mut tasks = Vec::new();
        for r in reqs.clone() {
            let mut c = s.client().await;
            tasks.push(tokio::spawn(async move {
                collect(&mut c, tonic::Request::new(r)).await.unwrap()
            }));
            // Each arrives while the earlier ones decode.
            tokio::time::sleep(std::time::Duration::from_millis(80)).await;
        }
        for (i, (t, w)) in tasks.into_iter().zip(&want).enumerate() {
            let got = t.await.unwrap();
            assert!(got.status.is_none(), "request {i}: {:?}", got.status);
            assert_eq!(got.ids, w.ids, "request {i} (faults: {faulty})");
        }
        let m = s.metrics().await;
        let joined = metric(&m, "weft_admissions_pipelined_total", &[]).unwrap_or(0.0);
        let undone = metric(&m, "weft_admissions_undone_total", &[]).unwrap_or(0.0);
        let rollbacks = metric(&m, "weft_step_rollbacks_total", &[]).unwrap_or(0.0);
        eprintln!("faults {faulty}: {joined} admissions into queued steps, {undone} undone, {rollbacks} rollbacks");
        assert!(joined >= 1.0, "no request joined a queued step");
        if faulty {
            assert!(rollbacks >= 5.0, "{rollbacks} rollbacks");
        }
    }
}
