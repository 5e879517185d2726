//! A latency process's flag: its work in flight on one GPU, which only it
//! can write and the GPU's batch processes read.

use crate::page::{READ_ONLY_SEALS, add_seals, check_header, map, memfd, sealed};
use crate::{FLAG_MAGIC, FLAG_MEMFD_PREFIX, FLAG_VERSION, PAGE_SIZE, QosError};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering::*};

const DEADLINE_OFF: usize = 16;

/// A new flag for the latency process in slot `slot` of GPU `gpu`'s page
/// (the node agent's): sealed against resizing only, so that process can
/// map it writable and seal it against writing itself ([`Flag::adopt`]).
/// The agent hands it on to batch processes only once it carries that
/// seal ([`Flag::is_sealed`]).
pub fn make_flag(gpu: usize, slot: usize) -> Result<File, QosError> {
    let file = memfd(format!("{FLAG_MEMFD_PREFIX}.{gpu}.{slot}"))?;
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&FLAG_MAGIC);
    head[8..12].copy_from_slice(&FLAG_VERSION.to_ne_bytes());
    file.write_all_at(&head, 0).map_err(|source| QosError::Io {
        what: "writing a latency flag's header",
        source,
    })?;
    Ok(file)
}

/// The latency process's writable flag.
#[derive(Clone, Copy)]
pub struct Flag {
    words: &'static [AtomicU64; PAGE_SIZE / 8],
}

impl Flag {
    /// Maps the flag handed to this latency process writable, then seals
    /// it against any other writer (its seals sealed): from then on only
    /// this mapping can change it.
    pub fn adopt(fd: BorrowedFd<'_>) -> Result<Flag, QosError> {
        let words = map(&fd, true)?;
        check_header(words, FLAG_MAGIC, FLAG_VERSION)?;
        add_seals(&fd, libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL)?;
        Ok(Flag { words })
    }

    /// Whether `fd` is a flag its process has sealed (the node agent
    /// hands on only those).
    pub fn is_sealed(fd: &impl AsRawFd) -> bool {
        sealed(fd, READ_ONLY_SEALS).is_ok()
    }

    /// Work in flight until at most `deadline` (CLOCK_MONOTONIC ns).
    pub fn busy(&self, deadline: u64) {
        self.words[DEADLINE_OFF / 8].store(deadline, Release);
    }

    /// No work in flight any more.
    pub fn idle(&self) {
        self.words[DEADLINE_OFF / 8].store(0, Release);
    }
}

/// A batch process's read-only view of a latency process's flag.
#[derive(Clone, Copy)]
pub struct FlagView {
    words: &'static [AtomicU64; PAGE_SIZE / 8],
}

impl FlagView {
    /// Maps a flag handed on by the node agent, read-only: it must carry
    /// the seals its latency process added.
    pub fn open(fd: BorrowedFd<'_>) -> Result<FlagView, QosError> {
        sealed(&fd, READ_ONLY_SEALS)?;
        let words = map(&fd, false)?;
        check_header(words, FLAG_MAGIC, FLAG_VERSION)?;
        Ok(FlagView { words })
    }

    /// Until when the process's work counts as in flight (0: none).
    pub fn deadline(&self) -> u64 {
        self.words[DEADLINE_OFF / 8].load(Acquire)
    }
}
