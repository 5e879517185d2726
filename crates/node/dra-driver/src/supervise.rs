//! The kubelet's plugin and registration sockets outlive a crashed driver
//! process. A 1.36 kubelet that finds the plugin socket refusing
//! connections fails the pod's NodePrepareResources and retries it only at
//! its next resync (60–90 s; `kuberuntime_manager.go` returns without an
//! error after `FailedPrepareDynamicResources`), and a restarted container
//! waits out CrashLoopBackOff. So `vcuda-dra-driver` runs as a small
//! supervisor that binds both sockets once and runs the driver as its child
//! ([`LISTEN_FDS_ENV`]); when the child dies it starts another at once. The
//! child serves the registration socket itself (connections made while it
//! restarts wait in the listen backlog); the plugin socket the supervisor
//! answers and relays to the child ([`crate::relay`]), so a call the child
//! dies under is answered by the next one. The kubelet sees neither a
//! refused socket, nor a lost call, nor a new registration.
//!
//! A child that exits before it was ever registered (bad settings, the
//! device plugins serving here) ends the supervisor with its status, so the
//! pod shows the error; SIGTERM/SIGINT go to the child, and the supervisor
//! exits with it. The child dies with the supervisor (`PR_SET_PDEATHSIG`).
//! Starting, restarting, signals and the child's "registered" report are
//! the [`supervisor`] crate's; what is here is the driver's: its sockets,
//! the relay and the socket holder.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use supervisor::{Messages, Ready, Spec, Supervisor};

use crate::grpc::Sockets;

/// In the child: `<plugin inbox fd>,<registration fd>` it inherited: the
/// supervisor passes the plugin socket's connections over the inbox
/// ([`crate::relay::incoming`]); the registration socket is a listener.
pub const LISTEN_FDS_ENV: &str = "VCUDA_DRA_LISTEN_FDS";
/// In the child: the instance the sockets are named for.
pub const INSTANCE_ENV: &str = "VCUDA_DRA_INSTANCE";
/// In the child: "1" when an earlier child was registered on these sockets
/// (the kubelet does not register the same socket again).
pub const REGISTERED_ENV: &str = "VCUDA_DRA_REGISTERED";
/// In the child: the fd it writes one byte to once registered.
pub const REPORT_FD_ENV: &str = "VCUDA_DRA_REPORT_FD";

const PLUGIN_FD: RawFd = 3;
const REGISTRATION_FD: RawFd = 4;
const REPORT_FD: RawFd = 5;

const MESSAGES: Messages = Messages {
    what: "driver",
    not_ready: "the driver exited before the kubelet registered it: not restarting it here",
    restarting: "the driver exited; a new one takes its sockets, which stay open meanwhile",
    hung: "the driver is hung: killing it",
};

/// What a supervised child inherited.
pub struct Inherited {
    pub sockets: Sockets,
    /// Where the supervisor passes the plugin socket's connections.
    pub inbox: UnixStream,
    pub registration: UnixListener,
    pub registered: bool,
    report: Option<OwnedFd>,
}

impl Inherited {
    /// Tells the supervisor this child is registered (once).
    pub fn report_registered(&mut self) {
        if let Some(fd) = self.report.take() {
            let _ = supervisor::report_ready(fd);
        }
    }
}

/// The sockets a supervisor handed this process, if it runs under one.
/// Takes the fds: call once.
pub fn inherited(plugins_dir: &Path, registry_dir: &Path) -> anyhow::Result<Option<Inherited>> {
    let Ok(fds) = std::env::var(LISTEN_FDS_ENV) else {
        return Ok(None);
    };
    let instance = std::env::var(INSTANCE_ENV)
        .map_err(|_| anyhow::anyhow!("{LISTEN_FDS_ENV} is set but {INSTANCE_ENV} is not"))?;
    let parsed: Vec<RawFd> = fds.split(',').filter_map(|f| f.parse().ok()).collect();
    let [inbox, registration] = parsed[..] else {
        anyhow::bail!(
            "{LISTEN_FDS_ENV}={fds:?}: expected two fds, \"<plugin inbox>,<registration>\""
        );
    };
    let report = std::env::var(REPORT_FD_ENV)
        .ok()
        .and_then(|f| f.parse::<RawFd>().ok());
    // SAFETY: the supervisor passed these fds to this process alone, open.
    let (inbox, registration, report) = unsafe {
        (
            UnixStream::from_raw_fd(inbox),
            UnixListener::from_raw_fd(registration),
            report.map(|f| OwnedFd::from_raw_fd(f)),
        )
    };
    registration.set_nonblocking(true)?;
    Ok(Some(Inherited {
        sockets: Sockets::for_instance(plugins_dir, registry_dir, &instance),
        inbox,
        registration,
        registered: std::env::var(REGISTERED_ENV).is_ok_and(|v| v == "1"),
        report,
    }))
}

/// The sockets to serve on: those a holder kept across this container's
/// restart ([`crate::holder`]), else new ones (given to the holder).
fn sockets(
    plugins_dir: &Path,
    registry_dir: &Path,
    holder: Option<&Path>,
) -> anyhow::Result<(Sockets, UnixListener, UnixListener, bool)> {
    if let Some(h) = holder {
        // Started just before this container; give it a moment to listen.
        let until = Instant::now() + Duration::from_secs(5);
        while std::os::unix::net::UnixStream::connect(h).is_err() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let held = holder.and_then(|h| match crate::holder::get(h) {
        Ok(held) => held,
        Err(e) => {
            tracing::warn!(holder = %h.display(), error = %e, "the socket holder does not answer: new sockets");
            None
        }
    });
    if let Some(held) = held {
        let sockets = Sockets::for_instance(plugins_dir, registry_dir, &held.instance);
        if sockets.plugin.exists() && sockets.registration.exists() {
            tracing::info!(instance = %held.instance, registered = held.registered, "serving on the sockets the holder kept open across this container's restart");
            let [plugin, registration] = held.fds;
            return Ok((
                sockets,
                UnixListener::from(plugin),
                UnixListener::from(registration),
                held.registered,
            ));
        }
        tracing::warn!(instance = %held.instance, "the held sockets' files are gone (removed by a newer instance?): new sockets");
    }
    let sockets = Sockets::new(plugins_dir, registry_dir);
    let plugin = crate::grpc::bind_std(&sockets.plugin)?;
    let registration = crate::grpc::bind_std(&sockets.registration)?;
    if let Some(h) = holder {
        let instance = sockets.instance().unwrap_or_default();
        if let Err(e) =
            crate::holder::put(h, &instance, [plugin.as_raw_fd(), registration.as_raw_fd()])
        {
            tracing::warn!(holder = %h.display(), error = %e, "the socket holder does not keep these sockets: a restart of this container closes them");
        }
    }
    Ok((sockets, plugin, registration, false))
}

/// Runs the driver (this executable, the same arguments) under supervision
/// until it stops; returns the exit code for the supervisor. `holder`: the
/// socket holder of this pod, if it has one.
pub fn supervise(
    plugins_dir: &Path,
    registry_dir: &Path,
    holder: Option<&Path>,
) -> anyhow::Result<i32> {
    let (sockets, plugin, registration, was_registered) =
        sockets(plugins_dir, registry_dir, holder)?;
    let instance = sockets
        .instance()
        .ok_or_else(|| anyhow::anyhow!("no instance in {}", sockets.plugin.display()))?;
    tracing::info!(plugin = %sockets.plugin.display(), registration = %sockets.registration.display(), "supervising the driver on these sockets");
    let registered = Ready::new(was_registered);
    let inboxes = start_relay(plugin)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let code = rt.block_on(
        Supervisor::new(MESSAGES, registered.clone())
            .run(|| child(&instance, &inboxes, &registration, &registered, holder)),
    )?;
    // A clean stop removes the sockets: the holder must not hand them to
    // the next container.
    if let Some(h) = holder
        && let Err(e) = crate::holder::drop_held(h)
    {
        tracing::warn!(holder = %h.display(), error = %e, "telling the socket holder to let go");
    }
    sockets.remove_own();
    Ok(code)
}

/// The relay on the kubelet's plugin socket, on a thread of its own for
/// the supervisor's life; the inboxes its connections go to.
fn start_relay(plugin: UnixListener) -> anyhow::Result<child_relay::Inboxes> {
    let inboxes = child_relay::Inboxes::default();
    child_relay::spawn_thread("relay", crate::relay::serve(plugin, inboxes.clone()))
        .map_err(|e| anyhow::anyhow!("starting the plugin socket's relay: {e}"))?;
    Ok(inboxes)
}

/// The next child, on its plugin inbox and the registration listener; it
/// reports on a pipe once registered, which the holder is told.
fn child(
    instance: &str,
    inboxes: &child_relay::Inboxes,
    registration: &UnixListener,
    registered: &Ready,
    holder: Option<&Path>,
) -> std::io::Result<Spec> {
    let inbox = inboxes.start_child()?;
    let holder = holder.map(Path::to_path_buf);
    let report = registered.pipe(move || {
        if let Some(h) = holder
            && let Err(e) = crate::holder::registered(&h)
        {
            tracing::warn!(holder = %h.display(), error = %e, "telling the socket holder the driver is registered");
        }
    })?;
    let gone = inboxes.clone();
    // The inbox is the child's alone (closed here once it started): a
    // dead child's inbox then reads as closed.
    Ok(Spec::this_executable("vcuda-dra-driver")
        .env(LISTEN_FDS_ENV, format!("{PLUGIN_FD},{REGISTRATION_FD}"))
        .env(INSTANCE_ENV, instance)
        .env(REPORT_FD_ENV, REPORT_FD.to_string())
        .env(REGISTERED_ENV, if registered.is_set() { "1" } else { "0" })
        .pass(inbox, PLUGIN_FD)
        .share(registration.as_raw_fd(), REGISTRATION_FD)
        .pass(report, REPORT_FD)
        .on_exit(move || gone.child_gone()))
}
