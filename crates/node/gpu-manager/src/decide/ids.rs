//! Advertised device IDs. Each GPU contributes 100 `vcuda-core` IDs and one
//! `vcuda-memory` ID per 256 MiB, named after it so that health and NUMA
//! follow the GPU. Which IDs kubelet hands over says nothing about which GPU
//! the allocator picks; only their count matters.

use device_plugin::api::Device;
use gpu_allocator::{GpuInfo, WHOLE_GPU_CORES};

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
}
