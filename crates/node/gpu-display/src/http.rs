//! HTTP on the query port: read-only GET endpoints, small bounded requests;
//! and, on listeners of their own, the probes alone ([`Endpoints::Probes`])
//! and the metrics alone ([`Endpoints::Metrics`]), so the query port, which
//! names every tenant's pods and host PIDs, can stay node-local.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{Error, Shared};

/// Request line + headers; hyper answers 431/414 past this. Scrapers send
/// a few hundred bytes.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// No endpoint takes a body.
pub(crate) const MAX_BODY: u64 = 4 * 1024;
/// Longest path+query accepted.
pub(crate) const MAX_URI: usize = 2 * 1024;
/// Open connections at once; more wait in the accept queue.
const MAX_CONNECTIONS: usize = 256;
/// Open connections from one address: the query port (or the metrics
/// port) may be on the pod network, and one pod holding every slot would
/// starve the kubelet's probes (a liveness kill is the one restart the
/// supervisor cannot bridge) and Prometheus. Past this the connection is
/// closed at once.
pub(crate) const MAX_PER_PEER: usize = 16;

/// Connections open per peer address.
#[derive(Default)]
struct Peers(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One peer's connection, counted while it lives.
struct PeerSlot(Arc<Peers>, std::net::IpAddr);

impl Peers {
    fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<PeerSlot> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= MAX_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerSlot(self.clone(), ip))
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// What a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoints {
    /// The query port: every endpoint.
    All,
    /// The probe listener: `/healthz` and `/readyz` only, so a flood of the
    /// query port (many pods, each within its per-address cap) cannot
    /// starve the kubelet's probes, and it tells nobody about tenants.
    Probes,
    /// The metrics listener: `/metrics` (alias `/metric`) alone, for
    /// Prometheus on the pod network while the query port stays local.
    Metrics,
}

impl Endpoints {
    fn serves(self, path: &str) -> bool {
        match self {
            Endpoints::All => matches!(
                path,
                "/graph" | "/usage" | "/version" | "/metrics" | "/metric" | "/healthz" | "/readyz"
            ),
            Endpoints::Probes => matches!(path, "/healthz" | "/readyz"),
            Endpoints::Metrics => matches!(path, "/metrics" | "/metric"),
        }
    }

    fn try_these(self) -> &'static str {
        match self {
            Endpoints::All => "/graph, /usage, /version, /metrics, /healthz, /readyz",
            Endpoints::Probes => {
                "/healthz, /readyz (this is the probe port; the rest is on the query port)"
            }
            Endpoints::Metrics => {
                "/metrics (this is the metrics port; the rest is on the query port)"
            }
        }
    }
}

type Resp = Response<Full<Bytes>>;

fn text(status: StatusCode, ctype: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
    r
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn route(shared: &Shared, endpoints: Endpoints, req: &Request<Incoming>) -> Resp {
    if req.uri().path_and_query().map_or(0, |p| p.as_str().len()) > MAX_URI {
        return text(StatusCode::URI_TOO_LONG, PLAIN, "URI too long\n");
    }
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY) {
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            PLAIN,
            "request body too large\n",
        );
    }
    let path = req.uri().path();
    if !endpoints.serves(path) {
        return text(
            StatusCode::NOT_FOUND,
            PLAIN,
            format!("no such endpoint {path}; try {}\n", endpoints.try_these()),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, PLAIN, "only GET and HEAD\n");
        r.headers_mut()
            .insert("allow", HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let src = &shared.source;
    match path {
        "/graph" => text(StatusCode::OK, PLAIN, shared.graph()),
        "/usage" => {
            let u = crate::usage::usage_json(&src.containers(), &shared.snapshot.load());
            let body = serde_json::to_vec_pretty(&u).unwrap_or_default();
            text(StatusCode::OK, "application/json", body)
        }
        "/version" => text(StatusCode::OK, PLAIN, src.version() + "\n"),
        "/metrics" | "/metric" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.render_metrics(),
        ),
        "/healthz" => match src.health() {
            Ok(()) => text(StatusCode::OK, PLAIN, "ok\n"),
            Err(e) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                PLAIN,
                format!("unhealthy: {e}\n"),
            ),
        },
        "/readyz" if shared.ready.load(Ordering::Acquire) => text(StatusCode::OK, PLAIN, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, PLAIN, "not ready\n"),
        _ => unreachable!("checked above"),
    }
}

async fn handle(
    shared: Arc<Shared>,
    endpoints: Endpoints,
    req: Request<Incoming>,
) -> Result<Resp, Infallible> {
    let head = req.method() == Method::HEAD;
    let mut resp = route(&shared, endpoints, &req);
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE || resp.status() == StatusCode::URI_TOO_LONG {
        // Do not read what the client still wants to send.
        resp.headers_mut()
            .insert("connection", HeaderValue::from_static("close"));
    }
    if head {
        *resp.body_mut() = Full::new(Bytes::new());
    }
    Ok(resp)
}

pub(crate) async fn serve(
    shared: Arc<Shared>,
    addr: SocketAddr,
    endpoints: Endpoints,
    cancel: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), Error> {
    let bind_error = |source| match endpoints {
        Endpoints::All => Error::Bind { addr, source },
        Endpoints::Probes => Error::BindProbes { addr, source },
        Endpoints::Metrics => Error::BindMetrics { addr, source },
    };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let peers = Arc::new(Peers::default());
    let join = tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = cancel.cancelled() => break,
                p = limit.clone().acquire_owned() => p.expect("never closed"),
            };
            let (stream, peer) = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(v) => v,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accepting an HTTP connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = peers.enter(peer.ip()) else {
                tracing::debug!(%peer, max = MAX_PER_PEER, "HTTP connection refused: too many from this address");
                continue;
            };
            let shared = shared.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let _permit = (permit, slot);
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .max_buf_size(MAX_HEAD)
                    .serve_connection(
                        TokioIo::new(stream),
                        service_fn(move |req| handle(shared.clone(), endpoints, req)),
                    );
                tokio::pin!(conn);
                tokio::select! {
                    r = conn.as_mut() => if let Err(e) = r {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    },
                    _ = cancel.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
                    }
                }
            });
        }
    });
    Ok((bound, join))
}
