//! The interposer (cuda-shim) in real processes on a simulated node: C
//! programs linked with `-lcuda` run against a vdriver mirror of the sim
//! whose libcuda.so.1 / libnvidia-ml.so.1 are the interposer, registering
//! with a test manager (crates/testing/test-support/src/shim/server.rs) over vcuda.sock.
//!
//! Needs `cargo build --workspace` first (gpu-sim, the sim's cdylibs and
//! libvcuda.so).

use server::{Event, TestManager};
use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use test_support::shim::{server, simnode};
use test_support::{sample_ctx_cost, target_dir, workspace_root};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A sim node with its vdriver mirror (the interposer as libcuda.so.1), one
/// container vm dir (empty until a test writes its config) and the compiled
/// client.
struct Node {
    sim: ShimNode,
    vm: Container,
    client: PathBuf,
}

impl Node {
    fn new() -> Node {
        let (sim, client) = ShimNode::sample(&workspace_root(), &target_dir(), "shim_client.c");
        Node {
            vm: sim.vm_dir(),
            sim,
            client,
        }
    }

    fn dir(&self) -> &Path {
        self.vm.path()
    }

    fn write_config(&self, quota: u64, enable: bool) {
        server::write_config(self.dir(), quota, self.sim.driver, enable);
    }

    /// Writes the config and starts a manager for `quota` bytes.
    fn manager(&self, quota: u64) -> TestManager {
        self.write_config(quota, true);
        TestManager::start(self.dir(), quota)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = self.vm.command(&self.client);
        c.args(args);
        c
    }

    fn run(&self, args: &[&str]) -> Run {
        self.run_cmd(self.cmd(args))
    }

    fn run_cmd(&self, mut c: Command) -> Run {
        let out = c.output().expect("run shim_client");
        Run {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn sim_used(&self) -> u64 {
        self.sim.memory_used()
    }
}

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Run {
    fn kv(&self) -> HashMap<String, String> {
        test_support::kv(&self.stdout)
    }

    fn get(&self, k: &str) -> u64 {
        self.kv()
            .get(k)
            .unwrap_or_else(|| {
                panic!(
                    "no {k} in output:\n{}\nstderr:\n{}",
                    self.stdout, self.stderr
                )
            })
            .parse()
            .unwrap()
    }

    fn assert_ok(&self) -> &Self {
        assert!(
            self.ok,
            "client failed:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }
}

#[test]
fn cumemalloc_up_to_the_quota_then_oom_and_the_view_shows_the_quota() {
    let n = Node::new();
    // The quota leaves 4 GiB beside the program's context.
    let quota = 4 * GIB + sample_ctx_cost();
    let m = n.manager(quota);
    let r = n.run(&["quota", "1024"]);
    r.assert_ok();
    assert_eq!(r.get("start_total"), quota, "cuMemGetInfo total = quota");
    assert_eq!(
        r.get("start_device_total"),
        quota,
        "cuDeviceTotalMem = quota"
    );
    assert_eq!(r.get("start_free"), 4 * GIB, "the context is in use");
    assert_eq!(r.get("allocated"), 4);
    assert_eq!(r.get("last"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(r.get("full_free"), 0);
    assert_eq!(r.get("realloc"), 0, "a free makes room again");
    assert_eq!(r.get("end_free"), 4 * GIB);
    m.wait_for(5, "the close", |e| {
        e.iter().any(|e| matches!(e, Event::Closed { .. }))
    });
    assert_eq!(m.ledger().used(), 0);
    assert_eq!(m.ledger().peak(), quota);
}

#[test]
fn vmm_and_stream_ordered_pools_are_held_to_the_quota() {
    let n = Node::new();
    let _m = n.manager(4 * GIB + sample_ctx_cost());
    let r = n.run(&["vmm", "512"]);
    r.assert_ok();
    assert_eq!((r.get("allocated"), r.get("last")), (8, 2));
    assert_eq!(r.get("full_free"), 0);
    assert_eq!(r.get("end_free"), 4 * GIB, "cuMemRelease gives it back");
    let r = n.run(&["async", "512"]);
    r.assert_ok();
    assert_eq!((r.get("async_allocated"), r.get("async_last")), (8, 2));
    assert_eq!((r.get("pool_allocated"), r.get("pool_last")), (8, 2));
    assert_eq!(r.get("pool_full_free"), 0);
    assert_eq!(r.get("end_free"), 4 * GIB);
}

#[test]
fn every_other_allocation_path_is_charged_and_given_back() {
    let n = Node::new();
    let _m = n.manager(4 * GIB);
    let r = n.run(&["paths"]);
    r.assert_ok();
    // The driver's pitch (rows padded to 512 bytes) x height.
    assert_eq!(r.get("pitch"), 1024 * 100);
    assert_eq!(r.get("managed"), 3 * MIB);
    assert_eq!(r.get("array"), 1024 * 512 * 4 * 4);
    assert_eq!(r.get("array3d"), 256 * 256 * 16);
    assert_eq!(
        r.get("mipmapped"),
        (1024 * 1024 + 512 * 512 + 256 * 256) * 4
    );
    for k in ["pitch", "managed", "array", "array3d", "mipmapped"] {
        assert_eq!(r.get(&format!("{k}_after_free")), 0, "{k} given back");
    }
}

#[test]
fn four_processes_of_eight_threads_never_hold_more_than_the_quota() {
    let n = Node::new();
    // 1 GiB to race for beside the four contexts.
    let quota = GIB + 4 * sample_ctx_cost();
    let m = n.manager(quota);
    let base = n.sim_used();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (mut max_ledger, mut max_sim, mut samples) = (0u64, 0u64, 0u64);
    let mut children: Vec<_> = (0..4)
        .map(|_| {
            let mut c = n
                .cmd(&["race", "8", "3000", "64", "wait"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let out = std::io::BufReader::new(c.stdout.take().unwrap());
            (c, out)
        })
        .collect();
    // Every context exists before anyone races (a context that does not
    // fit the quota is refused, which is not what this test is about).
    for (_, out) in &mut children {
        let mut line = String::new();
        std::io::BufRead::read_line(out, &mut line).unwrap();
        assert_eq!(line.trim(), "ready");
    }
    for (c, _) in &mut children {
        c.stdin.take().unwrap().write_all(b"go\n").unwrap();
    }
    let st = n.sim.state();
    let waiter = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let outs: Vec<_> = children
                .into_iter()
                .map(|(c, mut out)| {
                    let mut rest = String::new();
                    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
                    let mut o = c.wait_with_output().unwrap();
                    o.stdout = rest.into_bytes();
                    o
                })
                .collect();
            stop.store(true, std::sync::atomic::Ordering::Release);
            outs
        })
    };
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        max_ledger = max_ledger.max(m.ledger().used());
        max_sim = max_sim.max(st.memory_used(0).saturating_sub(base));
        samples += 1;
        std::thread::sleep(Duration::from_micros(50));
    }
    let outs = waiter.join().unwrap();
    let (mut ok, mut oom) = (0u64, 0u64);
    for o in &outs {
        let r = Run {
            ok: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        };
        r.assert_ok();
        assert_eq!(r.get("other"), 0);
        ok += r.get("ok");
        oom += r.get("oom");
    }
    assert!(ok > 0 && oom > 0, "contention happened: ok={ok} oom={oom}");
    assert!(samples > 10);
    assert!(max_ledger <= quota, "ledger held {max_ledger} > {quota}");
    assert!(max_sim <= quota, "the driver held {max_sim} > {quota}");
    assert!(m.ledger().peak() <= quota, "peak {}", m.ledger().peak());
    m.wait_for(5, "four closes", |e| {
        e.iter()
            .filter(|e| matches!(e, Event::Closed { .. }))
            .count()
            == 4
    });
    assert_eq!(m.ledger().used(), 0);
    assert_eq!(n.sim_used(), base);
}

#[test]
fn a_fork_child_registers_on_its_own_and_its_memory_comes_back() {
    let n = Node::new();
    // Parent and child each have a context.
    let m = n.manager(4 * GIB + 2 * sample_ctx_cost());
    let r = n.run(&["fork", "1024"]);
    r.assert_ok();
    let (parent, child) = (r.get("parent_pid") as i32, r.get("child_pid") as i32);
    // The parent holds 1 GiB: the child gets the other 3.
    assert_eq!(r.get("child_allocated"), 3);
    assert_eq!(r.get("child_last"), 2);
    assert_eq!(r.get("child_status"), 0);
    // The child exited holding 1 GiB; the manager gave it back.
    assert_eq!(r.get("parent_allocated"), 3);
    m.wait_for(5, "both closes", |e| {
        e.iter()
            .filter(|e| matches!(e, Event::Closed { .. }))
            .count()
            == 2
    });
    let ev = m.events();
    let slot_of = |pid: i32| {
        ev.iter().find_map(|e| match e {
            Event::Registered { pid: p, slot, .. } if *p == pid => Some(*slot),
            _ => None,
        })
    };
    let (ps, cs) = (slot_of(parent).unwrap(), slot_of(child).unwrap());
    assert_ne!(ps, cs, "own slot for the child");
    assert!(ev.contains(&Event::Closed {
        pid: child,
        slot: cs,
        freed: GIB + sample_ctx_cost()
    }));
    assert_eq!(m.ledger().used(), 0);
}

#[test]
fn missing_config_fails_closed_with_one_clear_line() {
    let n = Node::new();
    let r = n.run(&["init"]);
    assert_eq!(r.get("cuInit"), 800, "CUDA_ERROR_NOT_PERMITTED");
    let lines: Vec<_> = r.stderr.lines().filter(|l| l.contains("vcuda")).collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    assert!(
        lines[0].contains("vcuda.config") && lines[0].contains("refusing"),
        "{}",
        lines[0]
    );
}

#[test]
fn a_compute_quota_without_the_real_nvml_fails_closed_at_cuinit() {
    let n = Node::new();
    // A driver tree with the real libcuda but no real libnvidia-ml.
    let lib64 = n.sim.lib64_without("libnvidia-ml.so.");
    let init = |c: &Container| {
        let mut cmd = c.command(&n.client);
        cmd.arg("init");
        n.run_cmd(cmd)
    };
    let c = n.sim.container(30, true, 0).with_lib64(lib64.clone());
    let r = init(&c);
    assert_eq!(r.get("cuInit"), 800, "CUDA_ERROR_NOT_PERMITTED");
    let lines: Vec<_> = r.stderr.lines().filter(|l| l.contains("vcuda")).collect();
    assert_eq!(lines.len(), 1, "{}", r.stderr);
    assert!(
        lines[0].contains("compute quota 30%")
            && lines[0].contains("libnvidia-ml.so.")
            && lines[0].contains(&lib64.display().to_string())
            && lines[0].contains("refusing"),
        "{}",
        lines[0]
    );
    let m = c.manager.as_ref().unwrap();
    assert!(m.events().is_empty(), "refused before registering");
    // No compute quota (a whole GPU's worth): NVML is not needed.
    let c = n.sim.container(100, true, 0).with_lib64(lib64);
    let r = init(&c);
    assert_eq!(r.get("cuInit"), 0, "{}", r.stderr);
}

#[test]
fn corrupt_config_fails_closed() {
    let n = Node::new();
    std::fs::write(n.dir().join("vcuda.config"), b"not a resource_data_t").unwrap();
    let r = n.run(&["init"]);
    assert_eq!(r.get("cuInit"), 800);
    assert!(
        r.stderr.contains("corrupt") && r.stderr.contains("vcuda.config"),
        "{}",
        r.stderr
    );
}

#[test]
fn manager_absent_waits_briefly_then_fails_closed() {
    let n = Node::new();
    n.write_config(GIB, true);
    let mut c = n.cmd(&["init"]);
    c.env("VCUDA_REGISTER_TIMEOUT_MS", "400");
    let t = Instant::now();
    let r = n.run_cmd(c);
    let took = t.elapsed();
    assert_eq!(r.get("cuInit"), 800);
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(
        r.stderr.contains("cannot register with the GPU manager")
            && r.stderr.contains("vcuda.sock"),
        "{}",
        r.stderr
    );
    // A manager that comes up within the wait is found.
    let mut c = n.cmd(&["init"]);
    c.env("VCUDA_REGISTER_TIMEOUT_MS", "5000");
    let child = c.stdout(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let _m = TestManager::start(n.dir(), GIB);
    let out = child.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("cuInit=0"));
}

#[test]
fn a_rejected_registration_fails_closed() {
    let n = Node::new();
    let m = n.manager(GIB);
    m.set_reject(true);
    let r = n.run(&["init"]);
    assert_eq!(r.get("cuInit"), 800);
    assert!(r.stderr.contains("rejected"), "{}", r.stderr);
}

/// A manager of another release that answers in a protocol version this
/// interposer does not speak: CUDA is refused, naming both versions, never
/// read as if it were ours. (A reply without the field, from a manager that
/// predates it, is taken as the request's version: every other test here.)
#[test]
fn a_reply_in_another_protocol_version_fails_closed_naming_both() {
    let n = Node::new();
    let m = n.manager(GIB);
    m.set_answer_version(3);
    let r = n.run(&["init"]);
    assert_eq!(r.get("cuInit"), 800);
    assert!(
        r.stderr.contains("answered in protocol version 3")
            && r.stderr.contains("asked for 1 and speaks 1 and 2"),
        "{}",
        r.stderr
    );
}

#[test]
fn disabled_config_passes_through() {
    let n = Node::new();
    n.write_config(GIB, false);
    let r = n.run(&["quota", "8192"]);
    r.assert_ok();
    // The sim's card (40 GiB), no manager needed, no quota.
    assert!(r.get("start_total") > 4 * GIB);
    assert!(r.get("allocated") >= 4);
}

#[test]
fn after_a_manager_restart_the_process_re_registers_and_keeps_its_bytes() {
    let n = Node::new();
    let m = n.manager(4 * GIB);
    let mut child = n
        .cmd(&["hold", "1024"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    m.wait_for(5, "registration", |e| !e.is_empty());
    let (pid, slot) = match &m.events()[0] {
        Event::Registered { pid, slot, .. } => (*pid, *slot),
        e => panic!("{e:?}"),
    };
    let held = GIB + sample_ctx_cost();
    let t = Instant::now();
    while m.ledger().used() != held {
        assert!(t.elapsed() < Duration::from_secs(5), "hold never allocated");
        std::thread::sleep(Duration::from_millis(10));
    }
    m.crash();
    let m2 = TestManager::start(n.dir(), 4 * GIB);
    m2.wait_for(10, "re-registration", |e| {
        e.iter().any(|e| {
            matches!(e, Event::Registered { pid: p, previous_slot: Some(s), .. }
                if *p == pid && *s as usize == slot)
        })
    });
    assert_eq!(
        m2.ledger().used(),
        held,
        "its gigabyte and context are still counted"
    );
    let stdin = child.stdin.as_mut().unwrap();
    stdin.write_all(b"alloc\n").unwrap();
    stdin.flush().unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("alloc=0"), "{stdout}");
    m2.wait_for(5, "the close", |e| {
        e.iter().any(
            |e| matches!(e, Event::Closed { pid: p, freed, .. } if *p == pid && *freed == held + GIB),
        )
    });
    assert_eq!(m2.ledger().used(), 0);
}

#[test]
fn every_refused_allocation_is_counted_once_in_the_ledger() {
    let n = Node::new();
    let m = n.manager(4 * GIB);
    assert_eq!(m.ledger().refused_allocations(), 0);
    // cuMemAlloc until the quota refuses once.
    let r = n.run(&["quota", "1024"]);
    r.assert_ok();
    assert_eq!(r.get("last"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(m.ledger().refused_allocations(), 1);
    // cuMemCreate, then cuMemAllocAsync and cuMemAllocFromPoolAsync: one
    // refusal each, counted by the same path.
    n.run(&["vmm", "512"]).assert_ok();
    assert_eq!(m.ledger().refused_allocations(), 2);
    n.run(&["async", "512"]).assert_ok();
    assert_eq!(m.ledger().refused_allocations(), 4);
    assert_eq!(m.ledger().throttled_ns(), 0, "no compute limit here");
}
