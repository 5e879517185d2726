//! A kill -9 of the manager ended the kubelet's `ListAndWatch` streams:
//! the kubelet then marks vcuda-core and vcuda-memory unhealthy and refuses
//! every pod it admits before a new manager has registered
//! (`UnexpectedAdmissionError`, for good), and a call in flight was lost.
//! So `gpu-manager` runs as a small supervisor that owns what the kubelet
//! holds on to: the plugin sockets, their registration and the kubelet's
//! connections ([`device_plugin::RelayedPlugin`]). The manager runs as its
//! child, on connections the supervisor passes it ([`child_relay`]); when
//! the child dies the supervisor starts another at once, and the calls
//! made meanwhile wait for it (a call the child died under is sent to the
//! next one). The kubelet sees no stream end, no new registration, no
//! lost call.
//!
//! A child that exits before the kubelet ever registered the plugins (bad
//! settings, no GPU, DRA serving here) ends the supervisor with its status,
//! so the pod shows the error. SIGTERM/SIGINT go to the child; the
//! supervisor stops with it, leaving the kubelet's connections open when
//! the child had handed the node to a successor ([`crate::handover`]).
//! The child dies with the supervisor (`PR_SET_PDEATHSIG`).
//!
//! What the kubelet holds on to is a [`Link`]: the supervisor's own, or,
//! with `--plugin-holder PATH`, the one a container of its own keeps
//! beside this one ([`crate::holder`]), so that it outlives a kill of this
//! whole container too; each child then attaches there.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream as StdStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::link::Link;
use crate::served::FromSupervisor;

/// In the child: `<vcore inbox>,<vmemory inbox>,<control>` fds it inherited.
pub const FDS_ENV: &str = "VCUDA_MANAGER_SUPERVISOR_FDS";
/// In the child: the instance its plugin sockets are named for.
pub const INSTANCE_ENV: &str = "VCUDA_MANAGER_INSTANCE";

const CHILD_FDS: [RawFd; 3] = [3, 4, 5];
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A child that ran this long restarts after the first backoff again.
const STABLE: Duration = Duration::from_secs(60);

/// What the supervisor passed this process, if it runs under one. Takes
/// the fds: call once.
pub fn inherited() -> anyhow::Result<Option<FromSupervisor>> {
    let Ok(fds) = std::env::var(FDS_ENV) else {
        return Ok(None);
    };
    let instance = std::env::var(INSTANCE_ENV)
        .map_err(|_| anyhow::anyhow!("{FDS_ENV} is set but {INSTANCE_ENV} is not"))?;
    let parsed: Vec<RawFd> = fds.split(',').filter_map(|f| f.parse().ok()).collect();
    let [vcore, vmemory, control] = parsed[..] else {
        anyhow::bail!("{FDS_ENV}={fds:?}: expected three fds, \"<vcore>,<vmemory>,<control>\"");
    };
    for f in [vcore, vmemory, control] {
        // Not to this manager's own children: a control socket they kept
        // open would hide this manager's death from its link.
        // SAFETY: fcntl on fds this process owns.
        unsafe { libc::fcntl(f, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: the supervisor passed these fds to this process alone, open.
    let [vcore, vmemory, control] =
        [vcore, vmemory, control].map(|f| unsafe { StdStream::from_raw_fd(f) });
    Ok(Some(FromSupervisor {
        instance,
        inboxes: [vcore, vmemory],
        control,
    }))
}

/// Where the supervisor's children attach: a link of its own, or the
/// plugin holder of its pod ([`crate::holder`]).
enum Source {
    Own(Arc<Link>),
    Holder(PathBuf),
}

impl Source {
    /// A new child's instance and fds; whether the kubelet had registered.
    fn attach(&self) -> anyhow::Result<(String, [OwnedFd; 3], bool)> {
        match self {
            Source::Own(link) => Ok((link.instance.clone(), link.attach()?, link.served())),
            Source::Holder(path) => {
                // Waits for the holder to listen: blocking.
                let a = tokio::task::block_in_place(|| crate::holder::attach(path))?;
                Ok((a.instance, a.fds, a.served))
            }
        }
    }

    fn served(&self) -> bool {
        match self {
            Source::Own(link) => link.served(),
            Source::Holder(path) => tokio::task::block_in_place(|| crate::holder::served(path))
                .unwrap_or_else(|e| {
                    tracing::error!(error = %e, "the plugin holder");
                    false
                }),
        }
    }

    /// The supervisor's end (the holder, if any, stops on its own).
    async fn stop(&self, code: i32) -> i32 {
        match self {
            Source::Own(link) => link.stop(code).await,
            Source::Holder(_) => code,
        }
    }
}

/// Runs the manager (this executable, the same arguments) under
/// supervision until it stops; the exit code for the supervisor. With
/// `holder`, its children attach to the plugin holder there.
pub fn supervise(s: &Settings, holder: Option<PathBuf>) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(s, holder))
}

async fn run(s: &Settings, holder: Option<PathBuf>) -> anyhow::Result<i32> {
    let cancel = device_plugin::cancel_on_signals()?;
    let source = match holder {
        Some(path) => {
            tracing::info!(holder = %path.display(), "supervising the manager; the plugin holder of this pod keeps the kubelet's sockets and connections");
            Source::Holder(path)
        }
        None => Source::Own(Link::new(&s.device_plugin_path)),
    };
    let mut backoff = FIRST_BACKOFF;
    let mut served = false;
    loop {
        let started = Instant::now();
        let (instance, fds, was_served) = source.attach()?;
        served |= was_served;
        let status = run_child(&instance, fds, &cancel).await?;
        if cancel.is_cancelled() || status.success() {
            return Ok(source.stop(child_relay::exit_code(status)).await);
        }
        served = served || source.served();
        if !served {
            tracing::error!(%status, "the manager exited before the kubelet registered it: not restarting it here");
            return Ok(source.stop(child_relay::exit_code(status).max(1)).await);
        }
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        tracing::error!(%status, restart_in_ms = backoff.as_millis() as u64, "the manager exited; a new one takes over the kubelet's connections, which stay open meanwhile");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = cancel.cancelled() => return Ok(source.stop(0).await),
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One child, on the fds its link gave: started, SIGTERM/SIGINT passed
/// on; its exit status.
async fn run_child(
    instance: &str,
    fds: [OwnedFd; 3],
    cancel: &CancellationToken,
) -> anyhow::Result<std::process::ExitStatus> {
    let mut child = spawn(instance, [&fds[0], &fds[1], &fds[2]])?;
    // The child's alone: a dead child's inboxes and control then read as
    // closed.
    drop(fds);
    let mut forwarded = false;
    let status = loop {
        tokio::select! {
            s = child.wait() => break s?,
            () = cancel.cancelled(), if !forwarded => {
                if let Some(pid) = child.id() {
                    // SAFETY: signalling our own child.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
                }
                forwarded = true;
            }
        }
    };
    Ok(status)
}

fn spawn(instance: &str, fds: [&OwnedFd; 3]) -> anyhow::Result<tokio::process::Child> {
    // This very file, even if a newer build replaced its path since.
    let exe = Path::new("/proc/self/exe");
    let mut argv = std::env::args_os();
    let arg0 = argv.next().unwrap_or_else(|| "gpu-manager".into());
    let from = fds.map(|f| f.as_raw_fd());
    let mut cmd = std::process::Command::new(exe);
    cmd.arg0(arg0)
        .args(argv)
        .env(FDS_ENV, CHILD_FDS.map(|f| f.to_string()).join(","))
        .env(INSTANCE_ENV, instance);
    child_relay::inherit_fds(&mut cmd, from, CHILD_FDS);
    tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting the manager ({}): {e}", exe.display()))
}
