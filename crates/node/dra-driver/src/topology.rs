//! The two attributes a claim can match to get GPUs close to each other
//! (docs/multi-gpu.md, "The request, DRA mode"): the standard
//! `resource.kubernetes.io/pcieRoot` and the driver's `nvlinkDomain`.
//! Pairwise NVLink counts (a DGX-1's cube-mesh) cannot be attributes; a
//! domain is a set of GPUs all linked to each other.

use std::path::Path;

use gpu_allocator::Topology;

/// The standard attribute: the PCIe root complex a device is under.
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The driver's attribute: the set of GPUs all joined by NVLink.
pub const NVLINK_DOMAIN: &str = "nvlinkDomain";

/// Per GPU (by index): the UUID of the lowest-indexed GPU of its NVLink
/// domain, or `None` when no other GPU is linked to it or its linked GPUs
/// are not all linked to each other (no single domain to name).
pub fn nvlink_domains(topo: &Topology) -> Vec<Option<String>> {
    let n = topo.len();
    let linked = |a: usize, b: usize| a != b && topo.nvlink_count(a, b) > 0;
    (0..n)
        .map(|g| {
            // Its connected component over NVLink.
            let mut set = vec![g];
            let mut i = 0;
            while i < set.len() {
                let x = set[i];
                for y in 0..n {
                    if linked(x, y) && !set.contains(&y) {
                        set.push(y);
                    }
                }
                i += 1;
            }
            let clique = set
                .iter()
                .all(|&a| set.iter().all(|&b| a == b || linked(a, b)));
            (set.len() > 1 && clique).then(|| {
                let first = *set.iter().min().unwrap_or(&g);
                topo.gpus()[first].uuid.clone()
            })
        })
        .collect()
}

/// The PCIe root of the device at `bus_id` as the standard attribute
/// writes it (`pci<domain>:<bus>`, e.g. `pci0000:00`): the root component
/// of the device's path in sysfs under `host_root`, `None` where sysfs
/// does not say (a simulated node).
pub fn pcie_root(host_root: &Path, bus_id: &str) -> Option<String> {
    let b = bus_id.trim_end_matches('\0').to_ascii_lowercase();
    // sysfs names devices with a 4-digit domain; NVML prints 8.
    let b = match b.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => b,
    };
    let link = std::fs::read_link(host_root.join("sys/bus/pci/devices").join(&b)).ok()?;
    link.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.len() > 3)
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_allocator::{GpuInfo, PcieLevel};

    fn topo(n: usize, links: &[(usize, usize)]) -> Topology {
        let gpus = (0..n)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                minor: i as u32,
                memory_bytes: 16 << 30,
                numa_node: None,
                pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
            })
            .collect();
        let links = links.to_vec();
        Topology::from_fn(
            gpus,
            |_, _| PcieLevel::System,
            move |a, b| u32::from(links.contains(&(a.min(b), a.max(b)))) * 4,
        )
        .unwrap()
    }

    #[test]
    fn domains_are_sets_all_linked_to_each_other() {
        // 0-1 linked; 2-3-4 all linked; 5 alone; 6-7-8 a chain (7 between).
        let t = topo(9, &[(0, 1), (2, 3), (2, 4), (3, 4), (6, 7), (7, 8)]);
        let d = nvlink_domains(&t);
        let s = |x: &str| Some(x.to_string());
        assert_eq!(
            d,
            [
                s("GPU-0"),
                s("GPU-0"),
                s("GPU-2"),
                s("GPU-2"),
                s("GPU-2"),
                None,
                None,
                None,
                None
            ]
        );
    }

    #[test]
    fn pcie_root_from_sysfs() {
        let tmp = tempfile::tempdir().unwrap();
        let devices = tmp.path().join("sys/bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
            devices.join("0000:3b:00.0"),
        )
        .unwrap();
        assert_eq!(
            pcie_root(tmp.path(), "00000000:3B:00.0").as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(pcie_root(tmp.path(), "00000000:3C:00.0"), None);
    }
}
