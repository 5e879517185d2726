//! Where the world plugs into the manager: one trait per outside party,
//! so that the manager's decisions can be driven by in-memory doubles
//! (`crate::world::doubles`, built for tests only) and a backend can be swapped
//! (the container runtime: Docker or CRI v1 (containerd, CRI-O)) without
//! touching them. The signatures name only this crate's types: each
//! implementation turns its client's errors into them.
//!
//! Every source of evidence may be unreachable. The rule the manager
//! keeps: an unreachable source degrades (its evidence is skipped), it
//! never causes a release.

pub mod checkpoint;
#[cfg(test)]
pub mod doubles;
pub mod kube_api;
pub mod kubelet;
pub mod runtime;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use crate::allocation::Allocation;
use crate::world::checkpoint::{CheckpointError, Saved};

/// This node's pods as the API server lists them (a reflector in the
/// daemon).
#[async_trait::async_trait]
pub trait PodSource: Send + Sync {
    /// Whether the list is current; only `Ok` lets pods count as gone.
    fn health(&self) -> ApiHealth;
    fn pods(&self) -> Vec<Arc<Pod>>;
    /// A counter of the list's changes. Read it before `pods()` and wait
    /// with `changed_since`: a change in between is then never missed.
    fn generation(&self) -> u64;
    /// Waits until the generation differs from `seen` (at once when it
    /// already does) or `timeout` passes; false on timeout.
    async fn changed_since(&self, seen: u64, timeout: Duration) -> bool;
    /// The order in which the source first saw the pod on this node (its
    /// binding order); `None` when unknown.
    fn seen(&self, _uid: &str) -> Option<u64> {
        None
    }
}

/// Annotation patches on pods, applied in the background (never on the
/// RPC path), retried by the implementation.
pub trait PodPatcher: Send + Sync {
    fn submit(&self, job: PatchJob);
}

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

/// A container and the device IDs kubelet assigned it, by resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub pod: PodKey,
    pub container: String,
    pub ids: BTreeMap<String, Vec<String>>,
}

/// Why kubelet's device records could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubeletError {
    /// pod-resources did not answer (connecting, or its `List`).
    #[error("{0}")]
    PodResources(String),
    /// The device-manager checkpoint is not in a form kubelet writes.
    #[error("{path}: {problem}")]
    Checkpoint {
        path: String,
        problem: CheckpointFormatError,
    },
    /// Neither pod-resources nor the checkpoint answered.
    #[error("pod-resources ({socket}): {pod_resources}; checkpoint {checkpoint}: {io}")]
    Unreachable {
        socket: String,
        pod_resources: String,
        checkpoint: String,
        io: String,
    },
}

/// What is wrong with a kubelet device-manager checkpoint's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointFormatError {
    #[error("not JSON: {0}")]
    NotJson(String),
    #[error("no PodDeviceEntries")]
    NoEntries,
}

/// What kubelet recorded about device IDs: pod-resources, else its
/// device-manager checkpoint. An `Err` names why neither answered.
#[async_trait::async_trait]
pub trait KubeletSource: Send + Sync {
    /// Who holds any of `ids` of `resource`; `None` when kubelet has not
    /// recorded them (yet).
    async fn holder(&self, resource: &str, ids: &[String]) -> Result<Option<Holder>, KubeletError>;
    /// Every container holding devices of `resources`, with its IDs.
    async fn held(&self, resources: &[&str]) -> Result<Vec<Held>, KubeletError>;
    /// The pods kubelet admits or runs now (namespace, name), from
    /// pod-resources `List`: those it refused at admission are not among
    /// them, while the API server may still show them Pending. Only since
    /// 1.34 (`KubeletPodResourcesListUseActivePods` on by default,
    /// pkg/kubelet/apis/podresources/server_v1.go); an older kubelet lists
    /// every pod it was given, refused ones too.
    async fn active_pods(&self) -> Result<Vec<(String, String)>, KubeletError>;
}

/// The container runtime's view of the node's Kubernetes containers.
/// Implementations: Docker ([`crate::world::runtime::Docker`]), CRI v1
/// (containerd, CRI-O: [`crate::world::runtime::Cri`], from `ListContainers` +
/// `ContainerStatus`'s labels, state and mounts), none
/// ([`crate::world::runtime::NoRuntime`]).
#[async_trait::async_trait]
pub trait ContainerRuntime: Send + Sync {
    /// For logs and errors ("docker at unix:///run/docker.sock").
    fn describe(&self) -> String;
    /// Every Kubernetes container, running or not (not the pod sandbox).
    /// `Ok(None)`: no runtime configured. `Err`: unreachable; the caller
    /// skips this evidence and releases nothing on its account.
    async fn containers(&self) -> Result<Option<Vec<LiveContainer>>, RuntimeError>;
    /// The GPUs one container was given (rebuilding a lost allocation).
    async fn gpus(&self, id: &str) -> Result<ContainerGpus, RuntimeError>;
}

/// The durable record of the allocations, typed both ways (the format is
/// [`crate::world::checkpoint::encode`] and [`crate::world::checkpoint::parse`]'s).
/// Called off the async threads (writes sync to disk).
pub trait CheckpointStore: Send + Sync {
    /// Where it lives, for messages.
    fn location(&self) -> String;
    /// The saved GPU UUIDs and allocations; `None` when there is none yet.
    fn load(&self) -> Result<Option<Saved>, CheckpointError>;
    /// Replaces the record with `gpus` and `allocations` durably; on
    /// failure the previous record stays intact.
    fn store(&self, gpus: &[String], allocations: &[Allocation]) -> Result<(), CheckpointError>;
    /// Moves an unreadable record out of the way; where it went.
    fn set_aside(&self) -> Result<Vec<PathBuf>, CheckpointError>;
}

/// The parties a [`crate::manager::Manager`] talks to.
#[derive(Clone)]
pub struct World {
    pub pods: Arc<dyn PodSource>,
    pub patcher: Arc<dyn PodPatcher>,
    pub events: Arc<dyn node_agent::events::EventSink>,
    pub kubelet: Arc<dyn KubeletSource>,
    pub checkpoint: Arc<dyn CheckpointStore>,
    pub runtime: Arc<dyn ContainerRuntime>,
}

/// Why a runtime could not be asked, in neutral terms: each backend turns
/// its client's errors into these, so callers see no client types.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "container runtime {endpoint}: no answer within {0:?}",
        RUNTIME_TIMEOUT
    )]
    Timeout { endpoint: String },
    /// The runtime could not be asked (not listening, refused, an error
    /// answer; a test double), with the backend's reason.
    #[error("container runtime {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    /// It answers but does not serve the call (a containerd whose CRI
    /// plugin is disabled, as in Docker's own).
    #[error("container runtime {endpoint}: {reason}")]
    Unsupported { endpoint: String, reason: String },
}

/// How long a container runtime gets to answer one call.
pub const RUNTIME_TIMEOUT: Duration = Duration::from_secs(5);

/// One Kubernetes container the runtime knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveContainer {
    pub id: String,
    pub pod_uid: String,
    pub pod_name: String,
    pub namespace: String,
    pub container: String,
    /// Running, paused, restarting or created (about to start): it may use
    /// its devices. Exited, dead and being-removed containers do not.
    pub alive: bool,
    /// Host source of the `/etc/vcuda` mount.
    pub vm_source: Option<PathBuf>,
}

/// What only an inspect tells: the GPUs a container was given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerGpus {
    /// `NVIDIA_VISIBLE_DEVICES` (GPU UUIDs).
    pub visible: Vec<String>,
    /// Its `/dev/nvidia<N>` devices, as the container sees them (the
    /// AllocateResponse names the same path on both sides; the OCI spec
    /// that CRI-O returns has only this side).
    pub devices: Vec<String>,
}

/// Reachability of the API server as the reflector last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiHealth {
    Starting,
    Ok,
    Failing(String),
}

/// One annotation patch to apply.
#[derive(Debug, Clone)]
pub struct PatchJob {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
}
