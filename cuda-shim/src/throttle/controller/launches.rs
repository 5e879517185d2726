//! The bucket's launched-units counter over time: what turns an NVML
//! sample period into the units the container launched in it.

use std::collections::VecDeque;

/// Launch counts older than this are dropped (NVML keeps 5 s of samples).
const HISTORY_NS: u64 = 6_000_000_000;

#[derive(Default)]
pub(super) struct LaunchHistory {
    /// (CLOCK_MONOTONIC ns, units launched so far), oldest first.
    points: VecDeque<(u64, u64)>,
}

impl LaunchHistory {
    /// Adds the counter's value at `now`; a point not after the newest is
    /// ignored, points past [`HISTORY_NS`] are dropped.
    pub(super) fn record(&mut self, now: u64, units: u64) {
        if self.points.back().is_some_and(|&(t, _)| t >= now) {
            return;
        }
        self.points.push_back((now, units));
        while self
            .points
            .front()
            .is_some_and(|&(t, _)| t + HISTORY_NS < now)
        {
            self.points.pop_front();
        }
    }

    /// Units launched by `t`, interpolated between recorded points; `None`
    /// outside the recorded span.
    pub(super) fn at(&self, t: u64) -> Option<f64> {
        let first = *self.points.front()?;
        let last = *self.points.back()?;
        if t < first.0 || t > last.0 {
            return None;
        }
        let i = self.points.partition_point(|&(x, _)| x <= t);
        if i == 0 {
            return Some(first.1 as f64);
        }
        let (t0, u0) = self.points[i - 1];
        let Some(&(t1, u1)) = self.points.get(i) else {
            return Some(u0 as f64);
        };
        let f = (t - t0) as f64 / (t1 - t0).max(1) as f64;
        Some(u0 as f64 + f * (u1 as f64 - u0 as f64))
    }

    /// Units launched in `[start, end)`.
    pub(super) fn between(&self, start: u64, end: u64) -> Option<u64> {
        let a = self.at(start)?;
        let b = self.at(end)?;
        Some((b - a).max(0.0).round() as u64)
    }
}
