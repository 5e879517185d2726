//! The CRI v1 backend (containerd, CRI-O): kubelet's own view of the
//! node's containers, over the runtime's socket.
//!
//! * `ListContainers` + `ListPodSandbox`: the Kubernetes containers, their
//!   state and pod (from the `io.kubernetes.*` labels kubelet sets, else the
//!   sandbox's metadata).
//! * `ContainerStatus`: the mounts (the host side of `/etc/vcuda`), for
//!   every container; verbose, for [`ContainerRuntime::gpus`]: the runtime's
//!   `info["info"]` JSON. containerd puts kubelet's `config` (envs, devices)
//!   and the OCI `runtimeSpec` there; CRI-O only the `runtimeSpec` (with
//!   `sandboxID`, `pid`, `privileged`), whose environment also holds the
//!   image's variables (the container's value wins: it comes last) and
//!   whose devices name only container paths. Both shapes are read.
//!
//! Connected per use, like Docker: the runtime restarts and moves. Every
//! call is bounded; a runtime that cannot be asked is
//! [`RuntimeError::Unreachable`], one that does not serve CRI
//! [`RuntimeError::Unsupported`] (the caller degrades, never releases).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use cri_api::v1::runtime_service_client::RuntimeServiceClient;
use cri_api::v1::{
    Container, ContainerState, ContainerStatusRequest, ListContainersRequest,
    ListPodSandboxRequest, PodSandbox, VersionRequest,
};
use tonic::transport::Channel;

use super::{
    LABEL_CONTAINER, LABEL_POD_NAME, LABEL_POD_NAMESPACE, LABEL_POD_UID, VM_MOUNT,
    nvidia_minor_path, visible_list,
};
use crate::world::{ContainerGpus, ContainerRuntime, LiveContainer, RUNTIME_TIMEOUT, RuntimeError};

/// The verbose `ContainerStatus` info key both containerd and CRI-O use.
const INFO_KEY: &str = "info";
/// The CRI API version sent in `Version` (kubelet sends its own).
const CRI_VERSION: &str = "v1";

/// A CRI v1 runtime at a unix socket.
#[derive(Clone, Debug)]
pub struct Cri {
    /// "containerd", "cri-o", or what the runtime called itself.
    name: String,
    endpoint: String,
    timeout: Duration,
}

impl Cri {
    /// The runtime `name` (for logs) at `endpoint` (`unix:///path` or a
    /// path). Nothing is dialled here: a missing socket is a degraded
    /// source at each use, never a startup failure.
    pub fn new(name: &str, endpoint: &str) -> Cri {
        Cri {
            name: name.to_string(),
            endpoint: endpoint.to_string(),
            timeout: RUNTIME_TIMEOUT,
        }
    }

    /// The bound on each connection and call (tests shorten it).
    pub fn with_timeout(mut self, timeout: Duration) -> Cri {
        self.timeout = timeout;
        self
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(
            self.endpoint
                .strip_prefix("unix://")
                .unwrap_or(&self.endpoint),
        )
    }

    fn unreachable(&self, reason: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::Unreachable {
            endpoint: self.describe(),
            reason: reason.to_string(),
        }
    }

    async fn client(&self) -> Result<RuntimeServiceClient<Channel>, RuntimeError> {
        let ch = device_plugin::connect_unix(self.path(), self.timeout)
            .await
            .map_err(|e| {
                self.unreachable(format!(
                    "{e}; is the runtime running and --container-runtime-endpoint right?"
                ))
            })?;
        // A node's full container list with labels can pass tonic's 4 MiB.
        Ok(RuntimeServiceClient::new(ch).max_decoding_message_size(64 << 20))
    }

    /// One RPC, bounded by the timeout; a failure names the call.
    async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, RuntimeError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => {
                let reason = format!("{what}: {:?}: {}", s.code(), s.message());
                Err(match s.code() {
                    tonic::Code::Unimplemented => RuntimeError::Unsupported {
                        endpoint: self.describe(),
                        reason,
                    },
                    _ => self.unreachable(reason),
                })
            }
            Err(_) => Err(self.unreachable(format!("{what}: no answer within {:?}", self.timeout))),
        }
    }

    /// What the runtime calls itself and its version (`Version`).
    pub async fn version(&self) -> Result<(String, String), RuntimeError> {
        let mut c = self.client().await?;
        let v = self
            .call(
                "Version",
                c.version(VersionRequest {
                    version: CRI_VERSION.into(),
                }),
            )
            .await?;
        Ok((v.runtime_name, v.runtime_version))
    }
}

#[async_trait::async_trait]
impl ContainerRuntime for Cri {
    fn describe(&self) -> String {
        format!("{} (CRI) at {}", self.name, self.endpoint)
    }

    async fn containers(&self) -> Result<Option<Vec<LiveContainer>>, RuntimeError> {
        let mut c = self.client().await?;
        let list = self
            .call(
                "ListContainers",
                c.list_containers(ListContainersRequest { filter: None }),
            )
            .await?
            .containers;
        let sandboxes: HashMap<String, PodSandbox> = self
            .call(
                "ListPodSandbox",
                c.list_pod_sandbox(ListPodSandboxRequest { filter: None }),
            )
            .await?
            .items
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect();
        let mut out = Vec::new();
        for k in list {
            let Some(mut live) = kubernetes_container(&k, sandboxes.get(&k.pod_sandbox_id)) else {
                continue;
            };
            // Mounts are only in the status. One call per container: a
            // node runs tens to a few hundred.
            let status = tokio::time::timeout(
                self.timeout,
                c.container_status(ContainerStatusRequest {
                    container_id: k.id.clone(),
                    verbose: false,
                }),
            )
            .await;
            match status {
                Ok(Ok(r)) => {
                    if let Some(s) = r.into_inner().status {
                        live.alive = alive(s.state());
                        live.vm_source = s
                            .mounts
                            .iter()
                            .find(|m| m.container_path == VM_MOUNT && !m.host_path.is_empty())
                            .map(|m| PathBuf::from(&m.host_path));
                    }
                }
                // Removed between the list and the status: gone.
                Ok(Err(s)) if s.code() == tonic::Code::NotFound => continue,
                Ok(Err(s)) => {
                    return Err(self.unreachable(format!(
                        "ContainerStatus {}: {:?}: {}",
                        k.id,
                        s.code(),
                        s.message()
                    )));
                }
                Err(_) => {
                    return Err(self.unreachable(format!(
                        "ContainerStatus {}: no answer within {:?}",
                        k.id, self.timeout
                    )));
                }
            }
            out.push(live);
        }
        Ok(Some(out))
    }

    async fn gpus(&self, id: &str) -> Result<ContainerGpus, RuntimeError> {
        let mut c = self.client().await?;
        let r = self
            .call(
                "ContainerStatus (verbose)",
                c.container_status(ContainerStatusRequest {
                    container_id: id.to_string(),
                    verbose: true,
                }),
            )
            .await?;
        let info = r.info.get(INFO_KEY).ok_or_else(|| {
            self.unreachable(format!(
                "ContainerStatus {id}: no {INFO_KEY:?} in the verbose answer (keys: {:?})",
                r.info.keys().collect::<Vec<_>>()
            ))
        })?;
        gpus_from_info(info).map_err(|e| self.unreachable(format!("ContainerStatus {id}: {e}")))
    }
}

/// Created (about to start), running, or in a state the runtime cannot
/// tell: it may use its devices. Only exited containers do not.
fn alive(s: ContainerState) -> bool {
    !matches!(s, ContainerState::ContainerExited)
}

/// A Kubernetes container from its list entry: the pod from kubelet's
/// labels, else from its sandbox's metadata; `None` for containers kubelet
/// did not create. Mounts come later, from the status.
pub fn kubernetes_container(c: &Container, sandbox: Option<&PodSandbox>) -> Option<LiveContainer> {
    let label = |k: &str| c.labels.get(k).filter(|v| !v.is_empty()).cloned();
    let meta = sandbox.and_then(|s| s.metadata.as_ref());
    let pod_uid = label(LABEL_POD_UID).or_else(|| meta.map(|m| m.uid.clone()))?;
    let container = label(LABEL_CONTAINER)
        .or_else(|| c.metadata.as_ref().map(|m| m.name.clone()))
        .filter(|n| !n.is_empty())?;
    if pod_uid.is_empty() {
        return None;
    }
    Some(LiveContainer {
        id: c.id.clone(),
        pod_uid,
        pod_name: label(LABEL_POD_NAME)
            .or_else(|| meta.map(|m| m.name.clone()))
            .unwrap_or_default(),
        namespace: label(LABEL_POD_NAMESPACE)
            .or_else(|| meta.map(|m| m.namespace.clone()))
            .unwrap_or_default(),
        container,
        alive: alive(c.state()),
        vm_source: None,
    })
}

/// Why a verbose status's `info` tells no GPUs.
#[derive(Debug, thiserror::Error)]
pub enum InfoError {
    #[error("info is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("info has neither \"config\" nor \"runtimeSpec\"")]
    NoConfig,
}

/// `NVIDIA_VISIBLE_DEVICES` and `/dev/nvidia<N>` devices from a verbose
/// status's `info` JSON: kubelet's `config` where the runtime keeps it
/// (containerd), else the OCI `runtimeSpec` (containerd and CRI-O).
pub fn gpus_from_info(info: &str) -> Result<ContainerGpus, InfoError> {
    let v: serde_json::Value = serde_json::from_str(info).map_err(InfoError::NotJson)?;
    let config = &v["config"];
    let spec = &v["runtimeSpec"];
    if config.is_null() && spec.is_null() {
        return Err(InfoError::NoConfig);
    }
    // kubelet's envs, else the process environment (last one wins, as in
    // execve's view).
    let from_config = config["envs"].as_array().and_then(|envs| {
        envs.iter()
            .rev()
            .find(|e| e["key"] == "NVIDIA_VISIBLE_DEVICES")
            .and_then(|e| e["value"].as_str().map(str::to_string))
    });
    let visible = from_config
        .or_else(|| {
            spec["process"]["env"].as_array().and_then(|env| {
                env.iter().rev().find_map(|e| {
                    e.as_str()?
                        .strip_prefix("NVIDIA_VISIBLE_DEVICES=")
                        .map(str::to_string)
                })
            })
        })
        .map(|v| visible_list(&v))
        .unwrap_or_default();
    let mut devices: Vec<String> = config["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["container_path"].as_str())
        .chain(
            spec["linux"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|d| d["path"].as_str()),
        )
        .filter(|p| nvidia_minor_path(p))
        .map(str::to_string)
        .collect();
    devices.sort();
    devices.dedup();
    Ok(ContainerGpus { visible, devices })
}

#[cfg(test)]
mod tests;
