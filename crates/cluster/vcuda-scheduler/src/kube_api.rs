//! The API server behind the extender: watch caches of nodes and pods
//! (kube-runtime reflectors) that `filter` and `prioritize` read, the
//! nodes an event changed rebuilt into the [`Cluster`] view
//! ([`Changes`]); and [`KubeBind`], bind's fresh reads and
//! conflict-checked writes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::bind::{ApiError, BIND_SEQ, BindApi, NODE_LABEL};
use crate::changes::Changes;
use crate::cluster::Cluster;

/// Where `filter` and `prioritize` get the cluster.
pub trait ClusterSource: Send + Sync {
    fn cluster(&self) -> Arc<Cluster>;
    /// Both caches have listed once.
    fn ready(&self) -> bool;
}

/// Watch caches of every node and pod.
pub struct Caches {
    nodes: Store<Node>,
    pods: Store<Pod>,
    /// What changed since the view was built.
    changes: Arc<Mutex<Changes>>,
    built: Mutex<Arc<Cluster>>,
    /// Stores that have listed once.
    listed: Arc<AtomicU64>,
}

impl Caches {
    pub fn start(client: Client, cancel: CancellationToken) -> Caches {
        let changes = Arc::new(Mutex::new(Changes::default()));
        let ch = changes.clone();
        let nodes = reflect::<Node>(Api::all(client.clone()), cancel.clone(), move |e| {
            let mut c = ch.lock().unwrap_or_else(PoisonError::into_inner);
            match e {
                Event::Apply(n) | Event::Delete(n) | Event::InitApply(n) => {
                    c.node(n.metadata.name.as_deref().unwrap_or_default())
                }
                Event::Init | Event::InitDone => c.relist(),
            }
        });
        let ch = changes.clone();
        let pods = reflect::<Pod>(Api::all(client), cancel, move |e| {
            let mut c = ch.lock().unwrap_or_else(PoisonError::into_inner);
            match e {
                Event::Apply(p) | Event::InitApply(p) => c.pod(p, false),
                Event::Delete(p) => c.pod(p, true),
                Event::Init | Event::InitDone => c.relist(),
            }
        });
        let listed = Arc::new(AtomicU64::new(0));
        let (n, p, l) = (nodes.clone(), pods.clone(), listed.clone());
        tokio::spawn(async move {
            if n.wait_until_ready().await.is_ok() && p.wait_until_ready().await.is_ok() {
                l.store(1, Ordering::Release);
                tracing::info!("node and pod caches listed");
            }
        });
        Caches {
            nodes,
            pods,
            changes,
            built: Mutex::new(Arc::new(Cluster::default())),
            listed,
        }
    }
}

/// A store of every `K`, each event handed to `on_event` once applied.
fn reflect<K>(
    api: Api<K>,
    cancel: CancellationToken,
    on_event: impl FnMut(&Event<K>) + Send + 'static,
) -> Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    daemon_kit::reflect::spawn(
        api,
        watcher::Config::default(),
        cancel,
        on_event,
        |e| tracing::warn!(error = %e, "watch failed; retrying"),
    )
}

impl ClusterSource for Caches {
    fn cluster(&self) -> Arc<Cluster> {
        let mut b = self.built.lock().unwrap_or_else(PoisonError::into_inner);
        // The stores are read after the changes are taken: an event
        // applied meanwhile is in them, and rebuilt again next time.
        let pending = self
            .changes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let stores = || (self.nodes.state(), self.pods.state());
        *b = pending.apply(&b, stores, SystemTime::now());
        b.clone()
    }

    fn ready(&self) -> bool {
        self.listed.load(Ordering::Acquire) == 1
    }
}

/// Bind's reads and writes, straight to the API server.
pub struct KubeBind {
    pub client: Client,
}

fn api_error(e: kube::Error) -> ApiError {
    match &e {
        kube::Error::Api(s) if s.code == 409 => ApiError::Conflict(s.message.clone()),
        kube::Error::Api(s) if s.code == 404 => ApiError::NotFound(s.message.clone()),
        _ => ApiError::Other(e.to_string()),
    }
}

#[async_trait]
impl BindApi for KubeBind {
    async fn fresh(&self, node: &str) -> Result<(Node, Vec<Pod>), ApiError> {
        let n = Api::<Node>::all(self.client.clone())
            .get(node)
            .await
            .map_err(api_error)?;
        let pods: Api<Pod> = Api::all(self.client.clone());
        let bound = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(api_error)?;
        let reserving = pods
            .list(&ListParams::default().labels(&format!("{NODE_LABEL}={node}")))
            .await
            .map_err(api_error)?;
        let mut by_uid: BTreeMap<String, Pod> = BTreeMap::new();
        for p in bound.items.into_iter().chain(reserving.items) {
            by_uid.insert(gpu_pods::uid(&p).to_string(), p);
        }
        Ok((n, by_uid.into_values().collect()))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, ApiError> {
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(api_error)
    }

    async fn patch_pod(
        &self,
        pod: &Pod,
        annotations: &BTreeMap<String, Option<String>>,
        labels: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError> {
        let body = serde_json::json!({"metadata": {
            "resourceVersion": pod.metadata.resource_version,
            "annotations": annotations,
            "labels": labels,
        }});
        Api::<Pod>::namespaced(self.client.clone(), gpu_pods::namespace(pod))
            .patch(
                gpu_pods::name(pod),
                &PatchParams::default(),
                &Patch::Merge(&body),
            )
            .await
            .map(|_| ())
            .map_err(api_error)
    }

    async fn bump(&self, node: &Node, seq: u64) -> Result<(), ApiError> {
        let body = serde_json::json!({"metadata": {
            "resourceVersion": node.metadata.resource_version,
            "annotations": {BIND_SEQ: seq.to_string()},
        }});
        let name = node.metadata.name.as_deref().unwrap_or_default();
        Api::<Node>::all(self.client.clone())
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map(|_| ())
            .map_err(api_error)
    }

    async fn bind(
        &self,
        pod: &Pod,
        node: &str,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError> {
        let name = gpu_pods::name(pod);
        // A Binding's annotations are merged into the pod with its node
        // (every release since 1.4); only the ones it sets are sent.
        let set: BTreeMap<&String, &String> = annotations
            .iter()
            .filter_map(|(k, v)| Some((k, v.as_ref()?)))
            .collect();
        let body = serde_json::json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": gpu_pods::namespace(pod),
                         "uid": gpu_pods::uid(pod), "annotations": set},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        });
        Api::<Pod>::namespaced(self.client.clone(), gpu_pods::namespace(pod))
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &body,
            )
            .await
            .map(|_| ())
            .map_err(api_error)
    }
}
