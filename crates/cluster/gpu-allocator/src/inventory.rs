//! A node's GPUs as its manager publishes them for the cluster (the Node
//! annotation [`ANNOTATION`], JSON): what a scheduler extender needs to
//! rebuild the node's [`Topology`] and place requests exactly as the
//! node's manager will — GPUs (minor, UUID, memory, NUMA node, bus id,
//! health), pairwise PCIe levels and NVLink counts, and whether the node
//! serves shares. Nothing here is usage: that follows from the pods the
//! API server holds, so a manager or extender restart loses nothing.
//!
//! Versioned: a reader takes [`VERSION`] only and refuses any other with
//! an error naming both versions, never a silent misread.

use serde::{Deserialize, Serialize};

use crate::allocator::Allocator;
use crate::instances::SharedInstance;
use crate::topology::{GpuInfo, PcieLevel, Topology};

/// The Node annotation the inventory is published in.
pub const ANNOTATION: &str = "tencent.com/vcuda-gpu-inventory";
/// The layout this build writes and reads.
pub const VERSION: u32 = 1;

/// One node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub version: u32,
    /// The manager places shares (`vcuda-core` 1..99); else whole GPUs only.
    pub share_mode: bool,
    /// By index (a placement's GPU numbers).
    pub gpus: Vec<InventoryGpu>,
    /// PCIe level (NVML's `nvmlGpuTopologyLevel_t` value) of each pair
    /// `a < b`, row by row: (0,1), (0,2), ..., (1,2), ...
    pub pcie: Vec<u32>,
    /// NVLink links of each pair, in the same order.
    pub nvlink: Vec<u32>,
    /// MIG instances that serve shares (docs/mig.md). Written only when
    /// there are some: readers of version 1 without the field see none,
    /// and so never place a share inside one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InventoryInstance>,
}

/// A MIG instance that serves shares, and whether it takes new ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InventoryInstance {
    #[serde(flatten)]
    pub instance: SharedInstance,
    pub healthy: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InventoryGpu {
    /// The `N` of `/dev/nvidiaN` (what `predicate-gpu-idx-<i>` names).
    pub minor: u32,
    pub uuid: String,
    pub memory_bytes: u64,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    pub healthy: bool,
    /// In MIG mode: no shares, no whole-GPU placements. Written only when
    /// true, so readers of version 1 without the field read it as false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mig: bool,
}

/// Why an annotation is no inventory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error("{ANNOTATION} is not JSON of an inventory: {0}")]
    Json(String),
    #[error(
        "{ANNOTATION} is version {found}; this build reads version {VERSION} only (upgrade the reader, or run managers of one version)"
    )]
    Version { found: u32 },
    #[error("{ANNOTATION}: {0}")]
    Shape(String),
}

impl Inventory {
    /// What `alloc`'s node is now (its topology and each GPU's health).
    pub fn of(alloc: &Allocator, share_mode: bool) -> Inventory {
        let t = alloc.topology();
        let n = t.len();
        let pairs = (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b)));
        Inventory {
            version: VERSION,
            share_mode,
            gpus: t
                .gpus()
                .iter()
                .map(|g| InventoryGpu {
                    minor: g.minor,
                    uuid: g.uuid.clone(),
                    memory_bytes: g.memory_bytes,
                    numa_node: g.numa_node,
                    pci_bus_id: g.pci_bus_id.clone(),
                    healthy: alloc.usage(g.index).healthy,
                    mig: alloc.usage(g.index).mig,
                })
                .collect(),
            pcie: pairs
                .clone()
                .map(|(a, b)| t.pcie_level(a, b) as u32)
                .collect(),
            nvlink: pairs.map(|(a, b)| t.nvlink_count(a, b)).collect(),
            instances: alloc
                .instances()
                .map(|(i, u)| InventoryInstance {
                    instance: i.clone(),
                    healthy: u.healthy,
                })
                .collect(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an inventory serialises")
    }

    /// Parses an annotation's value: the version first, then the rest.
    pub fn from_json(s: &str) -> Result<Inventory, InventoryError> {
        #[derive(Deserialize)]
        struct Head {
            version: u32,
        }
        let head: Head =
            serde_json::from_str(s).map_err(|e| InventoryError::Json(e.to_string()))?;
        if head.version != VERSION {
            return Err(InventoryError::Version {
                found: head.version,
            });
        }
        let inv: Inventory =
            serde_json::from_str(s).map_err(|e| InventoryError::Json(e.to_string()))?;
        let n = inv.gpus.len();
        let pairs = n * n.saturating_sub(1) / 2;
        if inv.pcie.len() != pairs || inv.nvlink.len() != pairs {
            return Err(InventoryError::Shape(format!(
                "{n} GPUs need {pairs} pairs; pcie has {}, nvlink {}",
                inv.pcie.len(),
                inv.nvlink.len()
            )));
        }
        if let Some(v) = inv
            .pcie
            .iter()
            .find(|&&v| PcieLevel::from_nvml(v).is_none())
        {
            return Err(InventoryError::Shape(format!("{v} is no PCIe level")));
        }
        if let Some(i) = inv.instances.iter().find(|i| i.instance.gpu >= n) {
            return Err(InventoryError::Shape(format!(
                "MIG instance {} is on GPU{}, and there are {n} GPUs",
                i.instance.uuid, i.instance.gpu
            )));
        }
        Ok(inv)
    }

    /// Index of pair `a < b` in [`Inventory::pcie`] / [`Inventory::nvlink`].
    fn pair(&self, a: usize, b: usize) -> usize {
        let (a, b) = (a.min(b), a.max(b));
        let n = self.gpus.len();
        a * (2 * n - a - 1) / 2 + (b - a - 1)
    }

    /// The node's topology (GPU indices are the inventory's positions).
    pub fn topology(&self) -> Topology {
        let gpus = self
            .gpus
            .iter()
            .enumerate()
            .map(|(index, g)| GpuInfo {
                index,
                uuid: g.uuid.clone(),
                minor: g.minor,
                memory_bytes: g.memory_bytes,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
            })
            .collect();
        Topology::from_fn(
            gpus,
            |a, b| PcieLevel::from_nvml(self.pcie[self.pair(a, b)]).expect("checked by from_json"),
            |a, b| self.nvlink[self.pair(a, b)],
        )
        .expect("pairs are symmetric by construction")
    }

    /// An allocator over the node with each GPU's published health and no
    /// allocation.
    pub fn allocator(&self) -> Allocator {
        let mut a = Allocator::new(self.topology());
        for (i, g) in self.gpus.iter().enumerate() {
            if !g.healthy {
                a.set_healthy(i, false).expect("an index of the topology");
            }
            if g.mig {
                a.set_mig(i, true).expect("an index of the topology");
            }
        }
        a.set_instances(self.instances.iter().map(|i| i.instance.clone()).collect());
        for i in self.instances.iter().filter(|i| !i.healthy) {
            a.set_instance_healthy(&i.instance.uuid, false);
        }
        a
    }

    /// The index of the GPU `/dev/nvidia<minor>`.
    pub fn by_minor(&self, minor: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.minor == minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Allocator {
        let gpus = (0..4)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                minor: 10 + i as u32,
                memory_bytes: 16 << 30,
                numa_node: Some(i as u32 / 2),
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x3b + i),
            })
            .collect();
        let pcie = |a: usize, b: usize| {
            if a / 2 == b / 2 {
                PcieLevel::Single
            } else {
                PcieLevel::System
            }
        };
        let nvlink = |a: usize, b: usize| u32::from(a / 2 == b / 2 && a != b) * 4 + (a + b) as u32;
        Allocator::new(Topology::from_fn(gpus, pcie, nvlink).unwrap())
    }

    #[test]
    fn the_topology_and_health_survive_the_round_trip() {
        let mut a = node();
        a.set_healthy(2, false).unwrap();
        let inv = Inventory::of(&a, true);
        let back = Inventory::from_json(&inv.to_json()).unwrap();
        assert_eq!(back, inv);
        assert_eq!(back.topology(), *a.topology());
        let b = back.allocator();
        for g in 0..4 {
            assert_eq!(b.usage(g), a.usage(g), "GPU {g}");
        }
        assert_eq!(back.by_minor(12), Some(2));
        assert_eq!(back.by_minor(3), None);
    }

    #[test]
    fn another_version_or_shape_is_refused_by_name() {
        let inv = Inventory::of(&node(), false);
        let mut v: serde_json::Value = serde_json::from_str(&inv.to_json()).unwrap();
        v["version"] = 2.into();
        let e = Inventory::from_json(&v.to_string()).unwrap_err();
        assert_eq!(e, InventoryError::Version { found: 2 });
        assert!(
            e.to_string()
                .contains("version 2; this build reads version 1"),
            "{e}"
        );
        v["version"] = 1.into();
        v["pcie"] = serde_json::json!([10, 50]);
        let e = Inventory::from_json(&v.to_string()).unwrap_err();
        assert!(
            e.to_string().contains("4 GPUs need 6 pairs; pcie has 2"),
            "{e}"
        );
        v["pcie"] = serde_json::json!([10, 50, 50, 50, 50, 7]);
        let e = Inventory::from_json(&v.to_string()).unwrap_err();
        assert!(e.to_string().contains("7 is no PCIe level"), "{e}");
        assert!(matches!(
            Inventory::from_json("{}"),
            Err(InventoryError::Json(_))
        ));
    }
}
