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
use crate::publish::{Publisher, SliceApi};
use crate::slices::GpuDevice;

pub struct SliceController {
    pub api: Arc<dyn SliceApi>,
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
        match self
            .publisher
            .reconcile(self.api.as_ref(), &self.devices)
            .await
        {
            Ok(p) => tracing::debug!(?p, "ResourceSlice reconciled"),
            Err(e) => {
                tracing::warn!(error = %e, "publishing the ResourceSlice (retried at the next resync)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
    use tokio::sync::mpsc::unbounded_channel;

    use crate::driver::{ClaimSource, Config};
    use crate::kube_api::ApiError;

    /// The API server's slices in memory.
    #[derive(Default)]
    struct Slices(Mutex<Vec<ResourceSlice>>);

    #[async_trait::async_trait]
    impl SliceApi for Slices {
        async fn list(&self, _: &str) -> Result<Vec<ResourceSlice>, ApiError> {
            Ok(self.0.lock().unwrap().clone())
        }
        async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            self.0.lock().unwrap().push(s.clone());
            Ok(s.clone())
        }
        async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            *self.0.lock().unwrap() = vec![s.clone()];
            Ok(s.clone())
        }
        async fn delete(&self, _: &str) -> Result<(), ApiError> {
            self.0.lock().unwrap().clear();
            Ok(())
        }
        async fn ensure_class(&self, _: &DeviceClass) -> Result<(), ApiError> {
            Ok(())
        }
    }

    struct NoClaims;

    #[async_trait::async_trait]
    impl ClaimSource for NoClaims {
        async fn claim(&self, ns: &str, name: &str) -> Result<ResourceClaim, ApiError> {
            Err(ApiError::ReadClaim {
                namespace: ns.to_string(),
                name: name.to_string(),
                source: crate::kube_api::not_found("resourceclaims", name),
            })
        }
    }

    impl Slices {
        /// The published devices, once a slice exists.
        fn devices(&self) -> Option<usize> {
            let all = self.0.lock().unwrap();
            all.first()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        }

        async fn until(&self, want: Option<usize>) {
            let wait = async {
                while self.devices() != want {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(5), wait)
                .await
                .unwrap_or_else(|_| panic!("{:?} devices, not {want:?}", self.devices()));
        }
    }

    #[tokio::test]
    async fn health_and_the_slice_watch_republish() {
        let tmp = tempfile::tempdir().unwrap();
        let gpu = gpu_allocator::GpuInfo {
            index: 0,
            uuid: "GPU-a".into(),
            minor: 0,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        };
        let p = |d: &str| tmp.path().join(d);
        let cfg = Config {
            node: "n1".into(),
            vm_root: p("vm"),
            vdriver_dir: p("vdriver"),
            cdi_dir: p("cdi"),
            state_dir: p("state"),
            driver_version: (550, 54),
            extra_devices: vec![],
        };
        let driver = Arc::new(Driver::start(cfg, vec![gpu.clone()], Arc::new(NoClaims)).unwrap());
        let api = Arc::new(Slices::default());
        let healthy = Arc::new(Mutex::new(vec![true]));
        let (htx, hrx) = unbounded_channel();
        let (stx, srx) = unbounded_channel();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(
            SliceController {
                api: api.clone(),
                publisher: Publisher::new("n1", "550.54.15"),
                driver: driver.clone(),
                devices: vec![GpuDevice {
                    info: gpu,
                    model: "A100".into(),
                    healthy: true,
                    pcie_root: None,
                    nvlink_domain: None,
                }],
                healthy: healthy.clone(),
                xid_quiet_period: Duration::from_secs(300),
                resync_period: Duration::from_secs(3600),
            }
            .run(hrx, srx, cancel.clone()),
        );

        htx.send(HealthChange::Unhealthy { gpu: 0, xid: 79 })
            .unwrap();
        api.until(Some(0)).await;
        assert_eq!(*healthy.lock().unwrap(), [false]);
        let h = driver.health_watch().borrow().clone();
        assert!(
            !h[0].healthy && h[0].message.starts_with("critical Xid 79"),
            "{h:?}"
        );

        htx.send(HealthChange::Healthy { gpu: 0 }).unwrap();
        api.until(Some(1)).await;
        assert!(driver.health_watch().borrow()[0].healthy);

        // Deleted behind the driver's back: the watch's notice brings it back.
        api.0.lock().unwrap().clear();
        stx.send(()).unwrap();
        api.until(Some(1)).await;

        cancel.cancel();
        task.await.unwrap();
    }
}
