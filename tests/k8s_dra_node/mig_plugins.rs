//! MIG on the real node (issue 36), device-plugin mode: after the DRA
//! phase (`mig.rs`), the real `gpu-manager` binary on the host serves the
//! same simulated H100's instances as NVIDIA's `mixed` strategy does, one
//! resource per profile (`tencent.com/mig-3g.40gb`, …). The real kubelet
//! admits pods asking one by name; the manager's Allocate gives the
//! instance's nodes, `NVIDIA_VISIBLE_DEVICES=MIG-…` and the untouched
//! driver. The same two pods as in DRA mode (`mig::whole_instances`) see
//! exactly their instance and keep it busy side by side; deleting them and
//! stopping the manager leaves the instances.

use std::path::Path;

use crate::mig::whole_instances;
use crate::parts::*;
use test_support::k8s::util::wait;

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
    for p in &pods {
        n.ok(&["-n", NS, "delete", "pod", p, "--wait=true"]);
    }
    mgr.kill9();
    assert_eq!(state.mig_devices(0).len(), 3, "the instances stay");
}
