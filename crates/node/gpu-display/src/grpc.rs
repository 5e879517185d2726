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
            graph: self.0.graph(),
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
/// live server answers on unless `take_over`.
fn clear_stale(path: &Path, take_over: bool) -> Result<(), Error> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                if !take_over {
                    return Err(Error::SocketInUse {
                        path: path.to_path_buf(),
                    });
                }
                tracing::info!(socket = %path.display(), "taking the display socket over from the manager this one replaces");
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

/// The socket file's identity (device, inode).
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn live(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

fn bind(path: &Path, mode: u32) -> Result<UnixListener, Error> {
    let listener = UnixListener::bind(path).map_err(socket_err(path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(socket_err(path))?;
    Ok(listener)
}

/// Binds `path` and serves until `cancel`. Call inside a tokio runtime.
pub(crate) fn serve(
    shared: Arc<Shared>,
    path: &Path,
    mode: u32,
    take_over: bool,
    cancel: CancellationToken,
) -> Result<JoinHandle<()>, Error> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(socket_err(path))?;
    }
    clear_stale(path, take_over)?;
    let first = bind(path, mode)?;
    let path: PathBuf = path.to_path_buf();
    Ok(tokio::spawn(async move {
        let mut listener = Some(first);
        while let Some(l) = listener.take() {
            let ours = file_id(&path);
            // A manager this one replaced removes the path when it stops
            // (older versions did so whatever the file was), and one that
            // took it over may die: bind again.
            let gone = async {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    match file_id(&path) {
                        None => return,
                        Some(id) if Some(id) != ours && !live(&path) => {
                            let _ = std::fs::remove_file(&path);
                            return;
                        }
                        _ => {}
                    }
                }
            };
            let shutdown = async {
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = gone => {}
                }
            };
            let svc = GpuDisplayServer::new(Service(shared.clone()))
                .max_decoding_message_size(MAX_REQUEST);
            let r = tonic::transport::Server::builder()
                // A stuck client cannot hold the service: bounded work per
                // connection and per call.
                .concurrency_limit_per_connection(16)
                .timeout(Duration::from_secs(30))
                .http2_keepalive_interval(Some(Duration::from_secs(60)))
                .add_service(svc)
                .serve_with_incoming_shutdown(uds_authority::incoming(l), shutdown)
                .await;
            if let Err(e) = r {
                tracing::error!(socket = %path.display(), error = %e, "display gRPC server failed");
            }
            if cancel.is_cancelled() {
                // Only our own file: a successor may have bound the path.
                if ours.is_some() && file_id(&path) == ours {
                    let _ = std::fs::remove_file(&path);
                }
                break;
            }
            match bind(&path, mode) {
                Ok(l) => {
                    tracing::info!(socket = %path.display(), "the display socket was removed, or its new server died; bound again");
                    listener = Some(l);
                }
                Err(e) => tracing::error!(error = %e, "binding the removed display socket again"),
            }
        }
    }))
}
