//! Process slots and the reservations against the quota: claiming and
//! clearing slots, reserving and releasing bytes, resetting the ledger.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use crate::layout::*;
use crate::{Ledger, OverQuota, SlotInfo};

impl Ledger {
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

    fn slot_local_pid(&self, slot: usize) -> &AtomicI32 {
        // SAFETY: as for `slot_pid`: SLOT_LOCAL_PID + 4 <= SLOT_SIZE, 4-byte
        // aligned, only ever accessed atomically.
        unsafe { &*(self.base.add(Self::slot_off(slot) + SLOT_LOCAL_PID) as *const AtomicI32) }
    }

    /// Records the PID the process in `slot` has in its own PID namespace
    /// (the interposer, after it attached). Processes of a container without
    /// hostPID are named by these PIDs when NVML answers a caller inside the
    /// container (measured on driver 580: `tests/gpu/probes/nvml_pidns.py`),
    /// while `pids.config` and the slot's `pid` hold host PIDs.
    pub fn set_local_pid(&self, slot: usize, pid: i32) {
        self.slot_local_pid(slot).store(pid, Ordering::Release);
    }

    fn slot_used(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(Self::slot_off(slot) + SLOT_USED)
    }

    fn slot_peak(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(Self::slot_off(slot) + SLOT_PEAK)
    }

    /// Reserves `bytes` for the process in `slot`, atomically against the
    /// quota: concurrent reservations from any number of processes never
    /// take the total above it. Call before the driver allocates; on driver
    /// failure [`release`](Self::release) the same amount.
    pub fn try_reserve(&self, slot: usize, bytes: u64) -> Result<(), OverQuota> {
        self.try_reserve_within(slot, bytes, self.quota())
    }

    /// [`try_reserve`](Self::try_reserve) against `quota`, not the header's
    /// word: what the interposer calls with the quota it read from the
    /// read-only quota file, since any process of the container can write
    /// the ledger (a store into the header's quota must not lift it).
    pub fn try_reserve_within(&self, slot: usize, bytes: u64, quota: u64) -> Result<(), OverQuota> {
        let used = self.u64_at(OFF_USED);
        let mut cur = used.load(Ordering::Relaxed);
        loop {
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
                self.slot_local_pid(i).store(0, Ordering::Release);
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
        self.slot_local_pid(slot).store(0, Ordering::Release);
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
            local_pid: self.slot_local_pid(index).load(Ordering::Acquire),
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
}

fn sat_sub(a: &AtomicU64, bytes: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(bytes))
    });
}
