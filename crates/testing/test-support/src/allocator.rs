//! The allocator over a simulated node description (config/nodes/*.toml),
//! for gpu-allocator's tests/nodes.rs and benches/decide.rs.

use gpu_allocator::{Allocator, GpuInfo, PcieLevel, Topology};
use gpu_sim_core::NodeSpec;

/// The GPUs, PCIe levels and NVLink counts of `config/nodes/<file>`.
pub fn node(file: &str) -> Allocator {
    let path = crate::workspace_root().join("config/nodes").join(file);
    let spec = NodeSpec::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let gpus = spec
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| GpuInfo {
            index: i,
            uuid: g.uuid.clone(),
            minor: g.minor,
            memory_bytes: g.memory_mib << 20,
            numa_node: u32::try_from(g.numa_node).ok(),
            pci_bus_id: g.pci_bus_id.clone(),
        })
        .collect();
    let topo = Topology::from_fn(
        gpus,
        |a, b| PcieLevel::from_nvml(spec.pcie_level(a, b) as u32).expect("NVML level"),
        |a, b| spec.nvlink_count(a, b),
    )
    .unwrap();
    Allocator::new(topo)
}
