//! What the container runtime says runs on the node: Kubernetes containers
//! (labels `io.kubernetes.*`, as kubelet, dockershim and cri-dockerd set
//! them), their state and the host directory mounted at `/etc/vcuda`,
//! behind [`ContainerRuntime`]. Docker through `bollard` (here), CRI v1
//! (containerd, CRI-O) in [`cri`], and which one a node has in [`select`].

mod cri;
mod select;

pub use cri::{Cri, gpus_from_info, kubernetes_container};
pub use select::{Kind, Sockets, detect, select};

use std::collections::HashMap;
use std::path::PathBuf;

use bollard::models::ContainerSummaryStateEnum;
use bollard::query_parameters::{InspectContainerOptions, ListContainersOptionsBuilder};

use crate::world::{ContainerGpus, ContainerRuntime, LiveContainer, RUNTIME_TIMEOUT, RuntimeError};

pub const LABEL_POD_UID: &str = "io.kubernetes.pod.uid";
pub const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
pub const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const LABEL_CONTAINER: &str = "io.kubernetes.container.name";
/// Where the AllocateResponse mounts the container's vm directory.
pub const VM_MOUNT: &str = "/etc/vcuda";

/// `NVIDIA_VISIBLE_DEVICES`'s value as a list.
fn visible_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// `/dev/nvidia<N>`: a GPU (not nvidiactl, nvidia-uvm, ...).
fn nvidia_minor_path(p: &str) -> bool {
    p.strip_prefix("/dev/nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Docker (or cri-dockerd's engine) at an endpoint.
#[derive(Clone, Debug)]
pub struct Docker {
    endpoint: String,
}

/// No runtime to reconcile with (`--container-runtime none`).
#[derive(Clone, Debug)]
pub struct NoRuntime;

#[async_trait::async_trait]
impl ContainerRuntime for NoRuntime {
    fn describe(&self) -> String {
        "none".into()
    }

    async fn containers(&self) -> Result<Option<Vec<LiveContainer>>, RuntimeError> {
        Ok(None)
    }

    async fn gpus(&self, _id: &str) -> Result<ContainerGpus, RuntimeError> {
        Ok(ContainerGpus::default())
    }
}

impl Docker {
    /// Docker at `endpoint` (`unix:///path` or a path). Nothing is dialled
    /// here: a missing socket is a degraded source at each use, never a
    /// startup failure.
    pub fn new(endpoint: &str) -> Docker {
        Docker {
            endpoint: endpoint.to_string(),
        }
    }

    /// A client speaking the engine's API version (negotiated per call: a
    /// restarted or upgraded engine may answer differently).
    async fn negotiated(&self) -> Result<bollard::Docker, RuntimeError> {
        let endpoint = &self.endpoint;
        let err = |e| docker_error(endpoint, e);
        // Connected per use: the engine may restart, move or be upgraded;
        // the API version is negotiated down to what it speaks (Debian's
        // 20.10 tops at 1.41, bollard asks 1.53 by default).
        let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
        let client = bollard::Docker::connect_with_unix(
            path,
            RUNTIME_TIMEOUT.as_secs(),
            bollard::API_DEFAULT_VERSION,
        )
        .map_err(err)?;
        match tokio::time::timeout(RUNTIME_TIMEOUT, client.negotiate_version()).await {
            Ok(r) => r.map_err(err),
            Err(_) => Err(RuntimeError::Timeout {
                endpoint: endpoint.clone(),
            }),
        }
    }
}

/// A bollard error as the neutral [`RuntimeError`], with the operator's
/// hint.
fn docker_error(endpoint: &str, e: bollard::errors::Error) -> RuntimeError {
    RuntimeError::Unreachable {
        endpoint: endpoint.to_string(),
        reason: format!("{e}; is Docker running and --container-runtime-endpoint right?"),
    }
}

#[async_trait::async_trait]
impl ContainerRuntime for Docker {
    fn describe(&self) -> String {
        format!("docker at {}", self.endpoint)
    }

    async fn containers(&self) -> Result<Option<Vec<LiveContainer>>, RuntimeError> {
        let d = self.negotiated().await?;
        let endpoint = self.describe();
        let filters = HashMap::from([("label", vec![LABEL_POD_UID])]);
        let opts = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let list = match tokio::time::timeout(RUNTIME_TIMEOUT, d.list_containers(Some(opts))).await
        {
            Ok(r) => r.map_err(|e| docker_error(&endpoint, e))?,
            Err(_) => return Err(RuntimeError::Timeout { endpoint }),
        };
        Ok(Some(
            list.into_iter()
                .filter_map(|c| {
                    let labels = c.labels.unwrap_or_default();
                    let l = |k: &str| labels.get(k).cloned().unwrap_or_default();
                    let container = l(LABEL_CONTAINER);
                    // The pause ("POD") sandbox carries the pod labels too.
                    if container.is_empty() || container == "POD" {
                        return None;
                    }
                    let alive = matches!(
                        c.state,
                        Some(
                            ContainerSummaryStateEnum::RUNNING
                                | ContainerSummaryStateEnum::PAUSED
                                | ContainerSummaryStateEnum::RESTARTING
                                | ContainerSummaryStateEnum::CREATED
                        )
                    );
                    let vm_source = c.mounts.unwrap_or_default().into_iter().find_map(|m| {
                        (m.destination.as_deref() == Some(VM_MOUNT))
                            .then_some(m.source)
                            .flatten()
                            .map(PathBuf::from)
                    });
                    Some(LiveContainer {
                        id: c.id.unwrap_or_default(),
                        pod_uid: l(LABEL_POD_UID),
                        pod_name: l(LABEL_POD_NAME),
                        namespace: l(LABEL_POD_NAMESPACE),
                        container,
                        alive,
                        vm_source,
                    })
                })
                .collect(),
        ))
    }

    async fn gpus(&self, id: &str) -> Result<ContainerGpus, RuntimeError> {
        let d = self.negotiated().await?;
        let endpoint = self.describe();
        let info = match tokio::time::timeout(
            RUNTIME_TIMEOUT,
            d.inspect_container(id, None::<InspectContainerOptions>),
        )
        .await
        {
            Ok(r) => r.map_err(|e| docker_error(&endpoint, e))?,
            Err(_) => return Err(RuntimeError::Timeout { endpoint }),
        };
        let visible = info
            .config
            .and_then(|c| c.env)
            .unwrap_or_default()
            .iter()
            .find_map(|e| {
                e.strip_prefix("NVIDIA_VISIBLE_DEVICES=")
                    .map(str::to_string)
            })
            .map(|v| visible_list(&v))
            .unwrap_or_default();
        let devices = info
            .host_config
            .and_then(|h| h.devices)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| d.path_in_container)
            .filter(|p| nvidia_minor_path(p))
            .collect();
        Ok(ContainerGpus { visible, devices })
    }
}
