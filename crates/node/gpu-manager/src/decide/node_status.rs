//! What the scheduler sees of this node's vcuda resources while the
//! manager restarts. Kubelet 1.20 drops a stopped plugin's devices at
//! once (all unhealthy: a pod it admits then fails with
//! `UnexpectedAdmissionError` and is never retried) but reports the lower
//! allocatable only at its next node status update (every 10 s): pods the
//! scheduler places in between fail. So a stopping manager, its plugins
//! already stopped, writes allocatable 0 itself (what kubelet will report
//! anyway) and pods wait Pending instead; the next manager, registered,
//! writes back what its plugins advertise (what kubelet will report next),
//! so they are placed at once rather than after the next update.
//!
//! The stopping manager writes the 0 twice: once on the signal, while its
//! plugins still serve (a pod placed before the scheduler saw it is still
//! admitted with devices), and again once they stopped. Written only at the
//! end, a slow write (a loaded API server, the checkpoint's fsync before it)
//! left a window where the kubelet had no devices and the scheduler still
//! placed pods (CI, phase 3b: three pods refused); written only at the
//! start, a kubelet status update before the plugins stop writes the old
//! count back for up to 10 s.

use std::time::Duration;

use device_plugin::DeviceList;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};

/// No stop or start waits longer than this on the API server.
const TIMEOUT: Duration = Duration::from_secs(3);

/// Healthy devices of a plugin's list: kubelet's allocatable for it.
pub fn healthy(list: &DeviceList) -> usize {
    list.snapshot()
        .iter()
        .filter(|d| d.health == device_plugin::api::HEALTHY)
        .count()
}

/// How long a registered manager waits for the kubelet to open its
/// ListAndWatch streams before writing allocatable anyway.
const LISTING_TIMEOUT: Duration = Duration::from_secs(5);
/// The kubelet's handling of a stream's first list, after it opened it.
const FIRST_LIST: Duration = Duration::from_millis(100);

/// Waits until the kubelet watches each of `lists` (more receivers than
/// `before`, counted before the plugins served): only then does its
/// device manager hold the devices a pod's admission checks. A fixed
/// delay after registration was not enough on a loaded node (kubelet 1.20
/// refused pods placed meanwhile with `UnexpectedAdmissionError`).
pub async fn kubelet_listing(lists: &[&DeviceList], before: [usize; 2]) {
    let watched = || lists.iter().zip(before).all(|(l, b)| l.watchers() > b);
    let wait = async {
        while !watched() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(LISTING_TIMEOUT, wait).await.is_err() {
        tracing::warn!(
            "kubelet has not opened both ListAndWatch streams within {} s; writing allocatable anyway",
            LISTING_TIMEOUT.as_secs()
        );
        return;
    }
    tokio::time::sleep(FIRST_LIST).await;
}

/// The status patch setting both resources' allocatable.
pub fn allocatable_patch(vcore: usize, vmemory: usize) -> serde_json::Value {
    serde_json::json!({"status": {"allocatable": {
        VCORE_RESOURCE: vcore.to_string(),
        VMEMORY_RESOURCE: vmemory.to_string(),
    }}})
}

/// Writes both resources' allocatable on the node's status; errors are
/// logged (kubelet's next update writes the same, only later).
pub async fn set_allocatable(client: &kube::Client, node: &str, vcore: usize, vmemory: usize) {
    let api: Api<Node> = Api::all(client.clone());
    let body = allocatable_patch(vcore, vmemory);
    let (params, patch) = (PatchParams::default(), Patch::Merge(&body));
    let t = std::time::Instant::now();
    match tokio::time::timeout(TIMEOUT, api.patch_status(node, &params, &patch)).await {
        Ok(Ok(_)) => {
            tracing::info!(
                node,
                vcore,
                vmemory,
                ms = t.elapsed().as_millis() as u64,
                "node status: vcuda allocatable written"
            );
        }
        Ok(Err(e)) => {
            tracing::warn!(node, error = %e, "writing the node's vcuda allocatable (kubelet's next status update will)");
        }
        Err(_) => {
            tracing::warn!(
                node,
                "writing the node's vcuda allocatable timed out (kubelet's next status update will)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_names_both_resources() {
        assert_eq!(
            allocatable_patch(400, 160),
            serde_json::json!({"status": {"allocatable": {
                "tencent.com/vcuda-core": "400",
                "tencent.com/vcuda-memory": "160",
            }}})
        );
    }
}
