//! Device-plugin mode on the same node (kubelet ≥ 1.34, so DaemonSet surge
//! and kubelet ≥ 1.26's device-plugin registration handling): the manager's
//! DaemonSet from deploy/overlays/share (maxSurge 1) under two rolling
//! updates while pods asking for shares are created. Issue 24: all Running
//! within 5 s (p99), none refused, the running share not restarted and a
//! new process in it still held to its quota; each new manager took the
//! node's state over from the old one.

use serde_json::Value;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};
use test_support::k8s::util::{tail, wait};
use test_support::workspace_root;

use crate::parts::*;
use crate::windows;

const IMAGE: &str = "docker.io/vcuda-test/gpu-manager:local";
const LABEL: &str = "nvidia-device-enable";

/// The manager's pods, those not being deleted.
fn manager_pods(n: &Node) -> Result<Vec<Value>, String> {
    let v = n.json(&[
        "-n",
        "kube-system",
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=gpu-manager",
    ])?;
    Ok(v["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .collect())
}

fn ready_manager(n: &Node) -> Result<String, String> {
    let pods = manager_pods(n)?;
    let ready: Vec<&Value> = pods
        .iter()
        .filter(|p| {
            p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .collect();
    match ready[..] {
        [p] => Ok(p["metadata"]["name"].as_str().unwrap_or_default().into()),
        _ => Err(format!(
            "{} Ready manager pods of {}",
            ready.len(),
            pods.len()
        )),
    }
}

/// Removes the overlay and the label (also when the phase fails).
struct Cleanup<'a>(&'a Node, String);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .kubectl(&["label", "node", &self.1, &format!("{LABEL}-")]);
        let share = workspace_root().join("deploy/overlays/share");
        let _ = self.0.kubectl(&[
            "delete",
            "-k",
            share.to_str().unwrap(),
            "--ignore-not-found",
            "--wait=true",
        ]);
    }
}

pub fn device_plugin_phase(n: &Node, node: &str, w: &Path, sim: &Path, bin: &Path) {
    eprintln!("k8s_dra: device-plugin mode, deploy/overlays/share, rolling updates with surge");
    let etc = Path::new("/etc/gpu-manager");
    let _etc = test_support::k8s::util::Cleanup((!etc.exists()).then(|| etc.to_path_buf()));
    let _cleanup = Cleanup(n, node.to_string());
    let root = test_support::k8s::cluster::daemon_rootfs(w, "gpu-manager");
    import(n, IMAGE, &root, "/usr/bin/gpu-manager");
    let deploy = workspace_root().join("deploy");
    n.ok(&[
        "apply",
        "-k",
        deploy.join("overlays/share").to_str().unwrap(),
    ]);
    let server = n.ok(&[
        "config",
        "view",
        "--raw",
        "-o",
        "jsonpath={.clusters[0].cluster.server}",
    ]);
    let (host, port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .expect("https://host:port");
    let patch = fs::read_to_string(deploy.join("test/daemonset-sim-patch.yaml"))
        .unwrap()
        .replace("@SIM_ROOT@", sim.to_str().unwrap())
        .replace("@API_HOST@", host)
        .replace("@API_PORT@", port)
        .replace(
            "@CONTAINERD_DIR@",
            n.containerd.parent().unwrap().to_str().unwrap(),
        );
    n.ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "gpu-manager",
        "--type",
        "strategic",
        "-p",
        &patch,
    ]);
    n.ok(&[
        "label",
        "node",
        node,
        &format!("{LABEL}=enable"),
        "--overwrite",
    ]);
    let first = wait("the manager's DaemonSet pod Ready", 180, || {
        ready_manager(n)
    });
    let logs = |pod: &str| {
        n.kubectl(&["-n", "kube-system", "logs", pod])
            .unwrap_or_default()
    };
    wait("the manager registered with the kubelet", 60, || {
        let l = logs(&first);
        if l.contains("step 6/6") {
            Ok(())
        } else {
            Err(tail(&l, 5))
        }
    });
    let _ = n.kubectl(&["create", "namespace", NS]);
    let quota = "/work/shim_client quota 256; echo ---done; sleep 100000";
    n.apply(&share_pod("dp-share", 30, 4, quota, bin, sim));
    wait_running(n, "dp-share", 120);
    check_quota(&log_with(n, "dp-share", "---done"), "dp-share");

    // The same pods with nothing going on: what the windows compare with.
    windows::pods_during(
        n,
        "no update (baseline)",
        "dp-quiet",
        |p| share_pod(p, 5, 1, "sleep 100000", bin, sim),
        10,
        Duration::from_millis(400),
        || {},
        240,
    );
    windows::delete_pods(n, "dp-quiet", 10);
    let mut updates = Vec::new();
    for k in 0..2 {
        let before = ready_manager(n).unwrap();
        let t0 = Instant::now();
        let prefix = format!("dp-roll-{k}");
        let win = windows::pods_during(
            n,
            "a rolling update of the manager's DaemonSet",
            &prefix,
            |p| share_pod(p, 5, 1, "sleep 100000", bin, sim),
            10,
            Duration::from_millis(400),
            || {
                n.ok(&[
                    "-n",
                    "kube-system",
                    "rollout",
                    "restart",
                    "daemonset/gpu-manager",
                ]);
            },
            240,
        );
        n.ok(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "daemonset/gpu-manager",
            "--timeout=180s",
        ]);
        let after = wait("one Ready manager pod after the update", 120, || {
            let p = ready_manager(n)?;
            if p != before && manager_pods(n)?.len() == 1 {
                Ok(p)
            } else {
                Err(format!("{p}, {} pods", manager_pods(n)?.len()))
            }
        });
        let l = logs(&after);
        eprintln!(
            "k8s_dra: manager rolling update {k}: {before} -> {after} in {:.1} s; {}",
            t0.elapsed().as_secs_f64(),
            l.lines()
                .find(|l| l.contains("handed the node over"))
                .unwrap_or("no handover line")
        );
        assert!(
            l.contains("the previous manager handed the node over")
                && l.contains("kept kubelet's connections to the previous manager open"),
            "the new manager took the state and kubelet's connections over from the old one:\n{}",
            tail(&l, 30)
        );
        // Kubelet's streams to the old one stayed open, so it never dropped
        // the new registration.
        assert!(
            !l.contains("kubelet dropped this registration"),
            "kubelet dropped the new manager's registration:\n{}",
            tail(&l, 30)
        );
        updates.push(win);
        windows::delete_pods(n, &prefix, 10);
    }
    let all = windows::Window::combined("2 rolling updates of the manager's DaemonSet", updates);
    let share = n.json(&["-n", NS, "get", "pod", "dp-share"]).unwrap();
    assert_eq!(
        share["status"]["containerStatuses"][0]["restartCount"], 0,
        "the share's pod was not restarted"
    );
    let again = n.ok(&[
        "-n",
        NS,
        "exec",
        "dp-share",
        "--",
        "/work/shim_client",
        "quota",
        "256",
    ]);
    check_quota(&again, "dp-share after two rolling updates");
    all.assert_running_within(5000);
    n.ok(&["delete", "namespace", NS, "--wait=true", "--timeout=120s"]);
}
