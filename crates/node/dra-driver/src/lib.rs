//! vcuda as a Kubernetes DRA (Dynamic Resource Allocation) driver, the
//! alternative to the device-plugin mode on a node (one or the other):
//!
//! * [`slices`]: the node's ResourceSlice (a device per GPU with consumable
//!   `cores` and `memory`, multiple allocations allowed) and the
//!   DeviceClasses (pure), with [`topology`] (the PCIe root and NVLink
//!   domain attributes) and [`mig`] (a GPU in MIG mode: a device per MIG
//!   device, taken whole); [`publish`] keeps it current; [`geometry`]
//!   applies `--mig-geometry` at start.
//! * [`plan`]: an allocated ResourceClaim -> devices to prepare (pure), with
//!   [`params`] (opaque per-claim parameters: soft limits) and [`quantity`].
//! * [`driver`]: prepare / unprepare: vm directories (`vcuda.config`, the
//!   ledger, `vcuda.sock` via node-agent's `VmDirs` and `Registry`), the
//!   [`cdi`] spec (node-agent's container edits in CDI), the [`checkpoint`].
//! * [`grpc`]: the kubelet plugin (`DRAPlugin` v1 and v1beta1) and the
//!   plugin-registration service on unix sockets.
//! * [`kube_api`]: the API server behind [`driver::ClaimSource`] and
//!   [`publish::SliceApi`].
//! * [`controller`]: the slice controller (health and the slice watch into
//!   the published slice); [`daemon`] starts everything, [`cli`] resolves
//!   the settings over node-agent's configuration.
//! * [`supervise`]: the supervisor that keeps the kubelet's sockets open
//!   across a crash of the driver process, and [`holder`] across a restart
//!   of the driver's whole container.

pub mod cdi;
pub mod checkpoint;
pub mod claim_events;
pub mod cli;
pub mod controller;
pub mod daemon;
pub mod display;
pub mod driver;
pub mod dynamic;
pub mod dynamic_start;
#[cfg(test)]
mod fixtures;
pub mod geometry;
pub mod grpc;
pub mod health;
pub mod holder;
pub mod kube_api;
pub mod mig;
pub mod mig_health;
pub mod params;
pub mod partition;
pub mod plan;
pub mod publish;
pub mod quantity;
pub mod reclaims;
pub mod relay;
pub mod slices;
pub mod supervise;
pub mod topology;
pub mod uninstall;

/// The driver name: ResourceSlices' `spec.driver`, allocation results'
/// `driver`, the registration name.
pub const DRIVER_NAME: &str = gpu_pods::dra::DRIVER_NAME;
/// The CDI kind of its devices (`vcuda.tencent.com/gpu=<name>`).
pub const CDI_KIND: &str = "vcuda.tencent.com/gpu";
/// Consumable capacity: percent of the GPU's compute (100 = all).
pub const CAPACITY_CORES: &str = "cores";
/// Consumable capacity: bytes of GPU memory, in 256 MiB steps.
pub const CAPACITY_MEMORY: &str = "memory";
