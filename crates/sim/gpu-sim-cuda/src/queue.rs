//! The pending-launch queue of a context. A real GPU's launch queue is
//! bounded: about a thousand launches can be pending, after which the
//! launch call blocks until the device finishes one (NVIDIA developer forum,
//! "CUDA stream are blocked when launch lots of kernels (>1000)",
//! forums.developer.nvidia.com/t/68937, also stackoverflow.com/q/53970187:
//! ~190 us kernels launched in 4-5 us each for the first ~1000, then one
//! per kernel time; `cudaLimitDevRuntimePendingLaunchCount` does not change
//! it). Without the bound a process that never synchronises queues minutes
//! of work in a second, and whatever admitted it runs at 100 % long after.
//!
//! The sim keeps the simulated end of each of the last [`DEPTH`] launches
//! of the context in a ring: a launch takes the next slot and first sleeps
//! until the launch that held it [`DEPTH`] launches ago has ended (the
//! forum saw the bound per stream; one per context is the stricter reading
//! for a process with several streams). Atomics only; the wait sleeps.

use crate::ctx::wait_done;
use gpu_sim_core::state::now_ns;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// Launches a context may have pending (queued or running) on the device.
pub const DEPTH: usize = 1024;

pub(crate) struct LaunchQueue {
    next: AtomicU64,
    ends: [AtomicU64; DEPTH],
}

/// A launch's place in its context's queue, held from [`LaunchQueue::admit`]
/// until [`LaunchQueue::record`].
#[derive(Clone, Copy)]
pub(crate) struct Slot(usize);

impl LaunchQueue {
    pub fn new() -> LaunchQueue {
        LaunchQueue {
            next: AtomicU64::new(0),
            ends: [const { AtomicU64::new(0) }; DEPTH],
        }
    }

    /// Takes a slot, sleeping while the queue is full (until the launch
    /// [`DEPTH`] places earlier has finished on the simulated device).
    pub fn admit(&self, gpu: usize) -> Slot {
        let i = (self.next.fetch_add(1, AcqRel) % DEPTH as u64) as usize;
        let end = self.ends[i].load(Acquire);
        // The raw end: a bound this loose need not follow preemptions.
        if end > now_ns() {
            wait_done(gpu, end);
        }
        Slot(i)
    }

    /// The launch in `slot` ends at `end` (simulated ns).
    pub fn record(&self, slot: Slot, end: u64) {
        self.ends[slot.0].store(end, Release);
    }

    /// Launches whose simulated end is still ahead.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        let now = now_ns();
        self.ends.iter().filter(|e| e.load(Acquire) > now).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_after_a_full_queue_waits_for_the_oldest_to_end() {
        let q = LaunchQueue::new();
        let t0 = now_ns();
        let first_end = t0 + 30_000_000;
        for i in 0..DEPTH {
            let s = q.admit(0);
            q.record(s, first_end + i as u64);
        }
        assert!(
            now_ns() - t0 < 20_000_000,
            "a thousand launches queue freely"
        );
        assert_eq!(q.pending(), DEPTH);
        let s = q.admit(0);
        assert!(
            now_ns() >= first_end,
            "the full queue's next launch blocked"
        );
        q.record(s, now_ns() + 1_000_000);
    }
}
