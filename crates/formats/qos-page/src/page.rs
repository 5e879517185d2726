//! The GPU's page: written by the node agent alone, read-only to tenants;
//! and the memfd plumbing flags share.

use crate::{MAGIC, MEMFD_PREFIX, PAGE_SIZE, SLOTS, VERSION};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicU64, Ordering::*};
use thiserror::Error;

const LIVE_OFF: usize = 16;
const GENERATION_OFF: usize = 24;
const PID_OFF: usize = 1024;
/// Against resizing: what the node agent adds at creation.
pub(crate) const SIZE_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
/// Against resizing and new writable mappings, seals sealed: what a
/// tenant requires before it maps a page or a flag read-only.
pub(crate) const READ_ONLY_SEALS: i32 = SIZE_SEALS | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;

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

pub(crate) fn io(what: &'static str) -> QosError {
    QosError::Io {
        what,
        source: std::io::Error::last_os_error(),
    }
}

/// A page-sized memfd named `name`, sealed against resizing.
pub(crate) fn memfd(name: String) -> Result<File, QosError> {
    let name = std::ffi::CString::new(name).map_err(|e| QosError::Invalid(e.to_string()))?;
    // SAFETY: a NUL-terminated name; flags are plain integers.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
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
    add_seals(&file, SIZE_SEALS)?;
    Ok(file)
}

pub(crate) fn add_seals(fd: &impl AsRawFd, seals: i32) -> Result<(), QosError> {
    // SAFETY: F_ADD_SEALS on a live descriptor, an integer argument.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io("sealing QoS page"));
    }
    Ok(())
}

/// Whether `fd` carries every seal of `want`.
pub(crate) fn sealed(fd: &impl AsRawFd, want: i32) -> Result<(), QosError> {
    // SAFETY: F_GET_SEALS on a live descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & want != want {
        return Err(QosError::Invalid(format!(
            "descriptor is not sealed against resizing and writing (seals {seals:#x})"
        )));
    }
    Ok(())
}

/// Maps a page-sized descriptor, writable or not; never unmapped.
pub(crate) fn map(
    fd: &impl AsRawFd,
    writable: bool,
) -> Result<&'static [AtomicU64; PAGE_SIZE / 8], QosError> {
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
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a fresh shared mapping of a page-sized, size-sealed memfd.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE_SIZE,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io("mmap QoS page"));
    }
    // SAFETY: PAGE_SIZE bytes mapped, page-aligned, never unmapped. Atomic
    // loads of a read-only mapping do not write.
    Ok(unsafe { &*(p as *const [AtomicU64; PAGE_SIZE / 8]) })
}

/// Checks a mapping's magic and version.
pub(crate) fn check_header(
    words: &[AtomicU64; PAGE_SIZE / 8],
    magic: [u8; 8],
    version: u32,
) -> Result<(), QosError> {
    let (m, v) = (words[0].load(Acquire), words[1].load(Acquire));
    if m != u64::from_ne_bytes(magic) || v != version as u64 {
        return Err(QosError::Invalid(format!(
            "magic {m:#x} version {v}, this build reads version {version}"
        )));
    }
    Ok(())
}

/// A mapping of a GPU's QoS page: the node agent's writable one, or a
/// tenant's read-only one. Never unmapped (a launch may be reading it in
/// another thread whenever), so a `QosPage` is `Copy`.
#[derive(Clone, Copy)]
pub struct QosPage {
    words: &'static [AtomicU64; PAGE_SIZE / 8],
}

/// A latency process's slot in a GPU's page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub slot: usize,
}

impl QosPage {
    /// A fresh page for GPU `gpu` (the node agent's): its mapping, and the
    /// descriptor to hand to share processes, which can only map it
    /// read-only.
    pub fn create_sealed(gpu: usize) -> Result<(QosPage, File), QosError> {
        let file = memfd(format!("{MEMFD_PREFIX}.{gpu}"))?;
        let words = map(&file, true)?;
        words[1].store(VERSION as u64, Release);
        words[0].store(u64::from_ne_bytes(MAGIC), Release);
        // The agent's mapping stays writable; none made from now on can be.
        add_seals(&file, libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL)?;
        Ok((QosPage { words }, file))
    }

    /// Maps, read-only, a page handed over by the node agent: a memfd of
    /// the page's size sealed against resizing and writing, with this
    /// version's magic.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<QosPage, QosError> {
        sealed(&fd, READ_ONLY_SEALS)?;
        let words = map(&fd, false)?;
        check_header(words, MAGIC, VERSION)?;
        Ok(QosPage { words })
    }

    fn word(&self, off: usize) -> &'static AtomicU64 {
        &self.words[off / 8]
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

    /// Bumped whenever a latency process registers or goes: a batch
    /// process that saw another asks for the flags again.
    pub fn generation(&self) -> u64 {
        self.word(GENERATION_OFF).load(Acquire)
    }

    // ---- the node agent (its writable mapping) ------------------------------

    /// Gives `pid` a free latency slot; `None` when all are taken.
    pub fn claim(&self, pid: i32) -> Option<Holder> {
        let slot = (0..SLOTS).find(|&i| {
            self.word(PID_OFF + 8 * i)
                .compare_exchange(0, pid as u64, AcqRel, Acquire)
                .is_ok()
        })?;
        self.word(LIVE_OFF).fetch_add(1, AcqRel);
        self.word(GENERATION_OFF).fetch_add(1, AcqRel);
        Some(Holder { slot })
    }

    /// Frees a slot whose process is gone.
    pub fn release(&self, h: Holder) {
        if self.word(PID_OFF + 8 * h.slot).swap(0, AcqRel) != 0 {
            let _ = self
                .word(LIVE_OFF)
                .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1));
            self.word(GENERATION_OFF).fetch_add(1, AcqRel);
        }
    }
}

#[cfg(test)]
mod tests;
