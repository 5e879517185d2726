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

/// A critical Xid (79) on `gpu` of the simulated node.
fn xid79(env: &Env, gpu: usize) {
    let xid = std::process::Command::new(test_support::target_dir().join("gpu-sim"))
        .args(["xid", "--root"])
        .arg(env.sim_root())
        .args(["--gpu", &gpu.to_string(), "--code", "79"])
        .status()
        .unwrap();
    assert!(xid.success());
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

    xid79(&env, 2);
    published(&env, "GPU 2 unhealthy", |i| !i.gpus[2].healthy).await;
    let back = published(&env, "GPU 2 healthy again", |i| i.gpus[2].healthy).await;
    assert!(back.gpus.iter().all(|g| g.healthy));
}

/// An operator's MIG geometry on GPU 0 of the simulated H100 node
/// (`gpu-sim mig`, as `nvidia-smi -mig 1` then `nvidia-smi mig -cgi 9,19
/// -C`): the manager reports the MIG devices it finds, advertises GPU 0's
/// vcuda IDs Unhealthy (the kubelet counts none allocatable), publishes it
/// `mig` for the extender and the webhook, places nothing there, and keeps
/// it out when an Xid on it clears; GPU 1 serves shares and whole-GPU
/// requests as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_in_mig_mode_is_neither_shared_nor_given_whole() {
    fn geometry(sim: &test_support::sim::SimNode) {
        let out = std::process::Command::new(test_support::target_dir().join("gpu-sim"))
            .args(["mig", "--root"])
            .arg(sim.root())
            .args(["--gpu", "0", "--enable", "--create", "9,19"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gpu-sim mig: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(geometry),
            quiet_s: 1,
            ..Default::default()
        },
    )
    .await;
    let log = env.log_text();
    assert!(log.contains("GPU in MIG mode"), "{log}");
    for profile in ["3g.40gb", "1g.10gb"] {
        assert!(
            log.lines()
                .any(|l| l.contains("MIG device") && l.contains(&format!("profile={profile}"))),
            "no MIG device {profile} logged:\n{log}"
        );
    }
    let healthy_ids = |env: &Env, gpu: usize| {
        let v = env.kubelet.view();
        let v = v.borrow();
        let ids = v.resources[test_support::manager::VCORE]
            .devices
            .iter()
            .filter(|(id, _)| id.starts_with(&format!("vcore-{gpu}-")))
            .map(|(_, d)| d.healthy)
            .collect::<Vec<_>>();
        (ids.iter().filter(|h| **h).count(), ids.len())
    };
    assert_eq!(healthy_ids(&env, 0), (0, 100), "GPU 0's IDs");
    assert_eq!(healthy_ids(&env, 1), (100, 100), "GPU 1's IDs");
    let inv = published(&env, "GPU 0 in MIG mode", |i| i.gpus[0].mig).await;
    assert!(!inv.gpus[1].mig);

    // A whole GPU: GPU 1, the only one.
    let whole = env.pod(&[("main", 100, 0)], &[]);
    let r = env.admit(&whole, "main", 100, 0).await.unwrap();
    assert_eq!(Env::minors(&r), vec![1]);
    env.delete(&whole).await;
    // Shares: GPU 1 too.
    for cores in [60, 40] {
        let p = env.pod(&[("main", cores, 4)], &[]);
        let r = env.admit(&p, "main", cores as usize, 4).await.unwrap();
        assert_eq!(Env::minors(&r), vec![1], "a {cores}-core share");
    }

    // An Xid on GPU 0 and its quiet period: still no IDs to offer.
    xid79(&env, 0);
    env.wait_log("GPU health changed", 1).await;
    env.wait_log("GPU health changed", 2).await;
    assert_eq!(
        healthy_ids(&env, 0),
        (0, 100),
        "GPU 0's IDs after its Xid cleared"
    );
}
