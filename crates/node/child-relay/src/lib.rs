//! A supervisor that answers the kubelet's gRPC connections itself and
//! relays each call to its worker child. The kubelet keeps one connection
//! to a plugin socket; were it the child's, a kill -9 of the child would
//! end it and fail the call in flight ("error reading from server: EOF")
//! and, for a device plugin, end its `ListAndWatch` stream, which makes
//! the kubelet mark the resource unhealthy. Here the kubelet's connection
//! is the supervisor's, which outlives the child: a call the child dies
//! under is sent again to the next child ([`unary`]), and streams go on
//! from the next child.
//!
//! The child has no socket of its own: for each connection the supervisor
//! makes a socket pair and passes one end to the current child over its
//! inbox ([`Inboxes`], `SCM_RIGHTS`), which the child serves as an
//! accepted connection ([`incoming`]). Nothing is bound to a name, so
//! nothing but the supervisor can reach the child. Used by the DRA
//! driver's and the device-plugin manager's supervisors.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

/// How long a call waits for a child that answers it: less than the
/// kubelet's 45 s per DRA call (`defaultClientCallTimeout`,
/// pkg/kubelet/cm/dra/plugin/dra_plugin.go), so it gets this error rather
/// than its own deadline. (The device manager sets none on Allocate and
/// 30 s on PreStartContainer, `KubeletPreStartContainerRPCTimeoutInSecs`:
/// a child takes 1–2 s to start, so both are far off.)
pub const PATIENCE: Duration = Duration::from_secs(40);
/// The pause between tries, and before a stream is opened again.
pub const RETRY: Duration = Duration::from_millis(20);

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
    pub async fn connect(&self) -> io::Result<UnixStream> {
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
    pub fn channel(&self) -> Channel {
        let inboxes = self.clone();
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let inboxes = inboxes.clone();
            async move { inboxes.connect().await.map(TokioIo::new) }
        });
        Endpoint::from_static("http://localhost").connect_with_connector_lazy(connector)
    }
}

/// The connections the supervisor passes to this child over `inbox`, as
/// a gRPC server's incoming connections. Ends when the supervisor closes
/// the inbox.
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

/// Whether a call failed because the child went away under it (the
/// transport failed: tonic then keeps the cause as the status's source),
/// rather than because the child answered with this status (decoded from
/// its trailers, no source): only the first is sent again.
pub fn lost(s: &Status) -> bool {
    std::error::Error::source(s).is_some()
}

/// `call` on the child, again on the next child while the child goes away
/// under it, for at most [`PATIENCE`]. `what` names the call and `who` the
/// child ("driver process") in logs and errors.
pub async fn unary<T, Fut>(
    channel: &Channel,
    what: &str,
    who: &str,
    call: impl Fn(Channel) -> Fut,
) -> Result<T, Status>
where
    Fut: Future<Output = Result<Response<T>, Status>>,
{
    let until = Instant::now() + PATIENCE;
    let mut tries = 0u32;
    loop {
        // A child that never comes (a crash loop) ends the wait too.
        let left = until.saturating_duration_since(Instant::now());
        let r = match tokio::time::timeout(left, call(channel.clone())).await {
            Ok(r) => r,
            Err(_) => {
                return Err(Status::unavailable(format!(
                    "{what}: no {who} answered within {} s",
                    PATIENCE.as_secs()
                )));
            }
        };
        match r {
            Ok(r) => {
                if tries > 0 {
                    tracing::info!(call = what, tries, "answered by the next {who}");
                }
                return Ok(r.into_inner());
            }
            Err(s) if lost(&s) && Instant::now() < until => {
                if tries == 0 {
                    tracing::warn!(call = what, status = %s, "the {who} went away under a call: sending it to the next one");
                }
                tries += 1;
                tokio::time::sleep(RETRY).await;
            }
            Err(s) if lost(&s) => {
                return Err(Status::unavailable(format!(
                    "{what}: no {who} answered within {} s (last: {s})",
                    PATIENCE.as_secs()
                )));
            }
            Err(s) => return Err(s),
        }
    }
}

/// Runs `serve` on a runtime and thread of its own for the process's life.
/// Should it end, the kubelet can no longer reach the child: the process
/// exits, so that the pod restarts rather than serving nothing.
pub fn spawn_thread<F>(name: &str, serve: F) -> io::Result<()>
where
    F: Future<Output = io::Result<()>> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let what = name.to_string();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Err(e) = rt.block_on(serve) {
                tracing::error!(error = %e, "{what} stopped");
            } else {
                tracing::error!("{what} ended");
            }
            std::process::exit(1);
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
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

    /// A status the child answered is not sent again; a transport failure is.
    #[test]
    fn only_transport_failures_count_as_lost() {
        assert!(!lost(&Status::unavailable("the API server is not synced")));
        let mut s = Status::unavailable("error reading from server");
        s.set_source(Arc::new(io::Error::from(io::ErrorKind::ConnectionReset)));
        assert!(lost(&s));
    }
}
