//! MIG devices whose instance an operator destroyed while the manager ran.
//! The kubelet keeps a pod's MIG device for the pod's life and would say
//! nothing if the device just left the list: the pod's CUDA would fail with
//! no word why. So a lost device stays listed, Unhealthy (kubelets with
//! `ResourceHealthStatus` show it in the pod's status; none allocates it),
//! each pod the kubelet's pod-resources `List` names as holding it gets a
//! `VcudaMigDeviceLost` Event once, and it leaves the list once no pod
//! holds it. A device whose instance comes back (same UUID) is served again.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use node_agent::events::{EventSink, MIG_DEVICE_LOST, PodEvent};

use super::{MigPlugins, locked};
use crate::world::{Held, KubeletSource, PodKey};

/// A lost device: its resource, UUID and GPU index.
type Lost = (String, String, usize);

impl MigPlugins {
    /// The lost devices of every plugin.
    fn lost(&self) -> Vec<Lost> {
        let plugins = locked(&self.plugins);
        let mut out = Vec::new();
        for p in plugins.values() {
            for s in locked(&p.served).iter().filter(|s| s.lost) {
                out.push((p.resource.clone(), s.device.uuid.clone(), s.parent.index));
            }
        }
        out
    }

    /// The lost devices for the display's `vcuda_mig_device_lost` (the
    /// holder: the resource).
    pub fn lost_views(&self) -> Vec<gpu_display::LostMigView> {
        let lost = self.lost().into_iter();
        lost.map(|(resource, uuid, gpu)| gpu_display::LostMigView {
            gpu: gpu as u32,
            uuid,
            holder: resource,
        })
        .collect()
    }

    /// Whether any device is lost (a rescan then settles them).
    pub fn has_lost(&self) -> bool {
        !self.lost().is_empty()
    }

    /// Takes lost device `uuid` of `resource` out of its list.
    fn withdraw(&self, resource: &str, uuid: &str) {
        let Some(p) = locked(&self.plugins).get(resource).cloned() else {
            return;
        };
        let out = locked(&self.out).clone();
        let kept: Vec<_> = locked(&p.served)
            .iter()
            .filter(|s| !(s.lost && s.device.uuid == uuid))
            .cloned()
            .collect();
        p.set_served(kept, &out);
        locked(&self.told).remove(uuid);
        self.store();
    }

    /// Takes devices whose instances vcuda destroyed itself (dynamic MIG:
    /// no pod held them) out of their lists: they are not lost.
    pub fn forget(&self, uuids: &[String]) {
        let out = locked(&self.out).clone();
        for p in locked(&self.plugins).values() {
            let served = locked(&p.served).clone();
            let gone = |s: &super::Served| s.lost && uuids.contains(&s.device.uuid);
            if served.iter().any(gone) {
                p.set_served(served.into_iter().filter(|s| !gone(s)).collect(), &out);
            }
        }
        self.store();
    }

    /// At start, before serving: [`Self::settle_lost`] for the devices the
    /// record says were destroyed while no manager ran, then drops the
    /// plugins made for those alone that no pod holds (an instance vcuda
    /// destroyed itself at start, say): before serving, only those can be
    /// empty (a profile found gets a plugin with its devices). A `List`
    /// that fails or does not answer in 5 s leaves them listed, Unhealthy,
    /// for the rescans.
    pub async fn settle_recorded(
        &self,
        kubelet: &dyn KubeletSource,
        pods: &[Arc<Pod>],
        events: &dyn EventSink,
    ) {
        if !self.has_lost() {
            return;
        }
        let settle = self.settle_lost(kubelet, pods, events);
        if tokio::time::timeout(std::time::Duration::from_secs(5), settle)
            .await
            .is_err()
        {
            tracing::warn!(
                "the kubelet's List did not answer in 5 s: lost MIG devices stay listed Unhealthy until a rescan settles them"
            );
            return;
        }
        locked(&self.plugins).retain(|_, p| !p.is_empty());
    }

    /// Tells the pods holding lost devices (once each) and withdraws the
    /// devices no pod holds, as the kubelet's `List` says now; `pods` (the
    /// node's, from the API server) give the Events' pod names and UIDs.
    /// On a `List` failure nothing changes until the next rescan.
    pub async fn settle_lost(
        &self,
        kubelet: &dyn KubeletSource,
        pods: &[Arc<Pod>],
        events: &dyn EventSink,
    ) {
        let lost = self.lost();
        if lost.is_empty() {
            return;
        }
        let resources: Vec<&str> = lost.iter().map(|(r, _, _)| r.as_str()).collect();
        let held = match kubelet.held(&resources).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "which pods hold the lost MIG devices: kept listed Unhealthy until the next rescan");
                return;
            }
        };
        for (resource, uuid, gpu) in &lost {
            let holders: Vec<&Held> = held
                .iter()
                .filter(|h| h.ids.get(resource).is_some_and(|ids| ids.contains(uuid)))
                .collect();
            if holders.is_empty() {
                tracing::info!(%resource, %uuid, "lost MIG device held by no pod: withdrawn");
                self.withdraw(resource, uuid);
                continue;
            }
            if !locked(&self.told).insert(uuid.clone()) {
                continue;
            }
            for h in holders {
                let (namespace, name, uid) = pod_ref(&h.pod, pods);
                let note = format!(
                    "MIG device {uuid} ({resource} on GPU {gpu}) was destroyed while this pod held it: \
                     CUDA on it fails; delete the pod for a new device"
                );
                tracing::warn!(pod = %format!("{namespace}/{name}"), container = %h.container, "{note}");
                events.post(PodEvent {
                    namespace,
                    name,
                    uid,
                    reason: MIG_DEVICE_LOST,
                    note,
                });
            }
        }
    }
}

/// (namespace, name, UID) of the pod `key` names, from `pods` where it is
/// there (the kubelet names pods by name, its checkpoint by UID).
fn pod_ref(key: &PodKey, pods: &[Arc<Pod>]) -> (String, String, String) {
    let found = pods.iter().find(|p| match key {
        PodKey::Name { namespace, name } => {
            gpu_pods::namespace(p) == namespace && gpu_pods::name(p) == name
        }
        PodKey::Uid(u) => gpu_pods::uid(p) == u,
    });
    match (found, key) {
        (Some(p), _) => (
            gpu_pods::namespace(p).to_string(),
            gpu_pods::name(p).to_string(),
            gpu_pods::uid(p).to_string(),
        ),
        (None, PodKey::Name { namespace, name }) => {
            (namespace.clone(), name.clone(), String::new())
        }
        (None, PodKey::Uid(u)) => (String::new(), String::new(), u.clone()),
    }
}
