//! Memory accounting: per GPU and per process, never over the card.

use super::{Attached, SharedState};
use std::sync::atomic::Ordering::*;
use thiserror::Error;

/// The device ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("out of memory on GPU {gpu}: {requested} bytes requested, {free} free")]
pub struct OutOfMemory {
    pub gpu: usize,
    pub requested: u64,
    pub free: u64,
}

impl SharedState {
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
        // A MIG device's process: bounded by its GPU instance first.
        let in_gi = self
            .take_in_gi(me, gpu, bytes)
            .map_err(|free| OutOfMemory {
                gpu,
                requested: bytes,
                free,
            })?;
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
                    if in_gi {
                        self.give_in_gi(me.slot as usize, gpu, bytes);
                    }
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
        self.give_in_gi(me.slot as usize, gpu, given);
        self.device(gpu)
            .used
            .fetch_update(AcqRel, Acquire, |u| Some(u.saturating_sub(given)))
            .unwrap();
    }
}

#[cfg(test)]
mod tests {
    use crate::state::SharedState;
    use crate::state::tests::installed;
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
}
