//! GPU health from critical Xids, the same in both modes: a critical Xid
//! takes a GPU out at once; after the quiet period without another it is
//! healthy again. An Xid NVML reports inside a MIG GPU instance takes
//! that instance out, not its GPU (a [`Unit`] of its own). [`XidTracker`] is that rule (pure, clock passed in);
//! [`spawn_tracker`] runs it over the NVML watcher's events
//! ([`crate::nvml::watch_xids`]) and reports each change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::nvml::XidEvent;

/// What a critical Xid takes out: a GPU, or one MIG GPU instance on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unit {
    pub gpu: usize,
    pub gpu_instance: Option<u32>,
}

/// The quiet-period rule over the last critical Xid of each unit (GPU
/// indices, or [`Unit`]s).
#[derive(Debug, Clone)]
pub struct XidTracker<K = usize> {
    quiet: Duration,
    last: BTreeMap<K, Instant>,
}

impl<K: Ord + Copy> XidTracker<K> {
    pub fn new(quiet: Duration) -> XidTracker<K> {
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
    pub fn critical(&mut self, gpu: K, at: Instant) {
        self.last.insert(gpu, at);
    }

    pub fn is_unhealthy(&self, gpu: K) -> bool {
        self.last.contains_key(&gpu)
    }

    /// The units whose quiet period has passed at `now`, in order; they
    /// are healthy again (forgotten).
    pub fn recovered(&mut self, now: Instant) -> Vec<K> {
        let quiet = self.quiet;
        let done: Vec<K> = self
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

/// A GPU's (or a MIG GPU instance's) health changed, or another critical
/// Xid arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// Every critical Xid, also on a GPU already unhealthy (the quiet
    /// period restarts). `gpu_instance`: the MIG GPU instance NVML named,
    /// which alone is out.
    Unhealthy {
        gpu: usize,
        gpu_instance: Option<u32>,
        xid: u64,
    },
    Healthy {
        gpu: usize,
        gpu_instance: Option<u32>,
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
        let mut tracker = XidTracker::<Unit>::new(quiet);
        let mut timer = tokio::time::interval(tracker.tick());
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                ev = events.recv() => {
                    let Some(ev) = ev else { return };
                    let (gpu, gpu_instance) = (ev.gpu, ev.gpu_instance);
                    match gpu_instance {
                        None => tracing::warn!(gpu, xid = ev.xid, quiet_s = quiet.as_secs_f64(), "GPU unhealthy after a critical Xid"),
                        Some(gi) => tracing::warn!(gpu, gpu_instance = gi, xid = ev.xid, quiet_s = quiet.as_secs_f64(), "MIG GPU instance unhealthy after a critical Xid in it"),
                    }
                    tracker.critical(Unit { gpu, gpu_instance }, Instant::now());
                    let _ = tx.send(HealthChange::Unhealthy { gpu, gpu_instance, xid: ev.xid });
                }
                _ = timer.tick() => {
                    for Unit { gpu, gpu_instance } in tracker.recovered(Instant::now()) {
                        tracing::info!(gpu, gpu_instance, "no critical Xid for the quiet period; healthy again");
                        let _ = tx.send(HealthChange::Healthy { gpu, gpu_instance });
                    }
                }
            }
        }
    });
    rx
}

/// What a critical Xid inside a MIG GPU instance takes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceXids {
    /// That instance alone (its GPU's other instances go on).
    Instance,
    /// Its whole GPU, as any other Xid.
    Gpu,
}

/// The node's GPU health: NVML's critical Xids on the GPUs `uuids` (in
/// index order), less `ignored`, through an [`XidTracker`] of `quiet`.
pub fn watch(
    nvml: Arc<nvml_wrapper::Nvml>,
    uuids: Vec<String>,
    ignored: Vec<u64>,
    quiet: Duration,
    in_instance: InstanceXids,
    cancel: &CancellationToken,
) -> mpsc::UnboundedReceiver<HealthChange> {
    let (xtx, mut xrx) = mpsc::unbounded_channel::<XidEvent>();
    crate::nvml::watch_xids(nvml, uuids, ignored, xtx, cancel.clone());
    if in_instance == InstanceXids::Instance {
        return spawn_tracker(xrx, quiet, cancel.clone());
    }
    let (gtx, grx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(ev) = xrx.recv().await {
            let whole = XidEvent {
                gpu_instance: None,
                ..ev
            };
            if gtx.send(whole).is_err() {
                return;
            }
        }
    });
    spawn_tracker(grx, quiet, cancel.clone())
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
            XidTracker::<usize>::new(Duration::from_secs(300)).tick(),
            Duration::from_secs(5)
        );
        assert_eq!(
            XidTracker::<usize>::new(Duration::from_secs(2)).tick(),
            Duration::from_millis(500)
        );
    }

    #[tokio::test]
    async fn the_task_reports_each_xid_and_the_recovery() {
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let mut changes = spawn_tracker(rx, Duration::from_millis(200), cancel.clone());
        let whole = |gpu| XidEvent {
            gpu,
            gpu_instance: None,
            xid: 79,
        };
        tx.send(whole(1)).unwrap();
        assert_eq!(
            changes.recv().await,
            Some(HealthChange::Unhealthy {
                gpu: 1,
                gpu_instance: None,
                xid: 79
            })
        );
        assert_eq!(
            changes.recv().await,
            Some(HealthChange::Healthy {
                gpu: 1,
                gpu_instance: None
            })
        );
        // In a MIG GPU instance: that instance, apart from its GPU.
        tx.send(XidEvent {
            gpu: 0,
            gpu_instance: Some(2),
            xid: 94,
        })
        .unwrap();
        let change = changes.recv().await;
        assert_eq!(
            change,
            Some(HealthChange::Unhealthy {
                gpu: 0,
                gpu_instance: Some(2),
                xid: 94
            })
        );
        assert_eq!(
            changes.recv().await,
            Some(HealthChange::Healthy {
                gpu: 0,
                gpu_instance: Some(2)
            })
        );
        drop(tx);
        assert_eq!(changes.recv().await, None);
    }
}
