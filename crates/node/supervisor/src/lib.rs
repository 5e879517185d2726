//! The supervision core both node daemons run as (`gpu-manager`,
//! `vcuda-dra-driver`): the process started keeps what the kubelet holds
//! on to and runs the daemon's worker as its child, again when it dies.
//!
//! * A child is started from a [`Spec`]: its executable and arguments,
//!   environment, and fds it inherits at fixed numbers (`dup2`); it dies
//!   with the supervisor (`PR_SET_PDEATHSIG`).
//! * A child that dies is started again after a [`Backoff`]
//!   ([`FIRST_BACKOFF`] doubling to [`MAX_BACKOFF`]; a child that ran
//!   [`STABLE`] starts it over).
//! * A child that exits before it was ever [`Ready`] (bad settings, the
//!   other mode serving here) ends the supervisor with its status, so the
//!   pod shows the error. Ready is what the daemon says it is: a flag it
//!   sets itself, or a byte the child writes on a pipe ([`Ready::pipe`],
//!   [`report_ready`]).
//! * SIGTERM/SIGINT go to the child, and the supervisor stops with it.
//! * An optional [`Watchdog`]: a child whose [`Heartbeat`] stops for its
//!   `hung` time is killed (SIGKILL) and another started.
//!
//! What a daemon keeps across its children (sockets, relays, a control
//! protocol) stays the daemon's: [`Supervisor::run`] returns the code the
//! supervisor should exit with, and the daemon cleans up around it.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// The first wait before a dead child's successor starts.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait before a dead child's successor starts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A child that ran this long restarts after the first backoff again.
pub const STABLE: Duration = Duration::from_secs(60);

/// Why a supervisor could not go on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The child could not be started.
    #[error("starting the {what} ({}): {source}", exe.display())]
    Spawn {
        what: &'static str,
        exe: PathBuf,
        #[source]
        source: io::Error,
    },
    /// SIGTERM/SIGINT could not be caught.
    #[error("installing signal handlers: {0}")]
    Signals(#[source] io::Error),
    /// Preparing a child, or waiting for one, failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The wait before each restart: [`FIRST_BACKOFF`], doubling to
/// [`MAX_BACKOFF`]; a child that ran [`STABLE`] or longer starts it over.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    stable: Duration,
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(FIRST_BACKOFF, MAX_BACKOFF, STABLE)
    }
}

impl Backoff {
    pub fn new(first: Duration, max: Duration, stable: Duration) -> Self {
        Self {
            first,
            max,
            stable,
            next: first,
        }
    }

    /// The wait before restarting a child that ran for `ran`; the next
    /// wait doubles (up to the maximum).
    pub fn delay(&mut self, ran: Duration) -> Duration {
        if ran >= self.stable {
            self.next = self.first;
        }
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }
}

/// Whether a child was ever ready (for the device plugins: the kubelet
/// registered them). Shared: clones are the same flag.
#[derive(Debug, Clone, Default)]
pub struct Ready(Arc<AtomicBool>);

impl Ready {
    /// `already`: an earlier supervisor's child was ready on what this one
    /// inherited.
    pub fn new(already: bool) -> Self {
        Self(Arc::new(AtomicBool::new(already)))
    }

    /// Marks it ready; true the first time.
    pub fn set(&self) -> bool {
        !self.0.swap(true, Ordering::SeqCst)
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// A pipe for one child to report itself ready on ([`report_ready`]):
    /// its write end, to [`Spec::pass`] to the child. When the child
    /// writes its byte, this is set and `on_report` runs (on a thread of
    /// its own).
    pub fn pipe(&self, on_report: impl FnOnce() + Send + 'static) -> io::Result<OwnedFd> {
        let (r, w) = pipe()?;
        let ready = self.clone();
        std::thread::Builder::new()
            .name("ready-pipe".into())
            .spawn(move || {
                let mut f = std::fs::File::from(r);
                let mut b = [0u8; 1];
                if matches!(f.read(&mut b), Ok(1)) {
                    ready.set();
                    on_report();
                }
            })?;
        Ok(w)
    }
}

/// In the child: reports it is ready on the fd its supervisor passed
/// ([`Ready::pipe`]).
pub fn report_ready(fd: OwnedFd) -> io::Result<()> {
    std::fs::File::from(fd).write_all(b"r")
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills two fds we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created, owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// When the current child last said it is alive; none until it first
/// does (a child is not hung before its first beat).
#[derive(Debug, Default)]
pub struct Heartbeat(Mutex<Option<Instant>>);

impl Heartbeat {
    /// The child is alive now.
    pub fn beat(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// A new child: not heard yet.
    pub fn reset(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// How long since the last beat, if there was one.
    pub fn silence(&self) -> Option<Duration> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|t| t.elapsed())
    }
}

/// Kills a child whose heartbeat stopped: checked every `every`, hung
/// after `hung` of silence. Not once it is stopping (a child shutting down
/// may stop its heartbeat before it has written its last state).
#[derive(Debug, Clone)]
pub struct Watchdog {
    pub heartbeat: Arc<Heartbeat>,
    pub every: Duration,
    pub hung: Duration,
}

/// What the supervisor logs, in the daemon's words.
#[derive(Debug, Clone, Copy)]
pub struct Messages {
    /// The child, in errors: "manager", "driver".
    pub what: &'static str,
    /// A child exited before it was ever ready: the supervisor ends.
    pub not_ready: &'static str,
    /// A ready child exited: another starts after the backoff.
    pub restarting: &'static str,
    /// The watchdog killed a silent child.
    pub hung: &'static str,
}

enum Fd {
    /// Closed here once the child started.
    Owned(OwnedFd),
    /// The caller's; it keeps it open.
    Shared(RawFd),
}

impl Fd {
    fn raw(&self) -> RawFd {
        match self {
            Fd::Owned(f) => f.as_raw_fd(),
            Fd::Shared(f) => *f,
        }
    }
}

/// Runs its function when dropped: once the child exited, or if it never
/// started.
struct OnExit(Option<Box<dyn FnOnce() + Send>>);

impl Drop for OnExit {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// One child to start.
pub struct Spec {
    exe: PathBuf,
    arg0: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    fds: Vec<(Fd, RawFd)>,
    on_exit: OnExit,
}

impl Spec {
    pub fn new(exe: impl Into<PathBuf>) -> Self {
        let exe = exe.into();
        Self {
            arg0: exe.clone().into_os_string(),
            exe,
            args: Vec::new(),
            env: Vec::new(),
            fds: Vec::new(),
            on_exit: OnExit(None),
        }
    }

    /// This very executable (`/proc/self/exe`, even if a newer build
    /// replaced its path since), with this process's arguments;
    /// `default_arg0` when it has none.
    pub fn this_executable(default_arg0: &str) -> Self {
        let mut argv = std::env::args_os();
        let arg0 = argv.next().unwrap_or_else(|| default_arg0.into());
        Self::new("/proc/self/exe").arg0(arg0).args(argv)
    }

    pub fn arg0(mut self, arg0: impl Into<OsString>) -> Self {
        self.arg0 = arg0.into();
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The child gets `fd` as fd `at`; it is closed here once the child
    /// started (the child's alone then).
    pub fn pass(mut self, fd: OwnedFd, at: RawFd) -> Self {
        self.fds.push((Fd::Owned(fd), at));
        self
    }

    /// The child gets a copy of `fd` as fd `at`; `fd` stays the caller's,
    /// who keeps it open until the child started.
    pub fn share(mut self, fd: RawFd, at: RawFd) -> Self {
        self.fds.push((Fd::Shared(fd), at));
        self
    }

    /// `f` runs once this child has exited (or if it never started).
    pub fn on_exit(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.on_exit = OnExit(Some(Box::new(f)));
        self
    }

    /// The child started; what it was passed closed here, `on_exit` to
    /// keep until it exited.
    fn spawn(self, what: &'static str) -> Result<(tokio::process::Child, OnExit), Error> {
        let Spec {
            exe,
            arg0,
            args,
            env,
            fds,
            on_exit,
        } = self;
        let mut cmd = std::process::Command::new(&exe);
        cmd.arg0(arg0).args(args).envs(env);
        let from: Vec<RawFd> = fds.iter().map(|(f, _)| f.raw()).collect();
        let to: Vec<RawFd> = fds.iter().map(|(_, t)| *t).collect();
        inherit_fds(&mut cmd, from, to);
        let child = tokio::process::Command::from(cmd)
            .kill_on_drop(false)
            .spawn()
            .map_err(|source| Error::Spawn { what, exe, source })?;
        drop(fds);
        Ok((child, on_exit))
    }
}

/// The child gets `from[i]` as fd `to[i]`, and dies with this process.
fn inherit_fds(cmd: &mut std::process::Command, from: Vec<RawFd>, to: Vec<RawFd>) {
    // Allocated here: nothing may allocate between fork and exec.
    let mut high = vec![0 as RawFd; from.len()];
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // First above every target, so no dup2 overwrites a source
            // not yet copied; dup2 then leaves the targets without
            // FD_CLOEXEC.
            for (h, f) in high.iter_mut().zip(&from) {
                *h = libc::fcntl(*f, libc::F_DUPFD_CLOEXEC, 10);
                if *h < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (f, t) in high.iter().zip(&to) {
                if libc::dup2(*f, *t) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Exit code of a status, signals as 128 + signal (as shells report them).
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// SIGTERM/SIGINT: cancelled on the first, which it keeps.
struct Signals {
    stop: CancellationToken,
    signal: Arc<AtomicI32>,
}

impl Signals {
    fn install() -> Result<Self, Error> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(Error::Signals)?;
        let mut int = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
        let stop = CancellationToken::new();
        let signal = Arc::new(AtomicI32::new(0));
        let (t, s) = (stop.clone(), signal.clone());
        tokio::spawn(async move {
            let sig = tokio::select! {
                _ = term.recv() => {
                    tracing::info!("SIGTERM received, shutting down");
                    libc::SIGTERM
                }
                _ = int.recv() => {
                    tracing::info!("SIGINT received, shutting down");
                    libc::SIGINT
                }
            };
            s.store(sig, Ordering::SeqCst);
            t.cancel();
        });
        Ok(Self { stop, signal })
    }
}

/// Runs children one after another ([`Supervisor::run`]).
pub struct Supervisor {
    messages: Messages,
    ready: Ready,
    backoff: Backoff,
    watchdog: Option<Watchdog>,
}

impl Supervisor {
    /// `ready`: the flag the daemon (or a child, over [`Ready::pipe`])
    /// sets once a child is ready.
    pub fn new(messages: Messages, ready: Ready) -> Self {
        Self {
            messages,
            ready,
            backoff: Backoff::default(),
            watchdog: None,
        }
    }

    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    pub fn watchdog(mut self, watchdog: Watchdog) -> Self {
        self.watchdog = Some(watchdog);
        self
    }

    /// Starts a child from `next` and again when it dies, until one exits
    /// cleanly, one exits before any was ready, or SIGTERM/SIGINT (passed
    /// on to the child) stopped it: the code to exit with. Installs the
    /// signal handlers: call in a tokio runtime, once.
    pub async fn run<F>(mut self, mut next: F) -> Result<i32, Error>
    where
        F: FnMut() -> io::Result<Spec>,
    {
        let signals = Signals::install()?;
        loop {
            if let Some(w) = &self.watchdog {
                w.heartbeat.reset();
            }
            let started = Instant::now();
            let status = self.run_child(next()?, &signals).await?;
            if signals.stop.is_cancelled() || status.success() {
                return Ok(exit_code(status));
            }
            if !self.ready.is_set() {
                tracing::error!(%status, "{}", self.messages.not_ready);
                return Ok(exit_code(status).max(1));
            }
            let backoff = self.backoff.delay(started.elapsed());
            tracing::error!(%status, restart_in_ms = backoff.as_millis() as u64, "{}", self.messages.restarting);
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = signals.stop.cancelled() => return Ok(0),
            }
        }
    }

    /// One child, started; SIGTERM/SIGINT passed on, killed when hung;
    /// its exit status.
    async fn run_child(&self, spec: Spec, signals: &Signals) -> Result<ExitStatus, Error> {
        let (mut child, _on_exit) = spec.spawn(self.messages.what)?;
        let mut forwarded = false;
        let mut killed = false;
        let every = self
            .watchdog
            .as_ref()
            .map_or(Duration::from_secs(3600), |w| w.every);
        let mut watchdog = tokio::time::interval(every);
        let status = loop {
            tokio::select! {
                s = child.wait() => break s?,
                _ = watchdog.tick(), if self.watchdog.is_some() && !killed && !forwarded => {
                    let w = self.watchdog.as_ref().expect("checked above");
                    if let (Some(silent), Some(pid)) = (w.heartbeat.silence(), child.id())
                        && silent >= w.hung
                    {
                        tracing::error!(silent_s = silent.as_secs(), "{}", self.messages.hung);
                        // SAFETY: signalling our own child.
                        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                        killed = true;
                    }
                }
                () = signals.stop.cancelled(), if !forwarded => {
                    if let Some(pid) = child.id() {
                        let sig = signals.signal.load(Ordering::SeqCst);
                        // SAFETY: signalling our own child.
                        unsafe { libc::kill(pid as libc::pid_t, sig) };
                    }
                    forwarded = true;
                }
            }
        };
        Ok(status)
    }
}

#[cfg(test)]
mod tests;
