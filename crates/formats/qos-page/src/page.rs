//! Creating, mapping and using a QoS page.

use crate::{MAGIC, MEMFD_PREFIX, PAGE_SIZE, SLOTS, VERSION};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicU64, Ordering::*};
use thiserror::Error;

const LIVE_OFF: usize = 16;
/// Offset of the active word (public: the interposer's launch path keeps a
/// pointer to it).
pub const ACTIVE_OFF: usize = 24;
const HELD_OFF: usize = 32;
const HOLDS_OFF: usize = 40;
const DEADLINE_OFF: usize = 512;
const PID_OFF: usize = 1024;
const SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

#[derive(Debug, Error)]
pub enum QosError {
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("QoS page: {0}")]
    Invalid(String),
    #[error("unknown QoS tier {0:?}: expected latency, batch or plain")]
    Tier(String),
}

fn io(what: &'static str) -> QosError {
    QosError::Io {
        what,
        source: std::io::Error::last_os_error(),
    }
}

/// A mapping of a QoS page. The mapping is never unmapped (a launch may be
/// reading it in another thread whenever), so a `QosPage` is `Copy`.
#[derive(Clone, Copy)]
pub struct QosPage {
    words: &'static [AtomicU64; PAGE_SIZE / 8],
}

/// A latency process's claim on a slot of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub slot: usize,
}

impl QosPage {
    /// A fresh page for GPU `gpu` in a sealed memfd: the mapping and the
    /// descriptor to hand to share processes.
    pub fn create_sealed(gpu: usize) -> Result<(QosPage, File), QosError> {
        let name = std::ffi::CString::new(format!("{MEMFD_PREFIX}.{gpu}")).unwrap();
        // SAFETY: a NUL-terminated name; flags are plain integers.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io("memfd_create QoS page"));
        }
        // SAFETY: `fd` was just returned to us and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(PAGE_SIZE as u64)
            .map_err(|source| QosError::Io {
                what: "sizing QoS page",
                source,
            })?;
        // SAFETY: F_ADD_SEALS on our live descriptor, an integer argument.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io("sealing QoS page"));
        }
        let page = Self::map(&file)?;
        page.words[1].store(VERSION as u64, Release);
        page.words[0].store(u64::from_ne_bytes(MAGIC), Release);
        Ok((page, file))
    }

    /// Maps a page handed over by the node agent: a sealed memfd of the
    /// page's size with this version's magic.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<QosPage, QosError> {
        // SAFETY: F_GET_SEALS on a live borrowed descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(QosError::Invalid(format!(
                "descriptor is not sealed against resizing (seals {seals:#x})"
            )));
        }
        let page = Self::map(&fd)?;
        let (magic, version) = (page.words[0].load(Acquire), page.words[1].load(Acquire));
        if magic != u64::from_ne_bytes(MAGIC) || version != VERSION as u64 {
            return Err(QosError::Invalid(format!(
                "magic {magic:#x} version {version}, this build reads version {VERSION}"
            )));
        }
        Ok(page)
    }

    fn map(fd: &impl AsRawFd) -> Result<QosPage, QosError> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat on a live descriptor into a buffer of its type.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(io("fstat QoS page"));
        }
        // SAFETY: fstat succeeded, so it filled the buffer.
        let size = unsafe { st.assume_init() }.st_size;
        if size != PAGE_SIZE as i64 {
            return Err(QosError::Invalid(format!(
                "{size} bytes, expected {PAGE_SIZE}"
            )));
        }
        // SAFETY: a fresh shared mapping of a page-sized, size-sealed memfd.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io("mmap QoS page"));
        }
        // SAFETY: PAGE_SIZE bytes mapped, page-aligned, never unmapped.
        let words = unsafe { &*(p as *const [AtomicU64; PAGE_SIZE / 8]) };
        Ok(QosPage { words })
    }

    fn word(&self, off: usize) -> &'static AtomicU64 {
        &self.words[off / 8]
    }

    /// The active word, for a launch path that keeps a pointer to it.
    pub fn active_word(&self) -> &'static AtomicU64 {
        self.word(ACTIVE_OFF)
    }

    /// The count of latency processes, for a launch path that keeps a
    /// pointer to it.
    pub fn live_word(&self) -> &'static AtomicU64 {
        self.word(LIVE_OFF)
    }

    /// Latency processes the node agent registered on this GPU.
    pub fn latency_live(&self) -> u64 {
        self.word(LIVE_OFF).load(Acquire)
    }

    // ---- the node agent ---------------------------------------------------

    /// Gives `pid` a free latency slot; `None` when all are taken.
    pub fn claim(&self, pid: i32) -> Option<Holder> {
        let slot = (0..SLOTS).find(|&i| {
            self.word(PID_OFF + 8 * i)
                .compare_exchange(0, pid as u64, AcqRel, Acquire)
                .is_ok()
        })?;
        self.word(DEADLINE_OFF + 8 * slot).store(0, Release);
        self.word(LIVE_OFF).fetch_add(1, AcqRel);
        Some(Holder { slot })
    }

    /// Frees a slot whose process is gone: its activity no longer counts.
    pub fn release(&self, h: Holder) {
        self.idle(h);
        self.word(DEADLINE_OFF + 8 * h.slot).store(0, Release);
        if self.word(PID_OFF + 8 * h.slot).swap(0, AcqRel) != 0 {
            let _ = self
                .word(LIVE_OFF)
                .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1));
        }
    }

    /// (batch launch time held in ns, holds), for metrics.
    pub fn held(&self) -> (u64, u64) {
        (
            self.word(HELD_OFF).load(Acquire),
            self.word(HOLDS_OFF).load(Acquire),
        )
    }

    // ---- latency processes ------------------------------------------------

    /// Work in flight until at most `deadline` (CLOCK_MONOTONIC ns).
    pub fn busy(&self, h: Holder, deadline: u64) {
        self.word(DEADLINE_OFF + 8 * h.slot)
            .store(deadline, Release);
        self.word(ACTIVE_OFF).fetch_or(1 << h.slot, AcqRel);
    }

    /// No work in flight any more.
    pub fn idle(&self, h: Holder) {
        self.word(ACTIVE_OFF).fetch_and(!(1 << h.slot), AcqRel);
    }

    // ---- batch processes --------------------------------------------------

    /// When some latency slot's work still counts at `now`: the latest of
    /// their deadlines. Bits whose deadline passed are cleared.
    pub fn held_until(&self, now: u64) -> Option<u64> {
        let mut mask = self.word(ACTIVE_OFF).load(Acquire);
        let mut until = None;
        while mask != 0 {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let d = self.word(DEADLINE_OFF + 8 * i).load(Acquire);
            if d > now {
                until = until.max(Some(d));
            } else {
                self.word(ACTIVE_OFF).fetch_and(!(1 << i), AcqRel);
            }
        }
        until
    }

    /// Counts a batch launch that waited `ns`.
    pub fn add_held(&self, ns: u64) {
        self.word(HELD_OFF).fetch_add(ns, Relaxed);
        self.word(HOLDS_OFF).fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests;
