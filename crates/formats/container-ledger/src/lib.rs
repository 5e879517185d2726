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
//! header holds the quota, the total, its peak, the generation and four
//! container-wide counters the interposer bumps for the display's metrics
//! ([`Ledger::throttled_ns`], [`Ledger::refused_allocations`],
//! [`Ledger::qos_held_ns`] at byte 80, [`Ledger::qos_holds`] at 88), the
//! compute controller's attribution flag ([`Ledger::compute_unattributed`]);
//! bytes `96..1024` are reserved (zero); bytes `1024..4096` belong to the compute-quota
//! controller ([`Ledger::compute_words`]).
//!
//! The counters took reserved bytes that every ledger of this version has
//! always kept zero, so the layout version did not change: a ledger created
//! before them reads as "nothing throttled, nothing refused yet" and counts
//! from there, by old and new processes alike (an old interposer simply
//! never bumps them). A slot's local PID (bytes 24..28 of the slot) came the
//! same way: 0 reads as "not written".

#![deny(unsafe_op_in_unsafe_fn)]

mod compute;
pub mod fdpass;
mod header;
mod layout;
mod map;
mod peek;
mod sealed;
mod slots;

use thiserror::Error;

pub use layout::{
    COMPUTE_OFFSET, COMPUTE_UNATTRIBUTED_OFFSET, COMPUTE_WORDS, FILE_SIZE, HEADER_SIZE,
    LEDGER_FILE, MAGIC, QOS_HELD_NS_OFFSET, QOS_HOLDS_OFFSET, REFUSED_ALLOCATIONS_OFFSET,
    SLOT_SIZE, SLOTS, THROTTLED_NS_OFFSET, VERSION,
};
pub use map::dup_cloexec;
pub use sealed::{MEMFD_PREFIX, MemfdId, REQUIRED_SEALS, find_live, memfd_paths, proc_pids, seals};

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
    #[error(
        "ledger descriptor is not sealed against resizing (seals {seals:#x}, need {:#x}): \
         refusing to map memory whose size another process controls",
        REQUIRED_SEALS
    )]
    Unsealed { seals: i32 },
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
    /// Its PID in its own PID namespace, as the process wrote it
    /// ([`Ledger::set_local_pid`]); 0 until then (or from an interposer
    /// that predates the field). What the driver's NVML names the process
    /// to callers in the container's namespace.
    pub local_pid: i32,
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

#[cfg(test)]
mod tests;
