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
/// Summed costs of the launches asleep in [`Bucket::wait`] now.
const WAITING: usize = 14;
/// Units of stale debt forgiven, ever (diagnostics).
const FORGIVEN: usize = 15;
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
/// 1 ms of device time is worth: 100 waves (1 ms of 10 us waves).
const DEFAULT_UNKNOWN_COST: u64 = 100 * super::cost::WAVE_UNITS;
/// Bigger launches are charged this (keeps the counters far from wrapping).
const MAX_COST: u64 = 1 << 40;
/// While no rate is set at all (only where [`Bucket::start`] was not
/// called: a container's bucket gets its start-up rate when a process
/// attaches), launches run free and grant themselves this much ahead so
/// they take the fast path; the first rate clamps it away.
const LEARNING_SLACK: u64 = 1 << 32;
const MIN_SLEEP_NS: f64 = 50e3;
const MAX_SLEEP_NS: f64 = 20e6;

/// A launch's place in the bucket: covered once `granted >= end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub end: u64,
    /// The units it took (after clamping).
    pub cost: u64,
}

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
            // SAFETY: the caller guarantees (# Safety) `p` is the compute words of a mapping
            // never unmapped: COMPUTE_WORDS aligned atomics, valid for 'static.
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
    pub fn take(&self, cost: u64) -> Option<Ticket> {
        let cost = if cost == 0 {
            self.unknown_cost()
        } else {
            cost.min(MAX_COST)
        };
        let end = self.w[REQUESTED].fetch_add(cost, Ordering::Relaxed) + cost;
        if end <= self.w[GRANTED].load(Ordering::Acquire) {
            None
        } else {
            Some(Ticket { end, cost })
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
    pub fn wait(&self, ticket: Ticket, on_first_sleep: impl FnMut()) -> u64 {
        self.wait_with(
            ticket,
            now_ns,
            |ns| std::thread::sleep(Duration::from_nanos(ns)),
            on_first_sleep,
        )
    }

    /// [`wait`](Self::wait) on the given clock and sleep (tests drive a
    /// simulated clock).
    ///
    /// The wait is bounded by the ticket's own cost at the current rate
    /// plus the costs of the launches waiting ahead of it right now: debt
    /// ahead of the ticket that no live waiter holds (tickets of a process
    /// killed while it waited) is forgiven beyond a burst's worth, so no
    /// history of the container lengthens a launch's wait by more than
    /// [`BURST_NS`]. A cost larger than the burst still passes once
    /// refilled: the cap on unused tokens counts from `requested`, which
    /// includes the ticket.
    pub fn wait_with(
        &self,
        t: Ticket,
        clock: impl Fn() -> u64,
        mut sleep: impl FnMut(u64),
        mut on_first_sleep: impl FnMut(),
    ) -> u64 {
        let mut slept_since = None;
        let ret = loop {
            let now = clock();
            let slept = || slept_since.map_or(0, |t0: u64| now.saturating_sub(t0));
            self.refill(now);
            let g = self.w[GRANTED].load(Ordering::Acquire);
            if g >= t.end {
                break slept();
            }
            let rate = self.rate();
            if rate <= 0.0 {
                self.w[GRANTED].fetch_max(t.end.saturating_add(LEARNING_SLACK), Ordering::AcqRel);
                break slept();
            }
            if slept_since.is_none() {
                slept_since = Some(now);
                self.w[WAITS].fetch_add(1, Ordering::Relaxed);
                let others = self.w[WAITING].fetch_add(t.cost, Ordering::AcqRel);
                self.forgive_stale_debt(t, g, others, rate);
                on_first_sleep();
                continue;
            }
            sleep(sleep_for(t.end - g, rate));
        };
        if slept_since.is_some() {
            self.w[WAITING].fetch_sub(t.cost, Ordering::AcqRel);
        }
        ret
    }

    /// Grants the debt ahead of `t` beyond what the launches waiting now
    /// (`others`, their summed costs) and a burst at `rate` account for.
    /// Launches between `take` and their first sleep are not yet counted
    /// in `WAITING`; the burst's slack covers them.
    fn forgive_stale_debt(&self, t: Ticket, granted: u64, others: u64, rate: f64) {
        let ahead = (t.end - t.cost).saturating_sub(granted);
        let keep = others.saturating_add((rate * BURST_NS) as u64);
        if ahead > keep {
            let to = t.end - t.cost - keep;
            self.w[GRANTED].fetch_max(to, Ordering::AcqRel);
            self.w[FORGIVEN].fetch_add(to - granted, Ordering::Relaxed);
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

    /// A fresh container's rate before its controller has measured
    /// anything (`rate` from an assumed wave time, see
    /// `controller::STARTUP_WAVE_NS`), with a burst's worth of tokens so
    /// the first launches do not wait. Only while no rate is set: a later
    /// process of the container keeps the learned one.
    pub fn start(&self, rate: f64) {
        if !(rate.is_finite() && rate > 0.0) {
            return;
        }
        if self.w[RATE]
            .compare_exchange(0, rate.to_bits(), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let q = self.w[REQUESTED].load(Ordering::Acquire);
        self.w[GRANTED].fetch_max(q.saturating_add((rate * BURST_NS) as u64), Ordering::AcqRel);
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

    /// Cost units of 1 ms of device time, as the controller last learned
    /// them; 0 while unknown.
    pub fn units_per_ms(&self) -> u64 {
        self.w[UNITS_PER_MS].load(Ordering::Relaxed)
    }

    /// Units of stale debt forgiven, ever.
    pub fn forgiven(&self) -> u64 {
        self.w[FORGIVEN].load(Ordering::Relaxed)
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

/// How long to sleep for `deficit` units at `rate`: the shortest time whose
/// refill covers it (refills grant `floor(rate x elapsed)`), so one sleep
/// does it. A truncated division left it a unit short now and then, and
/// the second, shortest sleep cost another wakeup: on a loaded host each
/// wakeup may come milliseconds late. At least [`MIN_SLEEP_NS`] (timer slack
/// is 50 us anyway; the surplus stays in the bucket), at most
/// [`MAX_SLEEP_NS`] (then it looks again).
fn sleep_for(deficit: u64, rate: f64) -> u64 {
    let d = deficit as f64;
    let mut ns = (d / rate).ceil();
    // Rounding of the product: a few ulps at most.
    for _ in 0..4 {
        if (rate * ns).floor() >= d {
            break;
        }
        ns += (ns * 4.0 * f64::EPSILON).max(1.0);
    }
    ns.clamp(MIN_SLEEP_NS, MAX_SLEEP_NS) as u64
}

/// CLOCK_MONOTONIC ns (vDSO, no syscall).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only our local `ts`.
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
        // SAFETY: the ledger `l` is returned with the bucket and outlives it in every test that
        // uses them.
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
    fn a_fresh_bucket_starts_at_its_start_up_rate_with_a_burst() {
        let (_d, _l, b) = bucket();
        b.start(1e-3);
        assert_eq!(b.rate(), 1e-3);
        // 50 ms at 1 unit/us pass at once, the next launch waits.
        assert!(b.take(50_000).is_none());
        assert!(b.take(1).is_some());
        // A learned rate is kept by a later process's start.
        b.set_rate(2e-3, 1.0);
        b.start(1e-3);
        assert_eq!(b.rate(), 2e-3);
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
        // Loose: the host's scheduling is not what this checks.
        assert!(e < Duration::from_secs(5), "{e:?}");
    }

    #[test]
    fn unknown_shapes_cost_a_millisecond() {
        let (_d, _l, b) = bucket();
        assert_eq!(
            b.take(0).unwrap().cost,
            DEFAULT_UNKNOWN_COST,
            "before the controller knows"
        );
        let (_d, _l, b) = bucket();
        b.set_rate(1e9, 777.0);
        b.refill(1);
        b.refill(2);
        let before = b.w[REQUESTED].load(Ordering::Relaxed);
        let _ = b.take(0);
        assert_eq!(b.w[REQUESTED].load(Ordering::Relaxed) - before, 777);
    }

    /// A simulated clock that sleeping advances.
    struct Sim(std::cell::Cell<u64>);

    impl Sim {
        fn wait(&self, b: &Bucket, t: Ticket) -> u64 {
            let t0 = self.0.get();
            b.wait_with(
                t,
                || self.0.get(),
                |ns| self.0.set(self.0.get() + ns),
                || {},
            );
            self.0.get() - t0
        }
    }

    /// At 1 unit/µs: a bucket drained to zero (no unused tokens) at `t`.
    fn drained(t: u64) -> (tempfile::TempDir, Ledger, Bucket, Sim) {
        let (d, l, b) = bucket();
        b.set_rate(1e-3, 1e3);
        b.refill(t);
        b.refill(t + 1_000_000_000);
        let sim = Sim(std::cell::Cell::new(t + 1_000_000_000));
        let spare = b.w[GRANTED].load(Ordering::Relaxed) - b.w[REQUESTED].load(Ordering::Relaxed);
        assert!(b.take(spare).is_none());
        (d, l, b, sim)
    }

    #[test]
    fn a_wait_is_what_the_cost_takes_to_earn() {
        let (_d, _l, b, sim) = drained(1_000);
        // 1000 small launches back to back, each waiting at most its own
        // cost (or the shortest sleep, whose surplus covers the next ones).
        for _ in 0..1000 {
            if let Some(t) = b.take(16) {
                let w = sim.wait(&b, t);
                assert!(w <= MIN_SLEEP_NS as u64, "{w}");
            }
        }
        // Spend the surplus (less than one sleep's worth).
        let mut n = 0;
        while b.take(1).is_none() {
            n += 1;
        }
        assert!(n <= 50, "{n}");
        // Then a big one: its own cost, not the history's.
        let t = b.take(20_000).unwrap();
        let w = sim.wait(&b, t);
        assert!((20_000_000..20_100_000).contains(&w), "{w}");
    }

    /// tests/gpu's kernel mix (1-wave and 12-wave launches back to back
    /// from one thread) on a host that wakes sleepers late now and then:
    /// each wait asks for one sleep of at most its own cost's time at the
    /// rate (or the shortest sleep), and a late wakeup never lengthens a
    /// later wait (what it leaves behind is tokens, not debt).
    #[test]
    fn each_wait_asks_for_its_own_cost_whatever_the_wakeups() {
        // 30 % of a device whose waves take 10 us, and odd rates around it.
        for rate in [0.3 * 16.0 / 10_000.0, 3.7e-4, 1.234e-3, 7.77e-5] {
            let (_d, _l, b, sim) = drained(1_000);
            b.set_rate(rate, 1.0);
            let mut waits = 0;
            for i in 0..4000u64 {
                let cost = if i % 2 == 0 { 16 } else { 12 * 16 };
                let Some(t) = b.take(cost) else { continue };
                waits += 1;
                // Every 50th wait wakes 20 ms late.
                let late = if waits % 50 == 0 { 20_000_000 } else { 0 };
                let mut asked = Vec::new();
                b.wait_with(
                    t,
                    || sim.0.get(),
                    |ns| {
                        asked.push(ns);
                        sim.0.set(sim.0.get() + ns + late);
                    },
                    || {},
                );
                let own = ((cost as f64 / rate).ceil() as u64 + 1).max(MIN_SLEEP_NS as u64);
                assert!(
                    asked.len() == 1 && asked[0] <= own,
                    "rate {rate}, launch {i} (cost {cost}, {own} ns at the rate): slept {asked:?}"
                );
            }
            assert!(waits > 500, "rate {rate}: {waits}");
        }
    }

    #[test]
    fn a_cost_beyond_the_burst_passes_once_earned() {
        let (_d, _l, b, sim) = drained(1_000);
        // 10 s worth at this rate: 200 bursts.
        let t = b.take(10_000_000).unwrap();
        let w = sim.wait(&b, t);
        assert!((10_000_000_000..10_030_000_000).contains(&w), "{w}");
    }

    #[test]
    fn the_debt_of_a_launch_that_died_waiting_is_forgiven() {
        let (_d, _l, b, sim) = drained(1_000);
        // A process took a 100 s ticket and was killed before it slept.
        let _dead = b.take(100_000_000).unwrap();
        let t = b.take(16).unwrap();
        let w = sim.wait(&b, t);
        // Its own 16 us and at most a burst of the dead debt.
        assert!(w <= 16_000 + BURST_NS as u64 + 60_000, "{w}");
        assert!(b.forgiven() > 90_000_000, "{}", b.forgiven());
        assert_eq!(b.w[WAITING].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn live_waiters_ahead_are_waited_for() {
        let (_d, _l, b, sim) = drained(1_000);
        // Another launch (10 ms) is asleep ahead of ours.
        let ahead = b.take(10_000).unwrap();
        b.w[WAITING].fetch_add(ahead.cost, Ordering::Relaxed);
        let t = b.take(16).unwrap();
        let w = sim.wait(&b, t);
        assert!((10_016_000..10_100_000).contains(&w), "{w}");
        assert_eq!(b.forgiven(), 0);
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
