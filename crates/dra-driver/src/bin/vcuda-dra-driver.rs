//! `vcuda-dra-driver`: vcuda as a DRA driver on one node (instead of the
//! manager's device plugins). See docs/dra.md.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use dra_driver::daemon::{Settings, run};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    version,
    about = "vcuda DRA driver (vcuda.tencent.com): ResourceSlices, NodePrepareResources, CDI"
)]
struct Args {
    /// This node's name (the ResourceSlice's node and pool).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The host's root as mounted in this container.
    #[arg(long, default_value = "/")]
    host_root: PathBuf,
    #[arg(long)]
    nvml_library: Option<PathBuf>,
    #[arg(long, default_value = "/etc/gpu-manager/volume.conf")]
    volume_config: PathBuf,
    /// libvcuda.so, mirrored as the shares' libcuda.so.1 / libnvidia-ml.so.1.
    #[arg(long)]
    interposer: Option<PathBuf>,
    #[arg(long, default_value = "/etc/gpu-manager/vdriver")]
    vdriver_dir: PathBuf,
    #[arg(long, default_value = "/etc/gpu-manager/vm")]
    vm_dir: PathBuf,
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    #[arg(long, default_value = "/var/lib/kubelet/plugins/vcuda.tencent.com")]
    state_dir: PathBuf,
    #[arg(long, default_value = dra_api::pluginregistration::PLUGINS_DIR)]
    plugins_dir: PathBuf,
    #[arg(long, default_value = dra_api::pluginregistration::REGISTRY_DIR)]
    registry_dir: PathBuf,
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Seconds without a critical Xid before a GPU is published again.
    #[arg(long, default_value_t = 300)]
    xid_quiet_period: u64,
    /// Xids that are the application's fault, not the GPU's.
    #[arg(long, value_delimiter = ',', default_value = "13,31,43,45,68,109")]
    ignored_xids: Vec<u64>,
    /// Seconds between republishing checks (a deleted slice comes back).
    #[arg(long, default_value_t = 60)]
    resync_period: u64,
    /// Device nodes every GPU container also gets.
    #[arg(long, value_delimiter = ',')]
    extra_devices: Vec<String>,
    /// The display service's gRPC socket (vcudactl); "" to serve none.
    #[arg(long, default_value = gpu_display::DEFAULT_SOCKET)]
    display_socket: PathBuf,
    /// The display service's HTTP address (/usage, /metrics).
    #[arg(long, default_value = "127.0.0.1:5678")]
    query_addr: std::net::SocketAddr,
    /// NVML sampling period of the display, in seconds.
    #[arg(long, default_value_t = 1)]
    sample_period: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        c.cancel();
    });
    run(
        Settings {
            node: a.node_name,
            host_root: a.host_root,
            nvml_library: a.nvml_library,
            volume_config: a.volume_config,
            interposer: a.interposer,
            vdriver_dir: a.vdriver_dir,
            vm_dir: a.vm_dir,
            cdi_dir: a.cdi_dir,
            state_dir: a.state_dir,
            plugins_dir: a.plugins_dir,
            registry_dir: a.registry_dir,
            kubeconfig: a.kubeconfig,
            xid_quiet_period: Duration::from_secs(a.xid_quiet_period),
            ignored_xids: a.ignored_xids,
            resync_period: Duration::from_secs(a.resync_period),
            extra_devices: a.extra_devices,
            display: (!a.display_socket.as_os_str().is_empty())
                .then_some((a.display_socket, a.query_addr)),
            sample_period: Duration::from_secs(a.sample_period.max(1)),
        },
        cancel,
        None,
    )
    .await
}
