//! `gpu-manager hold-plugins`: the device plugins' [`Link`] in a container
//! of its own, beside the manager's in the DaemonSet's pod. A kill of the
//! manager's whole container (a failed liveness probe, an OOM kill of the
//! container, a kill by hand) then leaves the kubelet's plugin streams
//! open: the kubelet neither marks vcuda-core and vcuda-memory unhealthy
//! nor refuses the pods it admits meanwhile, and the calls made while the
//! container restarts wait for the next manager.
//!
//! The manager's supervisor ([`crate::supervise`], `--plugin-holder PATH`)
//! attaches each manager it starts here instead of keeping a link itself.
//! Protocol, one request per connection on the holder's unix socket, as
//! [`fd_pass`] messages: `ATTACH`, answered `OK <instance> <0|1 served>`
//! with the manager's three fds ([`Link::attach`]); `SERVED`, answered
//! `YES` or `NO` (whether the kubelet registered the plugins once).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::config::Settings;
use crate::link::Link;

/// How long a manager waits for its holder to listen (the two containers
/// start together), in seconds; [`WAIT_ENV`] sets another.
const WAIT_S: u64 = 60;
pub const WAIT_ENV: &str = "VCUDA_PLUGIN_HOLDER_WAIT_S";
/// How long a stopping holder waits for its manager to detach.
const STOPPING: Duration = Duration::from_secs(20);

/// A manager's attachment.
pub struct Attached {
    pub instance: String,
    /// Whether the kubelet had already registered the holder's plugins.
    pub served: bool,
    /// vcore inbox, vmemory inbox, control.
    pub fds: [OwnedFd; 3],
}

fn request(holder: &Path, msg: &str) -> std::io::Result<(String, Vec<OwnedFd>)> {
    let s = UnixStream::connect(holder)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    fd_pass::send(&s, msg.as_bytes(), &[])?;
    fd_pass::recv(&s)
}

/// Attaches a new manager, waiting up to a minute for the holder to listen.
pub fn attach(holder: &Path) -> anyhow::Result<Attached> {
    let wait = match std::env::var(WAIT_ENV) {
        Ok(v) => v
            .parse()
            .map_err(|e| anyhow::anyhow!("{WAIT_ENV}={v:?}: not a number of seconds: {e}"))?,
        Err(_) => WAIT_S,
    };
    let wait = Duration::from_secs(wait);
    let t0 = Instant::now();
    let mut told = false;
    let (reply, fds) = loop {
        match request(holder, "ATTACH") {
            Ok(r) => break r,
            Err(e) if t0.elapsed() < wait => {
                if !told {
                    tracing::info!(holder = %holder.display(), error = %e, "waiting for the plugin holder (its container starts beside this one)");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                anyhow::bail!(
                    "the plugin holder {} does not answer after {}s: {e} (is the plugin-holder container of this pod running, with the same --plugin-holder path?)",
                    holder.display(),
                    wait.as_secs()
                )
            }
        }
    };
    let words: Vec<&str> = reply.split(' ').collect();
    match (&words[..], <[OwnedFd; 3]>::try_from(fds)) {
        (["OK", instance, served], Ok(fds)) => Ok(Attached {
            instance: instance.to_string(),
            served: *served == "1",
            fds,
        }),
        (_, fds) => anyhow::bail!(
            "the plugin holder {} answered ATTACH with {reply:?} and {} fds (expected \"OK <instance> <0|1>\" and 3)",
            holder.display(),
            fds.map_or_else(|v| v.len(), |_| 3)
        ),
    }
}

/// Whether the kubelet registered the holder's plugins once.
pub fn served(holder: &Path) -> anyhow::Result<bool> {
    let (reply, _) = request(holder, "SERVED")
        .with_context(|| format!("asking the plugin holder {}", holder.display()))?;
    match reply.as_str() {
        "YES" => Ok(true),
        "NO" => Ok(false),
        other => anyhow::bail!(
            "the plugin holder {} answered SERVED with {other:?}",
            holder.display()
        ),
    }
}

/// The holder: serves `path` until SIGTERM/SIGINT, then lets the plugins
/// go once its manager has detached (or stays silent, leaving the
/// kubelet's connections open, when the node was handed to a successor).
pub fn hold(s: &Settings, path: &Path) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let cancel = device_plugin::cancel_on_signals()?;
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)
                .with_context(|| format!("creating the plugin holder's directory {}", d.display()))?;
        }
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding the plugin holder at {}", path.display()))?;
        anyhow::ensure!(
            s.device_plugin_path.is_dir(),
            "kubelet's device-plugin directory {} does not exist: is kubelet running on this node, and is --device-plugin-path right?",
            s.device_plugin_path.display()
        );
        let link = Link::new(&s.device_plugin_path);
        tracing::info!(socket = %path.display(), "holding the device plugins for the manager of this pod");
        loop {
            tokio::select! {
                c = listener.accept() => match c {
                    Ok((conn, _)) => answer(&link, conn),
                    Err(e) => tracing::warn!(error = %e, "accepting a manager"),
                },
                () = cancel.cancelled() => break,
            }
        }
        drop(listener);
        let _ = std::fs::remove_file(path);
        link.detached(STOPPING).await;
        Ok(link.stop(0).await)
    })
}

/// One request.
fn answer(link: &Arc<Link>, conn: tokio::net::UnixStream) {
    let link = link.clone();
    let rt = tokio::runtime::Handle::current();
    // fd_pass is blocking: off the runtime's thread.
    tokio::task::spawn_blocking(move || {
        let _guard = rt.enter();
        let conn = conn.into_std().and_then(|c| {
            c.set_nonblocking(false)?;
            c.set_read_timeout(Some(Duration::from_secs(5)))?;
            Ok(c)
        });
        let Ok(conn) = conn else { return };
        let Ok((msg, _)) = fd_pass::recv(&conn) else {
            return;
        };
        let (reply, fds) = match msg.as_str() {
            "ATTACH" => match link.attach() {
                Ok(fds) => {
                    tracing::info!("a manager attached: the kubelet's calls go to it");
                    let served = u8::from(link.served());
                    (format!("OK {} {served}", link.instance), Vec::from(fds))
                }
                Err(e) => (format!("ERROR attaching: {e}"), Vec::new()),
            },
            "SERVED" => (if link.served() { "YES" } else { "NO" }.into(), Vec::new()),
            other => (format!("ERROR unknown request {other:?}"), Vec::new()),
        };
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        if let Err(e) = fd_pass::send(&conn, reply.as_bytes(), &raw) {
            tracing::warn!(error = %e, "answering a manager");
        }
    });
}
