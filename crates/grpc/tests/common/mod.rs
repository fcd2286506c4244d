//! Shared helpers for the end-to-end tests: a real `weft serve` process on
//! free loopback ports with the real default model, and real gRPC clients.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};
use weft_grpc::pb;
use weft_grpc::pb::generation_client::GenerationClient;

/// Model load + warm-up of a debug build on a busy 2-core machine.
pub const READY_TIMEOUT: Duration = Duration::from_secs(240);

/// A running `weft serve`. Dropping it kills the process.
pub struct Server {
    child: Mutex<Option<Child>>,
    pid: u32,
    pub grpc_addr: String,
    pub metrics_addr: String,
    /// The OpenAI-compatible HTTP API's address (host:port).
    pub http_addr: Option<String>,
    lines: Arc<Mutex<Vec<String>>>,
    pub stderr_path: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Server {
    /// Starts `weft serve` with extra args on ports it picks itself; returns
    /// once both listeners are bound (the model may still be loading).
    pub fn spawn(extra: &[&str]) -> Server {
        Self::spawn_env(extra, &[])
    }

    pub fn spawn_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let stderr_path = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_weft"));
        cmd.arg("serve")
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(extra)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        // The server dies with the test process even if a test panics
        // somewhere Drop does not run (a shared static server).
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        // PR_SET_PDEATHSIG fires when the spawning *thread* exits: spawn from
        // a thread that lives as long as the process.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let r = cmd.spawn();
            let _ = tx.send(r);
            loop {
                std::thread::park();
            }
        });
        let mut child = rx.recv().unwrap().expect("spawning weft serve");
        let pid = child.id();
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (ltx, lrx) = mpsc::channel::<String>();
        {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line.clone());
                    let _ = ltx.send(line);
                }
            });
        }
        let mut grpc_addr = None;
        let mut metrics_addr = None;
        let mut http_addr = None;
        let t0 = Instant::now();
        while grpc_addr.is_none() || metrics_addr.is_none() {
            let left = Duration::from_secs(30).saturating_sub(t0.elapsed());
            let line = match lrx.recv_timeout(left) {
                Ok(l) => l,
                Err(_) => {
                    let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                    panic!("weft serve printed no addresses; stderr:\n{log}");
                }
            };
            if let Some(a) = line.strip_prefix("weft: grpc listening on ") {
                grpc_addr = Some(a.trim().to_string());
            }
            if let Some(a) = line
                .strip_prefix("weft: http listening on http://")
                .or_else(|| line.strip_prefix("weft: http listening on https://"))
            {
                http_addr = a.split_whitespace().next().map(str::to_string);
            }
            if let Some(a) = line.strip_prefix("weft: metrics listening on http://") {
                metrics_addr = Some(a.trim().trim_end_matches("/metrics").to_string());
            }
        }
        Server {
            child: Mutex::new(Some(child)),
            pid,
            grpc_addr: grpc_addr.unwrap(),
            metrics_addr: metrics_addr.unwrap(),
            http_addr,
            lines,
            stderr_path,
            dir,
        }
    }

    /// Starts a server and waits until health says SERVING.
    pub async fn start(extra: &[&str]) -> Server {
        let s = Self::spawn(extra);
        s.wait_serving().await;
        s
    }

    /// Starts a server with extra environment and waits until it serves.
    pub async fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let s = Self::spawn_env(extra, env);
        s.wait_serving().await;
        s
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn stdout(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    pub async fn channel(&self) -> Channel {
        channel_at(self.url()).await
    }

    pub async fn client(&self) -> GenerationClient<Channel> {
        GenerationClient::new(self.channel().await)
    }

    pub async fn health(&self, service: &str) -> Result<i32, Status> {
        use tonic_health::pb::health_client::HealthClient;
        let mut h = HealthClient::new(self.channel().await);
        h.check(tonic_health::pb::HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map(|r| r.into_inner().status)
    }

    pub async fn wait_serving(&self) {
        let t0 = Instant::now();
        loop {
            if let Ok(s) = self.health("").await {
                if s == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
                    return;
                }
            }
            if let Some(status) = self.try_exit_status() {
                panic!(
                    "weft serve exited early ({status}); stderr:\n{}",
                    self.stderr()
                );
            }
            assert!(
                t0.elapsed() < READY_TIMEOUT,
                "weft serve not SERVING after {READY_TIMEOUT:?}; stderr:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid as i32, sig);
        }
    }

    pub fn try_exit_status(&self) -> Option<ExitStatus> {
        let mut g = self.child.lock().unwrap();
        g.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits (polling, async-friendly) for the process to exit.
    pub async fn wait_exit(&self, timeout: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.try_exit_status() {
                return s;
            }
            assert!(
                t0.elapsed() < timeout,
                "weft serve did not exit within {timeout:?}; stderr:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The Prometheus text from `/metrics`.
    pub async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.metrics_addr);
        let r = reqwest::get(&url).await.expect("GET /metrics");
        assert!(r.status().is_success(), "GET /metrics: {}", r.status());
        r.text().await.unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Value of one sample line `name{labels} value` whose name and labels
/// contain every `needle` (label order-insensitive); sums matches.
pub fn metric(text: &str, name: &str, needles: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let base = series.split('{').next().unwrap_or("");
        if base != name || !needles.iter().all(|n| series.contains(n)) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Polls `/metrics` until `name{needles}` satisfies `pred` (or panics).
pub async fn wait_metric(
    s: &Server,
    name: &str,
    needles: &[&str],
    pred: impl Fn(f64) -> bool,
    timeout: Duration,
) -> f64 {
    let t0 = Instant::now();
    loop {
        let text = s.metrics().await;
        let v = metric(&text, name, needles).unwrap_or(0.0);
        if pred(v) {
            return v;
        }
        assert!(
            t0.elapsed() < timeout,
            "{name}{needles:?} = {v} did not reach the expected value in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A channel to the server at `url` (`Server::url`), for tasks that cannot
/// borrow the `Server`.
pub async fn channel_at(url: String) -> Channel {
    Endpoint::from_shared(url)
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connecting to weft serve")
}

/// A generation client of the server at `url`.
pub async fn client_at(url: String) -> GenerationClient<Channel> {
    GenerationClient::new(channel_at(url).await)
}

pub fn text_req(prompt: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Text(prompt.to_string())),
        max_tokens,
        ..Default::default()
    }
}

pub fn sampled(mut r: pb::GenerateRequest, temperature: f32, seed: u64) -> pb::GenerateRequest {
    r.sampling = Some(pb::SamplingParams {
        temperature,
        seed: Some(seed),
        ..Default::default()
    });
    r
}

/// Wraps a message with an API key and/or a deadline.
pub fn with<T>(msg: T, key: Option<&str>, timeout: Option<Duration>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(k) = key {
        let v: MetadataValue<_> = format!("Bearer {k}").parse().unwrap();
        r.metadata_mut().insert("authorization", v);
    }
    if let Some(t) = timeout {
        r.set_timeout(t);
    }
    r
}

/// Everything a finished stream said.
#[derive(Debug, Default)]
pub struct Collected {
    pub request_id: String,
    pub ids: Vec<u32>,
    pub text: String,
    pub deltas: usize,
    pub logprobs: Vec<pb::PositionLogprobs>,
    pub finished: Option<pb::Finished>,
    /// Messages after `finished` (must be 0).
    pub after_finished: usize,
    /// The stream's final status if it was not OK.
    pub status: Option<Status>,
}

pub async fn collect(
    client: &mut GenerationClient<Channel>,
    req: Request<pb::GenerateRequest>,
) -> Result<Collected, Status> {
    let mut stream = client.generate_stream(req).await?.into_inner();
    let mut c = Collected::default();
    loop {
        match stream.message().await {
            Ok(Some(m)) => {
                if c.request_id.is_empty() {
                    c.request_id = m.request_id.clone();
                }
                assert_eq!(m.request_id, c.request_id, "request_id in every message");
                if c.finished.is_some() {
                    c.after_finished += 1;
                }
                match m.event {
                    Some(pb::generate_stream_response::Event::Delta(d)) => {
                        c.deltas += 1;
                        c.ids.extend(d.ids);
                        c.text.push_str(&d.text);
                        c.logprobs.extend(d.logprobs);
                    }
                    Some(pb::generate_stream_response::Event::Finished(f)) => c.finished = Some(f),
                    None => panic!("stream message without an event"),
                }
            }
            Ok(None) => return Ok(c),
            Err(s) => {
                c.status = Some(s);
                return Ok(c);
            }
        }
    }
}

pub fn assert_code<T: std::fmt::Debug>(r: Result<T, Status>, code: Code, needle: &str) -> Status {
    match r {
        Ok(v) => panic!("expected {code:?} ({needle}), got Ok({v:?})"),
        Err(s) => {
            assert_eq!(s.code(), code, "{needle}: {}", s.message());
            assert!(
                s.message().contains(needle),
                "expected {needle:?} in {:?}",
                s.message()
            );
            s
        }
    }
}

pub fn retry_after_ms(s: &Status) -> u64 {
    s.metadata()
        .get("retry-after-ms")
        .unwrap_or_else(|| panic!("no retry-after-ms in {s:?}"))
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

pub fn reason(f: &pb::Finished) -> pb::FinishReason {
    pb::FinishReason::try_from(f.reason).unwrap()
}

/// The workspace's root directory.
#[allow(dead_code)]
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace root")
        .to_path_buf()
}

/// The Python with mlx-lm the oracle runs in (`WEFT_PYTHON`, else the
/// workspace's `.venv`).
#[allow(dead_code)]
pub fn oracle_python() -> PathBuf {
    std::env::var_os("WEFT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}
