//! The simulated GPU node's core: node descriptions ([`node`]) and the state
//! every process using the simulated driver shares ([`state`]).
//!
//! The simulated `libcuda` and `libnvidia-ml` are thin C-ABI layers over this
//! crate; `gpu-sim install` writes what they read.

pub mod law;
pub mod node;
pub mod state;

pub use node::{GpuSpec, NodeError, NodeSpec, NvmlSampling, PcieLevel};

/// 64-bit FNV-1a: the stable hash of a byte string the simulator derives
/// things from (a node file's identity, a board serial, a kernel's law).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
pub use state::{
    Attached, InstallOutcome, OutOfMemory, ProcessInfo, SharedState, SimRoot, StateError, XidEvent,
};
