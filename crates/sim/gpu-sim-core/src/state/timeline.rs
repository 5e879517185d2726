//! The kernel timeline: launches queue on each GPU's timeline, and
//! utilization is read back from the ring of busy intervals.

use super::layout::{DeviceBlock, RING};
use super::slice;
use super::{Attached, ProcessInfo, SharedState, now_ns};
use std::sync::atomic::Ordering::*;

/// A whole device's capacity, in the units kernels' shares are counted in.
pub(super) const FULL: u64 = 1 << 16;

/// A kernel that would queue behind its own process's work (from another
/// stream) runs beside it instead, from the start of the group it joins,
/// when the group leaves room for it; `None`: it queues.
fn beside(dev: &DeviceBlock, ready: u64, need: u64, duration_ns: u64) -> Option<(u64, u64)> {
    if ready >= dev.busy_until.load(Acquire) {
        return None;
    }
    dev.group_room
        .fetch_update(AcqRel, Acquire, |room| room.checked_sub(need))
        .ok()?;
    let start = ready.max(dev.group_start.load(Acquire));
    let end = start + duration_ns;
    dev.busy_until.fetch_max(end, AcqRel);
    Some((start, end))
}

/// Records a kernel's interval in `dev`'s ring. Back-to-back (or
/// side-by-side) kernels of one process extend its last interval, so a
/// saturating process costs one ring entry, not one per launch, and
/// overlapping kernels count once.
pub(super) fn record(dev: &DeviceBlock, owner: u64, start: u64, end: u64) {
    let head = dev.ring_head.load(Acquire);
    if head > 0 {
        let last = &dev.ring[((head - 1) as usize) % RING];
        if last.seq.load(Acquire) == head
            && last.owner.load(Acquire) == owner
            && (last.start.load(Acquire)..=last.end.load(Acquire)).contains(&start)
        {
            last.end.fetch_max(end, AcqRel);
            return;
        }
    }
    push(dev, owner, start, end);
}

/// Records an interval in a ring entry of its own.
pub(super) fn push(dev: &DeviceBlock, owner: u64, start: u64, end: u64) {
    let idx = dev.ring_head.fetch_add(1, AcqRel);
    let e = &dev.ring[(idx as usize) % RING];
    e.seq.store(0, Release);
    e.start.store(start, Release);
    e.end.store(end, Release);
    e.owner.store(owner, Release);
    e.seq.store(idx + 1, Release);
}

/// Busy nanoseconds on `dev`'s timeline within [from, to), for one owner
/// or all, and the part of the window its ring still covers.
fn busy_in(dev: &DeviceBlock, from: u64, to: u64, owner: Option<u64>) -> (u64, u64) {
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

/// (busy, window) as a percent, at most 100; 0 for an empty window.
fn percent((busy, window): (u64, u64)) -> f64 {
    if window == 0 {
        0.0
    } else {
        (busy as f64 * 100.0 / window as f64).min(100.0)
    }
}

impl SharedState {
    /// Queues a kernel of `duration_ns` that fills `gpu` on its timeline,
    /// not before `not_before_ns` (the end of the previous work on the
    /// caller's stream). See [`Self::launch_with`].
    pub fn launch(
        &self,
        me: Attached,
        gpu: usize,
        duration_ns: u64,
        not_before_ns: u64,
    ) -> (u64, u64) {
        self.launch_with(me, gpu, duration_ns, not_before_ns, 1.0)
    }

    /// Queues a kernel of `duration_ns` occupying `share` (0..=1) of `gpu`.
    /// Kernels of different processes never overlap (no MPS: contexts
    /// time-slice), and one that waits behind another process's work pays
    /// the node's `context_switch_ns` of idle device time first; when that
    /// work holds the device past the current timeslice, the kernel runs at
    /// the slice's end instead and the work moves later (`slice.rs`). A
    /// kernel of the process whose work the device runs, from another
    /// stream, runs beside that work while the device has room for it.
    /// Returns its simulated (start, end). Atomics and a vDSO clock read
    /// only, unless it preempts.
    pub fn launch_with(
        &self,
        me: Attached,
        gpu: usize,
        duration_ns: u64,
        not_before_ns: u64,
        share: f64,
    ) -> (u64, u64) {
        // A MIG device's process queues on its GPU instance's timeline.
        let dev = self.engine(me, gpu);
        let ready = now_ns().max(self.resolve_in(dev, me, not_before_ns));
        self.queue_at(dev, me, ready, duration_ns, share)
    }

    /// [`Self::launch_with`] from `ready`, a time already resolved.
    fn queue_at(
        &self,
        dev: &DeviceBlock,
        me: Attached,
        ready: u64,
        duration_ns: u64,
        share: f64,
    ) -> (u64, u64) {
        let node = self.node();
        if node.timeslice_ns > 0
            && dev.last_owner.load(Acquire) != me.owner()
            && dev.busy_until.load(Acquire) > ready
        {
            let (slice, switch) = (node.timeslice_ns, node.context_switch_ns);
            if let Some((start, end, from)) =
                slice::preempt(dev, me.owner(), ready, duration_ns, slice, switch)
            {
                self.stamps.note(end, from);
                return (start, end);
            }
        }
        let need = ((share.clamp(0.0, 1.0) * FULL as f64).ceil() as u64).max(1);
        let prev = dev.last_owner.swap(me.owner(), AcqRel);
        if prev == me.owner()
            && let Some((start, end)) = beside(dev, ready, need, duration_ns)
        {
            record(dev, me.owner(), start, end);
            return (start, end);
        }
        let switch = if prev != me.owner() {
            node.context_switch_ns
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
        dev.group_start.store(start, Release);
        dev.group_room.store(FULL.saturating_sub(need), Release);
        record(dev, me.owner(), start, end);
        (start, end)
    }

    /// As [`Self::launch_with`], for a kernel of a stream whose priority
    /// is above that of the caller's work queued before it: while the
    /// device runs the caller's own work, the kernel starts once the blocks
    /// running now finish (one wave of `wave_ns`) and that work waits
    /// (block scheduling favours the higher-priority stream's blocks;
    /// running blocks are not preempted). Behind another process's work it
    /// queues as any kernel: priorities order a context's own streams.
    pub fn launch_ahead(
        &self,
        me: Attached,
        gpu: usize,
        duration_ns: u64,
        not_before_ns: u64,
        share: f64,
        wave_ns: u64,
    ) -> (u64, u64) {
        let dev = self.engine(me, gpu);
        let ready = now_ns().max(self.resolve_in(dev, me, not_before_ns));
        if dev.last_owner.load(Acquire) == me.owner()
            && dev.busy_until.load(Acquire) > ready + wave_ns
            && let Some((start, end, from)) =
                slice::ahead(dev, me.owner(), ready + wave_ns, duration_ns)
        {
            self.stamps.note(end, from);
            return (start, end);
        }
        self.queue_at(dev, me, ready, duration_ns, share)
    }

    /// When the caller's work on `gpu` that was to end at `t` (a time this
    /// state gave it) ends now, after other processes' kernels preempted
    /// it (`slice.rs`). 0 stays 0.
    pub fn resolve(&self, me: Attached, gpu: usize, t: u64) -> u64 {
        self.resolve_in(self.engine(me, gpu), me, t)
    }

    fn resolve_in(&self, dev: &DeviceBlock, me: Attached, t: u64) -> u64 {
        let sb = &dev.slices;
        if t == 0 || sb.head.load(Acquire) == 0 {
            return t;
        }
        slice::resolve(sb, me.owner(), t, self.stamps.lookup(t))
    }

    /// `t`, a time read now from the timeline, noted as one the shifts
    /// made so far do not move.
    fn fresh(&self, dev: &DeviceBlock, t: u64) -> u64 {
        let sb = &dev.slices;
        let head = sb.head.load(Acquire);
        if head > 0 && t <= sb.max_old_busy.load(Acquire) {
            self.stamps.note(t, head);
        }
        t
    }

    /// When `gpu` would serve the caller's next command queued now, not
    /// before `not_before_ns` (its stream's tail): at once, or, while
    /// another process's work holds the device, after that work and a
    /// context switch (or at the end of the holder's timeslice). An event
    /// recorded on a stream is stamped then: on NVIDIA's GPUs an event is
    /// a command in its context's channel, processed when the context
    /// runs, so an event before a kernel and one after it bracket the
    /// kernel's own time, not the time it waited for another context.
    /// Reads only.
    pub fn served_from(&self, me: Attached, gpu: usize, not_before_ns: u64) -> u64 {
        let dev = self.engine(me, gpu);
        let ready = now_ns().max(self.resolve_in(dev, me, not_before_ns));
        let busy = dev.busy_until.load(Acquire);
        if dev.last_owner.load(Acquire) == me.owner() || busy <= ready {
            return self.fresh(dev, ready);
        }
        let node = self.node();
        let (slice, switch) = (node.timeslice_ns, node.context_switch_ns);
        if slice > 0
            && let Some(p) = slice::place(&dev.slices, busy, me.owner(), ready, 0, slice, switch)
        {
            return self.fresh(dev, p.start);
        }
        busy + switch
    }

    /// Busy nanoseconds on `gpu` within [from, to), for one owner or all,
    /// and the part of the window the ring still covers.
    fn busy_ns(&self, gpu: usize, from: u64, to: u64, owner: Option<u64>) -> (u64, u64) {
        busy_in(self.device(gpu), from, to, owner)
    }

    /// Percent of [from, to) during which `gpu` ran kernels.
    pub fn utilization(&self, gpu: usize, from: u64, to: u64) -> f64 {
        percent(self.busy_ns(gpu, from, to, None))
    }

    /// Percent of [from, to) during which GPU instance `gi` of `gpu` ran
    /// kernels: its own timeline (mig_use.rs), which the GPU's does not
    /// include. 0 for an instance that does not exist (any more).
    pub fn gi_utilization(&self, gpu: usize, gi: u32, from: u64, to: u64) -> f64 {
        // A destroyed instance's block keeps its old intervals: ask the
        // MIG state first (which also bounds `gi` for gi_block).
        if self.gpu_instance(gpu, gi).is_none() {
            return 0.0;
        }
        self.gi_block(gpu, gi)
            .map_or(0.0, |b| percent(busy_in(b, from, to, None)))
    }

    /// Per-process percent of [from, to) on `gpu`, for processes that ran in it.
    pub fn process_utilization(&self, gpu: usize, from: u64, to: u64) -> Vec<(ProcessInfo, f64)> {
        self.processes(gpu)
            .into_iter()
            .filter_map(|p| {
                let owner = p.slot as u64 | (p.generation as u64) << 16;
                let (busy, window) = self.busy_ns(gpu, from, to, Some(owner));
                (busy > 0 && window > 0).then(|| (p, percent((busy, window))))
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
    fn streams_of_one_process_share_the_device_while_they_fit() {
        let (_d, root) = installed();
        let s = SharedState::open(&root).unwrap();
        let me = s.attach().unwrap();
        s.set_active(me, 0);
        let (s1, e1) = s.launch_with(me, 0, 1_000_000, 0, 0.5);
        // Another stream (ready now): beside the first, not behind it.
        let (s2, e2) = s.launch_with(me, 0, 1_000_000, 0, 0.5);
        assert!(s2 < e1 && s2 >= s1, "{s1} {e1} {s2}");
        // The device is full: the next one queues.
        let (s3, e3) = s.launch_with(me, 0, 1_000_000, 0, 0.1);
        assert_eq!(s3, e2.max(e1));
        // Its own stream's tail: after it, whatever the room.
        let (s4, _) = s.launch_with(me, 0, 1_000, e3, 0.1);
        assert_eq!(s4, e3);
        // Overlapping kernels count once.
        let u = s.utilization(0, s1, e3);
        assert!((u - 100.0).abs() < 1e-9, "{u}");
        let per = s.process_utilization(0, s1, e3);
        assert!((per[0].1 - 100.0).abs() < 1e-9, "{per:?}");
    }

    #[test]
    fn another_process_waits_for_a_context_switch() {
        // Without a timeslice: in the order queued.
        let (_d, root) = crate::state::tests::installed_with("timeslice_ns = 0");
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
