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
//! the child had handed the node to a successor ([`crate::lifecycle::handover`]).
//! The child dies with the supervisor (`PR_SET_PDEATHSIG`). Starting,
//! restarting, signals and the heartbeat's watchdog are the [`supervisor`]
//! crate's; what is here is the manager's: the relayed plugins and the
//! control socket.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream as StdStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use child_relay::Inboxes;
use device_plugin::{PluginRuntime, RelayedPlugin, RuntimeHandle};
use supervisor::{Heartbeat, Messages, Ready, Spec, Supervisor, Watchdog};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::edge::served::FromSupervisor;

/// In the child: `<vcore inbox>,<vmemory inbox>,<control>` fds it inherited.
pub const FDS_ENV: &str = "VCUDA_MANAGER_SUPERVISOR_FDS";
/// In the child: the instance its plugin sockets are named for.
pub const INSTANCE_ENV: &str = "VCUDA_MANAGER_INSTANCE";

const CHILD_FDS: [RawFd; 3] = [3, 4, 5];
/// How often a child says it is alive on its control socket
/// ([`crate::edge::served::Control`]).
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A child silent this long is hung: the supervisor kills it and starts
/// another, well before the kubelet's liveness probe (60 s) would kill the
/// whole container, whose restart it cannot bridge (the kubelet restarts
/// a container from the same loop that waits on Allocate).
pub const HUNG: Duration = Duration::from_secs(10);

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
        // Not to this manager's own children: a socket they kept open would
        // hide this manager's death from its supervisor.
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

/// What the supervisor keeps for the kubelet across its children.
struct Link {
    dir: PathBuf,
    sockets: [PathBuf; 2],
    inboxes: [Inboxes; 2],
    plugins: tokio::sync::Mutex<Option<RuntimeHandle>>,
    stop_plugins: CancellationToken,
    /// Kubelet's connections to the managers this pod replaced.
    inherited: Arc<Mutex<Vec<OwnedFd>>>,
    /// The kubelet registered the plugins once.
    served: Ready,
    /// When the current child last said something ([`HEARTBEAT`]); None
    /// until it first does.
    heard: Arc<Heartbeat>,
    handed_over: AtomicBool,
}

/// Runs the manager (this executable, the same arguments) under
/// supervision until it stops; the exit code for the supervisor.
pub fn supervise(s: &Settings) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(s))
}

const MESSAGES: Messages = Messages {
    what: "manager",
    not_ready: "the manager exited before the kubelet registered it: not restarting it here",
    restarting: "the manager exited; a new one takes over the kubelet's connections, which stay open meanwhile",
    hung: "the manager is hung (no heartbeat): killing it; the next one takes the kubelet's calls",
};

async fn run(s: &Settings) -> anyhow::Result<i32> {
    let instance = node_agent::mode::instance_id();
    let link = Arc::new(Link {
        dir: s.device_plugin_path.clone(),
        sockets: crate::lifecycle::daemon::plugin_sockets(&s.device_plugin_path, &instance),
        inboxes: Default::default(),
        plugins: Default::default(),
        stop_plugins: CancellationToken::new(),
        inherited: Default::default(),
        served: Ready::default(),
        handed_over: AtomicBool::new(false),
        heard: Default::default(),
    });
    tracing::info!(%instance, vcore = %link.sockets[0].display(), vmemory = %link.sockets[1].display(), "supervising the manager; these sockets are this supervisor's");
    // Not once stopping: a manager shutting down stops its heartbeat
    // before it has written its last state.
    let code = Supervisor::new(MESSAGES, link.served.clone())
        .watchdog(Watchdog {
            heartbeat: link.heard.clone(),
            every: HEARTBEAT,
            hung: HUNG,
        })
        .run(|| child(&link, &instance))
        .await?;
    Ok(stop(&link, code).await)
}

/// The supervisor's end: the plugins' sockets removed, unless the node was
/// handed to a successor: then the kubelet's connections stay open (its
/// streams must not end, or it drops the successor's registration).
async fn stop(link: &Link, code: i32) -> i32 {
    if link.handed_over.load(Ordering::SeqCst) {
        tracing::info!("stopping: the node is the successor's; leaving kubelet's connections open");
        std::process::exit(code);
    }
    link.stop_plugins.cancel();
    if let Some(h) = link.plugins.lock().await.take()
        && let Err(e) = h.wait().await
    {
        tracing::warn!(error = %e, "stopping the device plugins");
    }
    code
}

/// The next child: its inboxes and control socket; the control socket
/// served while it runs.
fn child(link: &Arc<Link>, instance: &str) -> std::io::Result<Spec> {
    let inboxes = [
        link.inboxes[0].start_child()?,
        link.inboxes[1].start_child()?,
    ];
    let (mine, theirs) = StdStream::pair()?;
    let control = tokio::spawn(serve_control(link.clone(), mine));
    let gone = link.clone();
    let [vcore, vmemory] = inboxes;
    // The child's alone (closed here once it started): a dead child's
    // inboxes then read as closed.
    Ok(Spec::this_executable("gpu-manager")
        .env(FDS_ENV, CHILD_FDS.map(|f| f.to_string()).join(","))
        .env(INSTANCE_ENV, instance)
        .pass(vcore, CHILD_FDS[0])
        .pass(vmemory, CHILD_FDS[1])
        .pass(OwnedFd::from(theirs), CHILD_FDS[2])
        .on_exit(move || {
            for i in &gone.inboxes {
                i.child_gone();
            }
            control.abort();
        }))
}

/// The child's requests (see [`crate::edge::served::Control`]), until it closes
/// the socket.
async fn serve_control(link: Arc<Link>, conn: StdStream) -> std::io::Result<()> {
    conn.set_nonblocking(true)?;
    let (r, mut w) = tokio::net::UnixStream::from_std(conn)?.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Some(l) = rx.recv().await {
            if w.write_all(format!("{l}\n").as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await? {
        link.heard.beat();
        let (cmd, arg) = line.split_once(' ').unwrap_or((&line, ""));
        match cmd {
            "serve" => {
                let (link, tx) = (link.clone(), tx.clone());
                tokio::spawn(async move {
                    if link.serve().await {
                        let _ = tx.send("registered".into());
                    }
                });
            }
            "register-again" => {
                // Only a manager taking the node back asks this.
                link.handed_over.store(false, Ordering::SeqCst);
                if let Some(h) = link.plugins.lock().await.as_ref() {
                    h.register_again();
                }
            }
            "open-inbox" => {
                let r =
                    crate::lifecycle::handover::open_inbox(Path::new(arg), link.inherited.clone());
                let _ = tx.send(answer(r.map(|()| String::new())));
            }
            "hand-over" => {
                let r = link.hand_over(Path::new(arg)).await;
                let _ = tx.send(answer(r.map(|n| n.to_string())));
            }
            "alive" => {}
            other => tracing::warn!(request = other, "unknown request from the manager"),
        }
    }
    Ok(())
}

fn answer(r: std::io::Result<String>) -> String {
    match r {
        Ok(d) => format!("ok {d}"),
        Err(e) => format!("err {e}"),
    }
}

impl Link {
    /// Starts the plugins on the first child's options and device lists
    /// (once), then waits until the kubelet has both registered; false if
    /// they could not start.
    async fn serve(&self) -> bool {
        let statuses = {
            let mut plugins = self.plugins.lock().await;
            if plugins.is_none() {
                match self.start_plugins().await {
                    Ok(h) => *plugins = Some(h),
                    Err(e) => {
                        tracing::error!(error = %e, "starting the device plugins");
                        return false;
                    }
                }
            }
            plugins.as_ref().expect("started above").statuses()
        };
        if !device_plugin::all_registered(statuses).await {
            return false;
        }
        if self.served.set() {
            tracing::info!("the kubelet registered both plugins");
        }
        true
    }

    async fn start_plugins(&self) -> anyhow::Result<RuntimeHandle> {
        crate::lifecycle::daemon::remove_stale_sockets(&self.dir);
        let vcore = RelayedPlugin::start(VCORE_RESOURCE, &self.inboxes[0]).await?;
        let vmemory = RelayedPlugin::start(VMEMORY_RESOURCE, &self.inboxes[1]).await?;
        let name = crate::edge::served::file_name;
        Ok(PluginRuntime::new(&self.dir)
            .plugin(VCORE_RESOURCE, name(&self.sockets[0]), vcore)
            .plugin(VMEMORY_RESOURCE, name(&self.sockets[1]), vmemory)
            .start(self.stop_plugins.clone())?)
    }

    /// The kubelet's connections, to this supervisor's sockets and to
    /// those of the managers it replaced, passed to a successor's inbox.
    async fn hand_over(&self, inbox: &Path) -> std::io::Result<usize> {
        let mut fds = match self.plugins.lock().await.as_ref() {
            Some(h) => h.kubelet_connections(),
            None => Vec::new(),
        };
        fds.append(&mut self.inherited.lock().unwrap_or_else(|p| p.into_inner()));
        crate::edge::served::send_connections(inbox, &fds)?;
        self.handed_over.store(true, Ordering::SeqCst);
        Ok(fds.len())
    }
}
