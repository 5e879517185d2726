//! `vcuda-dra-driver` as it runs in the DaemonSet (the binary, supervised)
//! on a simulated node, with the API server emulator and the emulated
//! kubelet over the real protobuf: the driver process killed with -9 is
//! replaced on the same listening sockets, so a NodePrepareResources sent
//! right after the kill, on the kubelet's existing channel, succeeds
//! without a new registration (a 1.36 kubelet would otherwise fail the pod
//! and retry only at its 60–90 s resync); SIGTERM stops both processes and
//! removes the sockets; a driver that fails before it is registered ends
//! the supervisor with the error instead of being restarted; a call the
//! driver is killed under is answered by the next driver; a driver started
//! while a stopping manager's device plugins still serve waits for them.
//!
//! Needs `cargo build --workspace` first (gpu-sim and its libraries).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use apiserver_emulator::ApiServer;
use dra_kubelet_emulator::{allocator, plugin};
use test_support::dra::*;
use test_support::dra_binary::{self, Sup, children, log, prepare};

const BIN: &str = env!("CARGO_BIN_EXE_vcuda-dra-driver");

fn workspace() -> PathBuf {
    test_support::workspace_root()
}

/// The supervised binary over the sim in `dirs`, its stderr in `log`.
fn driver(dirs: &Dirs, extra: &[&str]) -> Sup {
    dra_binary::driver(Path::new(BIN), dirs, extra)
}

/// The one-GPU sim node the tests use, with the API server.
async fn node() -> (ApiServer, Dirs) {
    dra_binary::node("sim-1gpu.toml").await
}

/// The supervised driver started with `extra`, registered with the
/// emulated kubelet, its slice published and claim c1 prepared; its one
/// registration socket and that socket's inode.
async fn serving(
    server: &ApiServer,
    dirs: &Dirs,
    extra: &[&str],
) -> (Sup, plugin::DraPlugin, Vec<PathBuf>, u64) {
    dra_binary::serving(Path::new(BIN), server, dirs, extra).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_driver_is_replaced_on_the_same_sockets() {
    let (server, dirs) = node().await;
    let (mut sup, kubelet, reg, ino) = serving(&server, &dirs, &[]).await;
    let first = children(sup.0.id());
    assert_eq!(first.len(), 1, "one driver under the supervisor: {first:?}");

    // kill -9 the driver; the kubelet's next call on its channel comes
    // while no driver runs (the first restart waits 100 ms): after the
    // client saw its connection close (as grpc-go, which redials at once).
    // SAFETY: signals a process this test started (the supervisor's child).
    unsafe { libc::kill(first[0] as i32, libc::SIGKILL) };
    tokio::time::sleep(Duration::from_millis(30)).await;
    let waited = prepare(&kubelet, &server, "c2").await;
    eprintln!(
        "supervisor: prepare right after kill -9 answered in {:.0} ms",
        waited.as_secs_f64() * 1e3
    );
    let second = children(sup.0.id());
    assert!(
        second.len() == 1 && second != first,
        "{first:?} -> {second:?}"
    );
    // Same registration socket (the kubelet is not asked to register
    // anything new); both claims in the checkpoint.
    assert_eq!(plugin::sockets(&dirs.p("plugins_registry")), reg);
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&reg[0]).unwrap()),
        ino
    );
    let ck = dra_driver::checkpoint::Store::new(&dirs.p("state"))
        .load(NODE)
        .unwrap();
    assert_eq!(ck.claims.len(), 2);
    let l = log(&dirs);
    assert!(
        l.contains("the driver exited; a new one takes its sockets"),
        "{l}"
    );
    // Every call of both versions goes through the supervisor's relay: a
    // v1beta1 kubelet (1.32, 1.33) prepares, and c1 is unprepared.
    let old = plugin::register(&reg[0], true).await.unwrap();
    assert_eq!(old.version, plugin::Version::V1beta1);
    prepare(&old, &server, "c3").await;
    let c1 = server
        .get(apiserver_emulator::Kind::ResourceClaim, Some(NS), "c1")
        .unwrap();
    let c1 = plugin::claim(NS, "c1", &uid(&c1));
    let r = old.unprepare(std::slice::from_ref(&c1)).await.unwrap();
    assert_eq!(r.claims[&c1.uid].error, "");

    // SIGTERM: both go, the sockets with them.
    // SAFETY: signals the process this test started.
    unsafe { libc::kill(sup.0.id() as i32, libc::SIGTERM) };
    let status = sup.0.wait().unwrap();
    assert!(status.success(), "{status}\n{}", log(&dirs));
    assert!(
        std::fs::metadata(format!("/proc/{}", second[0])).is_err(),
        "the driver outlived its supervisor"
    );
    assert!(plugin::sockets(&dirs.p("plugins_registry")).is_empty());
}

/// kill -9 of the driver while it holds a NodePrepareResources: the call
/// is answered by the next driver, and the kubelet's health stream goes on
/// from it (issue 24: the call died with the driver's connection, "error
/// reading from server: EOF", and the kubelet retried the pod 10-15 s
/// later; seen on the 1.36 node). The driver is stopped first so the call
/// is surely in its hands, on the kubelet's existing connection, when it
/// dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_flight_when_the_driver_is_killed_is_answered_by_the_next() {
    let (server, dirs) = node().await;
    let (sup, kubelet, _reg, _ino) = serving(&server, &dirs, &[]).await;
    let mut health = kubelet.watch_health().await.unwrap();
    let first_health = tokio::time::timeout(Duration::from_secs(10), health.message())
        .await
        .expect("the first health message");
    assert!(matches!(first_health, Ok(Some(_))), "{first_health:?}");
    let first = children(sup.0.id());
    assert_eq!(first.len(), 1, "{first:?}");
    // SAFETY: signals the supervisor's child, started by this test.
    unsafe { libc::kill(first[0] as i32, libc::SIGSTOP) };
    let c = share_claim(&server, "c2", 20, "1Gi", None);
    allocator::allocate(&server, NS, "c2", NODE).unwrap();
    let claim = plugin::claim(NS, "c2", &uid(&c));
    let pending = {
        let (claim, kubelet) = (claim.clone(), kubelet.clone());
        tokio::spawn(async move { kubelet.prepare(std::slice::from_ref(&claim)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "answered by a stopped driver");
    let t0 = Instant::now();
    // SAFETY: as above.
    unsafe { libc::kill(first[0] as i32, libc::SIGKILL) };
    let r = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the call was never answered")
        .unwrap()
        .unwrap_or_else(|e| panic!("prepare c2 across kill -9: {e}\n{}", log(&dirs)));
    assert_eq!(r.claims[&claim.uid].error, "");
    eprintln!(
        "supervisor: prepare in flight at kill -9 answered {:.0} ms after the kill",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let next = tokio::time::timeout(Duration::from_secs(10), health.message())
        .await
        .expect("the health stream went quiet after the kill");
    assert!(
        matches!(next, Ok(Some(_))),
        "the health stream ended with the driver: {next:?}"
    );
    let second = children(sup.0.id());
    assert!(
        second.len() == 1 && second != first,
        "{first:?} -> {second:?}"
    );
    let l = log(&dirs);
    assert!(l.contains("answered by the next driver process"), "{l}");
    let ck = dra_driver::checkpoint::Store::new(&dirs.p("state"))
        .load(NODE)
        .unwrap();
    assert_eq!(ck.claims.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_failing_before_registration_ends_the_supervisor() {
    let (_server, dirs) = node().await;
    let mut sup = driver(&dirs, &["--nvml-library", "/nonexistent/libnvidia-ml.so.1"]);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = sup.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "still running\n{}",
            log(&dirs)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let l = log(&dirs);
    assert!(l.contains("/nonexistent/libnvidia-ml.so.1"), "{l}");
    assert!(l.contains("exited before the kubelet registered it"), "{l}");
    assert!(plugin::sockets(&dirs.p("plugins_registry")).is_empty());
}

/// A node switching modes: the driver's pod starts while the manager's
/// pod is still stopping (its device plugins keep serving while it
/// drains). The driver waits for the manager's socket to close, then
/// registers and serves; it is not refused (it was, at once, until
/// 4b8fea5: the DRA real-node suite's MIG phase failed so 3 runs in 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_started_beside_a_stopping_manager_waits_for_it() {
    let (server, dirs) = node().await;
    let dp = dirs.p("device-plugins");
    std::fs::create_dir_all(&dp).unwrap();
    let sock = dp.join(node_agent::mode::device_plugin_socket(
        node_agent::mode::VCORE_SOCKET,
        "1764245000000-7-0",
    ));
    let manager = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let log_path = dirs.p("driver.log");
    let text = move || std::fs::read_to_string(&log_path).unwrap_or_default();
    let stopper = std::thread::spawn(move || {
        let t0 = Instant::now();
        while !text().contains("waiting for it to stop") {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the driver did not wait for the manager:\n{}",
                text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // The manager drains for a while, then its sockets close.
        std::thread::sleep(Duration::from_secs(2));
        drop(manager);
    });
    let (mut sup, _kubelet, _reg, _ino) = serving(&server, &dirs, &[]).await;
    stopper.join().unwrap();
    let l = log(&dirs);
    assert!(!l.contains("still serving after"), "{l}");
    let at = |needle: &str| {
        l.find(needle)
            .unwrap_or_else(|| panic!("no {needle:?}\n{l}"))
    };
    assert!(
        at("waiting for it to stop") < at("DRA driver serving"),
        "served only once the manager stopped\n{l}"
    );
    assert!(sup.0.try_wait().unwrap().is_none(), "the driver runs\n{l}");
}

/// The driver's whole container killed (supervisor and driver, kill -9)
/// and started again, with the pod's socket holder: a NodePrepareResources
/// the kubelet sends while nothing of the driver runs waits in the held
/// socket's backlog and is answered by the new container's driver, on the
/// same registration (issue 24: without the holder the kubelet meets a
/// refused socket and retries the pod 10-15 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_container_restart_keeps_the_sockets_with_the_holder() {
    let (server, dirs) = node().await;
    let holder = dirs.p("holder/holder.sock");
    let _holder = Command::new(BIN)
        .arg("hold-sockets")
        .arg(&holder)
        .stderr(std::fs::File::create(dirs.p("holder.log")).unwrap())
        .spawn()
        .map(Sup)
        .unwrap();
    until(10, "the holder listening", || {
        std::os::unix::net::UnixStream::connect(&holder).is_ok()
    })
    .await;
    let flag = ["--socket-holder", holder.to_str().unwrap()];
    let (mut sup, kubelet, reg, ino) = serving(&server, &dirs, &flag).await;
    until(10, "the holder told of the registration", || {
        std::fs::read_to_string(dirs.p("holder.log"))
            .unwrap_or_default()
            .contains("holding the sockets")
    })
    .await;

    // The container dies: the supervisor with -9, its driver with it.
    let first = children(sup.0.id());
    sup.0.kill().unwrap();
    let _ = sup.0.wait();
    until(10, "the driver gone with its supervisor", || {
        first
            .iter()
            .all(|p| std::fs::metadata(format!("/proc/{p}")).is_err())
    })
    .await;
    let c = share_claim(&server, "c2", 20, "1Gi", None);
    allocator::allocate(&server, NS, "c2", NODE).unwrap();
    let claim = plugin::claim(NS, "c2", &uid(&c));
    let t0 = Instant::now();
    let pending = {
        let claim = claim.clone();
        let kubelet = kubelet.clone();
        tokio::spawn(async move { kubelet.prepare(std::slice::from_ref(&claim)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!pending.is_finished(), "answered while no driver ran");
    let _sup2 = driver(&dirs, &flag);
    let r = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the held call was never answered")
        .unwrap()
        .unwrap_or_else(|e| {
            panic!(
                "prepare c2 across the container restart: {e}\n{}",
                log(&dirs)
            )
        });
    assert_eq!(r.claims[&claim.uid].error, "");
    eprintln!(
        "holder: prepare sent while the container was down answered {:.0} ms later",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let l = log(&dirs);
    assert!(
        l.contains("serving on the sockets the holder kept open"),
        "{l}"
    );
    assert_eq!(plugin::sockets(&dirs.p("plugins_registry")), reg);
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&reg[0]).unwrap()),
        ino,
        "the same registration socket: nothing new for the kubelet"
    );
}

/// A hostile process in a claim's container, against the supervised
/// driver binary: the same attacks as `tests/manager_hostile.rs` on the
/// manager (resize and write the ledger it was handed, 1,000 maximal
/// registrations held, garbage and slow frames). The driver stays the
/// same process and keeps answering, its RSS bounded; the claim's quota
/// holds for an ordinary process, also with `VCUDA_CONFIG_DIR` at a
/// copied config that turns enforcement off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_claim_cannot_harm_the_driver_nor_lift_its_quota() {
    use test_support::hostile::{self, assert_held, quota_run, rss_kib};
    if !test_support::require(test_support::Capability::Root) {
        return;
    }
    let (server, dirs) = node().await;
    let (sup, kubelet, _, _) = serving(&server, &dirs, &[]).await;
    let child = children(sup.0.id());
    assert_eq!(child.len(), 1, "{child:?}");
    let child = child[0] as i32;
    let c = share_claim(&server, "hostile", 20, "1Gi", None);
    allocator::allocate(&server, NS, "hostile", NODE).unwrap();
    let claim = plugin::claim(NS, "hostile", &uid(&c));
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let one = &r.claims[&claim.uid];
    assert_eq!(one.error, "");
    let edits =
        dra_kubelet_emulator::cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0])
            .unwrap();
    let env = container_env(&edits);
    let dir =
        std::path::PathBuf::from(&env.iter().find(|(k, _)| k == "VCUDA_CONFIG_DIR").unwrap().1);
    let quota_config::Quota::Single(q) = quota_config::read_quota(&dir).unwrap() else {
        panic!("a one-GPU claim");
    };
    let req = hostile::maximal_request(&q.pod_uid, &q.container_name);

    let (conn, resp, fds) = hostile::register(&dir, &req);
    assert_eq!(resp.status, 1, "accepted: {resp:?}");
    let rs = hostile::resize(&fds[0]);
    assert_eq!(
        (rs.truncate, rs.grow, rs.fallocate),
        (Err(libc::EPERM), Err(libc::EPERM), Err(libc::EPERM)),
        "{rs:?}"
    );
    assert_eq!(rs.len_after, container_ledger::FILE_SIZE as u64);
    hostile::scribble(&fds[0]);
    let rss0 = rss_kib(child);
    let held = tokio::task::block_in_place(|| hostile::hold_registrations(&dir, &req, 250));
    let slow = tokio::task::block_in_place(|| hostile::garbage(&dir, &req, 300));
    // Still answering the kubelet while all of that is held: another
    // claim on the same GPU, whose quota is checked below.
    let (_, other) = dra_binary::prepare_share(&kubelet, &server, "after", 30, "512Mi").await;
    let other_env = dra_binary::share_env(&dirs, &other);
    let rss1 = rss_kib(child);
    eprintln!(
        "DRA driver RSS {rss0} KiB before, {rss1} KiB holding 1,000 registrations, 300 slow and 600 garbage connections"
    );
    assert!(
        rss1 < rss0 + 64 * 1024,
        "RSS grew from {rss0} to {rss1} KiB"
    );
    drop((held, slow, conn, fds));
    assert_eq!(children(sup.0.id()), vec![child as u32], "the same driver");

    let client = dirs.p("shim_client");
    test_support::sim::gcc_lcuda(
        &workspace().join("tests/c/shim_client.c"),
        &dirs.p("sim").join("usr/lib/x86_64-linux-gnu"),
        &client,
    );
    let copied = dirs.p("copied");
    std::fs::create_dir_all(&copied).unwrap();
    let mut off = q.clone();
    off.enable = false;
    off.gpu_memory = 64 << 30;
    std::fs::write(
        copied.join(quota_config::CONFIG_FILE),
        off.to_bytes().unwrap(),
    )
    .unwrap();
    let sim = dirs.p("sim");
    tokio::task::block_in_place(|| {
        assert_held(
            &quota_run(&client, &env, &sim, &[]),
            1 << 30,
            "hostile claim",
        );
        let out = quota_run(
            &client,
            &env,
            &sim,
            &[("VCUDA_CONFIG_DIR", copied.to_str().unwrap())],
        );
        assert_held(
            &out,
            1 << 30,
            "hostile claim, VCUDA_CONFIG_DIR at a copied config",
        );
        assert_held(
            &quota_run(&client, &other_env, &sim, &[]),
            512 << 20,
            "the other claim on the GPU",
        );
    });
    assert_eq!(children(sup.0.id()), vec![child as u32], "the same driver");
}

/// kill -9 of the driver while a MIG instance is in use (issue 36): the
/// instance and the process in it untouched, and the claim adopted by the
/// next driver (NodePrepareResources of it again answers the same CDI
/// device, no instance made or destroyed); unprepared once its process
/// ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_killed_under_a_mig_instance_in_use_leaves_it_and_adopts_its_claim() {
    let (server, dirs) = dra_binary::node("sim-mig-h100.toml").await;
    let sim = dirs.p("sim");
    // `nvidia-smi -mig 1` and `nvidia-smi mig -cgi 9,19 -C` on GPU 0: a
    // 3g.40gb and a 1g.10gb.
    test_support::sim::gpu_sim_mig(&sim, &["--gpu", "0", "--enable", "--create", "9,19"]);
    let instances = || {
        let mut v: Vec<String> = test_support::sim::state_at(&sim)
            .mig_devices(0)
            .into_iter()
            .map(|(g, c)| format!("{} {}", g.id, c.profile.device_name()))
            .collect();
        v.sort();
        v
    };
    let before = instances();
    assert_eq!(before.len(), 2, "{before:?}");
    let (sup, kubelet, _, _) = serving(&server, &dirs, &[]).await;
    let first = children(sup.0.id());
    assert_eq!(first.len(), 1, "{first:?}");

    let c = mig_claim(&server, "m", "3g.40gb");
    allocator::allocate(&server, NS, "m", NODE).unwrap();
    let m = plugin::claim(NS, "m", &uid(&c));
    let r = kubelet.prepare(std::slice::from_ref(&m)).await.unwrap();
    let one = &r.claims[&m.uid];
    assert_eq!(one.error, "", "{}", log(&dirs));
    let cdi_id = one.devices[0].cdi_device_ids[0].clone();
    let env = dra_binary::share_env(&dirs, &cdi_id);
    let mig = env
        .iter()
        .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
        .map(|(_, v)| v.clone())
        .unwrap();
    assert!(mig.starts_with("MIG-"), "{env:?}");
    let client = dirs.p("shim_client");
    test_support::sim::gcc_lcuda(
        &workspace().join("tests/c/shim_client.c"),
        &sim.join("usr/lib/x86_64-linux-gnu"),
        &client,
    );
    let mut cmd = Command::new(&client);
    cmd.envs(env.iter().cloned())
        .env("CUDA_VISIBLE_DEVICES", &mig);
    let mut holder = test_support::hostile::holding_mib(cmd, 64);

    // SAFETY: signals a process this test started (the supervisor's child).
    unsafe { libc::kill(first[0] as i32, libc::SIGKILL) };
    until(20, "the next driver", || {
        let now = children(sup.0.id());
        now.len() == 1 && now != first
    })
    .await;
    let again = kubelet.prepare(std::slice::from_ref(&m)).await.unwrap();
    let one = &again.claims[&m.uid];
    assert_eq!(one.error, "", "{}", log(&dirs));
    assert_eq!(
        one.devices[0].cdi_device_ids[0], cdi_id,
        "the claim adopted"
    );
    assert!(
        holder.try_wait().unwrap().is_none(),
        "the instance's process lives"
    );
    assert_eq!(instances(), before, "no instance made or destroyed");

    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    let u = kubelet.unprepare(std::slice::from_ref(&m)).await.unwrap();
    assert_eq!(u.claims[&m.uid].error, "", "{}", log(&dirs));
    assert_eq!(instances(), before, "an operator's instances stay");
}
