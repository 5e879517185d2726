//! Memory nobody asks for by size, on the simulated node: contexts cost
//! device memory, pools keep freed memory up to their release threshold,
//! host VMM handles take none, a handle released while mapped keeps its
//! memory until unmapped, the device heap and module images take theirs.
//! Each case runs the C program `tests/c/shim_memory.c` under the
//! interposer (the quota's view) and, where the simulator's own behaviour
//! is the point, directly on the sim.
//!
//! Needs `cargo build --workspace` first (gpu-sim, the sim's cdylibs and
//! libvcuda.so).

use server::{Event, TestManager};
use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use test_support::shim::{server, simnode};
use test_support::{sample_ctx_cost, target_dir, workspace_root};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

struct Node {
    sim: ShimNode,
    client: PathBuf,
}

impl Node {
    fn new() -> Node {
        let (sim, client) = ShimNode::sample(&workspace_root(), &target_dir(), "shim_memory.c");
        Node { sim, client }
    }

    /// A container with a memory quota of `quota` bytes (no compute
    /// limit) and its manager.
    fn container(&self, quota: u64) -> (Container, TestManager) {
        let c = self.sim.vm_dir();
        let d = quota_config::ResourceData {
            pod_uid: "pod-uid-memory".into(),
            container_name: "main".into(),
            bus_id: self.sim.bus_id.clone(),
            gpu_memory: quota,
            utilization: 100,
            hard_limit: true,
            driver_version: self.sim.driver,
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
        let m = TestManager::start(c.path(), quota);
        (c, m)
    }

    /// Runs the program in the container and waits until the manager has
    /// given its bytes back (the next run starts from an empty ledger).
    fn run_in(&self, c: &Container, m: &TestManager, args: &[&str]) -> Kv {
        let mut cmd = c.command(&self.client);
        cmd.args(args);
        let closed = closes(m);
        let r = run(cmd);
        m.wait_for(5, "the close", |e| {
            e.iter()
                .filter(|e| matches!(e, Event::Closed { .. }))
                .count()
                > closed
        });
        assert_eq!(m.ledger().used(), 0, "everything given back at exit");
        r
    }

    /// Directly on the simulated driver (no interposer).
    fn run_direct(&self, args: &[&str]) -> Kv {
        let mut cmd = self.sim.direct().command(&self.client);
        cmd.args(args);
        run(cmd)
    }
}

fn closes(m: &TestManager) -> usize {
    m.events()
        .iter()
        .filter(|e| matches!(e, Event::Closed { .. }))
        .count()
}

struct Kv {
    out: String,
    err: String,
    map: HashMap<String, String>,
}

fn run(mut cmd: Command) -> Kv {
    let o = cmd.output().expect("run shim_memory");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "shim_memory failed:\n{out}\nstderr:\n{err}"
    );
    Kv::parse(out, err)
}

impl Kv {
    fn parse(out: String, err: String) -> Kv {
        let map = test_support::kv(&out);
        Kv { out, err, map }
    }

    fn get(&self, k: &str) -> i64 {
        self.map
            .get(k)
            .unwrap_or_else(|| panic!("no {k} in:\n{}\nstderr:\n{}", self.out, self.err))
            .parse()
            .unwrap()
    }
}

#[test]
fn a_process_whose_context_costs_memory_is_never_physically_over_its_quota() {
    let n = Node::new();
    let quota = 2 * GIB;
    let (c, m) = n.container(quota);
    let mut child = c
        .command(&n.client)
        .args(["fill", "64"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let kv = Kv::parse(line.clone(), String::new());
    assert_eq!(kv.get("last"), 2, "filled until OUT_OF_MEMORY: {line}");
    let pid = kv.get("pid") as u32;
    // What the driver says the process uses (NVML's per-process memory).
    let used = n
        .sim
        .state()
        .processes(0)
        .into_iter()
        .find(|p| p.pid() == pid)
        .map(|p| p.used_bytes)
        .expect("the process is on the GPU");
    assert!(used <= quota, "physically over: {used} > {quota}");
    assert!(used + 64 * MIB > quota, "it did fill the quota: {used}");
    assert!(m.ledger().used() <= quota);
    let allocated = kv.get("allocated") as u64 * 64 * MIB;
    assert_eq!(
        allocated,
        (quota - sample_ctx_cost()) / (64 * MIB) * 64 * MIB,
        "the context's cost is what is not left to allocate"
    );
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    m.wait_for(5, "the close", |e| {
        e.iter().any(|e| matches!(e, Event::Closed { .. }))
    });
    assert_eq!(m.ledger().used(), 0);
}

#[test]
fn a_pool_that_keeps_freed_memory_keeps_it_charged_until_trimmed() {
    let n = Node::new();
    let chunk = 768 * MIB;
    // The simulator: the pool keeps the freed chunk above its threshold...
    let d = n.run_direct(&["pool", "2048", "768"]);
    assert_eq!(d.get("kept_by_pool") as u64, chunk);
    assert_eq!(d.get("charged_while_kept") as u64, chunk);
    assert_eq!(d.get("charged_after_trim"), 0);
    // ... and with the default threshold (0) gives it back at the sync.
    let d = n.run_direct(&["pool", "0", "768"]);
    assert_eq!(d.get("kept_by_pool"), 0);
    assert_eq!(d.get("charged_while_kept"), 0);
    // The interposer: room for the context and one chunk and a bit.
    let (c, m) = n.container(sample_ctx_cost() + GIB);
    let r = n.run_in(&c, &m, &["pool", "2048", "768"]);
    assert_eq!(r.get("charged_while_kept") as u64, chunk);
    assert_eq!(r.get("plain_while_kept"), 2, "the pool still holds it");
    assert_eq!(
        r.get("charged_reused") as u64,
        chunk,
        "reuse is not charged twice"
    );
    assert_eq!(r.get("charged_after_trim"), 0, "the trim gave it back");
    assert_eq!(r.get("plain_after_trim"), 0);
    assert!(m.ledger().peak() <= sample_ctx_cost() + GIB);
}

#[test]
fn a_host_located_vmm_handle_takes_no_quota() {
    let n = Node::new();
    let (c, m) = n.container(sample_ctx_cost() + 512 * MIB);
    let r = n.run_in(&c, &m, &["vmmhost", "1024"]);
    assert_eq!(
        r.get("host_create"),
        0,
        "1 GiB of host memory under a 512 MiB quota"
    );
    assert_eq!(r.get("host_charged"), 0);
    let d = n.run_direct(&["vmmhost", "1024"]);
    assert_eq!(
        d.get("host_charged"),
        0,
        "the sim takes no device memory either"
    );
}

#[test]
fn a_handle_released_while_mapped_is_charged_until_unmapped() {
    let n = Node::new();
    let d = n.run_direct(&["mapped", "512"]);
    assert_eq!(d.get("charged_after_release") as u64, 512 * MIB);
    assert_eq!(d.get("charged_after_unmap"), 0);
    let (c, m) = n.container(sample_ctx_cost() + GIB);
    let r = n.run_in(&c, &m, &["mapped", "512"]);
    assert_eq!(r.get("charged_after_release") as u64, 512 * MIB);
    assert_eq!(r.get("charged_after_unmap"), 0);
}

#[test]
fn context_destroy_and_reset_give_everything_back_and_reused_addresses_count_once() {
    let n = Node::new();
    let (c, m) = n.container(4 * GIB + 3 * sample_ctx_cost());
    let r = n.run_in(&c, &m, &["reset", "256"]);
    assert_eq!(r.get("primary_kept_after_reset"), 0);
    assert_eq!(r.get("charged_after_realloc") as u64, 256 * MIB);
    assert_eq!(r.get("charged_after_free"), 0);
    assert_eq!(r.get("own_kept_after_destroy"), 0);
    m.wait_for(5, "the close", |e| {
        e.iter().any(|e| matches!(e, Event::Closed { .. }))
    });
    assert_eq!(m.ledger().used(), 0);
    let d = n.run_direct(&["reset", "256"]);
    assert_eq!(
        d.get("primary_kept_after_reset"),
        0,
        "the sim frees them too"
    );
    assert_eq!(d.get("own_kept_after_destroy"), 0);
}

#[test]
fn the_device_heap_and_module_images_are_charged() {
    let n = Node::new();
    let d = n.run_direct(&["heap", "1024", "256"]);
    assert_eq!(d.get("heap_big"), 0, "the card has room");
    assert_eq!(d.get("heap_charged") as u64, 248 * MIB, "8 MiB by default");
    let d = n.run_direct(&["module", "300"]);
    assert_eq!(d.get("module_charged") as u64, 300 * MIB);
    assert_eq!(d.get("module_after_unload"), 0);
    let (c, m) = n.container(sample_ctx_cost() + 512 * MIB);
    let r = n.run_in(&c, &m, &["heap", "1024", "256"]);
    assert_eq!(r.get("heap_big"), 2, "a heap over the quota is refused");
    assert_eq!(r.get("heap_small"), 0);
    assert_eq!(r.get("heap_charged") as u64, 248 * MIB);
    let r = n.run_in(&c, &m, &["module", "300"]);
    assert_eq!(r.get("module_charged") as u64, 300 * MIB);
    assert_eq!(r.get("module_after_unload"), 0);
    let r = n.run_in(&c, &m, &["module", "600"]);
    assert_eq!(
        r.get("module_load"),
        2,
        "an image over the quota is refused"
    );
}

#[test]
fn without_the_real_nvml_a_memory_quota_counts_what_is_asked_and_says_so() {
    let n = Node::new();
    let lib64 = n.sim.lib64_without("libnvidia-ml.so.");
    let (c, m) = n.container(sample_ctx_cost() + 512 * MIB);
    let _m = m;
    let c = c.with_lib64(lib64);
    let mut cmd = c.command(&n.client);
    cmd.args(["heap", "1024", "256"])
        .env("LOGGER_LEVEL", "warn");
    let r = run(cmd);
    assert_eq!(r.get("heap_big"), 0, "nothing measured: not refused");
    let lines: Vec<_> = r
        .err
        .lines()
        .filter(|l| l.contains("not counted"))
        .collect();
    assert_eq!(lines.len(), 1, "one warning:\n{}", r.err);
    assert!(lines[0].contains("libnvidia-ml.so."), "{}", lines[0]);
}
