//! MIG instances of the simulated H100 are hardware, as NVIDIA's MIG user
//! guide describes them (each GPU instance has its own SMs, memory slices
//! and L2, "with guaranteed quality of service"): a saturating kernel loop
//! in one instance leaves another instance's kernel rate as it was alone,
//! while two processes in one instance split it (the control, so the
//! measure can fail). `tests/c/shim_compute.c saturate` run directly on the
//! sim's driver, each process given its instance as a pod is
//! (`CUDA_VISIBLE_DEVICES=MIG-…`). Needs `cargo build --workspace` first.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use test_support::shim::simnode::ShimNode;
use test_support::{kv, target_dir, workspace_root};

/// Seconds each measured loop runs.
const SECS: &str = "3";

fn node() -> (ShimNode, PathBuf) {
    let n = ShimNode::install(
        &workspace_root(),
        &target_dir().join("gpu-sim"),
        &target_dir().join("libvcuda.so"),
        "sim-mig-h100",
    );
    // GPU 0 in MIG mode with a 3g.40gb and a 1g.10gb (H100 profile ids 9
    // and 19), each with one full compute instance.
    test_support::sim::gpu_sim_mig(n.root(), &["--gpu", "0", "--enable", "--create", "9,19"]);
    let prog = n.compile_c(&workspace_root().join("tests/c/shim_compute.c"));
    (n, prog)
}

/// The MIG UUID of GPU 0's instance of `profile` (`3g.40gb`).
fn instance(n: &ShimNode, profile: &str) -> String {
    let st = n.state();
    let gpu = st.node().gpus[0].uuid.clone();
    st.mig_devices(0)
        .into_iter()
        .find(|(_, c)| c.profile.device_name().ends_with(profile))
        .map(|(g, c)| gpu_sim_core::mig::mig_uuid(&gpu, g.id, c.id))
        .unwrap_or_else(|| panic!("no {profile} instance on GPU 0"))
}

fn saturating(n: &ShimNode, prog: &Path, on: &str, secs: &str) -> Child {
    n.direct()
        .command(prog)
        .args(["saturate", secs])
        .env("CUDA_VISIBLE_DEVICES", on)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Kernels per second the loop launched and finished.
fn rate(p: Child) -> f64 {
    let out = p.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "shim_compute: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = kv(&text);
    let launches: f64 = m["launches"].parse().unwrap();
    let wall: f64 = m["wall_ns"].parse().unwrap();
    launches / (wall / 1e9)
}

/// The loop on `on` alone, then beside `others` (each saturating `on` or
/// another instance for longer than the measured loop runs).
fn alone_and_beside(n: &ShimNode, prog: &Path, on: &str, others: &[&str]) -> (f64, f64) {
    let alone = rate(saturating(n, prog, on, SECS));
    let mut load: Vec<Child> = others.iter().map(|o| saturating(n, prog, o, "5")).collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let beside = rate(saturating(n, prog, on, SECS));
    for l in &mut load {
        let _ = l.kill();
        let _ = l.wait();
    }
    (alone, beside)
}

#[test]
fn a_saturated_instance_leaves_its_neighbours_kernel_rate_alone() {
    let (n, prog) = node();
    let (big, small) = (instance(&n, "3g.40gb"), instance(&n, "1g.10gb"));
    let mut lines = Vec::new();
    for (name, on, other) in [("3g.40gb", &big, &small), ("1g.10gb", &small, &big)] {
        let (alone, beside) = alone_and_beside(&n, &prog, on, &[other]);
        let ratio = beside / alone;
        lines.push(format!(
            "{name}: {alone:.0} kernels/s alone, {beside:.0} beside a saturated neighbour ({ratio:.3})"
        ));
        assert!(
            (0.85..=1.15).contains(&ratio),
            "{name}'s kernel rate moved with its neighbour's load: {}",
            lines.join("; ")
        );
    }
    // The control: a second process in the same instance shares its SMs'
    // time, so the measure sees a neighbour that is not hardware.
    let (alone, shared) = alone_and_beside(&n, &prog, &big, &[&big]);
    lines.push(format!(
        "3g.40gb: {alone:.0} kernels/s alone, {shared:.0} beside a second process in it ({:.3})",
        shared / alone
    ));
    println!("{}", lines.join("\n"));
    assert!(
        shared / alone < 0.75,
        "two processes in one instance did not split it: {}",
        lines.join("; ")
    );
}
