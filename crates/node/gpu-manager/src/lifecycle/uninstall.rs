//! `gpu-manager uninstall`: what a manager leaves on its node, removed once
//! no share uses it (deploy/uninstall: a DaemonSet applied after the
//! manager's overlay was deleted).
//!
//! A manager that stops cannot tell an uninstall from an upgrade (both are
//! a SIGTERM) and keeps everything a successor needs: vm directories with
//! their ledgers, the mirrored driver, the checkpoint, and the inventory on
//! the Node. This mode removes them, but never under a live share: while a
//! process listed in any vm directory's `pids.config` is alive (the manager
//! runs with hostPID: those are host PIDs), it refuses, names the shares,
//! and tries again until their pods are gone.

use std::path::PathBuf;

use node_agent::in_use::{self, RemoveError};

use crate::config::Settings;
use node_agent::mode;

/// The host paths the manager created: removed (recursively) when present;
/// returns those removed. The device-plugin directory itself is kubelet's:
/// only the managers' plugin sockets go.
pub fn remove_state(s: &Settings) -> Result<Vec<PathBuf>, RemoveError> {
    let mut targets = vec![
        s.virtual_manager_path.clone(),
        s.vdriver_path.clone(),
        s.checkpoint_path.clone(),
        s.display_socket.clone(),
    ];
    targets.extend(mode::device_plugin_sockets(&s.device_plugin_path));
    node_agent::in_use::remove_paths(targets)
}

/// What keeps the uninstall waiting: live shares, and a manager still
/// serving (its overlay not deleted yet, or its pod still stopping).
fn blockers(s: &Settings) -> Vec<String> {
    let mut v: Vec<String> = node_agent::in_use::shares_in_use(&s.virtual_manager_path)
        .into_iter()
        .collect();
    for p in mode::device_plugin_sockets(&s.device_plugin_path) {
        if mode::serving(&p) {
            v.push(format!("gpu-manager still serves on {}", p.display()));
        }
    }
    v
}

/// Runs the mode: waits (checking every `retry`) until no share is in use,
/// removes the state and the Node's inventory annotation, then returns what
/// it did. Cancelled first: `None`.
pub async fn run(
    s: &Settings,
    retry: std::time::Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Option<String>> {
    let forget = async {
        let key = gpu_allocator::inventory::ANNOTATION;
        match daemon_kit::apiserver::client(s.kubeconfig.as_deref()).await {
            Ok(c) => crate::world::kube_api::remove_node_annotation(&c, &s.node_name, key)
                .await
                .map(|()| format!("annotation {key} removed"))
                .unwrap_or_else(|e| format!("annotation left: {e}")),
            Err(e) => format!("annotation left (no API server: {e})"),
        }
    };
    let done = in_use::uninstall(|| blockers(s), || remove_state(s), forget, retry, cancel).await?;
    Ok(done.map(|d| {
        format!(
            "uninstalled: removed {:?}; node {}: {}",
            d.removed, s.node_name, d.cluster
        )
    }))
}
