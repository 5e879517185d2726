//! The slice controller: keeps this node's ResourceSlice what the GPUs'
//! health says (kube-rs' shape: the slice watch and the health tracker are
//! its watchers, [`Publisher::reconcile`] its reconciler). It republishes
//! on a health change, when the slice is changed or deleted behind the
//! driver's back, and every resync period (which also prunes dead PIDs).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use node_agent::health::HealthChange;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::claim_events::ClaimEvents;
use crate::driver::Driver;
use crate::publish::{Publisher, SliceApi};
use crate::slices::{GpuDevice, UNHEALTHY_TAINT, Unhealthy};

/// GPUs whose static MIG devices differ from what was read before, with
/// what they are now (`None`: not in MIG mode); empty: the dynamic GPUs'
/// instances were read again and a claim's was found gone or back.
pub type MigChange = Vec<(usize, Option<Vec<node_agent::mig::MigDevice>>)>;

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
    /// Where the pods of a claim whose MIG device was destroyed are told
    /// (none in tests that do not look).
    pub events: Option<ClaimEvents>,
    /// The (claim UID, device) pairs already told, while they stay lost.
    pub told: BTreeSet<(String, String)>,
}

impl SliceController {
    /// Runs until `cancel`: `health` from the Xid tracker, `slice_changed`
    /// from the slice watch.
    pub async fn run(
        mut self,
        mut health: UnboundedReceiver<HealthChange>,
        mut slice_changed: UnboundedReceiver<()>,
        mut mig_changed: UnboundedReceiver<MigChange>,
        cancel: CancellationToken,
    ) {
        let start = tokio::time::Instant::now() + self.resync_period;
        let mut resync = tokio::time::interval_at(start, self.resync_period);
        // Instances destroyed while the driver was down.
        self.tell_lost();
        let driver = self.driver.clone();
        loop {
            let changed = tokio::select! {
                _ = cancel.cancelled() => return,
                Some(c) = health.recv() => self.apply(c),
                Some(m) = mig_changed.recv() => self.set_mig(m),
                () = driver.instance_xids_forgotten() => self.forget_destroyed(),
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

    /// GPUs' static MIG devices read again ([`MigChange`]): published from
    /// here on and planned on by the driver; whether the slice changes.
    pub fn set_mig(&mut self, change: MigChange) -> bool {
        if change.is_empty() {
            // The dynamic instances read again found one lost or back.
            self.tell_lost();
            return false;
        }
        let mut changed = false;
        for (gpu, now) in change {
            let Some(d) = self.devices.get_mut(gpu) else {
                continue;
            };
            if d.mig == now {
                continue;
            }
            let names = |m: &Option<Vec<node_agent::mig::MigDevice>>| {
                m.iter()
                    .flatten()
                    .map(|x| format!("{} {}", x.profile, x.uuid))
                    .collect::<Vec<_>>()
            };
            tracing::info!(gpu, before = ?names(&d.mig), now = ?names(&now), "MIG devices changed: republishing");
            d.mig = now.clone();
            self.driver.set_mig(gpu, now);
            changed = true;
        }
        if changed {
            self.tell_lost();
        }
        changed
    }

    /// Tells the pods of each claim whose static MIG device's instance is
    /// gone, once while it stays gone (the kubelet's health stream shows
    /// it meanwhile, [`crate::mig_health`]).
    fn tell_lost(&mut self) {
        let lost = self.driver.lost_mig_devices();
        let now: BTreeSet<(String, String)> = lost
            .iter()
            .map(|l| (l.claim_uid.clone(), l.device.clone()))
            .collect();
        for l in &lost {
            if self.told.contains(&(l.claim_uid.clone(), l.device.clone())) {
                continue;
            }
            let note = l.describe();
            tracing::warn!(claim = %format!("{}/{}", l.namespace, l.name), device = %l.device, uuid = %l.uuid, "{note}");
            if let Some(e) = &self.events {
                let reason = node_agent::events::MIG_DEVICE_LOST;
                e.post(l.namespace.clone(), l.name.clone(), reason, note);
            }
        }
        self.told = now;
    }

    /// A health change into the driver (the kubelet's health stream) and
    /// the devices; whether the slice is to be republished.
    pub fn apply(&mut self, change: HealthChange) -> bool {
        match change {
            HealthChange::Unhealthy {
                gpu,
                gpu_instance: Some(gi),
                xid,
            } => self.instance_health(gpu, gi, Some(xid)),
            HealthChange::Healthy {
                gpu,
                gpu_instance: Some(gi),
            } => self.instance_health(gpu, gi, None),
            HealthChange::Unhealthy { gpu, xid, .. } => {
                let shown = match self.publisher.unhealthy() {
                    Unhealthy::Taint(effect) => {
                        format!("tainted {UNHEALTHY_TAINT}=xid-{xid}:{effect} in the ResourceSlice")
                    }
                    Unhealthy::LeftOut => "out of the ResourceSlice".to_string(),
                };
                self.driver.set_healthy(
                    gpu,
                    false,
                    &format!(
                        "critical Xid {xid}: {shown} until {} s pass without another",
                        self.xid_quiet_period.as_secs()
                    ),
                );
                match self.devices.get_mut(gpu) {
                    Some(d) if d.xid != Some(xid) => {
                        tracing::warn!(gpu, xid, "GPU unhealthy after a critical Xid: {shown}");
                        d.xid = Some(xid);
                        true
                    }
                    _ => false,
                }
            }
            HealthChange::Healthy { gpu, .. } => {
                self.driver.set_healthy(gpu, true, "");
                let Some(d) = self.devices.get_mut(gpu) else {
                    return false;
                };
                tracing::info!(
                    gpu,
                    "no critical Xid for the quiet period: GPU healthy in the ResourceSlice"
                );
                d.xid = None;
                true
            }
        }
    }

    /// A critical Xid inside GPU instance `gi` of `gpu` (`Some`), or its
    /// quiet period over (`None`): that instance's MIG devices alone are
    /// tainted or left out; the GPU, its other instances and the driver's
    /// health of the GPU are untouched. Whether the slice changes.
    fn instance_health(&mut self, gpu: usize, gi: u32, xid: Option<u64>) -> bool {
        let Some(d) = self.devices.get_mut(gpu) else {
            return false;
        };
        let was = match xid {
            Some(x) => d.instance_xids.insert(gi, x),
            None => d.instance_xids.remove(&gi),
        };
        self.driver.set_instance_xid(gpu, gi, xid);
        match xid {
            Some(x) if was != Some(x) => {
                tracing::warn!(
                    gpu,
                    gpu_instance = gi,
                    xid = x,
                    "MIG GPU instance unhealthy after a critical Xid: its devices are out of service in the ResourceSlice"
                )
            }
            None if was.is_some() => tracing::info!(
                gpu,
                gpu_instance = gi,
                "no critical Xid for the quiet period: MIG GPU instance healthy in the ResourceSlice"
            ),
            _ => return false,
        }
        true
    }

    /// The driver destroyed instances with an Xid (their claims went):
    /// their IDs' Xids are dropped here too, and the slice republished
    /// without their placements' taints.
    fn forget_destroyed(&mut self) -> bool {
        for (gpu, d) in self.devices.iter_mut().enumerate() {
            d.instance_xids
                .retain(|&gi, _| self.driver.instance_xid(gpu, gi).is_some());
        }
        true
    }

    /// The devices, each dynamic GPU's instance Xids given to the
    /// placement devices of the prepared claims whose instance they name.
    fn with_placement_xids(&self) -> std::borrow::Cow<'_, [GpuDevice]> {
        if self.devices.iter().all(|d| d.instance_xids.is_empty()) {
            return std::borrow::Cow::Borrowed(&self.devices);
        }
        let mut devices = self.devices.clone();
        for c in self.driver.prepared() {
            for p in &c.devices {
                let (Some(m), Some(d)) = (&p.mig, devices.get_mut(p.gpu_index)) else {
                    continue;
                };
                if m.placement.is_none() {
                    continue;
                }
                if let Some(&xid) = d.instance_xids.get(&m.gpu_instance) {
                    d.placement_xids.insert(p.device.clone(), xid);
                }
            }
        }
        std::borrow::Cow::Owned(devices)
    }

    async fn publish(&self) {
        *self.healthy.lock().unwrap_or_else(PoisonError::into_inner) =
            self.devices.iter().map(GpuDevice::healthy).collect();
        let devices = self.with_placement_xids();
        match self.publisher.reconcile(self.api.as_ref(), &devices).await {
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

    /// The API server's slices in memory; `.1`: drops device taints on
    /// write, as one without the feature does.
    #[derive(Default)]
    struct Slices(Mutex<Vec<ResourceSlice>>, bool);

    impl Slices {
        fn stored(&self, s: &ResourceSlice) -> ResourceSlice {
            let mut s = s.clone();
            if self.1 {
                for d in s.spec.devices.iter_mut().flatten() {
                    d.taints = None;
                }
            }
            s
        }
    }

    #[async_trait::async_trait]
    impl SliceApi for Slices {
        async fn list(&self, _: &str) -> Result<Vec<ResourceSlice>, ApiError> {
            Ok(self.0.lock().unwrap().clone())
        }
        async fn create(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            let s = self.stored(s);
            self.0.lock().unwrap().push(s.clone());
            Ok(s)
        }
        async fn replace(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            let s = self.stored(s);
            *self.0.lock().unwrap() = vec![s.clone()];
            Ok(s)
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
        /// The published devices and those tainted, once a slice exists.
        fn devices(&self) -> Option<(usize, usize)> {
            let all = self.0.lock().unwrap();
            all.first().map(|s| {
                let d = s.spec.devices.as_deref().unwrap_or_default();
                (d.len(), d.iter().filter(|d| d.taints.is_some()).count())
            })
        }

        async fn until(&self, want: Option<(usize, usize)>) {
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
    async fn an_xid_taints_the_device_and_the_slice_watch_republishes() {
        xid_round_trip(false).await;
    }

    #[tokio::test]
    async fn without_device_taints_an_xid_takes_the_device_out() {
        xid_round_trip(true).await;
    }

    /// An Xid and its quiet period's end through the controller, over an
    /// API server that keeps device taints or drops them.
    async fn xid_round_trip(drops_taints: bool) {
        let tmp = tempfile::tempdir().unwrap();
        let gpu = crate::fixtures::gpu(0, 0);
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
        let api = Arc::new(Slices(Mutex::default(), drops_taints));
        let healthy = Arc::new(Mutex::new(vec![true]));
        let (htx, hrx) = unbounded_channel();
        let (stx, srx) = unbounded_channel();
        let (_mtx, mrx) = unbounded_channel();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(
            SliceController {
                api: api.clone(),
                publisher: Publisher::new("n1", "550.54.15", Unhealthy::Taint("NoSchedule")),
                driver: driver.clone(),
                devices: vec![GpuDevice {
                    info: gpu,
                    model: "A100".into(),
                    xid: None,
                    mig: None,
                    pcie_root: None,
                    nvlink_domain: None,
                    instance_xids: Default::default(),
                    placement_xids: Default::default(),
                }],
                healthy: healthy.clone(),
                xid_quiet_period: Duration::from_secs(300),
                resync_period: Duration::from_secs(3600),
                events: None,
                told: Default::default(),
            }
            .run(hrx, srx, mrx, cancel.clone()),
        );

        htx.send(HealthChange::Unhealthy {
            gpu: 0,
            gpu_instance: None,
            xid: 79,
        })
        .unwrap();
        api.until(Some(if drops_taints { (0, 0) } else { (1, 1) }))
            .await;
        assert_eq!(*healthy.lock().unwrap(), [false]);
        let h = driver.health_watch().borrow().gpus.clone();
        assert!(
            !h[0].healthy && h[0].message.starts_with("critical Xid 79"),
            "{h:?}"
        );
        // Once the API server was seen dropping taints, the next Xid says
        // so at once.
        htx.send(HealthChange::Unhealthy {
            gpu: 0,
            gpu_instance: None,
            xid: 48,
        })
        .unwrap();
        let said = if drops_taints {
            "critical Xid 48: out of the ResourceSlice"
        } else {
            "critical Xid 48: tainted vcuda.tencent.com/unhealthy=xid-48:NoSchedule"
        };
        let wait = async {
            while !driver.health_watch().borrow().gpus[0]
                .message
                .starts_with(said)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .unwrap_or_else(|_| panic!("{:?}", driver.health_watch().borrow().gpus[0]));

        htx.send(HealthChange::Healthy {
            gpu: 0,
            gpu_instance: None,
        })
        .unwrap();
        api.until(Some((1, 0))).await;
        assert!(driver.health_watch().borrow().gpus[0].healthy);

        // Deleted behind the driver's back: the watch's notice brings it back.
        api.0.lock().unwrap().clear();
        stx.send(()).unwrap();
        api.until(Some((1, 0))).await;

        cancel.cancel();
        task.await.unwrap();
    }
}
