//! The manager's state as the display service (`gpu-display`) sees it:
//! `/graph`, `/usage`, `PrintGraph`/`PrintUsages` and the per-GPU and
//! per-container metrics. Every call copies out of the manager under its
//! lock; no I/O.

use std::sync::Arc;

use gpu_allocator::MEMORY_UNIT_BYTES;
use gpu_display::{ContainerView, DisplaySource, GpuRef, GpuView};

use crate::allocation::PlacementRecord;
use crate::manager::Manager;

pub struct ManagerSource {
    pub mgr: Arc<Manager>,
    /// `--hostname-override` (the `node` label).
    pub node: String,
    /// NVML names of the GPUs, by index (may be shorter than the GPU list).
    pub models: Vec<String>,
    /// The MIG plugins, for their lost devices.
    pub mig: Option<crate::mig::MigPlugins>,
}

impl DisplaySource for ManagerSource {
    fn node_name(&self) -> String {
        self.node.clone()
    }

    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

    fn lost_mig_devices(&self) -> Vec<gpu_display::LostMigView> {
        let mut lost = self
            .mig
            .as_ref()
            .map(|m| m.lost_views())
            .unwrap_or_default();
        lost.extend(self.mgr.lost_shared_views());
        lost
    }

    fn dynamic_mig(&self) -> Option<gpu_display::DynamicMigView> {
        self.mig.as_ref().and_then(|m| m.dynamic_view())
    }

    fn health(&self) -> Result<(), gpu_display::Unhealthy> {
        self.mgr.health().map_err(|e| gpu_display::Unhealthy {
            reason: e.to_string(),
        })
    }

    fn graph_text(&self) -> String {
        self.mgr.render_tree()
    }

    fn gpus(&self) -> Vec<GpuView> {
        self.mgr
            .gpus()
            .iter()
            .zip(self.mgr.gpu_usages())
            .map(|(g, u)| GpuView {
                index: g.index as u32,
                uuid: g.uuid.clone(),
                bus_id: g.pci_bus_id.clone(),
                model: self.models.get(g.index).cloned().unwrap_or_default(),
                memory_total_bytes: g.memory_bytes,
                allocated_cores: u.allocated_cores,
                allocated_memory_bytes: u.allocated_memory_units * MEMORY_UNIT_BYTES,
                healthy: u.healthy,
                tenants: if u.exclusive { 1 } else { u.shares },
                ..node_agent::display::gpu_figures_view(self.mgr.registry().gpu_figures(&g.uuid))
            })
            .collect()
    }

    fn containers(&self) -> Vec<ContainerView> {
        let gpus = self.mgr.gpus();
        let gpu_ref = |i: usize| {
            gpus.get(i).map(|g| GpuRef {
                index: g.index as u32,
                uuid: g.uuid.clone(),
                bus_id: g.pci_bus_id.clone(),
            })
        };
        self.mgr
            .allocations()
            .into_iter()
            .map(|a| {
                let (held, exclusive, memory_quota_bytes) = match &a.placement {
                    PlacementRecord::Share { gpu, .. } | PlacementRecord::InMig { gpu, .. } => {
                        (vec![*gpu], false, a.memory_units * MEMORY_UNIT_BYTES)
                    }
                    PlacementRecord::Shares { gpus: held, .. } => {
                        (held.clone(), false, a.memory_units * MEMORY_UNIT_BYTES)
                    }
                    PlacementRecord::Exclusive { gpus: held } => {
                        let bytes = held
                            .iter()
                            .filter_map(|&i| gpus.get(i))
                            .map(|g| g.memory_bytes)
                            .sum();
                        (held.clone(), true, bytes)
                    }
                };
                let counters = self.mgr.registry().ledger_counters(&a.id());
                let vm_dir = self.mgr.registry().dir(&a.id());
                let host_pids = self
                    .mgr
                    .registry()
                    .pids(&a.id())
                    .into_iter()
                    .filter_map(|p| u32::try_from(p).ok())
                    .collect();
                ContainerView {
                    gpus: held.into_iter().filter_map(gpu_ref).collect(),
                    core_quota: a.cores,
                    memory_quota_bytes,
                    host_pids,
                    exclusive,
                    // From the ledger; none for exclusive containers (no
                    // interposer, no ledger).
                    throttled_seconds: counters.map(|c| c.throttled_ns as f64 / 1e9),
                    refused_allocations: counters.map(|c| c.refused_allocations),
                    compute_unattributed: counters.map(|c| c.compute_unattributed),
                    memory_borrowed_bytes: counters.map(|c| c.borrowed_bytes),
                    memory_reclaims: counters.map(|c| c.reclaims),
                    batch_held_seconds: counters.map(|c| c.qos_held_ns as f64 / 1e9),
                    pod_uid: a.pod_uid,
                    pod_name: a.pod_name,
                    namespace: a.namespace,
                    container: a.container,
                    user: String::new(),
                    cluster: String::new(),
                    vm_dir,
                }
            })
            .collect()
    }
}
