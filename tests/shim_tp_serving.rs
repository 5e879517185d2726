//! A TP = 2 model server on shares, end to end on the simulated 4-GPU node
//! `sim-4gpu-pcie` (docs/multi-gpu.md): container A holds a share on GPUs
//! 0 and 1 (2 GiB and 1.5 GiB, 40 % of each hard), container B one on the
//! same two GPUs (1 GiB each, 60 % of GPU 0 and 40 % of GPU 1 hard). A's two ranks
//! (`tests/c/tp_serve.c`, the call sequence of vLLM's V1 worker with its
//! custom all-reduce, NCCL's P2P buffers and PyTorch's expandable
//! segments; cited there) size their KV caches from `cuMemGetInfo`, share
//! buffers over CUDA IPC and POSIX-fd VMM handles, capture graphs for four
//! batch sizes and serve in replays, while B saturates both GPUs.
//!
//! - each rank's memory follows the rules of `test_support::shim::tp`
//!   (KV sized from its own GPU's quota, opened and imported memory
//!   charged once to the exporter, OOM at the call, NVML agrees), and each
//!   GPU's ledger holds exactly what the rank on it sees held;
//! - B, filling both GPUs meanwhile, gets its own quota on each, whatever
//!   A holds;
//! - on the sim's timeline (ground truth), each tenant is held to its
//!   compute quota on each GPU: A's ranks near 30 %, B near 60 % on GPU 0
//!   and 40 % on GPU 1. (A launch drawing from the first GPU's bucket
//!   whatever its device is invisible for A: GPU 0's controller raises the
//!   shared rate until GPU 0 shows 30 %, and the ranks' quotas are equal;
//!   it gives B's GPU 1 thread GPU 0's 60 %.)
//!
//! Programs: `tests/c/tp_serve.c`, `tests/c/multi_gpu.c`. Needs
//! `cargo build --workspace`.

use std::path::Path;
use test_support::shim::server::TestManager;
use test_support::shim::simnode::{Container, ShimNode};
use test_support::shim::tp::{Programs, Tenant, Workload, serve_beside};
use test_support::{target_dir, workspace_root};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// A's memory quota on GPU 0 and GPU 1, B's on each.
const A_MEM: [u64; 2] = [2 * GIB, 3 * GIB / 2];
const B_MEM: u64 = GIB;
/// A's compute quota on each GPU (its ranks advance in lockstep, so one
/// figure), B's on GPU 0 and GPU 1.
const A_CORES: i32 = 30;
const B_CORES: [i32; 2] = [60, 40];

struct Node {
    sim: ShimNode,
}

impl Node {
    fn bus(&self, gpu: usize) -> (String, String) {
        let state = self.sim.state();
        let g = &state.node().gpus[gpu];
        let (d, b, dv, f) = g.pci_location();
        (
            format!("{:04x}:{b:02x}:{dv:02x}.{f:x}", d & 0xffff),
            g.uuid.clone(),
        )
    }

    /// A container whose share is `mem[i]` bytes and `cores[i]` % of GPU
    /// i (GPUs 0 and 1, records in that order), served by its own manager.
    fn tenant(&self, pod: &str, mem: [u64; 2], cores: [i32; 2]) -> (Container, TestManager) {
        let c = self.sim.vm_dir();
        let gpus = (0..2)
            .map(|i| {
                let (bus_id, uuid) = self.bus(i);
                quota_config::GpuQuota {
                    bus_id,
                    uuid,
                    gpu_memory: mem[i],
                    utilization: cores[i],
                    limit: cores[i],
                }
            })
            .collect();
        let q = quota_config::MultiGpuQuota {
            pod_uid: pod.into(),
            container_name: "main".into(),
            hard_limit: true,
            driver_version: self.sim.driver,
            gpus,
        };
        quota_config::write_multi(c.path(), &q, 0o644).unwrap();
        let m = TestManager::start_gpus(c.path(), &mem);
        (c, m)
    }
}

#[test]
fn a_tp2_server_and_a_second_tenant_are_each_held_per_gpu() {
    let n = Node {
        sim: ShimNode::install(
            &workspace_root(),
            &target_dir().join("gpu-sim"),
            &target_dir().join("libvcuda.so"),
            "sim-4gpu-pcie",
        ),
    };
    let progs = Programs {
        tp: n
            .sim
            .compile_c(&workspace_root().join("tests/c/tp_serve.c")),
        load: n
            .sim
            .compile_c(&workspace_root().join("tests/c/multi_gpu.c")),
        sock: n.sim.root().join("tp.sock"),
    };
    let (a, ma) = n.tenant("pod-tp2", A_MEM, [A_CORES; 2]);
    let (b, mb) = n.tenant("pod-other", [B_MEM, B_MEM], B_CORES);
    let visible = |c: &Container, p: &Path| {
        let mut cmd = c.command(p);
        cmd.env("CUDA_VISIBLE_DEVICES", "0,1");
        cmd
    };
    let server = Tenant {
        command: &|p| visible(&a, p),
        mem: A_MEM,
        cores: [A_CORES.into(); 2],
        ledger_used: &|i| ma.ledger_at(i).used(),
    };
    let other = Tenant {
        command: &|p| visible(&b, p),
        mem: [B_MEM, B_MEM],
        cores: B_CORES.map(f64::from),
        ledger_used: &|i| mb.ledger_at(i).used(),
    };
    let ctx = n.sim.state().node().gpus[0].context_overhead_bytes() + 8 * MIB;
    serve_beside(
        &n.sim.state(),
        [0, 1],
        &progs,
        &server,
        &other,
        Workload::default(),
        ctx,
    );
}
