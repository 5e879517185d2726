//! Who may call the extender. `/bind` places pods and `/filter` answers
//! for every GPU pod of the cluster, so kube-scheduler must be the only
//! caller: either the extender listens on loopback beside kube-scheduler
//! (a sidecar in its pod), or it requires a client certificate signed by
//! the CA kube-scheduler's extender `tlsConfig` presents (mTLS, served by
//! `tls_listener`). A plain listener reachable from other hosts is
//! refused at start.

use std::net::SocketAddr;
use std::path::PathBuf;

use tls_listener::TlsFiles;

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
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
) -> Result<Option<TlsFiles>, AccessError> {
    match (cert, key, client_ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(client_ca)) => Ok(Some(TlsFiles {
            cert,
            key,
            client_ca: Some(client_ca),
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
            Err(AccessError::Partial(missing.join(", ")))
        }
    }
}

/// Refuses a plain listener on anything but loopback.
pub fn check_plain(listen: SocketAddr) -> Result<(), AccessError> {
    if listen.ip().is_loopback() {
        Ok(())
    } else {
        Err(AccessError::PlainOutsideLoopback(listen))
    }
}
