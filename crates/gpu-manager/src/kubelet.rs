//! What kubelet actually recorded: which pod and container holds a device
//! ID. First pod-resources v1 (`List`), else kubelet's device-manager
//! checkpoint in every format kubelet has written.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use vcuda_api::podresources::v1::{
    ListPodResourcesRequest, pod_resources_lister_client::PodResourcesListerClient,
};

pub const KUBELET_CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// The holder of a device according to kubelet. pod-resources names pods by
/// namespace/name, the checkpoint by UID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodKey {
    Name { namespace: String, name: String },
    Uid(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pod: PodKey,
    pub container: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pod {
            PodKey::Name { namespace, name } => write!(f, "pod {namespace}/{name}")?,
            PodKey::Uid(u) => write!(f, "pod uid {u}")?,
        }
        write!(f, " container {}", self.container)
    }
}

#[derive(Clone, Debug)]
pub struct KubeletRecords {
    pub pod_resources_socket: PathBuf,
    pub checkpoint: PathBuf,
}

impl KubeletRecords {
    pub fn new(pod_resources_socket: &Path, device_plugin_dir: &Path) -> KubeletRecords {
        KubeletRecords {
            pod_resources_socket: pod_resources_socket.to_path_buf(),
            checkpoint: device_plugin_dir.join(KUBELET_CHECKPOINT),
        }
    }

    /// Who kubelet says holds any of `ids` of `resource`; `None` when
    /// kubelet has not recorded them (yet).
    pub async fn holder(&self, resource: &str, ids: &[String]) -> Result<Option<Holder>, String> {
        match self.query_pod_resources(resource, ids).await {
            Ok(h) => Ok(h),
            Err(pr_err) => {
                tracing::debug!(error = %pr_err, "pod-resources unavailable; reading kubelet's checkpoint");
                match std::fs::read_to_string(&self.checkpoint) {
                    Ok(text) => holder_in_checkpoint(&text, resource, ids)
                        .map_err(|e| format!("{}: {e}", self.checkpoint.display())),
                    Err(e) => Err(format!(
                        "pod-resources ({}): {pr_err}; checkpoint {}: {e}",
                        self.pod_resources_socket.display(),
                        self.checkpoint.display()
                    )),
                }
            }
        }
    }

    async fn query_pod_resources(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<Option<Holder>, String> {
        let ch = device_plugin::connect_unix(&self.pod_resources_socket, Duration::from_secs(2))
            .await
            .map_err(|e| e.to_string())?;
        let mut req = tonic::Request::new(ListPodResourcesRequest {});
        req.set_timeout(Duration::from_secs(5));
        let list = PodResourcesListerClient::new(ch)
            .list(req)
            .await
            .map_err(|s| format!("List: {}", s.message()))?
            .into_inner();
        for p in list.pod_resources {
            for c in p.containers {
                if c.devices.iter().any(|d| {
                    d.resource_name == resource && d.device_ids.iter().any(|i| ids.contains(i))
                }) {
                    return Ok(Some(Holder {
                        pod: PodKey::Name {
                            namespace: p.namespace,
                            name: p.name,
                        },
                        container: c.name,
                    }));
                }
            }
        }
        Ok(None)
    }
}

/// Finds the entry holding any of `ids` in a kubelet checkpoint: the
/// current `{"Data": {"PodDeviceEntries": [{.., "DeviceIDs": {"<numa>":
/// [..]}}]}, "Checksum": ..}`, the pre-1.20 form with `"DeviceIDs": [..]`,
/// and the oldest form without the `Data` wrapper.
pub fn holder_in_checkpoint(
    text: &str,
    resource: &str,
    ids: &[String],
) -> Result<Option<Holder>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let entries = v
        .pointer("/Data/PodDeviceEntries")
        .or_else(|| v.get("PodDeviceEntries"))
        .and_then(Value::as_array)
        .ok_or("no PodDeviceEntries")?;
    for e in entries {
        if e.get("ResourceName").and_then(Value::as_str) != Some(resource) {
            continue;
        }
        let devs: Vec<&str> = match e.get("DeviceIDs") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            Some(Value::Object(m)) => m
                .values()
                .filter_map(Value::as_array)
                .flatten()
                .filter_map(Value::as_str)
                .collect(),
            _ => vec![],
        };
        if devs.iter().any(|d| ids.iter().any(|i| i == d)) {
            let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            return Ok(Some(Holder {
                pod: PodKey::Uid(s("PodUID")),
                container: s("ContainerName"),
            }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_checkpoint_format() {
        let current = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u1","ContainerName":"c","ResourceName":"r","DeviceIDs":{"0":["a","b"]},"AllocResp":""}],"RegisteredDevices":{}},"Checksum":1}"#;
        let v1 = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"u2","ContainerName":"c","ResourceName":"r","DeviceIDs":["a"],"AllocResp":""}],"RegisteredDevices":{}},"Checksum":1}"#;
        let oldest = r#"{"PodDeviceEntries":[{"PodUID":"u3","ContainerName":"c","ResourceName":"r","DeviceIDs":["a"],"AllocResp":""}],"RegisteredDevices":{}}"#;
        for (text, uid) in [(current, "u1"), (v1, "u2"), (oldest, "u3")] {
            let h = holder_in_checkpoint(text, "r", &ids(&["a"]))
                .unwrap()
                .unwrap();
            assert_eq!(h.pod, PodKey::Uid(uid.into()));
            assert_eq!(h.container, "c");
            assert!(
                holder_in_checkpoint(text, "other", &ids(&["a"]))
                    .unwrap()
                    .is_none()
            );
            assert!(
                holder_in_checkpoint(text, "r", &ids(&["z"]))
                    .unwrap()
                    .is_none()
            );
        }
        assert!(holder_in_checkpoint("{}", "r", &[]).is_err());
    }
}
