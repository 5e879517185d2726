//! Shares on two GPUs for one container, end to end in DRA mode: the whole
//! driver (`daemon::run`) on the simulated 4-GPU node, the interposer
//! mirrored as the shares' libcuda, the emulated kubelet. A claim for
//! 100 cores and 1 GiB on each of gpu-0 and gpu-1 is prepared; a program
//! run with what its CDI spec injects (`tests/c/multi_gpu.c`) gets a
//! context on both GPUs and runs out of memory at each GPU's own 1 GiB,
//! reserving through the ledgers the driver passed over `vcuda.sock`
//! (registration protocol 2); the node's other GPUs are refused. Then the
//! TP = 2 serving workload (`test_support::shim::tp`) in a claim for 50
//! cores and 4 GiB on each GPU, beside a second claim for 50 cores and
//! 2 GiB on each: both held per GPU, memory and compute.
//!
//! Needs `cargo build --workspace` first (gpu-sim, its cdylibs, libvcuda.so).

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use dra_driver::daemon::{Settings, run};
use dra_kubelet_emulator::{cdi, plugin};
use test_support::dra::*;
use test_support::{target_dir, workspace_root};
use tokio_util::sync::CancellationToken;

const MIB: u64 = 1 << 20;

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn settings(dirs: &Dirs) -> Settings {
    sim_settings(&dirs.p("sim"), dirs)
}

/// The whole driver on the simulated 4-GPU node, registered with the
/// emulated kubelet.
struct Node {
    server: apiserver_emulator::ApiServer,
    dirs: Dirs,
    cancel: CancellationToken,
    daemon: tokio::task::JoinHandle<anyhow::Result<()>>,
    kubelet: plugin::DraPlugin,
}

impl Node {
    async fn start() -> Node {
        for a in ["gpu-sim", "libvcuda.so"] {
            assert!(
                target_dir().join(a).is_file(),
                "{a} missing: run `cargo build --workspace` first"
            );
        }
        let server = apiserver_emulator::ApiServer::start("127.0.0.1:0")
            .await
            .unwrap();
        let dirs = Dirs::new();
        sh(Command::new(target_dir().join("gpu-sim"))
            .args(["install", "--node"])
            .arg(workspace_root().join("config/nodes/sim-4gpu-pcie.toml"))
            .arg("--root")
            .arg(dirs.p("sim")));
        server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
        let cancel = CancellationToken::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let daemon = tokio::spawn(run(settings(&dirs), cancel.clone(), Some(tx)));
        tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .unwrap()
            .unwrap();
        let kubelet =
            plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(20), false)
                .await
                .unwrap();
        Node {
            server,
            dirs,
            cancel,
            daemon,
            kubelet,
        }
    }

    /// Prepares the claim `uid` (named `name`); the environment its CDI
    /// spec gives a container.
    async fn prepare(&self, name: &str, uid: &str) -> Vec<(String, String)> {
        let claim = plugin::claim(NS, name, uid);
        let r = self
            .kubelet
            .prepare(std::slice::from_ref(&claim))
            .await
            .unwrap();
        let one = &r.claims[uid];
        assert_eq!(one.error, "");
        let edits = cdi::resolve(&self.dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
        container_env(&edits)
    }

    async fn stop(self) {
        self.cancel.cancel();
        self.daemon.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_on_two_simulated_gpus_each_hold_their_own_memory() {
    let node = Node::start().await;
    let (server, dirs, kubelet) = (&node.server, &node.dirs, &node.kubelet);
    let sim = dirs.p("sim");
    let uid = two_gpu_claim(server, "tp2", "100", "1Gi");
    let env = node.prepare("tp2", &uid).await;
    let claim = plugin::claim(NS, "tp2", &uid);

    let prog = dirs.p("multi_gpu");
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&prog)
        .arg(workspace_root().join("tests/c/multi_gpu.c"))
        .arg("-L")
        .arg(sim.join("usr/lib/x86_64-linux-gnu"))
        .arg("-lcuda"));
    let out = sh(Command::new(&prog)
        .args(["alloc", "64"])
        .envs(env.iter().cloned())
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("LOGGER_LEVEL"));
    let m: HashMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| -> u64 {
        m.get(k)
            .unwrap_or_else(|| panic!("no {k} in:\n{out}"))
            .parse()
            .unwrap()
    };
    assert_eq!(get("init"), 0, "{out}");
    assert_eq!(get("count"), 4, "{out}");
    // gpu-0 and gpu-1 of the node file are 3B:00.0 and 3C:00.0.
    for d in 0..4 {
        let bus = m[format!("d{d}_bus").as_str()].to_ascii_lowercase();
        let mine = bus.ends_with("3b:00.0") || bus.ends_with("3c:00.0");
        if !mine {
            assert_eq!(
                get(&format!("d{d}_ctx")),
                800,
                "GPU {bus} is not the claim's:\n{out}"
            );
            continue;
        }
        assert_eq!(get(&format!("d{d}_ctx")), 0, "{bus}:\n{out}");
        assert_eq!(get(&format!("d{d}_total")), 1024 * MIB, "{bus}:\n{out}");
        let filled = get(&format!("d{d}_filled"));
        assert!(
            (768 * MIB..=1024 * MIB).contains(&filled),
            "{bus}: filled {filled}:\n{out}"
        );
        assert_eq!(
            get(&format!("d{d}_err")),
            2,
            "OUT_OF_MEMORY on {bus}:\n{out}"
        );
    }
    // Each GPU's ledger held that GPU's part, up to its quota, and the
    // process's exit gave it back.
    let vm = dirs.p("vm").join(&uid).join("gpus");
    for (gpu, name) in ["ledger", "ledger.1"].into_iter().enumerate() {
        let l = test_support::ledger::live(&vm, gpu);
        assert_eq!(l.quota(), 1024 * MIB, "{name}");
        assert!(
            l.peak() > 512 * MIB && l.peak() <= 1024 * MIB,
            "{name}: peak {}",
            l.peak()
        );
        until(10, "the process's slots released", || l.used() == 0).await;
    }

    let u = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(u.claims[&uid].error, "");
    assert!(!dirs.p("vm").join(&uid).exists());
    node.stop().await;
}

/// The TP = 2 serving workload through the DRA driver: a claim for 50
/// cores and 4 GiB on each of gpu-0 and gpu-1 runs the server, a second
/// claim for 50 cores and 2 GiB on each the load beside it, each with what
/// its CDI spec gives a container (the GPUs it exposes as
/// `CUDA_VISIBLE_DEVICES`, in the spec's order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_server_beside_a_second_claim_is_held_per_gpu() {
    use test_support::shim::tp::{EvenTenant, Programs, ledgers_by_device, serve_beside_even};
    const GIB: u64 = 1 << 30;
    let node = Node::start().await;
    let dirs = &node.dirs;
    let server_uid = two_gpu_claim_nth(&node.server, "server", "50", "4Gi", 0);
    let other_uid = two_gpu_claim_nth(&node.server, "other", "50", "2Gi", 1);
    let exposed = |mut env: Vec<(String, String)>| {
        let v = env
            .iter()
            .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
            .map(|(_, v)| v.clone())
            .expect("NVIDIA_VISIBLE_DEVICES in the CDI edits");
        env.push(("CUDA_VISIBLE_DEVICES".into(), v));
        env
    };
    let env_s = exposed(node.prepare("server", &server_uid).await);
    let env_o = exposed(node.prepare("other", &other_uid).await);
    let uuids: Vec<String> = env_s
        .iter()
        .find(|(k, _)| k == "CUDA_VISIBLE_DEVICES")
        .unwrap()
        .1
        .split(',')
        .map(str::to_string)
        .collect();
    let state = test_support::sim::state_at(&dirs.p("sim"));
    let node_gpu = |u: &str| state.node().gpus.iter().position(|g| g.uuid == u).unwrap();
    let gpus = [node_gpu(&uuids[0]), node_gpu(&uuids[1])];
    let vm = |uid: &str| dirs.p("vm").join(uid).join("gpus");
    let (ls, lo) = (
        ledgers_by_device(&vm(&server_uid), &uuids),
        ledgers_by_device(&vm(&other_uid), &uuids),
    );
    let lib = dirs.p("sim").join("usr/lib/x86_64-linux-gnu");
    let progs = Programs {
        tp: dirs.p("tp_serve"),
        load: dirs.p("multi_gpu_load"),
        sock: dirs.p("tp.sock"),
    };
    for (src, out) in [("tp_serve", &progs.tp), ("multi_gpu", &progs.load)] {
        test_support::sim::gcc_lcuda(
            &workspace_root().join(format!("tests/c/{src}.c")),
            &lib,
            out,
        );
    }
    let in_claim = |env: &Vec<(String, String)>, p: &std::path::Path| {
        let mut c = Command::new(p);
        c.envs(env.iter().cloned()).env_remove("LOGGER_LEVEL");
        c
    };
    tokio::task::block_in_place(|| {
        serve_beside_even(
            &state,
            gpus,
            &progs,
            EvenTenant {
                command: &|p| in_claim(&env_s, p),
                mem: 4 * GIB,
                cores: 50.0,
                ledgers: &ls,
            },
            EvenTenant {
                command: &|p| in_claim(&env_o, p),
                mem: 2 * GIB,
                cores: 50.0,
                ledgers: &lo,
            },
        )
    });
    node.stop().await;
}
