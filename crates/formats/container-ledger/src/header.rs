//! The header's container-wide words: quota, total, peak, generation and
//! the display's counters.

use std::sync::atomic::Ordering;

use crate::Ledger;
use crate::layout::*;

impl Ledger {
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

    /// Total time, in ns, the container's batch-tier launches waited for
    /// a latency-tier tenant of their GPU (docs/qos.md), every thread
    /// summed. Monotone; survives [`Ledger::reset`].
    pub fn qos_held_ns(&self) -> u64 {
        self.u64_at(QOS_HELD_NS_OFFSET).load(Ordering::Relaxed)
    }

    /// Adds `ns` a batch launch waited (interposer), and counts the hold.
    pub fn add_qos_held_ns(&self, ns: u64) {
        self.u64_at(QOS_HELD_NS_OFFSET)
            .fetch_add(ns, Ordering::Relaxed);
        self.u64_at(QOS_HOLDS_OFFSET)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The container's batch-tier launches that waited for a latency-tier
    /// tenant. Monotone; survives [`Ledger::reset`].
    pub fn qos_holds(&self) -> u64 {
        self.u64_at(QOS_HOLDS_OFFSET).load(Ordering::Relaxed)
    }

    /// Bumped by [`Ledger::reset`]; lets a process notice the ledger was
    /// reinitialised under it.
    pub fn generation(&self) -> u64 {
        self.u64_at(OFF_GENERATION).load(Ordering::Acquire)
    }
}
