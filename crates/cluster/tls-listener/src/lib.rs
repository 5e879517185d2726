//! A TLS listener for axum: handshakes run off the accept path, at most
//! [`MAX_HANDSHAKES`] at once and [`HANDSHAKE_TIMEOUT`] each, so callers
//! that never finish one (or a flood of them) cannot hold up the ones that
//! do. The server certificate is read again when its files change (a
//! Secret volume rotated by cert-manager or by the webhook's own CA), and
//! a client CA, when given, makes client certificates required (mTLS).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
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
/// certificates must chain to (none: no client certificate asked for).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
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

/// A server configuration serving `f`'s certificate (read again when its
/// files change) and, with a client CA, requiring a client certificate
/// chaining to it.
pub fn server_config(f: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = Arc::new(Reloading::new(f, provider.clone())?);
    refresh_in_background(Arc::downgrade(&resolver));
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &f.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs("--client-ca", ca)? {
                roots.add(c).map_err(|e| TlsError::File {
                    what: "--client-ca",
                    path: ca.clone(),
                    problem: e.to_string(),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    Ok(Arc::new(builder.with_cert_resolver(resolver)))
}

/// The certified key of `cert` and `key`.
fn load(
    cert: &Path,
    key: &Path,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = certs("--tls-cert", cert)?;
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
        what: "--tls-key",
        path: key.to_path_buf(),
        problem: e.to_string(),
    })?;
    let ck = CertifiedKey::from_der(chain, der, provider)
        .map_err(|e| TlsError::Config(format!("--tls-cert with --tls-key: {e}")))?;
    Ok(Arc::new(ck))
}

fn modified(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The serving certificate, read again (at most once a second) when the
/// files' modification times change. A rotation caught half-written (a
/// new certificate, the old key) keeps the previous pair until both
/// read as a pair.
#[derive(Debug)]
struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<rustls::crypto::CryptoProvider>,
    current: RwLock<Current>,
}

#[derive(Debug)]
struct Current {
    key: Arc<CertifiedKey>,
    stamps: (Option<SystemTime>, Option<SystemTime>),
    checked: Instant,
}

impl Reloading {
    fn new(f: &TlsFiles, provider: Arc<rustls::crypto::CryptoProvider>) -> Result<Self, TlsError> {
        let key = load(&f.cert, &f.key, &provider)?;
        Ok(Reloading {
            current: RwLock::new(Current {
                key,
                stamps: (modified(&f.cert), modified(&f.key)),
                checked: Instant::now(),
            }),
            cert: f.cert.clone(),
            key: f.key.clone(),
            provider,
        })
    }

    fn refresh(&self) {
        let mut cur = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if cur.checked.elapsed() < RELOAD_CHECK {
            return;
        }
        cur.checked = Instant::now();
        let stamps = (modified(&self.cert), modified(&self.key));
        if stamps == cur.stamps {
            return;
        }
        match load(&self.cert, &self.key, &self.provider) {
            Ok(k) => {
                tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                (cur.key, cur.stamps) = (k, stamps);
            }
            Err(e) => {
                tracing::warn!(error = %e, "serving certificate changed but does not load; keeping the previous one")
            }
        }
    }
}

/// Reads the files again every [`RELOAD_CHECK`] whether or not a client
/// connects: read only at handshakes, a webhook whose API server kept its
/// connections open loaded none of two rotations in 14 s, and the next
/// handshake, catching a third half-written, kept the first certificate,
/// expired by then (k8s_node, phase 1c, under load).
fn refresh_in_background(r: std::sync::Weak<Reloading>) {
    let _ = std::thread::Builder::new()
        .name("tls-reload".into())
        .spawn(move || {
            while let Some(r) = r.upgrade() {
                r.refresh();
                drop(r);
                std::thread::sleep(RELOAD_CHECK);
            }
        });
}

/// How often the certificate files' times are looked at.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

impl rustls::server::ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.refresh();
        Some(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .key
                .clone(),
        )
    }
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

#[cfg(test)]
mod tests;
