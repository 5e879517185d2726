//! The slice controller: keeps this node's ResourceSlice what the GPUs'
//! health says (kube-rs' shape: the slice watch and the health tracker are
//! its watchers, [`Publisher::reconcile`] its reconciler). It republishes
//! on a health change, when the slice is changed or deleted behind the
//! driver's back, and every resync period (which also prunes dead PIDs).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use node_agent::health::HealthChange;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::driver::Driver;
use crate::kube_api::KubeApi;
use crate::publish::Publisher;
use crate::slices::GpuDevice;

pub struct SliceController {
    pub api: KubeApi,
    pub publisher: Publisher,
    pub driver: Arc<Driver>,
    /// The node's GPUs as published.
    pub devices: Vec<GpuDevice>,
    /// The display's copy of which GPUs are published.
    pub healthy: Arc<Mutex<Vec<bool>>>,
    pub xid_quiet_period: Duration,
    pub resync_period: Duration,
}

impl SliceController {
    /// Runs until `cancel`: `health` from the Xid tracker, `slice_changed`
    /// from the slice watch.
    pub async fn run(
        mut self,
        mut health: UnboundedReceiver<HealthChange>,
        mut slice_changed: UnboundedReceiver<()>,
        cancel: CancellationToken,
    ) {
        let start = tokio::time::Instant::now() + self.resync_period;
        let mut resync = tokio::time::interval_at(start, self.resync_period);
        loop {
            let changed = tokio::select! {
                _ = cancel.cancelled() => return,
                Some(c) = health.recv() => self.apply(c),
                Some(()) = slice_changed.recv() => {
                    while slice_changed.try_recv().is_ok() {}
                    true
                }
                _ = resync.tick() => {
                    // A backstop: closed connections release PIDs already.
                    let pruned = self.driver.registry().prune();
                    if pruned > 0 {
                        tracing::info!(pruned, "dead PIDs removed from pids.config");
                    }
                    true
                }
            };
            if changed {
                self.publish().await;
            }
        }
    }

    /// A health change into the driver (the kubelet's health stream) and
    /// the devices; whether the slice is to be republished.
    pub fn apply(&mut self, change: HealthChange) -> bool {
        match change {
            HealthChange::Unhealthy { gpu, xid } => {
                self.driver.set_healthy(
                    gpu,
                    false,
                    &format!(
                        "critical Xid {xid}: out of the ResourceSlice until {} s pass without another",
                        self.xid_quiet_period.as_secs()
                    ),
                );
                match self.devices.get_mut(gpu) {
                    Some(d) if d.healthy => {
                        tracing::warn!(
                            gpu,
                            xid,
                            "GPU unhealthy after a critical Xid: taken out of the ResourceSlice"
                        );
                        d.healthy = false;
                        true
                    }
                    _ => false,
                }
            }
            HealthChange::Healthy { gpu } => {
                self.driver.set_healthy(gpu, true, "");
                let Some(d) = self.devices.get_mut(gpu) else {
                    return false;
                };
                tracing::info!(
                    gpu,
                    "no critical Xid for the quiet period: GPU back in the ResourceSlice"
                );
                d.healthy = true;
                true
            }
        }
    }

    async fn publish(&self) {
        *self.healthy.lock().unwrap_or_else(PoisonError::into_inner) =
            self.devices.iter().map(|d| d.healthy).collect();
        match self.publisher.reconcile(&self.api, &self.devices).await {
            Ok(p) => tracing::debug!(?p, "ResourceSlice reconciled"),
            Err(e) => {
                tracing::warn!(error = %e, "publishing the ResourceSlice (retried at the next resync)")
            }
        }
    }
}
