//! What several of this crate's unit tests build alike: a 16 GiB GPU and
//! an H100's 3g.40gb MIG device (NVIDIA's MIG user guide: 40448 MiB, 60
//! SMs).

use gpu_allocator::GpuInfo;
use node_agent::mig::MigDevice;

/// GPU `index` with device minor `minor`: a 16 GiB card, `GPU-<index>`.
pub(crate) fn gpu(index: usize, minor: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        minor,
        memory_bytes: 16 << 30,
        numa_node: None,
        pci_bus_id: "00000000:3B:00.0".into(),
    }
}

/// The 3g.40gb `MIG-3g`, GPU instance 2, compute instance 0.
pub(crate) fn mig_3g() -> MigDevice {
    MigDevice {
        uuid: "MIG-3g".into(),
        profile: "3g.40gb".into(),
        gpu_instance: 2,
        compute_instance: 0,
        memory_bytes: 40448 << 20,
        multiprocessors: 60,
    }
}
