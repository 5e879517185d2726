//! `gpu-manager`: parse settings, log, run until SIGTERM/SIGINT.

use anyhow::Context;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let settings = gpu_manager::config::Settings::load()?;
    let cancel = device_plugin::cancel_on_signals().context("installing signal handlers")?;
    gpu_manager::daemon::run(settings, cancel).await
}
