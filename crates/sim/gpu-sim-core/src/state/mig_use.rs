//! Processes using MIG devices: which MIG device a process uses on a GPU
//! (its binding, in its process slot), and that device's own memory and
//! timeline (a `DeviceBlock` per GPU instance).
//!
//! A process bound to GPU instance `gi` of `gpu` allocates from `gi`'s
//! memory (bounded by the instance's size, counted apart from the other
//! instances) and queues kernels on `gi`'s timeline: GPU instances are
//! hardware partitions, so they never wait on each other, while processes
//! in one instance time-slice it as on a whole GPU. What it allocates is
//! also counted on the GPU and the process (the parent's memory and
//! process lists stay whole).

use super::layout::{DeviceBlock, MAX_PROCS, SLOT_LIVE};
use super::{Attached, SharedState};
use std::sync::atomic::Ordering::*;

fn encode(gi: u32, ci: u32) -> u32 {
    (gi + 1) | (ci + 1) << 8
}

fn decode(word: u32) -> Option<(u32, u32)> {
    let gi = (word & 0xff).checked_sub(1)?;
    let ci = ((word >> 8) & 0xff).checked_sub(1)?;
    Some((gi, ci))
}

impl SharedState {
    /// Records that the calling process uses compute instance `ci` of GPU
    /// instance `gi` on `gpu` (before it allocates or launches there);
    /// `false` on a node without MIG.
    pub fn bind_mig(&self, me: Attached, gpu: usize, gi: u32, ci: u32) -> bool {
        let Some(b) = self.mig_binding(me.slot as usize) else {
            return false;
        };
        b[gpu].store(encode(gi, ci), Release);
        true
    }

    /// The (GPU instance, compute instance) slot `slot` uses on `gpu`.
    pub(super) fn mig_use_of(&self, slot: usize, gpu: usize) -> Option<(u32, u32)> {
        decode(self.mig_binding(slot)?[gpu].load(Acquire))
    }

    /// Forgets a slot's bindings (attach and reclaim).
    pub(super) fn clear_mig_use(&self, slot: usize) {
        if let Some(b) = self.mig_binding(slot) {
            b.iter().for_each(|w| w.store(0, Release));
        }
    }

    /// The GPU-instance block the caller uses on `gpu`, if bound.
    pub(super) fn bound_block(&self, me: Attached, gpu: usize) -> Option<(u32, &DeviceBlock)> {
        let (gi, _) = self.mig_use_of(me.slot as usize, gpu)?;
        Some((gi, self.gi_block(gpu, gi)?))
    }

    /// The device block kernels of the caller on `gpu` queue on.
    pub(super) fn engine(&self, me: Attached, gpu: usize) -> &DeviceBlock {
        match self.bound_block(me, gpu) {
            Some((_, b)) => b,
            None => self.device(gpu),
        }
    }

    /// Bytes of GPU instance `gi` of `gpu`; 0 once it is destroyed.
    pub fn gi_memory_total(&self, gpu: usize, gi: u32) -> u64 {
        self.gpu_instance(gpu, gi)
            .map_or(0, |g| g.profile.memory_mib << 20)
    }

    /// Bytes in use in GPU instance `gi` of `gpu`.
    pub fn gi_memory_used(&self, gpu: usize, gi: u32) -> u64 {
        self.reap_dead();
        self.gi_block(gpu, gi).map_or(0, |b| b.used.load(Acquire))
    }

    /// (total, used) of the memory the caller sees on `gpu`: its MIG
    /// device's GPU instance when bound, else the whole GPU's.
    pub fn memory_seen(&self, me: Attached, gpu: usize) -> (u64, u64) {
        match self.mig_use_of(me.slot as usize, gpu) {
            Some((gi, _)) => (self.gi_memory_total(gpu, gi), self.gi_memory_used(gpu, gi)),
            None => (self.memory_total(gpu), self.memory_used(gpu)),
        }
    }

    /// Takes `bytes` of the caller's GPU instance on `gpu`, when bound:
    /// `Err(free)` when it is full. `Ok(true)`: taken; `Ok(false)`: not bound.
    pub(super) fn take_in_gi(&self, me: Attached, gpu: usize, bytes: u64) -> Result<bool, u64> {
        let Some((gi, block)) = self.bound_block(me, gpu) else {
            return Ok(false);
        };
        let total = self.gi_memory_total(gpu, gi);
        let mut reaped = false;
        loop {
            let r = block.used.fetch_update(AcqRel, Acquire, |u| {
                u.checked_add(bytes).filter(|&n| n <= total)
            });
            match r {
                Ok(_) => return Ok(true),
                Err(_) if !reaped => {
                    self.reap_dead();
                    reaped = true;
                }
                Err(used) => return Err(total.saturating_sub(used)),
            }
        }
    }

    /// Gives back `bytes` of slot `slot`'s GPU instance on `gpu`, if bound.
    pub(super) fn give_in_gi(&self, slot: usize, gpu: usize, bytes: u64) {
        let Some((gi, _)) = self.mig_use_of(slot, gpu) else {
            return;
        };
        if let Some(b) = self.gi_block(gpu, gi) {
            let _ = b
                .used
                .fetch_update(AcqRel, Acquire, |u| Some(u.saturating_sub(bytes)));
        }
    }

    /// Whether a live process uses compute instance `ci` of GPU instance
    /// `gi` on `gpu` (dead ones reclaimed first).
    pub(super) fn mig_in_use(&self, gpu: usize, gi: u32, ci: u32) -> bool {
        self.reap_dead();
        (0..MAX_PROCS).any(|i| {
            self.slot(i).state.load(Acquire) == SLOT_LIVE
                && self.mig_use_of(i, gpu) == Some((gi, ci))
        })
    }

    /// The (GPU instance, compute instance) a listed process uses on `gpu`.
    pub fn process_mig_use(&self, slot: u32, gpu: usize) -> Option<(u32, u32)> {
        self.mig_use_of(slot as usize, gpu)
    }
}

#[cfg(test)]
mod tests;
