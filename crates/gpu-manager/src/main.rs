//! `gpu-manager`: parse settings, log, run until SIGTERM/SIGINT.

use anyhow::Context;
use node_agent::process;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    process::init_logging();
    let settings = gpu_manager::config::Settings::load()?;
    let cancel = process::cancel_on_signals().context("installing signal handlers")?;
    gpu_manager::daemon::run(settings, cancel).await
}
