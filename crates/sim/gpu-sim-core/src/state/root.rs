//! Where a simulated node is installed, and how a library finds it.

use super::StateError;
use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Environment variable that names the simulated root explicitly.
pub const ROOT_ENV: &str = "GPU_SIM_ROOT";

/// Where a simulated node is installed: `<root>/run/gpu-sim` holds the node
/// description and the shared state, `<root>/dev` the device nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRoot {
    pub root: PathBuf,
}

impl SimRoot {
    pub fn new(root: impl Into<PathBuf>) -> SimRoot {
        SimRoot { root: root.into() }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join("run/gpu-sim")
    }
    pub fn node_file(&self) -> PathBuf {
        self.state_dir().join("node.toml")
    }
    pub fn state_file(&self) -> PathBuf {
        self.state_dir().join("state")
    }
    pub fn lock_file(&self) -> PathBuf {
        self.state_dir().join("procs.lock")
    }
    /// Where memory and events shared between processes live (CUDA IPC
    /// handles, fabric handles): one file each, named by its handle's id.
    pub fn ipc_dir(&self) -> PathBuf {
        self.state_dir().join("ipc")
    }
    pub fn dev_dir(&self) -> PathBuf {
        self.root.join("dev")
    }
    pub fn device_node(&self, minor: u32) -> PathBuf {
        self.dev_dir().join(format!("nvidia{minor}"))
    }

    /// Finds the root a library belongs to: `$GPU_SIM_ROOT` if set, else the
    /// nearest ancestor of `anchor` (the library's own file) that holds
    /// `run/gpu-sim/node.toml`. Inside a container the libraries sit under
    /// `/usr/local/nvidia` and the state is mounted at `/run/gpu-sim`, so the
    /// walk ends at `/`.
    pub fn locate(anchor: Option<&Path>) -> Result<SimRoot, StateError> {
        if let Some(root) = std::env::var_os(ROOT_ENV).filter(|v| !v.is_empty()) {
            let r = SimRoot::new(PathBuf::from(root));
            if r.node_file().is_file() {
                return Ok(r);
            }
            return Err(StateError::NotInstalled {
                searched: format!("{ROOT_ENV}={}", r.root.display()),
            });
        }
        let mut searched = Vec::new();
        if let Some(anchor) = anchor {
            let start = anchor
                .canonicalize()
                .unwrap_or_else(|_| anchor.to_path_buf());
            for dir in start.ancestors().skip(1) {
                let r = SimRoot::new(dir);
                if r.node_file().is_file() {
                    return Ok(r);
                }
                searched.push(dir.display().to_string());
            }
        } else {
            let r = SimRoot::new("/");
            if r.node_file().is_file() {
                return Ok(r);
            }
            searched.push("/".into());
        }
        Err(StateError::NotInstalled {
            searched: searched.join(", "),
        })
    }
}

/// Path of the shared object that contains `addr` (dladdr), so a library can
/// find where it was loaded from.
pub fn object_path_of(addr: usize) -> Option<PathBuf> {
    // SAFETY: Dl_info is pointers and integers: all-zero (NULL) is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables.
    if unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) } == 0
        || info.dli_fname.is_null()
    {
        return None;
    }
    // SAFETY: dladdr succeeded and dli_fname was checked non-NULL: the loader's NUL-terminated path, alive while the object is loaded.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::installed;
    #[test]
    fn locate_reports_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/libcuda.so.1");
        let err = SimRoot::locate(Some(&lib)).unwrap_err().to_string();
        assert!(err.contains("gpu-sim install"), "{err}");
        let (_d, root) = installed();
        let lib = root.root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
        assert_eq!(SimRoot::locate(Some(&lib)).unwrap(), root);
    }
}
