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

use std::collections::VecDeque;

/// Periods the learned scale averages over (1 s of 100 ms samples).
const SCALE_WINDOW: usize = 10;
/// Periods the achieved utilisation is averaged over for the integral.
const ERROR_WINDOW: usize = 5;
/// Periods the soft limit looks back for other containers' use.
const OTHERS_WINDOW: usize = 3;
/// Integral gain per period, per unit of relative error.
const KI: f64 = 0.08;
/// Bounds of the integral correction.
const M_MIN: f64 = 0.5;
const M_MAX: f64 = 2.0;
/// Launch counts older than this are dropped (NVML keeps 5 s of samples).
const HISTORY_NS: u64 = 6_000_000_000;
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

pub struct Controller {
    quota: Quota,
    /// (CLOCK_MONOTONIC ns, units launched so far), oldest first.
    launched: VecDeque<(u64, u64)>,
    periods: VecDeque<Period>,
    /// Learned ns of device time per cost unit.
    scale: Option<f64>,
    m: f64,
    /// Periods since the first decision: the integral starts once the
    /// error window holds only periods run under a decided rate (the
    /// unthrottled learning periods would wind it down).
    decided: usize,
}

impl Controller {
    pub fn new(quota: Quota) -> Controller {
        Controller {
            quota,
            launched: VecDeque::new(),
            periods: VecDeque::new(),
            scale: None,
            m: 1.0,
            decided: 0,
        }
    }

    /// Records the bucket's launched-units counter at `now`.
    pub fn record_launched(&mut self, now: u64, units: u64) {
        if self.launched.back().is_some_and(|&(t, _)| t >= now) {
            return;
        }
        self.launched.push_back((now, units));
        while self
            .launched
            .front()
            .is_some_and(|&(t, _)| t + HISTORY_NS < now)
        {
            self.launched.pop_front();
        }
    }

    /// Units launched by `t`, interpolated between recorded points; `None`
    /// outside the recorded span.
    pub fn launched_at(&self, t: u64) -> Option<f64> {
        let first = *self.launched.front()?;
        let last = *self.launched.back()?;
        if t < first.0 || t > last.0 {
            return None;
        }
        let i = self.launched.partition_point(|&(x, _)| x <= t);
        if i == 0 {
            return Some(first.1 as f64);
        }
        let (t0, u0) = self.launched[i - 1];
        let Some(&(t1, u1)) = self.launched.get(i) else {
            return Some(u0 as f64);
        };
        let f = (t - t0) as f64 / (t1 - t0).max(1) as f64;
        Some(u0 as f64 + f * (u1 as f64 - u0 as f64))
    }

    /// The container's launched units in `[end - len, end)`.
    pub fn cost_between(&self, start: u64, end: u64) -> Option<u64> {
        let a = self.launched_at(start)?;
        let b = self.launched_at(end)?;
        Some((b - a).max(0.0).round() as u64)
    }

    /// Adds a finished period. `waited`: some launch of the container
    /// waited for tokens since the previous period (its demand exceeded
    /// the rate). Returns the new decision once the scale is known.
    pub fn add_period(&mut self, p: Period, waited: bool) -> Option<Decision> {
        self.periods.push_back(p);
        while self.periods.len() > SCALE_WINDOW {
            self.periods.pop_front();
        }
        let (mut busy, mut units) = (0.0, 0u64);
        for q in &self.periods {
            if let Some(c) = q.cost {
                busy += q.own / 100.0 * q.len_ns as f64;
                units += c;
            }
        }
        if units > 0 && busy > 0.0 {
            self.scale = Some(busy / units as f64);
        }
        let scale = self.scale?;
        let others = avg(self.periods.iter().rev().take(OTHERS_WINDOW), |q| q.others);
        let target = self.quota.target(others);
        let achieved = avg(self.periods.iter().rev().take(ERROR_WINDOW), |q| q.own);
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

    pub fn scale(&self) -> Option<f64> {
        self.scale
    }

    pub fn integral(&self) -> f64 {
        self.m
    }
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
mod tests {
    use super::*;

    const P: u64 = DEFAULT_PERIOD_NS;

    /// A device model: the container launches at most `rate` units/ns
    /// (or `demand` if lower) and each unit costs `k` ns.
    fn run(quota: Quota, k: f64, demand: f64, others: f64, periods: usize) -> (Controller, f64) {
        let mut c = Controller::new(quota);
        let mut rate = f64::INFINITY;
        let mut units = 0.0;
        let mut t = 0;
        let mut own = 0.0;
        c.record_launched(t, 0);
        for _ in 0..periods {
            let r = rate.min(demand);
            let room = (100.0 - others) / 100.0 / k;
            let r = r.min(room);
            // Ticks of 20 ms within the period.
            for _ in 0..5 {
                t += P / 5;
                units += r * (P / 5) as f64;
                c.record_launched(t, units as u64);
            }
            own = r * k * 100.0;
            let p = Period {
                end_ns: t,
                len_ns: P,
                own,
                others,
                cost: c.cost_between(t - P, t),
            };
            if let Some(d) = c.add_period(p, rate < demand) {
                rate = d.rate;
            }
        }
        (c, own)
    }

    #[test]
    fn hard_limit_lands_on_the_target_whatever_the_scale() {
        for k in [1e-3, 0.05, 7.0] {
            for l in [10.0, 30.0, 90.0] {
                let q = Quota {
                    utilization: l,
                    soft_limit: None,
                };
                let (c, own) = run(q, k, f64::INFINITY, 0.0, 40);
                assert!((own - l).abs() < 0.5, "k={k} L={l}: {own}");
                assert!((c.scale().unwrap() - k).abs() / k < 1e-3);
            }
        }
    }

    #[test]
    fn an_idle_container_does_not_wind_up() {
        let q = Quota {
            utilization: 50.0,
            soft_limit: None,
        };
        // Wants only 20% worth of work.
        let (c, own) = run(q, 0.01, 0.2 / 0.01, 0.0, 50);
        assert!((own - 20.0).abs() < 0.5, "{own}");
        assert!((c.integral() - 1.0).abs() < 1e-9, "{}", c.integral());
    }

    #[test]
    fn soft_limit_takes_what_others_leave() {
        let q = Quota {
            utilization: 30.0,
            soft_limit: Some(100.0),
        };
        assert_eq!(q.target(0.0), 100.0);
        assert_eq!(q.target(40.0), 60.0);
        assert_eq!(q.target(90.0), 30.0);
        let capped = Quota {
            utilization: 30.0,
            soft_limit: Some(60.0),
        };
        assert_eq!(capped.target(0.0), 60.0);
        let (_, own) = run(capped, 0.02, f64::INFINITY, 0.0, 30);
        assert!((own - 60.0).abs() < 0.5, "{own}");
        let (_, own) = run(q, 0.02, f64::INFINITY, 50.0, 30);
        assert!((own - 50.0).abs() < 0.5, "{own}");
    }

    #[test]
    fn integral_corrects_a_bias() {
        // Feed-forward misses by 20% (e.g. tokens lost): achieved is 0.8 of
        // what the rate says; the integral brings it back.
        let q = Quota {
            utilization: 40.0,
            soft_limit: None,
        };
        let mut c = Controller::new(q);
        let (mut t, mut units, mut rate, mut own) = (0u64, 0.0, 1.0, 0.0);
        c.record_launched(0, 0);
        for _ in 0..100 {
            t += P;
            units += rate * P as f64;
            c.record_launched(t, units as u64);
            // k = 0.01 on what was launched, but only 80% of it "counts".
            own = rate * 0.01 * 100.0 * 0.8;
            let p = Period {
                end_ns: t,
                len_ns: P,
                own,
                others: 0.0,
                cost: c.cost_between(t - P, t),
            };
            rate = c.add_period(p, true).unwrap().rate;
        }
        assert!((own - 40.0).abs() < 1.0, "{own}");
    }

    #[test]
    fn launched_interpolates() {
        let mut c = Controller::new(Quota {
            utilization: 10.0,
            soft_limit: None,
        });
        assert_eq!(c.launched_at(5), None);
        c.record_launched(100, 1000);
        c.record_launched(200, 2000);
        c.record_launched(150, 5); // out of order: ignored
        assert_eq!(c.launched_at(150), Some(1500.0));
        assert_eq!(c.launched_at(200), Some(2000.0));
        assert_eq!(c.launched_at(201), None);
        assert_eq!(c.cost_between(100, 200), Some(1000));
    }
}
