//! A vcuda share inside a MIG device (issue 36), DRA mode: the whole
//! driver (`daemon::run`) on the simulated H100 node, GPU 0 in MIG mode
//! with one 2g.20gb instance (32 SMs, 19.6 GiB). A claim of the MIG class
//! asking 50 cores and 5 GiB of that device is allocated by the emulated
//! scheduler (consumable capacity), prepared through the emulated kubelet,
//! and a program run with what its CDI spec injects (the instance's nodes,
//! the interposer, its quota) sees a 5 GiB card, is refused past it, and
//! gets half of the instance's time, read from the sim's own timeline of
//! that instance (ground truth, not what the interposer steers by: GPM
//! samples of the instance). The whole instance is not allocatable to
//! another claim meanwhile; an Xid inside the instance taints its device
//! alone; a driver restart adopts the prepared share (same spec, a new
//! process still held); unprepare leaves the instance.
//!
//! Needs `cargo build --workspace` first (gpu-sim, its cdylibs, libvcuda.so).

use std::process::Command;
use std::time::Duration;

use apiserver_emulator::{ApiServer, Kind};
use dra_kubelet_emulator::{allocator, cdi, plugin};
use serde_json::json;
use test_support::dra::*;
use test_support::kv;
use test_support::sim::{SimNode, busy_of_instance, compile_c};

const MIB: u64 = 1 << 20;

/// A claim for `cores` and `memory` of the 2g.20gb MIG device, created.
fn share_in_2g(server: &ApiServer, name: &str, capacity: Option<(&str, &str)>) -> String {
    share_in(server, name, "2g.20gb", capacity)
}

/// A claim for `cores` and `memory` of the MIG device of `profile`.
fn share_in(
    server: &ApiServer,
    name: &str,
    profile: &str,
    capacity: Option<(&str, &str)>,
) -> String {
    share_in_with(server, name, profile, capacity, None)
}

/// [`share_in`] with a `GpuConfig` (`params`) for the claim's request.
fn share_in_with(
    server: &ApiServer,
    name: &str,
    profile: &str,
    capacity: Option<(&str, &str)>,
    params: Option<serde_json::Value>,
) -> String {
    let selector = format!(
        "device.attributes['{}'].profile == '{profile}'",
        dra_driver::DRIVER_NAME
    );
    let mut request = json!({"deviceClassName": dra_driver::slices::MIG_CLASS,
        "selectors": [{"cel": {"expression": selector}}]});
    if let Some((cores, memory)) = capacity {
        request["capacity"] = json!({"requests": {"cores": cores, "memory": memory}});
    }
    let mut devices = json!({"requests": [{"name": "mig", "exactly": request}]});
    if let Some(p) = params {
        devices["config"] = json!([{"requests": ["mig"], "opaque": {
            "driver": dra_driver::DRIVER_NAME, "parameters": p}}]);
    }
    let c = server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({"metadata": {"name": name, "namespace": NS}, "spec": {"devices": devices}}),
        )
        .unwrap();
    uid(&c)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_inside_a_2g_instance_is_held_to_its_part_of_the_instance() {
    let sim = SimNode::install("sim-mig-h100");
    // `nvidia-smi mig -cgi 14,19 -C`: a 2g.20gb and a 1g.10gb on H100.
    sim.mig(&["--gpu", "0", "--enable", "--create", "14,19"]);
    let (g, ci) = sim
        .state()
        .mig_devices(0)
        .into_iter()
        .find(|(_, c)| c.profile.device_name() == "2g.20gb")
        .unwrap();
    let gi = g.id;
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let settings = sim_settings(sim.root(), &dirs);
    let (cancel, daemon, kubelet) = run_daemon(&server, &dirs, settings).await;

    let uid = share_in_2g(&server, "half-of-2g", Some(("50", "5Gi")));
    let a = allocator::allocate(&server, NS, "half-of-2g", NODE).unwrap();
    let result = &a["devices"]["results"][0];
    assert_eq!(result["device"], format!("gpu-0-mig-{gi}-{}", ci.id));
    assert_eq!(result["consumedCapacity"]["cores"], "50", "{a}");
    let device = |name: &str| -> serde_json::Value {
        let s = server
            .get(
                Kind::ResourceSlice,
                None,
                &dra_driver::slices::slice_name(NODE),
            )
            .unwrap();
        let found = s["spec"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name);
        found.cloned().unwrap_or_else(|| panic!("no {name} in {s}"))
    };
    let name = format!("gpu-0-mig-{gi}-{}", ci.id);
    let mig_uuid = device(&name)["attributes"]["uuid"]["string"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(mig_uuid.starts_with("MIG-"), "{mig_uuid}");
    let claim = plugin::claim(NS, "half-of-2g", &uid);
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let one = &r.claims[&claim.uid];
    assert_eq!(one.error, "");
    let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
    let nodes = edits["deviceNodes"].to_string();
    assert!(
        nodes.contains("/dev/nvidia0")
            && nodes.matches("\"path\":\"/dev/nvidia-caps/").count() == 2,
        "the instance's nodes: {edits}"
    );
    let env = container_env(&edits);
    assert!(
        env.contains(&("NVIDIA_VISIBLE_DEVICES".into(), mig_uuid.clone())),
        "{env:?}"
    );
    assert!(env.iter().any(|(k, _)| k == "VCUDA_CONFIG_DIR"), "{env:?}");
    let env = exposed(env);

    // A 5 GiB card, refused past it.
    let client = compile_c("shim_client", &sim, &dirs.p(""));
    let out = run(Command::new(&client)
        .args(["quota", "64"])
        .envs(env.iter().cloned())
        .env_remove("LOGGER_LEVEL"));
    let r = kv(&out);
    let get = |k: &str| r[k].parse::<u64>().unwrap();
    assert_eq!(get("start_total"), 5 << 30, "cuMemGetInfo total: {out}");
    assert_eq!(get("last"), 2, "refused past 5 GiB (out of memory): {out}");
    assert!(get("allocated") * 64 * MIB <= 5 << 30, "{out}");
    assert!(get("full_free") < 64 * MIB, "{out}");

    // Half of the instance's time, saturating.
    let compute = compile_c("shim_compute", &sim, &dirs.p(""));
    let u = busy_of_instance(&sim, gi, &compute, &env, (6.0, 2.0, 5.5));
    println!("a 50 % share inside a 2g.20gb instance got {u:.1} % of the instance");
    // Issue 36's 50 ± 3 %: 49.1-50.0 % in three runs beside a clean-clone
    // run's cargo tests and real-node suite.
    assert!((u - 50.0).abs() <= 3.0, "{u:.1} % of the instance");

    // The whole instance is not free meanwhile (the scheduler's capacity).
    share_in_2g(&server, "all-of-2g", None);
    assert!(allocator::allocate(&server, NS, "all-of-2g", NODE).is_err());

    // An Xid inside the 2g.20gb's GPU instance taints its device alone
    // (while the claim is prepared: its pod goes on).
    sim.xid(0, 94, Some(gi));
    until(10, "the instance's device tainted", || {
        device(&name)["taints"][0]["value"] == "xid-94"
    })
    .await;
    let other = server
        .get(
            Kind::ResourceSlice,
            None,
            &dra_driver::slices::slice_name(NODE),
        )
        .unwrap()["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] != name.as_str())
        .cloned()
        .unwrap();
    assert!(
        other["taints"].is_null(),
        "the 1g.10gb is untouched: {other}"
    );

    // A driver restart adopts the share: the same CDI spec, and a process
    // of the claim registers with the new driver and is held as before.
    cancel.cancel();
    daemon.await.unwrap().unwrap();
    drop(kubelet);
    let settings = sim_settings(sim.root(), &dirs);
    let (cancel, daemon, kubelet) = run_daemon(&server, &dirs, settings).await;
    let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(again.claims[&claim.uid].error, "");
    assert_eq!(
        cdi::resolve(
            &dirs.p("cdi"),
            &again.claims[&claim.uid].devices[0].cdi_device_ids[0]
        )
        .unwrap(),
        edits,
        "the same spec after the restart"
    );
    let out = run(Command::new(&client)
        .args(["quota", "64"])
        .envs(env.iter().cloned())
        .env_remove("LOGGER_LEVEL"));
    assert_eq!(kv(&out)["start_total"], (5u64 << 30).to_string(), "{out}");
    assert_eq!(kv(&out)["last"], "2", "held after the restart: {out}");

    let u = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(u.claims[&claim.uid].error, "");
    assert!(!dirs.p("vm").join(&claim.uid).exists());
    assert_eq!(sim.state().mig_devices(0).len(), 2, "the instances stay");

    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// An A100 has no GPM, so NVML measures no MIG instance's use: the
/// interposer falls back to the parent's per-process samples, which MIG
/// mode leaves empty. The share's own timed launches (the instance is its
/// alone) then hold it on its quota: 50 ± 3 % of the instance from 3 s on
/// (the blind rule's assumed wave time alone held it at 9.9 %).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gpm_a_share_inside_an_instance_stays_within_its_quota() {
    let sim = SimNode::install("sim-mig-a100");
    // Profile 14 is 2g.10gb on A100 40GB.
    sim.mig(&["--gpu", "0", "--enable", "--create", "14"]);
    let gi = sim.state().mig_devices(0)[0].0.id;
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let settings = sim_settings(sim.root(), &dirs);
    let (cancel, daemon, kubelet) = run_daemon(&server, &dirs, settings).await;
    let uid = share_in(&server, "half-of-2g", "2g.10gb", Some(("50", "2Gi")));
    allocator::allocate(&server, NS, "half-of-2g", NODE).unwrap();
    let claim = plugin::claim(NS, "half-of-2g", &uid);
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let one = &r.claims[&claim.uid];
    assert_eq!(one.error, "");
    let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
    let env = exposed(container_env(&edits));
    let compute = compile_c("shim_compute", &sim, &dirs.p(""));
    let u = busy_of_instance(&sim, gi, &compute, &env, (8.0, 3.0, 7.5));
    println!("a 50 % share inside an A100's 2g.10gb (no GPM) got {u:.1} % of the instance");
    assert!((u - 50.0).abs() <= 3.0, "{u:.1} % of the instance");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// A claim for 50 cores and 4 GiB inside the MIG device of GPU instance
/// `gi`, in compute tier `tier` (the claim's `GpuConfig`).
fn tiered_share_in(server: &ApiServer, name: &str, gi: u32, tier: &str) -> String {
    let selector = format!(
        "device.attributes['{}'].gpuInstance == {gi}",
        dra_driver::DRIVER_NAME
    );
    let request = json!({"deviceClassName": dra_driver::slices::MIG_CLASS,
        "selectors": [{"cel": {"expression": selector}}],
        "capacity": {"requests": {"cores": "50", "memory": "4Gi"}}});
    let params =
        json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "tier": tier});
    let c = server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({"metadata": {"name": name, "namespace": NS},
                   "spec": {"devices": {
                       "requests": [{"name": "mig", "exactly": request}],
                       "config": [{"requests": ["mig"], "opaque": {
                           "driver": dra_driver::DRIVER_NAME, "parameters": params}}]}}}),
        )
        .unwrap();
    uid(&c)
}

/// Compute tiers inside MIG devices (docs/qos.md): a latency share and a
/// batch share inside one 2g.20gb order their launches through that
/// instance's QoS page, so the batch share's launches are held while the
/// latency tenant has work; a batch share inside the other 2g.20gb has a
/// page of its own and is never held (instances are hardware apart, a
/// latency tenant in one waits for nothing in the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_order_the_tenants_of_one_instance_and_no_other() {
    use qos_page::{QosPage, Tier};
    use std::os::fd::AsFd;
    let sim = SimNode::install("sim-mig-h100");
    sim.mig(&["--gpu", "0", "--enable", "--create", "14,14"]);
    let gis: Vec<u32> = sim
        .state()
        .mig_devices(0)
        .iter()
        .map(|(g, _)| g.id)
        .collect();
    let [near, far] = gis[..] else {
        panic!("two instances: {gis:?}")
    };
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let settings = sim_settings(sim.root(), &dirs);
    let (cancel, daemon, kubelet) = run_daemon(&server, &dirs, settings).await;

    let mut envs = Vec::new();
    for (name, gi, tier) in [
        ("lat", near, "latency"),
        ("bat", near, "batch"),
        ("far", far, "batch"),
    ] {
        let uid = tiered_share_in(&server, name, gi, tier);
        allocator::allocate(&server, NS, name, NODE).unwrap();
        let claim = plugin::claim(NS, name, &uid);
        let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
        let one = &r.claims[&claim.uid];
        assert_eq!(one.error, "", "{name}");
        let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
        envs.push((uid, exposed(container_env(&edits))));
    }
    // Each batch share's page and ledger, as a process of it receives them.
    let page_of = |uid: &str| {
        let req = test_support::hostile::maximal_request(uid, "mig");
        let dir = dirs.p("vm").join(uid).join("mig");
        let (_s, r, fds) = test_support::hostile::register(&dir, &req);
        assert_eq!(
            (Tier::from_wire(r.qos_tier), r.qos_page, fds.len()),
            (Tier::Batch, true, 2),
            "a batch share inside an instance gets its tier and a page: {r:?}"
        );
        (
            QosPage::from_fd(fds[1].as_fd()).unwrap(),
            container_ledger::Ledger::from_fd(fds[0].as_fd()).unwrap(),
        )
    };
    let ((_, near), (far_page, far)) = (page_of(&envs[1].0), page_of(&envs[2].0));

    let compute = compile_c("shim_compute", &sim, &dirs.p(""));
    let latency = compile_c("qos_latency", &sim, &dirs.p(""));
    let text = test_support::sim::latency_beside_batches(
        &compute,
        &latency,
        &envs[0].1,
        &[&envs[1].1, &envs[2].1],
    );
    let (held_ns, holds) = (near.qos_held_ns(), near.qos_holds());
    println!(
        "inside one 2g.20gb: batch held {holds} times, {:.1} ms, beside {text}",
        held_ns as f64 / 1e6
    );
    assert!(holds > 0 && held_ns > 0, "the near batch share was held");
    assert_eq!(
        (far.qos_held_ns(), far.qos_holds()),
        (0, 0),
        "the other instance's batch never"
    );
    assert_eq!(far_page.latency_live(), 0);
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// An operator destroys the instance under a prepared claim (`nvidia-smi
/// mig -dci; -dgi` while its pod is between programs: NVML refuses while a
/// process uses it). Within a rescan the kubelet's health stream says the
/// claim's device UNHEALTHY naming the MIG UUID, `/metrics` shows
/// `vcuda_mig_device_lost` for it and the pod the claim is reserved for
/// gets a `VcudaMigDeviceLost` Event; made again with the same ids (the
/// sim's UUIDs follow the ids), all clear. The build before only took the
/// device out of the slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_destroyed_under_a_prepared_claim_is_reported() {
    use dra_api::dra_health::v1alpha1::HealthStatus;
    let sim = SimNode::install("sim-mig-h100");
    sim.mig(&["--gpu", "0", "--enable", "--create", "19"]);
    let state = sim.state();
    let (g, ci) = state.mig_devices(0)[0];
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let settings = dra_driver::daemon::Settings {
        display: Some(dra_driver::daemon::DisplayAt {
            socket: dirs.p("display.sock"),
            http: node_agent::config::Listeners {
                query: "127.0.0.1:0".parse().unwrap(),
                health: None,
                metrics: None,
            },
        }),
        mig_rescan_period: Some(Duration::from_millis(200)),
        ..sim_settings(sim.root(), &dirs)
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(dra_driver::daemon::run(settings, cancel.clone(), Some(tx)));
    let ready = tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .unwrap()
        .unwrap();
    let http = ready.display_http.expect("the display's HTTP address");
    let kubelet = kubelet(&dirs, false).await;
    let slice = dra_driver::slices::slice_name(NODE);
    until(10, "the slice published", || {
        server.get(Kind::ResourceSlice, None, &slice).is_some()
    })
    .await;

    let uid = share_in(&server, "whole-1g", "1g.10gb", None);
    allocator::allocate(&server, NS, "whole-1g", NODE).unwrap();
    let pod = json!({"resource": "pods", "name": "infer", "uid": "u-infer"});
    let reserved = json!({"status": {"reservedFor": [pod]}});
    server
        .patch(Kind::ResourceClaim, Some(NS), "whole-1g", &reserved)
        .unwrap();
    let claim = plugin::claim(NS, "whole-1g", &uid);
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(r.claims[&claim.uid].error, "");
    let device = format!("gpu-0-mig-{}-{}", g.id, ci.id);
    let published = server.get(Kind::ResourceSlice, None, &slice).unwrap();
    let uuid = published["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == device.as_str())
        .and_then(|d| d["attributes"]["uuid"]["string"].as_str())
        .unwrap_or_else(|| panic!("{device} in {published}"))
        .to_string();
    let mut health = kubelet.watch_health().await.unwrap();
    // The claim's device in the stream: (health, message) once it is there.
    let mut next = async || plugin::next_device_health(&mut health, NODE, &device).await;
    assert_eq!(next().await.0, HealthStatus::Healthy as i32);
    let metric = || {
        let (_, text) = test_support::process::http_get(http, "/metrics");
        text.lines()
            .find(|l| l.starts_with("vcuda_mig_device_lost{"))
            .map(str::to_string)
    };
    assert_eq!(metric(), None);

    state.destroy_compute_instance(0, g.id, ci.id).unwrap();
    state.destroy_gpu_instance(0, g.id).unwrap();
    let (h, message) = next().await;
    assert_eq!(h, HealthStatus::Unhealthy as i32, "{message}");
    assert!(
        message.contains(&uuid) && message.contains("destroyed") && message.contains("whole-1g"),
        "{message}"
    );
    until(10, "vcuda_mig_device_lost", || {
        metric().is_some_and(|l| {
            l.contains(&uuid)
                && l.contains(&format!("holder=\"{NS}/whole-1g\""))
                && l.ends_with(" 1")
        })
    })
    .await;
    until(10, "the VcudaMigDeviceLost event", || {
        server.list(Kind::Event).iter().any(|e| {
            e["reason"] == "VcudaMigDeviceLost"
                && e["regarding"]["name"] == "infer"
                && e["note"].as_str().is_some_and(|n| n.contains(&uuid))
        })
    })
    .await;

    let again = state.create_gpu_instance(0, g.profile.id, Some(g.placement));
    assert_eq!(again.unwrap().id, g.id);
    let whole = g
        .profile
        .ci_profiles()
        .find(|c| c.slices == g.profile.slices);
    let made = state.create_compute_instance(0, g.id, whole.unwrap().index, None);
    assert_eq!(made.unwrap().id, ci.id);
    assert_eq!(next().await.0, HealthStatus::Healthy as i32);
    until(10, "vcuda_mig_device_lost gone", || metric().is_none()).await;

    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// Memory requests below limits inside a MIG device (docs/qos.md,
/// "Memory"; docs/mig.md), DRA mode: a 4 GiB claim of the 2g.20gb with
/// `memoryLimit: 16Gi` sees its limit as the card and fills 13 GiB; a
/// guaranteed 8 GiB claim of the same instance then allocates 7 GiB, for
/// which only the borrower's lent memory can make room: the borrower's
/// process is ended saying why, the guaranteed allocation succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_inside_a_mig_device_is_reclaimed_for_a_guaranteed_claim() {
    use std::os::unix::process::ExitStatusExt;
    use test_support::process::{field, hold, release};
    let sim = SimNode::install("sim-mig-h100");
    sim.mig(&["--gpu", "0", "--enable", "--create", "14,19"]);
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let (cancel, daemon, kubelet) =
        run_daemon(&server, &dirs, sim_settings(sim.root(), &dirs)).await;
    let limit = json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig",
        "memoryLimit": "16Gi"});
    // The borrower's claim first: the guaranteed one comes once it has
    // borrowed (prepared before, its guarantee leaves too little to lend).
    let prepare = |name: &'static str, memory: &'static str, params: Option<serde_json::Value>| {
        let (server, dirs, kubelet) = (&server, &dirs, &kubelet);
        async move {
            let uid = share_in_with(server, name, "2g.20gb", Some(("30", memory)), params);
            allocator::allocate(server, NS, name, NODE).unwrap();
            let claim = plugin::claim(NS, name, &uid);
            let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
            let one = &r.claims[&claim.uid];
            assert_eq!(one.error, "", "{name}");
            let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
            exposed(container_env(&edits))
        }
    };
    let borrow = prepare("borrow", "4Gi", Some(limit)).await;
    let exe = compile_c("hold_memory", &sim, &dirs.p(""));
    let in_claim = |env: &[(String, String)]| {
        let mut c = Command::new(&exe);
        c.envs(env.iter().cloned()).env_remove("LOGGER_LEVEL");
        c
    };
    let (probe, line) = hold(&mut in_claim(&borrow), 1024);
    assert_eq!(
        field(&line, "total_mib"),
        16384,
        "its limit as the card: {line}"
    );
    release(probe);
    let (mut borrower, line) = hold(&mut in_claim(&borrow), 13 * 1024);
    assert!(
        line.starts_with("pid="),
        "borrowing 9+ GiB inside the instance: {line}"
    );
    let guaranteed = prepare("guaranteed", "8Gi", None).await;
    let (g, line) = tokio::task::block_in_place(|| hold(&mut in_claim(&guaranteed), 7 * 1024));
    assert!(
        line.starts_with("pid="),
        "the guaranteed allocation: {line}"
    );
    println!(
        "DRA, inside a 2g.20gb: the guaranteed 7 GiB allocated with one reclaim in {} us",
        field(&line, "alloc_us")
    );
    let status = borrower.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let err = std::io::read_to_string(borrower.stderr.take().unwrap()).unwrap();
    assert!(err.contains("was ended to reclaim GPU memory"), "{err}");
    release(g);
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}
