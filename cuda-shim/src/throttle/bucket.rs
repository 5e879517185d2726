//! The container's token bucket, in the ledger's compute area (shared by
//! every process of the container, see `container_ledger::COMPUTE_OFFSET`).
//!
//! Tickets, not a balance: `requested` counts the cost units every launch
//! asked for, `granted` the units the refills handed out; a launch takes
//! ticket `q = requested += cost` and may run once `granted >= q`. One
//! `fetch_add` and one load on the launch path; waiters are served in
//! ticket order across threads and processes; nothing is ever lost or
//! double-spent.
//!
//! Refills are lazy: whoever comes by (a waiting launch, the watcher's
//! tick in any process) adds `rate x elapsed` since `refilled_at`, claimed
//! with a compare-and-swap on `refilled_at` so an interval is granted once.
//! Waiting therefore needs no controller to be alive: the elected
//! controller only sets `rate`. Unused tokens are capped at [`BURST_NS`]
//! worth, so an idle container cannot save up a long burst.
//!
//! A waiting launch sleeps (nanosleep) for as long as its deficit takes to
//! refill at the current rate (bounded, then it looks again); it never
//! spins.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Words of the area (indices into `Ledger::compute_words`). The hot words
/// share one cache line; the controller's bookkeeping sits on the next.
const TAG: usize = 0;
const REQUESTED: usize = 8;
const GRANTED: usize = 9;
const REFILLED_AT: usize = 10;
const RATE: usize = 11;
const UNITS_PER_MS: usize = 12;
const WAITS: usize = 13;
const LEASE_OWNER: usize = 16;
const LEASE_BEAT: usize = 17;
const TARGET_X100: usize = 18;
const ACHIEVED_X100: usize = 19;
/// Words this layout uses (the area has [`container_ledger::COMPUTE_WORDS`]).
const USED_WORDS: usize = 24;

/// `b"VCTHR"`, layout 1. A different tag (an older or newer interposer
/// left it) makes the first attaching process reset the area.
pub const AREA_TAG: u64 = 0x5643_5448_5200_0001;

/// Unused tokens are capped at this much time at the current rate.
pub const BURST_NS: f64 = 50e6;
/// A refill after a longer gap grants at most this much time.
const MAX_REFILL_NS: u64 = 1_000_000_000;
/// Units a launch of unknown shape costs before the controller knows what
/// 1 ms of device time is worth.
const DEFAULT_UNKNOWN_COST: u64 = 1 << 20;
/// Bigger launches are charged this (keeps the counters far from wrapping).
const MAX_COST: u64 = 1 << 40;
/// While the rate is unknown (a new container, first ~100 ms), launches
/// run free and grant themselves this much ahead so they take the fast
/// path; the first rate clamps it away.
const LEARNING_SLACK: u64 = 1 << 32;
const MIN_SLEEP_NS: f64 = 50e3;
const MAX_SLEEP_NS: f64 = 20e6;

/// A view of the compute words. The mapping outlives it (see
/// [`crate::throttle`]: it is never unmapped).
#[derive(Clone, Copy)]
pub struct Bucket {
    w: &'static [AtomicU64; container_ledger::COMPUTE_WORDS],
}

impl Bucket {
    /// # Safety
    /// `p` points at the compute words of a mapping that is never unmapped.
    #[inline(always)]
    pub unsafe fn at(p: *const AtomicU64) -> Bucket {
        Bucket {
            w: unsafe { &*(p as *const [AtomicU64; container_ledger::COMPUTE_WORDS]) },
        }
    }

    /// Claims the area for this layout if another layout (or nothing) is
    /// there. Zero is a valid state of every word.
    pub fn init(&self) {
        let cur = self.w[TAG].load(Ordering::Acquire);
        if cur != AREA_TAG
            && self.w[TAG]
                .compare_exchange(cur, AREA_TAG, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            && cur != 0
        {
            for w in &self.w[1..USED_WORDS] {
                w.store(0, Ordering::Release);
            }
        }
    }

    /// The launch path: takes a ticket for `cost` units (0 = unknown shape)
    /// and says whether it is covered. `Some(ticket)`: call
    /// [`wait`](Self::wait).
    #[inline(always)]
    pub fn take(&self, cost: u64) -> Option<u64> {
        let cost = if cost == 0 {
            self.unknown_cost()
        } else {
            cost.min(MAX_COST)
        };
        let q = self.w[REQUESTED].fetch_add(cost, Ordering::Relaxed) + cost;
        if q <= self.w[GRANTED].load(Ordering::Acquire) {
            None
        } else {
            Some(q)
        }
    }

    #[inline(always)]
    fn unknown_cost(&self) -> u64 {
        match self.w[UNITS_PER_MS].load(Ordering::Relaxed) {
            0 => DEFAULT_UNKNOWN_COST,
            u => u.min(MAX_COST),
        }
    }

    /// Sleeps until `ticket` is granted. Returns the ns spent from the
    /// first sleep until granted (CLOCK_MONOTONIC; 0 when it never slept),
    /// measured with the clock reads the refills take anyway.
    #[cold]
    #[inline(never)]
    pub fn wait(&self, ticket: u64, mut on_first_sleep: impl FnMut()) -> u64 {
        let mut slept_since = None;
        loop {
            let now = now_ns();
            let slept = || slept_since.map_or(0, |t0: u64| now.saturating_sub(t0));
            self.refill(now);
            let g = self.w[GRANTED].load(Ordering::Acquire);
            if g >= ticket {
                return slept();
            }
            let rate = self.rate();
            if rate <= 0.0 {
                self.w[GRANTED].fetch_max(ticket.saturating_add(LEARNING_SLACK), Ordering::AcqRel);
                return slept();
            }
            if slept_since.is_none() {
                slept_since = Some(now);
                self.w[WAITS].fetch_add(1, Ordering::Relaxed);
                on_first_sleep();
            }
            let ns = ((ticket - g) as f64 / rate).clamp(MIN_SLEEP_NS, MAX_SLEEP_NS);
            std::thread::sleep(Duration::from_nanos(ns as u64));
        }
    }

    /// Grants `rate x elapsed` since the last refill (capped), once per
    /// interval whoever calls. The fractional token stays in the interval:
    /// `refilled_at` advances only by the time the whole tokens stand for,
    /// so tiny rates and frequent refills lose nothing.
    pub fn refill(&self, now: u64) {
        let t0 = self.w[REFILLED_AT].load(Ordering::Acquire);
        if now <= t0 {
            return;
        }
        let rate = self.rate();
        if rate <= 0.0 || t0 == 0 {
            // Just start the clock.
            let _ =
                self.w[REFILLED_AT].compare_exchange(t0, now, Ordering::AcqRel, Ordering::Relaxed);
            return;
        }
        let dt = now - t0;
        let (add, t1) = if dt > MAX_REFILL_NS {
            ((rate * MAX_REFILL_NS as f64) as u64, now)
        } else {
            let add = (rate * dt as f64).floor();
            if add < 1.0 {
                return;
            }
            let spent = ((add / rate) as u64).clamp(1, dt);
            (add as u64, t0 + spent)
        };
        if self.w[REFILLED_AT]
            .compare_exchange(t0, t1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        self.grant(add, rate);
    }

    fn grant(&self, add: u64, rate: f64) {
        let cap = (rate * BURST_NS) as u64;
        let q = self.w[REQUESTED].load(Ordering::Acquire);
        let lim = q.saturating_add(cap);
        let _ = self.w[GRANTED].fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
            let ng = g.saturating_add(add);
            Some(if ng > lim { g.max(lim) } else { ng })
        });
    }

    /// Cost units per ns the container may launch; 0 while unknown.
    pub fn rate(&self) -> f64 {
        f64::from_bits(self.w[RATE].load(Ordering::Acquire))
    }

    /// Sets the rate (controller). Tokens beyond the burst cap of the new
    /// rate are taken back (this also ends the learning phase's slack).
    pub fn set_rate(&self, rate: f64, units_per_ms: f64) {
        if !(rate.is_finite() && rate > 0.0) {
            return;
        }
        self.w[RATE].store(rate.to_bits(), Ordering::Release);
        if units_per_ms.is_finite() && units_per_ms >= 1.0 {
            self.w[UNITS_PER_MS].store(units_per_ms as u64, Ordering::Relaxed);
        }
        let lim = self.w[REQUESTED]
            .load(Ordering::Acquire)
            .saturating_add((rate * BURST_NS) as u64);
        let _ = self.w[GRANTED].fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
            (g > lim).then_some(lim)
        });
    }

    /// Units admitted so far (granted and taken).
    pub fn launched(&self) -> u64 {
        let q = self.w[REQUESTED].load(Ordering::Acquire);
        q.min(self.w[GRANTED].load(Ordering::Acquire))
    }

    /// Launches that had to sleep, ever.
    pub fn waits(&self) -> u64 {
        self.w[WAITS].load(Ordering::Relaxed)
    }

    /// Controller lease: take or keep it for `me` (heartbeat `now`) when it
    /// is ours, free, or its holder went quiet for `stale_ns`.
    pub fn hold_lease(&self, me: u64, now: u64, stale_ns: u64) -> bool {
        let owner = self.w[LEASE_OWNER].load(Ordering::Acquire);
        if owner == me {
            self.w[LEASE_BEAT].store(now, Ordering::Release);
            return true;
        }
        let beat = self.w[LEASE_BEAT].load(Ordering::Acquire);
        if owner != 0 && now.saturating_sub(beat) < stale_ns {
            return false;
        }
        if self.w[LEASE_OWNER]
            .compare_exchange(owner, me, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.w[LEASE_BEAT].store(now, Ordering::Release);
            return true;
        }
        false
    }

    /// Gives the lease up (a controller that stops controlling).
    pub fn release_lease(&self, me: u64) {
        let _ = self.w[LEASE_OWNER].compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    pub fn lease_owner(&self) -> u64 {
        self.w[LEASE_OWNER].load(Ordering::Acquire)
    }

    /// Diagnostics for the manager / display (percent x 100).
    pub fn publish(&self, target: f64, achieved: f64) {
        self.w[TARGET_X100].store((target * 100.0) as u64, Ordering::Relaxed);
        self.w[ACHIEVED_X100].store((achieved * 100.0) as u64, Ordering::Relaxed);
    }

    /// (target, achieved) in percent, as last published.
    pub fn published(&self) -> (f64, f64) {
        (
            self.w[TARGET_X100].load(Ordering::Relaxed) as f64 / 100.0,
            self.w[ACHIEVED_X100].load(Ordering::Relaxed) as f64 / 100.0,
        )
    }
}

/// CLOCK_MONOTONIC ns (vDSO, no syscall).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use container_ledger::{COMPUTE_WORDS, Ledger};

    fn bucket() -> (tempfile::TempDir, Ledger, Bucket) {
        let d = tempfile::tempdir().unwrap();
        let (l, _f) = Ledger::create(&d.path().join("ledger"), 0).unwrap();
        let b = unsafe { Bucket::at(l.compute_words().as_ptr()) };
        b.init();
        (d, l, b)
    }

    #[test]
    fn layout_fits_the_area() {
        const { assert!(USED_WORDS <= COMPUTE_WORDS) };
        assert_eq!(REQUESTED / 8, GRANTED / 8, "hot words share a cache line");
    }

    #[test]
    fn learning_runs_free_then_the_rate_clamps() {
        let (_d, _l, b) = bucket();
        let q = b.take(100).unwrap();
        assert_eq!(b.wait(q, || panic!("no sleep while learning")), 0);
        assert!(b.take(100).is_none(), "slack granted");
        b.set_rate(1.0, 1e6);
        // Cap: 50 ms at 1 unit/ns beyond what was requested.
        assert_eq!(b.launched(), 200);
        assert!(b.take(50_000_000).is_none());
        assert!(b.take(1).is_some(), "beyond the cap");
    }

    #[test]
    fn refill_grants_rate_times_time_once_and_keeps_fractions() {
        let (_d, _l, b) = bucket();
        b.set_rate(0.001, 1.0);
        b.refill(1_000);
        let g0 = b.w[GRANTED].load(Ordering::Relaxed);
        // 1000 refills 500 ns apart: 0.5 token each, 500 tokens in all.
        for i in 1..=1000u64 {
            b.refill(1_000 + i * 500);
        }
        let g = b.w[GRANTED].load(Ordering::Relaxed) - g0;
        assert!((499..=500).contains(&g), "{g}");
        // The same instant twice grants nothing more.
        b.refill(1_000 + 1000 * 500);
        assert_eq!(b.w[GRANTED].load(Ordering::Relaxed) - g0, g);
    }

    #[test]
    fn unused_tokens_are_capped() {
        let (_d, _l, b) = bucket();
        b.set_rate(1.0, 1.0);
        b.refill(1);
        b.refill(10_000_000_000);
        assert_eq!(b.w[GRANTED].load(Ordering::Relaxed), BURST_NS as u64);
    }

    #[test]
    fn waiting_sleeps_until_refilled() {
        let (_d, _l, b) = bucket();
        // 1 unit per µs; ask for 20 ms worth beyond what is there.
        b.set_rate(1e-3, 1.0);
        b.refill(now_ns());
        let t = std::time::Instant::now();
        let q = b.take(20_000).unwrap();
        let mut slept = 0;
        let ns = b.wait(q, || slept += 1);
        let e = t.elapsed();
        assert_eq!((slept, b.waits()), (1, 1));
        assert!(
            ns >= 18_000_000 && ns <= e.as_nanos() as u64,
            "{ns} ns in {e:?}"
        );
        assert!(e >= Duration::from_millis(18), "{e:?}");
        assert!(e < Duration::from_millis(500), "{e:?}");
    }

    #[test]
    fn unknown_shapes_cost_a_millisecond() {
        let (_d, _l, b) = bucket();
        b.set_rate(1e9, 777.0);
        b.refill(1);
        b.refill(2);
        let before = b.w[REQUESTED].load(Ordering::Relaxed);
        let _ = b.take(0);
        assert_eq!(b.w[REQUESTED].load(Ordering::Relaxed) - before, 777);
    }

    #[test]
    fn lease_moves_only_when_stale() {
        let (_d, _l, b) = bucket();
        assert!(b.hold_lease(1, 100, 50));
        assert!(!b.hold_lease(2, 120, 50));
        assert!(b.hold_lease(1, 140, 50));
        assert!(b.hold_lease(2, 200, 50), "holder quiet for 60 ns");
        assert!(!b.hold_lease(1, 210, 50));
        b.release_lease(2);
        assert!(b.hold_lease(1, 211, 50));
    }

    #[test]
    fn a_foreign_layout_is_reset() {
        let (_d, l, b) = bucket();
        b.set_rate(3.0, 1.0);
        l.compute_words()[TAG].store(42, Ordering::Relaxed);
        b.init();
        assert_eq!(b.rate(), 0.0);
        assert_eq!(l.compute_words()[TAG].load(Ordering::Relaxed), AREA_TAG);
    }
}
