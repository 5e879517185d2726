//! Drives the real `gpu-sim` binary against fake artifacts built with gcc.

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use test_support::{Capability, is_root, missing};

const GPU_SIM: &str = env!("CARGO_BIN_EXE_gpu-sim");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

/// Shared objects with the right sonames stand in for the real cdylibs: the
/// install only copies them and lets ldconfig read their ELF headers.
fn fake_artifacts(dir: &Path) {
    let src = dir.join("empty.c");
    fs::write(&src, "int gpu_sim_fake(void) { return 0; }\n").unwrap();
    for (out, soname) in [
        ("libcuda.so", "libcuda.so.1"),
        ("libnvidia_ml.so", "libnvidia-ml.so.1"),
    ] {
        let st = Command::new("gcc")
            .args(["-shared", "-fPIC", &format!("-Wl,-soname,{soname}"), "-o"])
            .arg(dir.join(out))
            .arg(&src)
            .status()
            .expect("gcc");
        assert!(st.success());
    }
    fs::write(dir.join("nvidia-smi"), "#!/bin/sh\necho fake\n").unwrap();
}

/// As root, a temporary directory with [`fake_artifacts`] in `<tmp>/art`;
/// otherwise None, after [`missing`] said why (`why`: what needs root).
fn artifacts_as_root(why: &str) -> Option<(tempfile::TempDir, PathBuf)> {
    if !is_root() {
        missing(Capability::Root, why);
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("art");
    fs::create_dir_all(&art).unwrap();
    fake_artifacts(&art);
    Some((tmp, art))
}

fn run(args: &[&str]) -> Output {
    Command::new(GPU_SIM).args(args).output().unwrap()
}

fn install(node: &Path, root: &Path, artifacts: &Path) -> Output {
    install_with(node, root, artifacts, &[])
}

/// [`install`] with `extra` arguments after the usual ones.
fn install_with(node: &Path, root: &Path, artifacts: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "install",
        "--node",
        node.to_str().unwrap(),
        "--root",
        root.to_str().unwrap(),
        "--artifacts",
        artifacts.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}

/// [`install_with`], which must succeed.
fn install_ok(node: &Path, root: &Path, artifacts: &Path, extra: &[&str]) -> Output {
    let out = install_with(node, root, artifacts, extra);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn every_shipped_node_description_parses() {
    let dir = repo().join("config/nodes");
    let mut n = 0;
    for e in fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let node = gpu_sim_core::NodeSpec::load(&p).unwrap_or_else(|e| panic!("{e}"));
            assert!(!node.gpus.is_empty());
            n += 1;
        }
    }
    assert!(n >= 4, "expected at least 4 node descriptions, found {n}");
    let eight = gpu_sim_core::NodeSpec::load(&dir.join("sim-8gpu-nvlink.toml")).unwrap();
    assert_eq!(eight.nvlink_count(0, 7), 12);
    let four = gpu_sim_core::NodeSpec::load(&dir.join("sim-4gpu-pcie.toml")).unwrap();
    assert_eq!(four.pcie_level(0, 1), gpu_sim_core::PcieLevel::Single);
    assert_eq!(four.pcie_level(1, 3), gpu_sim_core::PcieLevel::System);
    assert_eq!(four.gpus[3].numa_node, 1);
}

#[test]
fn install_lays_out_a_driver_root_and_is_idempotent() {
    let Some((tmp, art)) = artifacts_as_root("ldconfig -r needs root") else {
        return;
    };
    let root = tmp.path().join("root");
    let node = repo().join("config/nodes/sim-4gpu-pcie.toml");

    let out = install_ok(&node, &root, &art, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("4 GPUs") && stdout.contains("created"),
        "{stdout}"
    );

    let lib = root.join("usr/lib/x86_64-linux-gnu");
    assert!(lib.join("libcuda.so.550.54.15").is_file());
    assert_eq!(
        fs::read_link(lib.join("libcuda.so.1")).unwrap(),
        Path::new("libcuda.so.550.54.15")
    );
    assert_eq!(
        fs::read_link(lib.join("libcuda.so")).unwrap(),
        Path::new("libcuda.so.1")
    );
    assert_eq!(
        fs::read_link(lib.join("libnvidia-ml.so.1")).unwrap(),
        Path::new("libnvidia-ml.so.550.54.15")
    );
    assert!(root.join("usr/bin/nvidia-smi").is_file());
    for d in ["nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm"] {
        let m = fs::metadata(root.join("dev").join(d)).unwrap();
        assert!(m.file_type().is_char_device(), "{d}");
    }
    let version = fs::read_to_string(root.join("proc/driver/nvidia/version")).unwrap();
    assert!(version.contains("550.54.15"));
    assert!(root.join("run/gpu-sim/state").is_file());

    // The cache is the system ldconfig's, with paths relative to the root.
    let cache = root.join("etc/ld.so.cache");
    let listing = Command::new("ldconfig")
        .arg("-p")
        .arg("-C")
        .arg(&cache)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        listing.contains("libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        "{listing}"
    );
    assert!(listing.contains("libnvidia-ml.so.1"), "{listing}");

    // Second install: same inode of the state file, state kept.
    let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
    let state_ino = ino(&root.join("run/gpu-sim/state"));
    let lib_ino = ino(&lib.join("libcuda.so.550.54.15"));
    let out = install(&node, &root, &art);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("kept"));
    assert_eq!(ino(&root.join("run/gpu-sim/state")), state_ino);
    assert_ne!(
        ino(&lib.join("libcuda.so.550.54.15")),
        lib_ino,
        "libraries get a new inode, never rewritten in place"
    );

    // A driver upgrade replaces the versioned files and removes the stale ones.
    let upgraded = tmp.path().join("upgraded.toml");
    let text = fs::read_to_string(&node)
        .unwrap()
        .replace("550.54.15", "560.35.03");
    fs::write(&upgraded, text).unwrap();
    install_ok(&upgraded, &root, &art, &[]);
    assert!(lib.join("libcuda.so.560.35.03").is_file());
    assert!(!lib.join("libcuda.so.550.54.15").exists());
    assert!(!lib.join("libnvidia-ml.so.550.54.15").exists());
    assert_eq!(
        fs::read_link(lib.join("libcuda.so.1")).unwrap(),
        Path::new("libcuda.so.560.35.03")
    );

    // Xid injection is range-checked.
    let out = run(&[
        "xid",
        "--root",
        root.to_str().unwrap(),
        "--gpu",
        "9",
        "--code",
        "79",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the node has 4 GPUs"));
    let out = run(&[
        "xid",
        "--root",
        root.to_str().unwrap(),
        "--gpu",
        "1",
        "--code",
        "79",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn missing_artifacts_and_bad_node_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let node = repo().join("config/nodes/sim-1gpu.toml");
    let out = install(&node, &tmp.path().join("root"), tmp.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("libcuda.so not found") && err.contains("cargo build -p gpu-sim-cuda"),
        "{err}"
    );

    let bad = tmp.path().join("bad.toml");
    let text = fs::read_to_string(&node)
        .unwrap()
        .replace("sm_count = 108", "sm_count = \"many\"");
    fs::write(&bad, text).unwrap();
    let out = install(&bad, &tmp.path().join("root"), tmp.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.toml") && err.contains("line 12") && err.contains("sm_count"),
        "{err}"
    );

    let out = run(&[
        "xid",
        "--root",
        tmp.path().to_str().unwrap(),
        "--gpu",
        "0",
        "--code",
        "79",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("node.toml"), "{err}");
}

/// `--host-dev=DIR` puts the nodes kubelet looks for (the Allocate response's
/// `/dev/nvidia*`) in a host directory as the sim's 1:3 character devices,
/// keeps its own on a second install and never replaces anything else (a real
/// driver's 195:N node stands for one here).
#[test]
fn host_dev_creates_the_device_nodes_and_never_replaces_others() {
    let Some((tmp, art)) = artifacts_as_root("needs root (mknod, ldconfig -r)") else {
        return;
    };
    let node = repo().join("config/nodes/sim-4gpu-pcie.toml");
    let root = tmp.path().join("root");
    let dev = tmp.path().join("dev");
    fs::create_dir_all(&dev).unwrap();
    // A "real" node for GPU 1 (195:1) and a plain file for nvidia-uvm.
    let real = std::ffi::CString::new(dev.join("nvidia1").to_str().unwrap()).unwrap();
    // SAFETY: valid C string.
    let rc = unsafe { libc::mknod(real.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, 1)) };
    assert_eq!(rc, 0);
    fs::write(dev.join("nvidia-uvm"), b"not a device").unwrap();

    let host_dev = format!("--host-dev={}", dev.display());
    let out = install_ok(&node, &root, &art, &[&host_dev]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    use std::os::unix::fs::MetadataExt;
    for name in ["nvidia0", "nvidia2", "nvidia3", "nvidiactl"] {
        let m = fs::symlink_metadata(dev.join(name)).unwrap();
        assert!(m.file_type().is_char_device(), "{name}");
        assert_eq!(
            (libc::major(m.rdev()), libc::minor(m.rdev())),
            (1, 3),
            "{name}"
        );
        assert!(
            stdout.contains(&format!("{}/{name} created", dev.display())),
            "{stdout}"
        );
    }
    let m = fs::symlink_metadata(dev.join("nvidia1")).unwrap();
    assert_eq!(
        (libc::major(m.rdev()), libc::minor(m.rdev())),
        (195, 1),
        "left alone"
    );
    assert!(
        stderr.contains("nvidia1 exists (character device 195:1); left alone"),
        "{stderr}"
    );
    assert_eq!(fs::read(dev.join("nvidia-uvm")).unwrap(), b"not a device");
    assert!(stderr.contains("nvidia-uvm exists"), "{stderr}");

    // Again: its own nodes are kept.
    let out = install_ok(&node, &root, &art, &[&host_dev]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("{}/nvidia0 kept", dev.display())),
        "{stdout}"
    );
}

#[test]
fn a_mig_capable_node_gets_the_drivers_mig_capability_files() {
    let Some((tmp, art)) = artifacts_as_root("ldconfig -r needs root") else {
        return;
    };
    let root = tmp.path().join("root");
    install_ok(
        &repo().join("config/nodes/sim-mig-h100.toml"),
        &root,
        &art,
        &[],
    );
    let caps = root.join("proc/driver/nvidia/capabilities/mig");
    let config = fs::read_to_string(caps.join("config")).unwrap();
    assert!(config.starts_with("DeviceFileMinor: 1\n"), "{config}");
    let monitor = fs::read_to_string(caps.join("monitor")).unwrap();
    assert!(monitor.starts_with("DeviceFileMinor: 2\n"), "{monitor}");
    let minors = fs::read_to_string(root.join("proc/driver/nvidia-caps/mig-minors")).unwrap();
    assert!(minors.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\n"));
    assert!(
        minors.contains("gpu1/gi1/ci0/access 148\n"),
        "3 + 135 + 9 + 1"
    );
    for n in ["nvidia-cap1", "nvidia-cap2"] {
        assert!(root.join("dev/nvidia-caps").join(n).exists(), "{n}");
    }
    // A node without MIG-capable GPUs has none of them.
    let plain = tmp.path().join("plain");
    install_ok(
        &repo().join("config/nodes/sim-1gpu.toml"),
        &plain,
        &art,
        &[],
    );
    assert!(!plain.join("proc/driver/nvidia-caps").exists());
    assert!(!plain.join("dev/nvidia-caps").exists());
}
