//! Where a kernel lands on its device's timeline: NVIDIA's scheduler
//! time-slices the contexts of different processes. A context keeps the
//! device until its timeslice ends or it runs out of work; then the next
//! context with work runs; a kernel longer than a timeslice is preempted
//! and resumed later. So a process that launches while another's work is
//! queued waits for the rest of that one's current timeslice, not for its
//! whole queue, and the queued work moves later by what it ran.
//!
//! The sim places work when it is launched, so that is where the rule is
//! applied: the newcomer's kernel goes in at the holder's next slice
//! boundary (or where the holder's work ends, if sooner), everything queued
//! from there on moves later by the time it took (the holder's own later
//! launches start that much later too), and its next kernels continue its
//! run while the slice lasts. One thing is not moved: the end the holder
//! was told for a kernel it had already queued (its stream's tail): the
//! time it lost comes out of its next launches instead, and NVML's timeline
//! shows where it ran. A kernel of a high-priority stream goes in the same
//! way in front of its own context's queued work, without a switch.
//!
//! A launch takes the device's lock (`DevLock`) for the placement: a few
//! loads and stores, longer only for a preemption.

use super::layout::{DeviceBlock, RING};
use super::now_ns;
use std::sync::atomic::Ordering::*;

/// Ring entries a preemption looks back over for the work it moves:
/// every owner's runs queued ahead, merged, are far fewer.
const LOOK_BACK: u64 = 1024;
/// A lock held this long belongs to a process that died holding it.
const LOCK_STALE_NS: u64 = 50_000_000;

/// A kernel to place.
#[derive(Debug, Clone, Copy)]
pub struct Work {
    pub duration_ns: u64,
    /// End of the previous work on the caller's stream.
    pub not_before_ns: u64,
    /// Part (0..=1) of the device it occupies (streams of one process run
    /// beside each other while they fit).
    pub share: f64,
    /// From a stream of the context's greatest priority.
    pub urgent: bool,
}

/// The per-device scheduler lock: a word holding the time it was taken,
/// so a holder that died is overtaken instead of stopping the device.
pub(super) struct DevLock<'a> {
    dev: &'a DeviceBlock,
    token: u64,
}

impl<'a> DevLock<'a> {
    pub(super) fn take(dev: &'a DeviceBlock) -> DevLock<'a> {
        let mut spins = 0u32;
        loop {
            let token = now_ns().max(1);
            let held = dev.lock.load(Acquire);
            let free = held == 0 || token.saturating_sub(held) > LOCK_STALE_NS;
            if free
                && dev
                    .lock
                    .compare_exchange(held, token, AcqRel, Acquire)
                    .is_ok()
            {
                return DevLock { dev, token };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for DevLock<'_> {
    fn drop(&mut self) {
        // Overtaken (we stalled past LOCK_STALE_NS): the lock is not ours.
        let _ = self
            .dev
            .lock
            .compare_exchange(self.token, 0, AcqRel, Acquire);
    }
}

/// The node's timing of context switches.
#[derive(Clone, Copy)]
pub(super) struct Slicing {
    pub(super) switch_ns: u64,
    pub(super) timeslice_ns: u64,
}

/// One ring entry as read: its index and interval.
#[derive(Clone, Copy)]
struct Entry {
    idx: u64,
    start: u64,
    end: u64,
    owner: u64,
}

/// The newest `LOOK_BACK` whole entries, newest first.
fn recent(dev: &DeviceBlock) -> impl Iterator<Item = Entry> + '_ {
    let head = dev.ring_head.load(Acquire);
    let n = head.min(RING as u64).min(LOOK_BACK);
    (0..n).filter_map(move |k| {
        let idx = head - 1 - k;
        let e = &dev.ring[(idx as usize) % RING];
        let entry = Entry {
            idx,
            start: e.start.load(Acquire),
            end: e.end.load(Acquire),
            owner: e.owner.load(Acquire),
        };
        (e.seq.load(Acquire) == idx + 1).then_some(entry)
    })
}

/// Rewrites entry `idx`'s interval (readers skip it meanwhile).
fn rewrite(dev: &DeviceBlock, idx: u64, start: u64, end: u64) {
    let e = &dev.ring[(idx as usize) % RING];
    e.seq.store(0, Release);
    e.start.store(start, Release);
    e.end.store(end, Release);
    e.seq.store(idx + 1, Release);
}

/// Where a context that is not `me` and holds the device at `at` gives it
/// up: its next slice boundary, or the end of its run if sooner; `at`
/// itself when no other context's work covers it.
fn yield_point(dev: &DeviceBlock, me: u64, at: u64, slice: u64) -> u64 {
    recent(dev)
        .find(|e| e.owner != me && e.start <= at && at < e.end)
        .map_or(at, |e| {
            let boundary = e.start + ((at - e.start) / slice + 1) * slice;
            boundary.min(e.end)
        })
}

/// Moves everything queued from `at` on `by` later: entries that start
/// there or after shift, one that spans `at` is cut there and its rest
/// queued again after the gap; `keep`'s entries stay. Returns the latest
/// end it moved anything to (`None`: nothing found queued past `at`).
fn open_gap(
    dev: &DeviceBlock,
    at: u64,
    by: u64,
    keep: Option<u64>,
    record: impl Fn(u64, u64, u64),
) -> Option<u64> {
    let mut cut = Vec::new();
    let mut last = None;
    // A preempting context's own earlier work is not queued behind it.
    for e in recent(dev).filter(|e| e.end > at && Some(e.owner) != keep) {
        if e.start >= at {
            rewrite(dev, e.idx, e.start + by, e.end + by);
        } else {
            rewrite(dev, e.idx, e.start, at);
            cut.push((e.owner, at + by, e.end + by));
        }
        last = last.max(Some(e.end + by));
    }
    for (owner, start, end) in cut {
        record(owner, start, end);
    }
    last
}

/// After `me`'s work up to `end` went in and queued work moved up to
/// `moved`: the timeline's end is the latest of them (never pushed by work
/// the look-back did not find), and `me` holds the tail if it ends it.
fn settle_tail(dev: &DeviceBlock, me: u64, end: u64, moved: Option<u64>) {
    // The last group's room no longer describes the tail: no kernel goes
    // beside it (`timeline::beside`) until one is queued in order again.
    dev.group_room.store(0, Release);
    let tail = end.max(moved.unwrap_or(0));
    let before = dev.busy_until.fetch_max(tail, AcqRel);
    if end >= before.max(tail) {
        dev.last_owner.store(me, Release);
    }
}

/// Places `w` of `me`, ready at `ready`, in front of work already queued
/// past `ready` (the lock held). `own`: that work is `me`'s own (an urgent
/// kernel jumps its queue without a switch). Returns the kernel's (start,
/// end); pieces of a kernel preempted between slices are recorded apart.
pub(super) fn preempt(
    dev: &DeviceBlock,
    me: u64,
    ready: u64,
    w: Work,
    own: bool,
    t: Slicing,
    record: &impl Fn(u64, u64, u64),
) -> (u64, u64) {
    if own {
        let moved = open_gap(dev, ready, w.duration_ns, None, record);
        let end = ready + w.duration_ns;
        record(me, ready, end);
        settle_tail(dev, me, end, moved);
        return (ready, end);
    }
    let mut left = w.duration_ns;
    let mut cursor = ready;
    let mut first = None;
    let mut end = cursor;
    while left > 0 {
        let busy = dev.busy_until.load(Acquire);
        let (mut run_start, run_end) = (dev.run_start.load(Acquire), dev.run_end.load(Acquire));
        let mine = dev.run_owner.load(Acquire) == me && cursor <= run_end;
        if mine && busy <= run_end {
            // Nobody's work waits behind ours: the slice renews.
            run_start = run_end;
            dev.run_start.store(run_end, Release);
        }
        let open = mine && run_end - run_start < t.timeslice_ns;
        if !open && mine {
            // Our slice is spent: the preempted context's turn first.
            cursor = run_end + t.switch_ns;
        }
        if !open && cursor >= busy {
            // Nothing queued from here on: the rest runs at the tail.
            let start = cursor.max(busy);
            record(me, start, start + left);
            dev.busy_until.fetch_max(start + left, AcqRel);
            dev.last_owner.store(me, Release);
            return (first.unwrap_or(start), start + left);
        }
        let (at, start, piece, gap) = if open {
            let piece = left.min(t.timeslice_ns - (run_end - run_start));
            (run_end, run_end, piece, piece)
        } else {
            let at = yield_point(dev, me, cursor, t.timeslice_ns);
            let piece = left.min(t.timeslice_ns);
            // The switch back, when there is work to switch back to.
            let back = if at < busy { t.switch_ns } else { 0 };
            (at, at + t.switch_ns, piece, piece + t.switch_ns + back)
        };
        let moved = open_gap(dev, at, gap, Some(me), record);
        record(me, start, start + piece);
        settle_tail(dev, me, start + piece, moved);
        if !open {
            dev.run_start.store(start, Release);
        }
        dev.run_owner.store(me, Release);
        dev.run_end.store(start + piece, Release);
        first.get_or_insert(start);
        end = start + piece;
        left -= piece;
        cursor = end;
    }
    (first.unwrap_or(end), end)
}

#[cfg(test)]
mod tests {
    use super::Work;
    use crate::state::tests::installed;
    use crate::state::{Attached, SharedState};

    const MS: u64 = 1_000_000;

    fn two() -> (
        tempfile::TempDir,
        SharedState,
        Attached,
        SharedState,
        Attached,
    ) {
        let (d, root) = installed();
        let (a, b) = (
            SharedState::open(&root).unwrap(),
            SharedState::open(&root).unwrap(),
        );
        let (ma, mb) = (a.attach().unwrap(), b.attach().unwrap());
        (d, a, ma, b, mb)
    }

    /// Busy ns of `who` (or all) in [from, to), from NVML's view.
    fn busy(s: &SharedState, from: u64, to: u64, who: Option<Attached>) -> f64 {
        let per = s.process_utilization(0, from, to);
        let pct = match who {
            None => s.utilization(0, from, to),
            Some(w) => per
                .iter()
                .find(|(p, _)| p.slot as u64 | (p.generation as u64) << 16 == w.owner())
                .map_or(0.0, |(_, u)| *u),
        };
        pct / 100.0 * (to - from) as f64
    }

    #[test]
    fn a_newcomer_waits_for_the_holders_slice_not_its_queue() {
        let (_d, a, ma, b, mb) = two();
        let (t, sw) = (a.node().timeslice_ns, a.node().context_switch_ns);
        assert_eq!(t, 2 * MS);
        a.set_active(ma, 0);
        b.set_active(mb, 0);
        // A queues 20 ms of work; B's 1 ms kernel runs after A's first slice.
        let (s1, _) = a.launch(ma, 0, 10 * MS, 0);
        let (_, e_a) = a.launch(ma, 0, 10 * MS, 0);
        let (sb, eb) = b.launch(mb, 0, MS, 0);
        assert_eq!(sb, s1 + t + sw, "the rest of A's slice and a switch");
        assert_eq!(eb, sb + MS);
        // B's next kernel continues its slice; A's queued work moved later.
        let (sb2, eb2) = b.launch(mb, 0, MS / 2, eb);
        assert_eq!(sb2, eb);
        let (sa3, _) = a.launch(ma, 0, MS, 0);
        assert_eq!(sa3, e_a + MS + MS / 2 + 2 * sw, "A lost what B ran");
        // NVML sees each process's own time, none of it overlapping.
        let to = sa3 + MS;
        assert!((busy(&a, s1, to, Some(ma)) - 21e6).abs() < 1e3);
        assert!((busy(&a, s1, to, Some(mb)) - 1.5e6).abs() < 1e3);
        let all = busy(&a, s1, to, None);
        assert!((all - 22.5e6).abs() < 1e3, "{all}");
        // Inside B's run A is idle; A runs again after the switch back.
        assert!(busy(&a, sb, eb2, Some(ma)).abs() < 1.0);
        assert!((busy(&a, eb2 + sw, eb2 + sw + MS, Some(ma)) - 1e6).abs() < 1e3);
    }

    #[test]
    fn a_kernel_longer_than_a_slice_is_preempted_and_resumed() {
        let (_d, a, ma, b, mb) = two();
        let (t, sw) = (a.node().timeslice_ns, a.node().context_switch_ns);
        a.set_active(ma, 0);
        b.set_active(mb, 0);
        let (s1, _) = a.launch(ma, 0, 30 * MS, 0);
        // 5 ms: slices of 2, 2 and 1 ms with A's 2 ms slices between.
        let (sb, eb) = b.launch(mb, 0, 5 * MS, 0);
        assert_eq!(sb, s1 + t + sw);
        assert_eq!(eb, sb + 5 * MS + 2 * (t + 2 * sw));
        assert!((busy(&a, sb, eb, Some(mb)) - 5e6).abs() < 1e3);
        assert!((busy(&a, sb, eb, Some(ma)) - 4e6).abs() < 1e3);
    }

    #[test]
    fn the_rest_runs_at_the_tail_once_the_holder_is_done() {
        let (_d, a, ma, b, mb) = two();
        let (t, sw) = (a.node().timeslice_ns, a.node().context_switch_ns);
        let (s1, e1) = a.launch(ma, 0, 3 * MS, 0);
        let (sb, eb) = b.launch(mb, 0, 6 * MS, 0);
        assert_eq!(sb, s1 + t + sw);
        // 2 ms, then A's last 1 ms (its run ends before its slice), then B's 4 ms.
        assert_eq!(eb, e1 + 2 * MS + 2 * sw + sw + 4 * MS);
    }

    #[test]
    fn an_urgent_kernel_goes_before_its_own_contexts_queue() {
        let (_d, a, ma, _b, _mb) = two();
        let (s1, e1) = a.launch(ma, 0, 10 * MS, 0);
        let w = Work {
            duration_ns: MS,
            not_before_ns: 0,
            share: 1.0,
            urgent: true,
        };
        let (su, eu) = a.launch_work(ma, 0, w);
        assert!(
            su >= s1 && su < s1 + MS,
            "now, not after 10 ms: {}",
            su - s1
        );
        assert_eq!(eu, su + MS);
        // The queued kernel finishes later by the urgent one's time.
        let (s3, _) = a.launch(ma, 0, MS, 0);
        assert_eq!(s3, e1 + MS);
    }
}
