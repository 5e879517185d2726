//! The two device plugins kubelet talks to; both delegate to [`Manager`].

use std::sync::Arc;

use device_plugin::DevicePluginService;
use device_plugin::api::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, PreStartContainerRequest,
    PreStartContainerResponse,
};
use tokio::sync::watch;
use tonic::Status;

use crate::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::manager::Manager;

fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: false,
    }
}

pub struct VcorePlugin(pub Arc<Manager>);
pub struct VmemoryPlugin(pub Arc<Manager>);

#[tonic::async_trait]
impl DevicePluginService for VcorePlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.vcore.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let mut out = Vec::with_capacity(request.container_requests.len());
        for c in request.container_requests {
            out.push(self.0.allocate_vcore(c.devices_ids).await.inspect_err(|e| {
                tracing::warn!(code = ?e.code(), error = %e.message(), "vcuda-core Allocate refused");
            })?);
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        self.0
            .pre_start(VCORE_RESOURCE, &request.devices_ids)
            .await
            .inspect_err(|e| tracing::warn!(error = %e.message(), "PreStartContainer refused"))?;
        Ok(PreStartContainerResponse {})
    }
}

#[tonic::async_trait]
impl DevicePluginService for VmemoryPlugin {
    fn options(&self) -> DevicePluginOptions {
        options()
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.0.vmemory.subscribe()
    }

    async fn allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        Ok(AllocateResponse {
            container_responses: request
                .container_requests
                .into_iter()
                .map(|c| self.0.allocate_vmemory(c.devices_ids))
                .collect(),
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        self.0
            .pre_start(VMEMORY_RESOURCE, &request.devices_ids)
            .await
            .inspect_err(|e| tracing::warn!(error = %e.message(), "PreStartContainer refused"))?;
        Ok(PreStartContainerResponse {})
    }
}
