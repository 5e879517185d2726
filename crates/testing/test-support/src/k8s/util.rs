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

pub fn k8s_bin() -> Option<PathBuf> {
    if let Some(b) = std::env::var_os("VCUDA_K8S_BIN") {
        return Some(PathBuf::from(b));
    }
    let mut found: Vec<PathBuf> = fs::read_dir("/var/cache/vcuda")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|n| n.to_string_lossy().starts_with("k8s-"))
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
        use std::os::fd::AsRawFd;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/vcuda-k8s.lock")
            .unwrap();
        wait(
            "the machine lock (/tmp/vcuda-k8s.lock: a real node or another test using /dev/nvidia*)",
            1200,
            || {
                // SAFETY: a valid open fd.
                if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
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
