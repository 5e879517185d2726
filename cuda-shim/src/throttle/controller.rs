//! The feedback controller: pure arithmetic over utilisation samples, no
//! I/O, so it is unit-tested directly.
//!
//! Model: a launch costs `cost` units (its thread count); the device busy
//! time it causes is `k` ns per unit, unknown and learned. The container
//! may launch `rate` units per ns, so it keeps the device busy
//! `rate * k` of the time. Each sample period the controller learns `k`
//! from the last second (busy ns measured by NVML / units launched, as
//! counted by the shared bucket) and sets `rate = m * target / k`: a
//! feed-forward that lands on the target after one period whatever the
//! kernels are. `m` is a slow integral term (about 2 s time constant) that
//! removes what feed-forward misses (tokens lost to the burst cap, a
//! launch-to-run lag); it only grows while the container actually waited
//! for tokens, so an idle container does not wind it up.
//!
//! Blind feedback (fail-open, issue 12): when NVML cannot attribute the
//! container's work to its host PIDs (a PID namespace the manager could
//! not map, MPS, whose server runs every client's kernels under its own
//! PID, MIG, which has no per-process samples), `own` reads 0 however much
//! the bucket admits, the scale is never learned, and the quota would be
//! off. The controller notices ([`Blind`]) and then, instead of running
//! unlimited: with samples that name other PIDs only, it charges the
//! container for the whole device's busy time (so it gets at most its
//! quota, less while others are busy too); with no samples at all, it
//! keeps the last rate it learned, or if it never learned one, assumes
//! [`ASSUMED_WAVE_NS`] per wave.

use std::collections::VecDeque;

mod launches;
use launches::LaunchHistory;

/// Periods the learned scale averages over (1 s of 100 ms samples).
const SCALE_WINDOW: usize = 10;
/// Periods the achieved utilisation is averaged over for the integral.
const ERROR_WINDOW: usize = 5;
/// Periods the soft limit looks back for other containers' use.
const OTHERS_WINDOW: usize = 3;
/// Device busy share (own + others, one period) at which a soft share
/// counts the device as full (context switches between tenants idle it by
/// a few percent).
const SATURATED: f64 = 90.0;
/// Points the others' use must grow by, over their average of the periods
/// before, for a full device to count as contended (NVML's whole percents
/// and the laws' jitter move it by 1-2).
const GROWTH: f64 = 3.0;
/// Periods in a row the device must have idle time before a soft share
/// holding on a full device takes it: a newcomer's controller dips for a
/// period or two while it relearns its scale (a hard 70 at 58 % for
/// 100 ms), and a soft share that grabbed that dip held it (34 % for 2 s
/// beside the neighbour it had yielded to).
const RECLAIM_PERIODS: usize = 3;
/// Integral gain per period, per unit of relative error.
const KI: f64 = 0.08;
/// Bounds of the integral correction.
const M_MIN: f64 = 0.5;
const M_MAX: f64 = 2.0;
/// Periods a seeded controller needs before its own estimate of the scale.
const SEEDED_MIN_PERIODS: usize = 3;
/// Periods in a row with work admitted, the device busy and no sample of
/// the container's PIDs before the feedback is called blind (1 s).
const BLIND_PERIODS: u32 = 10;
/// Admitted units a period needs to count towards blindness: 500 waves,
/// enough device time that NVML's whole-percent samples show it.
const BLIND_MIN_UNITS: u64 = 500 * super::cost::WAVE_UNITS;
/// No sample at all for this long while launching: blind.
const NO_SAMPLES_NS: u64 = 2_000_000_000;
/// Device time of a wave assumed when no sample ever arrives and nothing
/// was learned: longer than most real waves, so the error is a quota held
/// too tight, not one left open.
pub const ASSUMED_WAVE_NS: f64 = 50_000.0;
/// Device time of a wave assumed before the controller has measured any
/// (a fresh container's first sample period, 0.1-0.2 s): the bucket starts
/// at the quota's rate for waves this long. Long on purpose: a process
/// that queues launches without waiting for them would otherwise fill the
/// driver's launch queue with work the quota cannot take back (a kernel of
/// one 0.4 ms wave at a 50 us assumption ran at 100 % for its first 0.6 s
/// and 45 % over its first 2 s at a 30 % quota); too long costs a short
/// kernel a slow first period, no more (and where its work is too little
/// for NVML to show at all, [`Controller::ramp`] speeds the start up).
pub const STARTUP_WAVE_NS: f64 = 500_000.0;
/// A period is assumed to last this long when the previous one is unknown
/// (the driver samples every 100 ms on the sim; real drivers ~ 1/6 s).
pub const DEFAULT_PERIOD_NS: u64 = 100_000_000;

/// What the container may use, in percent of the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quota {
    pub utilization: f64,
    /// Soft limit ceiling; `None` for a hard limit.
    pub soft_limit: Option<f64>,
}

impl Quota {
    /// The share to aim for given the others' recent use: the quota, or
    /// for a soft limit whatever the device leaves idle, up to the ceiling.
    pub fn target(&self, others: f64) -> f64 {
        match self.soft_limit {
            None => self.utilization,
            Some(ceiling) => {
                (100.0 - others).clamp(self.utilization, ceiling.max(self.utilization))
            }
        }
    }
}

/// One NVML sample period, summed over processes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Period {
    /// End, CLOCK_MONOTONIC ns.
    pub end_ns: u64,
    pub len_ns: u64,
    /// The container's processes, percent of the period.
    pub own: f64,
    /// Everyone else on the device.
    pub others: f64,
    /// Cost units the container launched during the period, if known.
    pub cost: Option<u64>,
}

/// The device time a cost unit took in the container's timed launches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    /// Their device time over their cost.
    pub ns_per_unit: f64,
    /// The standard error of that ratio (residuals about it).
    pub error: f64,
    /// cov(residual, cost) / (n * mean cost²): how [`Self::error_at`]
    /// moves with the reference (0: the error does not).
    pub cross: f64,
    /// var(cost) / (n * mean cost²).
    pub cost_spread: f64,
}

impl Timed {
    /// A ratio whose standard error is `error` whatever it is tested
    /// against.
    pub fn new(ns_per_unit: f64, error: f64) -> Timed {
        Timed {
            ns_per_unit,
            error,
            cross: 0.0,
            cost_spread: 0.0,
        }
    }

    /// The ratio's standard error were the true ratio `reference`: from
    /// the residuals `ns - reference * cost`. Why not [`Self::error`]:
    /// when costs say little of time (one duration at 1 to 100,000
    /// blocks), the ratio is low exactly when the sample drew many
    /// costly launches, and the residuals about that low ratio are then
    /// small too, so a ratio 2 true standard errors low read as 3 and a
    /// hard 70 alone on its GPU ran at 76 % (tests/shim_accuracy.rs).
    pub fn error_at(&self, reference: f64) -> f64 {
        let d = reference - self.ns_per_unit;
        (self.error * self.error - 2.0 * d * self.cross + d * d * self.cost_spread)
            .max(0.0)
            .sqrt()
    }
}

/// The controller's decision for the bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Cost units per ns.
    pub rate: f64,
    /// Target in percent.
    pub target: f64,
    /// Cost units of 1 ms of device time (charged for launches of
    /// unknown shape, such as graphs).
    pub units_per_ms: f64,
    /// The container's recent use, percent.
    pub achieved: f64,
}

/// Why the controller cannot see the container's own use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blind {
    /// Samples show the device busy, none names the container's PIDs.
    OtherPids = 1,
    /// No sample at all while the container launched.
    NoSamples = 2,
}

pub struct Controller {
    quota: Quota,
    /// Periods in a row that looked blind; see [`BLIND_PERIODS`].
    dark: u32,
    blind: Option<Blind>,
    /// End of the newest period, or when this controller started.
    last_period_ns: Option<u64>,
    launched: LaunchHistory,
    periods: VecDeque<Period>,
    /// Learned ns of device time per cost unit.
    scale: Option<f64>,
    /// The scale came from the previous controller (see [`Self::seed_scale`]).
    seeded: bool,
    m: f64,
    /// A soft share's target while the device is full (see
    /// [`Self::soft_target`]).
    held: Option<f64>,
    /// Periods the container launched in while NVML never showed it busy
    /// (no scale yet): the start-up rate doubles with each ([`Self::ramp`]).
    unseen: u32,
    /// Periods since the first decision: the integral starts once the
    /// error window holds only periods run under a decided rate (the
    /// start-up periods, at an assumed rate, would wind it off).
    decided: usize,
    /// The container's launches timed on the device (see
    /// [`Self::set_timed`]).
    timed: Option<Timed>,
    /// The timed scale capped NVML's in the last decision.
    capping: bool,
}

impl Controller {
    pub fn new(quota: Quota) -> Controller {
        Controller {
            quota,
            dark: 0,
            blind: None,
            last_period_ns: None,
            launched: LaunchHistory::default(),
            periods: VecDeque::new(),
            scale: None,
            seeded: false,
            m: 1.0,
            held: None,
            unseen: 0,
            decided: 0,
            timed: None,
            capping: false,
        }
    }

    /// Records the bucket's launched-units counter at `now`.
    pub fn record_launched(&mut self, now: u64, units: u64) {
        self.last_period_ns.get_or_insert(now);
        self.launched.record(now, units);
    }

    /// Units launched by `t`, interpolated between recorded points; `None`
    /// outside the recorded span.
    pub fn launched_at(&self, t: u64) -> Option<f64> {
        self.launched.at(t)
    }

    /// The container's launched units in `[start, end)`.
    pub fn cost_between(&self, start: u64, end: u64) -> Option<u64> {
        self.launched.between(start, end)
    }

    /// Adds a finished period. `waited`: some launch of the container
    /// waited for tokens since the previous period (its demand exceeded
    /// the rate). Returns the new decision once the scale is known.
    pub fn add_period(&mut self, p: Period, waited: bool) -> Option<Decision> {
        self.watch_attribution(&p);
        self.learn(p, waited)
    }

    /// Adds `p` (its attribution already judged) to the window and decides.
    fn learn(&mut self, p: Period, waited: bool) -> Option<Decision> {
        self.periods.push_back(p);
        while self.periods.len() > SCALE_WINDOW {
            self.periods.pop_front();
        }
        let (mut busy, mut units, mut known) = (0.0, 0u64, 0);
        for q in &self.periods {
            if let Some(c) = q.cost {
                busy += self.seen(q) / 100.0 * q.len_ns as f64;
                units += c;
                known += 1;
            }
        }
        if units > 0 && busy > 0.0 && (!self.seeded || known >= SEEDED_MIN_PERIODS) {
            self.scale = Some(busy / units as f64);
        }
        let Some(learned) = self.scale else {
            return self.ramp(&p);
        };
        // NVML's scale, unless the timed launches say, beyond four standard
        // errors, that a unit takes less (see `set_timed`); once capping,
        // until they say so within one. Let go on a noisy second, the rate
        // fell back to NVML's scale, which for a share named with the
        // device's total is the neighbour's use too (a hard 70 beside a
        // soft 30 at 40 % for 1.5 s); held until the timed ratio reached
        // NVML's, a stale one outlived a change of kernels alone on the GPU
        // (a hard 50 at 53-56 %). Two standard errors to engage were
        // crossed by chance alone on the GPU when costs say nothing of
        // time (1 and 100,000 blocks of one duration: a ratio wandering
        // ±25 % over seconds; a hard 90 at 95 %). The errors are those the
        // ratio has were NVML's scale true ([`Timed::error_at`]), and four
        // to engage: a decision every 100 ms is 80 looks in 8 s, and three
        // were still crossed by chance (a hard 50 at 53.2 %, one run in 5).
        let margin = if self.capping { 1.0 } else { 4.0 };
        let capped = self
            .timed
            .filter(|t| t.ns_per_unit + margin * t.error_at(learned) < learned)
            .map(|t| t.ns_per_unit);
        self.capping = capped.is_some();
        let scale = capped.unwrap_or(learned);
        let others = avg(self.periods.iter().rev().take(OTHERS_WINDOW), |q| q.others);
        let target = self.soft_target(others);
        let achieved = avg(
            self.periods.iter().rev().take(ERROR_WINDOW),
            |q| match capped {
                Some(_) => self.timed_use(q).unwrap_or(self.seen(q) * scale / learned),
                None => self.seen(q),
            },
        );
        let err = (target - achieved) / target.max(1.0);
        self.decided += 1;
        // Anti-windup: raise only while the container was held back.
        if self.decided > ERROR_WINDOW + 1 && (err < 0.0 || waited) {
            self.m = (self.m * (1.0 + KI * err)).clamp(M_MIN, M_MAX);
        }
        Some(Decision {
            rate: self.m * target / 100.0 / scale,
            target,
            units_per_ms: 1e6 / scale,
            achieved,
        })
    }

    /// The newest period had the device full ([`SATURATED`]) with others
    /// on it.
    fn full(&self) -> bool {
        self.periods.back().is_some_and(|p| self.full_in(p))
    }

    fn full_in(&self, p: &Period) -> bool {
        p.others >= 1.0 && self.seen(p) + p.others >= SATURATED
    }

    /// The newest periods in a row that were not full.
    fn idle_run(&self) -> usize {
        self.periods
            .iter()
            .rev()
            .take_while(|p| !self.full_in(p))
            .count()
    }

    /// The target: the quota's ([`Quota::target`]: what others leave, for
    /// a soft share) while the device has idle time. On a full device
    /// ([`SATURATED`], others on it) nothing is left: contexts time-slice in
    /// proportion to what each submits, so "what others leave" is what the
    /// soft share leaves them, and its own use is no anchor either (its
    /// scale, learned while queued behind others' work, reads low, and the
    /// share crept from 30 to 40 % over 5 s beside a hard-70 neighbour). A
    /// soft share then holds the target it had when the device filled (it
    /// only goes down), and when the others' use grows ([`GROWTH`] points
    /// over the periods before: a neighbour that takes what it is given
    /// wants more) it falls back to its guarantee. Idle time it leaves is
    /// taken back once the device had idle time for [`RECLAIM_PERIODS`]
    /// in a row (what others leave).
    fn soft_target(&mut self, others: f64) -> f64 {
        let t = self.quota.target(others);
        let q = self.quota.utilization;
        if self.quota.soft_limit.is_none() {
            return t;
        }
        if !self.full() {
            match self.held {
                Some(h) if self.idle_run() < RECLAIM_PERIODS => return h.min(t).max(q),
                _ => {
                    self.held = None;
                    return t;
                }
            }
        }
        let mut newest = self.periods.iter().rev();
        let own = newest.next().map_or(0.0, |p| self.seen(p));
        let now = self.periods.back().map_or(0.0, |p| p.others);
        let before: Vec<f64> = newest.take(OTHERS_WINDOW).map(|p| p.others).collect();
        let grew = now - before.iter().sum::<f64>() / before.len().max(1) as f64;
        let held = if grew >= GROWTH {
            q
        } else {
            self.held.unwrap_or(own).min(t).max(q)
        };
        self.held = Some(held);
        held
    }

    /// No scale yet although the container launched in `p`: its work at
    /// the start-up rate was too little for NVML's whole percents (waves
    /// much shorter than [`STARTUP_WAVE_NS`]). Doubles the start-up rate
    /// per such period, up to the rate for [`ASSUMED_WAVE_NS`] waves (4
    /// periods), so a container of tiny kernels is seen and learns its
    /// scale instead of staying at a rate sized for long waves.
    fn ramp(&mut self, p: &Period) -> Option<Decision> {
        if p.cost.is_none_or(|c| c == 0) {
            return None;
        }
        self.unseen = (self.unseen + 1).min(16);
        let rate =
            (startup_rate(self.quota) * f64::from(1u32 << self.unseen)).min(self.ramp_ceiling());
        Some(Decision {
            rate,
            target: self.quota.utilization,
            // Nothing learned: the bucket keeps pricing unknown shapes as before.
            units_per_ms: 0.0,
            achieved: p.own,
        })
    }

    /// The ramp's highest rate (units per ns): the quota at
    /// [`ASSUMED_WAVE_NS`] per wave.
    fn ramp_ceiling(&self) -> f64 {
        self.quota.utilization / 100.0 * super::cost::WAVE_UNITS as f64 / ASSUMED_WAVE_NS
    }

    /// Admitted units `p` needs to count towards blindness:
    /// [`BLIND_MIN_UNITS`], or half of what the ramp's ceiling admits in the
    /// period where that is less. Before a scale is learned the ramp caps the
    /// rate, and a hard 30 % tops out at 600 waves per 100 ms (a quota of 25 %
    /// or less never reached 500): its periods must still count, or samples
    /// naming none of its PIDs go unnoticed for good.
    fn blind_min_units(&self, p: &Period) -> u64 {
        let ceiling = self.ramp_ceiling() * p.len_ns as f64;
        BLIND_MIN_UNITS.min((ceiling / 2.0) as u64)
    }

    /// The container's use in `q` as the controller counts it: its own
    /// samples, or while they name other PIDs only, the whole device's.
    fn seen(&self, q: &Period) -> f64 {
        match self.blind {
            Some(Blind::OtherPids) => (q.own + q.others).min(100.0),
            _ => q.own,
        }
    }

    fn watch_attribution(&mut self, p: &Period) {
        self.last_period_ns = Some(p.end_ns);
        if p.own > 0.0 {
            self.dark = 0;
            self.blind = None;
        } else if p.others > 0.0 && p.cost.is_some_and(|c| c >= self.blind_min_units(p)) {
            self.dark += 1;
            if self.dark >= BLIND_PERIODS {
                self.blind = Some(Blind::OtherPids);
            }
        } else if self.blind == Some(Blind::NoSamples) {
            self.blind = None;
        }
    }

    /// Called every tick: notices that no sample arrived for
    /// [`NO_SAMPLES_NS`] while the container launched. Returns the rate to
    /// hold when the feedback has just gone dark before any was learned.
    pub fn check_samples(&mut self, now: u64) -> Option<Decision> {
        let since = self.last_period_ns?;
        if self.blind.is_some() || now < since + NO_SAMPLES_NS {
            return None;
        }
        let from = self.launched_at(now - NO_SAMPLES_NS)?;
        let to = self.launched_at(now)?;
        if to - from < BLIND_MIN_UNITS as f64 {
            return None;
        }
        self.blind = Some(Blind::NoSamples);
        if self.scale.is_some() {
            return None; // the bucket keeps the last decided rate
        }
        let scale = ASSUMED_WAVE_NS / super::cost::WAVE_UNITS as f64;
        let target = self.quota.target(0.0);
        Some(Decision {
            rate: target / 100.0 / scale,
            target,
            units_per_ms: 1e6 / scale,
            achieved: 0.0,
        })
    }

    /// A period whose samples named only busier neighbours
    /// ([`super::sampler::Reported::eclipsed`]): a real driver names one
    /// process a period, so the container's own use in it is unknown, not
    /// zero. Counting it as zero made a 5 % latency tenant beside a batch
    /// neighbour "blind" after 10 such periods and charged it the
    /// neighbour's 50-99 %: its p99 went from 0.8 ms to 370 ms (H200,
    /// driver 580). Instead the container is charged what the device was
    /// busy beyond the neighbours named (`device`: NVML's device-wide busy
    /// percent), an upper bound (a third tenant's use is in it too), so a
    /// share that is never named still holds its quota; without that
    /// figure the period is left out (the rate holds, or before a scale is
    /// known the start-up ramp goes on). Under an assumed blindness (MPS)
    /// it counts as any period: all busy time is charged.
    pub fn add_eclipsed(
        &mut self,
        mut p: Period,
        device: Option<f64>,
        waited: bool,
    ) -> Option<Decision> {
        if self.blind == Some(Blind::OtherPids) {
            return self.add_period(p, waited);
        }
        self.last_period_ns = Some(p.end_ns);
        if let Some(own) = self.timed_use(&p) {
            p.own = own.min(device.unwrap_or(100.0));
            return self.learn(p, waited);
        }
        match device {
            Some(busy) => {
                p.own = (busy - p.others).clamp(0.0, 100.0);
                self.learn(p, waited)
            }
            None if self.scale.is_none() => self.ramp(&p),
            None => None,
        }
    }

    /// The device time per cost unit the container's own launches took,
    /// timed on the device with events (`super::timed`), or `None`. NVML's
    /// samples of a real driver name one process a period, the busiest,
    /// with the device's whole busy percent: two busy shares each counted
    /// the other's use as theirs and a hard 60 % beside a hard 30 % held
    /// 48 % (H200, driver 580). The timed scale caps the learned one (a
    /// timed launch that a timeslice interrupts reads long, so it errs on
    /// the quota's side; alone on a GPU NVML's is the lower and stays),
    /// and gives an eclipsed period its use.
    pub fn set_timed(&mut self, timed: Option<Timed>) {
        self.timed = timed.filter(|t| {
            t.ns_per_unit.is_finite()
                && t.ns_per_unit > 0.0
                && [t.error, t.cross, t.cost_spread]
                    .iter()
                    .all(|v| v.is_finite())
        });
    }

    /// The container's use in `p` by its timed scale, percent.
    fn timed_use(&self, p: &Period) -> Option<f64> {
        let (k, c) = (self.timed?.ns_per_unit, p.cost?);
        (p.len_ns > 0).then(|| c as f64 * k / p.len_ns as f64 * 100.0)
    }

    /// The container's use is known to be invisible by PID from the start
    /// (an MPS client: the server's PID carries every client's work):
    /// charge it the device's busy time at once, instead of waiting for
    /// [`BLIND_PERIODS`] periods of enough admitted units, which long
    /// kernels never reach (a CUDA graph of large matmuls is ~100 waves
    /// per 100 ms, under [`Self::blind_min_units`], and ran at 85 % under a
    /// hard 30 % on an H100 under MPS). Cleared like any blindness, by a
    /// sample that names the container.
    pub fn assume_blind(&mut self) {
        if self.blind.is_none() {
            self.blind = Some(Blind::OtherPids);
        }
    }

    /// A period of the container's own timed launches while NVML gives no
    /// samples at all ([`Blind::NoSamples`]): a MIG instance on a GPU
    /// without GPM (an A100), whose parent's samples MIG mode leaves
    /// empty. The instance is the container's alone, so its timed launches
    /// are its whole use there; without them the blind rule's assumed wave
    /// time held a 50 % share at 10 %. One period per
    /// [`DEFAULT_PERIOD_NS`]; `None` otherwise, or without timed launches.
    /// `waited` (did the container wait for tokens since the last period?)
    /// is asked only for a period added: asking resets it.
    pub fn add_timed_period(
        &mut self,
        now: u64,
        waited: impl FnOnce() -> bool,
    ) -> Option<Decision> {
        let since = self.last_period_ns?;
        if self.blind != Some(Blind::NoSamples) || now < since + DEFAULT_PERIOD_NS {
            return None;
        }
        let mut p = Period {
            end_ns: now,
            len_ns: now - since,
            own: 0.0,
            others: 0.0,
            cost: self.cost_between(since, now),
        };
        p.own = self.timed_use(&p)?.min(100.0);
        self.last_period_ns = Some(now);
        self.learn(p, waited())
    }

    /// Whether, and why, the container's own use is invisible.
    pub fn blind(&self) -> Option<Blind> {
        self.blind
    }

    /// Starts from the scale a previous controller of the container learned
    /// (the bucket keeps it), replaced once [`SEEDED_MIN_PERIODS`] periods
    /// give an estimate of its own: one period's estimate is noisy (a
    /// round of launches and its device time can straddle two periods),
    /// and a lease moving to a new process should not jolt the rate.
    pub fn seed_scale(&mut self, scale: f64) {
        if scale.is_finite() && scale > 0.0 && self.scale.is_none() {
            self.scale = Some(scale);
            self.seeded = true;
        }
    }

    pub fn scale(&self) -> Option<f64> {
        self.scale
    }

    pub fn integral(&self) -> f64 {
        self.m
    }
}

/// The bucket's rate (units per ns) before the first decision: the
/// guarantee at [`STARTUP_WAVE_NS`] per wave.
pub fn startup_rate(q: Quota) -> f64 {
    q.utilization / 100.0 * super::cost::WAVE_UNITS as f64 / STARTUP_WAVE_NS
}

/// Time-weighted average of `f` over periods.
fn avg<'a>(it: impl Iterator<Item = &'a Period>, f: impl Fn(&Period) -> f64) -> f64 {
    let (mut sum, mut len) = (0.0, 0.0);
    for p in it {
        sum += f(p) * p.len_ns as f64;
        len += p.len_ns as f64;
    }
    if len > 0.0 { sum / len } else { 0.0 }
}

#[cfg(test)]
mod tests;
