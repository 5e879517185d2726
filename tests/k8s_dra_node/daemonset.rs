//! The DRA real-node test's DaemonSet phase (tests/k8s_dra_node/main.rs):
//! deploy/overlays/dra as users apply it, two rolling updates with pods
//! created meanwhile, an optional node reboot, then the uninstall drill.

use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use test_support::k8s::util::{tail, wait};
use test_support::workspace_root;

use crate::parts::*;
use crate::windows;

/// deploy/dra/driver.yaml applied as users apply it, with the test overlay
/// (local image, host paths of the simulated root): the DaemonSet Ready
/// under the RBAC authorizer with only its ClusterRole's verbs, a share
/// served, nothing forbidden in its log, everything removed after.
pub fn daemonset_phase(n: &Node, node: &str, w: &Path, sim: &Path, bin: &Path) {
    eprintln!("k8s_dra: deploy/dra/driver.yaml under RBAC");
    let etc = Path::new("/etc/gpu-manager");
    let _etc = test_support::k8s::util::Cleanup((!etc.exists()).then(|| etc.to_path_buf()));
    let ds = DaemonSetCleanup {
        n,
        node: node.to_string(),
    };
    let root = test_support::k8s::cluster::daemon_rootfs(w, "vcuda-dra-driver");
    import(n, DRA_IMAGE, &root, "/usr/bin/vcuda-dra-driver");
    let (host, port) = install_overlay(
        n,
        "overlays/dra",
        DRIVER_APP,
        "dra-driver-sim-patch.yaml",
        sim,
    );
    let t0 = Instant::now();
    n.ok(&[
        "label",
        "node",
        node,
        "vcuda.tencent.com/mode=dra",
        "--overwrite",
    ]);
    wait("the driver's DaemonSet pod Ready", 180, || {
        let pods = n.driver_pods()?;
        for p in &pods {
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if ready {
                return Ok(p["metadata"]["name"].as_str().unwrap().to_string());
            }
        }
        Err(pods
            .iter()
            .map(|p| p["status"].to_string())
            .collect::<Vec<_>>()
            .join("; "))
    });
    eprintln!(
        "k8s_dra: DaemonSet pod Ready {:.2} s after the node was labelled",
        t0.elapsed().as_secs_f64()
    );
    let logs = || {
        let name = n.ready_pod(DRIVER_APP).unwrap_or_default();
        n.kubectl(&["-n", "kube-system", "logs", &name])
            .unwrap_or_default()
    };
    wait(
        "the DaemonSet's driver registered with the kubelet",
        60,
        || {
            let l = logs();
            if l.contains("registered with the kubelet") {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    n.ok(&["create", "namespace", NS]);
    n.apply(&claim_template("gpu-30-1g", 30, "1Gi"));
    n.apply(&pod(
        "ds-share",
        "gpu-30-1g",
        "/work/shim_client quota 256; echo ---done; sleep 100000",
        bin,
        sim,
    ));
    wait_running(n, "ds-share", 120);
    check_quota(&log_with(n, "ds-share", "---done"), "ds-share");
    rolling_update(n, bin, sim);
    match std::env::var("VCUDA_DRA_NODE_REBOOT") {
        Ok(cmd) => reboot_drill(n, bin, sim, &cmd),
        Err(_) => eprintln!(
            "k8s_dra: node reboot not checked (set VCUDA_DRA_NODE_REBOOT to a command that stops kubelet and containerd, kills every pod process, clears /var/run/cdi and starts both again)"
        ),
    }
    n.ok(&["delete", "namespace", NS, "--wait=true", "--timeout=120s"]);
    // Every claim unprepared while the driver runs (the kubelet finishes a
    // pod's deletion before it unprepares: the namespace gone is not enough).
    let ckpt = Path::new("/var/lib/kubelet/plugins/vcuda.tencent.com/checkpoint.json");
    wait("the DaemonSet's driver unprepared every claim", 120, || {
        let c: Value = serde_json::from_slice(&fs::read(ckpt).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        match c["claims"].as_object() {
            Some(m) if m.is_empty() => Ok(()),
            _ => Err(format!("{}; {}", c["claims"], tail(&logs(), 3))),
        }
    });
    let l = logs();
    assert!(
        !l.to_lowercase().contains("forbidden") && !l.contains("ERROR"),
        "the driver under its ClusterRole:\n{}",
        tail(&l, 30)
    );
    assert!(!l.contains("\u{1b}["), "no colour codes in the pod's log");
    uninstall_drill(n, node, (&host, &port));
    drop(ds);
}

/// The driver's overlay deleted, then deploy/overlays/uninstall: its DRA
/// DaemonSet leaves nothing of the driver on the node (the claims were
/// unprepared while the driver ran).
fn uninstall_drill(n: &Node, node: &str, (host, port): (&str, &str)) {
    let deploy = workspace_root().join("deploy");
    delete_driver_overlay(n, &[]).unwrap_or_else(|e| panic!("{e}"));
    // The stopping driver removed its sockets itself.
    let reg: Vec<String> = fs::read_dir("/var/lib/kubelet/plugins_registry")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with(DRIVER))
        .collect();
    assert!(reg.is_empty(), "registration sockets left: {reg:?}");
    n.ok(&[
        "apply",
        "-k",
        deploy.join("overlays/uninstall").to_str().unwrap(),
    ]);
    let _un = UninstallCleanup(n);
    n.ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "vcuda-dra-driver-uninstall",
        "--type",
        "strategic",
        "-p",
        &format!(
            // The local image; the API server's address as the driver's
            // test patch gives it (no kube-proxy here).
            r#"{{"spec":{{"template":{{"spec":{{"containers":[{{"name":"uninstall","image":"{DRA_IMAGE}","imagePullPolicy":"Never","env":[{{"name":"KUBERNETES_SERVICE_HOST","value":"{host}"}},{{"name":"KUBERNETES_SERVICE_PORT","value":"{port}"}}]}}]}}}}}}}}"#
        ),
    ]);
    let t0 = Instant::now();
    let done = uninstalled_line(n);
    eprintln!(
        "k8s_dra: uninstall done {:.1} s after applying it: {done}",
        t0.elapsed().as_secs_f64()
    );
    no_driver_state_left(n, node);
}

/// Waits for the DRA uninstaller's `uninstalled:` line, and returns it.
pub fn uninstalled_line(n: &Node) -> String {
    wait("the DRA uninstall's \"uninstalled\" line", 180, || {
        let l = n
            .kubectl(&[
                "-n",
                "kube-system",
                "logs",
                "-l",
                "app.kubernetes.io/name=vcuda-dra-driver-uninstall",
                "--tail=-1",
            ])
            .unwrap_or_default();
        l.lines()
            .find(|l| l.contains("uninstalled:"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    })
}

/// Nothing of the driver left on `node`: its state and sockets, CDI
/// specs, ResourceSlice.
pub fn no_driver_state_left(n: &Node, node: &str) {
    for gone in [
        "/etc/gpu-manager/vdriver",
        "/etc/gpu-manager/vm",
        "/var/lib/kubelet/plugins/vcuda.tencent.com",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after the uninstall");
    }
    let specs: Vec<String> = fs::read_dir(CDI_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with(DRIVER))
        .collect();
    assert!(specs.is_empty(), "CDI specs left: {specs:?}");
    let slices = n.json(&["get", "resourceslices"]).unwrap();
    let ours: Vec<&Value> = slices["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["spec"]["driver"] == DRIVER && s["spec"]["nodeName"] == node)
        .collect();
    assert!(ours.is_empty(), "ResourceSlices left: {ours:?}");
}

/// Deletes the uninstall overlay (also when the drill fails).
struct UninstallCleanup<'a>(&'a Node);

impl Drop for UninstallCleanup<'_> {
    fn drop(&mut self) {
        let deploy = workspace_root().join("deploy");
        let _ = self.0.kubectl(&[
            "delete",
            "-k",
            deploy.join("overlays/uninstall").to_str().unwrap(),
            "--ignore-not-found",
            "--wait=true",
        ]);
    }
}

/// Two rolling updates of the driver's DaemonSet with pods created
/// meanwhile ([`windows::rolling_updates`]); each new driver removed the
/// old one's sockets once registered.
fn rolling_update(n: &Node, bin: &Path, sim: &Path) {
    n.apply(&claim_template("gpu-5", 5, "256Mi"));
    windows::rolling_updates(
        n,
        DRIVER_APP,
        |p| pod(p, "gpu-5", "sleep 100000", bin, sim),
        "ds-share",
        |k, before, after, secs, l| {
            eprintln!("k8s_dra: rolling update {k}: {before} -> {after} in {secs:.1} s");
            assert!(
                l.contains("removed an earlier instance's socket"),
                "the new driver removed the old one's sockets:\n{}",
                tail(l, 20)
            );
        },
    );
}

/// A node reboot under the DaemonSet's driver: every pod process killed,
/// the runtime's state and the CDI specs (tmpfs on a real node) gone. The
/// driver comes back and re-serves its checkpoint (CDI specs written
/// again); the restartPolicy-Always pod runs again under its quota; the
/// Never pod, deleted after the reboot, is unprepared: nothing of its
/// claim stays booked.
fn reboot_drill(n: &Node, bin: &Path, sim: &Path, cmd: &str) {
    let ckpt = Path::new("/var/lib/kubelet/plugins/vcuda.tencent.com/checkpoint.json");
    let in_checkpoint = |uid: &str| {
        fs::read_to_string(ckpt)
            .unwrap_or_default()
            .contains(&format!("\"{uid}\""))
    };
    let spec = |uid: &str| PathBuf::from(CDI_DIR).join(format!("{DRIVER}-{uid}.json"));
    let quota = "/work/shim_client quota 256; echo ---done; sleep 100000";
    n.apply(
        &pod("reboot-always", "gpu-30-1g", quota, bin, sim)
            .replace("restartPolicy: Never", "restartPolicy: Always"),
    );
    n.apply(&pod("reboot-never", "gpu-5", "sleep 100000", bin, sim));
    wait_running(n, "reboot-always", 120);
    wait_running(n, "reboot-never", 120);
    check_quota(&log_with(n, "reboot-always", "---done"), "reboot-always");
    let uid_of = |p: &str| {
        pod_claim(n, p).unwrap()["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (always, never) = (uid_of("reboot-always"), uid_of("reboot-never"));
    assert!(in_checkpoint(&always) && in_checkpoint(&never));
    let t0 = Instant::now();
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "k8s_dra: node rebooted in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    wait("the driver's pod Ready after the reboot", 180, || {
        n.ready_pod(DRIVER_APP)
    });
    let running_again = wait("reboot-always running again", 240, || {
        let p = n.json(&["-n", NS, "get", "pod", "reboot-always"])?;
        let st = &p["status"]["containerStatuses"][0];
        if st["restartCount"].as_u64().unwrap_or(0) >= 1 && st["state"]["running"].is_object() {
            Ok(t0.elapsed())
        } else {
            Err(st.to_string())
        }
    });
    check_quota(
        &log_with(n, "reboot-always", "---done"),
        "reboot-always after the reboot",
    );
    assert!(spec(&always).is_file(), "its CDI spec written again");
    eprintln!(
        "k8s_dra: reboot: the Always pod ran again under its quota {:.1} s after the reboot began",
        running_again.as_secs_f64()
    );
    let t1 = Instant::now();
    n.ok(&[
        "-n",
        NS,
        "delete",
        "pod",
        "reboot-never",
        "--wait=true",
        "--timeout=180s",
    ]);
    wait("the Never pod's claim unprepared", 180, || {
        if !in_checkpoint(&never) && !spec(&never).exists() {
            Ok(())
        } else {
            Err(format!(
                "in checkpoint {}, spec {}",
                in_checkpoint(&never),
                spec(&never).exists()
            ))
        }
    });
    eprintln!(
        "k8s_dra: reboot: the Never pod's claim unprepared {:.1} s after its delete; nothing else booked",
        t1.elapsed().as_secs_f64()
    );
    n.ok(&[
        "-n",
        NS,
        "delete",
        "pod",
        "reboot-always",
        "--wait=true",
        "--timeout=180s",
    ]);
}

/// Removes what the DaemonSet phase applied (also when a run fails half
/// way, and at the start, for what a killed run left).
struct DaemonSetCleanup<'a> {
    n: &'a Node,
    node: String,
}

impl Drop for DaemonSetCleanup<'_> {
    fn drop(&mut self) {
        remove_daemonset(self.n, &self.node);
    }
}

pub fn remove_daemonset(n: &Node, node: &str) {
    let _ = n.kubectl(&["label", "node", node, "vcuda.tencent.com/mode-"]);
    let _ = delete_driver_overlay(n, &["--ignore-not-found"]);
    let _ = n.kubectl(&["delete", "resourceslice", &format!("{node}-{DRIVER}")]);
}

/// `kubectl delete -k deploy/overlays/dra` (with `extra` flags), then waits
/// until the driver's pods are gone; the delete's error, if it failed.
fn delete_driver_overlay(n: &Node, extra: &[&str]) -> Result<String, String> {
    let overlay = workspace_root().join("deploy/overlays/dra");
    let mut args = vec!["delete", "-k", overlay.to_str().unwrap(), "--wait=true"];
    args.extend(extra);
    let out = n.kubectl(&args)?;
    wait("the driver's DaemonSet pods gone", 120, || {
        if n.driver_pods()?.is_empty() {
            Ok(())
        } else {
            Err("still there".into())
        }
    });
    Ok(out)
}
