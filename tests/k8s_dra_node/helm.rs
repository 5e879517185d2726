//! The Helm chart in DRA mode on the real node (issue 35), as an operator
//! runs it: `helm install --set mode=dra` → the driver's DaemonSet Ready on
//! the labelled node, a share claim's pod served → `helm upgrade` with the
//! pod running (the driver's pod replaced, the pod's container kept and
//! still held to its quota) → `helm rollback` (the same) → `helm upgrade
//! --set uninstall.enabled=true` → `helm uninstall`: nothing of the release
//! left, no driver state on the node. The test patches (deploy/test: the
//! local image, the simulated root, the API server's address) go in through
//! helm's `--post-renderer`, as on the 1.20 node (tests/k8s_node/helm.rs).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;
use test_support::k8s::helm::Helm;
use test_support::k8s::util::{MIB, get_u64, tail, wait};
use test_support::{kv, workspace_root};

use crate::parts::*;

const RELEASE: &str = "vcuda";

/// The first `kubectl` on the suite's PATH (its post-renderer's kustomize).
fn kubectl() -> PathBuf {
    std::env::split_paths(&path_with_kubectl())
        .map(|d| d.join("kubectl"))
        .find(|p| p.is_file())
        .expect("kubectl on PATH")
}

/// The post-renderer's patches: the driver's DaemonSet (deploy/test's DRA
/// patch, filled) and the uninstaller's (image, API server).
fn patches(n: &Node, w: &Path, sim: &Path) -> (PathBuf, PathBuf) {
    let (host, port) = api_address(n);
    let dir = w.join("helm-dra");
    fs::create_dir_all(&dir).unwrap();
    let header = |name: &str| {
        format!(
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: {name}\n  namespace: kube-system\n"
        )
    };
    let body = fill_patch(n, "dra-driver-sim-patch.yaml", sim, (&host, &port));
    let ds = dir.join("ds.yaml");
    fs::write(&ds, header(DRIVER_APP) + &body).unwrap();
    let un = dir.join("uninstall.yaml");
    let un_body = format!(
        "spec:\n  template:\n    spec:\n      containers:\n        - name: uninstall\n          image: {DRA_IMAGE}\n          imagePullPolicy: Never\n          env:\n            - {{name: KUBERNETES_SERVICE_HOST, value: \"{host}\"}}\n            - {{name: KUBERNETES_SERVICE_PORT, value: \"{port}\"}}\n"
    );
    fs::write(&un, header("vcuda-dra-driver-uninstall") + &un_body).unwrap();
    (ds, un)
}

fn ready_driver(n: &Node, other_than: Option<&str>) -> String {
    wait("the chart's driver pod Ready", 180, || {
        let p = n.ready_pod(DRIVER_APP)?;
        if Some(p.as_str()) == other_than {
            return Err(format!("{p} still the Ready one"));
        }
        let l = n
            .kubectl(&["-n", "kube-system", "logs", &p])
            .unwrap_or_default();
        if l.contains("registered with the kubelet") {
            Ok(p)
        } else {
            Err(tail(&l, 3))
        }
    })
}

/// The share's container: the same one, never restarted.
fn container_id(n: &Node, pod: &str) -> String {
    let p = n.json(&["-n", NS, "get", "pod", pod]).unwrap();
    let s = &p["status"]["containerStatuses"][0];
    assert_eq!(s["restartCount"], 0, "{pod} restarted: {s}");
    s["containerID"].as_str().unwrap_or_default().to_string()
}

fn quota_held(n: &Node, pod: &str) {
    let out = n.ok(&[
        "-n",
        NS,
        "exec",
        pod,
        "--",
        "/work/shim_client",
        "quota",
        "64",
    ]);
    assert_eq!(get_u64(&kv(&out), "start_total", &out), 1024 * MIB, "{out}");
}

pub fn helm_phase(n: &Node, node: &str, w: &Path, sim: &Path, bin: &Path) {
    eprintln!("k8s_dra: the Helm chart in DRA mode: install, upgrade, rollback, uninstall");
    let root = test_support::k8s::cluster::daemon_rootfs(w, "vcuda-dra-driver");
    import(n, DRA_IMAGE, &root, "/usr/bin/vcuda-dra-driver");
    let (ds, un) = patches(n, w, sim);
    let h = Helm::new(
        &n.kubeconfig,
        &w.join("helm-dra/home"),
        &kubectl(),
        &[("ds", &ds), ("uninstall", &un)],
    );
    let chart = workspace_root().join("deploy/helm/vcuda");
    let (chart, pr) = (chart.to_str().unwrap(), h.post_renderer());
    let etc = Path::new("/etc/gpu-manager");
    let _etc = test_support::k8s::util::Cleanup((!etc.exists()).then(|| etc.to_path_buf()));
    let t0 = Instant::now();
    h.run(
        "ds",
        &[
            "install",
            RELEASE,
            chart,
            "--post-renderer",
            pr,
            "--set",
            "mode=dra",
        ],
    );
    n.ok(&[
        "label",
        "node",
        node,
        "vcuda.tencent.com/mode=dra",
        "--overwrite",
    ]);
    let drv = ready_driver(n, None);
    eprintln!(
        "k8s_dra: helm install: the driver's pod Ready and registered {:.1} s after `helm install`",
        t0.elapsed().as_secs_f64()
    );
    fresh_namespace(n);
    n.apply(&claim_template("gpu-30-1g", 30, "1Gi"));
    let cmd = "sleep 1000000 | /work/shim_client hold 64";
    n.apply(&pod("helm-share", "gpu-30-1g", cmd, bin, sim));
    wait_running(n, "helm-share", 120);
    log_with(n, "helm-share", "holding pid=");
    quota_held(n, "helm-share");
    let cid = container_id(n, "helm-share");

    let t = Instant::now();
    h.run(
        "ds",
        &[
            "upgrade",
            RELEASE,
            chart,
            "--post-renderer",
            pr,
            "--reuse-values",
            "--set-string",
            "kubeletPlugin.podAnnotations.vcuda-test/revision=2",
        ],
    );
    let drv = ready_driver(n, Some(&drv));
    let up_s = t.elapsed().as_secs_f64();
    assert_eq!(
        container_id(n, "helm-share"),
        cid,
        "the share's container replaced by the upgrade"
    );
    quota_held(n, "helm-share");
    let t = Instant::now();
    h.run("ds", &["rollback", RELEASE, "1"]);
    ready_driver(n, Some(&drv));
    let back_s = t.elapsed().as_secs_f64();
    assert_eq!(
        container_id(n, "helm-share"),
        cid,
        "the share's container replaced by the rollback"
    );
    quota_held(n, "helm-share");
    eprintln!(
        "k8s_dra: helm upgrade / rollback with a live share: the new driver pod registered {up_s:.1} s / {back_s:.1} s after; the share's container kept, its quota held"
    );

    // The share goes first (its claim unprepared by a running driver),
    // then the uninstaller, then the release.
    n.ok(&["-n", NS, "delete", "pod", "helm-share", "--wait=true"]);
    let ckpt = Path::new("/var/lib/kubelet/plugins/vcuda.tencent.com/checkpoint.json");
    wait(
        "the chart's driver unprepared the share's claim",
        120,
        || {
            let c: serde_json::Value =
                serde_json::from_slice(&fs::read(ckpt).map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
            match c["claims"].as_object() {
                Some(m) if m.is_empty() => Ok(()),
                _ => Err(c["claims"].to_string()),
            }
        },
    );
    h.run(
        "uninstall",
        &[
            "upgrade",
            RELEASE,
            chart,
            "--post-renderer",
            pr,
            "--reuse-values",
            "--set",
            "uninstall.enabled=true",
        ],
    );
    let done = crate::daemonset::uninstalled_line(n);
    h.run("ds", &["uninstall", RELEASE, "--wait"]);
    let _ = n.kubectl(&["label", "node", node, "vcuda.tencent.com/mode-"]);
    let left = n.ok(&[
        "get",
        "daemonset,deployment,configmap,service,serviceaccount,networkpolicy,clusterrole,clusterrolebinding",
        "-A", "-l", &format!("app.kubernetes.io/instance={RELEASE}"), "-o", "name",
    ]);
    assert!(
        left.trim().is_empty(),
        "objects of the release left after helm uninstall:\n{left}"
    );
    crate::daemonset::no_driver_state_left(n, node);
    eprintln!(
        "k8s_dra: helm uninstall (after the chart's uninstaller: {done}): no object of the release, no driver state left"
    );
}
