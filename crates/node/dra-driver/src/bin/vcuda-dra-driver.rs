//! `vcuda-dra-driver`: vcuda as a DRA driver on one node (instead of the
//! manager's device plugins). See docs/dra.md. It supervises itself
//! ([`dra_driver::supervise`]): the process started binds the kubelet's
//! sockets and runs the driver as its child on them, again when it dies;
//! `--no-supervisor` runs the driver alone.
//! `vcuda-dra-driver uninstall [flags]`: remove what drivers left on this
//! node once nothing uses it ([`dra_driver::uninstall`]), then wait for
//! SIGTERM (it runs as a DaemonSet, deploy/uninstall).
//! `vcuda-dra-driver hold-sockets PATH`: the pod's socket holder, which
//! keeps the kubelet's sockets open across a restart of the driver's
//! container ([`dra_driver::holder`], `--socket-holder PATH`).

use anyhow::Context;
use clap::Parser;
use dra_driver::cli::{Args, resolve};
use dra_driver::daemon::run;
use dra_driver::supervise;

fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "hold-sockets") {
        let Some(path) = argv.get(2) else {
            anyhow::bail!("usage: vcuda-dra-driver hold-sockets <socket path>");
        };
        return dra_driver::holder::serve(std::path::Path::new(path));
    }
    let uninstall = argv.get(1).is_some_and(|a| a == "uninstall");
    if uninstall {
        argv.remove(1);
    }
    let args = Args::parse_from(argv);
    let supervised =
        !uninstall && !args.no_supervisor && std::env::var_os(supervise::LISTEN_FDS_ENV).is_none();
    let holder = args.socket_holder.clone();
    let settings = resolve(args)?;
    if supervised {
        let code = supervise::supervise(
            &settings.plugins_dir,
            &settings.registry_dir,
            holder.as_deref(),
        )?;
        std::process::exit(code);
    }
    tokio::runtime::Runtime::new()
        .context("starting the tokio runtime")?
        .block_on(async {
            let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
            if !uninstall {
                return run(settings, cancel, None).await;
            }
            let retry = std::time::Duration::from_secs(10);
            if let Some(done) = dra_driver::uninstall::run(&settings, retry, &cancel).await? {
                tracing::info!(
                    "{done}; delete this DaemonSet (helm uninstall, or kubectl delete -k deploy/overlays/uninstall)"
                );
            }
            cancel.cancelled().await;
            Ok(())
        })
}
