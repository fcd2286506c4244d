//! TLS for the gRPC and HTTP listeners (rustls, ring): `--tls-cert` and
//! `--tls-key` (PEM) serve both over TLS; `--tls-client-ca` also requires
//! every client to present a certificate that CA signed (mutual TLS). The
//! metrics listener stays plaintext (scrapers on loopback or the pod network).
//! Files are read and checked once at startup, so a bad path or PEM is a
//! clear startup error, never a failed handshake later.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls;
use tracing::{debug, warn};

/// Where the PEM files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// The files' contents, checked.
pub struct Tls {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Option<Vec<u8>>,
}

fn read(what: &str, p: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
}

fn certs(
    what: &str,
    p: &Path,
    pem: &[u8],
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<_, _>>()
        .with_context(|| format!("the TLS {what} {} is not PEM", p.display()))?;
    if certs.is_empty() {
        bail!(
            "the TLS {what} {} holds no certificate (expected PEM `BEGIN CERTIFICATE` blocks)",
            p.display()
        );
    }
    Ok(certs)
}

impl TlsFiles {
    /// Reads and checks the files: certificates present, a private key present.
    pub fn load(&self) -> anyhow::Result<Tls> {
        let cert_pem = read("certificate", &self.cert)?;
        certs("certificate", &self.cert, &cert_pem)?;
        let key_pem = read("key", &self.key)?;
        rustls_pemfile::private_key(&mut &key_pem[..])
            .with_context(|| format!("the TLS key {} is not PEM", self.key.display()))?
            .with_context(|| {
                format!(
                    "the TLS key {} holds no private key (PKCS#8, PKCS#1 or SEC1 PEM)",
                    self.key.display()
                )
            })?;
        let ca_pem = match &self.client_ca {
            Some(p) => {
                let pem = read("client CA", p)?;
                certs("client CA", p, &pem)?;
                Some(pem)
            }
            None => None,
        };
        let tls = Tls {
            cert_pem,
            key_pem,
            ca_pem,
        };
        // Both configurations build now, so a mismatched key fails at startup.
        tls.http_acceptor()?;
        Ok(tls)
    }
}

impl Tls {
    /// Whether clients must present a certificate.
    pub fn mutual(&self) -> bool {
        self.ca_pem.is_some()
    }

    /// tonic's server TLS configuration.
    pub fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let mut c =
            ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem));
        if let Some(ca) = &self.ca_pem {
            c = c.client_ca_root(Certificate::from_pem(ca));
        }
        c
    }

    /// The HTTP listener's TLS acceptor (HTTP/1.1).
    pub fn http_acceptor(&self) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certs("certificate", Path::new("(certificate)"), &self.cert_pem)?;
        let key = rustls_pemfile::private_key(&mut &self.key_pem[..])?
            .context("the TLS key holds no private key")?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?;
        let builder = match &self.ca_pem {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs("client CA", Path::new("(client CA)"), ca)? {
                    roots.add(c).context("adding a client CA certificate")?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .context("building the client certificate verifier")?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .context("the TLS key does not match the certificate")?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// Serves `app` over TLS on `listener` until `stop` turns true: each
/// connection is handshaken, then served as HTTP/1.1 (a failed handshake
/// ends only that connection).
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    acceptor: tokio_rustls::TlsAcceptor,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (tcp, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "HTTP API: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let svc = hyper_util::service::TowerToHyperService::new(app);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                .await
            {
                debug!(%peer, error = %e, "HTTP connection ended");
            }
        });
    }
}
