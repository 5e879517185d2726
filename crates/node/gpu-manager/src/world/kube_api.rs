//! The API server side: a client, a reflector of this node's pods, and the
//! annotation patcher (retried on conflict and transient errors).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::world::{ApiHealth, PatchJob, PodPatcher, PodSource};

/// This node's pods, kept current by a reflector.
#[derive(Clone)]
pub struct PodWatch {
    store: Store<Pod>,
    changes: watch::Receiver<u64>,
    health: watch::Receiver<ApiHealth>,
    seen: Arc<std::sync::Mutex<Seen>>,
}

/// When the watch first saw each pod: 0 for the initial list (its order
/// says nothing), then 1, 2, ... as pods are bound to this node.
#[derive(Default)]
struct Seen {
    next: u64,
    by_uid: std::collections::HashMap<String, u64>,
}

impl Seen {
    fn note(&mut self, ev: &watcher::Event<Pod>) {
        let uid = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
        match ev {
            watcher::Event::InitApply(p) => {
                self.by_uid.entry(uid(p)).or_insert(0);
            }
            watcher::Event::Apply(p) => {
                if !self.by_uid.contains_key(&uid(p)) {
                    self.next += 1;
                    self.by_uid.insert(uid(p), self.next);
                }
            }
            watcher::Event::Delete(p) => {
                self.by_uid.remove(&uid(p));
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }
}

/// What the manager's API server calls failed at.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The pod watch's first full list did not come (why, as the watch
    /// said it).
    #[error("{0}")]
    NotListed(String),
    #[error("pod was replaced (uid {found:?}, allocation was for {allocated})")]
    PodReplaced {
        found: Option<String>,
        allocated: String,
    },
    #[error("after {attempt} attempts: {source}")]
    Patch {
        attempt: u32,
        #[source]
        source: kube::Error,
    },
    #[error("annotating node {node} with {key}: {source}")]
    AnnotateNode {
        node: String,
        key: String,
        #[source]
        source: kube::Error,
    },
    #[error("removing {key} from node {node}: {source}")]
    RemoveAnnotation {
        node: String,
        key: String,
        #[source]
        source: kube::Error,
    },
}

impl PodWatch {
    /// Starts the reflector (field selector `spec.nodeName=<node>`).
    pub fn start(client: Client, node: &str, cancel: CancellationToken) -> PodWatch {
        let api: Api<Pod> = Api::all(client);
        let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let (ctx, changes) = watch::channel(0u64);
        let (htx, health) = watch::channel(ApiHealth::Starting);
        let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
        let noted = seen.clone();
        let failing = htx.clone();
        let on_event = move |ev: &watcher::Event<Pod>| {
            noted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .note(ev);
            htx.send_if_modified(|h| {
                let changed = *h != ApiHealth::Ok;
                if changed {
                    tracing::info!("pod watch in sync with the API server");
                }
                *h = ApiHealth::Ok;
                changed
            });
            ctx.send_modify(|n| *n += 1);
        };
        let on_error = move |e: &watcher::Error| {
            let msg = e.to_string();
            tracing::warn!(error = %msg, "pod watch failed; retrying");
            failing.send_replace(ApiHealth::Failing(msg));
        };
        let store = daemon_kit::reflect::spawn(api, cfg, cancel, on_event, on_error);
        PodWatch {
            store,
            changes,
            health,
            seen,
        }
    }

    /// Waits for the first full list. The error says why it did not come.
    pub async fn ready(&self, timeout: Duration) -> Result<(), ApiError> {
        match tokio::time::timeout(timeout, self.store.wait_until_ready()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ApiError::NotListed(e.to_string())),
            Err(_) => Err(ApiError::NotListed(match &*self.health.borrow() {
                ApiHealth::Failing(e) => e.clone(),
                _ => "no answer".into(),
            })),
        }
    }

    pub fn is_ready(&self) -> bool {
        *self.health.borrow() != ApiHealth::Starting
    }

    pub fn health(&self) -> ApiHealth {
        self.health.borrow().clone()
    }

    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.store.state()
    }

    pub fn generation(&self) -> u64 {
        *self.changes.borrow()
    }

    /// Waits until the store's generation differs from `seen` or `timeout`
    /// passes; false on timeout.
    pub async fn changed_since(&self, seen: u64, timeout: Duration) -> bool {
        let mut rx = self.changes.clone();
        let moved = rx.wait_for(|&g| g != seen);
        matches!(tokio::time::timeout(timeout, moved).await, Ok(Ok(_)))
    }
}

#[async_trait::async_trait]
impl PodSource for PodWatch {
    fn health(&self) -> ApiHealth {
        PodWatch::health(self)
    }

    fn pods(&self) -> Vec<Arc<Pod>> {
        PodWatch::pods(self)
    }

    fn generation(&self) -> u64 {
        PodWatch::generation(self)
    }

    async fn changed_since(&self, seen: u64, timeout: Duration) -> bool {
        PodWatch::changed_since(self, seen, timeout).await
    }

    fn seen(&self, uid: &str) -> Option<u64> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .by_uid
            .get(uid)
            .copied()
    }
}

/// Applies annotation patches in the background, retrying conflicts and
/// transient failures with backoff.
#[derive(Clone)]
pub struct Patcher {
    tx: mpsc::UnboundedSender<PatchJob>,
}

fn retryable(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 409 || s.code == 429 || s.code >= 500,
        _ => true,
    }
}

impl Patcher {
    pub fn start(
        client: Client,
        done: Option<mpsc::UnboundedSender<(PatchJob, Result<(), ApiError>)>>,
    ) -> Patcher {
        let (tx, mut rx) = mpsc::unbounded_channel::<PatchJob>();
        tokio::spawn(async move {
            while let Some(job) = rx.recv().await {
                let r = patch_pod(&client, &job).await;
                match &r {
                    Ok(()) => {
                        tracing::info!(pod = %format!("{}/{}", job.namespace, job.name), annotations = ?job.annotations, "pod annotated")
                    }
                    Err(e) => {
                        tracing::error!(pod = %format!("{}/{}", job.namespace, job.name), error = %e, "annotating pod failed")
                    }
                }
                if let Some(d) = &done {
                    let _ = d.send((job, r));
                }
            }
        });
        Patcher { tx }
    }
}

impl PodPatcher for Patcher {
    fn submit(&self, job: PatchJob) {
        let _ = self.tx.send(job);
    }
}

async fn patch_pod(client: &Client, job: &PatchJob) -> Result<(), ApiError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &job.namespace);
    let body = serde_json::json!({"metadata": {"annotations": job.annotations}});
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=8 {
        match api
            .patch(&job.name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(p) => {
                if p.metadata.uid.as_deref() != Some(job.uid.as_str()) {
                    return Err(ApiError::PodReplaced {
                        found: p.metadata.uid,
                        allocated: job.uid.clone(),
                    });
                }
                return Ok(());
            }
            Err(e) if retryable(&e) && attempt < 8 => {
                tracing::debug!(attempt, error = %e, "patch failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(source) => return Err(ApiError::Patch { attempt, source }),
        }
    }
    unreachable!("the loop returns")
}

/// Sets one annotation on the node (a merge patch: others untouched).
pub async fn annotate_node(
    client: &Client,
    node: &str,
    key: &str,
    value: &str,
) -> Result<(), ApiError> {
    let api: Api<Node> = Api::all(client.clone());
    let body = serde_json::json!({"metadata": {"annotations": {key: value}}});
    api.patch(node, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .map(|_| ())
        .map_err(|source| ApiError::AnnotateNode {
            node: node.to_string(),
            key: key.to_string(),
            source,
        })
}

/// Removes one annotation from the node (a merge patch with null), as
/// `gpu-manager uninstall` does with the inventory; absent is success.
pub async fn remove_node_annotation(
    client: &Client,
    node: &str,
    key: &str,
) -> Result<(), ApiError> {
    let api: Api<Node> = Api::all(client.clone());
    let body = serde_json::json!({"metadata": {"annotations": {key: null}}});
    api.patch(node, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .map(|_| ())
        .map_err(|source| ApiError::RemoveAnnotation {
            node: node.to_string(),
            key: key.to_string(),
            source,
        })
}

/// Puts `labels` on the node; a missing node is logged, not fatal.
pub async fn label_node(client: &Client, node: &str, labels: &BTreeMap<String, String>) {
    if labels.is_empty() {
        return;
    }
    let api: Api<Node> = Api::all(client.clone());
    let body = serde_json::json!({"metadata": {"labels": labels}});
    match api
        .patch(node, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(_) => tracing::info!(node, ?labels, "node labelled"),
        Err(e) => tracing::warn!(node, error = %e, "labelling the node failed"),
    }
}
