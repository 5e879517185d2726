//! Phase 3: `deploy/` applied as users apply it, with the test overlay; the
//! DaemonSet under the RBAC authorizer, a share served, its manager pod
//! deleted and recovered, a refusal as a Warning Event.

use std::fs;
use std::time::Instant;
use test_support::k8s::cluster::{Cluster, Work, manager_image, pod_yaml};
use test_support::k8s::util::{UNIT, get_u64, tail, wait};
use test_support::kv;
use test_support::workspace_root;

/// deploy/ copied into the cluster's work directory with the test overlay's
/// placeholders filled in (`deploy/test/daemonset-sim-patch.yaml`, the
/// uninstaller's); the copy.
pub fn prepare_test_overlay(c: &Cluster, w: &Work) -> std::path::PathBuf {
    let copy = c.dir.join("work/deploy");
    let _ = fs::remove_dir_all(&copy);
    let st = std::process::Command::new("cp")
        .args(["-r"])
        .arg(workspace_root().join("deploy"))
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success(), "copying deploy/ to {}", copy.display());
    for patch in [
        "test/daemonset-sim-patch.yaml",
        "test/uninstall/uninstall-sim-patch.yaml",
    ] {
        let patch = copy.join(patch);
        let text = fs::read_to_string(&patch)
            .unwrap()
            .replace("@SIM_ROOT@", w.sim.to_str().unwrap())
            .replace("@API_HOST@", &c.flavor.node_ip(1))
            .replace("@API_PORT@", &c.flavor.api_port().to_string())
            .replace(
                "@CONTAINERD_DIR@",
                c.dir.join("containerd").to_str().unwrap(),
            );
        fs::write(&patch, text).unwrap();
    }
    // The test overlay is written over 1.20's overlay; a newer node gets
    // the one its users apply.
    let k = copy.join("test/kustomization.yaml");
    let text = fs::read_to_string(&k).unwrap();
    let base = "../overlays/share-before-1.22";
    assert!(
        text.contains(base),
        "{} no longer names {base}",
        k.display()
    );
    let overlay = format!("../{}", c.flavor.share_overlay());
    fs::write(&k, text.replace(base, &overlay)).unwrap();
    copy
}

/// `kubectl apply -k` of the prepared copy's `test/`:
/// deploy/overlays/share-before-1.22 (`share` on a modern node) plus the patch, installed as an
/// operator installs an overlay of their own.
fn apply_test_overlay(c: &Cluster, w: &Work) -> std::path::PathBuf {
    let copy = prepare_test_overlay(c, w);
    c.kubectl_ok(&["apply", "-k", copy.join("test").to_str().unwrap()]);
    copy.join("test")
}

/// Phase 3 (the caller prints its banner and removes /etc/gpu-manager after).
pub fn run(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    let quota = 8 * UNIT;
    manager_image(c, &c.dir.join("work"));
    let overlay = apply_test_overlay(c, w);
    let t_ds = Instant::now();
    c.kubectl_ok(&[
        "label",
        "node",
        &c.node,
        "nvidia-device-enable=enable",
        "--overwrite",
    ]);
    let mgr_pod = ds_ready_pod(c, None);
    let ds_ready = t_ds.elapsed();
    figures.push(format!(
        "DaemonSet: pod Ready {:.2} s after the node was labelled (image built locally, RBAC authorizer)",
        ds_ready.as_secs_f64()
    ));
    c.wait_allocatable("resources from the DaemonSet's manager", (400, 240), 120);
    // A share served by it, which then stays, holding memory.
    c.apply(&pod_yaml(
        w,
        "ds-share",
        30,
        8,
        "/work/shim_client quota 256 && echo --- && /work/cudart_loader 256 && echo --- \
         && sleep 1000000 | /work/shim_client hold 64",
        "",
    ));
    let share = c.wait_phase("ds-share", &["Running"], 120);
    let log = wait("ds-share's programs done and holding", 120, || {
        let l = c.logs("ds-share");
        if l.contains("holding pid=") {
            Ok(l)
        } else {
            Err(l)
        }
    });
    let parts: Vec<&str> = log.split("---").collect();
    let (lcuda, cudart) = (parts[0], parts[1]);
    assert_eq!(get_u64(&kv(lcuda), "start_total", &log), quota, "{log}");
    assert_eq!(get_u64(&kv(lcuda), "last", &log), 2, "{log}");
    assert_eq!(get_u64(&kv(cudart), "total", &log), quota, "{log}");
    assert_eq!(get_u64(&kv(cudart), "last", &log), 2, "{log}");

    // The manager's pod deleted: the DaemonSet's new pod recovers the live
    // share (checkpoint on the host path, kubelet, API server, containerd
    // through CRI) and its process registers again.
    let share_uid = share["metadata"]["uid"].as_str().unwrap().to_string();
    let t_re = Instant::now();
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "delete",
        "pod",
        &mgr_pod,
        "--wait=false",
    ]);
    // The DaemonSet makes the new pod once kubelet has removed the old one.
    wait("the DaemonSet's new pod", 240, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager",
        ])?;
        let names: Vec<String> = l["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
            .collect();
        if names.iter().any(|n| *n != mgr_pod) {
            Ok(())
        } else {
            Err(format!("{names:?}"))
        }
    });
    let t_new = t_re.elapsed();
    let mgr_pod = ds_ready_pod(c, Some(&mgr_pod));
    let re_ready = t_re.elapsed().saturating_sub(t_new);
    let mlog_of = |pod: &str| {
        c.kubectl(&["-n", "kube-system", "logs", pod])
            .unwrap_or_default()
    };
    let rec = wait("the new manager pod's recovery line", 60, || {
        let l = mlog_of(&mgr_pod);
        l.lines()
            .find(|l| l.contains("recovery finished"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    let rk = kv(&rec);
    assert!(
        rk.get("kept").is_some_and(|k| k == "1")
            && rk.get("unreachable").is_some_and(|u| u == "[]"),
        "the new manager pod kept the live share, every source reachable: {rec}"
    );
    wait(
        "ds-share's process registered with the new manager pod",
        60,
        || {
            let l = mlog_of(&mgr_pod);
            if l.lines()
                .any(|l| l.contains("interposer registered") && l.contains(&share_uid))
            {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    let out = c.kubectl_ok(&["exec", "ds-share", "--", "/work/shim_client", "quota", "64"]);
    assert_eq!(get_u64(&kv(&out), "start_total", &out), quota, "{out}");
    figures.push(format!(
        "DaemonSet pod deleted with a live share: the new pod created {:.2} s after the delete (kubelet removing the old one), Ready {:.2} s after that ({rec_ms}), the share's process registered again",
        t_new.as_secs_f64(),
        re_ready.as_secs_f64(),
        rec_ms = rk.get("recovery_ms").map(|v| format!("recovery_ms={v}")).unwrap_or_default()
    ));
    // A refused request becomes a Warning Event on the pod (events.k8s.io/v1
    // create, the ClusterRole's only events verb).
    c.apply(&pod_yaml(w, "refused", 30, 0, "true", ""));
    let ev = wait(
        "a VcudaAllocateFailed Warning Event on pod refused",
        120,
        || {
            let l = c.json(&["events.v1.events.k8s.io", "-n", "default"])?;
            l["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| {
                    e["reason"] == "VcudaAllocateFailed" && e["regarding"]["name"] == "refused"
                })
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "events: {}",
                        l["items"]
                            .as_array()
                            .map(|a| a
                                .iter()
                                .map(|e| e["reason"].to_string())
                                .collect::<Vec<_>>()
                                .join(","))
                            .unwrap_or_default()
                    )
                })
        },
    );
    assert_eq!(ev["type"], "Warning", "{ev}");
    let mlog = c
        .kubectl(&["-n", "kube-system", "logs", &mgr_pod])
        .unwrap_or_default();
    for l in mlog.lines().filter(|l| {
        l.contains(" WARN ")
            || l.contains(" ERROR ")
            || l.contains("container runtime for recovery")
            || l.contains("recovery finished")
    }) {
        eprintln!("k8s_node: DaemonSet manager: {l}");
    }
    assert!(
        !mlog.contains("no container runtime socket"),
        "the DaemonSet's manager found no runtime (the overlay mounts the node's containerd at /run/containerd):\n{}",
        tail(&mlog, 40)
    );
    assert!(
        !mlog.contains("forbidden") && !mlog.contains("Forbidden"),
        "the manager was refused by the RBAC authorizer:\n{}",
        tail(&mlog, 40)
    );
    // Phase 3b: upgrade and rollback with ds-share live (one share).
    crate::upgrade::run(c, w, &overlay, 1, figures);
    // Phase 3d: a node reboot; phase 3c: uninstall, with ds-always live.
    crate::reboot::run(c, w, figures);
    crate::uninstall::run(c, &overlay, crate::reboot::LIVE, figures);
    // Phase 3e: the same DaemonSet from the Helm chart.
    crate::helm::run(c, w, overlay.parent().unwrap(), figures);
}

/// The DaemonSet's Ready pod (another than `not`).
pub fn ds_ready_pod(c: &Cluster, not: Option<&str>) -> String {
    wait("the DaemonSet's pod Ready", 240, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager",
        ])?;
        let items = l["items"].as_array().cloned().unwrap_or_default();
        for p in &items {
            let name = p["metadata"]["name"].as_str().unwrap_or("");
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if ready && Some(name) != not {
                return Ok(name.to_string());
            }
        }
        Err(items
            .iter()
            .map(|p| p["status"].to_string())
            .collect::<Vec<_>>()
            .join("\n"))
    })
}
