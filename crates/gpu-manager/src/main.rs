//! `gpu-manager`: parse settings, log, run until SIGTERM/SIGINT. It
//! supervises itself ([`gpu_manager::supervise`]): the process started
//! runs the manager as its child, again when it dies, and keeps the
//! kubelet's plugin sockets and connections meanwhile, or with
//! `--plugin-holder PATH` has the holder there keep them; `--no-supervisor`
//! runs the manager alone.
//! `gpu-manager hold-plugins --plugin-holder PATH [flags]`: that holder, a
//! container of its own beside the manager's ([`gpu_manager::holder`]).
//! `gpu-manager uninstall [flags]`: remove what managers left on this node
//! once no share uses it (`gpu_manager::uninstall`), then wait for SIGTERM
//! (it runs as a DaemonSet, deploy/uninstall).

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Context;
use gpu_manager::supervise;
use node_agent::process;

const HOLDER_FLAG: &str = "--plugin-holder";

/// Takes `--plugin-holder PATH` or `--plugin-holder=PATH` out of `args`.
fn take_holder(args: &mut Vec<OsString>) -> anyhow::Result<Option<PathBuf>> {
    let Some(i) = args.iter().position(|a| {
        a == HOLDER_FLAG || a.to_string_lossy().starts_with(&format!("{HOLDER_FLAG}="))
    }) else {
        return Ok(None);
    };
    let flag = args.remove(i).to_string_lossy().into_owned();
    let path = match flag.split_once('=') {
        Some((_, p)) => p.to_string(),
        None if i < args.len() => args.remove(i).to_string_lossy().into_owned(),
        None => anyhow::bail!("{HOLDER_FLAG} needs a path (the plugin holder's socket)"),
    };
    anyhow::ensure!(
        !path.is_empty(),
        "{HOLDER_FLAG} needs a path (the plugin holder's socket)"
    );
    Ok(Some(PathBuf::from(path)))
}

fn main() -> anyhow::Result<()> {
    process::init_logging();
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let sub = args
        .get(1)
        .map(|a| a.to_string_lossy().into_owned())
        .filter(|a| a == "uninstall" || a == "hold-plugins");
    if sub.is_some() {
        args.remove(1);
    }
    let alone = args.iter().any(|a| a == "--no-supervisor");
    args.retain(|a| a != "--no-supervisor");
    let holder = take_holder(&mut args)?;
    let settings = gpu_manager::config::Settings::load_from(args)?;
    if sub.as_deref() == Some("hold-plugins") {
        let path = holder.with_context(|| format!("hold-plugins needs {HOLDER_FLAG} PATH"))?;
        std::process::exit(gpu_manager::holder::hold(&settings, &path)?);
    }
    let uninstall = sub.is_some();
    let sup = supervise::inherited()?;
    if !uninstall && !alone && sup.is_none() {
        std::process::exit(supervise::supervise(&settings, holder)?);
    }
    tokio::runtime::Runtime::new()
        .context("starting the tokio runtime")?
        .block_on(async {
            let cancel = process::cancel_on_signals().context("installing signal handlers")?;
            if !uninstall {
                return gpu_manager::daemon::run(settings, cancel, sup).await;
            }
            let retry = std::time::Duration::from_secs(10);
            if let Some(done) = gpu_manager::uninstall::run(&settings, retry, &cancel).await? {
                tracing::info!(
                    "{done}; delete this DaemonSet (kubectl delete -k deploy/overlays/uninstall)"
                );
            }
            cancel.cancelled().await;
            Ok(())
        })
}
