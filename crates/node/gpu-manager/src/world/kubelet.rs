//! What kubelet actually recorded: which pod and container holds a device
//! ID. First pod-resources v1 (`List`), else kubelet's device-manager
//! checkpoint in every format kubelet has written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tonic::transport::Channel;
use vcuda_api::podresources::v1::{
    ListPodResourcesRequest, ListPodResourcesResponse,
    pod_resources_lister_client::PodResourcesListerClient,
};

use crate::world::{CheckpointFormatError, Held, Holder, KubeletError, KubeletSource, PodKey};

pub const KUBELET_CHECKPOINT: &str = "kubelet_internal_checkpoint";

#[derive(Clone, Debug)]
pub struct KubeletRecords {
    pub pod_resources_socket: PathBuf,
    pub checkpoint: PathBuf,
    // One connection kept across calls: every Allocate asks for the active
    // pods, and a fresh connect per call cost more than the List itself.
    channel: Arc<tokio::sync::Mutex<Option<Channel>>>,
}

impl KubeletRecords {
    pub fn new(pod_resources_socket: &Path, device_plugin_dir: &Path) -> KubeletRecords {
        KubeletRecords {
            pod_resources_socket: pod_resources_socket.to_path_buf(),
            checkpoint: device_plugin_dir.join(KUBELET_CHECKPOINT),
            channel: Arc::default(),
        }
    }

    /// One pod-resources `List` call, on the kept connection; a call that
    /// fails on it (kubelet restarted: a new socket) is tried once more on
    /// a new one.
    async fn pod_resources_list(&self) -> Result<ListPodResourcesResponse, KubeletError> {
        let mut kept = self.channel.lock().await;
        let mut retry = kept.is_some();
        loop {
            let ch = match kept.as_ref() {
                Some(ch) => ch.clone(),
                None => {
                    let ch = device_plugin::connect_unix(
                        &self.pod_resources_socket,
                        Duration::from_secs(2),
                    )
                    .await
                    .map_err(|e| KubeletError::PodResources(e.to_string()))?;
                    kept.insert(ch).clone()
                }
            };
            let mut req = tonic::Request::new(ListPodResourcesRequest {});
            req.set_timeout(Duration::from_secs(5));
            match PodResourcesListerClient::new(ch).list(req).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if retry => {
                    tracing::debug!(error = %s.message(), "pod-resources List on the kept connection: reconnecting");
                    (*kept, retry) = (None, false);
                }
                Err(s) => {
                    *kept = None;
                    return Err(KubeletError::PodResources(format!("List: {}", s.message())));
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl KubeletSource for KubeletRecords {
    async fn holder(&self, resource: &str, ids: &[String]) -> Result<Option<Holder>, KubeletError> {
        match self.query_pod_resources(resource, ids).await {
            Ok(h) => Ok(h),
            Err(pr_err) => {
                tracing::debug!(error = %pr_err, "pod-resources unavailable; reading kubelet's checkpoint");
                let text = self.read_checkpoint(pr_err)?;
                holder_in_checkpoint(&text, resource, ids).map_err(|e| self.bad_checkpoint(e))
            }
        }
    }

    async fn active_pods(&self) -> Result<Vec<(String, String)>, KubeletError> {
        let list = self.pod_resources_list().await?;
        Ok(list
            .pod_resources
            .into_iter()
            .map(|p| (p.namespace, p.name))
            .collect())
    }

    async fn held(&self, resources: &[&str]) -> Result<Vec<Held>, KubeletError> {
        match self.list_pod_resources(resources).await {
            Ok(v) => Ok(v),
            Err(pr_err) => {
                let text = self.read_checkpoint(pr_err)?;
                held_in_checkpoint(&text, resources).map_err(|e| self.bad_checkpoint(e))
            }
        }
    }
}

impl KubeletRecords {
    /// The device-manager checkpoint, read when pod-resources failed with
    /// `pod_resources`; neither answering is one error naming both.
    fn read_checkpoint(&self, pod_resources: KubeletError) -> Result<String, KubeletError> {
        std::fs::read_to_string(&self.checkpoint).map_err(|e| KubeletError::Unreachable {
            socket: self.pod_resources_socket.display().to_string(),
            pod_resources: pod_resources.to_string(),
            checkpoint: self.checkpoint.display().to_string(),
            io: e.to_string(),
        })
    }

    fn bad_checkpoint(&self, problem: CheckpointFormatError) -> KubeletError {
        KubeletError::Checkpoint {
            path: self.checkpoint.display().to_string(),
            problem,
        }
    }

    async fn list_pod_resources(&self, resources: &[&str]) -> Result<Vec<Held>, KubeletError> {
        let list = self.pod_resources_list().await?;
        let mut out = Vec::new();
        for p in list.pod_resources {
            for c in p.containers {
                let mut h = Held {
                    pod: PodKey::Name {
                        namespace: p.namespace.clone(),
                        name: p.name.clone(),
                    },
                    container: c.name,
                    ids: BTreeMap::new(),
                };
                for d in c.devices {
                    if resources.contains(&d.resource_name.as_str()) {
                        h.ids
                            .entry(d.resource_name)
                            .or_default()
                            .extend(d.device_ids);
                    }
                }
                if !h.ids.is_empty() {
                    out.push(h);
                }
            }
        }
        Ok(out)
    }

    async fn query_pod_resources(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<Option<Holder>, KubeletError> {
        let list = self.pod_resources_list().await?;
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

fn checkpoint_entries(text: &str) -> Result<Vec<Value>, CheckpointFormatError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| CheckpointFormatError::NotJson(e.to_string()))?;
    v.pointer("/Data/PodDeviceEntries")
        .or_else(|| v.get("PodDeviceEntries"))
        .and_then(Value::as_array)
        .cloned()
        .ok_or(CheckpointFormatError::NoEntries)
}

fn entry_ids(e: &Value) -> Vec<String> {
    match e.get("DeviceIDs") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        Some(Value::Object(m)) => m
            .values()
            .filter_map(Value::as_array)
            .flatten()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => vec![],
    }
}

/// Every container of a kubelet checkpoint holding `resources`.
pub fn held_in_checkpoint(
    text: &str,
    resources: &[&str],
) -> Result<Vec<Held>, CheckpointFormatError> {
    let mut out: Vec<Held> = Vec::new();
    for e in checkpoint_entries(text)? {
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let res = s("ResourceName");
        if !resources.contains(&res.as_str()) {
            continue;
        }
        let (pod, container) = (PodKey::Uid(s("PodUID")), s("ContainerName"));
        let ids = entry_ids(&e);
        match out
            .iter_mut()
            .find(|h| h.pod == pod && h.container == container)
        {
            Some(h) => h.ids.entry(res).or_default().extend(ids),
            None => out.push(Held {
                pod,
                container,
                ids: BTreeMap::from([(res, ids)]),
            }),
        }
    }
    Ok(out)
}

/// Finds the entry holding any of `ids` in a kubelet checkpoint: the
/// current `{"Data": {"PodDeviceEntries": [{.., "DeviceIDs": {"<numa>":
/// [..]}}]}, "Checksum": ..}`, the pre-1.20 form with `"DeviceIDs": [..]`,
/// and the oldest form without the `Data` wrapper.
pub fn holder_in_checkpoint(
    text: &str,
    resource: &str,
    ids: &[String],
) -> Result<Option<Holder>, CheckpointFormatError> {
    for e in checkpoint_entries(text)? {
        if e.get("ResourceName").and_then(Value::as_str) != Some(resource) {
            continue;
        }
        let devs = entry_ids(&e);
        if devs.iter().any(|d| ids.contains(d)) {
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
            let held = held_in_checkpoint(text, &["r"]).unwrap();
            assert_eq!(held.len(), 1);
            let want = if uid == "u1" {
                ids(&["a", "b"])
            } else {
                ids(&["a"])
            };
            assert_eq!(held[0].ids["r"], want);
        }
        assert!(holder_in_checkpoint("{}", "r", &[]).is_err());
    }
}
