//! The interposer's accounting of memory shared between processes, on the
//! simulated node (whose driver attributes shared memory to the process
//! that allocated it, as NVIDIA's does: tests/sim_ipc.rs):
//!
//! - an allocation opened over CUDA IPC or imported from a shareable VMM
//!   handle is charged once, to the container whose process created it,
//!   never to the opener: not in another container's share on the same GPU
//!   (whose quota would not even hold it), not twice in the same container;
//! - host-located VMM memory charges no device quota;
//! - a process's `cuMemGetInfo` free is its container's quota minus what
//!   the container holds (contexts included), and NVML's per-process
//!   numbers seen inside the share add up to that used figure;
//! - over the quota is `CUDA_ERROR_OUT_OF_MEMORY` at the call, and the
//!   process goes on.
//!
//! The programs are `tests/c/ipc_pair.c` (its header cites the NCCL,
//! PyTorch and vLLM call sequences each mode follows), under the
//! interposer with a test manager per container. Needs
//! `cargo build --workspace` first.

use std::collections::HashMap;
use std::path::PathBuf;
use test_support::shim::server::TestManager;
use test_support::shim::simnode::{Container, ShimNode};
use test_support::{target_dir, workspace_root};

mod ipc_pair;
use ipc_pair::run_pair;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

struct Node {
    sim: ShimNode,
    prog: PathBuf,
}

impl Node {
    fn new() -> Node {
        let (sim, prog) = ShimNode::sample(&workspace_root(), &target_dir(), "ipc_pair.c");
        Node { sim, prog }
    }

    /// Device memory a context holds on the sample node: its overhead and
    /// its default 8 MiB device heap.
    fn ctx(&self) -> u64 {
        self.sim.state().node().gpus[0].context_overhead_bytes() + (8 << 20)
    }

    /// A container with a memory quota of `quota` bytes and its manager.
    fn container(&self, pod: &str, quota: u64) -> (Container, TestManager) {
        let c = self.sim.vm_dir();
        let d = quota_config::ResourceData {
            pod_uid: pod.into(),
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
}

/// Waits until the manager of `c` has published `pids` as the container's
/// (`pids.config`, what the interposer's NVML view lists): it rewrites the
/// file after each registration's reply, so a fresh opener may read it
/// before its own and its peer's are there.
fn wait_for_pids(c: &Container, pids: &[u32]) {
    let path = c.path().join(quota_config::PIDS_FILE);
    for _ in 0..500 {
        let listed = std::fs::read(&path)
            .ok()
            .and_then(|b| quota_config::decode_pids(&b).ok())
            .unwrap_or_default();
        if pids.iter().all(|p| listed.contains(&(*p as i32))) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{} never listed {pids:?}", path.display());
}

fn get(m: &HashMap<String, String>, k: &str) -> u64 {
    m.get(k)
        .unwrap_or_else(|| panic!("no {k} in {m:?}"))
        .parse()
        .unwrap()
}

/// The exporter in one container, the opener in a second one on the same
/// GPU whose quota holds its context and 16 MiB: the 64 MiB (`ipc`) or
/// 32 MiB (`fd`) it opens stay the exporter's container's.
fn across_containers(mode: &str, shared: u64, written: u64) {
    let n = Node::new();
    let ctx = n.ctx();
    let (a, ma) = n.container("pod-exporter", GIB);
    let small = ctx + 16 * MIB;
    let (b, mb) = n.container("pod-opener", small);
    let sock = n.sim.root().join("ipc.sock");
    let mut used_b = 0;
    let p = run_pair((&a, &n.prog), (&b, &n.prog), mode, &sock, |p| {
        assert!(
            ma.live().contains_key(&(p.server_pid as i32)),
            "the exporter is A's"
        );
        assert!(
            mb.live().contains_key(&(p.client_pid as i32)),
            "the opener is B's"
        );
        assert_eq!(
            ma.ledger().used(),
            ctx + shared,
            "the exporter's container: its context and the allocation"
        );
        assert_eq!(
            mb.ledger().used(),
            ctx,
            "the opener's container: its context only, never what it opened"
        );
        let c = &p.client;
        assert_eq!(
            get(c, "opener_free"),
            small - mb.ledger().used(),
            "cuMemGetInfo: quota minus what the container holds"
        );
        assert_eq!(get(c, "opener_total"), small);
        used_b = mb.ledger().used();
        wait_for_pids(&b, &[p.client_pid]);
    });
    let c = &p.client;
    assert_eq!(
        get(c, "opener_nvml_used"),
        used_b,
        "NVML's used inside the share"
    );
    assert_eq!(
        get(c, "opener_nvml_procs"),
        1,
        "only the container's process"
    );
    assert_eq!(
        get(c, "opener_nvml_procs_sum"),
        used_b,
        "NVML's per-process numbers add up to the same"
    );
    if mode == "fd" {
        let s = &p.server;
        assert_eq!(
            get(s, "host_after_free"),
            get(s, "host_before_free"),
            "host-located VMM memory charges no device quota"
        );
        assert_eq!(
            get(s, "host_nvml_used"),
            ctx,
            "in NVML inside the share either"
        );
        assert_eq!(get(s, "host_nvml_procs_sum"), ctx);
    }
    assert_eq!(
        get(&p.server, "exporter_free"),
        GIB - ctx - shared,
        "the exporter's cuMemGetInfo: quota minus context and allocation"
    );
    assert_eq!(
        get(&p.server, "written_by_opener"),
        written,
        "one memory, both ways"
    );
    assert_eq!(get(&p.client, "ok"), 1);
}

#[test]
fn ipc_opened_memory_is_charged_to_the_exporters_container_only() {
    across_containers("ipc", 64 * MIB, 0x33);
}

#[test]
fn imported_vmm_memory_is_charged_to_the_exporters_container_only() {
    across_containers("fd", 32 * MIB, 0x44);
}

/// Both processes in one container: the shared memory counts once.
#[test]
fn shared_memory_counts_once_within_a_container() {
    let n = Node::new();
    let ctx = n.ctx();
    let (a, ma) = n.container("pod-both", GIB);
    let sock = n.sim.root().join("ipc.sock");
    let mut used = 0;
    let p = run_pair((&a, &n.prog), (&a, &n.prog), "ipc", &sock, |p| {
        used = ma.ledger().used();
        assert_eq!(used, 2 * ctx + 64 * MIB, "two contexts, one allocation");
        assert_eq!(get(&p.client, "opener_free"), GIB - used);
        wait_for_pids(&a, &[p.server_pid, p.client_pid]);
    });
    let c = &p.client;
    assert_eq!(get(c, "opener_nvml_used"), used);
    assert_eq!(get(c, "opener_nvml_procs"), 2);
    assert_eq!(get(c, "opener_nvml_procs_sum"), used);
    assert_eq!(get(&p.client, "same_pointer"), 1);
}

/// Host-located VMM memory (NCCL's ncclCuMemHostAlloc) takes no device
/// quota; device memory over the quota is OUT_OF_MEMORY at the call.
#[test]
fn host_located_memory_is_free_and_over_quota_is_out_of_memory() {
    let n = Node::new();
    let ctx = n.ctx();
    let quota = ctx + 16 * MIB;
    let (c, m) = n.container("pod-quota", quota);
    let o = c.command(&n.prog).arg("quota").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let k = test_support::kv(&out);
    assert_eq!(
        get(&k, "create_host"),
        0,
        "128 MiB of host memory under a 16 MiB quota"
    );
    assert_eq!(
        get(&k, "host_free"),
        get(&k, "start_free"),
        "host-located memory charges no device quota"
    );
    assert_eq!(get(&k, "start_free"), quota - ctx);
    assert_eq!(get(&k, "create_device"), 2, "cuMemCreate over the quota");
    assert_eq!(get(&k, "alloc_device"), 2, "cuMemAlloc over the quota");
    assert_eq!(get(&k, "alloc_small"), 0, "and the process goes on");
    assert_eq!(get(&k, "end_free"), quota - ctx);
    assert_eq!(get(&k, "ok"), 1);
    m.wait_for(5, "the close", |e| !e.is_empty());
}

/// NCCL's ncclCuMemFree (retain, release, unmap, release): the container
/// holds the handle's bytes until the last release, as the driver does;
/// they went back at the unmap before.
#[test]
fn a_retained_handle_is_held_until_its_last_release() {
    let n = Node::new();
    let ctx = n.ctx();
    let (c, _m) = n.container("pod-nccl", GIB);
    let o = c.command(&n.prog).arg("ncclfree").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let k = test_support::kv(&out);
    assert_eq!(get(&k, "before_free"), GIB - ctx);
    assert_eq!(get(&k, "mapped_free"), GIB - ctx - 32 * MIB);
    assert_eq!(
        get(&k, "unmapped_free"),
        get(&k, "mapped_free"),
        "unmapped, but a reference is still out"
    );
    assert_eq!(
        get(&k, "released_free"),
        GIB - ctx,
        "back at the last release"
    );
}
