//! The tonic `DevicePlugin` service that wraps a [`DevicePluginService`]:
//! validation first, then the plugin.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, device_plugin_server::DevicePlugin,
};

use crate::service::DevicePluginService;
use crate::validate;

pub(crate) struct GrpcPlugin {
    pub(crate) resource: String,
    pub(crate) plugin: Arc<dyn DevicePluginService>,
    /// Cancelled when this server generation stops: ends the `ListAndWatch`
    /// streams, which would otherwise keep a graceful shutdown waiting forever.
    pub(crate) stop: CancellationToken,
    /// Counts `ListAndWatch` streams the kubelet closed while we served:
    /// kubelet ≥ 1.26 disconnects the newest registration of a resource
    /// when an older one's stream ends (`plugin/v1beta1/server.go`,
    /// `runClient`), so the runtime registers again.
    pub(crate) closed_by_kubelet: tokio::sync::watch::Sender<u64>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for GrpcPlugin {
    async fn get_device_plugin_options(
        &self,
        _req: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.plugin.options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _req: Request<Empty>) -> Result<Response<DeviceStream>, Status> {
        let mut devices = self.plugin.devices();
        let stop = self.stop.clone();
        let resource = self.resource.clone();
        let closed_by_kubelet = self.closed_by_kubelet.clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            tracing::debug!(%resource, "ListAndWatch stream opened");
            let mut client_left = false;
            loop {
                // Current list first, then after every change.
                let list = ListAndWatchResponse {
                    devices: devices.borrow_and_update().clone(),
                };
                if tx.send(Ok(list)).await.is_err() {
                    client_left = true;
                    break;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { break },
                    () = stop.cancelled() => break,
                    () = tx.closed() => { client_left = true; break },
                }
            }
            if client_left && !stop.is_cancelled() {
                tracing::info!(%resource, "kubelet closed the ListAndWatch stream");
                closed_by_kubelet.send_modify(|n| *n += 1);
            } else {
                tracing::debug!(%resource, "ListAndWatch stream closed");
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let req = req.into_inner();
        validate::preferred(&req, &self.plugin.devices().borrow())
            .inspect_err(|e| self.rejected("GetPreferredAllocation", e))?;
        let n = req.container_requests.len();
        let resp = self.plugin.get_preferred_allocation(req).await?;
        self.check_answered(resp.container_responses.len(), n)?;
        Ok(Response::new(resp))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let req = req.into_inner();
        validate::allocate(&req, &self.plugin.devices().borrow())
            .inspect_err(|e| self.rejected("Allocate", e))?;
        let n = req.container_requests.len();
        let resp = self.plugin.allocate(req).await?;
        self.check_answered(resp.container_responses.len(), n)?;
        Ok(Response::new(resp))
    }

    async fn pre_start_container(
        &self,
        req: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let req = req.into_inner();
        validate::pre_start(&req, &self.plugin.devices().borrow())
            .inspect_err(|e| self.rejected("PreStartContainer", e))?;
        Ok(Response::new(self.plugin.pre_start_container(req).await?))
    }
}

impl GrpcPlugin {
    /// The plugin must answer each container request with one response.
    fn check_answered(&self, answered: usize, requests: usize) -> Result<(), Status> {
        if answered != requests {
            return Err(Status::internal(format!(
                "plugin {} answered {answered} container responses for {requests} requests",
                self.resource
            )));
        }
        Ok(())
    }

    fn rejected(&self, rpc: &str, e: &Status) {
        tracing::warn!(resource = %self.resource, rpc, reason = e.message(), "rejected invalid request");
    }
}
