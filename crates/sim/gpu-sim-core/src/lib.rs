//! The simulated GPU node's core: node descriptions ([`node`]) and the state
//! every process using the simulated driver shares ([`state`]).
//!
//! The simulated `libcuda` and `libnvidia-ml` are thin C-ABI layers over this
//! crate; `gpu-sim install` writes what they read.

pub mod law;
pub mod mig;
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

/// Test knob, read in the CUDA process: its contexts are clients of an MPS
/// server of this PID. The sim's driver then says so
/// (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED` = 1) and its NVML names no client in
/// utilization samples, only the server, with the clients' use summed, as
/// NVIDIA's does under MPS (measured on an H100, tests/gpu/probes/mps.sh).
pub const MPS_SERVER_PID_ENV: &str = "GPU_SIM_MPS_SERVER_PID";

/// Test knob of the sim's NVML: each utilization sample period names only
/// the process that used the GPU most in it, with the whole device's busy
/// percent, as a real driver does (an H200 on driver 580: a 5 % tenant
/// beside a 50-99 % one was never named, and of two saturating tenants
/// held to 30 % and 48 % each was named in turn at 88-99 %;
/// tests/gpu/probes/nvml_util.py). Unset: every process that ran, with
/// its own share.
pub const SAMPLE_BUSIEST_ONLY_ENV: &str = "GPU_SIM_NVML_SAMPLE_BUSIEST_ONLY";

/// The MPS server's PID when [`MPS_SERVER_PID_ENV`] is set.
pub fn mps_server_pid() -> Option<u32> {
    std::env::var(MPS_SERVER_PID_ENV).ok()?.parse().ok()
}
