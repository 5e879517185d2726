//! The interposer under a share that spans several GPUs
//! (docs/multi-gpu.md), on the simulated 4-GPU node `sim-4gpu-pcie`: the
//! container holds a share on GPUs 1 and 0, in that record order, with a
//! different memory quota on each; GPUs 2 and 3 are not its.
//!
//! - each GPU's memory is held to its own quota: allocations in a device's
//!   context run out of memory at that GPU's quota, `cuMemGetInfo` on a
//!   device shows that GPU's quota and what the container holds there, and
//!   `nvmlDeviceGetMemoryInfo` of the same GPU agrees;
//! - a `cuMemCreate` charges the GPU its location names, not the current
//!   context's;
//! - devices are matched to the records by bus id, whatever
//!   `CUDA_VISIBLE_DEVICES` says (reordered, or by UUID);
//! - a device of the node outside the share is refused (its contexts);
//! - an interposer that registers at protocol 1 (a one-GPU reader) is
//!   refused by the manager of a multi-GPU container, and refuses CUDA.
//! - one process saturating two GPUs is held to each GPU's compute quota;
//! - after a manager restart the process re-registers (protocol 2, its
//!   slot in each ledger) and every GPU's ledger still holds its bytes.
//!
//! The program is `tests/c/multi_gpu.c`. Needs `cargo build --workspace`.

use std::collections::HashMap;
use std::path::PathBuf;
use test_support::shim::server::{Event, TestManager};
use test_support::shim::simnode::{Container, ShimNode};
use test_support::{target_dir, workspace_root};

const MIB: u64 = 1 << 20;
/// What each program allocates at a time.
const CHUNK: u64 = 64 * MIB;
/// CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_PERMITTED.
const OOM: u64 = 2;
const NOT_PERMITTED: u64 = 800;

struct Node {
    sim: ShimNode,
    prog: PathBuf,
}

/// One GPU of the node: its bus id, UUID and the quota the share gives it
/// (`None`: not in the share).
struct Gpu {
    bus: String,
    uuid: String,
    quota: Option<u64>,
}

impl Node {
    fn new() -> Node {
        let sim = ShimNode::install(
            &workspace_root(),
            &target_dir().join("gpu-sim"),
            &target_dir().join("libvcuda.so"),
            "sim-4gpu-pcie",
        );
        let prog = sim.compile_c(&workspace_root().join("tests/c/multi_gpu.c"));
        Node { sim, prog }
    }

    /// The node's GPUs, with quotas for GPU 1 (512 MiB) and GPU 0 (1 GiB).
    fn gpus(&self) -> Vec<Gpu> {
        let quotas = [Some(1024 * MIB), Some(512 * MIB), None, None];
        self.sim
            .state()
            .node()
            .gpus
            .iter()
            .zip(quotas)
            .map(|(g, quota)| Gpu {
                // As the manager writes it (4-digit domain, as in vcuda.config).
                bus: {
                    let (d, b, dv, f) = g.pci_location();
                    format!("{:04x}:{b:02x}:{dv:02x}.{f:x}", d & 0xffff)
                },
                uuid: g.uuid.clone(),
                quota,
            })
            .collect()
    }

    /// Device memory a context holds: its overhead and its 8 MiB heap.
    fn ctx(&self) -> u64 {
        self.sim.state().node().gpus[0].context_overhead_bytes() + 8 * MIB
    }

    /// The container with the share on GPUs 1 and 0 (records in that order)
    /// and its manager, one ledger per GPU.
    fn container(&self) -> (Container, TestManager) {
        self.container_with_cores([100, 100])
    }

    /// [`Node::container`] with `cores[0]` percent of GPU 1's compute and
    /// `cores[1]` of GPU 0's (hard limits).
    fn container_with_cores(&self, cores: [i32; 2]) -> (Container, TestManager) {
        let gpus = self.gpus();
        let c = self.sim.vm_dir();
        let record = |i: usize| quota_config::GpuQuota {
            bus_id: gpus[i].bus.clone(),
            uuid: gpus[i].uuid.clone(),
            gpu_memory: gpus[i].quota.unwrap(),
            utilization: cores[1 - i],
            limit: cores[1 - i],
        };
        let q = quota_config::MultiGpuQuota {
            pod_uid: "pod-tp2".into(),
            container_name: "main".into(),
            hard_limit: true,
            driver_version: self.sim.driver,
            gpus: vec![record(1), record(0)],
        };
        quota_config::write_multi(c.path(), &q, 0o644).unwrap();
        let m =
            TestManager::start_gpus(c.path(), &[gpus[1].quota.unwrap(), gpus[0].quota.unwrap()]);
        (c, m)
    }
}

fn parse(out: &std::process::Output) -> HashMap<String, String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn get(m: &HashMap<String, String>, k: &str) -> u64 {
    m.get(k)
        .unwrap_or_else(|| panic!("no {k} in {m:?}"))
        .parse()
        .unwrap()
}

fn same_bus(a: &str, b: &str) -> bool {
    let norm = |s: &str| {
        let s = s.to_ascii_lowercase();
        let (dom, rest) = s.split_once(':').unwrap_or(("0", &s));
        format!("{:x}:{rest}", u32::from_str_radix(dom, 16).unwrap_or(0))
    };
    norm(a) == norm(b)
}

/// Runs `mode` with `visible` as CUDA_VISIBLE_DEVICES and checks every
/// device the process saw against the quota of the GPU its bus id names.
fn check_per_gpu(n: &Node, mode: &str, visible: Option<&str>, expect_devices: usize) {
    let gpus = n.gpus();
    let ctx = n.ctx();
    let (c, m) = n.container();
    let mut cmd = c.command(&n.prog);
    cmd.args([mode, &(CHUNK / MIB).to_string()]);
    if let Some(v) = visible {
        cmd.env("CUDA_VISIBLE_DEVICES", v);
    }
    let o = cmd.output().unwrap();
    let k = parse(&o);
    let why = format!(
        "{mode} CUDA_VISIBLE_DEVICES={visible:?}: {k:?}\nstderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(get(&k, "init"), 0, "{why}");
    assert_eq!(get(&k, "count") as usize, expect_devices, "{why}");
    for d in 0..expect_devices {
        let bus = &k[&format!("d{d}_bus")];
        let gpu = gpus.iter().position(|g| same_bus(&g.bus, bus)).unwrap();
        let Some(quota) = gpus[gpu].quota else {
            assert_eq!(
                get(&k, &format!("d{d}_ctx")),
                NOT_PERMITTED,
                "GPU {bus} is not the container's: refused. {why}"
            );
            assert!(
                String::from_utf8_lossy(&o.stderr).contains("is not one of this container's GPUs"),
                "{why}"
            );
            continue;
        };
        assert_eq!(get(&k, &format!("d{d}_ctx")), 0, "{why}");
        let key = |s: &str| get(&k, &format!("d{d}_{s}"));
        assert_eq!(key("total"), quota, "GPU {bus}: its own quota. {why}");
        assert_eq!(
            key("free"),
            quota - ctx,
            "GPU {bus}: quota minus its context. {why}"
        );
        let filled = (quota - ctx) / CHUNK * CHUNK;
        assert_eq!(
            key("filled"),
            filled,
            "GPU {bus}: filled to its own quota. {why}"
        );
        assert_eq!(key("err"), OOM, "{why}");
        assert_eq!(key("full_total"), quota, "{why}");
        assert_eq!(key("full_free"), quota - ctx - filled, "{why}");
        // NVML's view of the same GPU (found by its bus id) agrees.
        assert_eq!(key("nvml"), 0, "{why}");
        assert_eq!(key("nvml_total"), quota, "GPU {bus} through NVML. {why}");
        assert_eq!(
            key("nvml_used"),
            ctx + filled,
            "GPU {bus} through NVML. {why}"
        );
    }
    m.wait_for(10, "the process's connection to close", |ev| {
        ev.iter().any(|e| matches!(e, Event::Closed { .. }))
    });
    // Each GPU's own ledger refused its own last allocation (GPU 1 is the
    // share's first record, GPU 0 its second); the process is gone, so
    // nothing is held any more.
    for (i, name) in [(0, "GPU 1"), (1, "GPU 0")] {
        assert_eq!(
            m.ledger_at(i).refused_allocations(),
            1,
            "{name}'s ledger. {why}"
        );
        assert_eq!(m.ledger_at(i).used(), 0, "{name}'s ledger. {why}");
    }
}

#[test]
fn memory_is_held_per_gpu_on_every_device_the_process_sees() {
    let n = Node::new();
    // All four GPUs visible: 0 and 1 are the share's, 2 and 3 are refused.
    check_per_gpu(&n, "alloc", None, 4);
}

#[test]
fn devices_are_matched_by_bus_id_whatever_their_order_or_form() {
    let n = Node::new();
    check_per_gpu(&n, "alloc", Some("1,0"), 2);
    let gpus = n.gpus();
    let by_uuid = format!("{},{}", gpus[1].uuid, gpus[0].uuid);
    check_per_gpu(&n, "alloc", Some(&by_uuid), 2);
    // A GPU outside the share first: refused; the share's still held.
    check_per_gpu(&n, "alloc", Some("3,1,0"), 3);
}

#[test]
fn a_vmm_handle_charges_the_gpu_its_location_names() {
    let n = Node::new();
    // Every handle is created from the first device's context.
    check_per_gpu(&n, "vmm", Some("1,0"), 2);
    check_per_gpu(&n, "vmm", Some("0,1"), 2);
}

#[test]
fn a_one_gpu_interposer_is_refused_for_a_multi_gpu_container() {
    let n = Node::new();
    let gpus = n.gpus();
    // What a one-GPU reader registers with: vcuda.config alone, enable = 1;
    // the manager serves the container's two ledgers.
    let c = n.sim.vm_dir();
    let d = quota_config::ResourceData {
        pod_uid: "pod-tp2".into(),
        container_name: "main".into(),
        bus_id: gpus[1].bus.clone(),
        gpu_memory: 512 * MIB,
        utilization: 100,
        hard_limit: true,
        driver_version: n.sim.driver,
        enable: true,
        ..Default::default()
    };
    quota_config::write_atomic(
        &c.path().join(quota_config::CONFIG_FILE),
        &d.to_bytes().unwrap(),
        0o644,
        quota_config::Durability::Derived,
    )
    .unwrap();
    let m = TestManager::start_gpus(c.path(), &[512 * MIB, 1024 * MIB]);
    let o = c.command(&n.prog).args(["alloc", "64"]).output().unwrap();
    let k = parse(&o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(get(&k, "init"), NOT_PERMITTED, "{k:?} {stderr}");
    assert!(
        stderr.contains("this container's share spans 2 GPUs; this interposer enforces one"),
        "{stderr}"
    );
    assert!(m.live().is_empty());
    assert_eq!(m.ledger_at(0).used() + m.ledger_at(1).used(), 0);
}

/// Percent of `[from, to)` the process `pid` kept the node's GPU `gpu`
/// busy, from the sim's timeline (ground truth, not NVML's samples).
fn busy(n: &Node, gpu: usize, pid: i32, from: u64, to: u64) -> f64 {
    n.sim
        .state()
        .process_utilization(gpu, from, to)
        .into_iter()
        .filter(|(p, _)| p.host_pid.unwrap_or(p.ns_pid) as i32 == pid || p.ns_pid as i32 == pid)
        .map(|(_, pct)| pct)
        .sum()
}

#[test]
fn each_gpu_is_held_to_its_own_compute_quota() {
    use std::io::{BufRead, BufReader, Read};
    let n = Node::new();
    // GPU 1 (the first record) 20%, GPU 0 50%; the devices in reverse order.
    let (c, _m) = n.container_with_cores([20, 50]);
    let mut child = c
        .command(&n.prog)
        .args(["compute", "4.5"])
        .env("CUDA_VISIBLE_DEVICES", "1,0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while !text.contains("start_ns=") {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        text.push_str(&line);
    }
    let head = test_support::kv(&text);
    let start: u64 = head
        .get("start_ns")
        .unwrap_or_else(|| panic!("no start_ns in {text}"))
        .parse()
        .unwrap();
    let pid: i32 = head["pid"].parse().unwrap();
    // Measured while it runs (the sim forgets exited processes).
    let (from, to) = (start + 1_000_000_000, start + 4_000_000_000);
    let now = test_support::shim::simnode::now_ns();
    if to > now {
        std::thread::sleep(std::time::Duration::from_nanos(to - now + 20_000_000));
    }
    let (gpu1, gpu0) = (busy(&n, 1, pid, from, to), busy(&n, 0, pid, from, to));
    out.read_to_string(&mut text).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.wait().unwrap().success(), "{text}\n{err}");
    let k = test_support::kv(&text);
    for d in 0..2 {
        assert_eq!(k[&format!("d{d}_launch_err")], "0", "{text}\n{err}");
    }
    eprintln!("GPU 1 (hard 20%): {gpu1:.1}%, GPU 0 (hard 50%): {gpu0:.1}%");
    // The tolerance of tests/shim_compute.rs: within half the quota.
    assert!(
        gpu1 > 10.0 && gpu1 < 30.0,
        "GPU 1 achieved {gpu1:.1}% under a hard 20%"
    );
    assert!(
        gpu0 > 25.0 && gpu0 < 75.0,
        "GPU 0 achieved {gpu0:.1}% under a hard 50%"
    );
}

#[test]
fn after_a_manager_restart_the_process_keeps_its_bytes_on_every_gpu() {
    use std::io::{BufRead, BufReader, Read, Write};
    let n = Node::new();
    let ctx = n.ctx();
    let gpus = n.gpus();
    let quotas = [gpus[1].quota.unwrap(), gpus[0].quota.unwrap()];
    let (c, m) = n.container();
    let mut child = c
        .command(&n.prog)
        .args(["hold", "128"])
        .env("CUDA_VISIBLE_DEVICES", "0,1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while !text.contains("held=") {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        text.push_str(&line);
    }
    assert!(text.contains("held=1"), "{text}");
    let held = ctx + 128 * MIB;
    let pid = match &m.events()[0] {
        Event::Registered { pid, .. } => *pid,
        e => panic!("{e:?}"),
    };
    for i in 0..2 {
        let t = std::time::Instant::now();
        while m.ledger_at(i).used() != held {
            assert!(
                t.elapsed().as_secs() < 5,
                "ledger {i}: {}",
                m.ledger_at(i).used()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    m.crash();
    let m2 = TestManager::start_gpus(c.path(), &quotas);
    m2.wait_for(10, "re-registration", |e| {
        e.iter().any(
            |e| matches!(e, Event::Registered { pid: p, previous_slot: Some(_), .. } if *p == pid),
        )
    });
    for i in 0..2 {
        assert_eq!(m2.ledger_at(i).used(), held, "ledger {i} after the restart");
    }
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"again\n").unwrap();
    drop(stdin);
    out.read_to_string(&mut text).unwrap();
    assert!(child.wait().unwrap().success(), "{text}");
    let k = parse_text(&text);
    assert_eq!(k["d0_again"], "0", "{text}");
    assert_eq!(k["d1_again"], "0", "{text}");
    m2.wait_for(5, "the close", |e| {
        e.iter()
            .any(|e| matches!(e, Event::Closed { pid: p, .. } if *p == pid))
    });
    for i in 0..2 {
        assert_eq!(
            m2.ledger_at(i).used(),
            0,
            "ledger {i} once the process is gone"
        );
    }
}

fn parse_text(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
