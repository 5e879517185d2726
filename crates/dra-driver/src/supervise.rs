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

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

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
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A child that ran this long restarts after the first backoff again.
const STABLE: Duration = Duration::from_secs(60);

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

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
            let mut f = std::fs::File::from(fd);
            let _ = std::io::Write::write_all(&mut f, b"r");
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
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    tracing::info!(plugin = %sockets.plugin.display(), registration = %sockets.registration.display(), "supervising the driver on these sockets");
    // This very file, even if a newer build replaced its path since.
    let exe = std::path::PathBuf::from("/proc/self/exe");
    let mut argv = std::env::args_os();
    let arg0 = argv.next().unwrap_or_else(|| "vcuda-dra-driver".into());
    let args: Vec<std::ffi::OsString> = argv.collect();
    let registered = Arc::new(AtomicBool::new(was_registered));
    let stop = |code: i32| {
        // A clean stop removes the sockets: the holder must not hand them
        // to the next container.
        if let Some(h) = holder
            && let Err(e) = crate::holder::drop_held(h)
        {
            tracing::warn!(holder = %h.display(), error = %e, "telling the socket holder to let go");
        }
        sockets.remove_own();
        Ok(code)
    };
    let inboxes = start_relay(plugin)?;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = Instant::now();
        let status = run_child(
            &exe,
            (&arg0, &args),
            &instance,
            (inboxes.start_child()?, registration.as_raw_fd()),
            (&registered, holder),
        );
        inboxes.child_gone();
        let status = status?;
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 || status.success() {
            return stop(exit_code(status));
        }
        if !registered.load(Ordering::SeqCst) {
            tracing::error!(%status, "the driver exited before the kubelet registered it: not restarting it here");
            return stop(exit_code(status).max(1));
        }
        if started.elapsed() >= STABLE {
            backoff = FIRST_BACKOFF;
        }
        tracing::error!(%status, restart_in_ms = backoff.as_millis() as u64, "the driver exited; a new one takes its sockets, which stay open meanwhile");
        if !sleep_unless_signalled(backoff) {
            return stop(0);
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// The relay on the kubelet's plugin socket, on a thread of its own for
/// the supervisor's life; the inboxes its connections go to.
fn start_relay(plugin: UnixListener) -> anyhow::Result<child_relay::Inboxes> {
    let inboxes = child_relay::Inboxes::default();
    child_relay::spawn_thread("relay", crate::relay::serve(plugin, inboxes.clone()))
        .map_err(|e| anyhow::anyhow!("starting the plugin socket's relay: {e}"))?;
    Ok(inboxes)
}

/// One child on its plugin inbox and the registration listener; forwards
/// SIGTERM/SIGINT; its exit status.
fn run_child(
    exe: &Path,
    (arg0, args): (&std::ffi::OsStr, &[std::ffi::OsString]),
    instance: &str,
    (inbox, registration): (OwnedFd, RawFd),
    (registered, holder): (&Arc<AtomicBool>, Option<&Path>),
) -> anyhow::Result<std::process::ExitStatus> {
    let (report_r, report_w) = pipe()?;
    let w = report_w.as_raw_fd();
    let inbox_fd = inbox.as_raw_fd();
    let mut cmd = std::process::Command::new(exe);
    cmd.arg0(arg0)
        .args(args)
        .env(LISTEN_FDS_ENV, format!("{PLUGIN_FD},{REGISTRATION_FD}"))
        .env(INSTANCE_ENV, instance)
        .env(REPORT_FD_ENV, REPORT_FD.to_string())
        .env(
            REGISTERED_ENV,
            if registered.load(Ordering::SeqCst) {
                "1"
            } else {
                "0"
            },
        );
    child_relay::inherit_fds(
        &mut cmd,
        [inbox_fd, registration, w],
        [PLUGIN_FD, REGISTRATION_FD, REPORT_FD],
    );
    let mut child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting the driver ({}): {e}", exe.display()))?;
    drop(report_w);
    // The child's alone: a dead child's inbox then reads as closed.
    drop(inbox);
    let flag = registered.clone();
    let holder = holder.map(Path::to_path_buf);
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(report_r);
        let mut b = [0u8; 1];
        if matches!(f.read(&mut b), Ok(1)) {
            flag.store(true, Ordering::SeqCst);
            if let Some(h) = holder
                && let Err(e) = crate::holder::registered(&h)
            {
                tracing::warn!(holder = %h.display(), error = %e, "telling the socket holder the driver is registered");
            }
        }
    });
    let mut forwarded = false;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 && !forwarded {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills two fds we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created, owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sleeps `d`; false when a stop signal came.
fn sleep_unless_signalled(d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if SIGNAL.load(Ordering::SeqCst) != 0 {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    SIGNAL.load(Ordering::SeqCst) == 0
}

pub use child_relay::exit_code;
