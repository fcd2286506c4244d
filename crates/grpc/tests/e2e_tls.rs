//! End-to-end: `weft serve --tls-cert/--tls-key [--tls-client-ca]` serves gRPC
//! and the HTTP API over TLS with a certificate the test makes (its own CA);
//! plaintext clients and, with mutual TLS, clients without a certificate from
//! that CA are refused; bad TLS files are startup errors.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use weft_grpc::pb;
use weft_grpc::pb::generation_client::GenerationClient;

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["client.test".into()]);
    Pki {
        ca: ca.pem(),
        server_cert,
        server_key,
        client_cert,
        client_key,
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// Waits for the server's readiness line (the plaintext health probe of
/// `Server::start` cannot speak TLS).
async fn wait_ready(s: &Server) {
    let t0 = Instant::now();
    while !s.stdout().iter().any(|l| l.starts_with("weft: ready")) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "not ready; stderr:\n{}",
            s.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn port(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

async fn grpc(
    s: &Server,
    ca: &str,
    id: Option<(&str, &str)>,
) -> Result<GenerationClient<tonic::transport::Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((c, k)) = id {
        tls = tls.identity(Identity::from_pem(c, k));
    }
    let ch = Endpoint::from_shared(format!("https://127.0.0.1:{}", port(&s.grpc_addr)))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(GenerationClient::new(ch))
}

fn https(s: &Server, ca: &str, id: Option<String>) -> reqwest::Client {
    let http = s.http_addr.as_deref().expect("HTTP API listening");
    let mut b = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .resolve(
            "localhost",
            format!("127.0.0.1:{}", port(http)).parse().unwrap(),
        )
        .timeout(Duration::from_secs(60));
    if let Some(pem) = id {
        b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

fn models_url(s: &Server) -> String {
    format!(
        "https://localhost:{}/v1/models",
        port(s.http_addr.as_deref().unwrap())
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls_on_both_apis() {
    let p = pki();
    let dir = tempfile::tempdir().unwrap();
    let cert = write(dir.path(), "server.pem", &p.server_cert);
    let key = write(dir.path(), "server.key", &p.server_key);
    let ca = write(dir.path(), "ca.pem", &p.ca);

    // Server TLS: both APIs over TLS; plaintext refused.
    let s = Server::spawn(&["--tls-cert", &cert, "--tls-key", &key]);
    wait_ready(&s).await;
    assert!(s
        .stdout()
        .iter()
        .any(|l| l.starts_with("weft: http listening on https://")));
    let mut c = grpc(&s, &p.ca, None).await.expect("TLS gRPC connect");
    let r = c
        .generate(text_req("The capital of France is", 4))
        .await
        .expect("Generate over TLS")
        .into_inner();
    assert!(!r.ids.is_empty());
    let plain = Endpoint::from_shared(s.url())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    let refused = match plain {
        Err(_) => true,
        Ok(ch) => GenerationClient::new(ch)
            .list_models(pb::ListModelsRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a plaintext gRPC call was served");
    let r = https(&s, &p.ca, None)
        .get(models_url(&s))
        .send()
        .await
        .expect("HTTPS /v1/models");
    assert_eq!(r.status(), 200);
    let plain_http = reqwest::Client::new()
        .get(format!(
            "http://{}/v1/models",
            s.http_addr.as_deref().unwrap()
        ))
        .send()
        .await;
    assert!(
        plain_http.is_err() || !plain_http.unwrap().status().is_success(),
        "plaintext HTTP was served"
    );
    drop(s);

    // Mutual TLS: a client certificate from the CA is required.
    let s = Server::spawn(&[
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    wait_ready(&s).await;
    let anonymous = match grpc(&s, &p.ca, None).await {
        Err(_) => true,
        Ok(mut c) => c.list_models(pb::ListModelsRequest {}).await.is_err(),
    };
    assert!(
        anonymous,
        "mutual TLS served a client without a certificate"
    );
    let mut c = grpc(&s, &p.ca, Some((&p.client_cert, &p.client_key)))
        .await
        .expect("mTLS gRPC connect");
    c.list_models(pb::ListModelsRequest {})
        .await
        .expect("ListModels with a client certificate");
    assert!(
        https(&s, &p.ca, None)
            .get(models_url(&s))
            .send()
            .await
            .is_err(),
        "mutual TLS served an HTTP client without a certificate"
    );
    let id = format!("{}{}", p.client_cert, p.client_key);
    let r = https(&s, &p.ca, Some(id))
        .get(models_url(&s))
        .send()
        .await
        .expect("HTTPS with a client certificate");
    assert_eq!(r.status(), 200);
}

#[test]
fn bad_tls_files_are_startup_errors() {
    let p = pki();
    let dir = tempfile::tempdir().unwrap();
    let cert = write(dir.path(), "server.pem", &p.server_cert);
    let key = write(dir.path(), "server.key", &p.server_key);
    let other_key = write(
        dir.path(),
        "other.key",
        &KeyPair::generate().unwrap().serialize_pem(),
    );
    let junk = write(dir.path(), "junk.pem", "not a certificate\n");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "off",
            ])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["--tls-cert", &junk, "--tls-key", &key]);
    assert!(e.contains("holds no certificate"), "{e}");
    let e = run(&["--tls-cert", &cert, "--tls-key", &other_key]);
    assert!(e.contains("does not match"), "{e}");
    let e = run(&["--tls-cert", &cert, "--tls-key", "/nonexistent/key.pem"]);
    assert!(e.contains("reading the TLS key"), "{e}");
    let e = run(&["--tls-cert", &cert]);
    assert!(e.contains("--tls-key"), "{e}");
    let e = run(&["--tls-client-ca", &cert]);
    assert!(e.contains("--tls-cert"), "{e}");
}
