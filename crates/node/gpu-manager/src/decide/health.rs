//! GPU health into the advertised devices: each critical Xid takes the
//! GPU's IDs unhealthy, a quiet period without one brings them back
//! ([`node_agent::health`] decides which).

use std::sync::Arc;

use node_agent::health::HealthChange;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::manager::Manager;
use crate::mig::MigPlugins;

/// The health task: `changes` into the manager and the MIG plugins until
/// `cancel` or their end.
pub fn spawn(
    mgr: Arc<Manager>,
    mig: MigPlugins,
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
                // An Xid inside a MIG GPU instance: that instance alone.
                Some(HealthChange::Unhealthy {
                    gpu,
                    gpu_instance: Some(gi),
                    ..
                }) => {
                    mig.set_instance_health(gpu, gi, false);
                    mgr.set_mig_health(gpu, Some(gi), false);
                }
                Some(HealthChange::Healthy {
                    gpu,
                    gpu_instance: Some(gi),
                }) => {
                    mig.set_instance_health(gpu, gi, true);
                    mgr.set_mig_health(gpu, Some(gi), true);
                }
                Some(HealthChange::Unhealthy { gpu, .. }) => {
                    mgr.set_gpu_health(gpu, false);
                    mig.set_gpu_health(gpu, false);
                    mgr.set_mig_health(gpu, None, false);
                }
                Some(HealthChange::Healthy { gpu, .. }) => {
                    mgr.set_gpu_health(gpu, true);
                    mig.set_gpu_health(gpu, true);
                    mgr.set_mig_health(gpu, None, true);
                }
            }
        }
    });
}
