//! The compute-quota controller's part of the header: its attribution flag
//! and its shared words.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::Ledger;
use crate::layout::*;

impl Ledger {
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

    /// The compute-quota controller's shared words (zero in a new ledger).
    /// Their meaning is the controller's; nothing else touches them.
    pub fn compute_words(&self) -> &[AtomicU64; COMPUTE_WORDS] {
        // SAFETY: COMPUTE_OFFSET..HEADER_SIZE is inside the mapping and
        // 8-aligned (COMPUTE_WORDS is defined to fit exactly); the reference
        // lives no longer than `&self`, and the words are atomics only.
        unsafe { &*(self.base.add(COMPUTE_OFFSET) as *const [AtomicU64; COMPUTE_WORDS]) }
    }
}
