//! Topology-aware GPU allocation decisions for vcuda: pure logic, no I/O.
//!
//! The manager builds a [`Topology`] (from NVML in production), wraps it in
//! an [`Allocator`] and asks it where each request goes:
//!
//! * `vcuda-core` a multiple of 100: that many whole GPUs, the set with the
//!   most NVLink links, then the closest PCIe common ancestor (the tightest
//!   subtree), then the most fragmented neighbourhood, then lowest indices.
//!   One whole GPU goes to the most fragmented subtree.
//! * `vcuda-core` 1..99 (share mode on, `vcuda-memory` ≥ 1 unit of 256 MiB):
//!   the fullest GPU that still fits the cores and the memory.
//! * A share on each of N ≥ 2 GPUs ([`Request::gpus`], [`Request::from_totals`]):
//!   the GPUs with room, ranked as whole-GPU sets (NVLink, then PCIe
//!   closeness), then the fullest set; [`Placement::Shares`].
//!
//! A node's GPUs as its manager publishes them for a cluster-wide
//! scheduler ([`inventory`]): rebuilds the same [`Topology`] elsewhere.
//! Where MIG instances go on a GPU ([`mig`]): a configured geometry or one
//! more instance, never destroying one in use.
//!
//! See README.md for the rules in full and an example rendering.
//!
//! ```
//! use gpu_allocator::{Allocator, ErrorKind, GpuInfo, PcieLevel, Placement, Request, Topology};
//!
//! // Two 16 GiB GPUs behind one PCIe switch, two more on the other socket.
//! let gpus = (0..4)
//!     .map(|i| GpuInfo {
//!         index: i,
//!         uuid: format!("GPU-{i}"),
//!         minor: i as u32,
//!         memory_bytes: 16 << 30,
//!         numa_node: Some(i as u32 / 2),
//!         pci_bus_id: format!("00000000:{:02X}:00.0", 0x3b + i),
//!     })
//!     .collect();
//! let pcie = |a: usize, b: usize| if a / 2 == b / 2 { PcieLevel::Single } else { PcieLevel::System };
//! let topo = Topology::from_fn(gpus, pcie, |_, _| 0).unwrap();
//! let mut alloc = Allocator::new(topo);
//!
//! let two = alloc.allocate("pod-a/main", &Request::whole(2)).unwrap();
//! assert_eq!(two, Placement::Exclusive { gpus: vec![0, 1] });
//! let share = alloc.evaluate(&Request::share(30, 8)).unwrap();
//! assert_eq!(share, Placement::Share { gpu: 2, cores: 30, memory_units: 8 });
//! alloc.commit("pod-b/main", &share).unwrap();
//!
//! let err = alloc.evaluate(&Request::share(150, 8)).unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::InvalidRequest);
//! let err = alloc.evaluate(&Request::whole(2)).unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::Insufficient);
//!
//! alloc.release("pod-a/main").unwrap();
//! assert!(alloc.render().contains("GPU2 /dev/nvidia2 GPU-2: cores 30/100 used"));
//! ```

mod allocator;
mod error;
mod instances;
pub mod inventory;
pub mod mig;
mod render;
mod select;
mod shares;
mod topology;

pub use allocator::{Allocator, GpuUsage, Placement, Request, WHOLE_GPU_CORES};
pub use error::{AllocError, ErrorKind, TopologyError};
pub use instances::SharedInstance;
pub use topology::{GpuInfo, Group, MEMORY_UNIT_BYTES, PcieLevel, Topology, Tree, TreeNode};

#[cfg(test)]
mod tests;
