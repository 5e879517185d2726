//! The watcher thread: one per registered process (blocking `poll`, no
//! async runtime). It keeps the connection to the manager; when the manager
//! goes away it reconnects with back-off and re-registers with the slot it
//! held ([`registration::Proc::reregister`], which reconciles the slot with
//! what this process really holds). Every [`throttle::tick_interval`] it
//! runs the compute quota's [`throttle::tick`] and the memory reconcile
//! ([`mem::reconcile_tick`]).
//!
//! This module ties registration to the quotas: it installs
//! [`registration::Hooks`] (a new ledger attachment goes to
//! [`throttle::on_attach`], the first connection starts the thread, a fork
//! child forgets both), so `registration` and `throttle` import neither
//! each other nor this module.

use crate::log::log;
use crate::{lending, mem, qos, registration, throttle};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

static HOOKS: registration::Hooks = registration::Hooks {
    attached: throttle::on_attach,
    registered: start,
    forked: forget,
};

/// Installs the hooks when the library is loaded, before any CUDA call can
/// register.
#[used]
// SAFETY: a plain function pointer in .init_array, run once by the loader;
// `install` only stores a pointer.
#[unsafe(link_section = ".init_array")]
static INSTALL: extern "C" fn() = install;

extern "C" fn install() {
    registration::set_hooks(&HOOKS);
}

static WATCHING: AtomicBool = AtomicBool::new(false);
/// The connection's descriptor, for a fork child to close its copy.
static SOCK_FD: AtomicI32 = AtomicI32::new(-1);

/// Whether this process's watcher thread runs.
pub fn watching() -> bool {
    WATCHING.load(Ordering::Acquire)
}

/// The first registration's connection: watch it (one watcher per
/// process; a fork child's flag is reset with its state).
fn start(sock: UnixStream) {
    SOCK_FD.store(sock.as_raw_fd(), Ordering::Release);
    lending::set_conn(Some(&sock));
    let r = std::thread::Builder::new()
        .name("vcuda-watcher".into())
        .spawn(move || watch(sock));
    if let Err(e) = r {
        log!(Error, "cannot start the watcher thread: {e}");
    } else {
        WATCHING.store(true, Ordering::Release);
    }
}

/// In a fork child (single-threaded): drop our copy of the parent's
/// connection, so the manager sees the parent's close when the parent
/// exits; the watcher thread does not exist here; the compute quota draws
/// a new lease identity.
fn forget() {
    let fd = SOCK_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: our copy of the connection's descriptor, closed once (swapped out).
        unsafe { libc::close(fd) };
    }
    lending::after_fork_child();
    WATCHING.store(false, Ordering::Release);
    throttle::after_fork_child();
}

fn tick() {
    throttle::tick(registration::container_pids);
    // Memory the driver took on its own (contexts, pools): NVML reconcile.
    mem::reconcile_tick();
    if qos::flags_wanted() {
        lending::ask_qos_flags();
    }
}

fn watch(mut sock: UnixStream) {
    // This thread never captures: the application's GLOBAL-mode captures
    // must not make its driver calls (pool attributes on the tick) prohibited,
    // which would invalidate them.
    crate::graph::thread_local_mode();
    let my_proc = registration::proc();
    loop {
        let interval = throttle::tick_interval();
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on our stack.
        let n = unsafe { libc::poll(&mut pfd, 1, interval.as_millis().min(60_000) as i32) };
        tick();
        if n <= 0 {
            continue;
        }
        // The manager sends only answers to our requests (the latency
        // flags' with descriptors); EOF or an error means it went away.
        let max = vcuda_api::vcuda::frame::MAX_FRAME;
        match container_ledger::fdpass::recv_frame_fds(sock.as_fd(), max) {
            Ok((body, fds)) => {
                lending::deliver(&body, fds);
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => {}
        }
        lending::set_conn(None);
        log!(
            Warn,
            "the GPU manager closed the connection; re-registering"
        );
        SOCK_FD.store(-1, Ordering::Release);
        drop(sock);
        sock = reconnect(my_proc);
        SOCK_FD.store(sock.as_raw_fd(), Ordering::Release);
        lending::set_conn(Some(&sock));
    }
}

/// Reconnects until the manager is back, keeping the ledger slot; the
/// quotas' ticks go on meanwhile.
fn reconnect(p: &registration::Proc) -> UnixStream {
    let mut backoff = Duration::from_millis(50);
    loop {
        std::thread::sleep(backoff);
        throttle::tick(registration::container_pids);
        match p.reregister() {
            Ok((s, resp)) => {
                log!(
                    Info,
                    "re-registered: host pid {}, ledger slot {:?}",
                    resp.host_pid,
                    resp.ledger_slot
                );
                return s;
            }
            Err(e) => {
                log!(Debug, "re-registration failed: {e}");
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}
