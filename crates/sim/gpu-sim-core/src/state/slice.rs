//! Time-slicing between processes' contexts, as NVIDIA's scheduler does
//! it: the context holding the device keeps it until its timeslice ends
//! or it runs out of work; then a context of another process that has work
//! runs, and a kernel longer than the slice is preempted and resumed later.
//!
//! Launches are placed on the timeline when they are made (timeline.rs).
//! A kernel of a process that finds another's work holding the device past
//! the next timeslice boundary runs at that boundary, and everything queued
//! after the boundary moves later by its time and two context switches
//! (one in, one back). Further kernels of that process join its run until
//! its own slice is used up; then the others get a slice before its next
//! one. Each move is a [`Shift`] in the device's shared block: the work it
//! moved belongs to other processes, whose memory this one cannot write, so
//! each process applies the shifts when it next reads a time of its own
//! ([`resolve`]). A shift is never placed before now, so a time already
//! past never moves.

use super::layout::{DeviceBlock, Interval, MOVES_OWN, RING, SHIFTS, SliceBlock};
use super::now_ns;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// Ring entries a preemption looks through for intervals to move (the
/// most recent: work queued past now is recorded last).
const SCAN: u64 = 512;

/// How long a holder may keep the lock before another process takes it
/// (one that died inside).
const LOCK_STALE_NS: u64 = 50_000_000;

/// Where a preempting kernel goes: its start, the point after which the
/// device's queued work moves, and by how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub at: u64,
    pub start: u64,
    pub amount: u64,
    /// It continues the process's own run (no switch in).
    pub joins: bool,
}

/// The timeslice boundary at or after `t` (a grid of `slice`: a newcomer
/// waits for the holder's slice to end, uniformly within one slice).
fn boundary(t: u64, slice: u64) -> u64 {
    t.div_ceil(slice) * slice
}

/// Where a kernel of `d` ns of process `me`, ready at `ready`, runs on
/// `dev` while another process's work holds it; `None`: that work ends
/// before the next boundary, and the kernel queues behind it.
pub(super) fn place(
    sb: &SliceBlock,
    busy: u64,
    me: u64,
    ready: u64,
    d: u64,
    slice: u64,
    switch: u64,
) -> Option<Place> {
    let (so, ss, se) = (
        sb.seg_owner.load(Acquire),
        sb.seg_start.load(Acquire),
        sb.seg_end.load(Acquire),
    );
    let live = se >= ready && se > 0;
    let mine = live && so == me + 1;
    let p = if mine && se - ss < slice {
        // Its own run goes on, before the others resume.
        Place {
            at: se,
            start: se,
            amount: d,
            joins: true,
        }
    } else {
        let mut at = boundary(ready, slice);
        if mine {
            // Its slice is used up: the others get one first.
            at = at.max(se + switch + slice);
        } else if live && ss <= at && at < se {
            // Not inside another process's run: after it.
            at = se;
        }
        Place {
            at,
            start: at + switch,
            amount: d + 2 * switch,
            joins: false,
        }
    };
    (busy > p.at).then_some(p)
}

/// Places `me`'s kernel of `d` ns at the next boundary when another
/// process's work holds `dev` past it, moving that work later: its
/// (start, end) and the shift count after it (the times it returns are
/// not moved by shifts up to there). `None`: queue it as usual.
pub(super) fn preempt(
    dev: &DeviceBlock,
    me: u64,
    ready: u64,
    d: u64,
    slice: u64,
    switch: u64,
) -> Option<(u64, u64, u64)> {
    let sb = &dev.slices;
    let _held = Lock::take(&sb.lock);
    let p = place(
        sb,
        dev.busy_until.load(Acquire),
        me,
        ready,
        d,
        slice,
        switch,
    )?;
    let end = p.start + d;
    let from = insert(dev, me, p.at, p.amount, (p.start, end), 0);
    if !p.joins {
        sb.seg_start.store(p.start, Release);
    }
    sb.seg_owner.store(me + 1, Release);
    sb.seg_end.store(end, Release);
    Some((p.start, end, from))
}

/// Runs `me`'s kernel of `d` ns at `at`, ahead of its own work queued
/// past it (a stream of higher priority: the blocks running at `at`
/// finish, the rest of the queue waits), moving that work later. Its
/// (start, end) and the shift count after it; `None` when the device's
/// work ends by `at`.
pub(super) fn ahead(dev: &DeviceBlock, me: u64, at: u64, d: u64) -> Option<(u64, u64, u64)> {
    let _held = Lock::take(&dev.slices.lock);
    if dev.busy_until.load(Acquire) <= at {
        return None;
    }
    let from = insert(dev, me, at, d, (at, at + d), MOVES_OWN);
    Some((at, at + d, from))
}

/// Under the lock: moves the work queued past `at` by `amount`, records
/// `me`'s kernel `run` and the shift; returns the shift count after it.
fn insert(dev: &DeviceBlock, me: u64, at: u64, amount: u64, run: (u64, u64), flags: u64) -> u64 {
    let sb = &dev.slices;
    // Appenders place behind busy_until with compare-and-swap: after this
    // add, none lands before the moved work.
    let old = dev.busy_until.fetch_add(amount, AcqRel);
    // Kernels of the moved group must not join it at its old place.
    dev.group_room.store(0, Release);
    move_intervals(dev, at, amount);
    super::timeline::record(dev, me, run.0, run.1);
    let i = sb.head.load(Acquire);
    let s = &sb.shifts[(i as usize) % SHIFTS];
    s.seq.store(0, Release);
    s.at.store(at, Release);
    s.old_busy.store(old, Release);
    s.amount.store(amount, Release);
    s.owner.store(me, Release);
    s.flags.store(flags, Release);
    s.seq.store(i + 1, Release);
    sb.head.store(i + 1, Release);
    sb.max_old_busy.fetch_max(old, AcqRel);
    i + 1
}

/// When `me`'s work that was to end at `t` ends now. `from`: the shifts
/// `t` already reflects (0: only those made after it was queued behind
/// the device's work move it, so those up to `t`'s own queueing do not).
pub(super) fn resolve(sb: &SliceBlock, me: u64, t: u64, from: u64) -> u64 {
    let head = sb.head.load(Acquire);
    if head <= from || t > sb.max_old_busy.load(Acquire) {
        return t;
    }
    let mut t = t;
    for i in from.max(head.saturating_sub(SHIFTS as u64))..head {
        let s = &sb.shifts[(i as usize) % SHIFTS];
        if s.seq.load(Acquire) != i + 1 {
            continue;
        }
        let (at, old, amount, owner, flags) = (
            s.at.load(Acquire),
            s.old_busy.load(Acquire),
            s.amount.load(Acquire),
            s.owner.load(Acquire),
            s.flags.load(Acquire),
        );
        if s.seq.load(Acquire) != i + 1 {
            continue;
        }
        // A time of unknown origin is not moved by its own process's
        // timeslice shifts: it is most likely the preempting kernel itself.
        let moves = owner != me || from > 0 || flags & MOVES_OWN != 0;
        if moves && at < t && t <= old {
            t += amount;
        }
    }
    t
}

/// Moves the recorded intervals past `at` later by `amount` (one running
/// across `at` is cut there and its rest recorded after the gap), so that
/// utilization reads what the device now runs when.
fn move_intervals(dev: &DeviceBlock, at: u64, amount: u64) {
    let head = dev.ring_head.load(Acquire);
    let mut rest = [(0u64, 0u64, 0u64); 8];
    let mut n = 0;
    for k in 0..head.min(SCAN) {
        let idx = head - 1 - k;
        let e: &Interval = &dev.ring[(idx as usize) % RING];
        if e.seq.load(Acquire) != idx + 1 {
            continue;
        }
        let (s, en) = (e.start.load(Acquire), e.end.load(Acquire));
        if en <= at {
            continue;
        }
        if s >= at {
            e.end.store(en + amount, Release);
            e.start.store(s + amount, Release);
        } else {
            e.end.store(at, Release);
            if n < rest.len() {
                rest[n] = (e.owner.load(Acquire), at + amount, en + amount);
                n += 1;
            }
        }
    }
    for &(owner, s, en) in &rest[..n] {
        super::timeline::push(dev, owner, s, en);
    }
}

/// The slice block's lock, across processes: a word holding when it was
/// taken, taken over once stale (its holder died inside).
struct Lock<'a>(&'a AtomicU64);

impl<'a> Lock<'a> {
    fn take(word: &'a AtomicU64) -> Lock<'a> {
        let mut spins = 0u32;
        loop {
            let now = now_ns().max(1);
            let held = word.load(Acquire);
            let free = held == 0 || now.saturating_sub(held) > LOCK_STALE_NS;
            if free && word.compare_exchange(held, now, AcqRel, Acquire).is_ok() {
                return Lock(word);
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Drop for Lock<'_> {
    fn drop(&mut self) {
        self.0.store(0, Release);
    }
}

/// Times this process got from a device after shifts were made, with the
/// shift count they reflect: so that applying those shifts again does not
/// move them twice. Process-local; a slot overwritten by another time
/// leaves it resolved as of unknown origin.
pub(super) struct Stamps {
    words: Box<[AtomicU64]>,
}

const STAMPS: usize = 4096;

impl Stamps {
    pub fn new() -> Stamps {
        Stamps {
            words: (0..2 * STAMPS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn slot(t: u64) -> usize {
        (t.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % STAMPS
    }

    pub fn note(&self, t: u64, from: u64) {
        let i = 2 * Self::slot(t);
        self.words[i].store(t, Release);
        self.words[i + 1].store(from, Release);
    }

    pub fn lookup(&self, t: u64) -> u64 {
        let i = 2 * Self::slot(t);
        let from = self.words[i + 1].load(Acquire);
        if self.words[i].load(Acquire) == t {
            from
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::tests::installed;
    use crate::state::{Attached, SharedState, now_ns};

    const MS: u64 = 1_000_000;
    /// The default timeslice.
    const SLICE: u64 = 2 * MS;

    fn two() -> (tempfile::TempDir, [(SharedState, Attached); 2]) {
        let (d, root) = installed();
        let pair = [(); 2].map(|_| {
            let s = SharedState::open(&root).unwrap();
            let me = s.attach().unwrap();
            s.set_active(me, 0);
            (s, me)
        });
        (d, pair)
    }

    /// 100 µs past a slice boundary 20 ms ahead: work queued from there
    /// is placed the same however late this thread runs meanwhile.
    fn base() -> u64 {
        (now_ns() + 20 * MS).div_ceil(SLICE) * SLICE + MS / 10
    }

    /// A process with work behind another's long kernel gets the device
    /// at the holder's slice boundary, not after the kernel; the holder's
    /// kernel resumes after it, and its process learns the new end.
    #[test]
    fn a_newcomer_runs_at_the_holders_slice_end() {
        let (_d, [(a, ma), (b, mb)]) = two();
        let switch = a.node().context_switch_ns;
        assert_eq!(a.node().timeslice_ns, SLICE);
        let t0 = base();
        let (s1, e1) = a.launch(ma, 0, 10 * MS, t0);
        assert_eq!(s1, t0);
        let (s2, e2) = b.launch(mb, 0, MS, t0 + 3 * MS / 10);
        let at = t0 - MS / 10 + SLICE;
        assert_eq!(s2, at + switch, "at the slice boundary");
        assert_eq!(e2 - s2, MS);
        let moved = MS + 2 * switch;
        assert_eq!(
            a.resolve(ma, 0, e1),
            e1 + moved,
            "the holder resumes after it"
        );
        assert_eq!(b.resolve(mb, 0, e2), e2, "the newcomer's own end stays");
        // Work the holder queues now goes after its moved kernel.
        let (s3, _) = a.launch(ma, 0, MS, e1);
        assert_eq!(s3, e1 + moved);
        // Each process is charged its own time: utilization follows.
        let per = a.process_utilization(0, s1, e1 + moved);
        let w = (e1 + moved - s1) as f64;
        let of = |m: Attached| {
            let owner = m.slot as u64 | (m.generation as u64) << 16;
            per.iter()
                .find(|(p, _)| (p.slot as u64 | (p.generation as u64) << 16) == owner)
                .map(|x| x.1)
                .unwrap()
        };
        assert!((of(ma) - 1e9 / w).abs() < 1e-6, "{per:?}");
        assert!((of(mb) - 1e8 / w).abs() < 1e-6, "{per:?}");
    }

    /// The newcomer's next kernels join its run while its slice lasts;
    /// then the holder gets a slice before the newcomer's next one.
    #[test]
    fn a_run_lasts_one_slice_then_yields() {
        let (_d, [(a, ma), (b, mb)]) = two();
        let switch = a.node().context_switch_ns;
        let t0 = base();
        let (_, ea) = a.launch(ma, 0, 30 * MS, t0);
        let k = 4 * MS / 5;
        let (s1, e1) = b.launch(mb, 0, k, t0 + MS / 10);
        let (s2, e2) = b.launch(mb, 0, k, e1);
        let (s3, e3) = b.launch(mb, 0, k, e2);
        assert_eq!(s1, t0 - MS / 10 + SLICE + switch);
        assert_eq!((s2, s3), (e1, e2), "one run: no switch between them");
        let (s4, _) = b.launch(mb, 0, k, e3);
        assert_eq!(s4, e3 + switch + SLICE + switch, "after the holder's slice");
        assert_eq!(a.resolve(ma, 0, ea), ea + 4 * k + 4 * switch);
    }

    /// Work that ends before the holder's slice does is not preempted:
    /// the newcomer queues behind it, as without a timeslice.
    #[test]
    fn work_ending_within_the_slice_is_waited_for() {
        let (_d, [(a, ma), (b, mb)]) = two();
        let switch = a.node().context_switch_ns;
        let t0 = base();
        let (_, e1) = a.launch(ma, 0, MS / 2, t0);
        let (s2, _) = b.launch(mb, 0, MS, t0 + MS / 10);
        assert_eq!(s2, e1 + switch);
        assert_eq!(a.resolve(ma, 0, e1), e1);
    }

    /// A kernel of a raised-priority stream runs ahead of its own
    /// process's queued work, which ends that much later; another
    /// process's kernel then time-slices with all of it.
    #[test]
    fn a_raised_kernel_goes_ahead_of_its_own_queue() {
        let (_d, [(a, ma), (b, mb)]) = two();
        let (wave, switch) = (10_000, a.node().context_switch_ns);
        let t0 = base();
        let (_, e1) = a.launch(ma, 0, 10 * MS, t0);
        let (s2, e2) = a.launch_ahead(ma, 0, MS, t0 + MS, 1.0, wave);
        assert_eq!((s2, e2), (t0 + MS + wave, t0 + 2 * MS + wave));
        assert_eq!(a.resolve(ma, 0, e2), e2, "its own end stays");
        assert_eq!(a.resolve(ma, 0, e1), e1 + MS, "the queue waits for it");
        b.launch(mb, 0, MS, t0 + 5 * MS);
        assert_eq!(a.resolve(ma, 0, e1), e1 + 2 * MS + 2 * switch);
        // On an idle device it is an ordinary launch.
        let (_d2, [(c, mc), _]) = two();
        let t1 = base();
        assert_eq!(c.launch_ahead(mc, 0, MS, t1, 1.0, wave).0, t1);
    }
}
