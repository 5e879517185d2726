//! What the display needs from the manager: a narrow, synchronous view of
//! its state. The manager implements [`DisplaySource`]; every call happens on
//! a scrape or an RPC, so implementations should only copy out of their own
//! state (take a lock, clone, release), never do I/O.

use serde::{Deserialize, Serialize};

/// The manager's state, as the display service and the metrics see it.
pub trait DisplaySource: Send + Sync + 'static {
    /// Node name for the `node` label (the manager's `--hostname-override`).
    fn node_name(&self) -> String;

    /// Version string answered by `Version` and `/version`.
    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

    /// Text rendering of the topology tree with free/used cores and memory
    /// per GPU (`PrintGraph`, `/graph`), e.g. `gpu_allocator::Allocator::render`.
    fn graph_text(&self) -> String;

    /// Every GPU of the node, by NVML index.
    fn gpus(&self) -> Vec<GpuView>;

    /// Every container holding an allocation.
    fn containers(&self) -> Vec<ContainerView>;

    /// MIG devices whose instance was destroyed while a pod or claim held
    /// them (docs/mig.md): `vcuda_mig_device_lost`.
    fn lost_mig_devices(&self) -> Vec<LostMigView> {
        Vec::new()
    }

    /// Dynamic MIG's state, where the node has it (device-plugin mode,
    /// docs/mig.md): `vcuda_mig_dynamic_*`.
    fn dynamic_mig(&self) -> Option<DynamicMigView> {
        None
    }

    /// Whether the process can go on (`/healthz`, the liveness probe): an
    /// `Err` says why it needs a restart.
    fn health(&self) -> Result<(), Unhealthy> {
        Ok(())
    }
}

/// Why a daemon needs a restart, as `/healthz` says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Unhealthy {
    pub reason: String,
}

/// One GPU as the allocator sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuView {
    /// NVML device index (the sampler's key).
    pub index: u32,
    pub uuid: String,
    /// PCI bus id, e.g. `00000000:07:00.0`.
    #[serde(default)]
    pub bus_id: String,
    #[serde(default)]
    pub model: String,
    pub memory_total_bytes: u64,
    /// Cores handed out, percent of this GPU (0..=100).
    #[serde(default)]
    pub allocated_cores: u32,
    #[serde(default)]
    pub allocated_memory_bytes: u64,
    #[serde(default = "yes")]
    pub healthy: bool,
    /// Containers holding a share or all of it.
    #[serde(default)]
    pub tenants: u32,
    /// Compute tiers (docs/qos.md): time batch launches were held for a
    /// latency tenant, and how many; `None` without tiered shares on it.
    #[serde(default)]
    pub batch_held_seconds: Option<f64>,
    #[serde(default)]
    pub batch_holds: Option<u64>,
    /// Memory its shares hold above their guarantees (lent out).
    #[serde(default)]
    pub memory_lent_bytes: u64,
}

fn yes() -> bool {
    true
}

/// A MIG device whose instance is gone while something holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostMigView {
    /// The parent GPU's NVML index.
    pub gpu: u32,
    /// `MIG-…`.
    pub uuid: String,
    /// What holds it: the device-plugin resource, or the DRA claim
    /// (`namespace/name`).
    pub holder: String,
}

/// Dynamic MIG on a node (device-plugin mode).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicMigView {
    /// Per profile pods needed at the last pass, how many fit on no
    /// dynamic GPU (0 once they did).
    pub unplaced: std::collections::BTreeMap<String, u64>,
    /// Instances made and destroyed since the daemon started.
    pub made: u64,
    pub destroyed: u64,
}

/// A GPU assigned to a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    /// NVML device index.
    pub index: u32,
    pub uuid: String,
    #[serde(default)]
    pub bus_id: String,
}

/// One container holding an allocation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerView {
    pub pod_uid: String,
    pub pod_name: String,
    pub namespace: String,
    pub container: String,
    pub gpus: Vec<GpuRef>,
    /// `tencent.com/vcuda-core`: percent of one GPU (100 = a whole GPU, 200 = two).
    pub core_quota: u32,
    /// Memory quota in bytes (the whole cards' memory for exclusive containers).
    pub memory_quota_bytes: u64,
    /// Host PIDs of the container's CUDA processes (from SO_PEERCRED
    /// registrations / `pids.config`); utilization is the sum of theirs.
    #[serde(default)]
    pub host_pids: Vec<u32>,
    /// Holds its GPUs whole (no interposer, so no PID registrations): every
    /// process on its GPUs is counted as its own.
    #[serde(default)]
    pub exclusive: bool,
    /// From the container's ledger, when the interposer keeps one: total time
    /// kernel launches were held back by the core quota.
    #[serde(default)]
    pub throttled_seconds: Option<f64>,
    /// From the container's ledger: allocations refused for the memory quota.
    #[serde(default)]
    pub refused_allocations: Option<u64>,
    /// From the container's ledger: the interposer's compute quota cannot
    /// attribute NVML's samples to the container (and has fallen back).
    #[serde(default)]
    pub compute_unattributed: Option<bool>,
    /// From the ledger: bytes held above the memory quota (a share with a
    /// memory limit above it borrows them; docs/qos.md).
    #[serde(default)]
    pub memory_borrowed_bytes: Option<u64>,
    /// Its processes ended to give borrowed memory back.
    #[serde(default)]
    pub memory_reclaims: Option<u64>,
    /// From the ledger: time its batch-tier launches waited for a
    /// latency-tier tenant of their GPU (docs/qos.md).
    #[serde(default)]
    pub batch_held_seconds: Option<f64>,
    /// `ContainerStat.user` of the display API (the original read the
    /// `SUBMITTER` env of the pod).
    #[serde(default)]
    pub user: String,
    /// `ContainerStat.cluster` of the display API.
    #[serde(default)]
    pub cluster: String,
    /// The share's vm directory on the host (mounted at `/etc/vcuda` in
    /// the container): how the escape guard knows a process is in it.
    /// Not shown to clients.
    #[serde(skip)]
    pub vm_dir: Option<std::path::PathBuf>,
}
