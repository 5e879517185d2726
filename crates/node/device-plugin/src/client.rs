//! gRPC over unix sockets, the way kubelet dials.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

use crate::Error;

/// Opens a tonic channel to the gRPC server on the unix socket `path`.
///
/// The URI is only used for the HTTP/2 `:authority`, which is `localhost`:
/// that is what grpc-go (and so kubelet >= 1.26) sends on unix sockets. Older
/// grpc-go (kubelet < 1.26) sent the socket path as authority; see the crate
/// README for what tonic's server does with that.
pub async fn connect_unix(path: impl AsRef<Path>, timeout: Duration) -> Result<Channel, Error> {
    let path: PathBuf = path.as_ref().to_path_buf();
    let p = path.clone();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let p = p.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
    });
    let endpoint = Endpoint::from_static("http://localhost").connect_timeout(timeout);
    match tokio::time::timeout(timeout, endpoint.connect_with_connector(connector)).await {
        Ok(Ok(ch)) => Ok(ch),
        Ok(Err(source)) => Err(Error::Connect { path, source }),
        Err(_) => Err(Error::ConnectTimeout {
            path,
            timeout_ms: timeout.as_millis() as u64,
        }),
    }
}
