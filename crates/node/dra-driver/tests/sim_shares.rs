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

/// Compute tiers on several GPUs (docs/qos.md): a share gets the QoS page
/// of each of its GPUs, and a launch is ordered by its device's. A latency
/// claim on gpu-0 and gpu-1 (a tensor-parallel server's shape) sending its
/// requests to gpu-0 holds a batch share there, not one on gpu-1; a batch
/// claim on gpu-2 and gpu-3 launching on gpu-3 is held through that GPU's
/// page (its second) for a latency share there; gpu-2's page holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_shares_on_several_gpus_are_held_by_their_launchs_gpu() {
    use std::process::{Child, Stdio};
    let node = Node::start().await;
    let dirs = &node.dirs;
    let tier = |t: &str| {
        Some(
            serde_json::json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "tier": t}),
        )
    };
    let claim = |name: &str, nth: u32, gpus: &[u32], t: &str| {
        claim_on_gpus(&node.server, name, ("30", "1Gi"), nth, gpus, tier(t))
    };
    let uids = [
        ("lat01", claim("lat01", 0, &[0, 1], "latency")),
        ("bat0", claim("bat0", 1, &[0], "batch")),
        ("bat1", claim("bat1", 2, &[1], "batch")),
        ("lat3", claim("lat3", 3, &[3], "latency")),
        ("bat23", claim("bat23", 4, &[2, 3], "batch")),
    ];
    let mut envs = HashMap::new();
    for (name, uid) in &uids {
        let mut env = exposed(node.prepare(name, uid).await);
        if *name == "bat23" {
            // Its CUDA device 0 is gpu-3 (devices are matched by bus id).
            for (_, v) in env.iter_mut().filter(|(k, _)| k == "CUDA_VISIBLE_DEVICES") {
                *v = v.rsplit(',').collect::<Vec<_>>().join(",");
            }
        }
        envs.insert(*name, env);
    }
    let (_c0, p0, l0) = batch_pages(dirs, &uids[1].1, 1);
    let (_c1, p1, l1) = batch_pages(dirs, &uids[2].1, 1);
    let (_c23, p23, l23) = batch_pages(dirs, &uids[4].1, 2);

    let lib = dirs.p("sim").join("usr/lib/x86_64-linux-gnu");
    let (compute, latency) = (dirs.p("shim_compute"), dirs.p("qos_latency"));
    for (src, out) in [("shim_compute", &compute), ("qos_latency", &latency)] {
        test_support::sim::gcc_lcuda(
            &workspace_root().join(format!("tests/c/{src}.c")),
            &lib,
            out,
        );
    }
    let spawn = |prog: &std::path::Path, args: &[&str], name: &str| -> Child {
        Command::new(prog)
            .args(args)
            .envs(envs[name].iter().cloned())
            .env_remove("LOGGER_LEVEL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let batches: Vec<Child> = ["bat0", "bat1", "bat23"]
        .iter()
        .map(|n| spawn(&compute, &["saturate", "6", "4"], n))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // 100 requests a second of three 1728-block kernels (~50 us each on the
    // T4): well inside a 30 % share, so holds follow requests, not a queue.
    let lats: Vec<Child> = ["lat01", "lat3"]
        .iter()
        .map(|n| spawn(&latency, &["4", "100", "3", "1728", "warmup=1"], n))
        .collect();
    let t0 = std::time::Instant::now();
    while p1[0].latency_live() == 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(p1[0].latency_live(), 1, "lat01 is registered on gpu-1 too");
    for l in lats {
        let o = l.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "qos_latency: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let requests: f64 = test_support::kv(&out)["requests"].parse().unwrap();
        assert!(requests >= 200.0, "{out}");
        println!("latency tenant: {}", out.trim().replace('\n', " "));
    }
    // Each container's own count, in its ledger of the GPU it waited on
    // (the metrics vcuda_container_batch_held_seconds_total and, summed
    // per GPU, vcuda_gpu_batch_holds_total).
    let held = |l: &container_ledger::Ledger| (l.qos_held_ns(), l.qos_holds());
    let (h0, h1, h2, h3) = (held(&l0[0]), held(&l1[0]), held(&l23[0]), held(&l23[1]));
    println!(
        "batch held (ns, holds): bat0 on gpu-0 {h0:?}, bat1 on gpu-1 {h1:?}, bat23 on gpu-2 {h2:?}, on gpu-3 {h3:?}"
    );
    assert!(
        h0.0 > 0 && h0.1 > 0,
        "the batch share on gpu-0, where lat01 launches, held"
    );
    assert_eq!(h1, (0, 0), "lat01 never launched on gpu-1");
    assert!(
        h3.0 > 0 && h3.1 > 0,
        "bat23, launching on gpu-3, held for lat3"
    );
    assert_eq!(h2, (0, 0), "gpu-2 has no latency share");
    let _ = (&p0, &p23);
    for b in batches {
        let o = b.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    node.stop().await;
}

/// The QoS pages and the ledgers a batch process of claim `uid` (on
/// `gpus` GPUs) receives at registration, in record order, and its
/// connection (the registration lasts while it is open).
fn batch_pages(
    dirs: &Dirs,
    uid: &str,
    gpus: usize,
) -> (
    std::os::unix::net::UnixStream,
    Vec<qos_page::QosPage>,
    Vec<container_ledger::Ledger>,
) {
    use qos_page::{QosPage, Tier};
    use std::os::fd::AsFd;
    let mut req = test_support::hostile::maximal_request(uid, "gpus");
    if gpus > 1 {
        (req.protocol_version, req.previous_slot) = (2, None);
    }
    let dir = dirs.p("vm").join(uid).join("gpus");
    let (s, r, fds) = test_support::hostile::register(&dir, &req);
    assert_eq!(Tier::from_wire(r.qos_tier), Tier::Batch, "{r:?}");
    let n = if gpus > 1 {
        r.qos_pages as usize
    } else {
        usize::from(r.qos_page)
    };
    assert_eq!((n, fds.len()), (gpus, 2 * gpus), "a page per GPU: {r:?}");
    let pages = fds[gpus..]
        .iter()
        .map(|f| QosPage::from_fd(f.as_fd()).unwrap())
        .collect();
    let ledgers = fds[..gpus]
        .iter()
        .map(|f| container_ledger::Ledger::from_fd(f.as_fd()).unwrap())
        .collect();
    (s, pages, ledgers)
}

/// A latency process on two GPUs is busy on each GPU until what it waited
/// for there is done: a synchronize clears only the page of the device it
/// waited for (a context's: the current one; a stream's: the stream's
/// context's, whichever is current; a query likewise), so a request still
/// running on gpu-1 keeps holding gpu-1's batch work after gpu-0's is
/// synchronised; and of two streams of gpu-0 launched onto, the first's
/// synchronize leaves gpu-0 busy until the second is said done. `tests/c/qos_sync.c` steps; the pages are read between
/// steps (a slot's mark, not its deadline: no timing involved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_process_is_idle_only_where_and_once_all_it_launched_is_done() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    let node = Node::start().await;
    let dirs = &node.dirs;
    let tier = |t: &str| {
        Some(
            serde_json::json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "tier": t}),
        )
    };
    let lat = claim_on_gpus(
        &node.server,
        "lat01",
        ("30", "1Gi"),
        0,
        &[0, 1],
        tier("latency"),
    );
    let bat = claim_on_gpus(
        &node.server,
        "bat01",
        ("30", "1Gi"),
        1,
        &[0, 1],
        tier("batch"),
    );
    let env = exposed(node.prepare("lat01", &lat).await);
    node.prepare("bat01", &bat).await;
    let (conn, _pages, _) = batch_pages(dirs, &bat, 2);
    let prog = dirs.p("qos_sync");
    let lib = dirs.p("sim").join("usr/lib/x86_64-linux-gnu");
    test_support::sim::gcc_lcuda(&workspace_root().join("tests/c/qos_sync.c"), &lib, &prog);
    let mut child = Command::new(&prog)
        .arg("1728")
        .envs(env)
        .env_remove("LOGGER_LEVEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    // The latency flags the batch process is handed (asked anew each
    // step), read-only: a mark is a deadline set.
    let marked = || {
        let views = test_support::hostile::qos_flag_views(&conn, 2);
        [0, 1].map(|g| views[g].iter().any(|v| v.deadline() != 0))
    };
    // Step, then the pages' marks (gpu-0, gpu-1) it must leave.
    let steps = [
        ("launched", [true, true]),
        ("ctx0", [false, true]),
        ("stream1", [false, false]),
        ("query0", [false, true]),
        ("ctx1", [false, false]),
        ("one-of-two", [true, false]),
        ("both", [false, false]),
        // An event: its stream, up to its record (cuEventRecord wrapped).
        ("event-one-of-two", [true, false]),
        ("event-before-a-launch", [true, false]),
        ("event-after-all", [false, false]),
    ];
    tokio::task::block_in_place(|| {
        for (name, want) in steps {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), format!("step={name}"), "qos_sync's steps");
            assert_eq!(
                marked(),
                want,
                "after {name}: gpu-0's and gpu-1's pages marked busy by the latency process"
            );
            writeln!(stdin, "next").unwrap();
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "qos_sync: {status}");
    });
    node.stop().await;
}
