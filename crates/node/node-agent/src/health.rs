//! GPU health from critical Xids, the same in both modes: a critical Xid
//! takes a GPU out at once; after the quiet period without another it is
//! healthy again. [`XidTracker`] is that rule (pure, clock passed in);
//! [`spawn_tracker`] runs it over the NVML watcher's events
//! ([`crate::nvml::watch_xids`]) and reports each change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::nvml::XidEvent;

/// The quiet-period rule over the GPUs' last critical Xid.
#[derive(Debug, Clone)]
pub struct XidTracker {
    quiet: Duration,
    last: BTreeMap<usize, Instant>,
}

impl XidTracker {
    pub fn new(quiet: Duration) -> XidTracker {
        XidTracker {
            quiet,
            last: BTreeMap::new(),
        }
    }

    pub fn quiet(&self) -> Duration {
        self.quiet
    }

    /// How often [`XidTracker::recovered`] is asked: a quarter of the quiet
    /// period, within 100 ms and 5 s.
    pub fn tick(&self) -> Duration {
        (self.quiet / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
    }

    /// A critical Xid on `gpu` at `at`: unhealthy until the quiet period
    /// passes without another.
    pub fn critical(&mut self, gpu: usize, at: Instant) {
        self.last.insert(gpu, at);
    }

    pub fn is_unhealthy(&self, gpu: usize) -> bool {
        self.last.contains_key(&gpu)
    }

    /// The GPUs whose quiet period has passed at `now`, in index order;
    /// they are healthy again (forgotten).
    pub fn recovered(&mut self, now: Instant) -> Vec<usize> {
        let quiet = self.quiet;
        let done: Vec<usize> = self
            .last
            .iter()
            .filter(|(_, t)| now.saturating_duration_since(**t) >= quiet)
            .map(|(&g, _)| g)
            .collect();
        for g in &done {
            self.last.remove(g);
        }
        done
    }
}

/// A GPU's health changed (or another critical Xid arrived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// Every critical Xid, also on a GPU already unhealthy (the quiet
    /// period restarts).
    Unhealthy {
        gpu: usize,
        xid: u64,
    },
    Healthy {
        gpu: usize,
    },
}

/// Runs an [`XidTracker`] of `quiet` over `events` until `cancel` or the
/// watcher ends; each critical Xid and each recovery is sent on the
/// returned channel.
pub fn spawn_tracker(
    mut events: mpsc::UnboundedReceiver<XidEvent>,
    quiet: Duration,
    cancel: CancellationToken,
) -> mpsc::UnboundedReceiver<HealthChange> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut tracker = XidTracker::new(quiet);
        let mut timer = tokio::time::interval(tracker.tick());
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                ev = events.recv() => {
                    let Some(ev) = ev else { return };
                    tracing::warn!(gpu = ev.gpu, xid = ev.xid, quiet_s = quiet.as_secs_f64(), "GPU unhealthy after a critical Xid");
                    tracker.critical(ev.gpu, Instant::now());
                    let _ = tx.send(HealthChange::Unhealthy { gpu: ev.gpu, xid: ev.xid });
                }
                _ = timer.tick() => {
                    for gpu in tracker.recovered(Instant::now()) {
                        tracing::info!(gpu, "no critical Xid for the quiet period; GPU healthy again");
                        let _ = tx.send(HealthChange::Healthy { gpu });
                    }
                }
            }
        }
    });
    rx
}

/// The node's GPU health: NVML's critical Xids on the GPUs `uuids` (in
/// index order), less `ignored`, through an [`XidTracker`] of `quiet`.
pub fn watch(
    nvml: Arc<nvml_wrapper::Nvml>,
    uuids: Vec<String>,
    ignored: Vec<u64>,
    quiet: Duration,
    cancel: &CancellationToken,
) -> mpsc::UnboundedReceiver<HealthChange> {
    let (xtx, xrx) = mpsc::unbounded_channel();
    crate::nvml::watch_xids(nvml, uuids, ignored, xtx, cancel.clone());
    spawn_tracker(xrx, quiet, cancel.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_period_restarts_with_each_xid() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut t = XidTracker::new(Duration::from_secs(10));
        t.critical(1, t0);
        t.critical(0, t0 + 2 * s);
        assert!(t.is_unhealthy(0) && t.is_unhealthy(1) && !t.is_unhealthy(2));
        assert!(t.recovered(t0 + 9 * s).is_empty());
        // Another Xid on GPU 1 before its period ends starts it again.
        t.critical(1, t0 + 9 * s);
        assert_eq!(t.recovered(t0 + 12 * s), vec![0]);
        assert!(t.is_unhealthy(1) && !t.is_unhealthy(0));
        assert!(t.recovered(t0 + 18 * s).is_empty());
        assert_eq!(t.recovered(t0 + 19 * s), vec![1]);
        assert!(t.recovered(t0 + 100 * s).is_empty());
    }

    #[test]
    fn recovery_is_in_index_order_and_the_tick_is_bounded() {
        let t0 = Instant::now();
        let mut t = XidTracker::new(Duration::from_millis(1));
        for g in [3, 0, 2] {
            t.critical(g, t0);
        }
        assert_eq!(t.recovered(t0 + Duration::from_millis(1)), vec![0, 2, 3]);
        assert_eq!(t.tick(), Duration::from_millis(100));
        assert_eq!(
            XidTracker::new(Duration::from_secs(300)).tick(),
            Duration::from_secs(5)
        );
        assert_eq!(
            XidTracker::new(Duration::from_secs(2)).tick(),
            Duration::from_millis(500)
        );
    }

    #[tokio::test]
    async fn the_task_reports_each_xid_and_the_recovery() {
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let mut changes = spawn_tracker(rx, Duration::from_millis(200), cancel.clone());
        tx.send(XidEvent { gpu: 1, xid: 79 }).unwrap();
        assert_eq!(
            changes.recv().await,
            Some(HealthChange::Unhealthy { gpu: 1, xid: 79 })
        );
        assert_eq!(changes.recv().await, Some(HealthChange::Healthy { gpu: 1 }));
        drop(tx);
        assert_eq!(changes.recv().await, None);
    }
}
