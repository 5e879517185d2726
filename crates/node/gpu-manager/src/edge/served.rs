//! How this manager's two device plugins reach the kubelet: on sockets of
//! its own (`--no-supervisor`), or through its supervisor
//! ([`crate::lifecycle::supervise`]), which owns the sockets, the registration and
//! the kubelet's connections, so that they outlive this process. The
//! handover of a rolling update ([`crate::lifecycle::handover`]) asks either for the
//! same things: an inbox for a predecessor's kubelet connections, those
//! connections passed on to a successor, a new registration.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use device_plugin::{DevicePluginService, PluginRuntime, RuntimeHandle};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// One plugin: its resource, socket file name and service.
pub type Entry = (&'static str, String, Arc<dyn DevicePluginService>);

/// What a supervised child inherited ([`crate::lifecycle::supervise::inherited`]).
pub struct FromSupervisor {
    pub instance: String,
    /// Where the supervisor passes the kubelet's connections, per plugin.
    pub inboxes: [StdStream; 2],
    pub control: StdStream,
}

pub enum Plugins {
    Own {
        handle: RuntimeHandle,
        /// Kubelet's connections to the managers this one replaced.
        inherited: Arc<Mutex<Vec<OwnedFd>>>,
    },
    Supervised {
        control: Control,
        served: Vec<JoinHandle<Result<(), tonic::transport::Error>>>,
    },
}

impl Plugins {
    /// Serves `plugins` until `stop`: on their sockets, or on the
    /// connections the supervisor passes (it then registers them).
    pub async fn start(
        dir: &Path,
        plugins: [Entry; 2],
        sup: Option<FromSupervisor>,
        stop: &CancellationToken,
    ) -> anyhow::Result<Plugins> {
        let Some(sup) = sup else {
            crate::lifecycle::daemon::remove_stale_sockets(dir);
            let mut rt = PluginRuntime::new(dir);
            for (resource, socket, svc) in plugins {
                rt = rt.plugin(resource, socket, svc);
            }
            let handle = rt
                .start(stop.clone())
                .context("starting the device plugins")?;
            return Ok(Plugins::Own {
                handle,
                inherited: Default::default(),
            });
        };
        let served = plugins
            .into_iter()
            .zip(sup.inboxes)
            .map(|((resource, _, svc), inbox)| {
                tokio::spawn(device_plugin::serve_inbox(
                    resource,
                    svc,
                    inbox,
                    stop.clone(),
                ))
            })
            .collect();
        let control = Control::new(sup.control).context("the supervisor's control socket")?;
        control.send("serve").await?;
        Ok(Plugins::Supervised { control, served })
    }

    /// Whether the kubelet accepted both registrations (false: cancelled).
    pub async fn registered(&self, resources: [&str; 2], cancel: &CancellationToken) -> bool {
        let wait = async {
            match self {
                Plugins::Own { handle, .. } => {
                    let statuses = resources.iter().filter_map(|r| handle.status(r));
                    device_plugin::all_registered(statuses.collect()).await;
                }
                Plugins::Supervised { control, .. } => {
                    let _ = control.registered.clone().wait_for(|r| *r).await;
                }
            }
        };
        tokio::pin!(wait);
        tokio::select! {
            () = &mut wait => true,
            () = tokio::time::sleep(Duration::from_secs(5)) => {
                tracing::warn!("kubelet has not accepted the registration within 5 s; still trying (is kubelet running?)");
                tokio::select! {
                    () = &mut wait => true,
                    () = cancel.cancelled() => false,
                }
            }
            () = cancel.cancelled() => false,
        }
    }

    /// Registers both plugins with the kubelet again, now.
    pub async fn register_again(&self) {
        match self {
            Plugins::Own { handle, .. } => handle.register_again(),
            Plugins::Supervised { control, .. } => {
                if let Err(e) = control.send("register-again").await {
                    tracing::error!(error = %e, "asking the supervisor to register again");
                }
            }
        }
    }

    /// Opens the inbox a predecessor passes its kubelet connections to.
    pub async fn open_inbox(&self, path: &Path) -> anyhow::Result<()> {
        match self {
            Plugins::Own { inherited, .. } => {
                crate::lifecycle::handover::open_inbox(path, inherited.clone()).map_err(Into::into)
            }
            Plugins::Supervised { control, .. } => control
                .request(&format!("open-inbox {}", path.display()))
                .await
                .map(drop),
        }
    }

    /// Passes the kubelet's connections (to this manager, and to those it
    /// replaced) to a successor's inbox, `also` with them (the MIG
    /// plugins', served by this process either way); how many.
    pub async fn hand_over_connections(
        &self,
        inbox: &Path,
        mut also: Vec<OwnedFd>,
    ) -> anyhow::Result<usize> {
        match self {
            Plugins::Own { handle, inherited } => {
                let mut fds = handle.kubelet_connections();
                fds.append(&mut inherited.lock().unwrap_or_else(|p| p.into_inner()));
                fds.append(&mut also);
                send_connections(inbox, &fds)?;
                Ok(fds.len())
            }
            Plugins::Supervised { control, .. } => {
                // The supervisor's first; the inbox takes a second sender.
                let n = control
                    .request(&format!("hand-over {}", inbox.display()))
                    .await?;
                if !also.is_empty() {
                    send_connections(inbox, &also)?;
                }
                Ok(n.trim().parse().unwrap_or(0) + also.len())
            }
        }
    }

    /// Waits for the plugins to stop (after the `stop` given to `start`).
    pub async fn wait(self) -> anyhow::Result<()> {
        match self {
            Plugins::Own { handle, .. } => handle.wait().await.map_err(Into::into),
            Plugins::Supervised { served, .. } => {
                for s in served {
                    s.await??;
                }
                Ok(())
            }
        }
    }
}

/// Sends `fds` to a successor's inbox, [`fd_pass::MAX_FDS`] a message.
pub fn send_connections(inbox: &Path, fds: &[OwnedFd]) -> std::io::Result<()> {
    let conn = std::os::unix::net::UnixStream::connect(inbox)?;
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    for chunk in raw.chunks(fd_pass::MAX_FDS) {
        fd_pass::send(&conn, b"connections", chunk)?;
    }
    Ok(())
}

/// The child's end of the control socket: one line a message. The child
/// sends `serve`, `register-again`, `open-inbox PATH`, `hand-over PATH`,
/// and `alive` every [`crate::lifecycle::supervise::HEARTBEAT`];
/// the supervisor sends `registered` once the kubelet has both plugins,
/// and answers the last two with `ok [detail]` or `err MESSAGE`.
pub struct Control {
    w: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    registered: watch::Receiver<bool>,
    replies: tokio::sync::Mutex<mpsc::UnboundedReceiver<String>>,
}

/// How long a request waits for the supervisor's answer.
const ANSWER: Duration = Duration::from_secs(10);

impl Control {
    fn new(s: StdStream) -> std::io::Result<Control> {
        s.set_nonblocking(true)?;
        let (r, w) = tokio::net::UnixStream::from_std(s)?.into_split();
        let (reg_tx, registered) = watch::channel(false);
        let (tx, replies) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                if l == "registered" {
                    reg_tx.send_replace(true);
                } else if tx.send(l).is_err() {
                    return;
                }
            }
        });
        let w = Arc::new(tokio::sync::Mutex::new(w));
        // The supervisor kills a manager that stops saying this (hung).
        let beat = Arc::downgrade(&w);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(crate::lifecycle::supervise::HEARTBEAT);
            loop {
                every.tick().await;
                let Some(w) = beat.upgrade() else { return };
                if w.lock().await.write_all(b"alive\n").await.is_err() {
                    return;
                }
            }
        });
        Ok(Control {
            w,
            registered,
            replies: tokio::sync::Mutex::new(replies),
        })
    }

    async fn send(&self, line: &str) -> std::io::Result<()> {
        let mut w = self.w.lock().await;
        w.write_all(format!("{line}\n").as_bytes()).await
    }

    /// Sends `line` and returns the detail of its `ok`.
    async fn request(&self, line: &str) -> anyhow::Result<String> {
        let mut replies = self.replies.lock().await;
        self.send(line).await?;
        let answer = tokio::time::timeout(ANSWER, replies.recv())
            .await
            .map_err(|_| {
                anyhow::anyhow!("the supervisor did not answer {line:?} within {ANSWER:?}")
            })?
            .ok_or_else(|| anyhow::anyhow!("the supervisor closed the control socket"))?;
        match answer.split_once(' ').unwrap_or((&answer, "")) {
            ("ok", detail) => Ok(detail.to_string()),
            (_, e) => anyhow::bail!("the supervisor: {e}"),
        }
    }
}

/// A plugin's socket file name in `sockets`.
pub fn file_name(p: &Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}
