//! The interposer as real drivers and tools meet it: cuGetProcAddress
//! against a driver that hands out internal entry points, the symbols
//! nvidia-smi and cuda-gdb look up, NVML's per-process queries with other
//! tenants on the GPU, NVML-only tools, and a C host whose manager hangs up
//! mid-registration. C programs: tests/c/shim_entry.c (and shim_client.c,
//! shim_compute.c as workloads).
//!
//! Needs `cargo build --workspace` first (gpu-sim, the sim's cdylibs and
//! libvcuda.so).

use server::{Event, TestManager};
use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use test_support::shim::{server, simnode};
use test_support::{target_dir, workspace_root};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

struct Node {
    sim: ShimNode,
    vm: Container,
    entry: PathBuf,
}

impl Node {
    fn new() -> Node {
        let (sim, entry) = ShimNode::sample(&workspace_root(), &target_dir(), "shim_entry.c");
        Node {
            vm: sim.vm_dir(),
            sim,
            entry,
        }
    }

    fn manager(&self, quota: u64) -> TestManager {
        server::write_config(self.vm.path(), quota, self.sim.driver, true);
        TestManager::start(self.vm.path(), quota)
    }

    fn c(&self, name: &str) -> PathBuf {
        self.sim
            .compile_c(&workspace_root().join("tests/c").join(name))
    }
}

/// Runs `c` and parses its `key=value` words.
fn run(mut c: Command) -> HashMap<String, String> {
    let out = c.output().expect("run test program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{c:?} failed ({}):\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let mut kv = test_support::kv(&stdout);
    kv.insert("_stdout".into(), stdout);
    kv.insert("_stderr".into(), stderr.into_owned());
    kv
}

fn num(kv: &HashMap<String, String>, k: &str) -> i64 {
    kv.get(k)
        .unwrap_or_else(|| panic!("no {k} in {}\n{}", kv["_stdout"], kv["_stderr"]))
        .parse()
        .unwrap()
}

fn pids(kv: &HashMap<String, String>, k: &str) -> Vec<u32> {
    kv.get(k)
        .unwrap_or_else(|| panic!("no {k} in {}", kv["_stdout"]))
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

/// Polls `f` every 50 ms until it returns Some, for at most `secs`.
fn wait_for<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child that is killed when the test ends, pass or fail.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn cu_get_proc_address_hands_out_the_wrappers_when_the_driver_answers_with_internal_pointers() {
    let n = Node::new();
    // Straight on the sim: like a real driver, cuGetProcAddress answers
    // with an internal entry point, not the export's address.
    let mut c = n.sim.direct().command(&n.entry);
    c.args(["procaddr", "1024"]);
    let r = run(c);
    assert_eq!(num(&r, "gpa_r"), 0);
    assert_eq!(num(&r, "alloc_is_export"), 0, "the sim is adversarial");
    assert!(num(&r, "allocated") > 4, "no quota on the bare driver");
    let bare_ns = r["gpa_ns"].clone();

    // Through the interposer: every enforced entry is our wrapper, the quota
    // holds, and the driver's own refusals come back unchanged.
    let m = n.manager(4 * GIB);
    let mut c = n.vm.command(&n.entry);
    c.args(["procaddr", "256"]);
    let r = run(c);
    // Allocations stop at the quota (the context's own memory may be
    // charged too), refused with CUDA_ERROR_OUT_OF_MEMORY.
    let held = num(&r, "allocated") as u64 * 256 * MIB;
    assert!(
        (3 * GIB..=4 * GIB).contains(&held),
        "{held} bytes through cuGetProcAddress's cuMemAlloc: {}",
        r["_stdout"]
    );
    assert_eq!(m.ledger().refused_allocations(), 1);
    eprintln!(
        "cuGetProcAddress_v2(\"cuMemAlloc\"): {bare_ns} ns on the sim, {} ns through the interposer",
        r["gpa_ns"]
    );
    for (k, v) in [
        ("gpa_r", 0),
        ("gpa_status", 0),
        ("alloc_is_export", 1),
        ("v1_r", 0),
        ("free_is_export", 1),
        ("launch_ptsz_is_export", 1),
        ("gpa_is_export", 1),
        // cuGetProcAddress_v2 reports a missing name through symbolStatus
        // with CUDA_SUCCESS, as NVIDIA's 535 and 550 do (tests/nvidia_oracle.rs).
        ("unknown_r", 0),
        ("unknown_status", 1),
        ("unknown_null", 1),
        ("old_r", 0),
        ("old_status", 2),
        ("last", 2),
    ] {
        assert_eq!(num(&r, k), v, "{k}: {}", r["_stdout"]);
    }
}

#[test]
fn nvidia_smi_and_cuda_gdb_find_their_symbols_in_a_share() {
    let n = Node::new();
    let _m = n.manager(4 * GIB);
    let mut c = n.vm.command(&n.entry);
    c.arg("exports");
    let r = run(c);
    assert_eq!(num(&r, "nvml_export_table"), 1, "{}", r["_stdout"]);
    assert_eq!(num(&r, "nvml_init"), 0);
    // Forwarded to the driver, which knows no table of that id.
    assert_eq!(num(&r, "table_r"), 3, "NVML_ERROR_NOT_SUPPORTED");
    assert_eq!(num(&r, "table_null"), 1);
    assert_eq!(num(&r, "cudbg_found"), num(&r, "cudbg_wanted"));
}

#[test]
fn nvml_per_process_queries_list_only_the_containers_processes() {
    let n = Node::new();
    let compute = n.c("shim_compute.c");
    // Ours: a container without a compute limit, saturating the GPU.
    let ours = n.sim.container(100, true, 0);
    let m = ours.manager.as_ref().unwrap();
    let mut c = ours.command(&compute);
    c.args(["saturate", "60"]).stdout(Stdio::null());
    let mine = Guard(c.spawn().unwrap());
    let mine_pid = mine.0.id();
    m.wait_for(10, "registration", |e| {
        e.iter()
            .any(|e| matches!(e, Event::Registered { pid, .. } if *pid as u32 == mine_pid))
    });
    // Another tenant on the same GPU, straight on the driver.
    let direct = n.sim.direct();
    let mut c = direct.command(&compute);
    c.args(["saturate", "60"]).stdout(Stdio::null());
    let other = Guard(c.spawn().unwrap());
    let other_pid = other.0.id();

    let probe = |ct: &Container| {
        let mut c = ct.command(&n.entry);
        c.args(["tenants", &other_pid.to_string()]);
        run(c)
    };
    // The driver itself lists both tenants everywhere (the leak to close).
    let bare = wait_for(30, "both tenants in the driver's samples", || {
        let r = probe(&direct);
        let both = |k: &str| {
            let p = pids(&r, k);
            p.contains(&mine_pid) && p.contains(&other_pid)
        };
        (both("util") && both("info")).then_some(r)
    });
    for k in ["detail", "acct"] {
        let p = pids(&bare, k);
        assert!(
            p.contains(&mine_pid) && p.contains(&other_pid),
            "{k}: {p:?}"
        );
    }
    assert_eq!(num(&bare, "other_stats_r"), 0);
    assert_eq!(num(&bare, "other_name_r"), 0);

    // In the container: only its own process, in every query.
    let r = wait_for(30, "our samples through the interposer", || {
        let r = probe(&ours);
        (pids(&r, "util").contains(&mine_pid) && pids(&r, "info").contains(&mine_pid)).then_some(r)
    });
    for k in ["util", "info", "detail", "acct"] {
        let p = pids(&r, k);
        assert!(
            !p.is_empty() && p.iter().all(|&p| p == mine_pid),
            "{k}: {p:?}, ours {mine_pid}, other {other_pid}\n{}",
            r["_stdout"]
        );
        assert_eq!(num(&r, &format!("{k}_r")), 0, "{k}");
    }
    assert_eq!(num(&r, "other_stats_r"), 6, "NVML_ERROR_NOT_FOUND");
    assert_eq!(num(&r, "other_name_r"), 6, "NVML_ERROR_NOT_FOUND");
    assert_eq!(
        num(&r, "info_bad_version_r"),
        25,
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH"
    );
    drop((mine, other));
}

#[test]
fn nvml_only_tools_take_no_slot_and_never_wait_for_the_manager() {
    let n = Node::new();
    let m = n.manager(4 * GIB);
    let client = n.c("shim_client.c");
    // A CUDA process of the container holding 1 GiB.
    let ours = holder(&n.vm, &client, 1024);
    // 1 GiB, plus what the driver took for the context if that is charged.
    let used = m.ledger().used();
    assert!(used >= GIB, "{used}");

    let nvml_only = || {
        let mut c = n.vm.command(&n.entry);
        c.arg("nvmlonly").env("VCUDA_REGISTER_TIMEOUT_MS", "60000");
        run(c)
    };
    // The ledger's use may move while we look (the holder's watcher
    // reconciles what the driver holds): the view is the use at some
    // moment between the two reads.
    let before = m.ledger().used();
    let r = nvml_only();
    let after = m.ledger().used();
    assert_eq!(num(&r, "init"), 0);
    assert_eq!(num(&r, "mem"), 0);
    assert_eq!(num(&r, "total"), 4 * GIB as i64);
    let seen = num(&r, "used") as u64;
    assert!(
        (before.min(after)..=before.max(after)).contains(&seen),
        "the container's view, from the ledger: {seen}, ledger {before}..{after}"
    );
    assert_eq!(num(&r, "free") as u64, 4 * GIB - seen);
    let registered = |ev: &[Event]| {
        ev.iter()
            .filter(|e| matches!(e, Event::Registered { .. }))
            .count()
    };
    assert_eq!(registered(&m.events()), 1, "only the holder registered");
    let slots = (0..container_ledger::SLOTS)
        .filter(|&i| m.ledger().slot(i).is_some())
        .count();
    assert_eq!(slots, 1, "no ledger slot for the NVML-only tool");

    // Manager down: the view still answers, without waiting for it (the
    // registration timeout is 60 s here).
    let used = m.ledger().used();
    m.crash();
    let t = Instant::now();
    let r = nvml_only();
    let took = t.elapsed();
    eprintln!("NVML-only tool with the manager down: {took:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert_eq!(
        (num(&r, "total"), num(&r, "used")),
        (4 * GIB as i64, used as i64)
    );
    // A tool that cannot read the ledger (here: it is gone; in a pod, a
    // non-root user): the driver's per-process use of the container's PIDs,
    // not the card's (another tenant holds 2 GiB more).
    let direct = n.sim.direct();
    let other = holder(&direct, &client, 2048);
    std::fs::rename(
        n.vm.path().join(container_ledger::LEDGER_FILE),
        n.vm.path().join("ledger.moved"),
    )
    .unwrap();
    // Another container's ledger, as /proc shows it under hostPID: a sealed
    // memfd of the same name, empty. Without the inode the manager records
    // beside the quota, no memfd is the container's: the tool once took
    // the first of that name (0 used here; beside the real-node suite, a
    // pod's ledger).
    let _decoy = container_ledger::Ledger::create_sealed(0, 8 * GIB).unwrap();
    let r = nvml_only();
    let seen = num(&r, "used") as u64;
    assert_eq!(num(&r, "total"), 4 * GIB as i64);
    assert!(
        (GIB..2 * GIB).contains(&seen),
        "{seen}: the holder's 1 GiB and its context"
    );
    drop((ours, other));
}

#[test]
fn a_manager_hanging_up_mid_registration_never_kills_a_c_host_with_sigpipe() {
    let n = Node::new();
    server::write_config(n.vm.path(), GIB, n.sim.driver, true);
    // A "manager" that accepts every connection and closes it at once.
    let l = std::os::unix::net::UnixListener::bind(n.vm.path().join("vcuda.sock")).unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            drop(c);
        }
    });
    // connect() returns only after the hang-up, so every registration write
    // meets a dead peer (deterministically, not by winning a race).
    let preload = n.sim.root().join("hangup_preload.so");
    let st = Command::new("gcc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&preload)
        .arg(workspace_root().join("tests/c/hangup_preload.c"))
        .arg("-ldl")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling hangup_preload.c");
    let mut c = n.vm.command(&n.entry);
    c.args(["sigpipe", "20"])
        .env("LD_PRELOAD", &preload)
        .env("VCUDA_REGISTER_TIMEOUT_MS", "150");
    let r = run(c);
    assert_eq!(num(&r, "killed_by_sigpipe"), 0, "{}", r["_stdout"]);
    assert_eq!(num(&r, "refused_cleanly"), 20);
}

/// Starts `shim_client hold MIB` under `ct` and waits until it holds.
fn holder(ct: &Container, client: &std::path::Path, mib: u64) -> Guard {
    let mut c = ct.command(client);
    c.args(["hold", &mib.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut g = Guard(c.spawn().unwrap());
    let mut line = String::new();
    BufReader::new(g.0.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("holding"), "{line}");
    g
}

#[test]
fn nvidia_smi_in_a_share_shows_the_quota_and_only_the_containers_processes() {
    let n = Node::new();
    let m = n.manager(4 * GIB);
    let client = n.c("shim_client.c");
    let ours = holder(&n.vm, &client, 1024);
    let direct = n.sim.direct();
    let other = holder(&direct, &client, 2048);
    let smi = n.sim.root().join("usr/bin/nvidia-smi");
    let run_smi = |ct: &Container, args: &[&str]| {
        let out = ct.command(&smi).args(args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "nvidia-smi {args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let apps = |ct: &Container| -> Vec<u32> {
        run_smi(ct, &["--query-compute-apps=pid", "--format=csv,noheader"])
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect()
    };
    // On the bare driver nvidia-smi sees both tenants.
    let all = apps(&direct);
    assert!(
        all.contains(&ours.0.id()) && all.contains(&other.0.id()),
        "{all:?}"
    );
    // In the share (it starts at all: its symbols are there), only ours.
    assert_eq!(apps(&n.vm), vec![ours.0.id()]);
    let mem = run_smi(
        &n.vm,
        &[
            "--query-gpu=memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ],
    );
    let v: Vec<u64> = mem.trim().split(", ").map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0], 4096, "the quota as the card's memory: {mem}");
    assert!(
        v[1] >= 1024 && v[1] < 2048,
        "the container's use, not the card's: {mem}"
    );
    assert_eq!(
        m.events()
            .iter()
            .filter(|e| matches!(e, Event::Registered { .. }))
            .count(),
        1,
        "nvidia-smi did not register"
    );
    drop((ours, other));
}
