//! A small Kubernetes API server for tests and the simulated node.
//!
//! Serves what the manager's `kube` client needs, over plain HTTP on
//! localhost: pods (all namespaces and per namespace) and nodes, with list,
//! watch (`watch=true`, JSON lines, from a `resourceVersion`), get, create,
//! merge / strategic-merge patch and delete; field selectors
//! (`spec.nodeName=...`, `status.phase=...`, any dotted path) and equality
//! label selectors. Also events.k8s.io/v1 Events and resource.k8s.io/v1
//! ResourceSlices, DeviceClasses and ResourceClaims (with PUT and the
//! claim's status subresource) for the DRA driver. Objects are kept as JSON, so any field a client sends
//! survives.
//!
//! Test hooks: [`ApiServer::inject_conflicts`] makes the next patches answer
//! 409 Conflict, [`ApiServer::write_kubeconfig`] writes a kubeconfig that
//! points at it, and the direct accessors ([`ApiServer::create_pod`],
//! [`ApiServer::pod`], ...) skip HTTP.

mod http;
mod resource;
mod store;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use store::{Kind, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A running emulator; stops when dropped or on [`ApiServer::stop`].
pub struct ApiServer {
    state: Arc<store::Shared>,
    addr: SocketAddr,
    cancel: CancellationToken,
}

impl ApiServer {
    /// Listens on `addr` (e.g. `127.0.0.1:0` for any free port).
    pub async fn start(addr: &str) -> Result<ApiServer, Error> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind {
                addr: addr.to_string(),
                source,
            })?;
        let local = listener.local_addr().map_err(|source| Error::Bind {
            addr: addr.to_string(),
            source,
        })?;
        let state = Arc::new(store::Shared::new());
        let cancel = CancellationToken::new();
        let app = http::router(state.clone(), cancel.clone());
        let c = cancel.clone();
        tokio::spawn(async move {
            let r = axum::serve(listener, app)
                .with_graceful_shutdown(c.cancelled_owned())
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "API server emulator failed");
            }
        });
        tracing::info!(%local, "API server emulator listening");
        Ok(ApiServer {
            state,
            addr: local,
            cancel,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig whose current context points at this server.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<(), Error> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: emu\n  cluster:\n    server: {url}\n\
             users:\n- name: emu\n  user: {{}}\ncontexts:\n- name: emu\n  context:\n    cluster: emu\n    user: emu\n\
             current-context: emu\n",
            url = self.url()
        );
        std::fs::write(path, text).map_err(|source| Error::Kubeconfig {
            path: path.display().to_string(),
            source,
        })
    }

    /// Stops serving; open watches end.
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    /// Creates a pod (namespace `default` unless set); fills uid,
    /// creationTimestamp and resourceVersion. Returns the stored object.
    pub fn create_pod(&self, pod: Value) -> Result<Value, Error> {
        Ok(self.state.create(Kind::Pod, None, pod)?)
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.state.get(Kind::Pod, Some(namespace), name)
    }

    /// Every pod, in namespace/name order.
    pub fn pods(&self) -> Vec<Value> {
        self.state.list(Kind::Pod)
    }

    /// Applies a JSON merge patch (RFC 7386), as a client's PATCH would.
    pub fn patch_pod(&self, namespace: &str, name: &str, patch: &Value) -> Result<Value, Error> {
        Ok(self.state.patch(Kind::Pod, Some(namespace), name, patch)?)
    }

    pub fn delete_pod(&self, namespace: &str, name: &str) -> Result<Value, Error> {
        Ok(self.state.delete(Kind::Pod, Some(namespace), name)?)
    }

    /// Every events.k8s.io/v1 Event, in namespace/name order.
    pub fn events(&self) -> Vec<Value> {
        self.state.list(Kind::Event)
    }

    pub fn create_node(&self, node: Value) -> Result<Value, Error> {
        Ok(self.state.create(Kind::Node, None, node)?)
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.state.get(Kind::Node, None, name)
    }

    /// Creates any object of `kind` (resource.k8s.io ones included), as a
    /// POST would; `namespace` for namespaced kinds without one in metadata.
    pub fn create(&self, kind: Kind, namespace: Option<&str>, obj: Value) -> Result<Value, Error> {
        Ok(self.state.create(kind, namespace, obj)?)
    }

    pub fn get(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.state.get(kind, namespace, name)
    }

    /// Every object of `kind`, in namespace/name order.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.state.list(kind)
    }

    /// Applies a JSON merge patch to any object, as a client's PATCH would.
    pub fn patch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        patch: &Value,
    ) -> Result<Value, Error> {
        Ok(self.state.patch(kind, namespace, name, patch)?)
    }

    pub fn delete(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Result<Value, Error> {
        Ok(self.state.delete(kind, namespace, name)?)
    }

    /// Changes (ADDED, MODIFIED, DELETED) recorded for `kind` so far: how a
    /// test sees that an object was written exactly once.
    pub fn changes(&self, kind: Kind) -> Vec<(&'static str, Value)> {
        self.state.history(kind)
    }

    /// The next `n` PATCH requests (pods or nodes) answer 409 Conflict.
    pub fn inject_conflicts(&self, n: u32) {
        self.state.inject_conflicts(n);
    }

    /// PATCH requests answered so far (conflicts included).
    pub fn patch_requests(&self) -> u64 {
        self.state.patch_requests()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
