//! The kernel timeline: launches queue on each GPU's timeline, and
//! utilization is read back from the ring of busy intervals.

use super::layout::{DeviceBlock, RING};
use super::{Attached, ProcessInfo, SharedState, now_ns};
use std::sync::atomic::Ordering::*;

impl SharedState {
    /// Queues a kernel of `duration_ns` on `gpu`'s timeline, not before
    /// `not_before_ns` (the end of the previous work on the caller's stream).
    /// Kernels never overlap (no MPS: contexts time-slice), and one that
    /// waits behind another process's work pays the node's
    /// `context_switch_ns` of idle device time first. Returns its simulated
    /// (start, end). Atomics and a vDSO clock read only: no syscall.
    pub fn launch(
        &self,
        me: Attached,
        gpu: usize,
        duration_ns: u64,
        not_before_ns: u64,
    ) -> (u64, u64) {
        let dev = self.device(gpu);
        let now = now_ns();
        let ready = now.max(not_before_ns);
        // Contexts of different processes time-slice: a kernel that waits
        // behind another process's work starts after a context switch.
        let prev = dev.last_owner.swap(me.owner(), AcqRel);
        let switch = if prev != me.owner() {
            self.node().context_switch_ns
        } else {
            0
        };
        let mut start = 0;
        let mut end = 0;
        let _ = dev.busy_until.fetch_update(AcqRel, Acquire, |busy| {
            start = if busy > ready { busy + switch } else { ready };
            end = start + duration_ns;
            Some(end)
        });
        self.record(dev, me.owner(), start, end);
        (start, end)
    }

    fn record(&self, dev: &DeviceBlock, owner: u64, start: u64, end: u64) {
        // Back-to-back kernels of one process extend its last interval, so a
        // saturating process costs one ring entry, not one per launch.
        let head = dev.ring_head.load(Acquire);
        if head > 0 {
            let last = &dev.ring[((head - 1) as usize) % RING];
            if last.seq.load(Acquire) == head
                && last.owner.load(Acquire) == owner
                && last
                    .end
                    .compare_exchange(start, end, AcqRel, Acquire)
                    .is_ok()
            {
                return;
            }
        }
        let idx = dev.ring_head.fetch_add(1, AcqRel);
        let e = &dev.ring[(idx as usize) % RING];
        e.seq.store(0, Release);
        e.start.store(start, Release);
        e.end.store(end, Release);
        e.owner.store(owner, Release);
        e.seq.store(idx + 1, Release);
    }

    /// Busy nanoseconds on `gpu` within [from, to), for one owner or all,
    /// and the part of the window the ring still covers.
    fn busy_ns(&self, gpu: usize, from: u64, to: u64, owner: Option<u64>) -> (u64, u64) {
        let dev = self.device(gpu);
        let head = dev.ring_head.load(Acquire);
        let n = head.min(RING as u64);
        let mut busy = 0;
        let mut oldest = u64::MAX;
        for k in 0..n {
            let idx = head - 1 - k;
            let e = &dev.ring[(idx as usize) % RING];
            if e.seq.load(Acquire) != idx + 1 {
                continue;
            }
            let (s, en, o) = (
                e.start.load(Acquire),
                e.end.load(Acquire),
                e.owner.load(Acquire),
            );
            if e.seq.load(Acquire) != idx + 1 {
                continue;
            }
            oldest = oldest.min(s);
            if owner.is_some_and(|w| w != o) {
                continue;
            }
            let (a, b) = (s.max(from), en.min(to));
            if b > a {
                busy += b - a;
            }
        }
        // When the ring wrapped, only the part it still covers is known.
        let covered_from = if head > RING as u64 {
            oldest.max(from)
        } else {
            from
        };
        (busy, to.saturating_sub(covered_from))
    }

    /// Percent of [from, to) during which `gpu` ran kernels.
    pub fn utilization(&self, gpu: usize, from: u64, to: u64) -> f64 {
        let (busy, window) = self.busy_ns(gpu, from, to, None);
        if window == 0 {
            0.0
        } else {
            (busy as f64 * 100.0 / window as f64).min(100.0)
        }
    }

    /// Per-process percent of [from, to) on `gpu`, for processes that ran in it.
    pub fn process_utilization(&self, gpu: usize, from: u64, to: u64) -> Vec<(ProcessInfo, f64)> {
        self.processes(gpu)
            .into_iter()
            .filter_map(|p| {
                let owner = p.slot as u64 | (p.generation as u64) << 16;
                let (busy, window) = self.busy_ns(gpu, from, to, Some(owner));
                (busy > 0 && window > 0)
                    .then(|| (p, (busy as f64 * 100.0 / window as f64).min(100.0)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::state::tests::installed;
    use crate::state::{SharedState, now_ns};

    #[test]
    fn timeline_queues_and_measures() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.set_active(me, 0);
        let t0 = now_ns();
        let (s1, e1) = s.launch(me, 0, 1_000_000, 0);
        let (s2, e2) = s.launch(me, 0, 1_000_000, 0);
        assert!(s1 >= t0 && e1 - s1 == 1_000_000);
        assert_eq!(s2, e1, "second kernel queues behind the first");
        assert_eq!(e2 - s2, 1_000_000);
        let u = s.utilization(0, s1, e2);
        assert!((u - 100.0).abs() < 1e-9, "{u}");
        let u = s.utilization(0, s1, e2 + 2_000_000);
        assert!((u - 50.0).abs() < 1e-9, "{u}");
        let per = s.process_utilization(0, s1, e2);
        assert_eq!(per.len(), 1);
        assert!((per[0].1 - 100.0).abs() < 1e-9);
    }

    #[test]
    fn another_process_waits_for_a_context_switch() {
        let (_d, root) = installed();
        let (a, b) = (
            SharedState::open(&root).unwrap(),
            SharedState::open(&root).unwrap(),
        );
        let (ma, mb) = (a.attach().unwrap(), b.attach().unwrap());
        assert_ne!(ma.owner(), mb.owner());
        let switch = a.node().context_switch_ns;
        assert!(switch > 0);
        let (_, e1) = a.launch(ma, 0, 5_000_000, 0);
        let (s2, e2) = b.launch(mb, 0, 1_000_000, 0);
        assert_eq!(s2, e1 + switch, "behind another context: a switch first");
        let (s3, _) = b.launch(mb, 0, 1_000_000, 0);
        assert_eq!(s3, e2, "same context: back to back");
        // The switch is nobody's: idle device time.
        let u = a.utilization(0, e1, s2);
        assert!(u.abs() < 1e-9, "{u}");
    }
}
