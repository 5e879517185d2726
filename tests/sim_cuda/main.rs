//! The simulated libcuda driven by real processes: a C program linked with
//! `-lcuda` against an installed root (only LD_LIBRARY_PATH points at it).
//!
//! Needs the workspace built (`cargo build --workspace`) and gcc; the
//! no-syscall check needs strace (tests/run.sh installs both).

use gpu_sim_core::state::now_ns;
use gpu_sim_core::{NodeSpec, SharedState, SimRoot};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use test_support::{SimNode, compile_c};

/// CUDA under MIG (issue 36).
mod mig;

struct Setup {
    node: SimNode,
    _bin_dir: tempfile::TempDir,
    prog: PathBuf,
}

fn setup(name: &str) -> Setup {
    let node = SimNode::install(name);
    let bin_dir = tempfile::tempdir().unwrap();
    let prog = compile_c("sim_cuda", &node, bin_dir.path());
    Setup {
        node,
        _bin_dir: bin_dir,
        prog,
    }
}

impl Setup {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.prog);
        c.args(args)
            .env("LD_LIBRARY_PATH", self.node.lib_dir())
            .env_remove("GPU_SIM_ROOT")
            .env_remove("CUDA_VISIBLE_DEVICES");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    /// Runs a mode that must succeed; returns its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "sim_cuda {args:?} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    fn state(&self) -> SharedState {
        SharedState::open(&SimRoot::new(self.node.root())).unwrap()
    }
}

/// `key=value` lines.
fn value<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in:\n{out}"))
}

fn node_spec(name: &str) -> NodeSpec {
    let path = test_support::workspace_root().join(format!("config/nodes/{name}.toml"));
    NodeSpec::load(&path).unwrap()
}

#[test]
fn c_program_sees_the_node_and_round_trips_memory() {
    let s = setup("sim-1gpu");
    let spec = node_spec("sim-1gpu");
    let out = s.ok(&["info"]);
    assert_eq!(value(&out, "count"), "1");
    assert_eq!(value(&out, "version"), spec.cuda_version.to_string());
    assert_eq!(value(&out, "dev0.name"), spec.gpus[0].name);
    assert_eq!(value(&out, "dev0.uuid"), spec.gpus[0].uuid);
    assert_eq!(value(&out, "dev0.sms"), spec.gpus[0].sm_count.to_string());
    assert_eq!(value(&out, "dev0.cc"), spec.gpus[0].compute_capability);
    assert_eq!(
        value(&out, "dev0.total_mib"),
        spec.gpus[0].memory_mib.to_string()
    );
    assert_eq!(value(&out, "dev0.bus"), "0000:07:00.0");
    let out = s.ok(&["roundtrip"]);
    assert!(out.contains("roundtrip ok"), "{out}");
}

#[test]
fn allocating_past_the_card_is_out_of_memory() {
    let s = setup("sim-1gpu");
    let out = s.ok(&["oom"]);
    assert!(
        out.contains("past_card=CUDA_ERROR_OUT_OF_MEMORY (out of memory)"),
        "{out}"
    );
    assert_eq!(s.state().memory_used(0), 0, "exited: memory given back");
}

#[test]
fn processes_see_each_others_memory() {
    let s = setup("sim-1gpu");
    let hold = compile_c("hold_memory", &s.node, s._bin_dir.path());
    let mut holder = Command::new(hold)
        .arg("1024")
        .env("LD_LIBRARY_PATH", s.node.lib_dir())
        .env_remove("GPU_SIM_ROOT")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("allocated_mib=1024"), "{line}");
    // Each process's context costs its overhead and its 8 MiB device heap.
    let ctx_mib = node_spec("sim-1gpu").gpus[0].context_overhead_mib + 8;
    assert!(ctx_mib > 8, "the sample node gives contexts a cost");
    let out = s.ok(&["info"]);
    assert_eq!(value(&out, "total_mib"), "40960");
    assert_eq!(
        value(&out, "free_mib"),
        (40960 - 1024 - 2 * ctx_mib).to_string(),
        "the other process's 1 GiB and both contexts are in use"
    );
    assert_eq!(s.state().memory_used(0), (1024 + ctx_mib) << 20);
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    let out = s.ok(&["info"]);
    assert_eq!(value(&out, "free_mib"), (40960 - ctx_mib).to_string());
}

fn read_until(child: &mut Child, want: &str) -> String {
    let stdout = child.stdout.as_mut().unwrap();
    let mut all = String::new();
    let mut r = BufReader::new(stdout);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("EOF before {want:?}: {all}");
        }
        all.push_str(&line);
        if line.starts_with(want) {
            return all;
        }
    }
}

/// A kernel on a stream of the greatest priority runs ahead of work
/// queued on one of the least: it ends after about one of the ten
/// queued 1 ms kernels (the blocks running when it arrived finish first),
/// and the queue ends that much later. Before, the simulator ran a
/// process's kernels in the order queued whatever their streams'
/// priorities (hi_ms 11).
#[test]
fn a_raised_stream_priority_runs_ahead_of_the_queue() {
    let s = setup("sim-1gpu");
    let out = s.cmd(&["priority"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let word = |k: &str| -> f64 {
        let w = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {text}"));
        w.parse().unwrap()
    };
    assert_eq!((word("least"), word("greatest")), (0.0, -5.0), "{text}");
    let (hi, lo) = (word("hi_ms"), word("lo_ms"));
    eprintln!("stream priorities: {}", text.trim());
    // Device time, from events: launching is host time, so the raised
    // kernel arrives while the first queued kernels run.
    assert!(hi < 3.5, "the raised kernel waited for the queue: {text}");
    assert!(
        (10.9..11.5).contains(&lo),
        "the queue: ten kernels and the raised one: {text}"
    );
}

/// What the sim's model guarantees for two saturating processes: their
/// kernels queue on one timeline (never overlapping) and each process is
/// charged exactly its own kernels. How evenly they share depends on the
/// host scheduler (a process kept off the CPU submits nothing): that figure
/// is printed by `cargo bench -p vcuda-tests --bench sim_share_bench`.
#[test]
fn saturating_processes_share_one_timeline() {
    let s = setup("sim-1gpu");
    let spawn = || {
        s.cmd(&["saturate", "1500"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let from = now_ns();
    let mut a = spawn();
    let mut b = spawn();
    read_until(&mut a, "ready");
    read_until(&mut b, "ready");
    // "done" follows a synchronize: every kernel of the process has ended.
    let launches = |out: String| -> u64 {
        let w = out
            .split_whitespace()
            .find_map(|w| w.strip_prefix("launches="));
        w.unwrap_or_else(|| panic!("no launches= in {out}"))
            .parse()
            .unwrap()
    };
    let na = launches(read_until(&mut a, "done"));
    let nb = launches(read_until(&mut b, "done"));
    let to = now_ns();
    let state = s.state();
    let per = state.process_utilization(0, from, to);
    let total = state.utilization(0, from, to);
    let pids = [a.id(), b.id()];
    for mut c in [a, b] {
        c.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(per.len(), 2, "{per:?}");
    let window = (to - from) as f64;
    let busy_ms = |pct: f64| pct / 100.0 * window / 1e6;
    // Each kernel: 100 waves of 10 us, 1 ms of device time.
    for (pid, n) in pids.into_iter().zip([na, nb]) {
        assert!(n > 0, "process {pid} launched nothing");
        let (_, u) = per.iter().find(|(p, _)| p.pid() == pid).unwrap();
        let ms = busy_ms(*u);
        assert!(
            (ms - n as f64).abs() < 0.01,
            "process {pid}: {n} kernels of 1 ms, charged {ms:.3} ms: {per:?}"
        );
    }
    let sum: f64 = per.iter().map(|(_, u)| u).sum();
    assert!(
        (busy_ms(sum) - busy_ms(total)).abs() < 0.01,
        "kernels overlapped: processes {sum:.3}%, device {total:.3}%"
    );
}

#[test]
fn hidden_device_node_hides_the_gpu() {
    let s = setup("sim-4gpu-pcie");
    let spec = node_spec("sim-4gpu-pcie");
    let out = s.ok(&["info"]);
    assert_eq!(value(&out, "count"), "4");
    std::fs::remove_file(
        s.node
            .root()
            .join(format!("dev/nvidia{}", spec.gpus[1].minor)),
    )
    .unwrap();
    let out = s.ok(&["info"]);
    assert_eq!(value(&out, "count"), "3");
    let uuids: Vec<&str> = (0..3)
        .map(|i| value(&out, &format!("dev{i}.uuid")))
        .collect();
    assert_eq!(
        uuids,
        [&spec.gpus[0].uuid, &spec.gpus[2].uuid, &spec.gpus[3].uuid]
    );
}

#[test]
fn cuda_visible_devices_selects_and_orders() {
    let s = setup("sim-4gpu-pcie");
    let spec = node_spec("sim-4gpu-pcie");
    let uuids_with = |env: &str| -> Vec<String> {
        let out = s
            .cmd(&["info"])
            .env("CUDA_VISIBLE_DEVICES", env)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let n: usize = value(&out, "count").parse().unwrap();
        (0..n)
            .map(|i| value(&out, &format!("dev{i}.uuid")).to_string())
            .collect()
    };
    assert_eq!(uuids_with("2"), [spec.gpus[2].uuid.clone()]);
    let prefix = &spec.gpus[3].uuid[..12];
    assert_eq!(
        uuids_with(&format!("{prefix},0")),
        [spec.gpus[3].uuid.clone(), spec.gpus[0].uuid.clone()]
    );
    // Parsing stops at the first entry that names no device.
    assert_eq!(uuids_with("1,junk,2"), [spec.gpus[1].uuid.clone()]);
    for none in ["7", "", "junk"] {
        let out = s
            .cmd(&["init"])
            .env("CUDA_VISIBLE_DEVICES", none)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.contains("cuInit=100 CUDA_ERROR_NO_DEVICE"),
            "{none:?}: {out}"
        );
    }
}

#[test]
fn missing_state_is_a_clear_cuinit_error() {
    let s = setup("sim-1gpu");
    std::fs::remove_dir_all(s.node.root().join("run/gpu-sim")).unwrap();
    let out = s.run(&["init"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("cuInit=100 CUDA_ERROR_NO_DEVICE"),
        "{stdout}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("gpu-sim state not found") && stderr.contains("gpu-sim install"),
        "{stderr}"
    );
}

#[test]
fn get_proc_address_versions_and_per_thread_variants() {
    let s = setup("sim-1gpu");
    let out = s.ok(&["procaddr"]);
    assert!(out.contains("procaddr ok"), "{out}");
}

/// Strace the launch loop: no system call may appear between the getppid()
/// markers around each round of 1000 launches (100k in all; the queue is
/// drained between rounds, as a full launch queue blocks on a real GPU too).
#[test]
fn launch_path_makes_no_syscall() {
    let s = setup("sim-1gpu");
    let trace = s._bin_dir.path().join("strace.txt");
    let strace = Command::new("strace")
        .arg("-f")
        .arg("-o")
        .arg(&trace)
        .arg(&s.prog)
        .args(["nosyscall", "100000"])
        .env("LD_LIBRARY_PATH", s.node.lib_dir())
        .env_remove("GPU_SIM_ROOT")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .expect("strace is needed for this test (apt-get install strace)");
    assert!(
        strace.status.success(),
        "{}{}",
        String::from_utf8_lossy(&strace.stdout),
        String::from_utf8_lossy(&strace.stderr)
    );
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let marks: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("getppid("))
        .collect();
    assert_eq!(
        marks.len(),
        200,
        "100 pairs of markers expected in:\n{text}"
    );
    for pair in marks.chunks(2) {
        let between = &lines[pair[0] + 1..pair[1]];
        assert!(
            between.is_empty(),
            "system calls during a round of 1000 launches:\n{}",
            between.join("\n")
        );
    }
}
