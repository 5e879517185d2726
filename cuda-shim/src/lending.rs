//! Memory requests to the manager (docs/qos.md, "Memory";
//! `MemoryRequest` in proto/vcuda/registration.proto): borrowing above the
//! quota, reclaiming lent memory for an allocation within it, and how much
//! a borrower may still take.
//!
//! They travel on the registration connection. The watcher thread is its
//! only reader: it hands each `MemoryResponse` frame to [`deliver`], and
//! the asking thread waits for it here. One request is in flight per
//! process. The cold path only: an allocation within the quota never gets
//! here.

use crate::log::log;
use crate::registration::proc;
use prost::Message;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};
use vcuda_api::vcuda::memory_request::Kind;
use vcuda_api::vcuda::memory_response::Status;
use vcuda_api::vcuda::{MemoryRequest, MemoryResponse, frame};

/// A copy of the registration connection's descriptor to write requests
/// on (-1: none); swapped under the process's send lock.
static REQ_FD: AtomicI32 = AtomicI32::new(-1);

/// Longer than the manager's wait for an ended borrower (10 s).
const ANSWER_WITHIN: Duration = Duration::from_secs(15);

/// The exchange's state, per process (a fork child's is new).
#[derive(Default)]
pub struct Chan {
    /// Held for a whole request: one in flight.
    one: std::sync::Mutex<()>,
    /// Held while writing (and while the watcher swaps the descriptor).
    send: std::sync::Mutex<()>,
    answer: std::sync::Mutex<Answer>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct Answer {
    /// Bumped when the connection is replaced: a waiter of an older one
    /// gives up.
    conn: u64,
    resp: Option<MemoryResponse>,
}

/// The watcher's new connection (or `None`: it went away).
pub fn set_conn(sock: Option<&std::os::unix::net::UnixStream>) {
    use std::os::fd::AsRawFd;
    let c = &proc().chan;
    let _s = c.send.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: dup of a descriptor the watcher owns and keeps open for this call.
    let new = sock.map_or(-1, |s| unsafe {
        libc::fcntl(s.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0)
    });
    let old = REQ_FD.swap(new, Ordering::AcqRel);
    if old >= 0 {
        // SAFETY: our own dup, swapped out above: closed once.
        unsafe { libc::close(old) };
    }
    let mut a = c.answer.lock().unwrap_or_else(|e| e.into_inner());
    a.conn += 1;
    c.cv.notify_all();
}

/// In a fork child (single-threaded): its copy of the parent's
/// connection must not keep the parent registered.
pub fn after_fork_child() {
    let fd = REQ_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: our copy, swapped out: closed once.
        unsafe { libc::close(fd) };
    }
}

/// A frame the watcher read on the connection, with the descriptors it
/// carried: the latency flags' answer goes to [`crate::qos`], any other to
/// the thread waiting for it.
pub fn deliver(body: &[u8], fds: Vec<std::os::fd::OwnedFd>) {
    let resp = match MemoryResponse::decode(body) {
        Ok(r) => r,
        Err(e) => {
            log!(
                Warn,
                "the manager sent a frame that is no MemoryResponse: {e}"
            );
            return;
        }
    };
    if resp.qos {
        let flags: Vec<(u32, u32)> = resp.qos_flags.iter().map(|f| (f.page, f.slot)).collect();
        crate::qos::on_flags(&flags, fds);
        return;
    }
    let c = &proc().chan;
    c.answer.lock().unwrap_or_else(|e| e.into_inner()).resp = Some(resp);
    c.cv.notify_all();
}

/// Asks for the GPUs' latency flags (the watcher, which reads the answer
/// itself: it does not wait). Not counted as the one request in flight:
/// its answer is told apart by `qos`.
pub fn ask_qos_flags() {
    if !send(Kind::QosFlags, 0) {
        log!(
            Debug,
            "asking for the latency flags: no connection, or it refused it"
        );
    }
}

/// Writes one request frame on the connection (under the send lock);
/// `false` when there is none or the write failed.
fn send(kind: Kind, bytes: u64) -> bool {
    let req = MemoryRequest {
        kind: kind as i32,
        bytes,
    };
    let Ok(buf) = frame::encode(&req) else {
        return false;
    };
    let c = &proc().chan;
    let _s = c.send.lock().unwrap_or_else(|e| e.into_inner());
    let fd = REQ_FD.load(Ordering::Acquire);
    fd >= 0 && send_all(fd, &buf)
}

/// Sends one request and waits for its answer; `None` when there is no
/// connection or no answer in time (a manager that predates these
/// requests never answers).
fn ask(kind: Kind, bytes: u64) -> Option<MemoryResponse> {
    let c = &proc().chan;
    let _one = c.one.lock().unwrap_or_else(|e| e.into_inner());
    let conn = {
        let mut a = c.answer.lock().unwrap_or_else(|e| e.into_inner());
        a.resp = None;
        a.conn
    };
    if !send(kind, bytes) {
        return None;
    }
    let deadline = Instant::now() + ANSWER_WITHIN;
    let mut a = c.answer.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(r) = a.resp.take() {
            return Some(r);
        }
        let left = deadline.checked_duration_since(Instant::now())?;
        if a.conn != conn {
            return None;
        }
        a =
            c.cv.wait_timeout(a, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
    }
}

fn send_all(fd: i32, mut buf: &[u8]) -> bool {
    while !buf.is_empty() {
        // SAFETY: writes from our own buffer, at most its length.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        buf = &buf[n as usize..];
    }
    true
}

/// Asks the manager to reserve `bytes` above the quota (it writes the
/// process's ledger slot). `true`: reserved.
#[cold]
pub fn borrow(bytes: u64) -> bool {
    match ask(Kind::Borrow, bytes) {
        Some(r) if r.status == Status::Granted as i32 => true,
        Some(r) => {
            log!(Info, "borrowing {bytes} bytes refused: {}", r.message);
            false
        }
        None => {
            log!(Warn, "borrowing {bytes} bytes: the manager did not answer");
            false
        }
    }
}

/// An allocation within the quota failed for memory: asks the manager to
/// take lent memory back. `true`: some came back (retry the allocation).
#[cold]
pub fn reclaim(bytes: u64) -> bool {
    match ask(Kind::Reclaim, bytes) {
        Some(r) if r.status == Status::Granted as i32 => {
            log!(
                Info,
                "{} bytes of lent memory reclaimed for an allocation of {bytes}",
                r.reclaimed
            );
            true
        }
        Some(r) => {
            log!(Debug, "reclaim for {bytes} bytes: {}", r.message);
            false
        }
        None => false,
    }
}

/// Bytes this borrower may still allocate (`None`: no answer).
#[cold]
pub fn available() -> Option<u64> {
    ask(Kind::Info, 0)
        .filter(|r| r.status == Status::Granted as i32)
        .map(|r| r.available)
}
