//! GPU health into the advertised devices: each critical Xid takes the
//! GPU's IDs unhealthy, a quiet period without one brings them back
//! ([`node_agent::health`] decides which).

use std::sync::Arc;

use node_agent::health::HealthChange;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::manager::Manager;

/// The health task: `changes` into the manager until `cancel` or their end.
pub fn spawn(
    mgr: Arc<Manager>,
    mut changes: mpsc::UnboundedReceiver<HealthChange>,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                _ = cancel.cancelled() => return,
                c = changes.recv() => c,
            };
            match change {
                None => return,
                Some(HealthChange::Unhealthy { gpu, .. }) => mgr.set_gpu_health(gpu, false),
                Some(HealthChange::Healthy { gpu }) => mgr.set_gpu_health(gpu, true),
            }
        }
    });
}
