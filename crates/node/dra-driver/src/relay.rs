//! The supervisor answers the kubelet on the plugin socket itself and relays
//! each call to its driver child ([`child_relay`]): a kill -9 of the child
//! would otherwise fail the NodePrepareResources in flight, and the kubelet
//! would retry the pod only 10–15 s later. A call the child dies under is
//! sent again to the next child (prepare and unprepare are idempotent: the
//! kubelet itself repeats them), and the health stream continues from the
//! next child.

use child_relay::{Inboxes, RETRY, lost};
use dra_api::dra::{v1, v1beta1};
use dra_api::dra_health::{v1 as h, v1alpha1};
use futures::StreamExt;
use tokio::net::UnixListener;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::health::{HealthStream, HealthStreamV1alpha1, as_v1alpha1};

pub use child_relay::incoming;

const WHO: &str = "driver process";

/// The relay: the kubelet's services, each call sent on to the child.
#[derive(Clone)]
pub struct Relay {
    channel: Channel,
}

impl Relay {
    fn new(inboxes: &Inboxes) -> Relay {
        Relay {
            channel: inboxes.channel(),
        }
    }
}

/// Serves the relay on the kubelet's plugin socket until the process ends.
pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    inboxes: Inboxes,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let l = UnixListener::from_std(listener)?;
    let relay = Relay::new(&inboxes);
    tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(relay.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
            relay.clone(),
        ))
        .add_service(h::dra_resource_health_server::DraResourceHealthServer::new(
            relay.clone(),
        ))
        .add_service(v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(relay))
        .serve_with_incoming(uds_authority::incoming(l))
        .await
        .map_err(std::io::Error::other)
}

/// One relayed unary call: `$client::new(channel).$method(request)` on the
/// child, through [`child_relay::unary`].
macro_rules! relay_unary {
    ($relay:expr, $what:literal, $req:expr, $client:ty, $method:ident) => {{
        let m = $req.into_inner();
        child_relay::unary(&$relay.channel, $what, WHO, |ch| {
            let m = m.clone();
            async move { <$client>::new(ch).$method(m).await }
        })
        .await
        .map(Response::new)
    }};
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Relay {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        type C = v1::dra_plugin_client::DraPluginClient<Channel>;
        relay_unary!(self, "NodePrepareResources", req, C, node_prepare_resources)
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        type C = v1::dra_plugin_client::DraPluginClient<Channel>;
        relay_unary!(
            self,
            "NodeUnprepareResources",
            req,
            C,
            node_unprepare_resources
        )
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for Relay {
    async fn node_prepare_resources(
        &self,
        req: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        type C = v1beta1::dra_plugin_client::DraPluginClient<Channel>;
        relay_unary!(
            self,
            "NodePrepareResources (v1beta1)",
            req,
            C,
            node_prepare_resources
        )
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        type C = v1beta1::dra_plugin_client::DraPluginClient<Channel>;
        relay_unary!(
            self,
            "NodeUnprepareResources (v1beta1)",
            req,
            C,
            node_unprepare_resources
        )
    }
}

impl Relay {
    /// One stream to the kubelet, fed by each child in turn (its v1
    /// service): a child's death is a pause, not the stream's end.
    fn health(&self) -> HealthStream {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let channel = self.channel.clone();
        tokio::spawn(async move {
            while !tx.is_closed() {
                let mut client =
                    h::dra_resource_health_client::DraResourceHealthClient::new(channel.clone());
                match client
                    .node_watch_resources(h::NodeWatchResourcesRequest {})
                    .await
                {
                    Ok(r) => {
                        let mut s = r.into_inner();
                        loop {
                            tokio::select! {
                                msg = s.message() => match msg {
                                    Ok(Some(msg)) => if tx.send(Ok(msg)).await.is_err() { return },
                                    _ => break,
                                },
                                () = tx.closed() => return,
                            }
                        }
                    }
                    Err(s) if !lost(&s) => {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(RETRY).await;
            }
        });
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
            .boxed()
    }
}

#[tonic::async_trait]
impl h::dra_resource_health_server::DraResourceHealth for Relay {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<h::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        Ok(Response::new(self.health()))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for Relay {
    type NodeWatchResourcesStream = HealthStreamV1alpha1;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStreamV1alpha1>, Status> {
        Ok(Response::new(as_v1alpha1(self.health())))
    }
}
