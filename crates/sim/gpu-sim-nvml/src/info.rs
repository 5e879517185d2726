//! Static facts about a simulated GPU that NVML reports and the node
//! description does not spell out: derived from its name, UUID and compute
//! capability so they stay stable across processes and runs.

use gpu_sim_core::GpuSpec;

pub const PCI_VENDOR_NVIDIA: u32 = 0x10DE;

/// PCI device id for well-known board names, so tools that key on it (e.g.
/// `lspci`-style tables) see plausible values.
pub fn pci_device_id(name: &str) -> u32 {
    let n = name.to_ascii_uppercase();
    let table: &[(&str, u32)] = &[
        ("A100-SXM4-80GB", 0x20B2),
        ("A100-PCIE-80GB", 0x20B5),
        ("A100-PCIE", 0x20F1),
        ("A100", 0x20B0),
        ("A10", 0x2236),
        ("A30", 0x20B7),
        ("H100 PCIE", 0x2331),
        ("H100", 0x2330),
        ("H200", 0x2335),
        ("L4", 0x27B8),
        ("L40S", 0x26B9),
        ("T4", 0x1EB8),
        ("V100", 0x1DB1),
        ("RTX 4090", 0x2684),
        ("RTX 3090", 0x2204),
    ];
    table
        .iter()
        .find(|(k, _)| n.contains(k))
        .map_or(0x20B0, |&(_, id)| id)
}

/// `pciDeviceId` as NVML packs it: device id above the vendor id.
pub fn pci_combined_id(g: &GpuSpec) -> u32 {
    (pci_device_id(&g.name) << 16) | PCI_VENDOR_NVIDIA
}

/// Subsystem id: NVIDIA's own reference board.
pub fn pci_subsystem_id(_g: &GpuSpec) -> u32 {
    (0x1450 << 16) | PCI_VENDOR_NVIDIA
}

/// 13-digit board serial derived from the UUID.
pub fn serial(g: &GpuSpec) -> String {
    format!(
        "{:013}",
        gpu_sim_core::fnv1a(g.uuid.as_bytes()) % 10_000_000_000_000
    )
}

/// Board id: unique per GPU on the node, as the real one is per board.
pub fn board_id(g: &GpuSpec) -> u32 {
    let (domain, bus, dev, _) = g.pci_location();
    (domain << 16) | (bus << 8) | dev
}

pub fn is_consumer(g: &GpuSpec) -> bool {
    let n = g.name.to_ascii_uppercase();
    n.contains("GEFORCE") || n.contains("TITAN")
}

/// nvmlBrandType_t.
pub fn brand(g: &GpuSpec) -> u32 {
    let n = g.name.to_ascii_uppercase();
    if n.contains("GEFORCE") {
        5
    } else if n.contains("TITAN") {
        6
    } else if n.contains("QUADRO") {
        1
    } else if n.contains("RTX") {
        13
    } else {
        2 // NVML_BRAND_TESLA: data-centre boards
    }
}

/// nvmlDeviceArchitecture_t from the compute capability.
pub fn architecture(g: &GpuSpec) -> u32 {
    match g.compute_capability() {
        (3, _) => 2,
        (5, _) => 3,
        (6, _) => 4,
        (7, 0) | (7, 2) => 5,
        (7, _) => 6,
        (8, 9) => 8,
        (8, _) => 7,
        (9, _) => 9,
        (10, _) | (12, _) => 10,
        _ => 0xffff_ffff,
    }
}

/// NVLink generation by architecture.
pub fn nvlink_version(g: &GpuSpec) -> u32 {
    match g.compute_capability().0 {
        ..=6 => 1,
        7 => 2,
        8 => 3,
        9 => 4,
        _ => 5,
    }
}

/// (graphics/SM, memory, video) maximum clocks in MHz.
pub fn max_clocks(g: &GpuSpec) -> (u32, u32, u32) {
    match g.compute_capability() {
        (9, _) => (1980, 2619, 1755),
        (8, 0) => (1410, 1215, 1275),
        (8, _) => (2520, 10501, 1965),
        (7, _) => (1530, 877, 1372),
        _ => (1500, 1000, 1200),
    }
}
