//! `vcuda-webhook`: vcuda's admission webhook (docs/webhook.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use vcuda_webhook::http::{Webhook, health_router, router};
use vcuda_webhook::kube_api::{KubeTemplates, NodeCache};
use vcuda_webhook::mutate::Settings;
use vcuda_webhook::validate::Trusted;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    /// Pods keep their vcuda limits (the device plugins serve them).
    DevicePlugin,
    /// vcuda limits become ResourceClaims (the DRA driver serves them).
    Dra,
}

/// vcuda's admission webhook: validates vcuda requests and placement
/// annotations; sets the extender's scheduler name; on DRA clusters
/// rewrites vcuda limits into ResourceClaims.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// HTTPS address the API server calls.
    #[arg(long, env = "VCUDA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// PEM certificate chain served (read again when the file changes).
    #[arg(long, env = "VCUDA_WEBHOOK_TLS_CERT")]
    tls_cert: PathBuf,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "VCUDA_WEBHOOK_TLS_KEY")]
    tls_key: PathBuf,
    /// A plain listener serving only GET /healthz, for the kubelet's probes.
    #[arg(long, env = "VCUDA_WEBHOOK_HEALTH_LISTEN")]
    health_listen: Option<SocketAddr>,
    #[arg(
        long,
        value_enum,
        env = "VCUDA_WEBHOOK_MODE",
        default_value = "device-plugin"
    )]
    mode: Mode,
    /// Set this scheduler name on vcuda pods that use the default one.
    #[arg(long, env = "VCUDA_WEBHOOK_SCHEDULER_NAME")]
    scheduler_name: Option<String>,
    /// Users that may write placement annotations (repeat; a trailing `*`
    /// is a prefix): the extender's and the manager's service accounts.
    #[arg(
        long = "trusted-user",
        env = "VCUDA_WEBHOOK_TRUSTED_USERS",
        value_delimiter = ','
    )]
    trusted_users: Vec<String>,
    /// kubeconfig [default: in-cluster, or $KUBECONFIG].
    #[arg(long, env = "VCUDA_WEBHOOK_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let a = Args::parse();
    let tls = tls_listener::server_config(&tls_listener::TlsFiles {
        cert: a.tls_cert.clone(),
        key: a.tls_key.clone(),
        client_ca: None,
    })?;
    let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
    let client = daemon_kit::apiserver::client(a.kubeconfig.as_deref()).await?;
    let hook = Arc::new(Webhook {
        nodes: Arc::new(NodeCache::start(client.clone(), cancel.clone())),
        templates: Arc::new(KubeTemplates { client }),
        settings: Settings {
            scheduler_name: a.scheduler_name.clone(),
            dra: matches!(a.mode, Mode::Dra),
        },
        trusted: Trusted(a.trusted_users.clone()),
    });
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on --listen {}", a.listen))?;
    tracing::info!(addr = %listener.local_addr()?, mode = ?a.mode, scheduler_name = ?a.scheduler_name, trusted = ?a.trusted_users, "vcuda-webhook serving");
    if let Some(h) = a.health_listen {
        let l = tokio::net::TcpListener::bind(h)
            .await
            .with_context(|| format!("listening on --health-listen {h}"))?;
        let (r, stop) = (health_router(hook.clone()), cancel.clone());
        tokio::spawn(async move {
            let _ = axum::serve(l, r)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
    }
    let l = tls_listener::TlsListener::start(listener, tls, cancel.clone())?;
    let stop = cancel.clone();
    axum::serve(l, router(hook))
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
        .context("serving")?;
    Ok(())
}
