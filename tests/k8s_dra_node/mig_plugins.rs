//! MIG on the real node (issue 36), device-plugin mode: after the DRA
//! phase (`mig.rs`), the real `gpu-manager` binary on the host serves the
//! same simulated H100's instances as NVIDIA's `mixed` strategy does, one
//! resource per profile (`tencent.com/mig-3g.40gb`, …). The real kubelet
//! admits pods asking one by name; the manager's Allocate gives the
//! instance's nodes, `NVIDIA_VISIBLE_DEVICES=MIG-…` and the untouched
//! driver. The same two pods as in DRA mode (`mig::whole_instances`) see
//! exactly their instance and keep it busy side by side; an instance
//! destroyed under a pod stays advertised Unhealthy and the pod is told;
//! deleting them and stopping the manager leaves the instances.

use std::path::Path;

use crate::mig::{destroy_instance, lost_event, lost_metric, make_again, whole_instances};
use crate::parts::*;
use test_support::k8s::util::{get_u64, wait};
use test_support::kv;

const PROFILES: [&str; 3] = ["3g.40gb", "2g.20gb", "1g.10gb"];

fn manager(n: &Node, node: &str, w: &Path, sim: &Path) -> DriverProc {
    let p = |s: &str| w.join(s).to_str().unwrap().to_string();
    let runtime = format!("unix://{}", n.containerd.display());
    let args = [
        "--share-mode",
        "--hostname-override",
        node,
        "--kubeconfig",
        n.kubeconfig.to_str().unwrap(),
        "--vdriver-path",
        &p("mig-mgr/vdriver"),
        "--virtual-manager-path",
        &p("mig-mgr/vm"),
        "--checkpoint-path",
        &p("mig-mgr/checkpoint"),
        "--display-socket",
        &p("mig-mgr/display.sock"),
        "--query-port",
        "25682",
        "--container-runtime",
        "containerd",
        "--container-runtime-endpoint",
        &runtime,
    ];
    DriverProc {
        child: None,
        log: w.join("mig-manager.log"),
        args: crate::mig::sim_flags(sim)
            .into_iter()
            .chain(args.iter().map(|s| s.to_string()))
            .collect(),
    }
}

pub fn mig_plugins_phase(
    n: &Node,
    node: &str,
    w: &Path,
    bin: &Path,
    sim: &Path,
    state: &gpu_sim_core::SharedState,
) {
    eprintln!("k8s_dp: MIG devices by resource name, gpu-manager on the host (sim-mig-h100)");
    let _ = std::fs::remove_dir_all(w.join("mig-mgr"));
    let mut mgr = manager(n, node, w, sim);
    mgr.spawn_program("gpu-manager");
    let resource = |p: &str| format!("tencent.com/mig-{p}");
    wait("the node to advertise one of each MIG profile", 90, || {
        let s = n.json(&["get", "node", node])?;
        let a = &s["status"]["allocatable"];
        let counts: Vec<String> = PROFILES
            .iter()
            .map(|p| a[resource(p)].as_str().unwrap_or("none").to_string())
            .collect();
        if counts.iter().all(|c| c == "1") {
            Ok(())
        } else {
            Err(format!(
                "allocatable {counts:?} for {PROFILES:?}; manager: {}",
                test_support::k8s::util::tail(&mgr.text(), 5)
            ))
        }
    });
    let pods = whole_instances(n, "k8s_dp", state, |name, profile, cmd| {
        let limits = format!("limits: {{{}: \"1\"}}", resource(profile));
        pod_with_limits(name, &limits, cmd, bin, sim)
    });
    destroyed_under_a_pod(n, node, state, "mig-1g-10gb", &mgr);
    for p in &pods {
        n.ok(&["-n", NS, "delete", "pod", p, "--wait=true"]);
    }
    mgr.kill9();
    assert_eq!(state.mig_devices(0).len(), 3, "the instances stay");
    shared(n, node, w, bin, sim, state);
    dynamic(n, node, w, bin, sim, state);
}

/// A vcuda share inside an instance in device-plugin mode (docs/mig.md):
/// the manager again with `--mig-shared-profiles 2g.20gb`; the node counts
/// the 2g.20gb's 100 `vcuda-core` beside GPU 1's, and a pod annotated
/// `tencent.com/vcuda-mig-profile: 2g.20gb` with 50 cores and 20 units,
/// admitted by the real kubelet's Allocate, sees a 5 GiB card inside the
/// instance, is refused past it and gets half the instance's time.
fn shared(
    n: &Node,
    node: &str,
    w: &Path,
    bin: &Path,
    sim: &Path,
    state: &gpu_sim_core::SharedState,
) {
    let _ = std::fs::remove_dir_all(w.join("mig-mgr"));
    let mut mgr = manager(n, node, w, sim);
    mgr.args
        .extend(["--mig-shared-profiles", "2g.20gb"].map(String::from));
    mgr.spawn_program("gpu-manager");
    wait("vcuda-core counting the shared 2g.20gb", 90, || {
        let s = n.json(&["get", "node", node])?;
        let got = s["status"]["allocatable"]["tencent.com/vcuda-core"]
            .as_str()
            .unwrap_or("none")
            .to_string();
        if got == "200" {
            Ok(())
        } else {
            Err(format!(
                "allocatable vcuda-core {got}; manager: {}",
                test_support::k8s::util::tail(&mgr.text(), 5)
            ))
        }
    });
    let cmd = "CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES /work/shim_client quota 256; \
        echo ---quota; /work/shim_compute saturate 7; echo ---done; sleep 100000";
    let limits = "limits: {tencent.com/vcuda-core: \"50\", tencent.com/vcuda-memory: \"20\"}";
    let pod = pod_with_limits("mig-dp-share", limits, cmd, bin, sim).replacen(
        "namespace: ",
        "annotations: {tencent.com/vcuda-mig-profile: 2g.20gb}, namespace: ",
        1,
    );
    let load = test_support::k8s::host_load::HostLoad::measure(
        "the share in the 2g.20gb (device plugins)",
    );
    n.apply(&pod);
    wait_running(n, "mig-dp-share", 120);
    let out = log_with(n, "mig-dp-share", "---quota");
    let a = kv(&out);
    let get = |k: &str| get_u64(&a, k, &out);
    assert_eq!(get("start_total"), 5 << 30, "a 5 GiB card\n{out}");
    assert_eq!(get("last"), 2, "refused past 5 GiB (OOM)\n{out}");
    let head = log_with(n, "mig-dp-share", "start_ns=");
    let start = get_u64(&kv(&head), "start_ns", &head);
    let (from, to) = (start + 2_000_000_000, start + 6_000_000_000);
    let now = test_support::shim::simnode::now_ns();
    std::thread::sleep(std::time::Duration::from_nanos(
        to.saturating_sub(now) + 50_000_000,
    ));
    let u = state.gi_utilization(0, crate::mig::gi_of(state, "2g.20gb"), from, to);
    drop(load);
    eprintln!(
        "k8s_dp: a 50 % / 5 GiB share inside the 2g.20gb through the device plugins: 5 GiB card, {u:.1} % of the instance"
    );
    assert!((42.0..=58.0).contains(&u), "{u:.1} % of the 2g.20gb");
    log_with(n, "mig-dp-share", "---done");
    n.ok(&["-n", NS, "delete", "pod", "mig-dp-share", "--wait=true"]);
    mgr.kill9();
    assert_eq!(state.mig_devices(0).len(), 3, "the instances stay");
}

/// Dynamic MIG on the real node (docs/mig.md): the manager again, GPU 1
/// (whole, idle) named `--mig-dynamic`. A pod asking a 7g.80gb, which no
/// node has, is marked Unschedulable by the real scheduler; the manager
/// makes the instance, the kubelet advertises it, the scheduler's next try
/// places the pod, which sees the instance's 81152 MiB (NVIDIA's H100 table). Deleted, its
/// instance goes after the grace period (10 s) and the node advertises none.
fn dynamic(
    n: &Node,
    node: &str,
    w: &Path,
    bin: &Path,
    sim: &Path,
    state: &gpu_sim_core::SharedState,
) {
    let mut mgr = manager(n, node, w, sim);
    mgr.args.extend(
        [
            "--mig-dynamic",
            "1",
            "--mig-rescan-period",
            "2",
            "--mig-dynamic-grace",
            "10",
        ]
        .map(String::from),
    );
    mgr.spawn_program("gpu-manager");
    let resource = "tencent.com/mig-7g.80gb";
    let cmd = "CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES /work/shim_client quota 256; \
        echo ---done; sleep 100000";
    let t0 = std::time::Instant::now();
    n.apply(&pod_with_limits(
        "mig-dynamic",
        &format!("limits: {{{resource}: \"1\"}}"),
        cmd,
        bin,
        sim,
    ));
    // The sim makes the new instance's capability nodes under its root, as
    // the driver does; containerd reads the host's /dev: mirrored there
    // once the instance exists (the phase's start did it for the others).
    let caps = std::cell::RefCell::new(None);
    wait("the pod asking a 7g.80gb Running", 120, || {
        if caps.borrow().is_none() && !state.mig_devices(1).is_empty() {
            *caps.borrow_mut() = Some(crate::mig::host_cap_nodes(sim));
        }
        let p = n.json(&["-n", NS, "get", "pod", "mig-dynamic"])?;
        if p["status"]["phase"] == "Running" {
            Ok(())
        } else {
            Err(format!(
                "status {}; GPU 1 instances {}; manager: {}",
                p["status"],
                state.mig_devices(1).len(),
                test_support::k8s::util::tail(&mgr.text(), 12)
            ))
        }
    });
    let out = log_with(n, "mig-dynamic", "---done");
    let total = get_u64(&kv(&out), "start_total", &out);
    assert_eq!(total, 81152 << 20, "the H100's 7g.80gb made for it\n{out}");
    let events = n.kubectl(&[
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=mig-dynamic",
        "-o",
        "custom-columns=R:.reason",
        "--no-headers",
    ]);
    eprintln!(
        "k8s_dp: a pod asking a 7g.80gb no node had: made on GPU 1 and the pod running in {:.1} s (events: {})",
        t0.elapsed().as_secs_f64(),
        events
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(",")
    );
    n.ok(&["-n", NS, "delete", "pod", "mig-dynamic", "--wait=true"]);
    let t1 = std::time::Instant::now();
    wait("the made instance destroyed and withdrawn", 60, || {
        let s = n.json(&["get", "node", node])?;
        let a = s["status"]["allocatable"][resource]
            .as_str()
            .unwrap_or("none")
            .to_string();
        let left = state.mig_devices(1).len();
        if a == "0" && left == 0 {
            Ok(())
        } else {
            Err(format!(
                "allocatable {a}, {left} instance(s) on GPU 1; manager: {}",
                test_support::k8s::util::tail(&mgr.text(), 5)
            ))
        }
    });
    eprintln!(
        "k8s_dp: its pod deleted: the instance destroyed and the node advertising none {:.1} s after (grace 10 s)",
        t1.elapsed().as_secs_f64()
    );
    mgr.kill9();
}

/// An operator destroys the 1g.10gb under `pod` (its program done): the
/// manager keeps advertising it, Unhealthy (allocatable 0), and the pod gets
/// a `VcudaMigDeviceLost` Event naming the device; made again (same UUID
/// in the sim), it is allocatable again.
fn destroyed_under_a_pod(
    n: &Node,
    node: &str,
    state: &gpu_sim_core::SharedState,
    pod: &str,
    mgr: &DriverProc,
) {
    let resource = "tencent.com/mig-1g.10gb";
    let counts = |want: (&str, &str)| {
        let s = n.json(&["get", "node", node])?;
        let got = (
            s["status"]["capacity"][resource].as_str().unwrap_or("none"),
            s["status"]["allocatable"][resource]
                .as_str()
                .unwrap_or("none"),
        );
        if got == want {
            Ok(())
        } else {
            Err(format!(
                "{resource} capacity, allocatable {got:?}; manager: {}",
                test_support::k8s::util::tail(&mgr.text(), 5)
            ))
        }
    };
    let g = destroy_instance(state, "1g.10gb");
    let t0 = std::time::Instant::now();
    let ev = lost_event(n, pod);
    let note = ev["message"].as_str().unwrap_or_default();
    let uuid = gpu_sim_core::mig::mig_uuid(&state.node().gpus[0].uuid, g.id, 0);
    assert!(note.contains("destroyed") && note.contains(&uuid), "{ev}");
    wait("the lost device advertised Unhealthy", 30, || {
        counts(("1", "0"))
    });
    let metrics = "127.0.0.1:25682";
    wait("vcuda_mig_device_lost", 30, || {
        lost_metric(metrics, &uuid, true)
    });
    eprintln!(
        "k8s_dp: {pod}'s instance destroyed: an Event and the device Unhealthy in {:.1} s (rescan period 10 s)",
        t0.elapsed().as_secs_f64()
    );
    make_again(state, &g);
    wait("the instance made again, allocatable", 30, || {
        counts(("1", "1"))
    });
    wait("vcuda_mig_device_lost gone", 30, || {
        lost_metric(metrics, &uuid, false)
    });
}
