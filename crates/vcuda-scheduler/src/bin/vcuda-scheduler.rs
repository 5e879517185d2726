//! `vcuda-scheduler`: the kube-scheduler extender (docs/scheduler.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use vcuda_scheduler::http::{Server, router};
use vcuda_scheduler::kube_api::{Caches, KubeBind};
use vcuda_scheduler::policy::Policy;

/// A kube-scheduler HTTP extender placing vcuda's device-plugin resources
/// per GPU.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Where kube-scheduler reaches the extender.
    #[arg(long, env = "VCUDA_SCHEDULER_LISTEN", default_value = "0.0.0.0:8888")]
    listen: SocketAddr,
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
    node_agent::process::init_logging();
    let a = Args::parse();
    let cancel = node_agent::process::cancel_on_signals().context("installing signal handlers")?;
    let client = node_agent::apiserver::client(a.kubeconfig.as_deref()).await?;
    let server = Arc::new(Server {
        source: Arc::new(Caches::start(client.clone(), cancel.clone())),
        binder: Arc::new(KubeBind { client }),
        policy: a.policy,
    });
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on --listen {}", a.listen))?;
    tracing::info!(addr = %listener.local_addr()?, policy = ?a.policy, "vcuda-scheduler serving");
    axum::serve(listener, router(server))
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
        .context("serving")?;
    Ok(())
}
