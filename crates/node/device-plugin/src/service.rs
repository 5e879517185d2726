//! The trait a device plugin implements, and a small helper that holds its
//! device list.

use tokio::sync::watch;
use tonic::Status;
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, HEALTHY,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, UNHEALTHY,
};

/// What a device plugin provides. The runtime ([`crate::PluginRuntime`])
/// serves it over gRPC, validates every request against [`Self::devices`]
/// before calling in, and re-registers it with kubelet whenever needed, so an
/// implementation contains only the resource's own logic.
#[tonic::async_trait]
pub trait DevicePluginService: Send + Sync + 'static {
    /// Options sent with `Register` and answered to `GetDevicePluginOptions`.
    fn options(&self) -> DevicePluginOptions;

    /// The current device list and its future changes. Every open
    /// `ListAndWatch` stream sends the value at once and again after each
    /// change, so a plugin only has to update the channel (see [`DeviceList`]).
    fn devices(&self) -> watch::Receiver<Vec<Device>>;

    /// `GetPreferredAllocation`, called only when [`Self::options`] says it is
    /// available. The request is already validated (known IDs, sane sizes).
    async fn get_preferred_allocation(
        &self,
        _request: PreferredAllocationRequest,
    ) -> Result<PreferredAllocationResponse, Status> {
        Err(Status::unimplemented(
            "GetPreferredAllocation is not offered by this plugin",
        ))
    }

    /// `Allocate`. The request is validated: at least one container, each with
    /// known, distinct device IDs. The response must hold one
    /// `ContainerAllocateResponse` per container request, in order.
    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status>;

    /// `PreStartContainer`, called by kubelet before each container start
    /// when [`DevicePluginOptions::pre_start_required`] is set.
    async fn pre_start_container(
        &self,
        _request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        Ok(PreStartContainerResponse {})
    }
}

/// A device list a plugin can share with the runtime: cheap to clone, every
/// change is pushed to all `ListAndWatch` streams.
#[derive(Clone, Debug)]
pub struct DeviceList {
    tx: watch::Sender<Vec<Device>>,
}

impl DeviceList {
    pub fn new(devices: Vec<Device>) -> Self {
        Self {
            tx: watch::Sender::new(devices),
        }
    }

    /// Healthy devices with the given IDs and no topology.
    pub fn healthy<I: IntoIterator<Item = S>, S: Into<String>>(ids: I) -> Self {
        Self::new(ids.into_iter().map(|id| device(id, true, None)).collect())
    }

    /// Receiver for [`DevicePluginService::devices`].
    pub fn subscribe(&self) -> watch::Receiver<Vec<Device>> {
        self.tx.subscribe()
    }

    /// Receivers of the list now: each ListAndWatch stream the kubelet
    /// holds open is one.
    pub fn watchers(&self) -> usize {
        self.tx.receiver_count()
    }

    pub fn snapshot(&self) -> Vec<Device> {
        self.tx.borrow().clone()
    }

    /// Replaces the whole list (count change, new GPU, ...). Streams are
    /// notified only when it differs: a periodic rescan that finds the same
    /// devices sends the kubelet nothing.
    pub fn replace(&self, devices: Vec<Device>) {
        self.tx.send_if_modified(|cur| {
            let changed = *cur != devices;
            if changed {
                *cur = devices;
            }
            changed
        });
    }

    /// Sets the health of the devices whose ID satisfies `pred`; returns how
    /// many changed. Streams are notified only when something changed.
    pub fn set_health_where(&self, healthy: bool, pred: impl Fn(&str) -> bool) -> usize {
        let want = if healthy { HEALTHY } else { UNHEALTHY };
        let mut changed = 0;
        self.tx.send_if_modified(|devs| {
            for d in devs.iter_mut().filter(|d| pred(&d.id)) {
                if d.health != want {
                    d.health = want.to_string();
                    changed += 1;
                }
            }
            changed > 0
        });
        changed
    }

    /// Sets the health of one device; false if unknown or unchanged.
    pub fn set_health(&self, id: &str, healthy: bool) -> bool {
        self.set_health_where(healthy, |d| d == id) > 0
    }
}

/// Builds a `Device`; `numa_node` becomes its topology when given.
pub fn device(id: impl Into<String>, healthy: bool, numa_node: Option<i64>) -> Device {
    use vcuda_api::deviceplugin::v1beta1::{NumaNode, TopologyInfo};
    Device {
        id: id.into(),
        health: if healthy { HEALTHY } else { UNHEALTHY }.to_string(),
        topology: numa_node.map(|n| TopologyInfo {
            nodes: vec![NumaNode { id: n }],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_change_notifies_only_when_changed() {
        let list = DeviceList::healthy(["a", "b"]);
        let mut rx = list.subscribe();
        rx.mark_unchanged();
        assert!(!list.set_health("a", true), "already healthy");
        assert!(!rx.has_changed().unwrap());
        assert!(list.set_health("a", false));
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update()[0].health, UNHEALTHY);
        assert!(!list.set_health("zzz", false), "unknown id");
        assert_eq!(list.set_health_where(false, |_| true), 1);
    }
}
