//! The simulated NVML library (crates/sim/gpu-sim-nvml) and nvidia-smi
//! (crates/sim/gpu-sim-smi) against an installed root, through the real Rust
//! client the manager uses (`nvml-wrapper`, loading the library by path).
//!
//! Load comes from helper processes (`sim-nvml-load`, tests/bin) that drive
//! the shared state the way the simulated libcuda does (attach, allocate,
//! queue kernels), so the checks do not depend on the CUDA library.
//!
//! Needs the workspace built (`cargo build --workspace`): the library is a
//! cdylib that `cargo test` alone does not build.

use gpu_sim_core::state::now_ns;
use gpu_sim_core::{NodeSpec, SharedState, SimRoot};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use test_support::{Capability, SimNode, require, target_dir};

const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// Three GPUs: 0 and 1 joined by 4 NVLinks behind one switch, 2 on the other
/// socket. Short waves so kernels of any shape are quick.
const NODE3: &str = r#"
name = "nvml-test"
driver_version = "550.54.15"
cuda_version = "12.4"
kernel_wave_ns = 10000

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-11111111-2222-3333-4444-000000000000"
memory_mib = 40960
sm_count = 108
compute_capability = "8.0"
pci_bus_id = "00000000:07:00.0"
minor = 0
numa_node = 0

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-11111111-2222-3333-4444-000000000001"
memory_mib = 40960
sm_count = 108
compute_capability = "8.0"
pci_bus_id = "00000000:0F:00.0"
minor = 1
numa_node = 0

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-11111111-2222-3333-4444-000000000002"
memory_mib = 40960
sm_count = 108
compute_capability = "8.0"
pci_bus_id = "00000000:87:00.0"
minor = 2
numa_node = 1

[[link]]
gpus = [0, 1]
pcie = "PIX"
nvlink = 4
"#;

/// An installed simulated root.
struct Root {
    _node: Option<SimNode>,
    _dir: Option<tempfile::TempDir>,
    root: PathBuf,
}

impl Root {
    fn lib(&self) -> PathBuf {
        self.root.join(LIB_DIR).join("libnvidia-ml.so.1")
    }
    fn sim(&self) -> SimRoot {
        SimRoot::new(&self.root)
    }
    fn nvml(&self) -> Nvml {
        Nvml::builder()
            .lib_path(self.lib().as_os_str())
            .init()
            .unwrap_or_else(|e| panic!("nvml init from {}: {e}", self.lib().display()))
    }
}

/// Installs `toml` with the real `gpu-sim install` when it and every
/// library it copies are built; otherwise lays out the same files itself
/// (the NVML library, its links, device nodes, the shared state).
fn install(toml: &str) -> Root {
    let t = target_dir();
    let built = t.join("libnvidia_ml.so");
    assert!(
        built.is_file(),
        "{} missing: run `cargo build --workspace` first",
        built.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.toml");
    std::fs::write(&node_file, toml).unwrap();
    let real = ["gpu-sim", "libcuda.so", "nvidia-smi"]
        .iter()
        .all(|f| t.join(f).is_file());
    if real {
        let node = SimNode::install_file(&node_file);
        let root = node.root().to_path_buf();
        return Root {
            _node: Some(node),
            _dir: Some(dir),
            root,
        };
    }
    let root = dir.path().join("root");
    let spec = NodeSpec::parse(toml, "test").unwrap();
    let lib_dir = root.join(LIB_DIR);
    std::fs::create_dir_all(&lib_dir).unwrap();
    let versioned = format!("libnvidia-ml.so.{}", spec.driver_version);
    std::fs::copy(&built, lib_dir.join(&versioned)).unwrap();
    std::os::unix::fs::symlink(&versioned, lib_dir.join("libnvidia-ml.so.1")).unwrap();
    std::os::unix::fs::symlink("libnvidia-ml.so.1", lib_dir.join("libnvidia-ml.so")).unwrap();
    let sim = SimRoot::new(&root);
    std::fs::create_dir_all(sim.dev_dir()).unwrap();
    for g in &spec.gpus {
        std::fs::write(sim.device_node(g.minor), b"").unwrap();
    }
    if t.join("nvidia-smi").is_file() {
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::copy(t.join("nvidia-smi"), root.join("usr/bin/nvidia-smi")).unwrap();
    }
    SharedState::install(&sim, &spec).unwrap();
    Root {
        _node: None,
        _dir: Some(dir),
        root,
    }
}

// ---- helper processes ----------------------------------------------------

/// A helper process; killed when dropped.
struct Helper {
    child: Child,
    /// PID as the host sees it, reported by the helper.
    host_pid: u32,
    /// The `look` mode's line: how the sim names the processes to it.
    look: String,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the load helper (tests/bin/sim-nvml-load.rs) doing `mode`
/// against `root`, and waits until it reports it is attached.
fn helper(root: &Root, mode: &str, prefix: &[&str]) -> Helper {
    let exe = env!("CARGO_BIN_EXE_sim-nvml-load");
    let mut cmd = if prefix.is_empty() {
        Command::new(exe)
    } else {
        let mut c = Command::new(prefix[0]);
        c.args(&prefix[1..]).arg(exe);
        c
    };
    let mut child = cmd
        .arg(&root.root)
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let host_pid = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("helper {mode} exited before attaching"))
            .unwrap();
        if let Some(p) = line.strip_prefix("ready host_pid=") {
            break p.trim().parse().unwrap();
        }
    };
    let look = if mode.starts_with("look") {
        lines.next().unwrap().unwrap()
    } else {
        String::new()
    };
    // Keep draining so the helper never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Helper {
        child,
        host_pid,
        look,
    }
}

// ---- tests -----------------------------------------------------------------

#[test]
fn init_enumerates_devices_with_their_identity() {
    let r = install(NODE3);
    let nvml = r.nvml();
    assert_eq!(nvml.device_count().unwrap(), 3);
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12040);
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.550.54.15");
    for i in 0..3u32 {
        let d = nvml.device_by_index(i).unwrap();
        assert_eq!(d.name().unwrap(), "NVIDIA A100-SXM4-40GB");
        assert_eq!(
            d.uuid().unwrap(),
            format!("GPU-11111111-2222-3333-4444-00000000000{i}")
        );
        assert_eq!(d.index().unwrap(), i);
        assert_eq!(d.minor_number().unwrap(), i);
        let m = d.memory_info().unwrap();
        assert_eq!(m.total, 40960 << 20);
        assert_eq!(m.used, 0);
        assert_eq!(m.free, m.total);
        let cc = d.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), (8, 0));
    }
    let d1 = nvml.device_by_index(1).unwrap();
    let pci = d1.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:0F:00.0");
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 0x0f, 0));
    assert_eq!(pci.pci_device_id & 0xffff, 0x10de);
    let by_uuid = nvml
        .device_by_uuid("GPU-11111111-2222-3333-4444-000000000002")
        .unwrap();
    assert_eq!(by_uuid.index().unwrap(), 2);
    let by_bus = nvml.device_by_pci_bus_id("0000:0f:00.0").unwrap();
    assert_eq!(by_bus.index().unwrap(), 1);
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        nvml.device_by_index(3),
        Err(NvmlError::InvalidArg)
    ));
    // Static facts clients read; values only need to be plausible.
    assert!(
        d1.temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
            .unwrap()
            > 0
    );
    assert_eq!(d1.enforced_power_limit().unwrap(), 400_000);
    assert!(d1.power_usage().unwrap() > 0);
    assert!(d1.is_in_persistent_mode().unwrap());
}

#[test]
fn topology_and_nvlinks_follow_the_node_description() {
    let r = install(NODE3);
    let nvml = r.nvml();
    let d: Vec<_> = (0..3).map(|i| nvml.device_by_index(i).unwrap()).collect();
    assert_eq!(
        d[0].topology_common_ancestor(nvml.device_by_index(1).unwrap())
            .unwrap(),
        TopologyLevel::Single
    );
    assert_eq!(
        d[0].topology_common_ancestor(nvml.device_by_index(2).unwrap())
            .unwrap(),
        TopologyLevel::System
    );
    let near: Vec<u32> = d[0]
        .topology_nearest_gpus(TopologyLevel::Single)
        .unwrap()
        .iter()
        .map(|x| x.index().unwrap())
        .collect();
    assert_eq!(near, vec![1]);
    // Links 0..3 of GPU 0 go to GPU 1; link 4 is not there.
    for link in 0..4 {
        let l = d[0].link_wrapper_for(link);
        assert!(l.is_active().unwrap(), "link {link}");
        assert_eq!(l.remote_pci_info().unwrap().bus_id, "00000000:0F:00.0");
    }
    assert!(!d[0].link_wrapper_for(4).is_active().unwrap());
    assert!(matches!(
        d[2].link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
}

#[test]
fn processes_see_each_others_memory_by_host_pid() {
    let r = install(NODE3);
    let a = helper(&r, "hold:0:1073741824", &[]);
    let b = helper(&r, "hold:0:536870912", &[]);
    let nvml = r.nvml();
    let dev = nvml.device_by_index(0).unwrap();
    let m = dev.memory_info().unwrap();
    assert_eq!(m.used, 1536 << 20, "both processes' memory");
    assert_eq!(m.free, m.total - m.used);
    let mut procs: Vec<(u32, u64)> = dev
        .running_compute_processes()
        .unwrap()
        .into_iter()
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => (p.pid, b),
            UsedGpuMemory::Unavailable => panic!("memory unavailable"),
        })
        .collect();
    procs.sort();
    let mut want = vec![(a.host_pid, 1 << 30), (b.host_pid, 512 << 20)];
    want.sort();
    assert_eq!(procs, want);
    assert!(dev.running_graphics_processes().unwrap().is_empty());
    assert!(
        nvml.device_by_index(1)
            .unwrap()
            .running_compute_processes()
            .unwrap()
            .is_empty()
    );

    drop(a);
    // The driver frees a dead process's memory.
    let deadline = Instant::now() + Duration::from_secs(5);
    while dev.memory_info().unwrap().used != 512 << 20 {
        assert!(Instant::now() < deadline, "dead process's memory not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(dev.running_compute_processes().unwrap().len(), 1);
}

/// A process in its own PID namespace (as in a container) is reported by
/// its host PID.
#[test]
fn container_process_is_reported_by_host_pid() {
    if !require(Capability::PidNamespace) {
        return;
    }
    let r = install(NODE3);
    let h = helper(&r, "hold:1:4096", &["unshare", "--pid", "--fork"]);
    let nvml = r.nvml();
    let procs = nvml
        .device_by_index(1)
        .unwrap()
        .running_compute_processes()
        .unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, h.host_pid);
    assert_ne!(procs[0].pid, 1, "not the namespace PID");
}

/// A reader inside a PID namespace (the interposer in a pod without
/// hostPID) is told what the real driver tells it (driver 580, H100,
/// `tests/gpu/probes/nvml_pidns.py`, `tests/gpu/README.md`): its own
/// namespace's processes by their PIDs there, no other namespace's process
/// in process lists, and, in utilization samples, a process of the initial
/// namespace by its host PID. A sim that named every process by host PID
/// hid that the interposer's controller looked only for host PIDs, so a
/// container without hostPID ran unthrottled on a GPU.
#[test]
fn a_reader_in_a_pid_namespace_is_named_its_own_processes_by_their_pids_there() {
    if !require(Capability::PidNamespace) {
        return;
    }
    let r = install(NODE3);
    let outside = helper(&r, "hold:0:4096", &[]);
    let inside = helper(
        &r,
        "look:0",
        &["unshare", "--pid", "--fork", "--mount-proc"],
    );
    let field = |k: &str| -> Vec<u32> {
        let v = inside
            .look
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k));
        let mut v: Vec<u32> = v
            .unwrap_or("")
            .split(',')
            .filter_map(|p| p.parse().ok())
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        field("listed="),
        vec![1],
        "lists: itself by its namespace PID only: {}",
        inside.look
    );
    let mut shown = vec![1, outside.host_pid];
    shown.sort();
    assert_eq!(
        field("shown="),
        shown,
        "samples: the outside process by host PID: {}",
        inside.look
    );
    // The initial namespace still sees both by host PID.
    let nvml = r.nvml();
    let mut pids: Vec<u32> = nvml
        .device_by_index(0)
        .unwrap()
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| p.pid)
        .collect();
    pids.sort();
    assert_eq!(pids.len(), 2, "{pids:?}");
    assert!(pids.contains(&outside.host_pid));
    assert!(!pids.contains(&1), "not the namespace PID: {pids:?}");
}

/// Mean smUtil per PID over the samples NVML returns for the last second.
fn per_process_util(nvml: &Nvml, gpu: u32) -> Vec<(u32, f64, usize)> {
    let dev = nvml.device_by_index(gpu).unwrap();
    let since = gpu_sim_core::state::mono_to_epoch_us(now_ns() - 1_000_000_000);
    let samples = dev.process_utilization_stats(since).unwrap();
    let mut by_pid: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
    for s in samples {
        assert!(s.timestamp > since);
        by_pid.entry(s.pid).or_default().push(s.sm_util);
    }
    by_pid
        .into_iter()
        .map(|(pid, v)| (pid, v.iter().sum::<u32>() as f64 / v.len() as f64, v.len()))
        .collect()
}

#[test]
fn two_saturating_processes_share_the_device_evenly() {
    let r = install(NODE3);
    let nvml = r.nvml();
    let dev = nvml.device_by_index(2).unwrap();
    // No samples yet: NOT_FOUND, as the real library says.
    assert!(matches!(
        dev.process_utilization_stats(0),
        Err(NvmlError::NotFound)
    ));
    let a = helper(&r, "saturate:2", &[]);
    let b = helper(&r, "saturate:2", &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let per = per_process_util(&nvml, 2);
    let dev_util = dev.utilization_rates().unwrap().gpu;
    eprintln!("saturating pair: per process {per:?}, device {dev_util}%");
    assert_eq!(per.len(), 2, "{per:?}");
    for (pid, util, n) in &per {
        assert!([a.host_pid, b.host_pid].contains(pid));
        assert!(*n >= 5, "samples over the last second: {n}");
        assert!((util - 50.0).abs() <= 5.0, "pid {pid}: {util}%");
    }
    assert!(dev_util >= 95, "device {dev_util}%");
}

#[test]
fn half_busy_process_reads_half_utilization() {
    let r = install(NODE3);
    let nvml = r.nvml();
    let dev = nvml.device_by_index(0).unwrap();
    assert_eq!(dev.utilization_rates().unwrap().gpu, 0);
    let h = helper(&r, "half:0", &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let util = dev.utilization_rates().unwrap().gpu;
    let per = per_process_util(&nvml, 0);
    eprintln!("half-busy process: device {util}%, per process {per:?}");
    assert!((45..=55).contains(&util), "device {util}%");
    assert_eq!(per.len(), 1);
    assert_eq!(per[0].0, h.host_pid);
    assert!((per[0].1 - 50.0).abs() <= 5.0, "{per:?}");
}

#[test]
fn injected_xid_reaches_event_wait() {
    let r = install(NODE3);
    let nvml = r.nvml();
    let dev = nvml.device_by_index(1).unwrap();
    assert!(
        dev.supported_event_types()
            .unwrap()
            .contains(EventTypes::CRITICAL_XID_ERROR)
    );
    let set = nvml.create_event_set().unwrap();
    let set = dev
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    // Nothing pending: the wait times out after about the timeout.
    let t = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    assert!(t.elapsed() >= Duration::from_millis(100));

    let state = SharedState::open(&r.sim()).unwrap();
    // An Xid on a GPU this set did not register for is not delivered.
    state.inject_xid(2, 13);
    let root = r.sim();
    let injector = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        SharedState::open(&root).unwrap().inject_xid(1, 79);
    });
    let t = Instant::now();
    let ev = set.wait(5000).unwrap();
    injector.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(ev.event_type, EventTypes::CRITICAL_XID_ERROR);
    assert!(matches!(ev.event_data, Some(XidError::Value(79))));
    assert_eq!(ev.device.uuid().unwrap(), dev.uuid().unwrap());
    set.release_events().unwrap();
}

#[test]
fn device_without_an_openable_node_is_hidden() {
    let r = install(NODE3);
    std::fs::remove_file(r.sim().device_node(1)).unwrap();
    let nvml = r.nvml();
    assert_eq!(nvml.device_count().unwrap(), 2);
    let uuids: Vec<String> = (0..2)
        .map(|i| nvml.device_by_index(i).unwrap().uuid().unwrap())
        .collect();
    assert_eq!(
        uuids,
        [
            "GPU-11111111-2222-3333-4444-000000000000",
            "GPU-11111111-2222-3333-4444-000000000002"
        ]
    );
    assert_eq!(nvml.device_by_index(1).unwrap().index().unwrap(), 1);
    assert!(matches!(
        nvml.device_by_uuid("GPU-11111111-2222-3333-4444-000000000001"),
        Err(NvmlError::NotFound)
    ));
}

/// Without an installed state the library refuses to init, says why on
/// stderr, and unknown entry points answer NOT_SUPPORTED.
#[test]
fn missing_state_is_a_clear_init_error() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia-ml.so.1");
    std::fs::copy(target_dir().join("libnvidia_ml.so"), &lib).unwrap();
    if std::env::var_os("SIM_NVML_MISSING").is_none() {
        // In a child, so the message on stderr can be checked.
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "missing_state_is_a_clear_init_error",
                "--nocapture",
            ])
            .env("SIM_NVML_MISSING", &lib)
            .env_remove("GPU_SIM_ROOT")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("libnvidia-ml"))
            .collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(lines[0].contains("gpu-sim install"), "{stderr}");
        return;
    }
    let lib = PathBuf::from(std::env::var_os("SIM_NVML_MISSING").unwrap());
    let r = Nvml::builder().lib_path(lib.as_os_str()).init();
    assert!(matches!(r, Err(NvmlError::DriverNotLoaded)), "{r:?}");
    // Raw calls: a stub and an implemented function before init.
    let c = std::ffi::CString::new(lib.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: dlopen/dlsym of the simulated NVML with NUL-terminated names; each symbol is called with its C signature.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null());
        let sym = |name: &str| {
            let n = std::ffi::CString::new(name).unwrap();
            let p = libc::dlsym(h, n.as_ptr());
            assert!(!p.is_null(), "{name} not exported");
            p
        };
        let stub: unsafe extern "C" fn() -> i32 = std::mem::transmute(sym("nvmlUnitGetCount"));
        assert_eq!(stub(), 3, "NVML_ERROR_NOT_SUPPORTED");
        // GPM too, its sample allocation included, as the real 535 and 550 answer.
        let alloc: unsafe extern "C" fn(*mut *mut std::ffi::c_void) -> i32 =
            std::mem::transmute(sym("nvmlGpmSampleAlloc"));
        let mut sample = std::ptr::null_mut();
        assert_eq!(alloc(&mut sample), 1, "NVML_ERROR_UNINITIALIZED");
        assert!(sample.is_null());
        let count: unsafe extern "C" fn(*mut u32) -> i32 =
            std::mem::transmute(sym("nvmlDeviceGetCount_v2"));
        let mut n = 0;
        assert_eq!(count(&mut n), 1, "NVML_ERROR_UNINITIALIZED");
        assert_eq!(count(std::ptr::null_mut()), 1);
    }
}

#[test]
fn nvidia_smi_shows_devices_memory_and_processes() {
    let r = install(NODE3);
    let smi = r.root.join("usr/bin/nvidia-smi");
    if !smi.is_file() {
        panic!(
            "{} missing: run `cargo build --workspace` first",
            smi.display()
        );
    }
    let h = helper(&r, "hold:0:1073741824", &[]);
    let run = |args: &[&str]| {
        let out = Command::new(&smi)
            .args(args)
            .env("LD_LIBRARY_PATH", r.root.join(LIB_DIR))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "nvidia-smi {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run(&[]);
    eprintln!("{table}");
    // The 535+ layout: every box line is 91 columns.
    for line in table.lines().skip(1).filter(|l| !l.is_empty()) {
        assert_eq!(line.chars().count(), 91, "{line:?}");
    }
    assert!(table.contains("Driver Version: 550.54.15"), "{table}");
    assert!(table.contains("CUDA Version: 12.4"), "{table}");
    assert!(table.contains("00000000:07:00.0"), "{table}");
    assert!(table.contains("1024MiB /  40960MiB"), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains(&format!(" {} ", h.host_pid)))
        .unwrap_or_else(|| panic!("no process row for {}: {table}", h.host_pid));
    assert!(row.contains("1024MiB") && row.contains(" C "), "{row}");

    let list = run(&["-L"]);
    assert_eq!(list.lines().count(), 3, "{list}");
    assert!(list.starts_with(
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-11111111-2222-3333-4444-000000000000)"
    ));

    let csv = run(&[
        "--query-gpu=index,uuid,memory.used,memory.total",
        "--format=csv,noheader,nounits",
    ]);
    assert_eq!(
        csv.lines().next().unwrap(),
        "0, GPU-11111111-2222-3333-4444-000000000000, 1024, 40960"
    );
}
