//! `gpu-sim install`: lays out a fake NVIDIA driver installation under a root
//! directory the way a real host has it, so everything that inspects a host
//! (ld.so.cache lookups, the vdriver mirror, NVML by path, device nodes) runs
//! unmodified against it.

use anyhow::{Context, Result, bail};
use gpu_sim_core::{InstallOutcome, NodeSpec, SharedState, SimRoot};
use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Multiarch library directory of a Debian/Ubuntu host, where the NVIDIA
/// packages put the driver's user-space libraries.
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The built artifacts `install` copies, and the names they get in the root.
struct Artifact {
    built: &'static str,
    /// Base name in the root; libraries get `.so.<driver-version>` appended.
    installed: &'static str,
    soname: Option<&'static str>,
    build_hint: &'static str,
}

const LIBRARIES: [Artifact; 2] = [
    Artifact {
        built: "libcuda.so",
        installed: "libcuda.so",
        soname: Some("libcuda.so.1"),
        build_hint: "cargo build -p gpu-sim-cuda",
    },
    Artifact {
        built: "libnvidia_ml.so",
        installed: "libnvidia-ml.so",
        soname: Some("libnvidia-ml.so.1"),
        build_hint: "cargo build -p gpu-sim-nvml",
    },
];

const SMI: Artifact = Artifact {
    built: "nvidia-smi",
    installed: "nvidia-smi",
    soname: None,
    build_hint: "cargo build -p gpu-sim-smi",
};

pub struct InstallReport {
    pub node: NodeSpec,
    pub state: InstallOutcome,
    pub device_nodes_are_char_devices: bool,
    /// What `--host-dev` did with each host device node (empty without it).
    pub host_dev: Vec<(PathBuf, HostDev)>,
}

/// One host device node after `--host-dev`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostDev {
    /// Created as the sim's character device (1:3).
    Created,
    /// Already the sim's character device (an earlier install).
    Kept,
    /// Something else is there (a real driver's node, 195:N): left alone.
    LeftAlone(String),
}

/// The sim's device numbers: /dev/null's (1:3), so the node opens anywhere.
const SIM_DEV_MAJOR: u32 = 1;
const SIM_DEV_MINOR: u32 = 3;

/// Creates the node's device nodes `names` (`nvidia0`, `nvidiactl`, ...) in
/// the host directory `dir` (normally `/dev`), where kubelet and the container
/// runtime look for the paths the device plugin's Allocate response names.
/// Never replaces anything already there: a real driver's nodes (or any other
/// file) are left alone and reported.
pub fn install_host_dev(dir: &Path, names: &[String]) -> Result<Vec<(PathBuf, HostDev)>> {
    let mut out = Vec::new();
    for name in names {
        let path = dir.join(name);
        let what = match fs::symlink_metadata(&path) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                let (maj, min) = (libc::major(m.rdev()), libc::minor(m.rdev()));
                if m.file_type().is_char_device() && (maj, min) == (SIM_DEV_MAJOR, SIM_DEV_MINOR) {
                    HostDev::Kept
                } else if m.file_type().is_char_device() {
                    HostDev::LeftAlone(format!("character device {maj}:{min}"))
                } else {
                    HostDev::LeftAlone(format!("{:?}", m.file_type()))
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let c = CString::new(path.as_os_str().as_bytes())?;
                // SAFETY: valid C string; the sim's device number.
                let rc = unsafe {
                    libc::mknod(
                        c.as_ptr(),
                        libc::S_IFCHR | 0o666,
                        libc::makedev(SIM_DEV_MAJOR, SIM_DEV_MINOR),
                    )
                };
                if rc != 0 {
                    let err = std::io::Error::last_os_error();
                    return Err(err).with_context(|| {
                        format!(
                            "creating host device node {} (needs root: CAP_MKNOD)",
                            path.display()
                        )
                    });
                }
                fs::set_permissions(&path, fs::Permissions::from_mode(0o666))?;
                HostDev::Created
            }
            Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
        };
        out.push((path, what));
    }
    Ok(out)
}

/// Installs `node` under `root`, taking the libraries from `artifacts`.
pub fn install(
    node_file: &Path,
    root: &Path,
    artifacts: &Path,
    host_dev: Option<&Path>,
) -> Result<InstallReport> {
    let node = NodeSpec::load(node_file)?;
    fs::create_dir_all(root).with_context(|| format!("creating root {}", root.display()))?;
    let root = root
        .canonicalize()
        .with_context(|| format!("resolving root {}", root.display()))?;
    for a in LIBRARIES.iter().chain([&SMI]) {
        let p = artifacts.join(a.built);
        if !p.is_file() {
            bail!(
                "{} not found in {}: build it first (`{}`), or point --artifacts at the directory holding it",
                a.built,
                artifacts.display(),
                a.build_hint
            );
        }
    }

    // Libraries: the versioned file plus the symlinks the driver packages ship.
    let lib_dir = root.join(LIB_DIR);
    fs::create_dir_all(&lib_dir).with_context(|| format!("creating {}", lib_dir.display()))?;
    for a in &LIBRARIES {
        let versioned = format!("{}.{}", a.installed, node.driver_version);
        remove_other_versions(&lib_dir, a.installed, &versioned)?;
        copy_atomic(&artifacts.join(a.built), &lib_dir.join(&versioned), 0o755)?;
        let soname = a.soname.expect("libraries have sonames");
        symlink_atomic(Path::new(&versioned), &lib_dir.join(soname))?;
        symlink_atomic(Path::new(soname), &lib_dir.join(a.installed))?;
    }

    // ld.so.cache made by the system's own ldconfig, relative to the root.
    let etc = root.join("etc");
    fs::create_dir_all(&etc)?;
    fs::create_dir_all(root.join("var/cache/ldconfig"))?;
    write_atomic(
        &etc.join("ld.so.conf"),
        format!("/{LIB_DIR}\n").as_bytes(),
        0o644,
    )?;
    // -i: ldconfig's aux cache keys sonames by inode, size and ctime; the
    // atomic replacements above recycle inodes, which can make it reuse
    // another library's soname and point libcuda.so.1 at libnvidia-ml.
    let out = Command::new(ldconfig())
        .arg("-i")
        .arg("-r")
        .arg(&root)
        .output()
        .context("running ldconfig (Debian package libc-bin)")?;
    if !out.status.success() {
        bail!(
            "ldconfig -r {} failed ({}): {}\nldconfig -r chroots into the root, which needs root privileges",
            root.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }

    // nvidia-smi where the driver package puts it.
    let bin = root.join("usr/bin");
    fs::create_dir_all(&bin)?;
    copy_atomic(&artifacts.join(SMI.built), &bin.join(SMI.installed), 0o755)?;

    // Device nodes and the driver's version file.
    let sim = SimRoot::new(&root);
    fs::create_dir_all(sim.dev_dir())?;
    let mut char_devices = true;
    let mut names: Vec<String> = node
        .gpus
        .iter()
        .map(|g| format!("nvidia{}", g.minor))
        .collect();
    names.extend(["nvidiactl".to_string(), "nvidia-uvm".to_string()]);
    for name in &names {
        char_devices &= make_device_node(&sim.dev_dir().join(name))?;
    }
    let proc_dir = root.join("proc/driver/nvidia");
    fs::create_dir_all(&proc_dir)?;
    write_atomic(
        &proc_dir.join("version"),
        format!(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {}  (gpu-sim)\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
            node.driver_version
        )
        .as_bytes(),
        0o644,
    )?;

    if node.gpus.iter().any(|g| g.mig_model().is_some()) {
        install_mig_caps(&sim)?;
    }

    let host_dev = match host_dev {
        Some(dir) => install_host_dev(dir, &names)?,
        None => Vec::new(),
    };

    let state = SharedState::install(&sim, &node)?;
    Ok(InstallReport {
        node,
        state,
        device_nodes_are_char_devices: char_devices,
        host_dev,
    })
}

/// A MIG-capable node's capability files as the driver has them from
/// load: `proc/driver/nvidia/capabilities/mig/{config,monitor}`,
/// `proc/driver/nvidia-caps/mig-minors`, and the config and monitor cap
/// nodes `dev/nvidia-caps/nvidia-cap1`, `…2` (per-instance ones come and go
/// with the instances, `gpu_sim_core::state::mig_caps`).
fn install_mig_caps(sim: &SimRoot) -> Result<()> {
    use gpu_sim_core::state::mig_caps;
    mig_caps::write_static(sim).context("writing the MIG capability files")?;
    fs::create_dir_all(sim.dev_dir().join("nvidia-caps"))?;
    for minor in [mig_caps::CONFIG_MINOR, mig_caps::MONITOR_MINOR] {
        make_device_node(&mig_caps::cap_node(sim, minor))?;
    }
    Ok(())
}

fn ldconfig() -> PathBuf {
    ["/usr/sbin/ldconfig", "/sbin/ldconfig"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("ldconfig"))
}

/// Removes `<base>.<other-version>` files left by an install of another
/// driver version, as a driver upgrade does on a real host.
fn remove_other_versions(dir: &Path, base: &str, keep: &str) -> Result<()> {
    let prefix = format!("{base}.");
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        // Versioned files only (e.g. 550.54.15), not the soname link.
        if name != keep && rest.contains('.') && entry.file_type()?.is_file() {
            fs::remove_file(entry.path())
                .with_context(|| format!("removing stale {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Writes a new inode and renames it into place, so processes that have the
/// old file mapped keep running on it.
fn copy_atomic(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let bytes = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    write_atomic(to, &bytes, mode)
}

fn write_atomic(to: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let tmp = temp_beside(to);
    let mut f = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.set_permissions(fs::Permissions::from_mode(mode))?;
    f.sync_all()?;
    fs::rename(&tmp, to).with_context(|| format!("renaming into {}", to.display()))
}

fn symlink_atomic(target: &Path, link: &Path) -> Result<()> {
    if fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let tmp = temp_beside(link);
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .with_context(|| format!("creating symlink {}", tmp.display()))?;
    fs::rename(&tmp, link).with_context(|| format!("renaming into {}", link.display()))
}

fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.gpu-sim-tmp"))
}

/// Creates a character device node that opens like /dev/null (1:3, as
/// [`install_host_dev`]): opening
/// works anywhere, and `docker run --device` accepts it. Which GPU it stands
/// for is in its name, as with the real driver's nodes. Returns false when it
/// had to fall back to a regular file (no CAP_MKNOD).
fn make_device_node(path: &Path) -> Result<bool> {
    if let Ok(m) = fs::symlink_metadata(path) {
        if m.file_type().is_char_device() {
            return Ok(true);
        }
        fs::remove_file(path)?;
    }
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: valid C string; makedev(1, 3) is /dev/null's number.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    if rc == 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o666))?;
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EPERM) {
        // Unprivileged: a regular file still opens, but containers cannot
        // receive it as a device.
        fs::write(path, b"")?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o666))?;
        return Ok(false);
    }
    Err(err).with_context(|| format!("creating device node {}", path.display()))
}
