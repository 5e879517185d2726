//! What a test needs from the machine, and what happens when it is missing:
//! where CI (tests/run.sh) says it must be there, the test fails naming what
//! is missing and why it was required; elsewhere it skips, saying why.
//!
//! A capability is required when `VCUDA_REQUIRE_ALL=1` (tests/run.sh: every
//! test must run) or its own variable is `1` ([`Capability::env`]: tests/run.sh
//! sets `VCUDA_REQUIRE_DOCKER`, `VCUDA_REQUIRE_CONTAINERD` and
//! `VCUDA_REQUIRE_K8S` as it starts each).
//!
//! ```no_run
//! use test_support::{Capability, require};
//! if !require(Capability::Root) {
//!     return;
//! }
//! ```

use std::fmt;

/// Something a test needs from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Running as root (mounts, mknod, namespaces, `ldconfig -r`).
    Root,
    /// A new PID namespace (`unshare --pid`).
    PidNamespace,
    /// A second filesystem at /dev/shm (hard links cannot cross it).
    ShmFilesystem,
    /// `gcc -m32`: 32-bit objects, for the 32-bit half of the vdriver checks.
    Gcc32,
    /// A Docker engine at `DOCKER_HOST` (tests/docker/engine.sh).
    Docker,
    /// A containerd answering CRI (tests/containerd/start.sh, cdi.sh).
    Containerd,
    /// Kubernetes binaries for the real-node suite (tests/k8s/build-kubernetes.sh).
    Kubernetes,
    /// NVIDIA's real user-space drivers in `VCUDA_NVIDIA_ROOTS` (tests/nvidia/fetch.sh).
    NvidiaDrivers,
    /// NVIDIA's CUDA wheels for python3 (nvcc, libcudart.so.13: tests/run.sh).
    CudaWheels,
}

impl Capability {
    /// Every capability, for documentation and checks.
    pub const ALL: [Capability; 9] = [
        Capability::Root,
        Capability::PidNamespace,
        Capability::ShmFilesystem,
        Capability::Gcc32,
        Capability::Docker,
        Capability::Containerd,
        Capability::Kubernetes,
        Capability::NvidiaDrivers,
        Capability::CudaWheels,
    ];

    /// The variable that requires this capability alone (`=1`).
    pub fn env(self) -> &'static str {
        match self {
            Capability::Root => "VCUDA_REQUIRE_ROOT",
            Capability::PidNamespace => "VCUDA_REQUIRE_PID_NAMESPACE",
            Capability::ShmFilesystem => "VCUDA_REQUIRE_SHM_FILESYSTEM",
            Capability::Gcc32 => "VCUDA_REQUIRE_GCC32",
            Capability::Docker => "VCUDA_REQUIRE_DOCKER",
            Capability::Containerd => "VCUDA_REQUIRE_CONTAINERD",
            Capability::Kubernetes => "VCUDA_REQUIRE_K8S",
            Capability::NvidiaDrivers => "VCUDA_REQUIRE_NVIDIA",
            Capability::CudaWheels => "VCUDA_REQUIRE_CUDA_WHEELS",
        }
    }

    /// How to get it on this machine.
    pub fn hint(self) -> &'static str {
        match self {
            Capability::Root | Capability::PidNamespace => {
                "Run the tests as root (tests/run.sh does)"
            }
            Capability::ShmFilesystem => "Mount a tmpfs at /dev/shm",
            Capability::Gcc32 => "Install gcc-multilib",
            Capability::Docker => {
                "Start one with `source tests/docker/engine.sh && start_docker_engine` (it sets DOCKER_HOST)"
            }
            Capability::Containerd => {
                "Start one with `source tests/containerd/start.sh && start_test_containerd`; \
                 with CDI, `source tests/containerd/cdi.sh && start_test_containerd_cdi`"
            }
            Capability::Kubernetes => {
                "Build them with tests/k8s/build-kubernetes.sh, set VCUDA_K8S_BIN, run as root (tests/k8s/README.md)"
            }
            Capability::NvidiaDrivers => {
                "`source tests/nvidia/fetch.sh && fetch_nvidia_drivers` unpacks NVIDIA's drivers \
                 535 and 550 from Debian non-free and sets VCUDA_NVIDIA_ROOTS"
            }
            Capability::CudaWheels => {
                "Install NVIDIA's CUDA wheels for python3 as tests/run.sh does"
            }
        }
    }

    /// Whether CI says it must be there: `VCUDA_REQUIRE_ALL=1` or
    /// [`env`](Self::env)`=1`. The variable that says so, if any.
    pub fn required_by(self) -> Option<&'static str> {
        [self.env(), "VCUDA_REQUIRE_ALL"]
            .into_iter()
            .find(|v| std::env::var(v).as_deref() == Ok("1"))
    }

    /// Whether CI says it must be there.
    pub fn required(self) -> bool {
        self.required_by().is_some()
    }

    /// Looks for it on this machine: `Err` says what is missing. Containerd
    /// and the CUDA wheels have no probe here (each test looks for the one
    /// it drives, then calls [`missing`]): asking panics.
    pub fn probe(self) -> Result<(), String> {
        match self {
            Capability::Root => is_root().then_some(()).ok_or_else(|| "not root".into()),
            Capability::PidNamespace => probe_pid_namespace(),
            Capability::ShmFilesystem => probe_shm_filesystem(),
            Capability::Gcc32 => probe_gcc32(),
            Capability::Docker => crate::docker::probe().map(|_| ()),
            Capability::Containerd | Capability::CudaWheels => {
                panic!("{self}: no probe; the test looks itself and calls test_support::missing")
            }
            Capability::Kubernetes => crate::k8s::k8s_bin().map(|_| ()).ok_or_else(|| {
                "no Kubernetes binaries (VCUDA_K8S_BIN unset and no /var/cache/vcuda/k8s-*/bin/kubelet)"
                    .into()
            }),
            Capability::NvidiaDrivers => probe_env("VCUDA_NVIDIA_ROOTS"),
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Capability::Root => "root",
            Capability::PidNamespace => "a PID namespace (unshare --pid)",
            Capability::ShmFilesystem => "a second filesystem at /dev/shm",
            Capability::Gcc32 => "gcc -m32",
            Capability::Docker => "a Docker engine",
            Capability::Containerd => "a containerd with CRI",
            Capability::Kubernetes => "a real Kubernetes node (its binaries, as root)",
            Capability::NvidiaDrivers => "NVIDIA's real drivers",
            Capability::CudaWheels => "NVIDIA's CUDA wheels",
        })
    }
}

/// Checks `cap` ([`Capability::probe`]): true when it is there. When it is
/// not, see [`missing`]: the test fails under CI, else it skips (the caller
/// returns on false).
#[track_caller]
pub fn require(cap: Capability) -> bool {
    match cap.probe() {
        Ok(()) => true,
        Err(detail) => {
            missing(cap, &detail);
            false
        }
    }
}

/// The test found `cap` missing (`detail`: what exactly, and what needed
/// it). Panics where `cap` is required ([`Capability::required_by`]),
/// naming what is missing, why it was required and how to get it;
/// otherwise prints why the test skips (the caller returns).
#[track_caller]
pub fn missing(cap: Capability, detail: &str) {
    if let Some(var) = cap.required_by() {
        panic!(
            "this test needs {cap}, required here by {var}=1 (tests/run.sh, so CI, sets it), \
             but it is missing: {detail}. {}.",
            cap.hint()
        );
    }
    eprintln!(
        "skipped: needs {cap}: {detail}. {}; {}=1 or VCUDA_REQUIRE_ALL=1 makes this a failure.",
        cap.hint(),
        cap.env()
    );
}

/// Effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn probe_env(var: &str) -> Result<(), String> {
    match std::env::var_os(var) {
        Some(v) if !v.is_empty() => Ok(()),
        _ => Err(format!("{var} is unset")),
    }
}

fn probe_pid_namespace() -> Result<(), String> {
    let out = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .output()
        .map_err(|e| format!("unshare: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "unshare --pid --fork: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn probe_shm_filesystem() -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let shm = std::fs::metadata("/dev/shm").map_err(|e| format!("/dev/shm: {e}"))?;
    if !shm.is_dir() {
        return Err("/dev/shm is not a directory".into());
    }
    let tmp = std::fs::metadata(std::env::temp_dir()).map_err(|e| format!("temp dir: {e}"))?;
    if shm.dev() == tmp.dev() {
        return Err("/dev/shm is on the temp dir's filesystem".into());
    }
    Ok(())
}

fn probe_gcc32() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let c = dir.path().join("m32.c");
    std::fs::write(&c, "int f(void) { return 1; }\n").map_err(|e| e.to_string())?;
    let out = std::process::Command::new("gcc")
        .args(["-m32", "-nostdlib", "-shared", "-fPIC", "-o"])
        .arg(dir.path().join("m32.so"))
        .arg(&c)
        .output()
        .map_err(|e| format!("gcc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "gcc -m32 -nostdlib -shared cannot build a 32-bit object here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::Capability;

    #[test]
    fn each_capability_has_its_own_variable() {
        let mut vars: Vec<&str> = Capability::ALL.iter().map(|c| c.env()).collect();
        assert!(vars.iter().all(|v| v.starts_with("VCUDA_REQUIRE_")));
        vars.sort();
        vars.dedup();
        assert_eq!(vars.len(), Capability::ALL.len());
    }

    /// Every `VCUDA_REQUIRE_*` tests/run.sh exports means something here.
    #[test]
    fn run_sh_requires_only_known_capabilities() {
        let run = std::fs::read_to_string(crate::workspace_root().join("tests/run.sh")).unwrap();
        let exported: Vec<&str> = run
            .lines()
            .filter_map(|l| l.trim().strip_prefix("export VCUDA_REQUIRE_"))
            .map(|l| l.split('=').next().unwrap())
            .collect();
        assert!(exported.contains(&"ALL"), "{exported:?}");
        for name in exported.iter().filter(|n| **n != "ALL") {
            let var = format!("VCUDA_REQUIRE_{name}");
            assert!(
                Capability::ALL.iter().any(|c| c.env() == var),
                "tests/run.sh exports {var}, which no Capability reads"
            );
        }
    }
}
