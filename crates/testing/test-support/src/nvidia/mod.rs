//! NVIDIA's real user-space drivers (tests/nvidia/fetch.sh), the oracle of
//! the real-driver tests, and host roots built from them ([`hosts`]).

pub mod hosts;

use crate::require::{Capability, missing};
use std::path::PathBuf;

/// One of NVIDIA's real user-space drivers, unpacked from Debian's
/// `non-free` packages by tests/nvidia/fetch.sh (never installed).
#[derive(Debug, Clone)]
pub struct NvidiaDriver {
    /// The dpkg-deb -x root (Debian's layout under it).
    pub root: PathBuf,
    /// "535.261.03".
    pub version: String,
}

impl NvidiaDriver {
    /// `usr/lib/x86_64-linux-gnu/nvidia/current`: libcuda.so.<v>,
    /// libnvidia-ml.so.<v> and their sonames.
    pub fn lib_dir(&self) -> PathBuf {
        self.root.join("usr/lib/x86_64-linux-gnu/nvidia/current")
    }
    pub fn libcuda(&self) -> PathBuf {
        self.lib_dir().join(format!("libcuda.so.{}", self.version))
    }
    pub fn libnvml(&self) -> PathBuf {
        self.lib_dir()
            .join(format!("libnvidia-ml.so.{}", self.version))
    }
    pub fn nvidia_smi(&self) -> PathBuf {
        self.root.join("usr/lib/nvidia/current/nvidia-smi")
    }
    /// CUDA's runtime (`libcudart.so.12`), where the suite carries it (trixie).
    pub fn libcudart(&self) -> Option<PathBuf> {
        let p = self.root.join("usr/lib/x86_64-linux-gnu/libcudart.so.12");
        p.exists().then_some(p)
    }
    /// Driver branch, "535".
    pub fn major(&self) -> &str {
        self.version.split('.').next().unwrap_or("")
    }
}

/// The real drivers of `VCUDA_NVIDIA_ROOTS` (colon-separated roots, set by
/// tests/run.sh through tests/nvidia/fetch.sh), oldest first. Empty, with
/// [`missing`] said, when the variable is unset: where
/// [`Capability::NvidiaDrivers`] is required that fails the test.
#[track_caller]
pub fn nvidia_drivers() -> Vec<NvidiaDriver> {
    let Some(roots) = std::env::var_os("VCUDA_NVIDIA_ROOTS").filter(|v| !v.is_empty()) else {
        missing(Capability::NvidiaDrivers, "VCUDA_NVIDIA_ROOTS is unset");
        return Vec::new();
    };
    let mut out = Vec::new();
    for root in std::env::split_paths(&roots) {
        let dir = root.join("usr/lib/x86_64-linux-gnu/nvidia/current");
        let version = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("VCUDA_NVIDIA_ROOTS names {}: {e}", dir.display()))
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find_map(|n| {
                let v = n.strip_prefix("libcuda.so.")?;
                (v.matches('.').count() == 2).then(|| v.to_string())
            })
            .unwrap_or_else(|| panic!("no libcuda.so.<version> in {}", dir.display()));
        out.push(NvidiaDriver { root, version });
    }
    out.sort_by(|a, b| a.version.cmp(&b.version));
    out
}
