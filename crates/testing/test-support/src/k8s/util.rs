//! The real-node suite's helpers: its constants, the environment switches,
//! polling, `key=value` figures, percentiles, the machine lock and the
//! host clean-ups.

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub const NODE_FILE: &str = "config/nodes/sim-4gpu-pcie.toml";
pub const IMAGE: &str = "docker.io/vcuda-test/busybox:local";
pub const MANAGER_IMAGE: &str = "docker.io/vcuda-test/gpu-manager:local";
pub const MANAGER_PORT: u16 = 25678;
pub const MIB: u64 = 1 << 20;
pub const UNIT: u64 = 256 * MIB;

/// Which real node the device-plugin suite (tests/k8s_node) drives: the
/// 1.20 node built from Debian's source package (`tests/k8s/cluster.sh`),
/// or, with `VCUDA_K8S_MODERN=1`, the ≥ 1.36 node built from the Go modules
/// (`tests/k8s/cluster-modern.sh`, the DRA suite's node). The two scripts
/// take the same commands; what differs is named here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    Debian120,
    Modern,
}

impl Flavor {
    pub fn current() -> Flavor {
        match std::env::var("VCUDA_K8S_MODERN").as_deref() {
            Ok("1") => Flavor::Modern,
            _ => Flavor::Debian120,
        }
    }

    pub fn script(self) -> &'static str {
        match self {
            Flavor::Debian120 => "tests/k8s/cluster.sh",
            Flavor::Modern => "tests/k8s/cluster-modern.sh",
        }
    }

    /// The script's variables for (binaries, state directory, node name).
    pub fn vars(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Flavor::Debian120 => ("VCUDA_K8S_BIN", "VCUDA_K8S_DIR", "VCUDA_K8S_NODE"),
            Flavor::Modern => (
                "VCUDA_K8S_MODERN_BIN",
                "VCUDA_K8S_MODERN_DIR",
                "VCUDA_K8S_MODERN_NODE",
            ),
        }
    }

    /// The scripts' defaults for (state directory, node name).
    pub fn defaults(self) -> (&'static str, &'static str) {
        match self {
            Flavor::Debian120 => ("/tmp/vcuda-k8s", "vcuda-k8s-node"),
            Flavor::Modern => ("/tmp/vcuda-k8s-modern", "vcuda-k8s-modern"),
        }
    }

    /// Node K's address on lo (K = 1 the first node; node-up's 2..9).
    pub fn node_ip(self, k: u32) -> String {
        match self {
            Flavor::Debian120 => format!("198.51.100.{k}"),
            Flavor::Modern => format!("198.51.100.{}", 35 + k),
        }
    }

    pub fn api_port(self) -> u16 {
        match self {
            Flavor::Debian120 => 26443,
            Flavor::Modern => 36443,
        }
    }

    /// The device-plugin overlay for the node's version: 1.20's
    /// DaemonSets have no maxSurge.
    pub fn share_overlay(self) -> &'static str {
        match self {
            Flavor::Debian120 => "overlays/share-before-1.22",
            Flavor::Modern => "overlays/share",
        }
    }

    /// The first node's kubelet `cgroupRoot` (pods under `<root>/kubepods`).
    pub fn cgroup_root(self) -> &'static str {
        match self {
            Flavor::Debian120 => "",
            Flavor::Modern => "/vcuda-modern",
        }
    }

    /// Whether, after a node reboot, the kubelet may reject a pod with
    /// device-plugin resources that it re-admits before the plugin
    /// registered: since 1.27 it allocates again for every container it
    /// must start (kubernetes#116376; the rejection is kubernetes#125579).
    pub fn reboot_may_reject_device_pods(self) -> bool {
        self == Flavor::Modern
    }

    /// Whether the manager's DaemonSet rolls with `maxSurge` (the new pod
    /// starts beside the old one and takes its state over) or, on 1.20,
    /// stops the old pod first (a gap the interposer waits through).
    pub fn daemonset_surge(self) -> bool {
        self == Flavor::Modern
    }

    /// kube-scheduler's configuration API (v1beta1 is 1.19-1.21's; v1 since 1.25).
    pub fn scheduler_config_api(self) -> &'static str {
        match self {
            Flavor::Debian120 => "kubescheduler.config.k8s.io/v1beta1",
            Flavor::Modern => "kubescheduler.config.k8s.io/v1",
        }
    }

    /// For the figures: what the node runs.
    pub fn label(self) -> &'static str {
        match self {
            Flavor::Debian120 => "kubelet 1.20, containerd 1.6",
            Flavor::Modern => "kubelet 1.37, containerd 2",
        }
    }

    /// `/var/cache/vcuda/<prefix><version>/bin`: where the builds leave them.
    fn cache_prefix(self) -> &'static str {
        match self {
            Flavor::Debian120 => "k8s-1.",
            Flavor::Modern => "k8s-go-",
        }
    }
}

/// The Kubernetes binaries of the [`Flavor::current`] node: its `*_BIN`
/// variable, or the newest build in /var/cache/vcuda.
pub fn k8s_bin() -> Option<PathBuf> {
    let flavor = Flavor::current();
    if let Some(b) = std::env::var_os(flavor.vars().0) {
        return Some(PathBuf::from(b));
    }
    let mut found: Vec<PathBuf> = fs::read_dir("/var/cache/vcuda")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|n| n.to_string_lossy().starts_with(flavor.cache_prefix()))
                && p.join("kubelet").is_file()
        })
        .collect();
    found.sort();
    found.pop()
}

/// Polls `f` every 200 ms until it gives a value; panics after `secs`
/// naming `what` and the last state `f` reported.
pub fn wait<T>(what: &str, secs: u64, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("waited {secs} s for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

pub fn get_u64(m: &HashMap<String, String>, k: &str, text: &str) -> u64 {
    m.get(k)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {k}= in:\n{text}"))
}

pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A pod's condition messages (why the scheduler or kubelet left it), joined.
pub fn condition_messages(pod: &serde_json::Value) -> String {
    pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["message"].as_str())
        .collect::<Vec<_>>()
        .join("; ")
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether process `p` runs in a pod of one node's kubelet (cgroupfs,
/// `pods` = `<cgroupRoot>/kubepods`: each node here has a root of its
/// own). Test binaries beside a suite (CI's cargo phase, the soak's other
/// stream) and another real node (the 1.37 node under
/// tests/k8s/isolated.sh beside the 1.20 one) start processes of the same names: a
/// soak run waited 60 s on a `shim_client hold` that never registered with
/// this node's manager, the DRA suite counted the 1.20 suite's manager.
pub fn in_node_pods(p: u32, pods: &str) -> bool {
    fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| {
        c.lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .any(|path| path.starts_with(pods))
    })
}

/// Host PIDs of the processes in pod `uid`'s cgroups among `pids`.
pub fn pids_of_pod(uid: &str, pids: &[u32]) -> Vec<u32> {
    let alt = uid.replace('-', "_");
    pids.iter()
        .copied()
        .filter(|p| {
            fs::read_to_string(format!("/proc/{p}/cgroup"))
                .is_ok_and(|s| s.contains(uid) || s.contains(&alt))
        })
        .collect()
}

/// The machine's host state, one user at a time: a real node (kubelet's
/// /var/lib/kubelet, the ports, the address on lo, /dev/nvidia*) or a test
/// that makes host device nodes. A second one waits for the first (test
/// binaries run side by side under `tests/run.sh --soak`).
/// Holds the flock while alive.
pub struct MachineLock {
    _file: fs::File,
}

impl MachineLock {
    pub fn take() -> MachineLock {
        use super::host_load::{open, try_lock};
        let f = open(std::path::Path::new("/tmp/vcuda-k8s.lock"));
        wait(
            "the machine lock (/tmp/vcuda-k8s.lock: a real node or another test using /dev/nvidia*)",
            1200,
            || {
                if try_lock(&f, libc::LOCK_EX) {
                    Ok(())
                } else {
                    Err("held".into())
                }
            },
        );
        MachineLock { _file: f }
    }
}

/// Removes a directory the test created on the host (/etc/gpu-manager).
pub struct Cleanup(pub Option<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = fs::remove_dir_all(p);
        }
    }
}

/// Removes the host device nodes `gpu-sim install --host-dev` created, if
/// they are still the sim's 1:3 nodes.
pub struct HostDevCleanup(pub Vec<PathBuf>);

impl HostDevCleanup {
    /// The nodes `gpu-sim install --host-dev` reports (created, or kept
    /// from a killed earlier run: only these suites make them).
    pub fn from_install_output(out: &str) -> HostDevCleanup {
        HostDevCleanup(
            out.lines()
                .filter_map(|l| l.strip_prefix("host device node "))
                .filter_map(|l| {
                    l.strip_suffix(" created (1:3)")
                        .or_else(|| l.strip_suffix(" kept (1:3)"))
                })
                .map(PathBuf::from)
                .collect(),
        )
    }
}

impl Drop for HostDevCleanup {
    fn drop(&mut self) {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        for p in &self.0 {
            if let Ok(m) = fs::symlink_metadata(p)
                && m.file_type().is_char_device()
                && m.rdev() == libc::makedev(1, 3)
            {
                let _ = fs::remove_file(p);
            }
        }
    }
}

/// The Event about object `name` in `kubectl get events -o json`'s `list`
/// (core/v1 view: `involvedObject`), or why there is none yet.
pub fn event_about(list: &serde_json::Value, name: &str) -> Result<serde_json::Value, String> {
    list["items"]
        .as_array()
        .and_then(|i| {
            i.iter()
                .find(|e| e["involvedObject"]["name"] == name)
                .cloned()
        })
        .ok_or_else(|| format!("no event about {name} in {list}"))
}
