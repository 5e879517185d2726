//! Advertised device IDs. Each GPU contributes 100 `vcuda-core` IDs and one
//! `vcuda-memory` ID per 256 MiB, named after it so that health and NUMA
//! follow the GPU. Which IDs kubelet hands over says nothing about which GPU
//! the allocator picks; only their count matters.

use device_plugin::api::Device;
use gpu_allocator::{GpuInfo, SharedInstance, WHOLE_GPU_CORES};

pub use gpu_pods::{VCORE_RESOURCE, VMEMORY_RESOURCE};
pub use node_agent::mode::{VCORE_SOCKET, VMEMORY_SOCKET};

pub fn vcore_id(gpu: usize, k: u32) -> String {
    format!("vcore-{gpu}-{k:02}")
}

pub fn vmemory_id(gpu: usize, k: u64) -> String {
    format!("vmemory-{gpu}-{k}")
}

/// The GPU index an advertised ID belongs to.
pub fn gpu_of(id: &str) -> Option<usize> {
    let rest = id
        .strip_prefix("vcore-")
        .or_else(|| id.strip_prefix("vmemory-"))?;
    rest.split_once('-')?.0.parse().ok()
}

fn numa(g: &GpuInfo) -> Option<i64> {
    g.numa_node.map(i64::from)
}

pub fn vcore_devices(gpus: &[GpuInfo], healthy: impl Fn(usize) -> bool) -> Vec<Device> {
    gpus.iter()
        .flat_map(|g| {
            let h = healthy(g.index);
            (0..WHOLE_GPU_CORES)
                .map(move |k| device_plugin::device(vcore_id(g.index, k), h, numa(g)))
        })
        .collect()
}

pub fn vmemory_devices(gpus: &[GpuInfo], healthy: impl Fn(usize) -> bool) -> Vec<Device> {
    gpus.iter()
        .flat_map(|g| {
            let h = healthy(g.index);
            (0..g.memory_units())
                .map(move |k| device_plugin::device(vmemory_id(g.index, k), h, numa(g)))
        })
        .collect()
}

/// `list` (a resource's IDs) with the shared MIG instances' IDs replaced
/// by those of `instances` (each with its health): 100 `vcuda-core` IDs
/// and one `vcuda-memory` ID per 256 MiB of each (`memory`), named after
/// the instance (`vcore-MIG-…-07`), so no GPU's health touches them
/// ([`gpu_of`] names no GPU for them) and NUMA follows the instance's GPU.
pub fn with_instances(
    list: Vec<Device>,
    instances: &[(SharedInstance, bool)],
    gpus: &[GpuInfo],
    memory: bool,
) -> Vec<Device> {
    let prefix = if memory { "vmemory-" } else { "vcore-" };
    let is_instance = |id: &str| {
        id.strip_prefix(prefix)
            .is_some_and(|r| r.starts_with("MIG-"))
    };
    let mut out: Vec<Device> = list.into_iter().filter(|d| !is_instance(&d.id)).collect();
    for (i, healthy) in instances {
        let numa = gpus.get(i.gpu).and_then(numa);
        let n = if memory {
            i.memory_units()
        } else {
            u64::from(WHOLE_GPU_CORES)
        };
        out.extend((0..n).map(|k| {
            let id = if memory {
                format!("vmemory-{}-{k}", i.uuid)
            } else {
                format!("vcore-{}-{k:02}", i.uuid)
            };
            device_plugin::device(id, *healthy, numa)
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: usize, mib: u64) -> GpuInfo {
        GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32,
            memory_bytes: mib << 20,
            numa_node: Some(i as u32 / 2),
            pci_bus_id: String::new(),
        }
    }

    #[test]
    fn counts_numa_and_round_trip() {
        let gpus = [gpu(0, 15360), gpu(2, 1000)];
        let c = vcore_devices(&gpus, |i| i != 2);
        assert_eq!(c.len(), 200);
        assert_eq!(gpu_of(&c[150].id), Some(2));
        assert_eq!(c[150].health, "Unhealthy");
        assert_eq!(c[150].topology.as_ref().unwrap().nodes[0].id, 1);
        let m = vmemory_devices(&gpus, |_| true);
        assert_eq!(m.len(), 60 + 3, "1000 MiB holds 3 whole units");
        assert_eq!(gpu_of("vmemory-12-7"), Some(12));
        assert_eq!(gpu_of("bogus"), None);
    }

    #[test]
    fn instance_ids_are_replaced_not_added_twice_and_follow_no_gpu() {
        let gpus = [gpu(0, 15360), gpu(1, 15360)];
        let inst = |uuid: &str| SharedInstance {
            uuid: uuid.into(),
            gpu: 1,
            profile: "2g.20gb".into(),
            memory_bytes: 1024 << 20,
        };
        let base = vcore_devices(&gpus, |_| true);
        let once = with_instances(
            base.clone(),
            &[(inst("MIG-a"), true), (inst("MIG-b"), false)],
            &gpus,
            false,
        );
        assert_eq!(once.len(), 400);
        assert_eq!(once[200].id, "vcore-MIG-a-00");
        assert_eq!(gpu_of(&once[200].id), None);
        assert_eq!(once[399].health, "Unhealthy");
        assert_eq!(once[200].topology.as_ref().unwrap().nodes[0].id, 0);
        let again = with_instances(once, &[(inst("MIG-b"), true)], &gpus, false);
        assert_eq!(again.len(), 300);
        assert_eq!(again[200].id, "vcore-MIG-b-00");
        let m = with_instances(
            vmemory_devices(&gpus, |_| true),
            &[(inst("MIG-a"), true)],
            &gpus,
            true,
        );
        assert_eq!(m.len(), 120 + 4);
        assert_eq!(m[123].id, "vmemory-MIG-a-3");
    }
}
