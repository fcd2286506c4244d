//! End-to-end tests of the bench against in-process fake servers: a tonic
//! `Generation` service with scripted deltas, and a raw-TCP HTTP server that
//! streams SSE in deliberately split pieces. Everything listens on 127.0.0.1.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::*;
use crate::pb;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn args(line: &str) -> BenchArgs {
    Cli::try_parse_from(std::iter::once("bench").chain(line.split_whitespace()))
        .unwrap()
        .bench
}

async fn run_quiet(a: BenchArgs) -> BenchReport {
    let (tx, rx) = watch::channel(false);
    run_until(a, tx, rx, std::future::pending()).await.unwrap()
}

/// A port nothing listens on.
async fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

// ---------------------------------------------------------------- gRPC

#[derive(Clone, Default)]
struct FakeGen {
    prompts: Arc<Mutex<Vec<String>>>,
    /// Delay between deltas.
    gap: Duration,
}

type DeltaStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::generation_server::Generation for FakeGen {
    async fn generate(
        &self,
        _: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type GenerateStreamStream = DeltaStream;

    /// Keys: `good*` are served; `flood` is over quota; none is
    /// unauthenticated. Streams `max_tokens` tokens in deltas of 1, 2, 1, 2…
    /// tokens, then `finished` (LENGTH) with usage.
    async fn generate_stream(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<DeltaStream>, Status> {
        let auth = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let r = req.into_inner();
        let prompt = match &r.input {
            Some(pb::generate_request::Input::Text(t)) => t.clone(),
            _ => return Err(Status::invalid_argument("input: text expected")),
        };
        self.prompts.lock().unwrap().push(prompt.clone());
        match auth.as_deref() {
            Some(a) if a.starts_with("Bearer good") => {}
            Some("Bearer flood") => {
                let mut s = Status::resource_exhausted("tenant flood over quota");
                s.metadata_mut()
                    .insert("retry-after-ms", "250".parse().unwrap());
                return Err(s);
            }
            _ => return Err(Status::unauthenticated("missing or unknown API key")),
        }
        if !r.ignore_eos || r.max_tokens == 0 || !r.request_id.starts_with("bench-") {
            return Err(Status::invalid_argument(
                "bench must set ignore_eos, max_tokens, request_id",
            ));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let gap = self.gap;
        let id = r.request_id.clone();
        tokio::spawn(async move {
            let mut sent = 0u32;
            let mut k = 1;
            while sent < r.max_tokens {
                tokio::time::sleep(gap).await;
                let n = k.min(r.max_tokens - sent);
                let msg = pb::GenerateStreamResponse {
                    request_id: id.clone(),
                    event: Some(pb::generate_stream_response::Event::Delta(pb::TokenDelta {
                        ids: (0..n).map(|i| sent + i).collect(),
                        text: "x".repeat(n as usize),
                        logprobs: vec![],
                    })),
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return; // client went away
                }
                sent += n;
                k = 3 - k;
            }
            let fin = pb::GenerateStreamResponse {
                request_id: id,
                event: Some(pb::generate_stream_response::Event::Finished(
                    pb::Finished {
                        reason: pb::FinishReason::Length as i32,
                        usage: Some(pb::Usage {
                            prompt_tokens: prompt.split(' ').count() as u32,
                            generated_tokens: sent,
                            ..Default::default()
                        }),
                        error: String::new(),
                    },
                )),
            };
            let _ = tx.send(Ok(fin)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn tokenize(
        &self,
        _: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn detokenize(
        &self,
        _: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_model(
        &self,
        _: Request<pb::GetModelRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn cancel(
        &self,
        _: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

async fn start_grpc(fake: FakeGen) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::generation_server::GenerationServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("grpc://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_closed_loop_counts_tokens_latencies_and_statuses() {
    let fake = FakeGen {
        gap: Duration::from_millis(1),
        ..Default::default()
    };
    let target = start_grpc(fake.clone()).await;
    let a = args(&format!(
        "--target {target} -c 4 -n 60 --warmup 5 --max-tokens 6 --prompt-tokens uniform:16:48 \
         --tenant a:good1 --tenant b:good2:2 --tenant flood:flood --tenant anon: --seed 3 -q"
    ));
    let r = run_quiet(a).await;
    assert!(!r.interrupted);
    assert_eq!(r.api, "weft");
    assert_eq!(r.warmup_requests, 5);
    let o = &r.overall;
    assert_eq!(o.requests, 60);
    let by = |name: &str| r.tenants.iter().find(|t| t.name == name).unwrap();
    let (a, b, flood, anon) = (by("a"), by("b"), by("flood"), by("anon"));
    assert_eq!(a.requests + b.requests + flood.requests + anon.requests, 60);
    assert_eq!(o.ok, a.ok + b.ok);
    assert_eq!((a.errors, b.errors), (0, 0));
    assert_eq!(flood.ok, 0);
    assert_eq!(
        flood.errors_by_status.get("RESOURCE_EXHAUSTED"),
        Some(&flood.requests)
    );
    assert_eq!(
        anon.errors_by_status.get("UNAUTHENTICATED"),
        Some(&anon.requests)
    );
    assert!(a.ok > 0 && b.ok > 0 && flood.requests > 0 && anon.requests > 0);
    // ignore_eos + max_tokens 6: every success has exactly 6 tokens.
    assert_eq!(o.output_tokens, 6 * o.ok);
    assert_eq!(o.finish_reasons.get("length"), Some(&o.ok));
    assert_eq!(o.ttft_ms.count, o.ok);
    assert_eq!(o.e2e_ms.count, o.ok);
    // Deltas of 1,2,1,2 tokens: the first delta's token gives TTFT, the other
    // 5 tokens one ITL sample each.
    assert_eq!(o.itl_ms.count, 5 * o.ok);
    assert!(o.ttft_ms.p50 > 0.5, "{:?}", o.ttft_ms); // >= one 1 ms gap
    assert!(o.e2e_ms.p50 >= o.ttft_ms.p50);
    assert!(o.requests_per_s > 0.0 && o.output_tokens_per_s > 0.0);
    let mean_prompt = o.mean_prompt_tokens.unwrap();
    assert!((16.0..=48.0).contains(&mean_prompt), "{mean_prompt}");
    assert!(r.error_examples.iter().any(|e| e
        .starts_with("RESOURCE_EXHAUSTED: tenant flood over quota")
        && e.contains("retry-after-ms 250")));
    // Warm-up + measured prompts: all unique.
    let mut prompts = fake.prompts.lock().unwrap().clone();
    assert_eq!(prompts.len(), 65);
    prompts.sort();
    prompts.dedup();
    assert_eq!(prompts.len(), 65);
    let table = stats::render_table(&r);
    assert!(table.contains("RESOURCE_EXHAUSTED") && table.contains("flood"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_open_loop_per_tenant_rates_for_a_duration() {
    let target = start_grpc(FakeGen::default()).await;
    let a = args(&format!(
        "--target {target} --tenant steady:good1 --tenant burst:good2 --tenant-rate burst:300 \
         --rate 50 -d 1s --max-tokens 3 --connections 2 -q"
    ));
    let r = run_quiet(a).await;
    let by = |name: &str| r.tenants.iter().find(|t| t.name == name).unwrap();
    let (steady, burst) = (by("steady"), by("burst"));
    assert_eq!(r.overall.errors, 0, "{:?}", r.error_examples);
    // Poisson counts in 1 s: 300 ± 4*sqrt(300) and 50 ± 4*sqrt(50).
    assert!((231..=369).contains(&burst.ok), "burst {}", burst.ok);
    assert!((22..=78).contains(&steady.ok), "steady {}", steady.ok);
    assert!(r.duration_s >= 0.9, "{}", r.duration_s);
    assert!(r.mode.contains("burst open loop 300 req/s") && r.mode.contains("open loop 50 req/s"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_targets_are_errors_not_panics() {
    let port = closed_port().await;
    let r = run_quiet(args(&format!(
        "--target grpc://127.0.0.1:{port} -c 2 -n 5 -q"
    )))
    .await;
    assert_eq!((r.overall.requests, r.overall.ok), (5, 0));
    assert_eq!(r.overall.errors_by_status.get("UNAVAILABLE"), Some(&5));
    let r = run_quiet(args(&format!(
        "--target http://127.0.0.1:{port} -c 2 -n 5 -q"
    )))
    .await;
    assert_eq!(r.api, "openai");
    assert_eq!(r.overall.errors_by_status.get("CONNECT_ERROR"), Some(&5));
    assert!(!r.error_examples.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_reports_what_was_measured() {
    // 1000 tokens at 5 ms apiece never finish within the test.
    let fake = FakeGen {
        gap: Duration::from_millis(5),
        ..Default::default()
    };
    let target = start_grpc(fake).await;
    let a = args(&format!(
        "--target {target} -c 3 -n 100 --max-tokens 1000 --tenant t:good -q"
    ));
    let (tx, rx) = watch::channel(false);
    let t0 = Instant::now();
    let r = run_until(a, tx, rx, tokio::time::sleep(Duration::from_millis(300)))
        .await
        .unwrap();
    assert!(r.interrupted);
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert_eq!(r.overall.requests, 0, "in-flight requests are dropped");
    assert!(
        r.duration_s >= 0.25 && r.duration_s < 1.0,
        "{}",
        r.duration_s
    );
    assert!(stats::render_table(&r).contains("(interrupted)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_report_is_written() {
    let target = start_grpc(FakeGen::default()).await;
    let path = std::env::temp_dir().join(format!("weft-bench-{}.json", std::process::id()));
    let a = args(&format!(
        "--target {target} -n 4 --max-tokens 2 --api-key good --json {} -q",
        path.display()
    ));
    let r = run(a).await.unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(v["overall"]["ok"], 4);
    assert_eq!(v["overall"]["output_tokens"], 8);
    assert_eq!(v["config"]["max_tokens"], "2");
    assert_eq!(v["tenants"][0]["name"], "default");
    assert!(v["overall"]["ttft_ms"]["p99"].as_f64().unwrap() > 0.0);
    assert_eq!(r.overall.ok, 4);
}

// ---------------------------------------------------------------- OpenAI/SSE

/// Serves `/v1/completions` like mlx_lm.server: one `data:` chunk per token
/// (each written in two pieces cut inside the JSON), a final chunk with the
/// finish reason, a usage chunk, `[DONE]`. Key `bad` gets a 401.
async fn start_sse(seen: Arc<Mutex<Vec<serde_json::Value>>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = match listener.accept().await {
                Ok(s) => s,
                Err(_) => return,
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                let head_end = loop {
                    let n = sock.read(&mut tmp).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    let n = sock.read(&mut tmp).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                }
                let body: serde_json::Value =
                    serde_json::from_slice(&buf[head_end..head_end + len]).unwrap();
                seen.lock().unwrap().push(body.clone());
                if !head.starts_with("post /v1/completions ") {
                    let _ = sock
                        .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                    return;
                }
                if head.contains("authorization: bearer bad") {
                    let _ = sock
                        .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 11\r\nconnection: close\r\n\r\nbad api key")
                        .await;
                    return;
                }
                let n = body["max_tokens"].as_u64().unwrap();
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                    .await;
                for i in 0..n {
                    let chunk = format!(
                        "data: {{\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"finish_reason\":null,\"text\":\" w{i}\"}}]}}\n\n"
                    );
                    let (x, y) = chunk.as_bytes().split_at(chunk.len() / 2);
                    let _ = sock.write_all(x).await;
                    let _ = sock.flush().await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let _ = sock.write_all(y).await;
                    let _ = sock.flush().await;
                }
                let tail = format!(
                    "data: {{\"choices\":[{{\"index\":0,\"finish_reason\":\"length\",\"text\":\"\"}}]}}\n\n\
                     data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":42,\"completion_tokens\":{n},\"total_tokens\":{}}}}}\n\n\
                     data: [DONE]\n\n",
                    42 + n
                );
                let _ = sock.write_all(tail.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sse_end_to_end() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let target = start_sse(seen.clone()).await;
    let a = args(&format!(
        "--target {target} -c 3 -n 12 --max-tokens uniform:4:8 --tenant ok:good --tenant nope:bad \
         --model m1 --extra-body {{\"min_tokens\":1}} -q"
    ));
    let r = run_quiet(a).await;
    assert_eq!(r.api, "openai");
    let by = |name: &str| r.tenants.iter().find(|t| t.name == name).unwrap();
    let (ok, nope) = (by("ok"), by("nope"));
    assert_eq!(ok.requests + nope.requests, 12);
    assert_eq!(ok.errors, 0, "{:?}", r.error_examples);
    assert_eq!(nope.errors_by_status.get("HTTP 401"), Some(&nope.requests));
    assert!(ok.ok > 0 && nope.requests > 0);
    assert_eq!(ok.mean_prompt_tokens, Some(42.0));
    assert_eq!(ok.finish_reasons.get("length"), Some(&ok.ok));
    // Tokens from usage equal one per chunk here; ITL: one sample per
    // chunk after the first.
    assert_eq!(ok.itl_ms.count, ok.output_tokens - ok.ok);
    assert!(ok.mean_output_tokens >= 4.0 && ok.mean_output_tokens <= 8.0);
    assert!(r
        .error_examples
        .iter()
        .any(|e| e == "HTTP 401: bad api key"));
    let bodies = seen.lock().unwrap();
    assert_eq!(bodies.len(), 12);
    for b in bodies.iter() {
        assert_eq!(b["stream"], true);
        assert_eq!(b["model"], "m1");
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["min_tokens"], 1);
        assert_eq!(b["stream_options"]["include_usage"], true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_stream_cut_short_is_incomplete() {
    // A server that starts a stream and hangs up mid-way.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut tmp = [0u8; 8192];
                let _ = sock.read(&mut tmp).await;
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choi")
                    .await;
                let _ = sock.shutdown().await;
            });
        }
    });
    let r = run_quiet(args(&format!("--target http://{addr} -n 2 -q"))).await;
    assert_eq!(
        r.overall.errors_by_status.get("INCOMPLETE_STREAM"),
        Some(&2),
        "{:?}",
        r.error_examples
    );
}
