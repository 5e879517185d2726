//! Who may call the extender. `/bind` places pods and `/filter` answers
//! for every GPU pod of the cluster, so kube-scheduler must be the only
//! caller: either the extender listens on loopback beside kube-scheduler
//! (a sidecar in its pod), or it requires a client certificate signed by
//! the CA kube-scheduler's extender `tlsConfig` presents (mTLS). A plain
//! listener reachable from other hosts is refused at start.
//!
//! Handshakes run off the accept path, at most [`MAX_HANDSHAKES`] at once
//! and [`HANDSHAKE_TIMEOUT`] each, so callers without a certificate (or a
//! flood of them) cannot hold up kube-scheduler's calls.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// How long a client may take to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once; connections past it are closed.
pub const MAX_HANDSHAKES: usize = 256;

/// The server's certificate chain and key, and the CA client
/// certificates must chain to.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {}: {problem}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        problem: String,
    },
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error(
        "--listen {0} is reachable from other hosts and would answer anyone: give --tls-cert, \
         --tls-key and --client-ca (kube-scheduler's extender tlsConfig presents a client \
         certificate), or listen on loopback beside kube-scheduler"
    )]
    PlainOutsideLoopback(SocketAddr),
    #[error("--tls-cert, --tls-key and --client-ca go together; missing: {0}")]
    Partial(String),
}

/// The TLS files from the flags: all three or none.
pub fn files(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<TlsFiles>, TlsError> {
    match (cert, key, client_ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(client_ca)) => Ok(Some(TlsFiles {
            cert,
            key,
            client_ca,
        })),
        (c, k, a) => {
            let missing: Vec<&str> = [
                (c.is_none(), "--tls-cert"),
                (k.is_none(), "--tls-key"),
                (a.is_none(), "--client-ca"),
            ]
            .into_iter()
            .filter_map(|(m, n)| m.then_some(n))
            .collect();
            Err(TlsError::Partial(missing.join(", ")))
        }
    }
}

/// Refuses a plain listener on anything but loopback.
pub fn check_plain(listen: SocketAddr) -> Result<(), TlsError> {
    if listen.ip().is_loopback() {
        Ok(())
    } else {
        Err(TlsError::PlainOutsideLoopback(listen))
    }
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |problem: String| TlsError::File {
        what,
        path: path.to_path_buf(),
        problem,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// A server configuration that requires a client certificate chaining to
/// `client_ca`.
pub fn server_config(f: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certs("--tls-cert", &f.cert)?;
    let key = PrivateKeyDer::from_pem_file(&f.key).map_err(|e| TlsError::File {
        what: "--tls-key",
        path: f.key.clone(),
        problem: e.to_string(),
    })?;
    let mut roots = rustls::RootCertStore::empty();
    for c in certs("--client-ca", &f.client_ca)? {
        roots.add(c).map_err(|e| TlsError::File {
            what: "--client-ca",
            path: f.client_ca.clone(),
            problem: e.to_string(),
        })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(format!("--tls-cert with --tls-key: {e}")))?;
    Ok(Arc::new(cfg))
}

/// Accepted connections that completed the handshake with a client
/// certificate, for `axum::serve`.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `tcp` until `cancel`, handshaking in the background.
    pub fn start(
        tcp: TcpListener,
        cfg: Arc<rustls::ServerConfig>,
        cancel: CancellationToken,
    ) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(cfg);
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let (s, peer) = tokio::select! {
                    _ = cancel.cancelled() => return,
                    a = tcp.accept() => match a {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    continue; // dropped: too many handshakes in progress
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(s)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept loop stopped (cancelled): serve is shutting down.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
