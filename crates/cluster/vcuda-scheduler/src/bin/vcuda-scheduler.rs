//! `vcuda-scheduler`: the kube-scheduler extender (docs/scheduler.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use vcuda_scheduler::access;
use vcuda_scheduler::http::{Server, router};
use vcuda_scheduler::kube_api::{Caches, KubeBind};
use vcuda_scheduler::policy::Policy;

/// A kube-scheduler HTTP extender placing vcuda's device-plugin resources
/// per GPU.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Where kube-scheduler reaches the extender: loopback (a sidecar
    /// beside kube-scheduler), or any address with --tls-cert, --tls-key
    /// and --client-ca.
    #[arg(long, env = "VCUDA_SCHEDULER_LISTEN", default_value = "127.0.0.1:8888")]
    listen: SocketAddr,
    /// PEM certificate chain the extender serves (mTLS).
    #[arg(long, env = "VCUDA_SCHEDULER_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "VCUDA_SCHEDULER_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// PEM CA that kube-scheduler's client certificate must chain to.
    #[arg(long, env = "VCUDA_SCHEDULER_CLIENT_CA")]
    client_ca: Option<PathBuf>,
    /// A plain listener serving only GET /healthz, for the kubelet's probes.
    #[arg(long, env = "VCUDA_SCHEDULER_HEALTH_LISTEN")]
    health_listen: Option<SocketAddr>,
    /// kubeconfig [default: in-cluster, or $KUBECONFIG].
    #[arg(long, env = "VCUDA_SCHEDULER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The cluster's default policy (binpack or spread); a pod's
    /// `tencent.com/vcuda-policy` annotation overrides it.
    #[arg(long, env = "VCUDA_SCHEDULER_POLICY", default_value = "binpack")]
    policy: Policy,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let a = Args::parse();
    let tls = match access::files(a.tls_cert.clone(), a.tls_key.clone(), a.client_ca.clone())? {
        Some(f) => Some(tls_listener::server_config(&f)?),
        None => {
            access::check_plain(a.listen)?;
            None
        }
    };
    let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
    let client = daemon_kit::apiserver::client(a.kubeconfig.as_deref()).await?;
    let server = Arc::new(Server {
        source: Arc::new(Caches::start(client.clone(), cancel.clone())),
        binder: Arc::new(KubeBind { client }),
        policy: a.policy,
    });
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on --listen {}", a.listen))?;
    tracing::info!(addr = %listener.local_addr()?, policy = ?a.policy, mtls = tls.is_some(), "vcuda-scheduler serving");
    if let Some(h) = a.health_listen {
        let l = tokio::net::TcpListener::bind(h)
            .await
            .with_context(|| format!("listening on --health-listen {h}"))?;
        tracing::info!(health = %l.local_addr()?, "probes served");
        let (r, stop) = (
            vcuda_scheduler::http::health_router(server.clone()),
            cancel.clone(),
        );
        tokio::spawn(async move {
            let _ = axum::serve(l, r)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
    }
    let stop = cancel.clone();
    match tls {
        Some(cfg) => {
            let l = tls_listener::TlsListener::start(listener, cfg, cancel.clone())?;
            axum::serve(l, router(server))
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        }
        None => {
            axum::serve(listener, router(server))
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        }
    }
    .context("serving")?;
    Ok(())
}
