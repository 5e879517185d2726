//! Dynamic MIG in DRA mode (issue 36), the whole driver (`daemon::run`) on
//! the simulated H100 node with `--mig-dynamic 0`: GPU 0 is put in MIG
//! mode and published as every placement of every profile (partitionable
//! devices consuming its memory-slice counters); a claim for a 3g.40gb
//! gets its instance made at prepare (a CUDA program with the spec's env
//! sees the instance's 60 SMs / 40448 MiB), a second 3g.40gb the other
//! placement, a third or a 7g.80gb does not fit (the counters); unprepare
//! destroys the instance.
//!
//! Needs `cargo build --workspace` first (gpu-sim, its cdylibs, libvcuda.so).

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use apiserver_emulator::{ApiServer, Kind};
use dra_driver::daemon::{Settings, run};
use dra_driver::slices;
use dra_kubelet_emulator::{allocator, cdi, plugin};
use test_support::dra::*;
use test_support::sim::SimNode;
use test_support::workspace_root;
use tokio_util::sync::CancellationToken;

fn settings(sim: &SimNode, dirs: &Dirs) -> Settings {
    Settings {
        mig_dynamic: vec!["0".into()],
        ..sim_settings(sim.root(), dirs)
    }
}

/// The driver run with `s` until `cancel`, once it says it is ready.
async fn start(
    s: Settings,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(run(s, cancel.clone(), Some(tx)));
    tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .unwrap()
        .unwrap();
    daemon
}

/// A claim `name` for a MIG device of `profile`, allocated: its device,
/// or the allocator's refusal.
fn claim(server: &ApiServer, name: &str, profile: &str) -> (String, Result<String, String>) {
    let c = mig_claim(server, name, profile);
    let a = allocator::allocate(server, NS, name, NODE).map_err(|e| e.to_string());
    let device = a.map(|a| {
        a["devices"]["results"][0]["device"]
            .as_str()
            .unwrap()
            .to_string()
    });
    (uid(&c), device)
}

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sim_cuda(sim: &SimNode, dirs: &Dirs) -> std::path::PathBuf {
    let prog = dirs.p("sim_cuda");
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&prog)
        .arg(workspace_root().join("tests/c/sim_cuda.c"))
        .arg("-I")
        .arg(workspace_root().join("tests/c"))
        .arg("-L")
        .arg(sim.root().join("usr/lib/x86_64-linux-gnu"))
        .args(["-lcuda", "-ldl", "-lpthread"]));
    prog
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_are_made_at_prepare_for_the_placement_allocated_and_destroyed_at_unprepare() {
    let sim = SimNode::install("sim-mig-h100");
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let cancel = CancellationToken::new();
    let daemon = start(settings(&sim, &dirs), &cancel).await;
    let kubelet = kubelet(&dirs, false).await;
    let counters = format!("{}-counters", slices::slice_name(NODE));
    // Its slices are written one after the other: both, then.
    until(10, "the pool published", || {
        [counters.clone(), slices::slice_name(NODE)]
            .iter()
            .all(|n| server.get(Kind::ResourceSlice, None, n).is_some())
    })
    .await;
    let set =
        &server.get(Kind::ResourceSlice, None, &counters).unwrap()["spec"]["sharedCounters"][0];
    assert_eq!(set["name"], "gpu-0-mig");
    assert_eq!(set["counters"].as_object().unwrap().len(), 8, "{set}");
    assert!(
        sim.mig_profiles(0).is_empty(),
        "nothing made before a claim"
    );
    let devices = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let half = devices["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "gpu-0-mig-3g-40gb-4")
        .unwrap()
        .clone();
    assert_eq!(half["capacity"]["memory"]["value"], "40448Mi", "{half}");
    assert_eq!(half["attributes"]["multiprocessors"]["int"], 60, "{half}");

    let (a_uid, a) = claim(&server, "a", "3g.40gb");
    assert_eq!(a.as_deref(), Ok("gpu-0-mig-3g-40gb-0"));
    let a_ref = plugin::claim(NS, "a", &a_uid);
    let r = kubelet.prepare(std::slice::from_ref(&a_ref)).await.unwrap();
    let one = &r.claims[&a_uid];
    assert_eq!(one.error, "");
    assert_eq!(sim.mig_profiles(0), ["3g.40gb"]);
    let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
    let env = container_env(&edits);
    let mig_uuid = env
        .iter()
        .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
        .unwrap()
        .1
        .clone();
    assert!(mig_uuid.starts_with("MIG-"), "{env:?}");
    let out = sh(Command::new(sim_cuda(&sim, &dirs))
        .arg("info")
        .envs(env.iter().cloned())
        .env("CUDA_VISIBLE_DEVICES", &mig_uuid));
    let kv: HashMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(
        (kv["count"], kv["dev0.total_mib"], kv["dev0.sms"]),
        ("1", "40448", "60"),
        "{out}"
    );

    let (b_uid, b) = claim(&server, "b", "3g.40gb");
    assert_eq!(b.as_deref(), Ok("gpu-0-mig-3g-40gb-4"));
    let b_ref = plugin::claim(NS, "b", &b_uid);
    let r = kubelet.prepare(std::slice::from_ref(&b_ref)).await.unwrap();
    assert_eq!(r.claims[&b_uid].error, "");
    assert_eq!(sim.mig_profiles(0), ["3g.40gb", "3g.40gb"]);
    for (name, profile) in [("c", "3g.40gb"), ("d", "7g.80gb")] {
        let (_, refused) = claim(&server, name, profile);
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("fits on no device")),
            "{name}: {refused:?}"
        );
    }

    let u = kubelet
        .unprepare(std::slice::from_ref(&a_ref))
        .await
        .unwrap();
    assert_eq!(u.claims[&a_uid].error, "");
    assert_eq!(sim.mig_profiles(0), ["3g.40gb"], "a's instance destroyed");
    assert!(!dra_driver::cdi::spec_path(&dirs.p("cdi"), &a_uid).exists());
    let recorded = || -> Vec<serde_json::Value> {
        let text = std::fs::read(dirs.p("state/mig-created.json")).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        let gpus = v["gpus"].as_object().unwrap();
        gpus.values()
            .flat_map(|s| s.as_array().unwrap().clone())
            .collect()
    };
    assert_eq!(recorded().len(), 1, "b's alone: {:?}", recorded());
    cancel.cancel();
    daemon.await.unwrap().unwrap();

    // A restart keeps b's instance (the checkpoint): its placement is
    // published, not left out as an operator's, and unprepare destroys it.
    // The pool is deleted first (as a kubelet's restart does): the new
    // driver's own slices are read.
    for n in [counters.clone(), slices::slice_name(NODE)] {
        server.delete(Kind::ResourceSlice, None, &n).unwrap();
    }
    let cancel = CancellationToken::new();
    let daemon = start(settings(&sim, &dirs), &cancel).await;
    let kubelet = test_support::dra::kubelet(&dirs, false).await;
    until(10, "the pool published again", || {
        [counters.clone(), slices::slice_name(NODE)]
            .iter()
            .all(|n| server.get(Kind::ResourceSlice, None, n).is_some())
    })
    .await;
    assert_eq!(sim.mig_profiles(0), ["3g.40gb"]);
    let devices = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let names: Vec<&str> = devices["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"gpu-0-mig-3g-40gb-4"), "{names:?}");
    let u = kubelet
        .unprepare(std::slice::from_ref(&b_ref))
        .await
        .unwrap();
    assert_eq!(u.claims[&b_uid].error, "");
    assert!(sim.mig_profiles(0).is_empty());
    assert!(recorded().is_empty());
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// An operator's instance (a 1g.10gb made before the driver starts) is
/// left alone, and no placement overlapping it is published: the
/// scheduler, which cannot see it, could otherwise allocate one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_over_an_operators_instance_are_not_published() {
    let sim = SimNode::install("sim-mig-h100");
    sim.mig(&["--gpu", "0", "--enable", "--create", "19"]);
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let cancel = CancellationToken::new();
    let daemon = start(settings(&sim, &dirs), &cancel).await;
    let _kubelet = kubelet(&dirs, false).await;
    let counters = format!("{}-counters", slices::slice_name(NODE));
    // Its slices are written one after the other: both, then.
    until(10, "the pool published", || {
        [counters.clone(), slices::slice_name(NODE)]
            .iter()
            .all(|n| server.get(Kind::ResourceSlice, None, n).is_some())
    })
    .await;
    let start = sim.state().mig_devices(0)[0].0.placement.start;
    let s = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let names: Vec<String> = s["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect();
    let op = format!("gpu-0-mig-1g-10gb-{start}");
    assert!(!names.contains(&op), "{op} in {names:?}");
    assert!(
        !names.contains(&"gpu-0-mig-7g-80gb-0".to_string()),
        "{names:?}"
    );
    let other_half = if start < 4 { 4 } else { 0 };
    let free = format!("gpu-0-mig-3g-40gb-{other_half}");
    assert!(names.contains(&free), "{free} not in {names:?}");
    assert_eq!(sim.mig_profiles(0), ["1g.10gb"], "the operator's kept");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// An operator destroys the instance made for a prepared claim (its
/// program done): the driver's next read of the dynamic GPU
/// (`--mig-rescan-period`, under the checkpoint lock) shows the claim's
/// device Unhealthy in the kubelet's health stream, saying so, and the
/// claim's pod gets a `VcudaMigDeviceLost` Event; unprepare still
/// succeeds (an instance already gone is no error). The build before
/// watched only static devices and said nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_made_for_a_claim_and_destroyed_under_it_is_reported() {
    use dra_api::dra_health::v1alpha1::HealthStatus;
    let Node {
        sim,
        server,
        dirs,
        cancel,
        daemon,
        kubelet,
    } = Node::start(Some(Duration::from_millis(200)), None).await;
    let pod = serde_json::json!({"resource": "pods", "name": "infer", "uid": "u-infer"});
    let (small, device, one) = prepared_1g(&server, &kubelet, Some(pod)).await;
    let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
    let env = container_env(&edits);
    let (_, uuid) = env
        .iter()
        .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
        .unwrap()
        .clone();
    let state = sim.state();
    let (g, ci) = state.mig_devices(0)[0];
    let mut health = kubelet.watch_health().await.unwrap();
    let mut next = async || plugin::next_device_health(&mut health, NODE, &device).await;
    assert_eq!(next().await.0, HealthStatus::Healthy as i32);

    state.destroy_compute_instance(0, g.id, ci.id).unwrap();
    state.destroy_gpu_instance(0, g.id).unwrap();
    let t = std::time::Instant::now();
    let (h, message) = next().await;
    assert_eq!(h, HealthStatus::Unhealthy as i32, "{message}");
    assert!(
        message.contains(&uuid) && message.contains("destroyed") && message.contains("small"),
        "{message}"
    );
    until(10, "the VcudaMigDeviceLost event", || {
        server.list(Kind::Event).iter().any(|e| {
            e["reason"] == "VcudaMigDeviceLost"
                && e["regarding"]["name"] == "infer"
                && e["note"].as_str().is_some_and(|n| n.contains(&uuid))
        })
    })
    .await;
    println!(
        "a dynamic instance destroyed under its claim: Unhealthy and the pod told {} ms after (read every 200 ms)",
        t.elapsed().as_millis()
    );
    kubelet
        .unprepare(std::slice::from_ref(&small))
        .await
        .unwrap();
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// Every device of the node's pool (its slices with devices).
fn pool_devices(server: &ApiServer) -> Vec<serde_json::Value> {
    server
        .list(Kind::ResourceSlice)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// An Xid inside the GPU instance made for a claim taints that claim's
/// placement device alone in the pool (the GPU's other placements stay
/// as they were), and the kubelet's health stream says which instance.
/// The build before tainted nothing for an instance's Xid on a dynamic
/// GPU (only the GPU's own Xids reached its placements). When the claim
/// goes, its instance and the taint go with it, and the next claim on
/// that placement gets a healthy instance under the same ID (the build
/// before kept the taint and the Xid for the quiet period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_inside_a_made_instance_taints_its_placement_alone() {
    use dra_api::dra_health::v1alpha1::HealthStatus;
    let Node {
        sim,
        server,
        cancel,
        daemon,
        kubelet,
        ..
    } = Node::start(None, Some(Duration::from_secs(120))).await;
    let (small, device, _) = prepared_1g(&server, &kubelet, None).await;
    let (g, _) = sim.state().mig_devices(0)[0];
    let mut health = kubelet.watch_health().await.unwrap();
    let mut next = async || plugin::next_device_health(&mut health, NODE, &device).await;
    assert_eq!(next().await.0, HealthStatus::Healthy as i32);

    sim.xid(0, 94, Some(g.id));
    let (h, message) = next().await;
    assert_eq!(h, HealthStatus::Unhealthy as i32, "{message}");
    assert!(message.contains("critical Xid 94"), "{message}");
    let tainted = |server: &ApiServer| -> Vec<String> {
        pool_devices(server)
            .iter()
            .filter(|d| !d["taints"].is_null())
            .map(|d| d["name"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    until(10, "the claim's placement tainted", || {
        tainted(&server) == [device.clone()]
    })
    .await;
    let d = pool_devices(&server)
        .into_iter()
        .find(|d| d["name"] == device.as_str())
        .unwrap();
    assert_eq!(d["taints"][0]["value"], "xid-94", "{d}");
    assert!(
        pool_devices(&server).len() > 10,
        "every placement published"
    );

    // The instance goes with its claim; the next one made under the same
    // GPU-instance ID is new hardware state, healthy (the build before
    // kept the old instance's Xid against the ID for the quiet period).
    kubelet
        .unprepare(std::slice::from_ref(&small))
        .await
        .unwrap();
    until(10, "the destroyed instance's placement untainted", || {
        tainted(&server).is_empty()
    })
    .await;
    server
        .delete(Kind::ResourceClaim, Some(NS), "small")
        .unwrap();
    let (uid, again) = claim(&server, "again", "1g.10gb");
    let again = again.unwrap();
    let r = kubelet
        .prepare(&[plugin::claim(NS, "again", &uid)])
        .await
        .unwrap();
    assert_eq!(r.claims[&uid].error, "");
    let (g2, _) = sim.state().mig_devices(0)[0];
    assert_eq!(again, device, "best fit picks the same placement again");
    assert_eq!(g2.id, g.id, "GPU-instance IDs follow placements");
    let mut next = async || plugin::next_device_health(&mut health, NODE, &again).await;
    let (h, message) = next().await;
    assert_eq!(h, HealthStatus::Healthy as i32, "{message}");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// The driver on the simulated H100 with GPU 0 dynamic (`rescan`: its
/// `--mig-rescan-period`), its pool published, and the kubelet's side.
struct Node {
    sim: SimNode,
    server: ApiServer,
    dirs: Dirs,
    cancel: CancellationToken,
    daemon: tokio::task::JoinHandle<anyhow::Result<()>>,
    kubelet: plugin::DraPlugin,
}

impl Node {
    /// `quiet`: the Xid quiet period, when not the test default.
    async fn start(rescan: Option<Duration>, quiet: Option<Duration>) -> Node {
        let sim = SimNode::install("sim-mig-h100");
        let server = ApiServer::start("127.0.0.1:0").await.unwrap();
        let dirs = Dirs::new();
        server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
        let cancel = CancellationToken::new();
        let base = settings(&sim, &dirs);
        let s = Settings {
            mig_rescan_period: rescan,
            xid_quiet_period: quiet.unwrap_or(base.xid_quiet_period),
            ..base
        };
        let daemon = start(s, &cancel).await;
        let kubelet = kubelet(&dirs, false).await;
        until(10, "the pool published", || {
            server
                .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
                .is_some()
        })
        .await;
        Node {
            sim,
            server,
            dirs,
            cancel,
            daemon,
            kubelet,
        }
    }
}

/// A claim `small` for a 1g.10gb, reserved for `pod` (when given),
/// allocated and prepared: the kubelet's claim, its placement device and
/// what prepare answered for it.
async fn prepared_1g(
    server: &ApiServer,
    kubelet: &plugin::DraPlugin,
    pod: Option<serde_json::Value>,
) -> (
    dra_api::dra::v1::Claim,
    String,
    dra_api::dra::v1::NodePrepareResourceResponse,
) {
    let (uid, device) = claim(server, "small", "1g.10gb");
    let device = device.unwrap();
    if let Some(pod) = pod {
        let reserved = serde_json::json!({"status": {"reservedFor": [pod]}});
        server
            .patch(Kind::ResourceClaim, Some(NS), "small", &reserved)
            .unwrap();
    }
    let small = plugin::claim(NS, "small", &uid);
    let r = kubelet.prepare(std::slice::from_ref(&small)).await.unwrap();
    let one = r.claims[&uid].clone();
    assert_eq!(one.error, "");
    (small, device, one)
}

/// A GPU prepared claims hold (a share here) is never put in MIG mode
/// (issue 36: a GPU holding a share is never re-partitioned): the driver
/// restarted with `--mig-dynamic 0,1` leaves GPU 0 whole (its share's
/// claim still prepared, unprepared after) and partitions idle GPU 1; so
/// does `--mig-geometry` for GPU 0; the next start after the claim went
/// partitions GPU 0 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_holding_claims_is_never_put_in_mig_mode() {
    let sim = SimNode::install("sim-mig-h100");
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let plain = sim_settings(sim.root(), &dirs);
    let mig_mode = |gpu| sim.state().mig_mode(gpu).unwrap();
    let restart = |s: Settings| async {
        for n in [
            format!("{}-counters", slices::slice_name(NODE)),
            slices::slice_name(NODE),
        ] {
            let _ = server.delete(Kind::ResourceSlice, None, &n);
        }
        let cancel = CancellationToken::new();
        let daemon = start(s, &cancel).await;
        // It publishes (its classes first) once a kubelet registered it.
        let kubelet = test_support::dra::kubelet(&dirs, false).await;
        until(10, "the slice published", || {
            server
                .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
                .is_some()
        })
        .await;
        (cancel, daemon, kubelet)
    };

    let (cancel, daemon, kubelet) = restart(plain.clone()).await;
    let c = share_claim(&server, "s", 30, "1Gi", None);
    let a = allocator::allocate(&server, NS, "s", NODE).unwrap();
    assert_eq!(a["devices"]["results"][0]["device"], "gpu-0", "{a}");
    let s = plugin::claim(NS, "s", &uid(&c));
    let r = kubelet.prepare(std::slice::from_ref(&s)).await.unwrap();
    assert_eq!(r.claims[&s.uid].error, "");
    cancel.cancel();
    daemon.await.unwrap().unwrap();

    let dynamic = Settings {
        mig_dynamic: vec!["0".into(), "1".into()],
        ..plain.clone()
    };
    let (cancel, daemon, _kubelet) = restart(dynamic.clone()).await;
    assert_eq!(mig_mode(0), (false, false), "GPU 0 holds a share: whole");
    assert!(mig_mode(1).0, "GPU 1 is idle: in MIG mode");
    cancel.cancel();
    daemon.await.unwrap().unwrap();

    let geometry = Settings {
        mig_geometry: "0=3g.40gb".parse().unwrap(),
        ..plain.clone()
    };
    let (cancel, daemon, kubelet) = restart(geometry).await;
    assert_eq!(mig_mode(0), (false, false), "--mig-geometry: whole too");
    assert!(sim.mig_profiles(0).is_empty());
    let u = kubelet.unprepare(std::slice::from_ref(&s)).await.unwrap();
    assert_eq!(u.claims[&s.uid].error, "");
    cancel.cancel();
    daemon.await.unwrap().unwrap();

    let (cancel, daemon, _kubelet) = restart(dynamic).await;
    assert!(mig_mode(0).0, "no claim left: GPU 0 in MIG mode");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}
