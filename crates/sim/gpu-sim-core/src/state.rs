//! State shared by every process that uses the simulated driver.
//!
//! One file, `<root>/run/gpu-sim/state`, mapped `MAP_SHARED` by each process
//! (including processes in containers that have the directory mounted). It
//! holds, per GPU, the memory in use and the kernel timeline; a table of
//! processes with their memory per GPU; a ring of injected Xid events; and
//! per GPU its MIG mode and instances (on a MIG node also each GPU
//! instance's memory and timeline, and the MIG device each process uses).
//! Everything in it is an atomic, so no process ever blocks another (MIG
//! reconfiguration alone takes a per-GPU lock, see `mig`).
//!
//! Liveness of a process slot is an OFD byte-range lock on `procs.lock`, held
//! by the owning process: the kernel drops it when the process dies, however it
//! dies, and any process can then reclaim the slot and the memory it held —
//! the real driver frees a dead process's memory the same way.
//!
//! The parts, one job each: `root` where a node is installed, `clock` the
//! clocks NVML and CUDA report in, `layout` the mapped file's layout (and
//! `install` / `open`), `procs` the process table and liveness, `memory`
//! memory accounting, `timeline` the kernel timeline and utilization,
//! `xid` the Xid event ring, `mig` MIG mode and instances, `mig_caps` the
//! MIG capability files the driver exposes for them, `mig_use` the memory
//! and timeline of each GPU instance and which one a process uses.

mod clock;
mod layout;
mod memory;
mod mig;
pub mod mig_caps;
mod mig_use;
mod procs;
mod root;
mod slice;
mod timeline;
mod xid;

pub use clock::{epoch_us_to_mono, mono_to_epoch_us, now_ns};
pub use layout::{InstallOutcome, MAX_PROCS, RING, XID_RING};
pub use memory::OutOfMemory;
pub use mig::{Activation, ComputeInstance, GpuInstance, MigError};
pub use procs::{Attached, ProcessInfo};
pub use root::{ROOT_ENV, SimRoot, object_path_of};
pub use xid::XidEvent;

use crate::node::{NodeError, NodeSpec};
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::AtomicI64;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateError {
    #[error(
        "gpu-sim state not found: no run/gpu-sim/node.toml under {searched}; \
         run `gpu-sim install --node FILE --root DIR` first, or set {ROOT_ENV}=DIR"
    )]
    NotInstalled { searched: String },
    #[error("gpu-sim state {path}: {message}")]
    Corrupt { path: String, message: String },
    #[error("gpu-sim state {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("all {MAX_PROCS} simulated process slots are in use")]
    TooManyProcesses,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A mapping of the shared state.
pub struct SharedState {
    root: SimRoot,
    node: NodeSpec,
    base: *mut u8,
    len: usize,
    lock: OwnedFd,
    /// Slot this handle attached, so its own lock is not mistaken for a dead
    /// process (OFD locks never conflict with their own description).
    own_slot: AtomicI64,
    /// Times handed out after preemptions, with what they reflect
    /// (`slice.rs`).
    stamps: slice::Stamps,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for SharedState {}
// SAFETY: as for Send: every access to the mapping is atomic.
unsafe impl Sync for SharedState {}

impl Drop for SharedState {
    fn drop(&mut self) {
        // SAFETY: base/len come from a successful mmap.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl SharedState {
    pub fn node(&self) -> &NodeSpec {
        &self.node
    }
    pub fn root(&self) -> &SimRoot {
        &self.root
    }
    pub fn gpu_count(&self) -> usize {
        self.node.gpus.len()
    }

    /// Indices of the GPUs whose device node this process can open, as the
    /// real driver only sees the devices present in its mount namespace.
    pub fn visible_gpus(&self) -> Vec<usize> {
        (0..self.gpu_count())
            .filter(|&i| {
                let path = self.root.device_node(self.node.gpus[i].minor);
                let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
                    return false;
                };
                // SAFETY: valid C string.
                let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
                if fd >= 0 {
                    // SAFETY: closing the fd just opened, which nothing else holds.
                    unsafe { libc::close(fd) };
                    true
                } else {
                    false
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const NODE: &str = r#"
name = "t"
driver_version = "550.54.15"
cuda_version = "12.4"
kernel_wave_ns = 1000

[[gpu]]
name = "NVIDIA Test"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
memory_mib = 1
sm_count = 1
pci_bus_id = "00000000:07:00.0"
minor = 0
"#;

    /// A one-GPU node (1 MiB of memory) installed in a temp dir.
    pub(super) fn installed() -> (tempfile::TempDir, SimRoot) {
        installed_with("")
    }

    /// As [`installed`], with `top` (top-level keys) added to the node.
    pub(super) fn installed_with(top: &str) -> (tempfile::TempDir, SimRoot) {
        let dir = tempfile::tempdir().unwrap();
        let root = SimRoot::new(dir.path());
        let text = if top.is_empty() {
            NODE.to_string()
        } else {
            NODE.replacen(
                "kernel_wave_ns = 1000",
                &format!("kernel_wave_ns = 1000\n{top}"),
                1,
            )
        };
        let node = NodeSpec::parse(&text, "t").unwrap();
        assert_eq!(
            SharedState::install(&root, &node).unwrap(),
            InstallOutcome::Created
        );
        (dir, root)
    }
}
