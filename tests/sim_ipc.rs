//! The simulated driver shares device memory between processes as
//! NVIDIA's does: CUDA IPC memory and event handles, VMM handles exported
//! as a POSIX fd (sent with SCM_RIGHTS) or a fabric handle, host-located
//! VMM memory, and peer access as the node's topology allows. The memory
//! stays counted once, for the process that allocated it, in
//! `cuMemGetInfo` and in the per-process numbers NVML reports.
//!
//! The programs are `tests/c/ipc_pair.c` (whose header cites the NCCL,
//! PyTorch and vLLM call sequences each mode follows), run directly on the
//! simulated driver. Needs `cargo build --workspace` first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use test_support::shim::simnode::ShimNode;
use test_support::{target_dir, workspace_root};

mod ipc_pair;
use ipc_pair::{Pair, run_pair, run_pair_env};

const MIB: u64 = 1 << 20;

fn node(name: &str) -> (ShimNode, PathBuf) {
    let n = ShimNode::install(
        &workspace_root(),
        &target_dir().join("gpu-sim"),
        &target_dir().join("libvcuda.so"),
        name,
    );
    let prog = n.compile_c(&workspace_root().join("tests/c/ipc_pair.c"));
    (n, prog)
}

fn get(m: &HashMap<String, String>, k: &str) -> u64 {
    m.get(k)
        .unwrap_or_else(|| panic!("no {k} in {m:?}"))
        .parse()
        .unwrap()
}

/// Used bytes per PID on GPU 0, as the sim's NVML reports them.
fn used_by_pid(n: &ShimNode) -> HashMap<u32, u64> {
    n.state()
        .processes(0)
        .into_iter()
        .map(|p| (p.pid(), p.used_bytes))
        .collect()
}

fn pair(n: &ShimNode, prog: &Path, mode: &str, at_pause: impl FnOnce(&Pair)) -> Pair {
    let d = n.direct();
    run_pair(
        (&d, prog),
        (&d, prog),
        mode,
        &n.root().join("ipc.sock"),
        at_pause,
    )
}

fn ctx_overhead(n: &ShimNode) -> u64 {
    n.state().node().gpus[0].context_overhead_bytes() + (8 << 20)
}

#[test]
fn ipc_memory_and_event_handles_count_once_for_the_exporter() {
    let (n, prog) = node("sim-1gpu");
    let ctx = ctx_overhead(&n);
    let p = pair(&n, &prog, "ipc", |p| {
        let used = used_by_pid(&n);
        assert_eq!(
            used[&p.server_pid],
            ctx + 64 * MIB,
            "exporter: context and allocation"
        );
        assert_eq!(
            used[&p.client_pid], ctx,
            "opener: its context only, never the opened memory"
        );
        assert_eq!(
            n.memory_used(),
            2 * ctx + 64 * MIB,
            "the device counts it once"
        );
    });
    let (s, c) = (&p.server, &p.client);
    assert_eq!(get(s, "same_handle"), 1, "one handle per allocation");
    assert_eq!(
        get(s, "range_start_ok"),
        1,
        "an interior pointer's allocation"
    );
    assert_eq!(get(s, "range_size"), 64 * MIB);
    assert_eq!(get(s, "memory_type"), 2, "CU_MEMORYTYPE_DEVICE");
    assert_eq!(get(s, "pageable_type"), 0, "not the driver's: unregistered");
    assert_eq!(
        get(s, "open_own"),
        201,
        "INVALID_CONTEXT in the exporting process"
    );
    assert_eq!(get(s, "event_not_interprocess"), 1);
    assert_eq!(get(c, "same_pointer"), 1, "opened twice: the same pointer");
    assert_eq!(get(c, "byte"), 0x5a, "the exporter's bytes");
    assert_eq!(get(s, "written_by_opener"), 0x33, "and the opener's back");
    assert_eq!(get(c, "close_third"), 1, "two opens, two closes");
    assert_eq!(
        get(s, "before_free") - get(s, "exporter_free"),
        64 * MIB,
        "exporter's cuMemGetInfo: the allocation"
    );
    assert_eq!(
        get(s, "exporter_free") - get(c, "opener_free"),
        ctx,
        "opener's cuMemGetInfo: only its own context more"
    );
    assert_eq!(n.memory_used(), 0, "everything freed at exit");
    assert!(
        std::fs::read_dir(n.root().join("run/gpu-sim/ipc"))
            .unwrap()
            .next()
            .is_none(),
        "the shared files go with the memory and the event"
    );
}

fn vmm_pair(node_name: &str, mode: &str) {
    let (n, prog) = node(node_name);
    let ctx = ctx_overhead(&n);
    let p = pair(&n, &prog, mode, |p| {
        let used = used_by_pid(&n);
        assert_eq!(
            used[&p.server_pid],
            ctx + 32 * MIB,
            "exporter: context and handle"
        );
        assert_eq!(used[&p.client_pid], ctx, "importer: its context only");
    });
    let (s, c) = (&p.server, &p.client);
    assert_eq!(get(s, "retained_same"), 1);
    assert_eq!(
        get(s, "export_unrequested"),
        1,
        "only requested handle types"
    );
    assert_eq!(
        get(s, "host_before_free"),
        get(s, "host_after_free"),
        "host-located memory takes no device memory"
    );
    assert_eq!(
        get(s, "host_nvml_used"),
        ctx,
        "nor any in NVML: the context only"
    );
    assert_eq!(get(s, "host_nvml_procs_sum"), ctx);
    assert_eq!(get(s, "before_free") - get(s, "exporter_free"), 32 * MIB);
    assert_eq!(c["prop_location"], "1:0", "device 0's memory");
    assert_eq!(get(c, "byte"), 0x6b);
    assert_eq!(get(s, "written_by_opener"), 0x44);
    assert_eq!(n.memory_used(), 0);
}

#[test]
fn vmm_handle_over_a_posix_fd_counts_once_for_the_exporter() {
    vmm_pair("sim-1gpu", "fd");
}

#[test]
fn fabric_handle_where_nvlink_joins_the_gpus() {
    vmm_pair("sim-8gpu-nvlink", "fabric");
}

#[test]
fn peer_access_follows_the_topology() {
    let (n, prog) = node("sim-4gpu-pcie");
    let o = n.direct().command(&prog).arg("peer").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let m = test_support::kv(&out);
    assert_eq!(get(&m, "can_0_1"), 1, "one PCIe switch");
    assert_eq!(get(&m, "can_0_2"), 0, "across NUMA nodes");
    assert_eq!(get(&m, "peer_copied"), 0x21);
}

#[test]
fn an_expandable_segment_spans_its_handles() {
    let (n, prog) = node("sim-1gpu");
    let o = n.direct().command(&prog).arg("segments").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let m = test_support::kv(&out);
    assert_eq!(get(&m, "across"), 0x7e, "a copy across two mappings");
    assert_eq!(get(&m, "access_past_mapped"), 1, "not past what is mapped");
    assert_eq!(get(&m, "before_free") - get(&m, "mapped_free"), 64 * MIB);
    assert_eq!(get(&m, "after_free"), get(&m, "before_free"));
}

#[test]
fn ncclcumemfree_keeps_the_memory_until_the_last_release() {
    let (n, prog) = node("sim-1gpu");
    let o = n.direct().command(&prog).arg("ncclfree").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let m = test_support::kv(&out);
    assert_eq!(
        get(&m, "range_size"),
        32 * MIB,
        "cuMemGetAddressRange: the mapping"
    );
    assert_eq!(get(&m, "before_free") - get(&m, "mapped_free"), 32 * MIB);
    assert_eq!(
        get(&m, "unmapped_free"),
        get(&m, "mapped_free"),
        "a reference is out"
    );
    assert_eq!(get(&m, "released_free"), get(&m, "before_free"));
}

/// vLLM's tensor-parallel ranks: each on its own GPU opens the other's
/// buffer (custom_all_reduce.py, create_shared_buffer). The memory stays on
/// the exporter's GPU, counted for the exporter; the opener's GPU holds its
/// context only.
#[test]
fn a_rank_on_another_gpu_opens_the_buffer_without_holding_it() {
    let (n, prog) = node("sim-8gpu-nvlink");
    let ctx0 = n.state().node().gpus[0].context_overhead_bytes() + (8 << 20);
    let ctx1 = n.state().node().gpus[1].context_overhead_bytes() + (8 << 20);
    let d = n.direct();
    run_pair_env(
        (&d, &prog),
        (&d, &prog),
        &[("CUDA_VISIBLE_DEVICES", "1")],
        "ipc",
        &n.root().join("ipc.sock"),
        |p| {
            let st = n.state();
            let on = |gpu: usize| -> HashMap<u32, u64> {
                st.processes(gpu)
                    .into_iter()
                    .map(|x| (x.pid(), x.used_bytes))
                    .collect()
            };
            assert_eq!(on(0)[&p.server_pid], ctx0 + 64 * MIB);
            assert!(
                !on(0).contains_key(&p.client_pid),
                "the opener has nothing on GPU 0"
            );
            assert_eq!(on(1)[&p.client_pid], ctx1, "its context on GPU 1, only");
            assert_eq!(st.memory_used(1), ctx1);
        },
    );
    assert_eq!(n.memory_used(), 0);
}
