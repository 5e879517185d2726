//! gRPC `display.GPUDisplay` on a unix socket.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use vcuda_api::display::gpu_display_server::{GpuDisplay, GpuDisplayServer};
use vcuda_api::display::{GraphResponse, UsageResponse, VersionResponse};

use crate::{Error, Shared};

/// Every display request is `google.protobuf.Empty`: anything bigger than
/// this is refused before it is decoded.
pub(crate) const MAX_REQUEST: usize = 4 * 1024;

struct Service(Arc<Shared>);

#[tonic::async_trait]
impl GpuDisplay for Service {
    async fn print_graph(&self, _: Request<()>) -> Result<Response<GraphResponse>, Status> {
        Ok(Response::new(GraphResponse {
            graph: self.0.source.graph_text(),
        }))
    }

    async fn print_usages(&self, _: Request<()>) -> Result<Response<UsageResponse>, Status> {
        let containers = self.0.source.containers();
        Ok(Response::new(crate::usage::usage_response(
            &containers,
            &self.0.snapshot.load(),
        )))
    }

    async fn version(&self, _: Request<()>) -> Result<Response<VersionResponse>, Status> {
        Ok(Response::new(VersionResponse {
            version: self.0.source.version(),
        }))
    }
}

fn socket_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Socket {
        path: path.to_path_buf(),
        source,
    }
}

/// Removes a stale socket left by a previous run; refuses to steal one a
/// live server answers on.
fn clear_stale(path: &Path) -> Result<(), Error> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(Error::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            std::fs::remove_file(path).map_err(socket_err(path))
        }
        Ok(_) => Err(Error::Socket {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket; not removing it",
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(socket_err(path)(e)),
    }
}

/// Binds `path` and serves until `cancel`. Call inside a tokio runtime.
pub(crate) fn serve(
    shared: Arc<Shared>,
    path: &Path,
    mode: u32,
    cancel: CancellationToken,
) -> Result<JoinHandle<()>, Error> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(socket_err(path))?;
    }
    clear_stale(path)?;
    let listener = UnixListener::bind(path).map_err(socket_err(path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(socket_err(path))?;
    let svc = GpuDisplayServer::new(Service(shared)).max_decoding_message_size(MAX_REQUEST);
    let path: PathBuf = path.to_path_buf();
    Ok(tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            // A stuck client cannot hold the service: bounded work per
            // connection and per call.
            .concurrency_limit_per_connection(16)
            .timeout(Duration::from_secs(30))
            .http2_keepalive_interval(Some(Duration::from_secs(60)))
            .add_service(svc)
            .serve_with_incoming_shutdown(uds_authority::incoming(listener), cancel.cancelled())
            .await;
        if let Err(e) = r {
            tracing::error!(socket = %path.display(), error = %e, "display gRPC server failed");
        }
        let _ = std::fs::remove_file(&path);
    }))
}
