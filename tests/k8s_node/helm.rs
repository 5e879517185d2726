//! Phase 3e (issue 35): the Helm chart (`deploy/helm/vcuda`) on the real
//! node, as an operator runs it: `helm install` → a share served →
//! `helm upgrade` with the share running (the manager's pod replaced, the
//! share's container not restarted, still held to its quota) → `helm
//! rollback` (the same) → `helm upgrade --set uninstall.enabled=true` →
//! `helm uninstall`: nothing of the release left, no node state left.
//!
//! The test overlay's patches (deploy/test: the local image, the simulated
//! driver root, the API server's address) go in through helm's
//! `--post-renderer`, the way a site patches a chart it does not fork.

use std::path::Path;
use std::time::Instant;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::helm::Helm;
use test_support::k8s::util::{Flavor, UNIT, get_u64, wait};
use test_support::{kv, workspace_root};

const RELEASE: &str = "vcuda";
const STATE: &str = "/etc/gpu-manager";

/// Helm against the cluster, with the test overlay's patches (`ds`,
/// `uninstall`) as its post-renderer's.
fn helm_for(c: &Cluster, deploy_copy: &Path) -> Helm {
    let kubectl = c.kubectl_cmd(&[]).get_program().to_owned();
    Helm::new(
        &c.kubeconfig(),
        &c.dir.join("work/helm"),
        Path::new(&kubectl),
        &[
            ("ds", &deploy_copy.join("test/daemonset-sim-patch.yaml")),
            (
                "uninstall",
                &deploy_copy.join("test/uninstall/uninstall-sim-patch.yaml"),
            ),
        ],
    )
}

fn quota_held(c: &Cluster, pod: &str) {
    let out = c.kubectl_ok(&["exec", pod, "--", "/work/shim_client", "quota", "64"]);
    assert_eq!(get_u64(&kv(&out), "start_total", &out), 8 * UNIT, "{out}");
}

/// The share's container: same container, no restart.
fn container_id(c: &Cluster, pod: &str) -> String {
    let p = c.pod(pod).unwrap();
    let s = &p["status"]["containerStatuses"][0];
    assert_eq!(s["restartCount"], 0, "{pod} restarted: {s}");
    s["containerID"].as_str().unwrap_or_default().to_string()
}

/// A rollout of the release's DaemonSet: a Ready pod other than `old`.
fn rolled(c: &Cluster, old: &str, what: &str) -> (String, f64) {
    let t = Instant::now();
    let new = crate::deploy::ds_ready_pod(c, Some(old));
    eprintln!("k8s_node: helm {what}: manager pod {old} -> {new}");
    (new, t.elapsed().as_secs_f64())
}

/// The chart's placement policy (issue 33): where the API server has
/// ValidatingAdmissionPolicy (the 1.37 node) placement annotations set or
/// changed by anyone but vcuda are refused by the API server itself, the
/// cluster admin included, while the manager's ServiceAccount still writes
/// its own (helm-share's gpu-assigned, on either node); 1.20 has no such
/// API and the chart leaves the policy out.
fn placement_policy(c: &Cluster, figures: &mut Vec<String>) {
    wait(
        "helm-share's tencent.com/gpu-assigned from the manager",
        60,
        || {
            let p = c.pod("helm-share")?;
            match p["metadata"]["annotations"]["tencent.com/gpu-assigned"].as_str() {
                Some("true") => Ok(()),
                _ => Err(p["metadata"]["annotations"].to_string()),
            }
        },
    );
    let installed = c.kubectl(&[
        "get",
        "validatingadmissionpolicy",
        "vcuda-placement-annotations",
        "-o",
        "name",
    ]);
    if c.flavor == Flavor::Debian120 {
        assert!(installed.is_err(), "a policy on 1.20: {installed:?}");
        return;
    }
    installed.expect("the chart's ValidatingAdmissionPolicy on the 1.37 node");
    let forged = [
        "tencent.com/predicate-gpu-idx-0=3",
        "tencent.com/predicate-node=elsewhere",
    ];
    // A policy takes a moment to reach the API server's admission chain.
    let refusal = wait("the placement policy in force", 60, || {
        match c.kubectl(&["annotate", "pod", "helm-share", "--overwrite", forged[0]]) {
            Err(e) if e.contains("only vcuda writes it") => Ok(e),
            Err(e) => Err(e),
            Ok(out) => Err(format!("admitted: {out}")),
        }
    });
    assert!(
        refusal.contains("tencent.com/predicate-gpu-idx-0")
            && refusal.contains("Remove it from the manifest"),
        "{refusal}"
    );
    let run = [
        "run",
        "forged",
        "--image=docker.io/vcuda-test/busybox:local",
        "--restart=Never",
        "--dry-run=server",
        "--annotations",
        forged[1],
    ];
    let e = c
        .kubectl(&run)
        .expect_err("a pod created with a forged placement");
    assert!(
        e.contains("tencent.com/predicate-node") && e.contains("only vcuda writes it"),
        "{e}"
    );
    // Other annotations, and taking a placement off, stay anyone's.
    c.kubectl_ok(&["annotate", "pod", "helm-share", "vcuda-test/note=ok"]);
    figures.push(
        "placement annotations: the chart's ValidatingAdmissionPolicy refused the admin's change and a forged pod; \
         the manager's own written"
            .into(),
    );
}

/// The chart's manager serves Prometheus on its pod's address (the
/// metrics port, /metrics alone) while the query port (/usage: every
/// tenant's pods and host PIDs) answers nobody there; `kubectl
/// port-forward`, which the API server authorizes, reaches it inside the
/// pod.
fn query_port_stays_in_the_pod(c: &Cluster, mgr: &str, figures: &mut Vec<String>) {
    use std::io::{BufRead, BufReader};
    let ip = c.kubectl_ok(&[
        "-n",
        "kube-system",
        "get",
        "pod",
        mgr,
        "-o",
        "jsonpath={.status.podIP}",
    ]);
    let at = |port: u16| std::net::SocketAddr::new(ip.trim().parse().unwrap(), port);
    let (code, metrics) = test_support::process::http_get(at(5680), "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert!(
        metrics.contains("pod=\"helm-share\""),
        "the share's series on the metrics port: {metrics}"
    );
    let (code, body) = test_support::process::http_get(at(5680), "/usage");
    assert_eq!(code, 404, "/usage on the metrics port: {body}");
    let refused = test_support::process::try_http_get(at(5678), "/usage");
    assert!(
        refused.is_err(),
        "the query port answered on the pod's address: {refused:?}"
    );
    let mut fwd = c
        .kubectl_cmd(&[
            "-n",
            "kube-system",
            "port-forward",
            &format!("pod/{mgr}"),
            ":5678",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(fwd.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "Forwarding from 127.0.0.1:40123 -> 5678"
    let local = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok());
    let usage = local.map(|a| test_support::process::try_http_get(a, "/usage"));
    let _ = (fwd.kill(), fwd.wait());
    let (code, body) = match usage {
        Some(Ok(r)) => r,
        other => panic!("kubectl port-forward to the query port: {line:?}: {other:?}"),
    };
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("helm-share"),
        "/usage through port-forward: {body}"
    );
    figures.push(
        "helm install: /metrics on the pod's 5680, the query port 5678 refused there and reached by kubectl port-forward".into(),
    );
}

pub fn run(c: &Cluster, w: &Work, deploy_copy: &Path, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 3e: the Helm chart: install, upgrade, rollback, uninstall");
    let chart = workspace_root().join("deploy/helm/vcuda");
    let chart = chart.to_str().unwrap();
    let h = helm_for(c, deploy_copy);
    let pr = h.post_renderer();
    let image = [
        "--set",
        "image.repository=docker.io/vcuda-test/gpu-manager",
        "--set",
        "image.tag=local",
        "--set",
        "image.pullPolicy=Never",
    ];
    c.kubectl_ok(&[
        "label",
        "node",
        &c.node,
        "nvidia-device-enable=enable",
        "--overwrite",
    ]);
    let t = Instant::now();
    let mut args = vec!["install", RELEASE, chart, "--post-renderer", pr];
    args.extend_from_slice(&image);
    h.run("ds", &args);
    let mgr = crate::deploy::ds_ready_pod(c, None);
    c.wait_allocatable("resources from the chart's manager", (400, 240), 120);
    figures.push(format!(
        "helm install: the manager's pod Ready and resources advertised {:.1} s after `helm install`",
        t.elapsed().as_secs_f64()
    ));
    c.apply(&pod_yaml(
        w,
        "helm-share",
        30,
        8,
        "sleep 1000000 | /work/shim_client hold 64",
        "",
    ));
    c.wait_phase("helm-share", &["Running"], 120);
    wait("helm-share holding", 60, || {
        let l = c.logs("helm-share");
        if l.contains("holding pid=") {
            Ok(())
        } else {
            Err(l)
        }
    });
    quota_held(c, "helm-share");
    query_port_stays_in_the_pod(c, &mgr, figures);
    placement_policy(c, figures);
    let cid = container_id(c, "helm-share");

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
            "devicePlugin.podAnnotations.vcuda-test/revision=2",
        ],
    );
    let (mgr, up_s) = rolled(c, &mgr, "upgrade");
    assert_eq!(
        container_id(c, "helm-share"),
        cid,
        "the share's container was replaced by the upgrade"
    );
    quota_held(c, "helm-share");

    h.run("ds", &["rollback", RELEASE, "1"]);
    let (mgr, back_s) = rolled(c, &mgr, "rollback");
    assert_eq!(
        container_id(c, "helm-share"),
        cid,
        "the share's container was replaced by the rollback"
    );
    quota_held(c, "helm-share");
    let hist = h.run("ds", &["history", RELEASE]);
    assert!(
        hist.lines().count() >= 4,
        "install, upgrade, rollback:\n{hist}"
    );
    figures.push(format!(
        "helm upgrade / rollback with a live share: the new manager pod Ready {up_s:.1} s / {back_s:.1} s after; \
         the share's container kept, its quota held"
    ));

    // Uninstall: the share goes first (a live one keeps its state, as the
    // kustomize phase shows), then the uninstallers, then the release.
    c.kubectl_ok(&["delete", "pod", "helm-share", "--wait=true"]);
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
    let done = wait("the chart's uninstaller done", 180, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager-uninstall",
        ])?;
        let pod = l["items"][0]["metadata"]["name"]
            .as_str()
            .ok_or("no uninstall pod yet")?
            .to_string();
        let log = c
            .kubectl(&["-n", "kube-system", "logs", &pod])
            .unwrap_or_default();
        log.lines()
            .find(|l| l.contains("uninstalled: removed"))
            .map(str::to_string)
            .ok_or(log)
    });
    let _ = mgr;
    h.run("ds", &["uninstall", RELEASE, "--wait"]);
    let left = c.kubectl_ok(&[
        "get", "daemonset,deployment,configmap,service,serviceaccount,networkpolicy,clusterrole,clusterrolebinding",
        "-A", "-l", &format!("app.kubernetes.io/instance={RELEASE}"), "-o", "name",
    ]);
    assert!(
        left.trim().is_empty(),
        "objects of the release left after helm uninstall:\n{left}"
    );
    let state: Vec<String> = ["vm", "vdriver", "checkpoint"]
        .iter()
        .map(|d| Path::new(STATE).join(d))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    assert!(state.is_empty(), "node state left: {state:?} ({done})");
    wait("the release's pods gone", 120, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name in (gpu-manager,gpu-manager-uninstall)",
        ])?;
        match l["items"].as_array().map_or(0, Vec::len) {
            0 => Ok(()),
            k => Err(format!("{k} pods")),
        }
    });
    figures.push(format!("helm uninstall (after the chart's uninstaller: {done}): no object of the release, no node state left"));
}
