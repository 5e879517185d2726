//! NVIDIA's real CUDA runtime (`libcudart.so.12` and `.13`, unmodified) on the
//! simulated node, directly and under the interposer: the C program
//! `tests/c/sim_cudart.c` (a fatbinary registered and launched the way
//! nvcc's host code does it) linked with each runtime the suite carries:
//!
//! * 12.4.127 from Debian trixie's `libcudart12` (tests/nvidia/fetch.sh,
//!   `VCUDA_NVIDIA_ROOTS`);
//! * 12.9.79 from PyPI's `nvidia-cuda-runtime-cu12` wheel and 13.5.37 from
//!   its `nvidia-cuda-runtime` (CUDA 13) wheel (tests/run.sh caches both
//!   in `$VCUDA_CACHE/wheels` and installs them for python3); 13.5 runs on
//!   the node's CUDA 13.0 driver by minor-version compatibility.
//!
//! And a CUDA C++ program compiled by NVIDIA's nvcc
//! (`tests/c/sim_cudart_nvcc.cu`, PyPI's CUDA 13.5 toolchain wheels
//! `nvidia-cuda-nvcc`, `nvidia-nvvm`, `nvidia-cuda-crt`): a real sm_80 cubin
//! in nvcc's fatbinary, launched by nvcc's host code.
//!
//! The runtime needs the driver's private export tables first
//! (`crates/sim/gpu-sim-cuda/src/export_table.rs`); without them it answers
//! cudaErrorNotSupported to everything. Missing runtimes fail the test
//! under `VCUDA_REQUIRE_ALL=1` (tests/run.sh).
//!
//! Needs `cargo build --workspace` first (gpu-sim, the sim's cdylibs and
//! libvcuda.so) and gcc.

use gpu_sim_core::NodeSpec;
use simnode::{Container, ShimNode};
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::shim::simnode;
use test_support::{Capability, missing, nvidia_drivers, target_dir, workspace_root};

/// One runtime: where it comes from, and the program linked with it (run
/// path to a directory holding only that runtime).
struct Runtime {
    label: String,
    prog: PathBuf,
}

/// The runtimes the suite carries, each with `sim_cudart.c` built against
/// it under `dir`. Missing ones are said through [`missing`].
fn runtimes(dir: &Path) -> Vec<Runtime> {
    let mut found = Vec::new();
    let debian = nvidia_drivers().into_iter().find_map(|d| d.libcudart());
    match debian {
        Some(p) => found.push(("debian-trixie", p)),
        None => missing(
            Capability::NvidiaDrivers,
            "no libcudart.so.12 in VCUDA_NVIDIA_ROOTS (Debian trixie's libcudart12)",
        ),
    }
    for (label, module, lib) in [
        (
            "pypi-nvidia-cuda-runtime-cu12",
            "nvidia.cuda_runtime",
            "lib/libcudart.so.12",
        ),
        (
            "pypi-nvidia-cuda-runtime-13",
            "nvidia.cu13",
            "lib/libcudart.so.13",
        ),
    ] {
        match wheel_runtime(module, lib) {
            Some(p) => found.push((label, p)),
            None => missing(
                Capability::CudaWheels,
                &format!("python3 has no {module}/{lib}: tests/run.sh installs {label}'s wheel"),
            ),
        }
    }
    found
        .into_iter()
        .map(|(label, lib)| build(dir, label, &lib))
        .collect()
}

/// `lib` in the package `module` of a wheel installed for python3.
fn wheel_runtime(module: &str, lib: &str) -> Option<PathBuf> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(format!("import {module} as m; print(list(m.__path__)[0])"))
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let lib = Path::new(dir.trim()).join(lib);
    (out.status.success() && lib.is_file()).then_some(lib)
}

fn build(dir: &Path, label: &str, lib: &Path) -> Runtime {
    let rt_dir = dir.join(label);
    std::fs::create_dir_all(&rt_dir).unwrap();
    // A private copy: the run path must not bring other libraries along.
    let name = lib.file_name().unwrap();
    std::fs::copy(lib, rt_dir.join(name)).unwrap();
    let prog = rt_dir.join("sim_cudart");
    let src = workspace_root().join("tests/c/sim_cudart.c");
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&prog)
        .arg(&src)
        .arg("-L")
        .arg(&rt_dir)
        .arg(format!("-l:{}", name.to_string_lossy()))
        .arg(format!("-Wl,-rpath,{}", rt_dir.display()))
        .status()
        .expect("gcc");
    assert!(
        st.success(),
        "compiling {} against {}",
        src.display(),
        lib.display()
    );
    Runtime {
        label: label.into(),
        prog,
    }
}

/// `tests/c/sim_cudart_nvcc.cu` compiled by the CUDA 13 nvcc of the wheels
/// installed for python3, linked with their `libcudart.so.13`.
fn nvcc_program(dir: &Path) -> Option<Runtime> {
    let Some(nvcc) = wheel_runtime("nvidia.cu13", "bin/nvcc") else {
        missing(
            Capability::CudaWheels,
            "python3 has no nvidia.cu13/bin/nvcc: tests/run.sh installs nvcc's wheels",
        );
        return None;
    };
    let Some(lib) = wheel_runtime("nvidia.cu13", "lib/libcudart.so.13") else {
        missing(
            Capability::CudaWheels,
            "python3 has no nvidia.cu13/lib/libcudart.so.13",
        );
        return None;
    };
    let out_dir = dir.join("nvcc");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::copy(&lib, out_dir.join("libcudart.so.13")).unwrap();
    let src = workspace_root().join("tests/c/sim_cudart_nvcc.cu");
    let obj = out_dir.join("sim_cudart_nvcc.o");
    let st = Command::new(&nvcc)
        .args([
            "-c",
            "-gencode",
            "arch=compute_80,code=[sm_80,compute_80]",
            "-o",
        ])
        .arg(&obj)
        .arg(&src)
        .status()
        .expect("nvcc");
    assert!(st.success(), "nvcc {}", src.display());
    let prog = out_dir.join("sim_cudart_nvcc");
    let st = Command::new("g++")
        .arg("-o")
        .arg(&prog)
        .arg(&obj)
        .arg("-L")
        .arg(&out_dir)
        .arg("-l:libcudart.so.13")
        .arg(format!("-Wl,-rpath,{}", out_dir.display()))
        .status()
        .expect("g++");
    assert!(st.success(), "linking {}", prog.display());
    Some(Runtime {
        label: "nvcc-13.5".into(),
        prog,
    })
}

/// Runs a mode of the program in `c`; its `key=value` lines.
fn run(rt: &Runtime, c: &Container, args: &[&str]) -> Kv {
    let out = c.command(&rt.prog).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{} {args:?}: {}", rt.label, stdout.replace('\n', " "));
    assert!(
        out.status.success() && stdout.ends_with("ok\n"),
        "{} {args:?} failed ({}): {stdout}{stderr}",
        rt.label,
        out.status
    );
    Kv(stdout)
}

struct Kv(String);

impl Kv {
    fn str(&self, key: &str) -> &str {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
            .unwrap_or_else(|| panic!("no {key}= in:\n{}", self.0))
    }
    fn num(&self, key: &str) -> f64 {
        self.str(key)
            .parse()
            .unwrap_or_else(|_| panic!("{key} not a number in:\n{}", self.0))
    }
}

fn node() -> ShimNode {
    let target = target_dir();
    ShimNode::install(
        &workspace_root(),
        &target.join("gpu-sim"),
        &target.join("libvcuda.so"),
        "sim-1gpu",
    )
}

fn spec() -> NodeSpec {
    NodeSpec::load(&workspace_root().join("config/nodes/sim-1gpu.toml")).unwrap()
}

/// Device count, properties, versions and memory info: what the runtime
/// learns through the export tables, cuGetProcAddress and the device
/// queries. `total_mib`: the card's, or the quota under the interposer.
fn check_info(rt: &Runtime, c: &Container, total_mib: u64) -> Kv {
    let spec = spec();
    let kv = run(rt, c, &["info"]);
    assert_eq!(kv.str("count"), "1", "{}", rt.label);
    assert_eq!(kv.num("driver") as i32, spec.cuda_version);
    let runtime = kv.num("runtime");
    assert!(runtime >= 12000.0, "{}: {}", rt.label, kv.0);
    assert!(runtime < 14000.0, "{}: {}", rt.label, kv.0);
    let gpu = &spec.gpus[0];
    assert_eq!(kv.str("dev0.name"), gpu.name);
    assert_eq!(kv.num("dev0.total_mib") as u64, total_mib, "{}", rt.label);
    assert_eq!(kv.str("dev0.sms"), gpu.sm_count.to_string());
    assert_eq!(kv.str("dev0.cc"), gpu.compute_capability);
    assert_eq!(kv.num("total_mib") as u64, total_mib, "{}", rt.label);
    assert!(
        kv.num("free_mib") < total_mib as f64,
        "the context costs memory"
    );
    kv
}

/// cudaMalloc of `chunk` MiB until refused: the runtime sees
/// cudaErrorMemoryAllocation within a chunk of what was free, recovers,
/// and frees everything.
fn check_oom(rt: &Runtime, c: &Container, chunk: u64) -> Kv {
    let kv = run(rt, c, &["oom", &chunk.to_string()]);
    assert_eq!(
        kv.str("refused"),
        "cudaErrorMemoryAllocation",
        "{}",
        rt.label
    );
    let free = kv.num("free_mib");
    let got = kv.num("allocated_mib");
    assert!(
        got <= free && got > free - chunk as f64,
        "{}: {got} MiB allocated of {free} MiB free",
        rt.label
    );
    assert_eq!(kv.num("free_end_mib"), free, "{}: all freed", rt.label);
    kv
}

/// Kernels from the fatbinary, timed by the simulator: the events span at
/// least the device time the sim's own timeline shows; that time per
/// kernel is returned.
fn check_kernel(rt: &Runtime, node: &ShimNode, c: &Container, launches: u32) -> f64 {
    let from = simnode::now_ns();
    let kv = run(rt, c, &["kernel", &launches.to_string()]);
    let to = simnode::now_ns();
    assert_eq!(kv.num("launches") as u32, launches);
    let device_ms = kv.num("device_ms");
    assert!(device_ms > 0.0, "{}: kernels took no device time", rt.label);
    // The device's timeline (the process has exited: no per-process view).
    // The events' span holds that busy time, and also any gap a descheduled
    // host leaves in the queue: at least, not equal, on a loaded machine.
    let busy_ms = node.state().utilization(0, from, to) / 100.0 * (to - from) as f64 / 1e6;
    assert!(
        busy_ms > 0.0 && device_ms >= 0.9 * busy_ms - 0.5,
        "{}: the sim's timeline has {busy_ms:.3} ms busy, the events {device_ms:.3} ms",
        rt.label
    );
    busy_ms / f64::from(launches)
}

/// A capture of `n` launches replayed `k` times: n nodes, n * k kernels'
/// device time on the sim's timeline. Not the events' span: it also holds
/// the gaps a descheduled host leaves between replays of 23 us kernels
/// (2.6 ms for 0.9 ms of kernels once in five with the other core loaded).
fn check_graph(rt: &Runtime, node: &ShimNode, c: &Container, per_kernel_ms: f64) {
    let (n, k) = (5, 8);
    let from = simnode::now_ns();
    let kv = run(rt, c, &["graph", &n.to_string(), &k.to_string()]);
    let to = simnode::now_ns();
    assert_eq!(kv.num("nodes") as u32, n, "{}", rt.label);
    let want = per_kernel_ms * f64::from(n * k);
    let busy_ms = node.state().utilization(0, from, to) / 100.0 * (to - from) as f64 / 1e6;
    let events_ms = kv.num("device_ms");
    assert!(
        (busy_ms - want).abs() <= 0.25 * want && events_ms >= 0.75 * want,
        "{}: {n} x {k} replayed kernels took {busy_ms:.3} ms on the device ({events_ms:.3} ms between the events), one launch {per_kernel_ms:.4} ms",
        rt.label
    );
}

/// cudaDeviceReset between two kernels: the runtime drops its state (kept
/// in the driver's context-local storage), resets the primary context and
/// loads its fatbinary again; memory comes back.
fn check_reset(rt: &Runtime, c: &Container) {
    let kv = run(rt, c, &["reset"]);
    let (a, b) = (kv.num("free_mib"), kv.num("free_again_mib"));
    assert!(
        (a - b).abs() <= 2.0,
        "{}: {a} MiB free, {b} after a reset",
        rt.label
    );
}

#[test]
fn real_runtime_runs_directly_on_the_simulated_node() {
    let dir = tempfile::tempdir().unwrap();
    let rts = runtimes(dir.path());
    let node = node();
    let c = node.direct();
    for rt in &rts {
        check_info(rt, &c, spec().gpus[0].memory_mib);
        check_oom(rt, &c, 1024);
        let per = check_kernel(rt, &node, &c, 200);
        check_graph(rt, &node, &c, per);
        check_reset(rt, &c);
        assert_eq!(node.memory_used(), 0, "{}: everything given back", rt.label);
    }
}

#[test]
fn real_runtime_runs_under_the_interposer_with_a_quota() {
    let dir = tempfile::tempdir().unwrap();
    let rts = runtimes(dir.path());
    let node = node();
    // 4 GiB of memory, no compute limit.
    let c = node.container(100, true, 0);
    for rt in &rts {
        check_info(rt, &c, 4096);
        let kv = check_oom(rt, &c, 256);
        assert!(
            kv.num("free_after_mib") < 256.0,
            "{}: refused at the quota, not before: {}",
            rt.label,
            kv.0
        );
        let per = check_kernel(rt, &node, &c, 200);
        check_graph(rt, &node, &c, per);
        check_reset(rt, &c);
    }
}

/// A hard 30 % compute quota holds a real runtime's saturating loop
/// (launches synchronized every 64, 4 s) to about 30 % of the device, after
/// the first second (the controller's warm-up), as the interposer's own
/// compute tests measure (tests/shim_compute.rs).
#[test]
fn real_runtime_kernels_are_throttled_to_the_compute_quota() {
    let dir = tempfile::tempdir().unwrap();
    let rts = runtimes(dir.path());
    let node = node();
    for rt in &rts {
        let c = node.container(30, true, 0);
        let start = simnode::now_ns();
        run(rt, &c, &["saturate", "4"]);
        let end = simnode::now_ns();
        let busy = node.state().utilization(0, start + 1_000_000_000, end);
        eprintln!("{}: {busy:.1} % busy under a hard 30 %", rt.label);
        assert!(
            busy > 15.0 && busy < 45.0,
            "{}: {busy:.1} % busy under a hard 30 %",
            rt.label
        );
    }
}

/// nvcc's own fatbinary and host code: kernels and a captured graph,
/// directly and under the interposer.
#[test]
fn an_nvcc_compiled_program_runs_directly_and_under_the_interposer() {
    let dir = tempfile::tempdir().unwrap();
    let Some(rt) = nvcc_program(dir.path()) else {
        return;
    };
    let node = node();
    for c in [node.direct(), node.container(100, true, 0)] {
        let per = check_kernel(&rt, &node, &c, 200);
        check_graph(&rt, &node, &c, per);
    }
}
