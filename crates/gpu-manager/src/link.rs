//! What keeps the kubelet's view of this node's two device plugins across
//! the manager's deaths: the plugin sockets, their registration and the
//! kubelet's connections ([`device_plugin::RelayedPlugin`]), with the
//! calls relayed to the manager attached now ([`child_relay`]). A
//! [`Link`] lives in the manager's supervisor ([`crate::supervise`]), or
//! in a container of its own beside the manager's ([`crate::holder`]),
//! which also outlives a kill of the manager's whole container.
//!
//! A manager attaches ([`Link::attach`]) and gets three fds: an inbox per
//! plugin, over which the link passes the kubelet's connections, and a
//! control socket ([`crate::served::Control`]). When the control socket
//! closes, the manager is gone: calls wait for the next one.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream as StdStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use child_relay::Inboxes;
use device_plugin::{PluginRuntime, RelayedPlugin, RuntimeHandle};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};

/// What a link keeps for the kubelet across its managers.
pub struct Link {
    pub instance: String,
    dir: PathBuf,
    sockets: [PathBuf; 2],
    inboxes: [Inboxes; 2],
    /// The attachment calls go to now.
    current: AtomicU64,
    /// How many managers are attached (their control sockets open).
    attached: tokio::sync::watch::Sender<usize>,
    plugins: tokio::sync::Mutex<Option<RuntimeHandle>>,
    stop_plugins: CancellationToken,
    /// Kubelet's connections to the managers this pod replaced.
    inherited: Arc<Mutex<Vec<OwnedFd>>>,
    /// The kubelet registered the plugins once.
    served: AtomicBool,
    handed_over: AtomicBool,
}

impl Link {
    /// A link for the plugin sockets of a new instance in `dir`.
    pub fn new(dir: &Path) -> Arc<Link> {
        let instance = node_agent::mode::instance_id();
        let link = Link {
            sockets: crate::daemon::plugin_sockets(dir, &instance),
            instance,
            dir: dir.to_path_buf(),
            inboxes: Default::default(),
            current: AtomicU64::new(0),
            attached: tokio::sync::watch::channel(0).0,
            plugins: Default::default(),
            stop_plugins: CancellationToken::new(),
            inherited: Default::default(),
            served: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
        };
        tracing::info!(instance = %link.instance, vcore = %link.sockets[0].display(), vmemory = %link.sockets[1].display(), "these plugin sockets and the kubelet's connections to them are kept here across the manager's restarts");
        Arc::new(link)
    }

    /// A new manager: calls go to it from now on. Its fds: the vcore and
    /// vmemory inboxes and its end of the control socket.
    pub fn attach(self: &Arc<Self>) -> std::io::Result<[OwnedFd; 3]> {
        let n = self.current.fetch_add(1, Ordering::SeqCst) + 1;
        let vcore = self.inboxes[0].start_child()?;
        let vmemory = self.inboxes[1].start_child()?;
        let (mine, theirs) = StdStream::pair()?;
        let link = self.clone();
        self.attached.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            if let Err(e) = serve_control(&link, mine).await {
                tracing::warn!(error = %e, "the manager's control socket");
            }
            link.attached.send_modify(|n| *n -= 1);
            // Gone, unless a newer manager attached meanwhile.
            if link.current.load(Ordering::SeqCst) == n {
                for i in &link.inboxes {
                    i.child_gone();
                }
            }
        });
        Ok([vcore, vmemory, theirs.into()])
    }

    /// Whether the kubelet registered the plugins once.
    pub fn served(&self) -> bool {
        self.served.load(Ordering::SeqCst)
    }

    /// Waits until no manager is attached, at most `limit`: a manager
    /// stopping beside this link still serves the kubelet meanwhile.
    pub async fn detached(&self, limit: std::time::Duration) {
        let mut rx = self.attached.subscribe();
        if tokio::time::timeout(limit, rx.wait_for(|n| *n == 0))
            .await
            .is_err()
        {
            tracing::warn!(
                limit_s = limit.as_secs(),
                "the manager is still attached; stopping anyway"
            );
        }
    }

    /// The link's end: the plugins' sockets removed, unless the node was
    /// handed to a successor: then the kubelet's connections stay open (its
    /// streams must not end, or it drops the successor's registration), so
    /// this process exits at once with `code`.
    pub async fn stop(&self, code: i32) -> i32 {
        if self.handed_over.load(Ordering::SeqCst) {
            tracing::info!(
                "stopping: the node is the successor's; leaving kubelet's connections open"
            );
            std::process::exit(code);
        }
        self.stop_plugins.cancel();
        if let Some(h) = self.plugins.lock().await.take()
            && let Err(e) = h.wait().await
        {
            tracing::warn!(error = %e, "stopping the device plugins");
        }
        code
    }

    /// Starts the plugins on the first manager's options and device lists
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
        if !self.served.swap(true, Ordering::SeqCst) {
            tracing::info!("the kubelet registered both plugins");
        }
        true
    }

    async fn start_plugins(&self) -> anyhow::Result<RuntimeHandle> {
        crate::daemon::remove_stale_sockets(&self.dir);
        let vcore = RelayedPlugin::start(VCORE_RESOURCE, &self.inboxes[0]).await?;
        let vmemory = RelayedPlugin::start(VMEMORY_RESOURCE, &self.inboxes[1]).await?;
        let name = crate::served::file_name;
        Ok(PluginRuntime::new(&self.dir)
            .plugin(VCORE_RESOURCE, name(&self.sockets[0]), vcore)
            .plugin(VMEMORY_RESOURCE, name(&self.sockets[1]), vmemory)
            .start(self.stop_plugins.clone())?)
    }

    /// The kubelet's connections, to this link's sockets and to those of
    /// the managers it replaced, passed to a successor's inbox.
    async fn hand_over(&self, inbox: &Path) -> std::io::Result<usize> {
        let mut fds = match self.plugins.lock().await.as_ref() {
            Some(h) => h.kubelet_connections(),
            None => Vec::new(),
        };
        fds.append(&mut self.inherited.lock().unwrap_or_else(|p| p.into_inner()));
        crate::served::send_connections(inbox, &fds)?;
        self.handed_over.store(true, Ordering::SeqCst);
        Ok(fds.len())
    }
}

/// The manager's requests (see [`crate::served::Control`]), until it
/// closes the socket.
async fn serve_control(link: &Arc<Link>, conn: StdStream) -> std::io::Result<()> {
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
                let r = crate::handover::open_inbox(Path::new(arg), link.inherited.clone());
                let _ = tx.send(answer(r.map(|()| String::new())));
            }
            "hand-over" => {
                let r = link.hand_over(Path::new(arg)).await;
                let _ = tx.send(answer(r.map(|n| n.to_string())));
            }
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
