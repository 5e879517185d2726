//! The process's registration with the manager and its share of the
//! container ledger.
//!
//! Protocol (`proto/vcuda/registration.proto`): connect to
//! `<config dir>/vcuda.sock`, send a `RegisterRequest` frame, read the
//! `RegisterResponse` frame with the ledger's descriptor attached
//! (SCM_RIGHTS), map the ledger, keep the connection open for the life of
//! the process. The manager knows the caller by SO_PEERCRED (a host PID)
//! and, when the connection closes, clears the process's ledger slot: a dead
//! process's memory was freed by the driver.
//!
//! A container whose share spans several GPUs registers at protocol 2: the
//! reply carries one ledger descriptor and slot per GPU, in the order of
//! `vcuda-gpus.config`'s records. A one-GPU container keeps speaking
//! protocol 1, so it registers with a manager that knows only that.
//!
//! What happens around a registration is not this module's business: the
//! connection, a new ledger attachment and a fork go to [`Hooks`], which
//! `crate::watcher` installs (the watcher thread keeps the connection,
//! re-registers through [`Proc::reregister`] and drives the quotas'
//! periodic work). This module imports neither the watcher nor the quotas.
//!
//! Fork: the child gets a fresh, unregistered state (a new `Proc`) and
//! registers on its own at its next CUDA call, which also starts its own
//! watcher.

use crate::config::{self, Enforce};
use crate::log::{self, log};
use crate::qos::Grant;
use crate::table::AllocTable;
use container_ledger::{Ledger, fdpass};
use qos_page::{Flag, QosPage, Tier};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, Once, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};
use thiserror::Error;
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse, frame, register_response::Status};

/// Returned by CUDA calls refused because the process has no quota to run
/// under (no config, corrupt config, no manager).
pub const REFUSED: cuda_abi::CUresult = cuda_abi::CUDA_ERROR_NOT_PERMITTED;

/// This process's place in one GPU's ledger.
pub struct Held {
    pub ledger: Ledger,
    pub slot: usize,
    /// The GPU's memory quota, from the read-only quota file: what every
    /// reservation is checked against. Never the ledger's header word,
    /// which any process of the container can write.
    pub quota: u64,
    /// What a borrower may hold above `quota` by asking the manager
    /// (`crate::lending`); 0: it never borrows.
    pub limit: u64,
    file_id: (u64, u64),
    /// Kept open for the life of the attachment: a restarted manager takes
    /// the live ledger back from a registered process's descriptors
    /// (`node-agent`'s `ledgers`).
    _fd: OwnedFd,
}

/// This process's place in the container's ledgers: one per GPU of the
/// share, in record order (`crate::devices` maps a device to its position).
pub struct Attach {
    pub gpus: Vec<Held>,
    pub host_pid: i32,
    /// The manager takes lent memory back for an allocation within the
    /// quota that fails for memory.
    pub reclaim: bool,
}

impl Attach {
    /// The first GPU's ledger: a one-GPU container's only one.
    pub fn first(&self) -> &Held {
        &self.gpus[0]
    }

    /// The ledger of the GPU at `position` (positions come from the same
    /// records the ledgers were checked against; clamped for safety).
    pub fn gpu(&self, position: usize) -> &Held {
        &self.gpus[position.min(self.gpus.len() - 1)]
    }
}

/// Per-process state; replaced wholesale in a fork child.
pub struct Proc {
    attach: RwLock<Option<Attach>>,
    registered: AtomicBool,
    /// Serialises registration; holds the sticky failure, if any.
    reg: Mutex<Option<String>>,
    pub table: AllocTable,
    /// Bytes this process holds on each GPU of the share (what its slot in
    /// that GPU's ledger should say).
    pub local_used: Box<[AtomicU64]>,
    /// Memory requests on the registration connection.
    pub chan: crate::lending::Chan,
}

static PROC: AtomicPtr<Proc> = AtomicPtr::new(std::ptr::null_mut());

/// What the rest of the interposer does around a registration.
pub struct Hooks {
    /// The process got (or changed) its ledger and slot on the GPU at a
    /// position of the share (under the attachment's write lock: no
    /// allocation is in flight).
    pub attached: fn(usize, &Ledger, usize),
    /// The first registration succeeded: the connection, to keep open for
    /// the life of the process (the manager clears the slot when it closes).
    pub registered: fn(UnixStream),
    /// In a fork child, after its state was replaced (single-threaded: no
    /// locks another thread may hold).
    pub forked: fn(),
}

/// Until [`set_hooks`]: the connection is leaked (kept open), nothing else.
static NO_HOOKS: Hooks = Hooks {
    attached: |_, _, _| {},
    registered: |s| std::mem::forget(s),
    forked: || {},
};
static HOOKS: AtomicPtr<Hooks> = AtomicPtr::new(&NO_HOOKS as *const Hooks as *mut Hooks);

/// Installs the hooks (once, before the first registration).
pub fn set_hooks(h: &'static Hooks) {
    HOOKS.store(h as *const Hooks as *mut Hooks, Ordering::Release);
}

fn hooks() -> &'static Hooks {
    // SAFETY: only ever set to a `&'static Hooks`.
    unsafe { &*HOOKS.load(Ordering::Acquire) }
}

impl Proc {
    fn new() -> Proc {
        Proc {
            attach: RwLock::new(None),
            registered: AtomicBool::new(false),
            reg: Mutex::new(None),
            table: AllocTable::default(),
            local_used: (0..config::enforce().map_or(1, |e| e.gpus()))
                .map(|_| AtomicU64::new(0))
                .collect(),
            chan: Default::default(),
        }
    }

    /// Registers with the manager unless done (a load on the fast path).
    /// Pass-through processes need nothing. On failure the reason was
    /// printed and the call should return [`REFUSED`].
    #[inline]
    pub fn ensure_registered(&self) -> Result<(), cuda_abi::CUresult> {
        if self.registered.load(Ordering::Acquire) {
            return Ok(());
        }
        self.register_slow()
    }

    #[cold]
    fn register_slow(&self) -> Result<(), cuda_abi::CUresult> {
        let enf = match config::mode() {
            config::Mode::PassThrough => return Ok(()),
            config::Mode::Closed(reason) => {
                log::fail_closed(reason);
                return Err(REFUSED);
            }
            config::Mode::Enforce(e) => e,
        };
        let mut failed = self.reg.lock().unwrap_or_else(|e| e.into_inner());
        if self.registered.load(Ordering::Acquire) {
            return Ok(());
        }
        if failed.is_some() {
            return Err(REFUSED);
        }
        let timeout = config::register_timeout();
        let deadline = Instant::now() + timeout;
        let mut noticed = false;
        loop {
            match register_once(enf, &[], deadline) {
                Ok((sock, resp, fds)) => match self.install(&resp, fds) {
                    Ok(()) => {
                        self.registered.store(true, Ordering::Release);
                        log!(
                            Info,
                            "registered: host pid {}, ledger slot {:?}{}",
                            resp.host_pid,
                            resp.ledger_slot,
                            if resp.ledger_slots.len() > 1 {
                                format!(" (per GPU: {:?})", resp.ledger_slots)
                            } else {
                                String::new()
                            }
                        );
                        (hooks().registered)(sock);
                        return Ok(());
                    }
                    Err(e) => {
                        let msg = format!("GPU manager registration failed: {e}; refusing CUDA");
                        log::fail_closed(&msg);
                        *failed = Some(msg);
                        return Err(REFUSED);
                    }
                },
                Err(e) if e.retryable() && Instant::now() < deadline => {
                    let waited = timeout.saturating_sub(deadline - Instant::now());
                    if !noticed && waited >= Duration::from_millis(config::REGISTER_WAIT_NOTICE_MS)
                    {
                        noticed = true;
                        log::write_line(&format!(
                            "waiting for the GPU manager at {} ({e}): restarting or upgrading? \
                             CUDA starts once it answers, or is refused after {} ms \
                             ({})",
                            socket_path(enf).display(),
                            timeout.as_millis(),
                            config::REGISTER_TIMEOUT_ENV
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(25));
                }
                Err(e) => {
                    let msg = format!(
                        "cannot register with the GPU manager at {} (waited {} ms): {e}; refusing CUDA",
                        socket_path(enf).display(),
                        timeout.as_millis()
                    );
                    log::fail_closed(&msg);
                    *failed = Some(msg);
                    return Err(REFUSED);
                }
            }
        }
    }

    /// Bytes this process holds on the GPU at `position`.
    pub fn used_on(&self, position: usize) -> &AtomicU64 {
        &self.local_used[position.min(self.local_used.len() - 1)]
    }

    /// Maps the ledgers the manager passed (one per GPU, record order) and
    /// makes our slot in each hold exactly what this process holds there.
    fn install(&self, resp: &RegisterResponse, fds: Vec<OwnedFd>) -> Result<(), RegError> {
        let slots: Vec<usize> = if resp.ledger_slots.is_empty() {
            let slot = resp
                .ledger_slot
                .ok_or_else(|| RegError::Protocol("the reply has no ledger slot".into()))?;
            vec![slot as usize]
        } else {
            resp.ledger_slots.iter().map(|&s| s as usize).collect()
        };
        if fds.is_empty() {
            return Err(RegError::Protocol(
                "the reply carries no ledger descriptor".into(),
            ));
        }
        let want = self.local_used.len();
        if slots.len() != want || fds.len() < want {
            return Err(RegError::Protocol(format!(
                "the share spans {want} GPU(s) but the reply carries {} ledger(s) and {} slot(s)",
                fds.len(),
                slots.len()
            )));
        }
        let mut fds = fds;
        let extra = fds.split_off(want);
        let qos = qos_of(resp, extra)?;
        let quotas: Vec<u64> = config::enforce()
            .map(|e| e.gpus.iter().map(|g| g.gpu_memory).collect())
            .unwrap_or_default();
        let mut gpus = Vec::with_capacity(want);
        for (i, (&slot, fd)) in slots.iter().zip(fds).enumerate() {
            if slot >= container_ledger::SLOTS {
                return Err(RegError::Protocol(format!(
                    "ledger slot {slot} out of range"
                )));
            }
            let ledger =
                Ledger::from_fd(fd.as_fd()).map_err(|e| RegError::Ledger(e.to_string()))?;
            gpus.push(Held {
                ledger,
                slot,
                quota: quotas.get(i).copied().unwrap_or(0),
                limit: if i == 0 { resp.memory_limit } else { 0 },
                file_id: file_id(&fd),
                _fd: fd,
            });
        }
        let mut w = self.attach.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = w.as_ref() {
            for (o, n) in old.gpus.iter().zip(&gpus) {
                if o.file_id == n.file_id
                    && o.slot != n.slot
                    && o.ledger.slot(o.slot).is_some_and(|s| s.pid == old.host_pid)
                {
                    // Same ledger, new slot: do not leave our bytes counted twice.
                    o.ledger.clear_slot(o.slot);
                }
            }
        }
        // No allocation is in flight in this process (write lock).
        let local_pid = std::process::id() as i32;
        for (i, g) in gpus.iter().enumerate() {
            g.ledger
                .reconcile(g.slot, self.local_used[i].load(Ordering::Acquire));
            g.ledger.set_local_pid(g.slot, local_pid);
        }
        for (i, g) in gpus.iter().enumerate() {
            (hooks().attached)(i, &g.ledger, g.slot);
        }
        *w = Some(Attach {
            gpus,
            host_pid: resp.host_pid,
            reclaim: resp.reclaim,
        });
        crate::qos::on_register(qos.0, qos.1);
        Ok(())
    }

    /// The ledger attachment for the duration of an allocation or free.
    /// Many threads hold it at once; re-registration waits for them.
    pub fn attach(&self) -> RwLockReadGuard<'_, Option<Attach>> {
        self.attach.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// Registers again after the manager went away, asking for the slot
    /// this process held, and installs the reply: the new connection.
    pub fn reregister(&self) -> Result<(UnixStream, RegisterResponse), RegError> {
        let Some(enf) = config::enforce() else {
            return Err(RegError::Protocol("not enforcing".into()));
        };
        let prev: Vec<usize> = self
            .attach()
            .as_ref()
            .map(|a| a.gpus.iter().map(|g| g.slot).collect())
            .unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(2);
        let (sock, resp, fds) = register_once(enf, &prev, deadline)?;
        self.install(&resp, fds)?;
        Ok((sock, resp))
    }
}

/// argv[0] for the manager's logs, cut to the 256 bytes it accepts
/// (`node-agent`'s `registry::budget::MAX_PROGRAM`): a longer request is
/// refused.
fn program_name() -> String {
    let mut p = std::env::args_os()
        .next()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    if p.len() > 256 {
        let mut end = 256;
        while !p.is_char_boundary(end) {
            end -= 1;
        }
        p.truncate(end);
    }
    p
}

/// This process's state.
#[inline]
pub fn proc() -> &'static Proc {
    let p = PROC.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a non-NULL PROC came from Box::into_raw (proc_init or atfork_child) and is
        // never freed (a replaced one is leaked), so it is valid for 'static.
        return unsafe { &*p };
    }
    proc_init()
}

#[cold]
fn proc_init() -> &'static Proc {
    static ATFORK: Once = Once::new();
    init_per_process(&PROC, &ATFORK, atfork_child, Proc::new)
}

/// First use of a per-process state kept in `slot` (a leaked object that a
/// fork child replaces): registers `child` with pthread_atfork (once, as
/// `atfork` guards), then publishes a fresh `make()` in `slot` unless
/// another thread published first, and returns whichever is published.
/// `slot` only ever holds NULL or pointers from Box::into_raw that are
/// never freed.
pub(crate) fn init_per_process<T>(
    slot: &'static AtomicPtr<T>,
    atfork: &'static Once,
    child: extern "C" fn(),
    make: impl FnOnce() -> T,
) -> &'static T {
    // SAFETY: pthread_atfork with a plain extern "C" handler that lives as long as the process;
    // registered once.
    atfork.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(child));
    });
    let fresh = Box::into_raw(Box::new(make()));
    match slot.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: `fresh` came from Box::into_raw just above and is now published in `slot`,
        // never freed: valid for 'static.
        Ok(_) => unsafe { &*fresh },
        Err(existing) => {
            // SAFETY: `fresh` came from Box::into_raw above and lost the race, so no one else
            // has seen it: freed once, here.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: `existing` is the published one: from Box::into_raw, never freed.
            unsafe { &*existing }
        }
    }
}

/// In the child of fork(): only this thread exists. The parent's state
/// (its registration, slot and allocations) is not ours; start afresh (the
/// hooks drop the child's copy of the parent's connection). The old state
/// is leaked: another thread may have held its locks at fork time.
extern "C" fn atfork_child() {
    let fresh = Box::into_raw(Box::new(Proc::new()));
    PROC.store(fresh, Ordering::Release);
    (hooks().forked)();
}

fn file_id(fd: &OwnedFd) -> (u64, u64) {
    // SAFETY: `libc::stat` is plain integers, for which all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a descriptor we own, filling our local `st`.
    unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    (st.st_dev, st.st_ino)
}

#[derive(Debug, Error)]
pub enum RegError {
    #[error("{0}")]
    Connect(std::io::Error),
    #[error("talking to the manager: {0}")]
    Io(std::io::Error),
    #[error("the manager rejected this process: {0}")]
    Rejected(String),
    #[error("bad reply from the manager: {0}")]
    Protocol(String),
    #[error("cannot map the container ledger: {0}")]
    Ledger(String),
}

impl RegError {
    /// The manager may just not be up yet.
    fn retryable(&self) -> bool {
        match self {
            RegError::Connect(e) => matches!(
                e.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
            ),
            RegError::Io(_) => true,
            _ => false,
        }
    }
}

pub fn socket_path(enf: &Enforce) -> PathBuf {
    enf.dir.join(quota_config::SOCKET_FILE)
}

/// One registration attempt: the connection, the reply and the ledger
/// descriptors (record order). `previous_slots`: the slot held in each
/// ledger, when re-registering.
fn register_once(
    enf: &Enforce,
    previous_slots: &[usize],
    deadline: Instant,
) -> Result<(UnixStream, RegisterResponse, Vec<OwnedFd>), RegError> {
    let sock = UnixStream::connect(socket_path(enf)).map_err(RegError::Connect)?;
    // Bounded handshake; the watcher later waits with poll().
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(500));
    sock.set_read_timeout(Some(left)).map_err(RegError::Io)?;
    sock.set_write_timeout(Some(left)).map_err(RegError::Io)?;
    let gpus = enf.gpus();
    let req = RegisterRequest {
        protocol_version: if gpus > 1 {
            frame::PROTOCOL_VERSION_MULTI_GPU
        } else {
            frame::PROTOCOL_VERSION
        },
        pod_uid: enf.data.pod_uid.clone(),
        container_name: enf.data.container_name.clone(),
        bus_id: enf.data.bus_id.clone(),
        local_pid: std::process::id() as i32,
        program: program_name(),
        qos_pages: true,
        qos_flags: true,
        previous_slot: previous_slots.first().map(|&s| s as u32),
        previous_slots: if gpus > 1 {
            previous_slots.iter().map(|&s| s as u32).collect()
        } else {
            Vec::new()
        },
    };
    // sendmsg(MSG_NOSIGNAL), stated rather than left to std's choice of
    // syscall: a manager gone mid-registration must be a retryable EPIPE,
    // never a SIGPIPE that kills a C host with the default disposition.
    let body = prost::Message::encode_to_vec(&req);
    fdpass::send_frame(sock.as_fd(), &body, None).map_err(RegError::Io)?;
    let (body, fds) =
        fdpass::recv_frame_fds(sock.as_fd(), frame::MAX_FRAME).map_err(RegError::Io)?;
    let resp = <RegisterResponse as prost::Message>::decode(body.as_slice())
        .map_err(|e| RegError::Protocol(e.to_string()))?;
    if resp.protocol_version != 0 && resp.protocol_version != req.protocol_version {
        return Err(RegError::Protocol(format!(
            "the manager answered in protocol version {}; this interposer asked for {} and \
             speaks {} and {}",
            resp.protocol_version,
            req.protocol_version,
            frame::PROTOCOL_VERSION,
            frame::PROTOCOL_VERSION_MULTI_GPU
        )));
    }
    if resp.status() != Status::Accepted {
        return Err(RegError::Rejected(if resp.message.is_empty() {
            format!("status {:?}", resp.status())
        } else {
            resp.message.clone()
        }));
    }
    // The ledgers' descriptors, then the QoS pages' it names.
    let ledger_fds = fds.len().saturating_sub(resp.qos_pages as usize);
    if gpus > 1 && (ledger_fds != gpus || resp.ledger_slots.len() != gpus) {
        return Err(RegError::Protocol(format!(
            "the container's share spans {gpus} GPUs but the reply carries {ledger_fds} ledger \
             descriptor(s) and {} slot(s)",
            resp.ledger_slots.len()
        )));
    }
    sock.set_read_timeout(None).map_err(RegError::Io)?;
    sock.set_write_timeout(None).map_err(RegError::Io)?;
    Ok((sock, resp, fds))
}

/// The compute tier the reply names and the QoS pages it carries (the
/// descriptors after the ledgers': one for a one-GPU share, `qos_pages` for
/// one on several GPUs), each with a latency process's slot.
fn qos_of(resp: &RegisterResponse, extra: Vec<OwnedFd>) -> Result<(Tier, Vec<Grant>), RegError> {
    let tier = Tier::from_wire(resp.qos_tier);
    let (n, slots): (usize, Vec<u32>) = if resp.qos_pages > 0 {
        (resp.qos_pages as usize, resp.qos_slots.clone())
    } else if resp.qos_page {
        (1, resp.qos_slot.into_iter().collect())
    } else {
        return Ok((tier, Vec::new()));
    };
    if extra.len() < n {
        return Err(RegError::Protocol(format!(
            "the reply names {n} QoS page(s) but carries {} descriptor(s) for them",
            extra.len()
        )));
    }
    if !slots.is_empty() && slots.len() != n {
        return Err(RegError::Protocol(format!(
            "the reply names {n} QoS page(s) but {} latency slot(s)",
            slots.len()
        )));
    }
    if let Some(s) = slots.iter().find(|&&s| s as usize >= qos_page::SLOTS) {
        return Err(RegError::Protocol(format!("QoS slot {s} out of range")));
    }
    let mut grants = Vec::with_capacity(n);
    for (i, fd) in extra.iter().take(n).enumerate() {
        // The mapping outlives the descriptor (closed when `extra` drops).
        // A latency process (with its slots) is handed its flags, a batch
        // one the GPU's pages.
        let g = if tier == Tier::Latency && !slots.is_empty() {
            Flag::adopt(fd.as_fd()).map(Grant::Latency)
        } else {
            QosPage::from_fd(fd.as_fd()).map(Grant::Batch)
        };
        match g {
            Ok(g) => grants.push(g),
            // A tier orders tenants, it bounds nobody: without it the
            // process runs as a plain share, its quotas as they are.
            Err(e) => {
                log!(
                    Warn,
                    "QoS descriptor {i} of the reply: {e}: this process runs as a plain share"
                );
                return Ok((Tier::Plain, Vec::new()));
            }
        }
    }
    Ok((tier, grants))
}

/// The PIDs NVML may name the container's processes by: their host PIDs
/// (the manager's `pids.config`, plus this process's: the manager may not
/// have written it yet) and their PIDs in the container's own PID namespace
/// (each process writes its own into its ledger slots; this process's is
/// added here). The driver names processes of the caller's namespace by
/// their namespace PIDs and everyone else's by host PIDs (driver 580,
/// `tests/gpu/probes/nvml_pidns.py`), so a container without hostPID needs
/// both. A local PID can equal another namespace's host PID only when that
/// process is among the host's first few hundred: a GPU process there
/// would be charged to this container (throttled harder, never freer).
pub fn container_pids() -> Vec<i32> {
    let mut pids = Vec::new();
    let enf = config::enforce();
    if let Some(enf) = enf
        && let Ok(b) = std::fs::read(enf.dir.join(quota_config::PIDS_FILE))
        && let Ok(p) = quota_config::decode_pids(&b)
    {
        pids = p;
    }
    let mut add = |p: i32| {
        if p > 0 && !pids.contains(&p) {
            pids.push(p);
        }
    };
    add(std::process::id() as i32);
    match proc().attach().as_ref() {
        Some(a) => {
            add(a.host_pid);
            for g in &a.gpus {
                g.ledger.slots().for_each(|s| add(s.local_pid));
            }
        }
        // An NVML-only tool (never registers): the ledger files, read-only.
        None => {
            if let Some(enf) = enf {
                for gpu in 0..enf.gpus.len() {
                    let path = ledger_for_tools(enf, gpu);
                    if let Ok(local) = container_ledger::Ledger::peek_local_pids(&path) {
                        local.into_iter().for_each(&mut add);
                    }
                }
            }
        }
    }
    pids
}

/// Where a process that does not register (an NVML-only tool) reads GPU
/// `gpu`'s ledger: the memfd a registered process of the container holds
/// (`/proc/<pid>/fd/<n>`, opened read-only: root in the container, or its
/// owner) whose inode the manager recorded in `<ledger>.id`, or a ledger
/// file in the container directory (a manager of an older release). Found
/// once per process, looked for again when gone.
pub fn ledger_for_tools(enf: &Enforce, gpu: usize) -> PathBuf {
    static FOUND: Mutex<Vec<Option<PathBuf>>> = Mutex::new(Vec::new());
    let file = enf.dir.join(quota_config::ledger_file(gpu));
    if file.exists() {
        return file;
    }
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if found.len() <= gpu {
        found.resize(gpu + 1, None);
    }
    if let Some(p) = &found[gpu]
        && p.exists()
    {
        return p.clone();
    }
    // The inode the manager recorded beside the quota: with hostPID, /proc
    // also shows other containers' ledgers under the same name, so without
    // that record no memfd is taken (the caller falls back to the driver's
    // per-process use). Taking any memfd of the name once showed a tool
    // another container's use (shim_entry's soak, beside a real manager).
    let Some(id) = std::fs::read_to_string(enf.dir.join(quota_config::ledger_id_file(gpu)))
        .ok()
        .and_then(|t| container_ledger::MemfdId::parse(&t))
    else {
        return file;
    };
    let hit = container_ledger::memfd_paths(gpu, id, container_ledger::proc_pids()).next();
    found[gpu] = hit.clone();
    hit.unwrap_or(file)
}
