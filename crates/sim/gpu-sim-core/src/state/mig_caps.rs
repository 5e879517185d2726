//! The MIG capability files NVIDIA's driver exposes, under the sim root:
//! `proc/driver/nvidia/capabilities/mig/{config,monitor}`,
//! `proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/access` and
//! `…/gi<G>/ci<C>/access` while that instance exists, each holding
//! "DeviceFileMinor: <m>"; `proc/driver/nvidia-caps/mig-minors` (the whole
//! name-to-minor table); and `dev/nvidia-caps/nvidia-cap<m>` nodes.
//!
//! The minors are the driver's fixed table (open-gpu-kernel-modules,
//! kernel-open/nvidia/nv-caps.c: one counter from 0 over the nvlink table
//! (fabric-mgmt 0), the MIG table (config 1, monitor 2), then per GPU 0..32
//! and GPU instance 0..15 the GI's access and its eight CIs' access), so a
//! GI's minor is 3 + 135 × GPU + 9 × GI. `<N>` is the GPU's minor number,
//! as nvidia-container-toolkit names them.
//!
//! The cap nodes the sim makes for instances are plain files (the real
//! ones are made by nvidia-modprobe as character devices); writing is best
//! effort, since a container may see the root read-only.

use super::SimRoot;
use std::fs;
use std::path::PathBuf;

pub const CONFIG_MINOR: u32 = 1;
pub const MONITOR_MINOR: u32 = 2;
/// GPUs and GPU instances in the driver's table.
const TABLE_GPUS: u32 = 32;
const TABLE_GIS: u32 = 15;
const TABLE_CIS: u32 = 8;
const PER_GI: u32 = 1 + TABLE_CIS;
const PER_GPU: u32 = TABLE_GIS * PER_GI;

/// Minor of `gpu<gpu_minor>/gi<gi>/access`.
pub fn gi_minor(gpu_minor: u32, gi: u32) -> u32 {
    3 + gpu_minor * PER_GPU + gi * PER_GI
}

/// Minor of `gpu<gpu_minor>/gi<gi>/ci<ci>/access`.
pub fn ci_minor(gpu_minor: u32, gi: u32, ci: u32) -> u32 {
    gi_minor(gpu_minor, gi) + 1 + ci
}

/// `/proc/driver/nvidia-caps/mig-minors` as the driver prints it.
pub fn mig_minors() -> String {
    let mut s = format!("config {CONFIG_MINOR}\nmonitor {MONITOR_MINOR}\n");
    for gpu in 0..TABLE_GPUS {
        for gi in 0..TABLE_GIS {
            s += &format!("gpu{gpu}/gi{gi}/access {}\n", gi_minor(gpu, gi));
            for ci in 0..TABLE_CIS {
                s += &format!("gpu{gpu}/gi{gi}/ci{ci}/access {}\n", ci_minor(gpu, gi, ci));
            }
        }
    }
    s
}

/// A capability's proc file (the driver's nv_cap_procfs_read); `mode` is
/// the node's permission bits (0400 config, 0444 the others).
fn cap_file(minor: u32, mode: u32) -> String {
    format!("DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
}

fn caps_dir(root: &SimRoot) -> PathBuf {
    root.root.join("proc/driver/nvidia/capabilities")
}

fn gi_dir(root: &SimRoot, gpu_minor: u32, gi: u32) -> PathBuf {
    caps_dir(root).join(format!("gpu{gpu_minor}/mig/gi{gi}"))
}

/// `dev/nvidia-caps/nvidia-cap<minor>`.
pub fn cap_node(root: &SimRoot, minor: u32) -> PathBuf {
    root.dev_dir()
        .join(format!("nvidia-caps/nvidia-cap{minor}"))
}

fn write(path: PathBuf, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text)
}

/// The node-wide files a MIG-capable node has from the start: config,
/// monitor and mig-minors (cap nodes for config and monitor are the
/// installer's, as device nodes).
pub fn write_static(root: &SimRoot) -> std::io::Result<()> {
    let mig = caps_dir(root).join("mig");
    write(mig.join("config"), &cap_file(CONFIG_MINOR, 0o400))?;
    write(mig.join("monitor"), &cap_file(MONITOR_MINOR, 0o444))?;
    write(
        root.root.join("proc/driver/nvidia-caps/mig-minors"),
        &mig_minors(),
    )
}

/// Publishes (or, `live` false, withdraws) a GPU instance's access file
/// and cap node.
pub fn publish_gi(root: &SimRoot, gpu_minor: u32, gi: u32, live: bool) {
    let dir = gi_dir(root, gpu_minor, gi);
    let minor = gi_minor(gpu_minor, gi);
    if live {
        let _ = write(dir.join("access"), &cap_file(minor, 0o444));
        let _ = write(cap_node(root, minor), "");
    } else {
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_file(cap_node(root, minor));
    }
}

/// Publishes (or withdraws) a compute instance's access file and cap node.
pub fn publish_ci(root: &SimRoot, gpu_minor: u32, gi: u32, ci: u32, live: bool) {
    let dir = gi_dir(root, gpu_minor, gi).join(format!("ci{ci}"));
    let minor = ci_minor(gpu_minor, gi, ci);
    if live {
        let _ = write(dir.join("access"), &cap_file(minor, 0o444));
        let _ = write(cap_node(root, minor), "");
    } else {
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_file(cap_node(root, minor));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_follow_the_drivers_table() {
        assert_eq!(gi_minor(0, 0), 3);
        assert_eq!(ci_minor(0, 0, 0), 4);
        assert_eq!(ci_minor(0, 0, 7), 11);
        assert_eq!(gi_minor(0, 1), 12);
        assert_eq!(gi_minor(1, 0), 138);
        let table = mig_minors();
        let mut lines = table.lines();
        assert_eq!(lines.next(), Some("config 1"));
        assert_eq!(lines.next(), Some("monitor 2"));
        assert_eq!(lines.next(), Some("gpu0/gi0/access 3"));
        assert!(table.contains("gpu1/gi0/access 138\n"));
        assert!(table.ends_with("gpu31/gi14/ci7/access 4322\n"));
    }
}
