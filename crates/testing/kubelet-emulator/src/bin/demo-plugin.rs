//! Serves [`kubelet_emulator::demo::DemoPlugin`] on `<dir>/<socket>` and keeps
//! trying to register with `<dir>/kubelet.sock`, until SIGTERM/SIGINT. Used
//! by the wire-compatibility tests and for demos.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use device_plugin::PluginRuntime;
use kubelet_emulator::demo::DemoPlugin;

#[derive(Parser)]
#[command(about = "A demo device plugin with N fake devices")]
struct Args {
    /// Device-plugin dir to serve in.
    #[arg(long, default_value = vcuda_api::deviceplugin::v1beta1::DEVICE_PLUGIN_PATH)]
    device_plugin_path: PathBuf,
    /// Socket file name inside the dir.
    #[arg(long, default_value = "demo.sock")]
    socket: String,
    /// Extended resource name.
    #[arg(long, default_value = "example.com/demo")]
    resource: String,
    /// Number of devices, named <prefix>-0 ..
    #[arg(long, default_value_t = 4)]
    devices: usize,
    #[arg(long, default_value = "dev")]
    prefix: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let args = Args::parse();
    let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
    let plugin = Arc::new(DemoPlugin::new(&args.prefix, args.devices));
    let handle = PluginRuntime::new(&args.device_plugin_path)
        .plugin(&args.resource, &args.socket, plugin)
        .start(cancel)
        .context("starting demo plugin")?;
    handle.wait().await.context("demo plugin")?;
    Ok(())
}
