//! `vcuda-dra-driver`: vcuda as a DRA driver on one node (instead of the
//! manager's device plugins). See docs/dra.md. It supervises itself
//! ([`dra_driver::supervise`]): the process started binds the kubelet's
//! sockets and runs the driver as its child on them, again when it dies;
//! `--no-supervisor` runs the driver alone.

use anyhow::Context;
use clap::Parser;
use dra_driver::cli::{Args, resolve};
use dra_driver::daemon::run;
use dra_driver::supervise;
use node_agent::process;

fn main() -> anyhow::Result<()> {
    process::init_logging();
    let args = Args::parse();
    let supervised = !args.no_supervisor && std::env::var_os(supervise::LISTEN_FDS_ENV).is_none();
    let settings = resolve(args)?;
    if supervised {
        let code = supervise::supervise(&settings.plugins_dir, &settings.registry_dir)?;
        std::process::exit(code);
    }
    tokio::runtime::Runtime::new()
        .context("starting the tokio runtime")?
        .block_on(async {
            let cancel = process::cancel_on_signals().context("installing signal handlers")?;
            run(settings, cancel, None).await
        })
}
