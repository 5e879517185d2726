//! The simulated GPU node's core: node descriptions ([`node`]) and the state
//! every process using the simulated driver shares ([`state`]).
//!
//! The simulated `libcuda` and `libnvidia-ml` are thin C-ABI layers over this
//! crate; `gpu-sim install` writes what they read.

pub mod law;
pub mod node;
pub mod state;

pub use node::{GpuSpec, NodeError, NodeSpec, NvmlSampling, PcieLevel};
pub use state::{
    Attached, InstallOutcome, OutOfMemory, ProcessInfo, SharedState, SimRoot, StateError, XidEvent,
};
