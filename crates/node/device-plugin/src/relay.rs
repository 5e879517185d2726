//! Device plugins answered by a supervisor's child ([`child_relay`]): the
//! supervisor serves the kubelet's sockets with a [`RelayedPlugin`] (what
//! [`crate::PluginRuntime`] registers and keeps registered), and its child
//! serves the plugin itself on the connections passed to it
//! ([`serve_inbox`]). The kubelet's `ListAndWatch` stream is the
//! supervisor's: it keeps the last list while no child runs and goes on
//! with the next child's, so the kubelet never sees it end (it would mark
//! the resource unhealthy and refuse the pods it admits meanwhile).

use std::os::unix::net::UnixStream as StdStream;
use std::sync::Arc;

use child_relay::{Inboxes, RETRY};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::transport::Channel;
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, device_plugin_client::DevicePluginClient,
    device_plugin_server::DevicePluginServer,
};

use crate::grpc::GrpcPlugin;
use crate::service::DevicePluginService;

const WHO: &str = "manager process";

type Client = DevicePluginClient<Channel>;

/// The supervisor's plugin for one resource: options and device list from
/// the child, every call sent on to it.
pub struct RelayedPlugin {
    options: DevicePluginOptions,
    devices: watch::Sender<Vec<Device>>,
    channel: Channel,
}

impl RelayedPlugin {
    /// The plugin whose child serves `resource` on `inboxes`: waits for a
    /// child's options and first device list ([`child_relay::PATIENCE`] at
    /// most), then follows every child's list for the process's life.
    pub async fn start(resource: &str, inboxes: &Inboxes) -> Result<Arc<Self>, Status> {
        let channel = inboxes.channel();
        let options = child_relay::unary(&channel, "GetDevicePluginOptions", WHO, |ch| async {
            Client::new(ch).get_device_plugin_options(Empty {}).await
        })
        .await?;
        let devices = watch::Sender::new(Vec::new());
        let mut first = devices.subscribe();
        tokio::spawn(follow(
            channel.clone(),
            resource.to_string(),
            devices.clone(),
        ));
        tokio::time::timeout(child_relay::PATIENCE, first.changed())
            .await
            .map_err(|_| {
                Status::unavailable(format!(
                    "{resource}: no {WHO} sent its device list within {} s",
                    child_relay::PATIENCE.as_secs()
                ))
            })?
            .map_err(|_| Status::internal("the device list's follower stopped"))?;
        Ok(Arc::new(RelayedPlugin {
            options,
            devices,
            channel,
        }))
    }
}

/// Each child's `ListAndWatch` in turn into `devices`; a child's end is a
/// pause (the last list stands), not the list's end.
async fn follow(channel: Channel, resource: String, devices: watch::Sender<Vec<Device>>) {
    loop {
        if let Ok(r) = Client::new(channel.clone()).list_and_watch(Empty {}).await {
            let mut s = r.into_inner();
            while let Ok(Some(m)) = s.message().await {
                devices.send_if_modified(|d| {
                    let changed = *d != m.devices || d.is_empty();
                    *d = m.devices;
                    changed
                });
            }
            tracing::info!(%resource, "the {WHO}'s device list ended; following the next one's");
        }
        tokio::time::sleep(RETRY).await;
    }
}

#[tonic::async_trait]
impl DevicePluginService for RelayedPlugin {
    fn options(&self) -> DevicePluginOptions {
        self.options
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.devices.subscribe()
    }

    async fn get_preferred_allocation(
        &self,
        req: PreferredAllocationRequest,
    ) -> Result<PreferredAllocationResponse, Status> {
        child_relay::unary(&self.channel, "GetPreferredAllocation", WHO, |ch| {
            let req = req.clone();
            async move { Client::new(ch).get_preferred_allocation(req).await }
        })
        .await
    }

    async fn allocate(&self, req: AllocateRequest) -> Result<AllocateResponse, Status> {
        child_relay::unary(&self.channel, "Allocate", WHO, |ch| {
            let req = req.clone();
            async move { Client::new(ch).allocate(req).await }
        })
        .await
    }

    async fn pre_start_container(
        &self,
        req: PreStartContainerRequest,
    ) -> Result<PreStartContainerResponse, Status> {
        child_relay::unary(&self.channel, "PreStartContainer", WHO, |ch| {
            let req = req.clone();
            async move { Client::new(ch).pre_start_container(req).await }
        })
        .await
    }
}

/// The child's side: serves `plugin` on the connections its supervisor
/// passes over `inbox`, until `stop` (which ends the open `ListAndWatch`
/// streams; the supervisor then follows the next child's).
pub async fn serve_inbox(
    resource: &str,
    plugin: Arc<dyn DevicePluginService>,
    inbox: StdStream,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let svc = DevicePluginServer::new(GrpcPlugin {
        resource: resource.to_string(),
        plugin,
        stop: stop.clone(),
        // The supervisor's streams are its own business: nothing here
        // registers.
        closed_by_kubelet: watch::Sender::new(0),
    });
    tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(child_relay::incoming(inbox), stop.cancelled_owned())
        .await
}
