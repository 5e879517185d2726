//! `gpu-manager`: parse settings, log, run until SIGTERM/SIGINT. It
//! supervises itself ([`gpu_manager::lifecycle::supervise`]): the process started
//! owns the kubelet's plugin sockets and connections and runs the manager
//! as its child, again when it dies; `--no-supervisor` runs the manager
//! alone.
//! `gpu-manager uninstall [flags]`: remove what managers left on this node
//! once no share uses it (`gpu_manager::lifecycle::uninstall`), then wait for SIGTERM
//! (it runs as a DaemonSet, deploy/uninstall).

use anyhow::Context;
use gpu_manager::lifecycle::supervise;

fn main() -> anyhow::Result<()> {
    daemon_kit::init_logging();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let uninstall = args.get(1).is_some_and(|a| a == "uninstall");
    if uninstall {
        args.remove(1);
    }
    let alone = args.iter().any(|a| a == "--no-supervisor");
    args.retain(|a| a != "--no-supervisor");
    let settings = gpu_manager::config::Settings::load_from(args)?;
    let sup = supervise::inherited()?;
    if !uninstall && !alone && sup.is_none() {
        std::process::exit(supervise::supervise(&settings)?);
    }
    tokio::runtime::Runtime::new()
        .context("starting the tokio runtime")?
        .block_on(async {
            let cancel = daemon_kit::cancel_on_signals().context("installing signal handlers")?;
            if !uninstall {
                return gpu_manager::lifecycle::daemon::run(settings, cancel, sup).await;
            }
            let retry = std::time::Duration::from_secs(10);
            if let Some(done) = gpu_manager::lifecycle::uninstall::run(&settings, retry, &cancel).await? {
                tracing::info!(
                    "{done}; delete this DaemonSet (helm uninstall, or kubectl delete -k deploy/overlays/uninstall)"
                );
            }
            cancel.cancelled().await;
            Ok(())
        })
}
