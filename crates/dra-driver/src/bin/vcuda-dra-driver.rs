//! `vcuda-dra-driver`: vcuda as a DRA driver on one node (instead of the
//! manager's device plugins). See docs/dra.md.

use anyhow::Context;
use clap::Parser;
use dra_driver::cli::{Args, resolve};
use dra_driver::daemon::run;
use node_agent::process;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    process::init_logging();
    let settings = resolve(Args::parse())?;
    let cancel = process::cancel_on_signals().context("installing signal handlers")?;
    run(settings, cancel, None).await
}
