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
//!   the fullest GPU that still fits the cores and the memory; a share never
//!   spans GPUs.
//!
//! See README.md for the rules in full and an example rendering.

mod allocator;
mod error;
mod render;
mod select;
mod topology;

pub use allocator::{Allocator, GpuUsage, Placement, Request, WHOLE_GPU_CORES};
pub use error::{AllocError, ErrorKind, TopologyError};
pub use topology::{GpuInfo, Group, MEMORY_UNIT_BYTES, PcieLevel, Topology, Tree, TreeNode};

#[cfg(test)]
mod tests;
