//! The manager publishes its node's GPU inventory on the Node object
//! (`gpu_allocator::inventory`, annotation `tencent.com/vcuda-gpu-inventory`)
//! for the scheduler extender: what the simulated node's GPUs are (minor,
//! UUID, memory, bus id, PCIe levels and NVLink counts as the node file
//! says) and their health, updated when a critical Xid takes a GPU out and
//! when it comes back. Needs `cargo build --workspace`.

use std::time::{Duration, Instant};

use apiserver_emulator::Kind;
use gpu_allocator::PcieLevel;
use gpu_allocator::inventory::{ANNOTATION, Inventory};
use test_support::manager::{Env, NODE, Options};

async fn published(env: &Env, what: &str, pred: impl Fn(&Inventory) -> bool) -> Inventory {
    let t = Instant::now();
    loop {
        let node = env.api.get(Kind::Node, None, NODE).unwrap();
        if let Some(v) = node["metadata"]["annotations"][ANNOTATION].as_str() {
            let inv = Inventory::from_json(v).unwrap();
            if pred(&inv) {
                return inv;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{what}: never published; node {node}\nlog:\n{}",
            env.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_carries_its_gpu_inventory_and_health() {
    let env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let inv = published(&env, "the inventory", |_| true).await;
    assert!(inv.share_mode);
    let state = env.sim.state();
    let sim = state.node();
    assert_eq!(inv.gpus.len(), 4);
    for (g, s) in inv.gpus.iter().zip(&sim.gpus) {
        assert_eq!((g.minor, g.uuid.as_str()), (s.minor, s.uuid.as_str()));
        assert_eq!(g.memory_bytes, s.memory_mib << 20);
        assert!(g.healthy);
    }
    // Two PCIe switches of two GPUs each: the same tree the manager uses.
    let t = inv.topology();
    assert_eq!(t.pcie_level(0, 1), PcieLevel::Single);
    assert_eq!(t.pcie_level(2, 3), PcieLevel::Single);
    assert!(t.pcie_level(1, 2) > PcieLevel::Single);
    assert!(!t.has_nvlink());

    let xid = std::process::Command::new(test_support::target_dir().join("gpu-sim"))
        .args(["xid", "--root"])
        .arg(env.sim_root())
        .args(["--gpu", "2", "--code", "79"])
        .status()
        .unwrap();
    assert!(xid.success());
    published(&env, "GPU 2 unhealthy", |i| !i.gpus[2].healthy).await;
    let back = published(&env, "GPU 2 healthy again", |i| i.gpus[2].healthy).await;
    assert!(back.gpus.iter().all(|g| g.healthy));
}
