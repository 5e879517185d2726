//! The manager's long-running jobs, each a named task with its inputs,
//! started by [`crate::daemon::run`] once the state is restored. The pod
//! watch (`kube_api::PodWatch`: watcher and reflector) feeds
//! [`PodRelease`]; [`AllocationCheck`] is the periodic reconciliation;
//! GPU health is [`crate::health::spawn`] over `node_agent::health`.

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
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.mgr.pod_changes() => { self.mgr.release_deleted_pods(); }
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
