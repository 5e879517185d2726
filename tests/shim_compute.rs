//! The compute quota of the interposer, end to end on a simulated node:
//! a C program saturating the GPU with 1 ms kernels runs under the
//! interposer (a vdriver mirror of the sim) in a container vm dir served by
//! a test manager; what it achieved is read from the sim's timeline (the
//! ground truth, not the NVML samples the controller steers by).
//!
//! Functional checks with wide margins; the accuracy numbers come from
//! `cargo bench -p cuda-shim --bench compute_accuracy`. Needs
//! `cargo build --workspace` first.

use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;
use test_support::kv;
use test_support::shim::simnode;
use test_support::{target_dir, workspace_root};

/// One saturating workload at a time: the machine has few cores and a
/// CPU-starved launcher would make the lower bounds flaky.
static SERIAL: Mutex<()> = Mutex::new(());

fn node() -> (ShimNode, PathBuf) {
    ShimNode::sample(&workspace_root(), &target_dir(), "shim_compute.c")
}

struct Out {
    kv: HashMap<String, String>,
    text: String,
}

impl Out {
    fn get(&self, k: &str) -> u64 {
        self.kv
            .get(k)
            .unwrap_or_else(|| panic!("no {k} in:\n{}", self.text))
            .parse()
            .unwrap()
    }
}

/// Runs the workload and measures, while it still runs (the sim forgets
/// exited processes), what its processes achieved over
/// `[start + from_s, start + to_s)`; `start` is when it began launching.
fn run(n: &ShimNode, c: &Container, prog: &Path, args: &[&str], window: (f64, f64)) -> (Out, f64) {
    run_with(n, c, &[prog.to_str().unwrap()], args, window, &[])
}

/// [`run`] with extra environment variables; `cmd` is the program, or a
/// wrapper and its arguments ending with the program.
fn run_with(
    n: &ShimNode,
    c: &Container,
    cmd: &[&str],
    args: &[&str],
    (from_s, to_s): (f64, f64),
    env: &[(&str, &str)],
) -> (Out, f64) {
    let mut child = c
        .command(Path::new(cmd[0]))
        .args(&cmd[1..])
        .envs(env.iter().copied())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    let mut line = String::new();
    while !text.contains("start_ns=") {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            break;
        }
        text.push_str(&line);
    }
    let mut measured = None;
    let head = kv(&text);
    if let Some(start) = head.get("start_ns").and_then(|v| v.parse::<u64>().ok()) {
        let at = |s: f64| start + (s * 1e9) as u64;
        let now = simnode::now_ns();
        if at(to_s) > now {
            std::thread::sleep(Duration::from_nanos(at(to_s) - now + 20_000_000));
        }
        let pids: Vec<i32> = ["pid", "parent_pid"]
            .iter()
            .filter_map(|k| head.get(*k).and_then(|v| v.parse().ok()))
            .collect();
        measured = Some(n.busy(&pids, at(from_s), at(to_s)));
    }
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    text.push_str(&rest);
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let st = child.wait().unwrap();
    let text = format!("{text}\nstderr:\n{err}");
    assert!(st.success(), "workload failed:\n{text}");
    let u = measured.unwrap_or_else(|| panic!("no start_ns in:\n{text}"));
    (
        Out {
            kv: kv(&text),
            text,
        },
        u,
    )
}

#[test]
fn a_hard_limit_of_30_keeps_a_saturating_process_well_below_45_percent() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, true, 0);
    let (_, u) = run(&n, &c, &prog, &["saturate", "4.5"], (1.0, 4.0));
    eprintln!("hard 30: {u:.1}%");
    assert!(u < 45.0 && u > 15.0, "achieved {u:.1}% under a hard 30%");
}

#[test]
fn an_unthrottled_process_saturates_the_gpu() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    // A whole-GPU container: enable = 0. A sync every 64 launches, not
    // every 16: each sync drains the queue, and the host's wake-up after it
    // idles the device; with 16, a loaded host cost 10 points once in five.
    let c = n.whole_gpu();
    let (_, u) = run(&n, &c, &prog, &["saturate", "2.5", "64"], (0.5, 2.0));
    eprintln!("whole GPU: {u:.1}%");
    assert!(u > 90.0, "achieved {u:.1}% with no limit");
}

#[test]
fn a_soft_limit_bursts_above_its_quota_on_an_idle_gpu() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, false, 100);
    let (_, u) = run(&n, &c, &prog, &["saturate", "4.5", "8"], (1.0, 4.0));
    eprintln!("soft 30 (limit 100), alone: {u:.1}%");
    assert!(
        u > 50.0,
        "achieved only {u:.1}% with the GPU otherwise idle"
    );
}

#[test]
fn a_throttled_launch_sleeps_rather_than_spins() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(10, true, 0);
    let (o, u) = run(&n, &c, &prog, &["saturate", "3.5"], (1.0, 3.0));
    let (cpu, wall) = (o.get("cpu_ns") as f64, o.get("wall_ns") as f64);
    eprintln!(
        "hard 10: {u:.1}%, cpu {:.0} ms of {:.0} ms",
        cpu / 1e6,
        wall / 1e6
    );
    assert!(u < 25.0, "achieved {u:.1}% under a hard 10%");
    // Throttled about 90% of the time: spinning would show as ~wall.
    assert!(
        cpu < 0.2 * wall,
        "the process used {:.0} ms of CPU in {:.0} ms",
        cpu / 1e6,
        wall / 1e6
    );
}

#[test]
fn a_fork_child_is_still_throttled() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, true, 0);
    let (o, u) = run(&n, &c, &prog, &["fork", "4.5"], (1.0, 4.0));
    assert_eq!(o.get("child_status"), 0, "{}", o.text);
    assert_ne!(o.get("pid"), o.get("parent_pid"));
    eprintln!("fork child under hard 30: {u:.1}%");
    assert!(u < 45.0 && u > 15.0, "achieved {u:.1}% under a hard 30%");
}

#[test]
fn time_asleep_for_tokens_is_counted_in_the_ledger() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(10, true, 0);
    let ledger = || c.manager.as_ref().unwrap().ledger();
    assert_eq!(ledger().throttled_ns(), 0);
    let (o, _) = run(&n, &c, &prog, &["saturate", "2.5"], (0.5, 2.0));
    let (throttled, wall) = (ledger().throttled_ns() as f64, o.get("wall_ns") as f64);
    eprintln!(
        "hard 10: asleep for tokens {:.0} ms of {:.0} ms",
        throttled / 1e6,
        wall / 1e6
    );
    // One launching thread held to 10%: asleep most of the run, never longer.
    assert!(
        throttled > 0.5 * wall && throttled <= wall,
        "throttled {:.0} ms in {:.0} ms",
        throttled / 1e6,
        wall / 1e6
    );
    assert_eq!(ledger().refused_allocations(), 0);
}

/// Issue 12: a process of 1-thread kernels (about 25% busy, under the
/// quota) leaves the container's bucket a rate learned from them; the next
/// process's first 1 ms kernel must not wait longer than about what its
/// cost takes to earn at 30% (3.3 ms), whatever that history. Priced by
/// threads, it waited minutes. The bound here is seconds: the machine is
/// shared and slow, and the point is minutes against milliseconds.
#[test]
fn a_big_kernel_after_tiny_ones_launches_within_seconds() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, true, 0);
    let out = |args: &[&str]| {
        let o = c.command(&prog).args(args).output().unwrap();
        let text = format!(
            "{}\nstderr:\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status, text)
    };
    let (st, text) = out(&["tiny", "2.5"]);
    assert!(st.success(), "the tiny-kernel process failed:\n{text}");
    // The compute words' learned scale (bucket word 12, units per ms): A
    // must have left one, or B would start at the start-up rate and this
    // would prove nothing.
    let ledger = c.manager.as_ref().unwrap().ledger();
    let scale = ledger.compute_words()[12].load(Ordering::Relaxed);
    assert!(scale > 0, "no scale learned from the tiny kernels:\n{text}");
    let (st, text) = out(&["first", "1.0"]);
    let first = kv(&text).get("first_ns").cloned().unwrap_or_default();
    assert!(
        st.success() && first != "timeout",
        "the first 1 ms kernel after the tiny ones waited 30 s or more:\n{text}"
    );
    let first: u64 = first.parse().unwrap();
    eprintln!(
        "first launch after tiny kernels: {:.1} ms",
        first as f64 / 1e6
    );
    assert!(
        first < 5_000_000_000,
        "first launch took {:.1} s",
        first as f64 / 1e9
    );
}

/// Issue 12, compute fail-open: NVML's samples name none of the
/// container's PIDs (the sim's knob shifts them, as a PID namespace the
/// manager cannot map would). The quota must not silently turn off: the
/// controller says so (a log line, the ledger's flag the metrics export)
/// and charges the container the device's busy time. Unnoticed, the
/// process ran unthrottled (~100%).
#[test]
fn unattributed_samples_are_flagged_and_the_quota_still_holds() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, true, 0);
    let ledger = || c.manager.as_ref().unwrap().ledger();
    assert_eq!(ledger().compute_unattributed(), 0);
    let (o, u) = run_with(
        &n,
        &c,
        &[prog.to_str().unwrap()],
        &["saturate", "5.5"],
        (2.5, 5.0),
        &[
            ("GPU_SIM_NVML_SAMPLE_PID_OFFSET", "1000000"),
            ("LOGGER_LEVEL", "warn"),
        ],
    );
    eprintln!("hard 30, samples unattributable: {u:.1}%");
    assert_eq!(
        ledger().compute_unattributed(),
        1,
        "not flagged:\n{}",
        o.text
    );
    assert!(
        o.text.contains("name none of the container's processes"),
        "no log line:\n{}",
        o.text
    );
    assert!(u < 45.0 && u > 10.0, "achieved {u:.1}% under a hard 30%");
}

/// A container without hostPID: the program (and its fork child) run in
/// their own PID namespace (the parent is PID 1 there). The driver's NVML names them
/// by those PIDs to the controller inside (measured on driver 580; the
/// sim does the same), not by the host PIDs the manager registered: an
/// H100 ran a PyTorch CUDA graph at 86.7 % under a hard 30 % before the
/// controller took the namespace's PIDs (each process writes its own into
/// its ledger slot) as the container's too. Whichever process holds the
/// controller's lease, it must attribute the child's samples.
#[test]
fn a_container_without_host_pids_is_attributed_and_throttled() {
    if !test_support::require(test_support::Capability::PidNamespace) {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let c = n.container(30, true, 0);
    let ledger = || c.manager.as_ref().unwrap().ledger();
    let ns = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        prog.to_str().unwrap(),
    ];
    let (o, u) = run_with(
        &n,
        &c,
        &ns,
        &["fork", "5.5"],
        (2.5, 5.0),
        &[("LOGGER_LEVEL", "warn")],
    );
    assert_eq!(o.get("child_status"), 0, "{}", o.text);
    assert_eq!(
        o.get("parent_pid"),
        1,
        "not in a PID namespace:\n{}",
        o.text
    );
    eprintln!("hard 30 in a PID namespace: {u:.1}%");
    assert_eq!(
        ledger().compute_unattributed(),
        0,
        "the controller did not recognise the namespace's PIDs:\n{}",
        o.text
    );
    assert!(u < 45.0 && u > 15.0, "achieved {u:.1}% under a hard 30%");
}

/// Two busy hard shares, 30 % and 60 %, on one GPU whose NVML answers as
/// driver 580 does on an H200: one process a sample period, the busiest,
/// with the device's whole busy percent (`SAMPLE_BUSIEST_ONLY_ENV`;
/// tests/gpu/README.md, 2026-12-04). Each controller then saw periods at
/// the device's total as its own and the pair held 30.6 % and 48.0 % on
/// the H200. The interposer times a few of its own launches on the device
/// (events around them) and charges at most that: each share must hold
/// its own quota.
#[test]
fn two_hard_shares_hold_their_quotas_when_nvml_names_only_the_busiest() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (n, prog) = node();
    let (a, b) = (n.container(30, true, 0), n.container(60, true, 0));
    let env = [(gpu_sim_core::SAMPLE_BUSIEST_ONLY_ENV, "1")];
    let cmd = [prog.to_str().unwrap()];
    let args = ["saturate", "7"];
    let ((oa, ua), (ob, ub)) = std::thread::scope(|s| {
        let ta = s.spawn(|| run_with(&n, &a, &cmd, &args, (3.0, 6.5), &env));
        let tb = s.spawn(|| run_with(&n, &b, &cmd, &args, (3.0, 6.5), &env));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    eprintln!("hard 30 + hard 60, NVML names the busiest only: {ua:.1}% + {ub:.1}%");
    let texts = || format!("{}\n---\n{}", oa.text, ob.text);
    // Without the timed launches: 37.1 % + 47.7 %; with them but events
    // stamped when recorded instead of when their context runs (a sim
    // that let them count another context's work): 23.4 % + 52.3 %.
    assert!(
        (26.0..=36.0).contains(&ua),
        "hard 30 achieved {ua:.1}%:\n{}",
        texts()
    );
    assert!(
        (53.0..=66.0).contains(&ub),
        "hard 60 achieved {ub:.1}%:\n{}",
        texts()
    );
}
