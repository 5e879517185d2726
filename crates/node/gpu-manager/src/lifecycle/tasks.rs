//! The manager's long-running jobs, each a named task with its inputs,
//! started by [`crate::lifecycle::daemon::run`] once the state is restored. The pod
//! watch (`kube_api::PodWatch`: watcher and reflector) feeds
//! [`PodRelease`]; [`AllocationCheck`] is the periodic reconciliation;
//! GPU health is [`crate::decide::health::spawn`] over `node_agent::health`;
//! [`InventoryPublish`] keeps the node's GPU inventory on its Node object.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::manager::Manager;

/// Deleted pods free their capacity as soon as the watch sees them.
pub struct PodRelease {
    pub mgr: Arc<Manager>,
}

impl PodRelease {
    pub fn spawn(self, cancel: CancellationToken) {
        tokio::spawn(async move {
            // The generation is read before each sweep, so a deletion seen
            // while one runs wakes the next instead of waiting for an
            // unrelated event.
            let mut seen = self.mgr.pod_generation();
            self.mgr.release_deleted_pods();
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.mgr.pod_changes(seen) => {
                        seen = self.mgr.pod_generation();
                        self.mgr.release_deleted_pods();
                    }
                }
            }
        });
    }
}

/// Every `period`, the allocations against kubelet, the API server and the
/// container runtime (`Manager::check_allocations`).
pub struct AllocationCheck {
    pub mgr: Arc<Manager>,
    pub period: Duration,
}

impl AllocationCheck {
    /// A fresh allocation has no container yet: "no container, no kubelet
    /// record" counts only after this long.
    pub fn grace(&self) -> Duration {
        (self.period * 2).max(Duration::from_secs(10))
    }

    pub fn spawn(self, cancel: CancellationToken) {
        let grace = self.grace();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(self.period);
            t.tick().await;
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = t.tick() => self.mgr.check_allocations(grace).await,
                }
            }
        });
    }
}

/// The node's GPU inventory (`gpu_allocator::inventory`: GPUs, topology,
/// health, share mode) in the Node annotation the scheduler extender reads:
/// at start, then whenever it changes (a GPU's health), checked every
/// `period`. A failed patch is retried at the next check.
pub struct InventoryPublish {
    pub mgr: Arc<Manager>,
    pub client: kube::Client,
    pub node: String,
    pub period: Duration,
}

impl InventoryPublish {
    pub fn spawn(self, cancel: CancellationToken) {
        tokio::spawn(async move {
            let mut published: Option<String> = None;
            let mut t = tokio::time::interval(self.period);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = t.tick() => {}
                }
                let now = self.mgr.inventory().to_json();
                if published.as_ref() == Some(&now) {
                    continue;
                }
                let key = gpu_allocator::inventory::ANNOTATION;
                match crate::world::kube_api::annotate_node(&self.client, &self.node, key, &now)
                    .await
                {
                    Ok(()) => {
                        tracing::info!(node = %self.node, "GPU inventory published on the node");
                        published = Some(now);
                    }
                    Err(e) => tracing::warn!("{e}; retrying in {:?}", self.period),
                }
            }
        });
    }
}
