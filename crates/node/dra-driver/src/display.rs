//! The display service's view of a DRA node: every prepared claim device is
//! shown like a container (namespace, claim name as the pod, request as the
//! container, claim UID as the pod UID; a claim's shares on several GPUs
//! are one container with all of them), so `vcudactl`, `/usage` and the
//! metrics list claims the way they list device-plugin containers.

use std::fmt::Write;
use std::sync::{Arc, Mutex, PoisonError};

use gpu_display::{ContainerView, DisplaySource, GpuRef, GpuView};

use crate::driver::Driver;
use crate::plan::PlannedDevice;

pub struct DraSource {
    pub driver: Arc<Driver>,
    pub node: String,
    pub models: Vec<String>,
    /// Per GPU index: published (no recent critical Xid).
    pub healthy: Arc<Mutex<Vec<bool>>>,
}

impl DisplaySource for DraSource {
    fn lost_mig_devices(&self) -> Vec<gpu_display::LostMigView> {
        let lost = self.driver.lost_mig_devices().into_iter();
        lost.map(|l| gpu_display::LostMigView {
            gpu: l.gpu as u32,
            holder: format!("{}/{}", l.namespace, l.name),
            uuid: l.uuid,
        })
        .collect()
    }

    fn node_name(&self) -> String {
        self.node.clone()
    }

    fn graph_text(&self) -> String {
        let mut out = String::new();
        for g in self.gpus() {
            let _ = writeln!(
                out,
                "GPU {} {} {}: cores {}/100, memory {}/{} MiB, {} claim device(s){}",
                g.index,
                g.model,
                g.uuid,
                g.allocated_cores,
                g.allocated_memory_bytes >> 20,
                g.memory_total_bytes >> 20,
                g.tenants,
                if g.healthy {
                    ""
                } else {
                    ", unhealthy (not published)"
                }
            );
        }
        out
    }

    fn gpus(&self) -> Vec<GpuView> {
        let claims = self.driver.prepared();
        let healthy = self
            .healthy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        self.driver
            .gpus()
            .iter()
            .map(|g| {
                let on: Vec<_> = claims
                    .iter()
                    .flat_map(|c| &c.devices)
                    .filter(|d| d.gpu_index == g.index)
                    .collect();
                // Shares inside its MIG devices have their devices' pages.
                let mut instances: Vec<&str> = on
                    .iter()
                    .filter_map(|d| d.mig.as_ref())
                    .map(|m| m.uuid.as_str())
                    .collect();
                instances.sort_unstable();
                instances.dedup();
                GpuView {
                    index: g.index as u32,
                    uuid: g.uuid.clone(),
                    bus_id: g.pci_bus_id.clone(),
                    model: self.models.get(g.index).cloned().unwrap_or_default(),
                    memory_total_bytes: g.memory_bytes,
                    allocated_cores: on.iter().map(|d| d.cores).sum::<u32>().min(100),
                    allocated_memory_bytes: on.iter().map(|d| d.memory_bytes).sum(),
                    healthy: healthy.get(g.index).copied().unwrap_or(true),
                    tenants: on.len() as u32,
                    ..node_agent::display::gpu_figures_view(
                        self.driver.registry().gpu_figures_with(&g.uuid, &instances),
                    )
                }
            })
            .collect()
    }

    fn containers(&self) -> Vec<ContainerView> {
        let gpus = self.driver.gpus();
        let reg = self.driver.registry();
        let mut out = Vec::new();
        for c in self.driver.prepared() {
            // Shares on several GPUs are one container's: one row with its
            // GPUs and totals, as the device plugin shows them.
            let multi = c.devices.len() > 1 && c.devices.iter().all(|d| !d.whole);
            let rows: Vec<&[PlannedDevice]> = if multi {
                vec![&c.devices[..]]
            } else {
                c.devices.chunks(1).collect()
            };
            for row in rows {
                let d = &row[0];
                let id = Driver::registry_id(&c.uid, &d.request);
                let counters = reg.ledger_counters(&id);
                out.push(ContainerView {
                    pod_uid: c.uid.clone(),
                    pod_name: c.name.clone(),
                    namespace: c.namespace.clone(),
                    container: d.request.clone(),
                    gpus: row
                        .iter()
                        .map(|d| {
                            let g = &gpus[d.gpu_index];
                            GpuRef {
                                index: g.index as u32,
                                uuid: g.uuid.clone(),
                                bus_id: g.pci_bus_id.clone(),
                            }
                        })
                        .collect(),
                    core_quota: row.iter().map(|d| d.cores).sum(),
                    memory_quota_bytes: row.iter().map(|d| d.memory_bytes).sum(),
                    host_pids: reg
                        .pids(&id)
                        .into_iter()
                        .filter_map(|p| u32::try_from(p).ok())
                        .collect(),
                    exclusive: d.whole,
                    throttled_seconds: counters.map(|c| c.throttled_ns as f64 / 1e9),
                    refused_allocations: counters.map(|c| c.refused_allocations),
                    compute_unattributed: counters.map(|c| c.compute_unattributed),
                    memory_borrowed_bytes: counters.map(|c| c.borrowed_bytes),
                    memory_reclaims: counters.map(|c| c.reclaims),
                    batch_held_seconds: counters.map(|c| c.qos_held_ns as f64 / 1e9),
                    user: String::new(),
                    cluster: String::new(),
                    vm_dir: reg.dir(&id),
                });
            }
        }
        out
    }
}
