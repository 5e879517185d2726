//! Every overlay in deploy/overlays (and the real-node suite's deploy/test)
//! rendered with `kubectl kustomize` as an operator's kubectl renders it:
//! the CI cluster's kubectl 1.20 (kustomize v2.0.3, the oldest this project
//! supports) and, where one is on PATH, a current kubectl (kustomize v5),
//! which must render the same objects. Every rendered object passes the same
//! typed round trip as the plain manifests, and each overlay is what its
//! name says.

use super::{ServiceMonitor, typed};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::{Capability, require};

/// The overlays this file knows what to expect of; a new overlay fails
/// [`every_overlay_renders_with_every_kubectl`] until it is added here.
pub(super) const OVERLAYS: [&str; 9] = [
    "share",
    "share-before-1.22",
    "whole-gpu",
    "dra",
    "scheduler",
    "monitoring",
    "example-site",
    "uninstall",
    "placement-policy",
];

/// kubectls to render with: the CI cluster's (required where CI requires
/// Kubernetes) and a current one from PATH, if any, with their versions.
fn kubectls() -> Option<Vec<(String, PathBuf)>> {
    if !require(Capability::Kubernetes) {
        return None;
    }
    let ci = test_support::k8s::k8s_bin().unwrap().join("kubectl");
    let mut out = vec![(version(&ci), ci)];
    if let Ok(p) = which("kubectl")
        && version(&p) != out[0].0
    {
        out.push((version(&p), p));
    }
    Some(out)
}

pub(super) fn which(name: &str) -> Result<PathBuf, ()> {
    let path = std::env::var_os("PATH").ok_or(())?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}

fn version(kubectl: &Path) -> String {
    let out = Command::new(kubectl)
        .args(["version", "--client"])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", kubectl.display()));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = text
        .split(|c: char| c == '"' || c.is_whitespace())
        .find(|w| w.starts_with("v1."))
        .unwrap_or("unknown");
    v.trim_end_matches(',').to_string()
}

/// `kubectl kustomize dir`: the rendered objects, or a panic with stderr.
pub(super) fn render(kubectl: &Path, dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} kustomize {}: {}",
        kubectl.display(),
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// The typed round trip of every rendered object, by kind.
pub(super) fn check_types(what: &str, objects: &[Value]) {
    for v in objects {
        let kind = v["kind"].as_str().unwrap_or_default();
        let name = format!("{what}: {kind} {}", v["metadata"]["name"]);
        match kind {
            "DaemonSet" => drop(typed::<DaemonSet>(&name, v)),
            "Deployment" => drop(typed::<Deployment>(&name, v)),
            "ConfigMap" => drop(typed::<ConfigMap>(&name, v)),
            "Service" => drop(typed::<Service>(&name, v)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(&name, v)),
            "ClusterRole" => drop(typed::<ClusterRole>(&name, v)),
            "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(&name, v)),
            "NetworkPolicy" => drop(typed::<k8s_openapi::api::networking::v1::NetworkPolicy>(
                &name, v,
            )),
            "ValidatingAdmissionPolicy" => drop(typed::<
                k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy,
            >(&name, v)),
            "ValidatingAdmissionPolicyBinding" => drop(typed::<
                k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
            >(&name, v)),
            "ServiceMonitor" => {
                let _: ServiceMonitor =
                    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            other => panic!("{name}: unexpected kind {other:?} in an overlay"),
        }
    }
}

/// Every ConfigMap and ServiceAccount a workload's pod template names (not
/// marked optional) is in the same render: `kubectl apply -k` of the
/// overlay alone must give pods that start.
pub(super) fn check_references(what: &str, objects: &[Value]) {
    let has = |kind: &str, ns: &Value, name: &str| {
        objects.iter().any(|v| {
            v["kind"] == kind && v["metadata"]["name"] == name && v["metadata"]["namespace"] == *ns
        })
    };
    for w in objects
        .iter()
        .filter(|v| matches!(v["kind"].as_str(), Some("DaemonSet" | "Deployment")))
    {
        let (ns, spec) = (&w["metadata"]["namespace"], &w["spec"]["template"]["spec"]);
        let who = format!("{what}: {} {}", w["kind"], w["metadata"]["name"]);
        if let Some(sa) = spec["serviceAccountName"].as_str() {
            assert!(
                has("ServiceAccount", ns, sa),
                "{who} runs as ServiceAccount {sa}, not in the overlay"
            );
        }
        for vol in spec["volumes"].as_array().into_iter().flatten() {
            let cm = &vol["configMap"];
            if let Some(name) = cm["name"].as_str()
                && cm["optional"] != true
            {
                assert!(
                    has("ConfigMap", ns, name),
                    "{who} mounts ConfigMap {name}, not in the overlay"
                );
            }
        }
    }
}

pub(super) fn overlay(name: &str) -> PathBuf {
    super::deploy_dir().join("overlays").join(name)
}

pub(super) fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|v| v["kind"] == kind && v["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among {} objects", objects.len()))
}

pub(super) fn container(ds: &Value) -> &Value {
    &ds["spec"]["template"]["spec"]["containers"][0]
}

pub(super) fn args(ds: &Value) -> Vec<String> {
    container(ds)["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn every_overlay_renders_with_every_kubectl() {
    let Some(kubectls) = kubectls() else { return };
    let found: BTreeSet<String> = std::fs::read_dir(super::deploy_dir().join("overlays"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let known: BTreeSet<String> = OVERLAYS.iter().map(|s| s.to_string()).collect();
    assert_eq!(found, known, "overlays without expectations here (or gone)");
    for name in OVERLAYS {
        let mut first: Option<(String, Vec<Value>)> = None;
        for (v, k) in &kubectls {
            let objects = render(k, &overlay(name));
            check_types(&format!("overlays/{name} ({v})"), &objects);
            check_references(&format!("overlays/{name} ({v})"), &objects);
            match &first {
                None => first = Some((v.clone(), objects)),
                Some((v0, o0)) => assert_eq!(
                    o0, &objects,
                    "overlays/{name}: kubectl {v0} and {v} render different objects"
                ),
            }
        }
        eprintln!(
            "overlays/{name}: {} objects, rendered by kubectl {}",
            first.unwrap().1.len(),
            kubectls
                .iter()
                .map(|(v, _)| v.as_str())
                .collect::<Vec<_>>()
                .join(" and ")
        );
    }
}

#[test]
fn each_overlay_installs_what_its_name_says() {
    let Some(kubectls) = kubectls() else { return };
    let k = &kubectls[0].1;
    let share = render(k, &overlay("share"));
    let ds = find(&share, "DaemonSet", "gpu-manager");
    assert!(!args(ds).iter().any(|a| a.starts_with("--share-mode")));
    find(&share, "ConfigMap", "gpu-manager");
    find(&share, "Service", "gpu-manager-metrics");
    // Upgrades start the new manager beside the old one; before 1.22 the
    // old one goes first (no DaemonSet surge there), nothing else differs.
    let surge = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(
        (&surge["maxSurge"], &surge["maxUnavailable"]),
        (&serde_json::json!(1), &serde_json::json!(0))
    );
    let old = render(k, &overlay("share-before-1.22"));
    let ods = find(&old, "DaemonSet", "gpu-manager");
    assert_eq!(
        ods["spec"]["updateStrategy"]["rollingUpdate"],
        serde_json::json!({"maxUnavailable": 1})
    );
    let mut same = ods.clone();
    same["spec"]["updateStrategy"] = ds["spec"]["updateStrategy"].clone();
    assert_eq!(
        &same, ds,
        "share-before-1.22 changes only the update strategy"
    );

    let whole = render(k, &overlay("whole-gpu"));
    let wds = find(&whole, "DaemonSet", "gpu-manager");
    assert_eq!(args(wds).last().unwrap(), "--share-mode=false");
    assert_eq!(
        args(wds)[..args(ds).len()],
        args(ds)[..],
        "whole-gpu keeps the base's arguments"
    );

    let dra = render(k, &overlay("dra"));
    find(&dra, "DaemonSet", "vcuda-dra-driver");
    assert!(
        !dra.iter()
            .any(|v| v["kind"] == "DaemonSet" && v["metadata"]["name"] == "gpu-manager"),
        "DRA mode must not also install the device plugins"
    );
    // The driver reads the manager's settings: they come with it.
    find(&dra, "ConfigMap", "gpu-manager");

    let sched = render(k, &overlay("scheduler"));
    find(&sched, "Deployment", "vcuda-scheduler");

    // The API server's own check of placement annotations: the policy and
    // its binding alone, bound to deny, trusting vcuda's two writers.
    let policy = render(k, &overlay("placement-policy"));
    assert_eq!(policy.len(), 2, "{policy:?}");
    let vap = find(
        &policy,
        "ValidatingAdmissionPolicy",
        "vcuda-placement-annotations",
    );
    assert_eq!(vap["spec"]["failurePolicy"], "Fail");
    let writer = vap["spec"]["variables"][0]["expression"].as_str().unwrap();
    for sa in ["kube-system:vcuda-scheduler", "kube-system:gpu-manager"] {
        assert!(writer.contains(sa), "{writer}");
    }
    // The keys are gpu-pods' placement annotations, as the webhook checks.
    let forged = vap["spec"]["variables"][1]["expression"].as_str().unwrap();
    for key in [
        gpu_pods::PREDICATE_NODE,
        gpu_pods::PREDICATE_TIME,
        gpu_pods::GPU_ASSIGNED,
    ] {
        assert!(forged.contains(&format!("'{key}'")), "{key}: {forged}");
    }
    for prefix in [
        gpu_pods::PREDICATE_GPU_IDX_PREFIX,
        gpu_pods::PREDICATE_MIG_PREFIX,
    ] {
        assert!(
            forged.contains(&format!("k.startsWith('{prefix}')")),
            "{prefix}: {forged}"
        );
    }
    let binding = find(
        &policy,
        "ValidatingAdmissionPolicyBinding",
        "vcuda-placement-annotations",
    );
    assert_eq!(
        binding["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );

    let un = render(k, &overlay("uninstall"));
    let uds = find(&un, "DaemonSet", "gpu-manager-uninstall");
    assert_eq!(args(uds)[0], "uninstall");
    assert_eq!(uds["spec"]["template"]["spec"]["hostPID"], true);
    // Paths as the manager's ConfigMap sets them, the parent mounted (a
    // mount point cannot be removed).
    let cfg = find(&share, "ConfigMap", "gpu-manager")["data"]["gpu-manager.toml"]
        .as_str()
        .unwrap()
        .to_string();
    for key in [
        "virtual-manager-path",
        "vdriver-path",
        "checkpoint-path",
        "device-plugin-path",
    ] {
        let want = cfg
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("{key} not in the ConfigMap"))
            .trim_matches('"')
            .to_string();
        assert!(
            args(uds).contains(&format!("--{key}={want}")),
            "uninstall's --{key} is not the ConfigMap's {want}"
        );
    }
    assert!(
        !container(uds)["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mountPath"] == "/etc/gpu-manager/vm"),
        "a vm mount point could not be removed"
    );

    // The DRA driver's: on the driver's nodes, at the driver's paths.
    let dds = find(&un, "DaemonSet", "vcuda-dra-driver-uninstall");
    let driver = find(&dra, "DaemonSet", "vcuda-dra-driver");
    assert_eq!(args(dds)[0], "uninstall");
    assert_eq!(dds["spec"]["template"]["spec"]["hostPID"], true);
    assert_eq!(
        dds["spec"]["template"]["spec"]["nodeSelector"],
        driver["spec"]["template"]["spec"]["nodeSelector"]
    );
    for (flag, key) in [
        ("vm-dir", "virtual-manager-path"),
        ("vdriver-dir", "vdriver-path"),
    ] {
        let want = cfg
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")))
            .unwrap()
            .trim_matches('"')
            .to_string();
        assert!(
            args(dds).contains(&format!("--{flag}={want}")),
            "the DRA uninstall's --{flag} is not the ConfigMap's {key} {want}"
        );
    }
    let cdi = args(driver)
        .into_iter()
        .find(|a| a.starts_with("--cdi-dir="))
        .unwrap();
    assert!(
        args(dds).contains(&cdi),
        "the DRA uninstall's CDI directory is not the driver's {cdi}"
    );

    let mon = render(k, &overlay("monitoring"));
    find(&mon, "ServiceMonitor", "gpu-manager");
    let dash = find(&mon, "ConfigMap", "vcuda-grafana-dashboard");
    assert_eq!(dash["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dash["data"]["vcuda-dashboard.json"].as_str().unwrap()).unwrap();
    assert_eq!(json["uid"], "vcuda-gpu-sharing");
}

/// The example site overlay sets image, node selector, tolerations and
/// settings in one place and loses nothing of the base it does not mean
/// to replace.
#[test]
fn the_example_site_overlay_changes_only_what_it_sets() {
    let Some(kubectls) = kubectls() else { return };
    let k = &kubectls[0].1;
    let base = render(k, &overlay("share"));
    let site = render(k, &overlay("example-site"));
    assert_eq!(base.len(), site.len());
    let (b, s) = (
        find(&base, "DaemonSet", "gpu-manager"),
        find(&site, "DaemonSet", "gpu-manager"),
    );
    assert_eq!(
        container(s)["image"],
        "registry.example.com/vcuda/gpu-manager:0.1.0"
    );
    let pod = &s["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        serde_json::json!({"node.kubernetes.io/gpu-vendor": "nvidia"})
    );
    let tolerations = |d: &Value| -> Vec<Value> {
        d["spec"]["template"]["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .clone()
    };
    for t in tolerations(b) {
        assert!(tolerations(s).contains(&t), "the site dropped {t}");
    }
    assert!(
        args(s).starts_with(&args(b)),
        "the site dropped base arguments"
    );
    assert!(args(s).contains(&"--sample-period=2".to_string()));
    // Everything else of the DaemonSet is the base's.
    let strip = |d: &Value| {
        let mut d = d.clone();
        let spec = &mut d["spec"]["template"]["spec"];
        for k in ["nodeSelector", "tolerations"] {
            spec.as_object_mut().unwrap().remove(k);
        }
        let c = &mut spec["containers"][0];
        for k in ["image", "args"] {
            c.as_object_mut().unwrap().remove(k);
        }
        d
    };
    assert_eq!(strip(b), strip(s));
}
