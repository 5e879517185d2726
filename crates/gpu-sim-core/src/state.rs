//! State shared by every process that uses the simulated driver.
//!
//! One file, `<root>/run/gpu-sim/state`, mapped `MAP_SHARED` by each process
//! (including processes in containers that have the directory mounted). It
//! holds, per GPU, the memory in use and the kernel timeline; a table of
//! processes with their memory per GPU; and a ring of injected Xid events.
//! Everything in it is an atomic, so no process ever blocks another.
//!
//! Liveness of a process slot is an OFD byte-range lock on `procs.lock`, held
//! by the owning process: the kernel drops it when the process dies, however it
//! dies, and any process can then reclaim the slot and the memory it held —
//! the real driver frees a dead process's memory the same way.

use crate::node::{MAX_GPUS, NodeError, NodeSpec};
use std::ffi::{CStr, CString};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::*};
use thiserror::Error;

/// Process slots in the shared table.
pub const MAX_PROCS: usize = 256;
/// Kernel intervals remembered per GPU for utilization sampling.
pub const RING: usize = 16384;
/// Xid events remembered.
pub const XID_RING: usize = 64;

const MAGIC: [u8; 8] = *b"GPUSIM\0\x01";
const LAYOUT_VERSION: u32 = 1;
/// Inode number of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;

/// Environment variable that names the simulated root explicitly.
pub const ROOT_ENV: &str = "GPU_SIM_ROOT";

#[derive(Debug, Error)]
pub enum StateError {
    #[error(
        "gpu-sim state not found: no run/gpu-sim/node.toml under {searched}; \
         run `gpu-sim install --node FILE --root DIR` first, or set {ROOT_ENV}=DIR"
    )]
    NotInstalled { searched: String },
    #[error("gpu-sim state {path}: {message}")]
    Corrupt { path: String, message: String },
    #[error("gpu-sim state {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("all {MAX_PROCS} simulated process slots are in use")]
    TooManyProcesses,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where a simulated node is installed: `<root>/run/gpu-sim` holds the node
/// description and the shared state, `<root>/dev` the device nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRoot {
    pub root: PathBuf,
}

impl SimRoot {
    pub fn new(root: impl Into<PathBuf>) -> SimRoot {
        SimRoot { root: root.into() }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join("run/gpu-sim")
    }
    pub fn node_file(&self) -> PathBuf {
        self.state_dir().join("node.toml")
    }
    pub fn state_file(&self) -> PathBuf {
        self.state_dir().join("state")
    }
    pub fn lock_file(&self) -> PathBuf {
        self.state_dir().join("procs.lock")
    }
    pub fn dev_dir(&self) -> PathBuf {
        self.root.join("dev")
    }
    pub fn device_node(&self, minor: u32) -> PathBuf {
        self.dev_dir().join(format!("nvidia{minor}"))
    }

    /// Finds the root a library belongs to: `$GPU_SIM_ROOT` if set, else the
    /// nearest ancestor of `anchor` (the library's own file) that holds
    /// `run/gpu-sim/node.toml`. Inside a container the libraries sit under
    /// `/usr/local/nvidia` and the state is mounted at `/run/gpu-sim`, so the
    /// walk ends at `/`.
    pub fn locate(anchor: Option<&Path>) -> Result<SimRoot, StateError> {
        if let Some(root) = std::env::var_os(ROOT_ENV).filter(|v| !v.is_empty()) {
            let r = SimRoot::new(PathBuf::from(root));
            if r.node_file().is_file() {
                return Ok(r);
            }
            return Err(StateError::NotInstalled {
                searched: format!("{ROOT_ENV}={}", r.root.display()),
            });
        }
        let mut searched = Vec::new();
        if let Some(anchor) = anchor {
            let start = anchor
                .canonicalize()
                .unwrap_or_else(|_| anchor.to_path_buf());
            for dir in start.ancestors().skip(1) {
                let r = SimRoot::new(dir);
                if r.node_file().is_file() {
                    return Ok(r);
                }
                searched.push(dir.display().to_string());
            }
        } else {
            let r = SimRoot::new("/");
            if r.node_file().is_file() {
                return Ok(r);
            }
            searched.push("/".into());
        }
        Err(StateError::NotInstalled {
            searched: searched.join(", "),
        })
    }
}

/// Path of the shared object that contains `addr` (dladdr), so a library can
/// find where it was loaded from.
pub fn object_path_of(addr: usize) -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables.
    if unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) } == 0
        || info.dli_fname.is_null()
    {
        return None;
    }
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// CLOCK_MONOTONIC in nanoseconds. Served by the vDSO: no syscall.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Converts a monotonic timestamp to microseconds since the Unix epoch, as
/// NVML reports sample times.
pub fn mono_to_epoch_us(mono_ns: u64) -> u64 {
    let mut rt = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut rt) };
    let rt_ns = rt.tv_sec as u64 * 1_000_000_000 + rt.tv_nsec as u64;
    let now = now_ns();
    (rt_ns as i128 - (now as i128 - mono_ns as i128)).max(0) as u64 / 1000
}

/// Inverse of [`mono_to_epoch_us`].
pub fn epoch_us_to_mono(epoch_us: u64) -> u64 {
    let mut rt = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut rt) };
    let rt_ns = rt.tv_sec as i128 * 1_000_000_000 + rt.tv_nsec as i128;
    let now = now_ns() as i128;
    (now - (rt_ns - epoch_us as i128 * 1000)).max(0) as u64
}

// ---- shared layout -------------------------------------------------------

#[repr(C)]
struct Header {
    magic: [u8; 8],
    layout_version: u32,
    gpu_count: u32,
    node_hash: u64,
    xid_head: AtomicU64,
    _pad: [u8; 4096 - 32 - XID_RING * 32],
    xids: [XidSlot; XID_RING],
}

#[repr(C)]
struct XidSlot {
    seq: AtomicU64,
    gpu: AtomicU32,
    code: AtomicU32,
    time_ns: AtomicU64,
    _pad: u64,
}

#[repr(C)]
struct DeviceBlock {
    used: AtomicU64,
    busy_until: AtomicU64,
    ring_head: AtomicU64,
    _pad: [u64; 5],
    ring: [Interval; RING],
}

#[repr(C)]
struct Interval {
    /// Index + 1 of the launch that wrote it; 0 while being written.
    seq: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
    /// Owner: slot index in the low 16 bits, slot generation above.
    owner: AtomicU64,
}

const SLOT_FREE: u32 = 0;
const SLOT_LIVE: u32 = 1;

#[repr(C)]
struct ProcSlot {
    state: AtomicU32,
    generation: AtomicU32,
    /// PID in the initial namespace; 0 until known.
    host_pid: AtomicI32,
    /// PID in the process's own namespace.
    ns_pid: AtomicI32,
    pidns_ino: AtomicU64,
    /// Bit i: the process has a context on GPU i.
    active: AtomicU64,
    comm: [AtomicU64; 4],
    used: [AtomicU64; MAX_GPUS],
}

const HEADER_SIZE: usize = std::mem::size_of::<Header>();
const DEVICE_SIZE: usize = std::mem::size_of::<DeviceBlock>();
const SLOT_SIZE: usize = std::mem::size_of::<ProcSlot>();

fn layout_len(gpus: usize) -> usize {
    HEADER_SIZE + gpus * DEVICE_SIZE + MAX_PROCS * SLOT_SIZE
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What `install` did with the state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstallOutcome {
    Created,
    /// Same node description: the live state (allocations, timeline) was kept.
    Kept,
    /// The node description changed: a fresh state file replaced the old one.
    Replaced,
}

/// A process known to the simulated driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    pub slot: u32,
    pub generation: u32,
    /// PID in the initial (host) PID namespace; `None` when it cannot be
    /// resolved from here (the reader does not see the host's /proc).
    pub host_pid: Option<u32>,
    /// PID in the process's own namespace.
    pub ns_pid: u32,
    pub used_bytes: u64,
    pub name: String,
}

impl ProcessInfo {
    /// The PID to report: host PID where known.
    pub fn pid(&self) -> u32 {
        self.host_pid.unwrap_or(self.ns_pid)
    }
}

/// An injected Xid event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEvent {
    pub seq: u64,
    pub gpu: u32,
    pub code: u32,
    pub time_ns: u64,
}

/// The calling process's registration: index into the process table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    pub slot: u32,
    pub generation: u32,
}

impl Attached {
    fn owner(self) -> u64 {
        self.slot as u64 | (self.generation as u64) << 16
    }
}

/// The device ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("out of memory on GPU {gpu}: {requested} bytes requested, {free} free")]
pub struct OutOfMemory {
    pub gpu: usize,
    pub requested: u64,
    pub free: u64,
}

/// A mapping of the shared state.
pub struct SharedState {
    root: SimRoot,
    node: NodeSpec,
    base: *mut u8,
    len: usize,
    lock: OwnedFd,
    /// Slot this handle attached, so its own lock is not mistaken for a dead
    /// process (OFD locks never conflict with their own description).
    own_slot: AtomicI64,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for SharedState {}
unsafe impl Sync for SharedState {}

impl Drop for SharedState {
    fn drop(&mut self) {
        // SAFETY: base/len come from a successful mmap.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl SharedState {
    /// Writes the node description and a state file for it under `root`.
    /// Keeps an existing state made for the same description, so installing
    /// twice does not disturb running processes.
    pub fn install(root: &SimRoot, node: &NodeSpec) -> Result<InstallOutcome, StateError> {
        let dir = root.state_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let hash = fnv1a(node.source.as_bytes());
        let state_path = root.state_file();
        let outcome = match Self::read_header(&state_path) {
            Ok(Some((h, count))) if h == hash && count == node.gpus.len() => InstallOutcome::Kept,
            Ok(Some(_)) | Err(_) => InstallOutcome::Replaced,
            Ok(None) => InstallOutcome::Created,
        };
        if outcome != InstallOutcome::Kept {
            // New inode: processes still mapping the old state are unaffected.
            let tmp = dir.join(".state.tmp");
            let f = File::create(&tmp).map_err(io_err(&tmp))?;
            f.set_len(layout_len(node.gpus.len()) as u64)
                .map_err(io_err(&tmp))?;
            let mut header = vec![0u8; 24];
            header[..8].copy_from_slice(&MAGIC);
            header[8..12].copy_from_slice(&LAYOUT_VERSION.to_ne_bytes());
            header[12..16].copy_from_slice(&(node.gpus.len() as u32).to_ne_bytes());
            header[16..24].copy_from_slice(&hash.to_ne_bytes());
            (&f).write_all(&header).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
            fs::rename(&tmp, &state_path).map_err(io_err(&state_path))?;
        }
        write_atomic(&root.node_file(), node.source.as_bytes())?;
        let lock = root.lock_file();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&lock)
            .map_err(io_err(&lock))?;
        // Containers run as other users too; the state is a device, not a secret.
        for p in [&dir, &state_path, &root.node_file(), &lock] {
            let mode = if p.is_dir() { 0o777 } else { 0o666 };
            let _ = fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode));
        }
        Ok(outcome)
    }

    fn read_header(path: &Path) -> Result<Option<(u64, usize)>, StateError> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(path)(e)),
        };
        let corrupt = |m: &str| StateError::Corrupt {
            path: path.display().to_string(),
            message: m.to_string(),
        };
        if bytes.len() < 24 || bytes[..8] != MAGIC {
            return Err(corrupt(
                "not a gpu-sim state file (bad magic); re-run gpu-sim install",
            ));
        }
        let version = u32::from_ne_bytes(bytes[8..12].try_into().unwrap());
        if version != LAYOUT_VERSION {
            return Err(corrupt(&format!(
                "layout version {version}, this build reads {LAYOUT_VERSION}; re-run gpu-sim install"
            )));
        }
        let count = u32::from_ne_bytes(bytes[12..16].try_into().unwrap()) as usize;
        if count == 0 || count > MAX_GPUS || bytes.len() < layout_len(count) {
            return Err(corrupt("truncated or inconsistent; re-run gpu-sim install"));
        }
        Ok(Some((
            u64::from_ne_bytes(bytes[16..24].try_into().unwrap()),
            count,
        )))
    }

    /// Maps the state of an installed root.
    pub fn open(root: &SimRoot) -> Result<SharedState, StateError> {
        let node = NodeSpec::load(&root.node_file())?;
        let path = root.state_file();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(&path))?;
        let len = layout_len(node.gpus.len());
        let actual = file.metadata().map_err(io_err(&path))?.len() as usize;
        let corrupt = |message: String| StateError::Corrupt {
            path: path.display().to_string(),
            message,
        };
        if actual < len {
            return Err(corrupt(format!(
                "{actual} bytes, expected {len} for {} GPUs; re-run gpu-sim install",
                node.gpus.len()
            )));
        }
        // SAFETY: mapping a regular file we opened read-write.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io_err(&path)(std::io::Error::last_os_error()));
        }
        let lock_path = root.lock_file();
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        let state = SharedState {
            root: root.clone(),
            node,
            base: base.cast(),
            len,
            lock: OwnedFd::from(lock),
            own_slot: AtomicI64::new(-1),
        };
        let h = state.header();
        if h.magic != MAGIC || h.layout_version != LAYOUT_VERSION {
            return Err(corrupt(
                "bad magic or layout version; re-run gpu-sim install".into(),
            ));
        }
        if h.gpu_count as usize != state.node.gpus.len()
            || h.node_hash != fnv1a(state.node.source.as_bytes())
        {
            return Err(corrupt(
                "was made for another node description; re-run gpu-sim install".into(),
            ));
        }
        Ok(state)
    }

    pub fn node(&self) -> &NodeSpec {
        &self.node
    }
    pub fn root(&self) -> &SimRoot {
        &self.root
    }
    pub fn gpu_count(&self) -> usize {
        self.node.gpus.len()
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_SIZE long and page aligned.
        unsafe { &*(self.base as *const Header) }
    }
    fn device(&self, gpu: usize) -> &DeviceBlock {
        assert!(gpu < self.gpu_count());
        // SAFETY: in bounds by layout_len.
        unsafe { &*(self.base.add(HEADER_SIZE + gpu * DEVICE_SIZE) as *const DeviceBlock) }
    }
    fn slot(&self, i: usize) -> &ProcSlot {
        assert!(i < MAX_PROCS);
        let off = HEADER_SIZE + self.gpu_count() * DEVICE_SIZE + i * SLOT_SIZE;
        // SAFETY: in bounds by layout_len.
        unsafe { &*(self.base.add(off) as *const ProcSlot) }
    }

    /// Indices of the GPUs whose device node this process can open, as the
    /// real driver only sees the devices present in its mount namespace.
    pub fn visible_gpus(&self) -> Vec<usize> {
        (0..self.gpu_count())
            .filter(|&i| {
                let path = self.root.device_node(self.node.gpus[i].minor);
                let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
                    return false;
                };
                // SAFETY: valid C string.
                let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
                if fd >= 0 {
                    unsafe { libc::close(fd) };
                    true
                } else {
                    false
                }
            })
            .collect()
    }

    // ---- process table ----

    fn lock_byte(&self, slot: usize, cmd: libc::c_int, kind: libc::c_short) -> libc::flock {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = slot as libc::off_t;
        fl.l_len = 1;
        // SAFETY: valid fd and flock struct.
        let rc = unsafe { libc::fcntl(self.lock.as_raw_fd(), cmd, &mut fl) };
        if rc != 0 {
            fl.l_type = -1;
        }
        fl
    }

    fn try_lock_slot(&self, slot: usize) -> bool {
        self.lock_byte(slot, libc::F_OFD_SETLK, libc::F_WRLCK as libc::c_short)
            .l_type
            != -1
    }

    fn unlock_slot(&self, slot: usize) {
        self.lock_byte(slot, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_short);
    }

    /// Gives back what a dead process held. Call with the slot's lock held.
    fn reclaim(&self, i: usize) {
        let s = self.slot(i);
        for g in 0..self.gpu_count() {
            let held = s.used[g].swap(0, AcqRel);
            if held > 0 {
                self.device(g).used.fetch_sub(held, AcqRel);
            }
        }
        s.active.store(0, Release);
        s.host_pid.store(0, Release);
        s.state.store(SLOT_FREE, Release);
    }

    /// Reclaims the slots of processes that died.
    pub fn reap_dead(&self) {
        let own = self.own_slot.load(Acquire);
        for i in 0..MAX_PROCS {
            if i as i64 == own || self.slot(i).state.load(Acquire) != SLOT_LIVE {
                continue;
            }
            if self.try_lock_slot(i) {
                if self.slot(i).state.load(Acquire) == SLOT_LIVE {
                    self.reclaim(i);
                }
                self.unlock_slot(i);
            }
        }
    }

    /// Registers the calling process. Call once per process; the slot is held
    /// until the process exits.
    pub fn attach(&self) -> Result<Attached, StateError> {
        let own = self.own_slot.load(Acquire);
        if own >= 0 {
            let generation = self.slot(own as usize).generation.load(Acquire);
            return Ok(Attached {
                slot: own as u32,
                generation,
            });
        }
        let (ns_pid, pidns) = own_pid_and_ns();
        for i in 0..MAX_PROCS {
            if !self.try_lock_slot(i) {
                continue;
            }
            let s = self.slot(i);
            if s.state.load(Acquire) == SLOT_LIVE {
                self.reclaim(i);
            }
            let generation = s.generation.fetch_add(1, AcqRel).wrapping_add(1) & 0xffff;
            s.ns_pid.store(ns_pid as i32, Release);
            s.pidns_ino.store(pidns, Release);
            let host = if pidns == INIT_PID_NS_INO { ns_pid } else { 0 };
            s.host_pid.store(host as i32, Release);
            let comm = own_comm();
            for (k, word) in s.comm.iter().enumerate() {
                let mut b = [0u8; 8];
                for (j, byte) in b.iter_mut().enumerate() {
                    *byte = comm.get(k * 8 + j).copied().unwrap_or(0);
                }
                word.store(u64::from_ne_bytes(b), Release);
            }
            s.active.store(0, Release);
            s.state.store(SLOT_LIVE, Release);
            self.own_slot.store(i as i64, Release);
            return Ok(Attached {
                slot: i as u32,
                generation: generation & 0xffff,
            });
        }
        Err(StateError::TooManyProcesses)
    }

    /// Marks that the process has a context on `gpu` (it then shows in
    /// process lists even before it allocates).
    pub fn set_active(&self, me: Attached, gpu: usize) {
        self.slot(me.slot as usize)
            .active
            .fetch_or(1 << gpu, AcqRel);
    }

    /// Processes with a context or memory on `gpu`, dead ones reclaimed first.
    pub fn processes(&self, gpu: usize) -> Vec<ProcessInfo> {
        self.reap_dead();
        let my_ns = own_pid_and_ns().1;
        let mut out = Vec::new();
        for i in 0..MAX_PROCS {
            let s = self.slot(i);
            if s.state.load(Acquire) != SLOT_LIVE {
                continue;
            }
            let used = s.used[gpu].load(Acquire);
            if used == 0 && s.active.load(Acquire) & (1 << gpu) == 0 {
                continue;
            }
            let ns_pid = s.ns_pid.load(Acquire) as u32;
            let mut host = s.host_pid.load(Acquire);
            if host == 0 {
                let ns = s.pidns_ino.load(Acquire);
                if let Some(p) = host_pid_of(ns, ns_pid, my_ns) {
                    host = p as i32;
                    // Only cache what the initial namespace would see.
                    if my_ns == INIT_PID_NS_INO {
                        s.host_pid.store(host, Release);
                    }
                }
            }
            let mut name = Vec::with_capacity(32);
            for w in &s.comm {
                name.extend_from_slice(&w.load(Acquire).to_ne_bytes());
            }
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            out.push(ProcessInfo {
                slot: i as u32,
                generation: s.generation.load(Acquire) & 0xffff,
                host_pid: (host > 0).then_some(host as u32),
                ns_pid,
                used_bytes: used,
                name: String::from_utf8_lossy(&name[..end]).into_owned(),
            });
        }
        out
    }

    // ---- memory ----

    pub fn memory_total(&self, gpu: usize) -> u64 {
        self.node.gpus[gpu].memory_bytes()
    }

    /// Memory in use on `gpu` by all processes (dead ones reclaimed first).
    pub fn memory_used(&self, gpu: usize) -> u64 {
        self.reap_dead();
        self.device(gpu).used.load(Acquire)
    }

    /// Takes `bytes` of `gpu`'s memory for the calling process, or fails when
    /// the card is full. Concurrent callers never overshoot the card.
    pub fn try_alloc(&self, me: Attached, gpu: usize, bytes: u64) -> Result<(), OutOfMemory> {
        let total = self.memory_total(gpu);
        let dev = self.device(gpu);
        let mut reaped = false;
        loop {
            let r = dev.used.fetch_update(AcqRel, Acquire, |u| {
                u.checked_add(bytes).filter(|&n| n <= total)
            });
            match r {
                Ok(_) => break,
                Err(used) if !reaped => {
                    // Memory of processes that died may still be counted.
                    let _ = used;
                    self.reap_dead();
                    reaped = true;
                }
                Err(used) => {
                    return Err(OutOfMemory {
                        gpu,
                        requested: bytes,
                        free: total.saturating_sub(used),
                    });
                }
            }
        }
        let s = self.slot(me.slot as usize);
        s.used[gpu].fetch_add(bytes, AcqRel);
        s.active.fetch_or(1 << gpu, AcqRel);
        Ok(())
    }

    /// Gives back memory taken with [`try_alloc`](Self::try_alloc).
    pub fn free(&self, me: Attached, gpu: usize, bytes: u64) {
        let s = self.slot(me.slot as usize);
        let taken = s.used[gpu]
            .fetch_update(AcqRel, Acquire, |u| Some(u.saturating_sub(bytes)))
            .unwrap();
        let given = taken.min(bytes);
        self.device(gpu)
            .used
            .fetch_update(AcqRel, Acquire, |u| Some(u.saturating_sub(given)))
            .unwrap();
    }

    // ---- time ----

    /// Queues a kernel of `duration_ns` on `gpu`'s timeline, not before
    /// `not_before_ns` (the end of the previous work on the caller's stream).
    /// Returns its simulated (start, end). Atomics and a vDSO clock read
    /// only: no syscall.
    pub fn launch(
        &self,
        me: Attached,
        gpu: usize,
        duration_ns: u64,
        not_before_ns: u64,
    ) -> (u64, u64) {
        let dev = self.device(gpu);
        let now = now_ns();
        let mut start = 0;
        let mut end = 0;
        let _ = dev.busy_until.fetch_update(AcqRel, Acquire, |busy| {
            start = busy.max(now).max(not_before_ns);
            end = start + duration_ns;
            Some(end)
        });
        self.record(dev, me.owner(), start, end);
        (start, end)
    }

    fn record(&self, dev: &DeviceBlock, owner: u64, start: u64, end: u64) {
        // Back-to-back kernels of one process extend its last interval, so a
        // saturating process costs one ring entry, not one per launch.
        let head = dev.ring_head.load(Acquire);
        if head > 0 {
            let last = &dev.ring[((head - 1) as usize) % RING];
            if last.seq.load(Acquire) == head
                && last.owner.load(Acquire) == owner
                && last
                    .end
                    .compare_exchange(start, end, AcqRel, Acquire)
                    .is_ok()
            {
                return;
            }
        }
        let idx = dev.ring_head.fetch_add(1, AcqRel);
        let e = &dev.ring[(idx as usize) % RING];
        e.seq.store(0, Release);
        e.start.store(start, Release);
        e.end.store(end, Release);
        e.owner.store(owner, Release);
        e.seq.store(idx + 1, Release);
    }

    /// Busy nanoseconds on `gpu` within [from, to), for one owner or all,
    /// and the part of the window the ring still covers.
    fn busy_ns(&self, gpu: usize, from: u64, to: u64, owner: Option<u64>) -> (u64, u64) {
        let dev = self.device(gpu);
        let head = dev.ring_head.load(Acquire);
        let n = head.min(RING as u64);
        let mut busy = 0;
        let mut oldest = u64::MAX;
        for k in 0..n {
            let idx = head - 1 - k;
            let e = &dev.ring[(idx as usize) % RING];
            if e.seq.load(Acquire) != idx + 1 {
                continue;
            }
            let (s, en, o) = (
                e.start.load(Acquire),
                e.end.load(Acquire),
                e.owner.load(Acquire),
            );
            if e.seq.load(Acquire) != idx + 1 {
                continue;
            }
            oldest = oldest.min(s);
            if owner.is_some_and(|w| w != o) {
                continue;
            }
            let (a, b) = (s.max(from), en.min(to));
            if b > a {
                busy += b - a;
            }
        }
        // When the ring wrapped, only the part it still covers is known.
        let covered_from = if head > RING as u64 {
            oldest.max(from)
        } else {
            from
        };
        (busy, to.saturating_sub(covered_from))
    }

    /// Percent of [from, to) during which `gpu` ran kernels.
    pub fn utilization(&self, gpu: usize, from: u64, to: u64) -> f64 {
        let (busy, window) = self.busy_ns(gpu, from, to, None);
        if window == 0 {
            0.0
        } else {
            (busy as f64 * 100.0 / window as f64).min(100.0)
        }
    }

    /// Per-process percent of [from, to) on `gpu`, for processes that ran in it.
    pub fn process_utilization(&self, gpu: usize, from: u64, to: u64) -> Vec<(ProcessInfo, f64)> {
        self.processes(gpu)
            .into_iter()
            .filter_map(|p| {
                let owner = p.slot as u64 | (p.generation as u64) << 16;
                let (busy, window) = self.busy_ns(gpu, from, to, Some(owner));
                (busy > 0 && window > 0)
                    .then(|| (p, (busy as f64 * 100.0 / window as f64).min(100.0)))
            })
            .collect()
    }

    // ---- Xid events ----

    /// Records an Xid error on `gpu`; returns its sequence number.
    pub fn inject_xid(&self, gpu: usize, code: u32) -> u64 {
        assert!(gpu < self.gpu_count());
        let h = self.header();
        let seq = h.xid_head.fetch_add(1, AcqRel) + 1;
        let e = &h.xids[(seq as usize) % XID_RING];
        e.seq.store(0, Release);
        e.gpu.store(gpu as u32, Release);
        e.code.store(code, Release);
        e.time_ns.store(now_ns(), Release);
        e.seq.store(seq, Release);
        seq
    }

    /// Sequence number of the newest Xid event (0 if none).
    pub fn xid_cursor(&self) -> u64 {
        self.header().xid_head.load(Acquire)
    }

    /// Xid events newer than `cursor`, oldest first.
    pub fn xid_events_since(&self, cursor: u64) -> Vec<XidEvent> {
        let h = self.header();
        let head = h.xid_head.load(Acquire);
        let first = cursor.max(head.saturating_sub(XID_RING as u64 - 1)) + 1;
        (first..=head)
            .filter_map(|seq| {
                let e = &h.xids[(seq as usize) % XID_RING];
                let ev = XidEvent {
                    seq,
                    gpu: e.gpu.load(Acquire),
                    code: e.code.load(Acquire),
                    time_ns: e.time_ns.load(Acquire),
                };
                (e.seq.load(Acquire) == seq).then_some(ev)
            })
            .collect()
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

/// This process's PID in its own namespace and that namespace's inode.
fn own_pid_and_ns() -> (u32, u64) {
    let pid = std::process::id();
    let ino = fs::metadata("/proc/self/ns/pid")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(INIT_PID_NS_INO);
    (pid, ino)
}

fn own_comm() -> Vec<u8> {
    fs::read("/proc/self/comm")
        .map(|mut b| {
            while b.last() == Some(&b'\n') {
                b.pop();
            }
            b.truncate(32);
            b
        })
        .unwrap_or_default()
}

/// Host PID of the process that is `ns_pid` in PID namespace `ns`, found by
/// scanning /proc as the reader sees it: each process's `ns/pid` inode and the
/// last entry of `NSpid` in its status.
fn host_pid_of(ns: u64, ns_pid: u32, my_ns: u64) -> Option<u32> {
    if ns == my_ns {
        return Some(ns_pid);
    }
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(m) = fs::metadata(format!("/proc/{pid}/ns/pid")) else {
            continue;
        };
        if std::os::unix::fs::MetadataExt::ino(&m) != ns {
            continue;
        }
        let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let last = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|s| s.parse::<u32>().ok());
        if last == Some(ns_pid) {
            return Some(pid);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: &str = r#"
name = "t"
driver_version = "550.54.15"
cuda_version = "12.4"
kernel_wave_ns = 1000

[[gpu]]
name = "NVIDIA Test"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
memory_mib = 1
sm_count = 1
pci_bus_id = "00000000:07:00.0"
minor = 0
"#;

    fn installed() -> (tempfile::TempDir, SimRoot) {
        let dir = tempfile::tempdir().unwrap();
        let root = SimRoot::new(dir.path());
        let node = NodeSpec::parse(NODE, "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &node).unwrap(),
            InstallOutcome::Created
        );
        (dir, root)
    }

    #[test]
    fn install_is_idempotent_and_replaces_on_change() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.try_alloc(me, 0, 4096).unwrap();
        let node = NodeSpec::parse(NODE, "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &node).unwrap(),
            InstallOutcome::Kept
        );
        assert_eq!(
            SharedState::open(&root).unwrap().memory_used(0),
            4096,
            "kept live state"
        );
        let changed =
            NodeSpec::parse(&NODE.replace("memory_mib = 1", "memory_mib = 2"), "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &changed).unwrap(),
            InstallOutcome::Replaced
        );
        assert_eq!(SharedState::open(&root).unwrap().memory_used(0), 0);
    }

    #[test]
    fn memory_is_bounded_by_the_card() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.try_alloc(me, 0, 1024 * 1024).unwrap();
        let err = s.try_alloc(me, 0, 1).unwrap_err();
        assert_eq!(err.free, 0);
        s.free(me, 0, 512 * 1024);
        assert_eq!(s.memory_used(0), 512 * 1024);
        let procs = s.processes(0);
        assert_eq!(procs.len(), 1);
        assert_eq!(procs[0].used_bytes, 512 * 1024);
        assert_eq!(procs[0].host_pid, Some(std::process::id()));
    }

    #[test]
    fn other_handle_sees_live_process_and_reclaims_closed_one() {
        let (_d, root) = installed();
        let a = SharedState::open(&root).unwrap();
        let me = a.attach().unwrap();
        a.try_alloc(me, 0, 1000).unwrap();
        let b = SharedState::open(&root).unwrap();
        assert_eq!(b.memory_used(0), 1000, "a's lock keeps its slot alive");
        drop(a); // closes the lock fd: like the process dying
        assert_eq!(b.memory_used(0), 0, "reclaimed");
        assert!(b.processes(0).is_empty());
    }

    #[test]
    fn timeline_queues_and_measures() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.set_active(me, 0);
        let t0 = now_ns();
        let (s1, e1) = s.launch(me, 0, 1_000_000, 0);
        let (s2, e2) = s.launch(me, 0, 1_000_000, 0);
        assert!(s1 >= t0 && e1 - s1 == 1_000_000);
        assert_eq!(s2, e1, "second kernel queues behind the first");
        assert_eq!(e2 - s2, 1_000_000);
        let u = s.utilization(0, s1, e2);
        assert!((u - 100.0).abs() < 1e-9, "{u}");
        let u = s.utilization(0, s1, e2 + 2_000_000);
        assert!((u - 50.0).abs() < 1e-9, "{u}");
        let per = s.process_utilization(0, s1, e2);
        assert_eq!(per.len(), 1);
        assert!((per[0].1 - 100.0).abs() < 1e-9);
    }

    #[test]
    fn xid_events_in_order() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let c = s.xid_cursor();
        s.inject_xid(0, 79);
        s.inject_xid(0, 48);
        let ev = s.xid_events_since(c);
        assert_eq!(ev.iter().map(|e| e.code).collect::<Vec<_>>(), vec![79, 48]);
        assert!(s.xid_events_since(s.xid_cursor()).is_empty());
    }

    #[test]
    fn locate_reports_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/libcuda.so.1");
        let err = SimRoot::locate(Some(&lib)).unwrap_err().to_string();
        assert!(err.contains("gpu-sim install"), "{err}");
        let (_d, root) = installed();
        let lib = root.root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
        assert_eq!(SimRoot::locate(Some(&lib)).unwrap(), root);
    }

    #[test]
    fn corrupt_state_is_reported() {
        let (_d, root) = installed();
        fs::write(root.state_file(), b"garbage").unwrap();
        let err = SharedState::open(&root).err().unwrap().to_string();
        assert!(err.contains("re-run gpu-sim install"), "{err}");
    }
}
