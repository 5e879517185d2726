//! `vcuda-dra-driver`: vcuda as a DRA driver on one node (instead of the
//! manager's device plugins). See docs/dra.md.

use clap::Parser;
use dra_driver::cli::{Args, resolve};
use dra_driver::daemon::run;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Colours only on a terminal: `kubectl logs` shows no escape codes.
    device_plugin::init_logging();
    let settings = resolve(Args::parse())?;
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
    run(settings, cancel, None).await
}
