//! The supervisor answers the kubelet on the plugin socket itself and relays
//! each call to its driver child. A kubelet keeps one connection to the
//! plugin socket; were it the child's, a kill -9 of the child would end it
//! and fail the NodePrepareResources in flight ("error reading from server:
//! EOF"), and the kubelet would retry the pod only 10–15 s later. Here the
//! kubelet's connection is the supervisor's, which outlives the child: a
//! call the child dies under is sent again to the next child (prepare and
//! unprepare are idempotent: the kubelet itself repeats them), and the
//! health stream continues from the next child.
//!
//! The child has no socket of its own: for each connection the supervisor
//! makes a socket pair and passes one end to the current child over its
//! inbox ([`Inboxes`], `SCM_RIGHTS`), which the child serves as an accepted
//! connection ([`incoming`]). Nothing is bound to a name, so nothing but
//! the supervisor can reach the child.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdStream;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dra_api::dra::{v1, v1beta1};
use dra_api::dra_health as h;
use futures::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};

/// How long a call waits for a child that answers it: less than the
/// kubelet's 45 s per call (`defaultClientCallTimeout`,
/// pkg/kubelet/cm/dra/plugin/dra_plugin.go), so it gets this error rather
/// than its own deadline.
pub const PATIENCE: Duration = Duration::from_secs(40);
const RETRY: Duration = Duration::from_millis(20);

type Inbox = Option<Arc<StdStream>>;

/// The current child's inbox, set by the supervisor as children come and go.
#[derive(Clone)]
pub struct Inboxes {
    tx: Arc<watch::Sender<Inbox>>,
}

impl Default for Inboxes {
    fn default() -> Self {
        Inboxes {
            tx: Arc::new(watch::channel(None).0),
        }
    }
}

impl Inboxes {
    /// A new child's inbox: the end to hand to the child. Connections made
    /// from now on go to it.
    pub fn start_child(&self) -> io::Result<OwnedFd> {
        let (mine, theirs) = StdStream::pair()?;
        mine.set_nonblocking(true)?;
        self.tx.send_replace(Some(Arc::new(mine)));
        Ok(theirs.into())
    }

    /// The child is gone: connections wait for the next one.
    pub fn child_gone(&self) {
        self.tx.send_replace(None);
    }

    /// A connection to the current child, waiting for one while none runs.
    async fn connect(&self) -> io::Result<UnixStream> {
        let mut rx = self.tx.subscribe();
        loop {
            let inbox = rx.borrow_and_update().clone();
            if let Some(inbox) = inbox {
                let (mine, theirs) = StdStream::pair()?;
                match fd_pass::send(&inbox, b"c", &[theirs.as_raw_fd()]) {
                    Ok(()) => {
                        mine.set_nonblocking(true)?;
                        return UnixStream::from_std(mine);
                    }
                    // A child busy starting: its inbox is full for a moment.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                    // The child died; the supervisor has not seen it yet.
                    Err(_) => {}
                }
            }
            if rx.changed().await.is_err() {
                return Err(io::Error::other("the supervisor stopped"));
            }
        }
    }

    /// A channel whose connections go to the current child.
    fn channel(&self) -> Channel {
        let inboxes = self.clone();
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let inboxes = inboxes.clone();
            async move { inboxes.connect().await.map(TokioIo::new) }
        });
        Endpoint::from_static("http://localhost").connect_with_connector_lazy(connector)
    }
}

/// The connections the supervisor passes to this child over `inbox`, as
/// the plugin server's incoming connections. Ends when the supervisor
/// closes the inbox.
pub fn incoming(
    inbox: StdStream,
) -> impl Stream<Item = io::Result<uds_authority::Fixed<UnixStream>>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<StdStream>();
    std::thread::spawn(move || {
        // recv blocks: the inbox must be blocking whatever it was given as.
        let _ = inbox.set_nonblocking(false);
        loop {
            match fd_pass::recv(&inbox) {
                Ok((_, fds)) if fds.is_empty() => return,
                Ok((_, fds)) => {
                    for fd in fds {
                        if tx.send(StdStream::from(fd)).is_err() {
                            return;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::error!(error = %e, "the supervisor's inbox");
                    return;
                }
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        let c = rx.recv().await?;
        let c = c
            .set_nonblocking(true)
            .and_then(|()| UnixStream::from_std(c))
            .map(uds_authority::Fixed::new);
        Some((c, rx))
    })
}

/// A status that says the child went away under the call (a transport
/// error), not what the driver answered: the driver reports its own
/// failures inside the response and never as a status.
fn lost(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
    )
}

/// The relay: the kubelet's services, each call sent on to the child.
#[derive(Clone)]
pub struct Relay {
    channel: Channel,
}

impl Relay {
    pub fn new(inboxes: &Inboxes) -> Relay {
        Relay {
            channel: inboxes.channel(),
        }
    }

    /// `call` on the child, again on the next child while the child goes
    /// away under it, for at most [`PATIENCE`].
    async fn unary<T, Fut>(&self, what: &str, call: impl Fn(Channel) -> Fut) -> Result<T, Status>
    where
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let until = Instant::now() + PATIENCE;
        let mut tries = 0u32;
        loop {
            // A child that never comes (a crash loop) ends the wait too.
            let left = until.saturating_duration_since(Instant::now());
            let r = tokio::time::timeout(left, call(self.channel.clone()))
                .await
                .unwrap_or_else(|_| Err(Status::unavailable("no driver process answered")));
            match r {
                Ok(r) => {
                    if tries > 0 {
                        tracing::info!(call = what, tries, "answered by the next driver process");
                    }
                    return Ok(r.into_inner());
                }
                Err(s) if lost(&s) && Instant::now() < until => {
                    if tries == 0 {
                        tracing::warn!(call = what, status = %s, "the driver process went away under a call: sending it to the next one");
                    }
                    tries += 1;
                    tokio::time::sleep(RETRY).await;
                }
                Err(s) if lost(&s) => {
                    return Err(Status::unavailable(format!(
                        "{what}: no driver process answered within {} s (last: {s})",
                        PATIENCE.as_secs()
                    )));
                }
                Err(s) => return Err(s),
            }
        }
    }
}

/// Serves the relay on the kubelet's plugin socket until the process ends.
pub async fn serve(listener: std::os::unix::net::UnixListener, inboxes: Inboxes) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let l = UnixListener::from_std(listener)?;
    let relay = Relay::new(&inboxes);
    tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(relay.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
            relay.clone(),
        ))
        .add_service(h::dra_resource_health_server::DraResourceHealthServer::new(
            relay,
        ))
        .serve_with_incoming(uds_authority::incoming(l))
        .await
        .map_err(io::Error::other)
}

/// One relayed unary call: `$client::new(channel).$method(request)` on the
/// child, through [`Relay::unary`].
macro_rules! relay_unary {
    ($relay:expr, $what:literal, $req:expr, $client:ty, $method:ident) => {{
        let m = $req.into_inner();
        $relay
            .unary($what, |ch| {
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

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<h::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl h::dra_resource_health_server::DraResourceHealth for Relay {
    type NodeWatchResourcesStream = HealthStream;

    /// One stream to the kubelet, fed by each child in turn: a child's
    /// death is a pause, not the stream's end.
    async fn node_watch_resources(
        &self,
        req: Request<h::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let m = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let channel = self.channel.clone();
        tokio::spawn(async move {
            while !tx.is_closed() {
                let mut client =
                    h::dra_resource_health_client::DraResourceHealthClient::new(channel.clone());
                match client.node_watch_resources(m).await {
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
        let s =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(s.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connection waits while no child runs, then reaches the next
    /// child's incoming connections; a dead child's inbox is skipped.
    #[tokio::test]
    async fn connections_wait_for_a_child_and_reach_it() {
        let inboxes = Inboxes::default();
        let dead = inboxes.start_child().unwrap();
        drop(dead);
        let waiting = {
            let i = inboxes.clone();
            tokio::spawn(async move { i.connect().await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "connected to a dead child");
        inboxes.child_gone();
        let theirs = inboxes.start_child().unwrap();
        let mut conns = Box::pin(incoming(StdStream::from(theirs)));
        let mut mine = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("never connected")
            .unwrap()
            .unwrap();
        let mut child_side = conns.next().await.unwrap().unwrap();
        mine.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        child_side.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ping");
    }
}
