//! Runs the kubelet emulator until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kubelet_emulator::KubeletEmulator;

#[derive(Parser)]
#[command(
    about = "Emulated kubelet device manager: registration, ListAndWatch, checkpoint, pod-resources"
)]
struct Args {
    /// Device-plugin dir: kubelet.sock, plugin sockets and the checkpoint live here.
    #[arg(long, default_value = vcuda_api::deviceplugin::v1beta1::DEVICE_PLUGIN_PATH)]
    device_plugin_path: PathBuf,
    /// Socket of the pod-resources API.
    #[arg(long, default_value = vcuda_api::podresources::v1::DEFAULT_SOCKET)]
    pod_resources_socket: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let args = Args::parse();
    let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
    let emu = KubeletEmulator::start(&args.device_plugin_path, &args.pod_resources_socket)
        .await
        .with_context(|| {
            format!(
                "starting kubelet emulator in {}",
                args.device_plugin_path.display()
            )
        })?;
    cancel.cancelled().await;
    emu.stop().await;
    Ok(())
}
