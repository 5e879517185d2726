//! `gpu-manager`: parse settings, log, run until SIGTERM/SIGINT.

use anyhow::Context;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    device_plugin::init_logging();
    let settings = gpu_manager::config::Settings::load()?;
    let cancel = device_plugin::cancel_on_signals().context("installing signal handlers")?;
    gpu_manager::daemon::run(settings, cancel).await
}
