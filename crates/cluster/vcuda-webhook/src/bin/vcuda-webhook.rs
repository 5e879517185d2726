//! `vcuda-webhook`: vcuda's admission webhook (docs/webhook.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use vcuda_webhook::certs::{self, Policy};
use vcuda_webhook::http::{Webhook, health_router, router};
use vcuda_webhook::kube_api::{
    ConfigRef, KubeBundleTargets, KubeCertStore, KubeTemplates, NodeCache,
};
use vcuda_webhook::mutate::Settings;
use vcuda_webhook::rotate::{RotateError, Rotator};
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
    /// PEM certificate chain served (read again when the file changes);
    /// with --self-managed, where the webhook writes its own.
    #[arg(long, env = "VCUDA_WEBHOOK_TLS_CERT")]
    tls_cert: PathBuf,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "VCUDA_WEBHOOK_TLS_KEY")]
    tls_key: PathBuf,
    /// NAMESPACE/SECRET: the webhook makes and renews its own CA and
    /// serving certificate, kept in this Secret (shared by replicas), and
    /// patches the CA into every --ca-bundle-of configuration.
    #[arg(long, env = "VCUDA_WEBHOOK_SELF_MANAGED")]
    self_managed: Option<String>,
    /// validating/NAME or mutating/NAME: a configuration whose webhooks'
    /// caBundle --self-managed keeps (repeat).
    #[arg(long, env = "VCUDA_WEBHOOK_CA_BUNDLE_OF", value_delimiter = ',')]
    ca_bundle_of: Vec<ConfigRef>,
    /// DNS names and IP addresses of the self-managed certificate (repeat;
    /// the Service's names).
    #[arg(long, env = "VCUDA_WEBHOOK_CERT_NAMES", value_delimiter = ',')]
    cert_name: Vec<String>,
    /// Life of the self-managed CA (s, m, h, d); the next one is staged
    /// with a third left.
    #[arg(long, env = "VCUDA_WEBHOOK_CA_VALIDITY", default_value = "365d", value_parser = certs::parse_duration)]
    ca_validity: Duration,
    /// Life of the serving certificate, at most half the CA's; renewed
    /// with a third left.
    #[arg(long, env = "VCUDA_WEBHOOK_CERT_VALIDITY", default_value = "90d", value_parser = certs::parse_duration)]
    cert_validity: Duration,
    /// How long a staged CA is in the bundle before it signs: time for
    /// every API server to see the patched configurations.
    #[arg(long, env = "VCUDA_WEBHOOK_CA_OVERLAP", default_value = "60s", value_parser = certs::parse_duration)]
    ca_overlap: Duration,
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
    /// The device plugins' MIG resources (`<prefix><profile>`), rewritten
    /// into MIG claims in DRA mode; the manager's --mig-resource-prefix.
    #[arg(long, env = "VCUDA_WEBHOOK_MIG_RESOURCE_PREFIX", default_value = gpu_pods::MIG_RESOURCE_PREFIX)]
    mig_resource_prefix: String,
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
    let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
    let client = daemon_kit::apiserver::client(a.kubeconfig.as_deref()).await?;
    if let Some(secret) = &a.self_managed {
        self_managed(&a, secret, client.clone(), cancel.clone()).await?;
    }
    let tls = tls_listener::server_config(&tls_listener::TlsFiles {
        cert: a.tls_cert.clone(),
        key: a.tls_key.clone(),
        client_ca: None,
    })?;
    let hook = Arc::new(Webhook {
        nodes: Arc::new(NodeCache::start(client.clone(), cancel.clone())),
        templates: Arc::new(KubeTemplates { client }),
        settings: Settings {
            scheduler_name: a.scheduler_name.clone(),
            dra: matches!(a.mode, Mode::Dra),
            mig_prefix: a.mig_resource_prefix.clone(),
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

/// --self-managed: the certificates settled once (so there is something to
/// serve), then kept in the background.
async fn self_managed(
    a: &Args,
    secret: &str,
    client: kube::Client,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let (ns, name) = secret
        .split_once('/')
        .filter(|(n, s)| !n.is_empty() && !s.is_empty())
        .with_context(|| format!("--self-managed '{secret}' is not NAMESPACE/SECRET"))?;
    anyhow::ensure!(
        !a.cert_name.is_empty(),
        "--self-managed needs --cert-name: the names the API server calls the webhook by"
    );
    let policy = Policy::new(a.ca_validity, a.cert_validity, a.ca_overlap)?;
    let rotator = Rotator {
        store: Box::new(KubeCertStore {
            api: Api::<Secret>::namespaced(client.clone(), ns),
            namespace: ns.into(),
            name: name.into(),
        }),
        targets: Box::new(KubeBundleTargets {
            client,
            configs: a.ca_bundle_of.clone(),
        }),
        policy,
        names: a.cert_name.clone(),
        cert_file: a.tls_cert.clone(),
        key_file: a.tls_key.clone(),
    };
    match rotator.sync(vcuda_webhook::rotate::unix_now()).await {
        Ok(_) => {}
        // The configurations may come after the webhook (one chart applies
        // both): the background passes patch them.
        Err(e @ RotateError::Target { .. }) => tracing::warn!(error = %e, "caBundle not set yet"),
        Err(e) => return Err(e).context("--self-managed: the first certificates"),
    }
    tokio::spawn(rotator.run(RECHECK, cancel));
    Ok(())
}

/// How often the Secret and configurations are compared with the files
/// even when nothing is due (another replica rotated, or someone edited).
const RECHECK: Duration = Duration::from_secs(30);
