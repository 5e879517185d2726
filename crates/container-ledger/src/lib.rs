//! The per-container ledger: one small file, mapped shared by the manager and
//! by every CUDA process of a shared container, that holds the container's
//! GPU memory use.
//!
//! Why a shared ledger: each process of a container allocates on its own, so
//! a quota check against a number any one process computes (HAMi's design)
//! lets concurrent allocations overshoot together. Here the container total
//! is one atomic in shared memory, and an allocation first *reserves* its
//! size with a compare-and-swap that never lets the total pass the quota;
//! only then does it call the driver (and gives the reservation back if the
//! driver fails). N processes x M threads can never hold more than the quota.
//!
//! Who does what:
//! * the manager creates the file in the container's vm directory on the
//!   host ([`Ledger::create`]), passes a read-write descriptor to each
//!   registering process over the registration socket (the vm directory is
//!   mounted read-only into the container), claims a slot for the process
//!   ([`Ledger::claim_slot`]) and, when the process's connection closes,
//!   gives its memory back ([`Ledger::clear_slot`]): the driver freed it
//!   when the process died;
//! * the interposer maps the descriptor ([`Ledger::from_fd`]) and calls
//!   [`Ledger::try_reserve`] / [`Ledger::release`] around every allocation
//!   and free.
//!
//! The file layout is fixed (little-endian x86_64/aarch64 native, version
//! [`VERSION`]): a 4 KiB header, then [`SLOTS`] slots of 64 bytes. The
//! header holds the quota, the total, its peak, the generation and two
//! container-wide counters the interposer bumps for the display's metrics
//! ([`Ledger::throttled_ns`], [`Ledger::refused_allocations`]), the compute
//! controller's attribution flag ([`Ledger::compute_unattributed`]); bytes
//! `80..1024` are reserved (zero); bytes `1024..4096` belong to the
//! compute-quota controller ([`Ledger::compute_words`]).
//!
//! The counters took reserved bytes that every ledger of this version has
//! always kept zero, so the layout version did not change: a ledger created
//! before them reads as "nothing throttled, nothing refused yet" and counts
//! from there, by old and new processes alike (an old interposer simply
//! never bumps them).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod fdpass;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use thiserror::Error;

/// File name of the ledger in a container's vm directory (host side).
pub const LEDGER_FILE: &str = "ledger";
/// `b"VCUDALDG"`.
pub const MAGIC: [u8; 8] = *b"VCUDALDG";
/// Layout version.
pub const VERSION: u32 = 1;
/// Header size; slots start here.
pub const HEADER_SIZE: usize = 4096;
/// Number of process slots.
pub const SLOTS: usize = 1024;
/// Size of one slot.
pub const SLOT_SIZE: usize = 64;
/// Size of the whole file.
pub const FILE_SIZE: usize = HEADER_SIZE + SLOTS * SLOT_SIZE;
/// Offset of the compute controller's area in the header.
pub const COMPUTE_OFFSET: usize = 1024;
/// Number of 64-bit words in the compute controller's area.
pub const COMPUTE_WORDS: usize = (HEADER_SIZE - COMPUTE_OFFSET) / 8;
/// Offset of the container's throttled-time counter (u64 ns) in the header.
/// Public because the interposer also reaches it through its long-lived
/// second mapping of the header page (the one that holds the compute
/// words), not only through a [`Ledger`].
pub const THROTTLED_NS_OFFSET: usize = 56;
/// Offset of the container's refused-allocations counter (u64) in the header.
pub const REFUSED_ALLOCATIONS_OFFSET: usize = 64;
/// Offset of the compute controller's attribution flag (u64) in the header
/// (see [`Ledger::compute_unattributed`]); in the compute area's page, which
/// the interposer keeps mapped.
pub const COMPUTE_UNATTRIBUTED_OFFSET: usize = 72;
const _: () = assert!(
    THROTTLED_NS_OFFSET / 4096 == COMPUTE_OFFSET / 4096,
    "the throttled counter shares the compute area's page"
);

// Header fields.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_HEADER_SIZE: usize = 12;
const OFF_SLOTS: usize = 16;
const OFF_SLOT_SIZE: usize = 20;
const OFF_QUOTA: usize = 24;
const OFF_USED: usize = 32;
const OFF_PEAK: usize = 40;
const OFF_GENERATION: usize = 48;
// Slot fields.
const SLOT_PID: usize = 0;
const SLOT_USED: usize = 8;
const SLOT_PEAK: usize = 16;

#[derive(Debug, Error)]
pub enum LedgerError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("ledger is {len} bytes, expected {FILE_SIZE}")]
    Size { len: u64 },
    #[error("not a vcuda ledger (bad magic)")]
    Magic,
    #[error("ledger layout version {found}, this build reads {VERSION}")]
    Version { found: u32 },
    #[error("ledger geometry {header}/{slots}/{slot_size} does not match this build's")]
    Geometry {
        header: u32,
        slots: u32,
        slot_size: u32,
    },
}

/// An allocation that does not fit: what was asked and what was left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{requested} bytes requested, {available} of the {quota}-byte quota available")]
pub struct OverQuota {
    pub requested: u64,
    pub available: u64,
    pub quota: u64,
}

/// One process slot, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    pub index: usize,
    /// Host PID of the process (never 0 for a claimed slot).
    pub pid: i32,
    /// Bytes the process holds.
    pub used: u64,
    /// Most bytes it ever held.
    pub peak: u64,
}

/// A mapped ledger. Cheap to share between threads (`&Ledger` is all an
/// operation needs); unmapped on drop.
pub struct Ledger {
    base: *mut u8,
}

// SAFETY: `base` is a MAP_SHARED mapping owned by the Ledger (unmapped only
// in Drop); after set-up every access is an atomic through `u64_at` /
// `slot_pid` / `compute_words`, which other threads (and processes) may race
// with safely. The header's plain u32/byte fields are written only in
// `init_header`, before the Ledger is returned to anyone.
unsafe impl Send for Ledger {}
// SAFETY: as for Send: shared access is atomics only.
unsafe impl Sync for Ledger {}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("quota", &self.quota())
            .field("used", &self.used())
            .finish()
    }
}

fn io(what: impl Into<String>, source: std::io::Error) -> LedgerError {
    LedgerError::Io {
        what: what.into(),
        source,
    }
}

impl Ledger {
    /// Creates the ledger at `path` (mode 0600) with `quota` bytes, or opens
    /// the existing one (a restarted manager keeps the live state) and sets
    /// its quota. Returns the mapping and the open file, whose descriptor is
    /// what the manager passes to registering processes.
    pub fn create(path: &Path, quota: u64) -> Result<(Ledger, File), LedgerError> {
        let what = || path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(what(), e))?;
        let len = file.metadata().map_err(|e| io(what(), e))?.len();
        let fresh = len == 0;
        if fresh {
            file.set_len(FILE_SIZE as u64).map_err(|e| io(what(), e))?;
        }
        let ledger = if fresh {
            let l = Self::map(file.as_fd_borrowed())?;
            l.init_header();
            l
        } else {
            Self::from_fd(file.as_fd_borrowed()).map_err(|e| match e {
                LedgerError::Io { source, .. } => io(what(), source),
                other => other,
            })?
        };
        ledger.set_quota(quota);
        Ok((ledger, file))
    }

    /// Opens an existing ledger file read-write (manager inspection,
    /// recovery after a restart).
    pub fn open(path: &Path) -> Result<(Ledger, File), LedgerError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(path.display().to_string(), e))?;
        let l = Self::from_fd(file.as_fd_borrowed())?;
        Ok((l, file))
    }

    /// The quota and the container's use, read from the ledger file
    /// without a writable mapping or a slot: for processes that must not
    /// register (NVML-only tools in the container). Needs read permission.
    pub fn peek(path: &Path) -> Result<(u64, u64), LedgerError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io(path.display().to_string(), e))?;
        let len = file
            .metadata()
            .map_err(|e| io(path.display().to_string(), e))?
            .len();
        if len != FILE_SIZE as u64 {
            return Err(LedgerError::Size { len });
        }
        // SAFETY: a fresh mapping (NULL hint, no MAP_FIXED) replaces nothing;
        // the file's length was checked to be FILE_SIZE just above.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io("mmap ledger", std::io::Error::last_os_error()));
        }
        // Read-only: only the readers below touch it (atomic loads, never a
        // store, which would fault on PROT_READ); Drop unmaps.
        let l = Ledger { base: p.cast() };
        l.check_header()?;
        Ok((l.quota(), l.used()))
    }

    /// Maps the ledger behind `fd` (read-write) and checks its header. The
    /// descriptor may be closed afterwards.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        // SAFETY: `libc::stat` is plain integers, for which all-zero is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a live borrowed descriptor; `st` is a local to fill.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io("fstat ledger", std::io::Error::last_os_error()));
        }
        if st.st_size as u64 != FILE_SIZE as u64 {
            return Err(LedgerError::Size {
                len: st.st_size as u64,
            });
        }
        let l = Self::map(fd)?;
        l.check_header()?;
        Ok(l)
    }

    /// Callers make sure the file is FILE_SIZE bytes (set or checked) first.
    fn map(fd: BorrowedFd<'_>) -> Result<Ledger, LedgerError> {
        // SAFETY: a fresh mapping (NULL hint, no MAP_FIXED) replaces nothing;
        // `fd` is a live descriptor of a FILE_SIZE-byte file (every caller
        // sets or checks the length first), so all FILE_SIZE bytes are backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io("mmap ledger", std::io::Error::last_os_error()));
        }
        Ok(Ledger { base: p.cast() })
    }

    fn init_header(&self) {
        // SAFETY: only on a freshly created file, before the Ledger is shared:
        // no other reference into the mapping exists yet. All offsets are
        // constants inside the header (< HEADER_SIZE <= FILE_SIZE); the u32
        // fields are 4-byte aligned offsets from a page-aligned base.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), self.base.add(OFF_MAGIC), 8);
            (self.base.add(OFF_VERSION) as *mut u32).write(VERSION);
            (self.base.add(OFF_HEADER_SIZE) as *mut u32).write(HEADER_SIZE as u32);
            (self.base.add(OFF_SLOTS) as *mut u32).write(SLOTS as u32);
            (self.base.add(OFF_SLOT_SIZE) as *mut u32).write(SLOT_SIZE as u32);
        }
    }

    fn check_header(&self) -> Result<(), LedgerError> {
        // SAFETY: `off` is one of the header's constant, 4-aligned u32 offsets
        // (< HEADER_SIZE) in our live FILE_SIZE-byte mapping of a page-aligned
        // base. Header fields are written once at creation, before sharing.
        let u32_at = |off: usize| unsafe { (self.base.add(off) as *const u32).read() };
        // SAFETY: bytes 0..8 of our live mapping, borrowed only for the
        // comparison below while `self` keeps the mapping alive.
        let magic = unsafe { std::slice::from_raw_parts(self.base.add(OFF_MAGIC), 8) };
        if magic != MAGIC {
            return Err(LedgerError::Magic);
        }
        let version = u32_at(OFF_VERSION);
        if version != VERSION {
            return Err(LedgerError::Version { found: version });
        }
        let (header, slots, slot_size) = (
            u32_at(OFF_HEADER_SIZE),
            u32_at(OFF_SLOTS),
            u32_at(OFF_SLOT_SIZE),
        );
        if (header as usize, slots as usize, slot_size as usize) != (HEADER_SIZE, SLOTS, SLOT_SIZE)
        {
            return Err(LedgerError::Geometry {
                header,
                slots,
                slot_size,
            });
        }
        Ok(())
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= FILE_SIZE && off.is_multiple_of(8));
        // SAFETY: `off` is a constant or slot offset, 8-aligned and within the
        // FILE_SIZE bytes mapped (asserted above; slot_off checks the slot
        // index), and the base is page-aligned, so this is an aligned u64 in
        // the mapping, which lives as long as `&self`. AtomicU64 has u64's
        // layout, and every process touches these words only atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn slot_off(slot: usize) -> usize {
        assert!(slot < SLOTS, "ledger slot {slot} out of range");
        HEADER_SIZE + slot * SLOT_SIZE
    }

    fn slot_pid(&self, slot: usize) -> &AtomicI32 {
        // SAFETY: `slot_off` asserts `slot < SLOTS`, so the slot's first 4
        // bytes are inside the mapping and 64-byte aligned; the reference
        // lives no longer than `&self` (the mapping), and the word is only
        // ever accessed atomically.
        unsafe { &*(self.base.add(Self::slot_off(slot) + SLOT_PID) as *const AtomicI32) }
    }

    fn slot_used(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(Self::slot_off(slot) + SLOT_USED)
    }

    fn slot_peak(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(Self::slot_off(slot) + SLOT_PEAK)
    }

    /// The container's memory quota in bytes.
    pub fn quota(&self) -> u64 {
        self.u64_at(OFF_QUOTA).load(Ordering::Acquire)
    }

    /// Changes the quota (manager). Lowering it below the current use makes
    /// further allocations fail until enough is freed; nothing is revoked.
    pub fn set_quota(&self, quota: u64) {
        self.u64_at(OFF_QUOTA).store(quota, Ordering::Release);
    }

    /// Bytes the container's processes hold, all together.
    pub fn used(&self) -> u64 {
        self.u64_at(OFF_USED).load(Ordering::Acquire)
    }

    /// Most bytes the container ever held at once.
    pub fn peak(&self) -> u64 {
        self.u64_at(OFF_PEAK).load(Ordering::Relaxed)
    }

    /// Total time, in ns, the container's launch threads spent asleep
    /// waiting for compute tokens (every process, every thread, summed: two
    /// threads waiting together for 1 s count 2 s). Monotone; survives
    /// [`Ledger::reset`].
    pub fn throttled_ns(&self) -> u64 {
        self.u64_at(THROTTLED_NS_OFFSET).load(Ordering::Relaxed)
    }

    /// Adds `ns` a launch slept for tokens (interposer). Wraps after ~584
    /// years of summed sleep.
    pub fn add_throttled_ns(&self, ns: u64) {
        self.u64_at(THROTTLED_NS_OFFSET)
            .fetch_add(ns, Ordering::Relaxed);
    }

    /// Allocations the container's processes refused for the memory quota
    /// (`CUDA_ERROR_OUT_OF_MEMORY` without the driver running out).
    /// Monotone; survives [`Ledger::reset`].
    pub fn refused_allocations(&self) -> u64 {
        self.u64_at(REFUSED_ALLOCATIONS_OFFSET)
            .load(Ordering::Relaxed)
    }

    /// Counts one allocation refused for the quota (interposer, once per
    /// refused call, whichever reservation of it failed).
    pub fn count_refused_allocation(&self) {
        self.u64_at(REFUSED_ALLOCATIONS_OFFSET)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the compute quota's feedback is blind: 0 it sees the
    /// container's use (or has not looked yet), 1 NVML's samples show the
    /// device busy but name none of the container's host PIDs (a PID
    /// namespace, MPS), 2 no samples at all (MIG). Set by the interposer's
    /// controller; the quota then falls back (cuda-shim README, "Compute
    /// quota").
    pub fn compute_unattributed(&self) -> u64 {
        self.u64_at(COMPUTE_UNATTRIBUTED_OFFSET)
            .load(Ordering::Relaxed)
    }

    pub fn set_compute_unattributed(&self, v: u64) {
        self.u64_at(COMPUTE_UNATTRIBUTED_OFFSET)
            .store(v, Ordering::Relaxed);
    }

    /// Bumped by [`Ledger::reset`]; lets a process notice the ledger was
    /// reinitialised under it.
    pub fn generation(&self) -> u64 {
        self.u64_at(OFF_GENERATION).load(Ordering::Acquire)
    }

    /// Reserves `bytes` for the process in `slot`, atomically against the
    /// quota: concurrent reservations from any number of processes never
    /// take the total above it. Call before the driver allocates; on driver
    /// failure [`release`](Self::release) the same amount.
    pub fn try_reserve(&self, slot: usize, bytes: u64) -> Result<(), OverQuota> {
        let used = self.u64_at(OFF_USED);
        let mut cur = used.load(Ordering::Relaxed);
        loop {
            let quota = self.quota();
            let next = cur.checked_add(bytes).filter(|&n| n <= quota);
            let Some(next) = next else {
                return Err(OverQuota {
                    requested: bytes,
                    available: quota.saturating_sub(cur),
                    quota,
                });
            };
            match used.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.u64_at(OFF_PEAK).fetch_max(next, Ordering::Relaxed);
                    let s = self.slot_used(slot).fetch_add(bytes, Ordering::AcqRel) + bytes;
                    self.slot_peak(slot).fetch_max(s, Ordering::Relaxed);
                    return Ok(());
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Gives back `bytes` the process in `slot` freed (or failed to
    /// allocate). Saturates at zero: after the manager cleared a slot, a late
    /// free cannot wrap the counters.
    pub fn release(&self, slot: usize, bytes: u64) {
        sat_sub(self.slot_used(slot), bytes);
        sat_sub(self.u64_at(OFF_USED), bytes);
    }

    /// Adds `bytes` the process in `slot` already holds without a quota
    /// check (memory the driver took on its own: a context, a pool that
    /// grew). The container may end up above its quota; later reservations
    /// then fail until it is back under.
    pub fn force_reserve(&self, slot: usize, bytes: u64) {
        let n = self.u64_at(OFF_USED).fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.u64_at(OFF_PEAK).fetch_max(n, Ordering::Relaxed);
        let s = self.slot_used(slot).fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.slot_peak(slot).fetch_max(s, Ordering::Relaxed);
    }

    /// Makes `slot` hold exactly `bytes`, moving the container total by the
    /// difference without a quota check: the memory already exists. Used by
    /// a process that re-registers after losing its connection (the manager
    /// may have cleared its slot meanwhile) or that was handed a new ledger.
    pub fn reconcile(&self, slot: usize, bytes: u64) {
        let prev = self.slot_used(slot).swap(bytes, Ordering::AcqRel);
        if bytes > prev {
            let n = self
                .u64_at(OFF_USED)
                .fetch_add(bytes - prev, Ordering::AcqRel);
            self.u64_at(OFF_PEAK)
                .fetch_max(n + bytes - prev, Ordering::Relaxed);
        } else {
            sat_sub(self.u64_at(OFF_USED), prev - bytes);
        }
        self.slot_peak(slot).fetch_max(bytes, Ordering::Relaxed);
    }

    /// Claims a free slot for the process `host_pid` (manager, at
    /// registration). If `prefer` names a slot that `host_pid` already holds
    /// (a process re-registering after a manager restart), that slot is kept
    /// with its bytes. `None` when all slots are taken.
    pub fn claim_slot(&self, host_pid: i32, prefer: Option<usize>) -> Option<usize> {
        assert!(host_pid > 0, "host pid must be positive");
        if let Some(p) = prefer.filter(|&p| p < SLOTS)
            && self.slot_pid(p).load(Ordering::Acquire) == host_pid
        {
            return Some(p);
        }
        for i in 0..SLOTS {
            if self
                .slot_pid(i)
                .compare_exchange(0, host_pid, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                // A slot cleared by clear_slot is zero already; make sure.
                self.slot_used(i).store(0, Ordering::Release);
                self.slot_peak(i).store(0, Ordering::Relaxed);
                return Some(i);
            }
        }
        None
    }

    /// Frees `slot` and subtracts what its process held from the container
    /// total (manager, when the process's connection closes: the driver
    /// released a dead process's memory). Returns the bytes given back.
    pub fn clear_slot(&self, slot: usize) -> u64 {
        let bytes = self.slot_used(slot).swap(0, Ordering::AcqRel);
        sat_sub(self.u64_at(OFF_USED), bytes);
        self.slot_peak(slot).store(0, Ordering::Relaxed);
        self.slot_pid(slot).store(0, Ordering::Release);
        bytes
    }

    /// Clears every claimed slot whose process `alive` says is gone
    /// (manager recovery after a restart). Returns (pid, bytes) cleared.
    pub fn reclaim_dead(&self, alive: impl Fn(i32) -> bool) -> Vec<(i32, u64)> {
        self.slots()
            .filter(|s| !alive(s.pid))
            .map(|s| (s.pid, self.clear_slot(s.index)))
            .collect()
    }

    /// Every claimed slot.
    pub fn slots(&self) -> impl Iterator<Item = SlotInfo> + '_ {
        (0..SLOTS).filter_map(|i| self.slot(i))
    }

    /// One slot, if claimed.
    pub fn slot(&self, index: usize) -> Option<SlotInfo> {
        let pid = self.slot_pid(index).load(Ordering::Acquire);
        (pid != 0).then(|| SlotInfo {
            index,
            pid,
            used: self.slot_used(index).load(Ordering::Acquire),
            peak: self.slot_peak(index).load(Ordering::Relaxed),
        })
    }

    /// Zeroes every slot and the total and bumps the generation (manager,
    /// when it knows no process of the container is alive). The throttled
    /// and refused counters are kept: they are `_total` counters for the
    /// container's life.
    pub fn reset(&self) {
        for i in 0..SLOTS {
            self.clear_slot(i);
        }
        self.u64_at(OFF_USED).store(0, Ordering::Release);
        self.u64_at(OFF_PEAK).store(0, Ordering::Relaxed);
        self.u64_at(OFF_GENERATION).fetch_add(1, Ordering::AcqRel);
    }

    /// The compute-quota controller's shared words (zero in a new ledger).
    /// Their meaning is the controller's; nothing else touches them.
    pub fn compute_words(&self) -> &[AtomicU64; COMPUTE_WORDS] {
        // SAFETY: COMPUTE_OFFSET..HEADER_SIZE is inside the mapping and
        // 8-aligned (COMPUTE_WORDS is defined to fit exactly); the reference
        // lives no longer than `&self`, and the words are atomics only.
        unsafe { &*(self.base.add(COMPUTE_OFFSET) as *const [AtomicU64; COMPUTE_WORDS]) }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: `base` is our FILE_SIZE-byte mapping, unmapped once, here;
        // `&mut self` means no reference into it is still alive.
        unsafe { libc::munmap(self.base.cast(), FILE_SIZE) };
    }
}

fn sat_sub(a: &AtomicU64, bytes: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(bytes))
    });
}

/// `File::as_fd` spelled so the borrow is obvious at call sites.
trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
}

impl AsFdBorrowed for File {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }
}

/// Duplicates `fd` with close-on-exec (for passing the ledger on).
pub fn dup_cloexec(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a live borrowed descriptor; no memory passed.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` is the new descriptor fcntl just returned; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

#[cfg(test)]
mod tests {
    #[test]
    fn peek_reads_quota_and_use_without_a_slot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(super::LEDGER_FILE);
        let (l, _f) = super::Ledger::create(&path, 1000).unwrap();
        let slot = l.claim_slot(42, None).unwrap();
        l.try_reserve(slot, 300).unwrap();
        assert_eq!(super::Ledger::peek(&path).unwrap(), (1000, 300));
        std::fs::write(dir.path().join("short"), b"x").unwrap();
        assert!(matches!(
            super::Ledger::peek(&dir.path().join("short")),
            Err(super::LedgerError::Size { len: 1 })
        ));
    }

    use super::*;
    use std::os::fd::AsFd;
    use std::sync::Arc;

    fn new(quota: u64) -> (tempfile::TempDir, Ledger, File) {
        let dir = tempfile::tempdir().unwrap();
        let (l, f) = Ledger::create(&dir.path().join(LEDGER_FILE), quota).unwrap();
        (dir, l, f)
    }

    #[test]
    fn layout_constants() {
        assert_eq!(FILE_SIZE, 69632);
        assert_eq!(COMPUTE_WORDS, 384);
    }

    #[test]
    fn reserve_until_quota_then_refuse() {
        let (_d, l, _f) = new(1000);
        let s = l.claim_slot(42, None).unwrap();
        l.try_reserve(s, 600).unwrap();
        l.try_reserve(s, 400).unwrap();
        assert_eq!(
            l.try_reserve(s, 1),
            Err(OverQuota {
                requested: 1,
                available: 0,
                quota: 1000
            })
        );
        l.release(s, 400);
        assert_eq!(l.used(), 600);
        assert_eq!(l.slot(s).unwrap().used, 600);
        assert_eq!(l.peak(), 1000);
        assert!(l.try_reserve(s, u64::MAX).is_err(), "overflow is refused");
    }

    #[test]
    fn release_saturates() {
        let (_d, l, _f) = new(1000);
        let s = l.claim_slot(1, None).unwrap();
        l.try_reserve(s, 10).unwrap();
        l.release(s, 50);
        assert_eq!((l.used(), l.slot(s).unwrap().used), (0, 0));
    }

    #[test]
    fn clear_slot_gives_bytes_back_and_frees_it() {
        let (_d, l, _f) = new(1000);
        let a = l.claim_slot(10, None).unwrap();
        let b = l.claim_slot(11, None).unwrap();
        assert_ne!(a, b);
        l.try_reserve(a, 300).unwrap();
        l.try_reserve(b, 200).unwrap();
        assert_eq!(l.clear_slot(a), 300);
        assert_eq!(l.used(), 200);
        assert!(l.slot(a).is_none());
        assert_eq!(l.slots().count(), 1);
        assert_eq!(l.claim_slot(12, None), Some(a), "freed slot reused");
    }

    #[test]
    fn claim_prefers_own_slot() {
        let (_d, l, _f) = new(1000);
        let a = l.claim_slot(10, None).unwrap();
        l.try_reserve(a, 5).unwrap();
        assert_eq!(l.claim_slot(10, Some(a)), Some(a));
        assert_eq!(l.slot(a).unwrap().used, 5);
        let other = l.claim_slot(11, Some(a)).unwrap();
        assert_ne!(other, a, "a slot held by another pid is not handed over");
    }

    #[test]
    fn reconcile_moves_total() {
        let (_d, l, _f) = new(1000);
        let a = l.claim_slot(10, None).unwrap();
        l.try_reserve(a, 100).unwrap();
        l.reconcile(a, 250);
        assert_eq!((l.used(), l.slot(a).unwrap().used), (250, 250));
        l.reconcile(a, 50);
        assert_eq!((l.used(), l.slot(a).unwrap().used), (50, 50));
    }

    #[test]
    fn reclaim_dead_and_reset() {
        let (_d, l, _f) = new(1000);
        let a = l.claim_slot(10, None).unwrap();
        let b = l.claim_slot(11, None).unwrap();
        l.try_reserve(a, 1).unwrap();
        l.try_reserve(b, 2).unwrap();
        assert_eq!(l.reclaim_dead(|pid| pid == 11), vec![(10, 1)]);
        assert_eq!(l.used(), 2);
        let g = l.generation();
        l.reset();
        assert_eq!((l.used(), l.slots().count(), l.generation()), (0, 0, g + 1));
    }

    #[test]
    fn reopen_keeps_state_and_updates_quota() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        let (l, _f) = Ledger::create(&path, 1000).unwrap();
        let s = l.claim_slot(7, None).unwrap();
        l.try_reserve(s, 123).unwrap();
        drop(l);
        let (l2, _f2) = Ledger::create(&path, 2000).unwrap();
        assert_eq!((l2.used(), l2.quota()), (123, 2000));
        let (l3, f3) = Ledger::open(&path).unwrap();
        assert_eq!(l3.slot(s).unwrap().pid, 7);
        let dup = dup_cloexec(f3.as_fd()).unwrap();
        let l4 = Ledger::from_fd(dup.as_fd()).unwrap();
        drop(dup);
        l4.try_reserve(s, 1).unwrap();
        assert_eq!(l3.used(), 124, "mappings share the file");
    }

    #[test]
    fn rejects_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, vec![0u8; FILE_SIZE]).unwrap();
        assert!(matches!(Ledger::open(&p), Err(LedgerError::Magic)));
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(
            Ledger::open(&p),
            Err(LedgerError::Size { len: 5 })
        ));
        let e = Ledger::open(&dir.path().join("missing")).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[test]
    fn counters_start_at_zero_are_shared_and_survive_reset() {
        let (d, l, f) = new(1000);
        assert_eq!((l.throttled_ns(), l.refused_allocations()), (0, 0));
        let l2 = Ledger::from_fd(f.as_fd()).unwrap();
        l.add_throttled_ns(1_500);
        l2.add_throttled_ns(500);
        l2.count_refused_allocation();
        l.count_refused_allocation();
        assert_eq!((l.throttled_ns(), l.refused_allocations()), (2_000, 2));
        l.reset();
        assert_eq!((l2.throttled_ns(), l2.refused_allocations()), (2_000, 2));
        // They touch nothing else of the header or the compute area.
        assert_eq!((l.quota(), l.used(), l.peak()), (1000, 0, 0));
        assert!(
            l.compute_words()
                .iter()
                .all(|w| w.load(Ordering::Relaxed) == 0)
        );
        let raw = std::fs::read(d.path().join(LEDGER_FILE)).unwrap();
        let at = |o: usize| u64::from_le_bytes(raw[o..o + 8].try_into().unwrap());
        assert_eq!(
            (at(THROTTLED_NS_OFFSET), at(REFUSED_ALLOCATIONS_OFFSET)),
            (2_000, 2)
        );
        assert!(raw[72..COMPUTE_OFFSET].iter().all(|&b| b == 0), "reserved");
        assert_eq!(l.compute_unattributed(), 0);
        l2.set_compute_unattributed(1);
        assert_eq!(l.compute_unattributed(), 1, "shared");
    }

    #[test]
    fn a_ledger_from_before_the_counters_opens_with_them_at_zero() {
        // What an earlier build wrote: the same version, the counters'
        // bytes never touched.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        let mut raw = vec![0u8; FILE_SIZE];
        raw[..8].copy_from_slice(&MAGIC);
        raw[8..12].copy_from_slice(&1u32.to_le_bytes());
        raw[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
        raw[16..20].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        raw[20..24].copy_from_slice(&(SLOT_SIZE as u32).to_le_bytes());
        raw[24..32].copy_from_slice(&777u64.to_le_bytes());
        std::fs::write(&path, &raw).unwrap();
        let (l, _f) = Ledger::create(&path, 1000).unwrap();
        assert_eq!(VERSION, 1, "the counters did not change the layout version");
        assert_eq!((l.throttled_ns(), l.refused_allocations()), (0, 0));
        l.count_refused_allocation();
        assert_eq!(l.refused_allocations(), 1);
    }

    #[test]
    fn compute_area_is_shared_and_separate() {
        let (_d, l, f) = new(1000);
        let l2 = Ledger::from_fd(f.as_fd()).unwrap();
        l.compute_words()[0].store(99, Ordering::Relaxed);
        assert_eq!(l2.compute_words()[0].load(Ordering::Relaxed), 99);
        assert_eq!(l2.used(), 0);
        l.compute_words()[COMPUTE_WORDS - 1].store(1, Ordering::Relaxed);
        assert!(
            l.slot(0).is_none(),
            "last compute word does not touch slot 0"
        );
    }

    #[test]
    fn concurrent_reservations_never_overshoot() {
        let (_d, l, _f) = new(10_000);
        let l = Arc::new(l);
        let slots: Vec<usize> = (0..8)
            .map(|i| l.claim_slot(100 + i, None).unwrap())
            .collect();
        let threads: Vec<_> = slots
            .into_iter()
            .map(|s| {
                let l = Arc::clone(&l);
                std::thread::spawn(move || {
                    let mut held = 0u64;
                    for i in 0..20_000u64 {
                        let n = 1 + (i * 7919 + s as u64 * 31) % 97;
                        if l.try_reserve(s, n).is_ok() {
                            held += n;
                            assert!(l.used() <= 10_000);
                        }
                        if i % 3 == 0 && held > 0 {
                            let r = held.min(50);
                            l.release(s, r);
                            held -= r;
                        }
                    }
                    held
                })
            })
            .collect();
        let held: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(l.used(), held);
        assert!(l.peak() <= 10_000);
        assert_eq!(l.slots().map(|s| s.used).sum::<u64>(), held);
    }
}
