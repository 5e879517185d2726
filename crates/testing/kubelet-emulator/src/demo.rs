//! A small device plugin for tests, demos and wire-compatibility checks: it
//! records what kubelet asked and answers with a recognisable response.

use std::sync::Mutex;

use device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DevicePluginOptions, DeviceSpec, Mount,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use device_plugin::{DeviceList, DevicePluginService};
use tokio::sync::watch;
use tonic::Status;

/// Plugin whose devices are `<prefix>-0 .. <prefix>-<n-1>`.
pub struct DemoPlugin {
    pub devices: DeviceList,
    pub options: DevicePluginOptions,
    /// IDs this plugin prefers, best first; others follow in reverse ID order,
    /// so a kubelet that honours preferences is easy to tell apart.
    pub prefer: Vec<String>,
    /// Device IDs of every Allocate container request seen.
    pub allocated: Mutex<Vec<Vec<String>>>,
    /// Device IDs of every PreStartContainer call seen.
    pub prestarted: Mutex<Vec<Vec<String>>>,
}

impl DemoPlugin {
    pub fn new(prefix: &str, n: usize) -> Self {
        Self {
            devices: DeviceList::healthy((0..n).map(|i| format!("{prefix}-{i}"))),
            options: DevicePluginOptions {
                pre_start_required: true,
                get_preferred_allocation_available: true,
            },
            prefer: Vec::new(),
            allocated: Mutex::default(),
            prestarted: Mutex::default(),
        }
    }
}

#[tonic::async_trait]
impl DevicePluginService for DemoPlugin {
    fn options(&self) -> DevicePluginOptions {
        self.options
    }

    fn devices(&self) -> watch::Receiver<Vec<device_plugin::api::Device>> {
        self.devices.subscribe()
    }

    async fn get_preferred_allocation(
        &self,
        req: PreferredAllocationRequest,
    ) -> Result<PreferredAllocationResponse, Status> {
        let container_responses = req
            .container_requests
            .into_iter()
            .map(|c| {
                let mut rest: Vec<String> = c
                    .available_device_i_ds
                    .iter()
                    .filter(|d| !c.must_include_device_i_ds.contains(d))
                    .cloned()
                    .collect();
                rest.sort_by(|a, b| {
                    let rank = |x: &String| {
                        self.prefer
                            .iter()
                            .position(|p| p == x)
                            .unwrap_or(usize::MAX)
                    };
                    rank(a).cmp(&rank(b)).then_with(|| b.cmp(a))
                });
                let ids = c
                    .must_include_device_i_ds
                    .into_iter()
                    .chain(rest)
                    .take(c.allocation_size as usize)
                    .collect();
                ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        Ok(PreferredAllocationResponse {
            container_responses,
        })
    }

    async fn allocate(&self, req: AllocateRequest) -> Result<AllocateResponse, Status> {
        let mut out = Vec::new();
        for c in req.container_requests {
            self.allocated.lock().unwrap().push(c.devices_ids.clone());
            let joined = c.devices_ids.join(",");
            out.push(ContainerAllocateResponse {
                envs: [("DEMO_DEVICES".to_string(), joined.clone())].into(),
                mounts: vec![Mount {
                    container_path: "/etc/demo".into(),
                    host_path: "/tmp/demo".into(),
                    read_only: true,
                }],
                devices: vec![DeviceSpec {
                    container_path: "/dev/null".into(),
                    host_path: "/dev/null".into(),
                    permissions: "rwm".into(),
                }],
                annotations: [("demo/devices".to_string(), joined)].into(),
                cdi_devices: vec![],
            });
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        req: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        self.prestarted.lock().unwrap().push(req.devices_ids);
        Ok(PreStartContainerResponse {})
    }
}
