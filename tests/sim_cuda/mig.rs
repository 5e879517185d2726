//! CUDA under MIG on the simulated `sim-mig-h100` node: GPU 0 in MIG mode
//! with a 1g.10gb and a 3g.40gb instance (one compute instance each), in
//! the shared MIG state the sim's NVML drives. A C program linked
//! with `-lcuda` (tests/c/sim_cuda.c) sees exactly the MIG device it is
//! given, with that instance's SMs, memory and UUID, and is bound to its
//! instance (whose own timeline keeps instances from waiting on each other:
//! `gpu-sim-core`'s `instances_do_not_wait_on_each_other` checks that on
//! the simulated clock; a kernel-rate comparison here measured the host's
//! CPU scheduler as much, and failed under load); without the capability
//! nodes a process sees nothing of the GPU. The instances are made by
//! `gpu-sim mig`.
//!
//! Needs the sim crates built (`cargo build -p gpu-sim -p gpu-sim-cuda -p
//! gpu-sim-nvml`) and gcc.

use gpu_sim_core::mig::mig_uuid;
use gpu_sim_core::state::{MigError, mig_caps};
use gpu_sim_core::{NodeSpec, SharedState};
use std::io::Write;

use super::{read_until, value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use test_support::{SimNode, compile_c, target_dir, workspace_root};

const NODE: &str = "sim-mig-h100";
/// Driver profile ids on the H100 80GB (nvidia-smi mig -lgip's ID).
const GI_1G: u32 = 19;
const GI_3G: u32 = 9;

/// One MIG device made for the test.
struct Mig {
    gi: u32,
    ci: u32,
    uuid: String,
    sms: u32,
    memory_mib: u64,
    name: String,
}

struct Setup {
    node: SimNode,
    spec: NodeSpec,
    _bin_dir: tempfile::TempDir,
    prog: PathBuf,
    small: Mig,
    big: Mig,
}

/// The MIG device of the GPU instance of profile `gi_profile` on GPU 0.
fn find(state: &SharedState, spec: &NodeSpec, gi_profile: u32) -> Mig {
    let devs = state.mig_devices(0);
    let (g, c) = devs
        .iter()
        .find(|(g, _)| g.profile.id == gi_profile)
        .unwrap_or_else(|| panic!("no instance of profile {gi_profile}: {devs:?}"));
    Mig {
        gi: g.id,
        ci: c.id,
        uuid: mig_uuid(&spec.gpus[0].uuid, g.id, c.id),
        sms: c.profile.sms(),
        memory_mib: g.profile.memory_mib,
        name: format!("{} MIG {}", spec.gpus[0].name, c.profile.device_name()),
    }
}

/// The node with MIG on GPU 0, a 1g and a 3g instance, made by `gpu-sim
/// mig` (enable, then the GPU instances with a full compute instance each).
fn setup() -> Setup {
    let node = SimNode::install(NODE);
    let spec = NodeSpec::load(&workspace_root().join(format!("config/nodes/{NODE}.toml"))).unwrap();
    let out = Command::new(target_dir().join("gpu-sim"))
        .args(["mig", "--gpu", "0", "--enable", "--create"])
        .arg(format!("{GI_1G},{GI_3G}"))
        .arg("--root")
        .arg(node.root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gpu-sim mig: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state = node.state();
    assert_eq!(state.mig_mode(0), Ok((true, true)), "idle GPU: applied");
    let small = find(&state, &spec, GI_1G);
    let big = find(&state, &spec, GI_3G);
    for m in [&small, &big] {
        assert!(stdout.contains(&m.uuid), "{} not listed: {stdout}", m.uuid);
    }
    let bin_dir = tempfile::tempdir().unwrap();
    let prog = compile_c("sim_cuda", &node, bin_dir.path());
    Setup {
        node,
        spec,
        _bin_dir: bin_dir,
        prog,
        small,
        big,
    }
}

impl Setup {
    /// The C program in `mode`, with CUDA_VISIBLE_DEVICES `env` (unset: None).
    fn cmd(&self, args: &[&str], env: Option<&str>) -> Command {
        let mut c = Command::new(&self.prog);
        c.args(args)
            .env("LD_LIBRARY_PATH", self.node.lib_dir())
            .env_remove("GPU_SIM_ROOT")
            .env_remove("CUDA_VISIBLE_DEVICES");
        if let Some(e) = env {
            c.env("CUDA_VISIBLE_DEVICES", e);
        }
        c
    }

    fn out(&self, args: &[&str], env: Option<&str>) -> String {
        let out = self.cmd(args, env).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "sim_cuda {args:?} ({env:?}) failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    fn spawn_saturate(&self, ms: u32, env: &str) -> Child {
        let mut c = self
            .cmd(&["saturate", &ms.to_string()], Some(env))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        read_until(&mut c, "ready");
        c
    }
}

/// Lets a spawned `saturate` exit.
fn finish(mut c: Child) {
    c.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
    assert!(c.wait().unwrap().success());
}

/// The UUID the C program printed (it formats the 16 bytes as "GPU-…"),
/// without its prefix.
fn uuid_hex(out: &str, i: usize) -> String {
    value(out, &format!("dev{i}.uuid"))[4..].to_string()
}

fn assert_is(out: &str, m: &Mig, bus: &str) {
    assert_eq!(value(out, "count"), "1", "{out}");
    assert_eq!(value(out, "dev0.name"), m.name);
    assert_eq!(uuid_hex(out, 0), m.uuid[4..], "the MIG UUID's bytes");
    assert_eq!(value(out, "dev0.sms"), m.sms.to_string());
    assert_eq!(value(out, "dev0.total_mib"), m.memory_mib.to_string());
    assert_eq!(value(out, "total_mib"), m.memory_mib.to_string());
    assert!(
        value(out, "dev0.bus").eq_ignore_ascii_case(&bus[4..]),
        "{out}"
    );
}

#[test]
fn a_process_sees_the_mig_device_it_is_given() {
    let s = setup();
    let bus = &s.spec.gpus[0].pci_bus_id;
    assert!(s.big.sms > s.small.sms && s.big.memory_mib > s.small.memory_mib);
    assert_eq!(s.big.name, "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    assert_is(&s.out(&["info"], Some(&s.big.uuid)), &s.big, bus);
    assert_is(&s.out(&["info"], Some(&s.small.uuid)), &s.small, bus);
    // A unique prefix and the older MIG-GPU-<uuid>/<gi>/<ci> form.
    assert_is(&s.out(&["info"], Some(&s.big.uuid[..14])), &s.big, bus);
    let legacy = format!("MIG-{}/{}/{}", s.spec.gpus[0].uuid, s.small.gi, s.small.ci);
    assert_is(&s.out(&["info"], Some(&legacy)), &s.small, bus);
    // Unset: the GPU in MIG mode shows its first MIG device, never
    // itself, and then no other device: not GPU 1 (MIG off) either.
    let first = [&s.small, &s.big].into_iter().min_by_key(|m| m.gi).unwrap();
    assert_is(&s.out(&["info"], None), first, bus);
    // Two MIG devices or a whole GPU beside: only the MIG device.
    let both = format!("{},{}", s.big.uuid, s.small.uuid);
    assert_is(&s.out(&["info"], Some(&both)), &s.big, bus);
    let beside = format!("1,{}", s.small.uuid);
    assert_is(&s.out(&["info"], Some(&beside)), &s.small, bus);
    // GPU 1 alone is whole.
    let whole = s.out(&["info"], Some("1"));
    assert_eq!(value(&whole, "count"), "1");
    assert_eq!(uuid_hex(&whole, 0), s.spec.gpus[1].uuid[4..]);
    // The index of a GPU in MIG mode: its first MIG device.
    assert_eq!(uuid_hex(&s.out(&["info"], Some("0")), 0), first.uuid[4..]);
}

#[test]
fn each_instance_bounds_its_own_memory() {
    let s = setup();
    // A process in the 1g holds its context (and memory) while the 3g's
    // process fills its own instance: all 40 GB of it are there.
    let mut holder = s.spawn_saturate(100, &s.small.uuid);
    let out = s.out(&["oom"], Some(&s.big.uuid));
    assert!(out.contains("oom ok"), "{out}");
    let out = s.out(&["oom"], Some(&s.small.uuid));
    assert!(out.contains("oom ok"), "{out}");
    // NVML's view: the holder is listed on GPU 0 using the 1g.
    let state = s.node.state();
    let procs = state.processes(0);
    let pid = holder.id();
    let p = procs
        .iter()
        .find(|p| p.pid() == pid)
        .expect("holder listed");
    assert_eq!(
        state.process_mig_use(p.slot, 0),
        Some((s.small.gi, s.small.ci))
    );
    assert!(state.gi_memory_used(0, s.small.gi) > 0);
    assert_eq!(
        state.destroy_compute_instance(0, s.small.gi, s.small.ci),
        Err(MigError::InUse),
        "a compute instance a process uses stays"
    );
    // nvidia-smi's process row names the GPU and compute instance.
    let smi = Command::new(s.node.root().join("usr/bin/nvidia-smi"))
        .env("LD_LIBRARY_PATH", s.node.lib_dir())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&smi.stdout);
    let row = table
        .lines()
        .find(|l| l.contains(&format!(" {pid} ")))
        .unwrap_or_else(|| panic!("no row for {pid}: {table}"));
    let ids = format!("|    0{:>6}{:>5} ", s.small.gi, s.small.ci);
    assert!(row.starts_with(&ids), "{row}");
    // Utilization of a GPU in MIG mode is not reported (nvml.h).
    let util = Command::new(s.node.root().join("usr/bin/nvidia-smi"))
        .args(["--query-gpu=utilization.gpu", "--format=csv,noheader"])
        .env("LD_LIBRARY_PATH", s.node.lib_dir())
        .output()
        .unwrap();
    let util = String::from_utf8_lossy(&util.stdout).into_owned();
    let lines: Vec<&str> = util.lines().collect();
    assert!(lines.len() == 2 && lines[0].contains("N/A"), "{util}");
    assert!(!lines[1].contains("N/A"), "GPU 1 is whole: {util}");
    assert_eq!(state.gi_memory_used(0, s.big.gi), 0, "the oom run freed");
    read_until(&mut holder, "done");
    finish(holder);
}

#[test]
fn without_the_caps_a_process_sees_nothing_of_the_gpu() {
    let s = setup();
    let root = gpu_sim_core::SimRoot::new(s.node.root());
    let minor = s.spec.gpus[0].minor;
    // No access to the 3g's compute instance: it names no device.
    let ci = mig_caps::ci_minor(minor, s.big.gi, s.big.ci);
    std::fs::remove_file(mig_caps::cap_node(&root, ci)).unwrap();
    let out = s.out(&["init"], Some(&s.big.uuid));
    assert!(out.contains("cuInit=100 CUDA_ERROR_NO_DEVICE"), "{out}");
    // Nor to the 1g's GPU instance: GPU 0 shows nothing at all.
    let gi = mig_caps::gi_minor(minor, s.small.gi);
    std::fs::remove_file(mig_caps::cap_node(&root, gi)).unwrap();
    let all = s.out(&["info"], None);
    assert_eq!(value(&all, "count"), "1", "{all}");
    assert_eq!(uuid_hex(&all, 0), s.spec.gpus[1].uuid[4..]);
    let out = s.out(&["init"], Some("0"));
    assert!(out.contains("cuInit=100 CUDA_ERROR_NO_DEVICE"), "{out}");
}
