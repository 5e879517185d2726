//! The two device plugins kubelet talks to; both delegate to [`Manager`].

use std::sync::Arc;
use std::time::Instant;

use device_plugin::DevicePluginService;
use device_plugin::api::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, PreStartContainerRequest,
    PreStartContainerResponse,
};
use gpu_display::ManagerMetrics;
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::manager::Manager;

fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: false,
    }
}

/// PreStartContainer for either resource: the manager's check, logged when refused.
async fn pre_start(
    manager: &Manager,
    resource: &str,
    request: PreStartContainerRequest,
) -> Result<PreStartContainerResponse, Status> {
    manager
        .pre_start(resource, &request.devices_ids)
        .await
        .inspect_err(|e| tracing::warn!(error = %e.message(), "PreStartContainer refused"))?;
    Ok(PreStartContainerResponse {})
}

/// The `reason` label of a refused Allocate: a fixed word per gRPC code.
pub fn failure_reason(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid_argument",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Unavailable => "unavailable",
        Code::Internal => "internal",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Cancelled => "cancelled",
        _ => "other",
    }
}

/// The vcuda-core plugin; the metrics count its Allocate outcomes.
pub struct VcorePlugin(pub Arc<Manager>, pub ManagerMetrics);
/// The vcuda-memory plugin.
pub struct VmemoryPlugin(pub Arc<Manager>, pub ManagerMetrics);

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
            let t = Instant::now();
            let r = self.0.allocate_vcore(c.devices_ids).await;
            match &r {
                Ok(_) => self.1.allocation_succeeded(VCORE_RESOURCE),
                Err(e) => {
                    tracing::warn!(code = ?e.code(), error = %e.message(), "vcuda-core Allocate refused");
                    self.1
                        .allocation_failed(VCORE_RESOURCE, failure_reason(e.code()));
                }
            }
            self.1.observe_allocate(t.elapsed());
            out.push(r?);
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0, VCORE_RESOURCE, request).await
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
        let mut out = Vec::with_capacity(request.container_requests.len());
        for c in request.container_requests {
            let t = Instant::now();
            out.push(self.0.allocate_vmemory(c.devices_ids));
            self.1.allocation_succeeded(VMEMORY_RESOURCE);
            self.1.observe_allocate(t.elapsed());
        }
        Ok(AllocateResponse {
            container_responses: out,
        })
    }

    async fn pre_start_container(
        &self,
        request: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        pre_start(&self.0, VMEMORY_RESOURCE, request).await
    }
}
