//! The manager: its state and the decisions behind Allocate,
//! PreStartContainer, recovery and the periodic check. One file per job:
//!
//! * [`state`]: what one `Mutex<State>` guards, and how a poisoned lock is
//!   handled.
//! * [`persist`]: group-commit writes of the checkpoint.
//! * [`restore`]: recovery at start (checkpoint reconciled with the node);
//!   [`rebuild`]: an allocation the checkpoint lost, from the node.
//! * [`allocate`]: Allocate for vcuda-core and vcuda-memory.
//! * [`prestart`]: PreStartContainer's check of the guessed pod.
//! * [`refusal`]: why a call is refused, rendered to gRPC only by the
//!   plugin edge.
//! * [`sweep`]: releases (deleted pods, dead containers) and GPU health.
//!
//! The outside parties (API server, kubelet, container runtime, checkpoint
//! store, events) come in as [`World`] traits, so the decisions have unit
//! tests of their own (`tests`, with `crate::world::doubles`).
//!
//! Locks: the state lock is never held across an await, a disk sync or
//! other file-system work (vm directories, ledgers, sockets are handled
//! outside it, serialised by `files`); an async lock serialises Allocate
//! calls as kubelet does.

mod allocate;
mod in_mig;
mod persist;
mod prestart;
mod rebuild;
mod refusal;
mod restore;
mod state;
mod sweep;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use device_plugin::DeviceList;
use gpu_allocator::{Allocator, GpuInfo, MEMORY_UNIT_BYTES, Placement};
use node_agent::share::{ShareError, ShareGpu, ShareSpec, Shares};

use crate::allocation::Allocation;
use crate::decide::ids;
use crate::world::{
    CheckpointStore, ContainerRuntime, KubeletSource, PodPatcher, PodSource, World,
};
use node_agent::events::EventSink;
use node_agent::extra::ExtraConfig;
use node_agent::registry::Registry;

pub use in_mig::{Found as SharedFound, served_whole, shared_instances};
pub use refusal::{Refusal, RefusalKind};
pub use restore::RecoveryReport;
use state::State;

/// What the manager needs of the node's settings.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// This node, for messages.
    pub node_name: String,
    /// `--share-mode`: hand out shares of GPUs (vcuda-core 1..99).
    pub share_mode: bool,
    /// Where the per-container vm directories live.
    pub vm_root: PathBuf,
    /// The mirrored driver volumes the Allocate response mounts.
    pub vdriver_dir: PathBuf,
}

pub struct Manager {
    config: ManagerConfig,
    gpus: Vec<GpuInfo>,
    driver_version: (i32, i32),
    state: Mutex<State>,
    /// A panic poisoned `state` (logged once).
    poison_seen: AtomicBool,
    alloc_lock: tokio::sync::Mutex<()>,
    /// One checkpoint write at a time; waiters whose change the write
    /// covered return without writing.
    commit_lock: tokio::sync::Mutex<()>,
    /// Wakes the lazy flush after a change that waits for the next write.
    lazy: tokio::sync::Notify,
    pods: Arc<dyn PodSource>,
    patcher: Arc<dyn PodPatcher>,
    events: Arc<dyn EventSink>,
    kubelet: Arc<dyn KubeletSource>,
    checkpoint: Arc<dyn CheckpointStore>,
    runtime: Arc<dyn ContainerRuntime>,
    /// Vm directories and sockets, opened outside the state lock.
    shares: Shares,
    /// The shared MIG instances' devices, by UUID ([`in_mig`]).
    mig_shares: Mutex<in_mig::MigShares>,
    extra: ExtraConfig,
    pub vcore: DeviceList,
    pub vmemory: DeviceList,
}

pub struct ManagerParts {
    pub config: ManagerConfig,
    pub allocator: Allocator,
    pub driver_version: (i32, i32),
    pub extra: ExtraConfig,
    pub world: World,
}

use node_agent::{now, short_bus_id};

impl Manager {
    pub fn new(p: ManagerParts) -> Arc<Manager> {
        let gpus = p.allocator.topology().gpus().to_vec();
        let w = p.world;
        // A GPU in MIG mode is advertised with Unhealthy IDs: the kubelet
        // counts none of them allocatable.
        let usable = |g: usize| p.allocator.usage(g).takes_placements();
        Arc::new(Manager {
            vcore: DeviceList::new(ids::vcore_devices(&gpus, usable)),
            vmemory: DeviceList::new(ids::vmemory_devices(&gpus, usable)),
            shares: Shares::new(&p.config.vm_root),
            mig_shares: Mutex::default(),
            state: Mutex::new(State::new(p.allocator, gpus.len())),
            gpus,
            driver_version: p.driver_version,
            poison_seen: AtomicBool::new(false),
            alloc_lock: tokio::sync::Mutex::new(()),
            commit_lock: tokio::sync::Mutex::new(()),
            lazy: tokio::sync::Notify::new(),
            pods: w.pods,
            patcher: w.patcher,
            events: w.events,
            kubelet: w.kubelet,
            checkpoint: w.checkpoint,
            runtime: w.runtime,
            extra: p.extra,
            config: p.config,
        })
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Where the manager's pod Events go.
    pub fn events(&self) -> Arc<dyn EventSink> {
        self.events.clone()
    }

    /// The kubelet's records (pod-resources), for the MIG plugins.
    pub fn kubelet(&self) -> Arc<dyn KubeletSource> {
        self.kubelet.clone()
    }

    /// The node's pods as the API server lists them now.
    pub fn pods_now(&self) -> Vec<Arc<k8s_openapi::api::core::v1::Pod>> {
        self.pods.pods()
    }

    pub fn registry(&self) -> &Registry {
        self.shares.registry()
    }

    /// Allocations, for display and tests.
    pub fn allocations(&self) -> Vec<Allocation> {
        self.st().allocs.values().cloned().collect()
    }

    /// Per-GPU allocation figures (cores, memory units, shares), by index.
    /// The node's GPU inventory as the scheduler extender reads it.
    pub fn inventory(&self) -> gpu_allocator::inventory::Inventory {
        gpu_allocator::inventory::Inventory::of(&self.st().allocator, self.config.share_mode)
    }

    pub fn gpu_usages(&self) -> Vec<gpu_allocator::GpuUsage> {
        self.st().allocator.usages().to_vec()
    }

    /// The GPU tree with current usage, rendered by the allocator.
    pub fn render_tree(&self) -> String {
        self.st().allocator.render()
    }

    /// The pod watch's generation (see [`Manager::pod_changes`]).
    pub fn pod_generation(&self) -> u64 {
        self.pods.generation()
    }

    /// Resolves once the pod watch has moved past generation `seen`.
    pub async fn pod_changes(&self, seen: u64) {
        while !self
            .pods
            .changed_since(seen, std::time::Duration::from_secs(3600))
            .await
        {}
    }

    /// Pods bound here awaiting the kubelet's admission
    /// ([`crate::decide::pods::awaiting_admission`]).
    pub fn awaiting_admission(&self) -> Vec<String> {
        crate::decide::pods::awaiting_admission(&self.pods.pods())
    }

    fn uuids(&self) -> Vec<String> {
        self.gpus.iter().map(|g| g.uuid.clone()).collect()
    }

    /// An allocation in the shared floor's terms.
    fn share_spec(&self, a: &Allocation) -> ShareSpec {
        let p = Placement::from(&a.placement);
        let gpu = |g: usize, memory_bytes: u64, cores: u32, limit: u32| ShareGpu {
            pci_bus_id: self.gpus[g].pci_bus_id.clone(),
            uuid: self.gpus[g].uuid.clone(),
            memory_bytes,
            cores,
            limit,
            card_bytes: self.gpus[g].memory_bytes,
        };
        let gpus = match &p {
            // Inside a MIG instance: its UUID, relative to it; what is lent
            // there is judged against the instance's memory.
            Placement::InMig {
                gpu: g,
                instance,
                cores,
                memory_units,
            } => vec![ShareGpu {
                uuid: instance.clone(),
                card_bytes: self.instance_bytes(instance),
                ..gpu(
                    *g,
                    memory_units * MEMORY_UNIT_BYTES,
                    *cores,
                    a.soft_limit.map_or(*cores, |l| l.max(*cores)),
                )
            }],
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => {
                let limit = a.soft_limit.map_or(*cores, |l| l.max(*cores));
                gpus.iter()
                    .map(|&g| gpu(g, memory_units * MEMORY_UNIT_BYTES, *cores, limit))
                    .collect()
            }
            // Whole GPUs and one-GPU shares: one quota file, on the first.
            _ => {
                let cores = a.cores.min(100);
                let limit = a.soft_limit.unwrap_or(cores);
                vec![gpu(
                    p.gpus()[0],
                    a.memory_units * MEMORY_UNIT_BYTES,
                    cores,
                    limit,
                )]
            }
        };
        ShareSpec {
            id: a.id(),
            owner: a.pod_uid.clone(),
            slot: a.container.clone(),
            whole: p.is_exclusive(),
            hard_limit: a.soft_limit.is_none(),
            driver_version: self.driver_version,
            gpus,
            tier: a.tier,
            memory_limit: a.memory_ceiling,
        }
    }

    /// Opens a container's share (vm directory, ledgers, socket); outside
    /// the state lock. The caller has reserved the allocation's capacity.
    fn open_files(&self, a: &Allocation) -> Result<std::path::PathBuf, ShareError> {
        self.shares.open(&self.share_spec(a))
    }

    /// Closes a container's share, unless the same container was allocated
    /// again meanwhile (its capacity is reserved before its files are
    /// written).
    fn close_files(&self, id: &str, pod_uid: &str, container: &str) {
        self.shares.close_unless(id, pod_uid, container, || {
            self.st().allocator.allocation(id).is_some()
        });
    }
}
