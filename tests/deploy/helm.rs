//! The Helm chart (deploy/helm/vcuda) against the kustomize overlays: for
//! the default values and for each mode, `helm template` must render the
//! objects `kubectl kustomize deploy/overlays/<name>` renders, field for
//! field, after [`normalize`] (which names every difference by design);
//! `helm lint --strict` passes for each mode; every rendered object passes
//! the overlays' typed round trip and reference checks; bad values fail
//! rendering with a message naming the value.
//!
//! helm: `$VCUDA_HELM_BIN/helm` (deploy/helm/build-helm.sh prints that
//! directory), else the newest /var/cache/vcuda/helm-*/bin/helm, else `helm`
//! on PATH. Missing, the tests skip, or fail where `VCUDA_REQUIRE_HELM=1`
//! or `VCUDA_REQUIRE_ALL=1`. kustomize is the overlays tests' kubectl: CI's
//! (tests/k8s/build-kubernetes.sh), else one on PATH.

use super::kustomize::{self, check_references, check_types, find, overlay, render};
use super::typed;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::{Capability, missing};

/// Makes a missing helm a failure (as `VCUDA_REQUIRE_ALL=1` does).
const REQUIRE_ENV: &str = "VCUDA_REQUIRE_HELM";
/// The directory holding `helm` (build-helm.sh's last line).
const BIN_ENV: &str = "VCUDA_HELM_BIN";
/// The Kubernetes version rendered for unless a case says otherwise (DRA
/// mode needs >= 1.34; the surge update strategy >= 1.22).
const KUBE: &str = "1.36.0";

fn chart() -> PathBuf {
    super::deploy_dir().join("helm/vcuda")
}

pub(super) fn helm() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(BIN_ENV).filter(|d| !d.is_empty()) {
        let p = PathBuf::from(dir).join("helm");
        if p.is_file() {
            return Some(p);
        }
        return helm_missing(&format!(
            "{BIN_ENV} is set but {} is not a file",
            p.display()
        ));
    }
    let mut cached: Vec<PathBuf> = std::fs::read_dir("/var/cache/vcuda")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("helm-"))
        .map(|e| e.path().join("bin/helm"))
        .filter(|p| p.is_file())
        .collect();
    cached.sort();
    if let Some(p) = cached.pop() {
        return Some(p);
    }
    if let Ok(p) = kustomize::which("helm") {
        return Some(p);
    }
    helm_missing(&format!(
        "{BIN_ENV} is unset, no /var/cache/vcuda/helm-*/bin/helm and no helm on PATH"
    ))
}

fn helm_missing(detail: &str) -> Option<PathBuf> {
    let hint =
        "Build it with deploy/helm/build-helm.sh and set VCUDA_HELM_BIN to the directory it prints";
    if let Some(var) = [REQUIRE_ENV, "VCUDA_REQUIRE_ALL"]
        .into_iter()
        .find(|v| std::env::var(v).as_deref() == Ok("1"))
    {
        panic!(
            "this test needs helm, required here by {var}=1, but it is missing: {detail}. {hint}."
        );
    }
    eprintln!("skipped: needs helm: {detail}. {hint}; {REQUIRE_ENV}=1 makes this a failure.");
    None
}

/// The kubectl whose kustomize renders the overlays.
fn kubectl() -> Option<PathBuf> {
    if let Some(k) = test_support::k8s::k8s_bin()
        .map(|b| b.join("kubectl"))
        .filter(|k| k.is_file())
    {
        return Some(k);
    }
    if let Ok(k) = kustomize::which("kubectl") {
        return Some(k);
    }
    missing(
        Capability::Kubernetes,
        "no kubectl to render deploy/overlays with (tests/k8s/build-kubernetes.sh's, or one on PATH)",
    );
    None
}

fn parse(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{e}\n{text}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// `helm template vcuda deploy/helm/vcuda -n kube-system` with `args`: the
/// objects, or helm's stderr.
fn try_template(helm: &Path, args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(helm)
        .arg("template")
        .arg("vcuda")
        .arg(chart())
        .args(["--namespace", "kube-system", "--kube-version", KUBE])
        .args(args)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(parse(&String::from_utf8(out.stdout).unwrap()))
}

pub(super) fn template(helm: &Path, args: &[&str]) -> Vec<Value> {
    try_template(helm, args).unwrap_or_else(|e| panic!("helm template {args:?}: {e}"))
}

/// What helm adds by design, taken off both sides:
/// - the release's labels (helm.sh/chart, app.kubernetes.io/managed-by,
///   instance, part-of, version) on objects' metadata, never in selectors
///   or pod templates;
/// - `checksum/config` on the daemons' pod templates (a changed ConfigMap
///   rolls them);
/// - `imagePullPolicy: IfNotPresent`, which the chart always writes and the
///   API server defaults to for a tagged image (the extender's Deployment in
///   deploy/ leaves it out);
/// - gpu-manager.toml is rendered from values (keys sorted, no comments):
///   compared as TOML tables; volume.conf as JSON.
fn normalize(v: &Value) -> Value {
    // pointer_mut, not v[..]: indexing a Value mutably adds missing keys.
    let mut v = v.clone();
    if let Some(meta) = v.pointer_mut("/metadata").and_then(Value::as_object_mut)
        && let Some(labels) = meta.get_mut("labels").and_then(Value::as_object_mut)
    {
        for k in [
            "helm.sh/chart",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/part-of",
            "app.kubernetes.io/version",
        ] {
            labels.remove(k);
        }
        if labels.is_empty() {
            meta.remove("labels");
        }
    }
    if let Some(meta) = v
        .pointer_mut("/spec/template/metadata")
        .and_then(Value::as_object_mut)
        && let Some(a) = meta.get_mut("annotations").and_then(Value::as_object_mut)
    {
        a.remove("checksum/config");
        if a.is_empty() {
            meta.remove("annotations");
        }
    }
    for list in ["containers", "initContainers"] {
        if let Some(cs) = v
            .pointer_mut(&format!("/spec/template/spec/{list}"))
            .and_then(Value::as_array_mut)
        {
            for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                if c.get("imagePullPolicy")
                    .is_some_and(|p| p == "IfNotPresent")
                {
                    c.remove("imagePullPolicy");
                }
            }
        }
    }
    if v["kind"] == "ConfigMap"
        && v["metadata"]["name"] == "gpu-manager"
        && let Some(data) = v.pointer_mut("/data").and_then(Value::as_object_mut)
    {
        for (k, d) in data.iter_mut() {
            let text = d.as_str().unwrap().to_string();
            if k.ends_with(".toml") {
                *d = serde_json::to_value(toml::from_str::<toml::Table>(&text).unwrap()).unwrap();
            } else if k.ends_with(".conf") {
                *d = serde_json::from_str(&text).unwrap();
            }
        }
    }
    v
}

type Key = (String, String, String);

fn key(v: &Value) -> Key {
    let s = |x: &Value| x.as_str().unwrap_or_default().to_string();
    (
        s(&v["kind"]),
        s(&v["metadata"]["namespace"]),
        s(&v["metadata"]["name"]),
    )
}

fn by_key(what: &str, objects: &[Value]) -> BTreeMap<Key, Value> {
    let mut out = BTreeMap::new();
    for v in objects {
        assert!(
            out.insert(key(v), normalize(v)).is_none(),
            "{what}: {:?} twice",
            key(v)
        );
    }
    out
}

/// Every path where `a` and `b` differ.
fn diff(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = format!("{path}.{k}");
                match (x.get(k), y.get(k)) {
                    (Some(a), Some(b)) => diff(&p, a, b, out),
                    (Some(a), None) => out.push(format!("{p}: helm {a}, kustomize none")),
                    (None, Some(b)) => out.push(format!("{p}: helm none, kustomize {b}")),
                    (None, None) => unreachable!(),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (a, b)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}[{i}]"), a, b, out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: helm {a}, kustomize {b}")),
    }
}

/// The chart's objects are kustomize's, after [`normalize`].
fn same_objects(what: &str, helm: &[Value], kustomize: &[Value]) {
    let (h, k) = (by_key(what, helm), by_key(what, kustomize));
    let (hk, kk): (BTreeSet<_>, BTreeSet<_>) = (h.keys().collect(), k.keys().collect());
    assert_eq!(
        hk,
        kk,
        "{what}: objects only helm renders: {:?}; only kustomize: {:?}",
        hk.difference(&kk).collect::<Vec<_>>(),
        kk.difference(&hk).collect::<Vec<_>>()
    );
    let mut out = Vec::new();
    for (key, hv) in &h {
        diff(&format!("{key:?}"), hv, &k[key], &mut out);
    }
    assert!(
        out.is_empty(),
        "{what}: the chart and the overlay differ:\n  {}",
        out.join("\n  ")
    );
}

/// The overlays' checks, the manager's parser on every settings file, and
/// the kinds only the chart renders (webhook, cert-manager).
pub(super) fn check_rendered(what: &str, objects: &[Value]) {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let (ours, theirs): (Vec<Value>, Vec<Value>) = objects.iter().cloned().partition(|v| {
        !matches!(
            v["kind"].as_str(),
            Some(
                "Secret"
                    | "Role"
                    | "RoleBinding"
                    | "MutatingWebhookConfiguration"
                    | "ValidatingWebhookConfiguration"
                    | "Issuer"
                    | "Certificate"
            )
        )
    });
    check_types(what, &ours);
    check_references(what, objects);
    for v in &theirs {
        let name = format!("{what}: {} {}", v["kind"], v["metadata"]["name"]);
        match v["kind"].as_str().unwrap() {
            "Secret" => drop(typed::<k8s_openapi::api::core::v1::Secret>(&name, v)),
            "Role" => drop(typed::<k8s_openapi::api::rbac::v1::Role>(&name, v)),
            "RoleBinding" => drop(typed::<k8s_openapi::api::rbac::v1::RoleBinding>(&name, v)),
            "MutatingWebhookConfiguration" => drop(typed::<MutatingWebhookConfiguration>(&name, v)),
            "ValidatingWebhookConfiguration" => {
                drop(typed::<ValidatingWebhookConfiguration>(&name, v))
            }
            _ => assert_eq!(v["apiVersion"], "cert-manager.io/v1", "{name}"),
        }
    }
    for cm in objects
        .iter()
        .filter(|v| v["kind"] == "ConfigMap" && v["metadata"]["name"] == "gpu-manager")
    {
        for (file, text) in cm["data"].as_object().unwrap() {
            if file.ends_with(".toml") {
                manager_settings(&format!("{what}: {file}"), text.as_str().unwrap());
            }
        }
    }
}

/// The manager's own parser and resolution accept `text`.
pub(super) fn manager_settings(what: &str, text: &str) -> gpu_manager::config::Settings {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("gpu-manager.toml");
    std::fs::write(&f, text).unwrap();
    let opts = gpu_manager::config::Options::from_toml(&f)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
    gpu_manager::config::Settings::resolve(gpu_manager::config::Options {
        hostname_override: Some("node-1".into()),
        ..opts
    })
    .unwrap_or_else(|e| panic!("{what}: {e}\n{text}"))
}

/// The API (group/version/kind) the chart's placement policy needs.
const VAP_API: &str = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy";

fn without(objects: &[Value], kind: &str, name: &str) -> Vec<Value> {
    objects
        .iter()
        .filter(|v| !(v["kind"] == kind && v["metadata"]["name"] == name))
        .cloned()
        .collect()
}

/// Values of deploy/overlays/example-site (its kustomization's image, its
/// site.yaml's node selector, tolerations and flags).
const EXAMPLE_SITE: &str = r#"
image:
  repository: registry.example.com/vcuda/gpu-manager
  tag: 0.1.0
devicePlugin:
  nodeSelector:
    nvidia-device-enable: null
    node.kubernetes.io/gpu-vendor: nvidia
  tolerations:
    - {key: CriticalAddonsOnly, operator: Exists}
    - {key: tencent.com/vcuda-core, operator: Exists, effect: NoSchedule}
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
    - {key: dedicated, operator: Equal, value: gpu, effect: NoSchedule}
  extraArgs: [--sample-period=2, --allocation-check-period=60]
"#;

#[test]
fn every_overlay_is_a_set_of_chart_values() {
    let Some(helm) = helm() else { return };
    let Some(k) = kubectl() else { return };
    let dir = tempfile::tempdir().unwrap();
    let site = dir.path().join("example-site.yaml");
    std::fs::write(&site, EXAMPLE_SITE).unwrap();
    let site = site.to_str().unwrap();

    let share = render(&k, &overlay("share"));
    let plus = |a: &[Value], b: &[Value]| [a, b].concat();
    // overlay -> (chart values, what the chart renders for them)
    let mut covered = BTreeSet::new();
    let mut case = |name: &str, args: &[&str], chart: Vec<Value>, kustomize: Vec<Value>| {
        covered.insert(name.to_string());
        let what = format!("overlays/{name} = helm template {}", args.join(" "));
        check_rendered(&what, &chart);
        same_objects(&what, &chart, &kustomize);
        eprintln!("{what}: {} objects alike", chart.len());
    };
    case("share", &[], template(&helm, &[]), share.clone());
    let old = ["--kube-version", "1.21.0"];
    case(
        "share-before-1.22",
        &old,
        template(&helm, &old),
        render(&k, &overlay("share-before-1.22")),
    );
    let a = ["--set", "shareMode=whole-gpu"];
    case(
        "whole-gpu",
        &a,
        template(&helm, &a),
        render(&k, &overlay("whole-gpu")),
    );
    let a = ["--set", "mode=dra"];
    case("dra", &a, template(&helm, &a), render(&k, &overlay("dra")));
    // The extender beside the default install; the kube-scheduler
    // configuration (a file in deploy/) is checked by
    // the_kube_scheduler_configuration_is_deploys.
    let a = ["--set", "scheduler.enabled=true"];
    let sched = template(&helm, &a);
    find(&sched, "ConfigMap", "vcuda-scheduler-kube-scheduler-config");
    case(
        "scheduler",
        &a,
        without(&sched, "ConfigMap", "vcuda-scheduler-kube-scheduler-config"),
        plus(&share, &render(&k, &overlay("scheduler"))),
    );
    let a = [
        "--set",
        "monitoring.serviceMonitor.enabled=true,monitoring.dashboard.enabled=true",
    ];
    case(
        "monitoring",
        &a,
        template(&helm, &a),
        plus(&share, &render(&k, &overlay("monitoring"))),
    );
    let a = ["-f", site];
    case(
        "example-site",
        &a,
        template(&helm, &a),
        render(&k, &overlay("example-site")),
    );
    // Each mode's clean-up; the overlay has both.
    let a = ["--set", "uninstall.enabled=true"];
    let b = ["--set", "uninstall.enabled=true,mode=dra"];
    case(
        "uninstall",
        &["--set", "uninstall.enabled=true[,mode=dra]"],
        plus(&template(&helm, &a), &template(&helm, &b)),
        render(&k, &overlay("uninstall")),
    );
    // Where the API server has ValidatingAdmissionPolicy (helm install
    // asks it; helm template is told), the chart adds the policy, which is
    // the overlay's; nowhere else (the cases above).
    let a = ["--api-versions", VAP_API];
    let with = template(&helm, &a);
    let policy: Vec<Value> = with
        .iter()
        .filter(|v| v["metadata"]["name"] == "vcuda-placement-annotations")
        .cloned()
        .collect();
    case(
        "placement-policy",
        &a,
        policy,
        render(&k, &overlay("placement-policy")),
    );
    let want: BTreeSet<String> = kustomize::OVERLAYS.iter().map(|s| s.to_string()).collect();
    assert_eq!(covered, want, "an overlay without chart values here");
}

/// `helm lint --strict` for each mode and the optional parts together.
#[test]
fn the_chart_lints_in_every_mode() {
    let Some(helm) = helm() else { return };
    for sets in [
        "",
        "shareMode=whole-gpu",
        "mode=dra",
        "scheduler.enabled=true,monitoring.serviceMonitor.enabled=true,monitoring.dashboard.enabled=true",
        "mode=dra,monitoring.serviceMonitor.enabled=true,webhook.enabled=true",
        "webhook.enabled=true,webhook.schedulerName=vcuda-scheduler,webhook.certificate.source=cert-manager",
        "uninstall.enabled=true",
        "uninstall.enabled=true,mode=dra",
        "nodeConfig.gpu-node-7.sample-period=2",
    ] {
        let mut cmd = Command::new(&helm);
        cmd.args([
            "lint",
            "--strict",
            "--namespace",
            "kube-system",
            "--kube-version",
            KUBE,
        ])
        .arg(chart());
        if !sets.is_empty() {
            cmd.args(["--set", sets]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "helm lint --set {sets}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Values the chart cannot install fail rendering, naming the value.
#[test]
fn bad_values_fail_with_a_message_naming_them() {
    let Some(helm) = helm() else { return };
    for (sets, says) in [
        ("mode=gpu", "mode"),
        ("shareMode=half", "shareMode"),
        ("resourceCores=", "resourceCores"),
        ("resourceMem=", "resourceMem"),
        ("resourceCores=example.com/gpu-core", "resourceCores"),
        ("memoryUnit=1Gi", "memoryUnit"),
        ("config.shar-mode=true", "shar-mode"),
        ("config.query-port=0", "query-port"),
        // The query port inside the pod leaves the kubelet and Prometheus
        // nothing to reach without these.
        ("config.health-port=null", "config.health-port: query-addr"),
        (
            "config.metrics-port=null",
            "config.metrics-port: query-addr",
        ),
        ("config.container-runtime=rkt", "container-runtime"),
        (
            "nodeConfig.Node_1.sample-period=2",
            "'Node_1' does not match",
        ),
        ("nodeConfig.node-1.sampel-period=2", "sampel-period"),
        ("devicePlugin.extraArgs[0]=sample-period=2", "extraArgs"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("webhook.failurePolicy=Maybe", "failurePolicy"),
        ("webhook.certificate.source=vault", "source"),
        ("scheduler.enabled=true,mode=dra", "scheduler.enabled"),
        ("unknownTopLevel=1", "unknownTopLevel"),
    ] {
        let err = try_template(&helm, &["--set", sets])
            .err()
            .unwrap_or_else(|| panic!("--set {sets} rendered"));
        assert!(err.contains(says), "--set {sets}: {err}");
    }
    let err = try_template(&helm, &["--set", "mode=dra", "--kube-version", "1.33.0"])
        .expect_err("DRA on 1.33");
    assert!(err.contains("mode: dra needs Kubernetes >= 1.34"), "{err}");
    let err = try_template(
        &helm,
        &[
            "--set",
            "webhook.trustedUsers={a'b}",
            "--api-versions",
            VAP_API,
        ],
    )
    .expect_err("a quote in a trusted user");
    assert!(err.contains("webhook.trustedUsers"), "{err}");
}

/// The placement policy trusts webhook.trustedUsers as the webhook does (a
/// trailing `*` a prefix), renders only where the API server has the API
/// and the policy is enabled, and not in the chart's clean-up.
#[test]
fn the_placement_policy_trusts_whom_the_webhook_trusts() {
    let Some(helm) = helm() else { return };
    let api = ["--api-versions", VAP_API];
    let users = ["--set", "webhook.trustedUsers={system:node:*,ops-bot}"];
    let objects = template(&helm, &[&api[..], &users[..]].concat());
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "vcuda-placement-annotations",
    );
    let writer = vap["spec"]["variables"][0]["expression"].as_str().unwrap();
    assert_eq!(
        writer,
        "request.userInfo.username in ['system:serviceaccount:kube-system:vcuda-scheduler', \
         'system:serviceaccount:kube-system:gpu-manager', 'ops-bot'] \
         || request.userInfo.username.startsWith('system:node:')"
    );
    let count = |args: &[&str]| {
        template(&helm, args)
            .iter()
            .filter(|v| v["metadata"]["name"] == "vcuda-placement-annotations")
            .count()
    };
    assert_eq!(count(&api), 2);
    assert_eq!(count(&[]), 0, "rendered for an API server without the API");
    let off = ["--set", "placementPolicy.enabled=false"];
    assert_eq!(count(&[&api[..], &off[..]].concat()), 0);
    let un = ["--set", "uninstall.enabled=true"];
    assert_eq!(count(&[&api[..], &un[..]].concat()), 0);
}

/// Every key values.schema.json lets into the manager's settings is one
/// the manager's parser knows (it refuses unknown keys).
#[test]
fn the_schemas_settings_are_the_managers() {
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(chart().join("values.schema.json")).unwrap())
            .unwrap();
    let props = schema["properties"]["config"]["properties"]
        .as_object()
        .unwrap();
    assert_eq!(
        &schema["properties"]["nodeConfig"]["additionalProperties"]["properties"],
        &schema["properties"]["config"]["properties"],
        "nodeConfig takes the same keys as config"
    );
    for (k, p) in props {
        let sample = match p["type"].as_str().unwrap() {
            "string" => match p["enum"].as_array() {
                Some(e) => e[0].to_string(),
                None => "\"/x\"".into(),
            },
            "integer" => "1".into(),
            "boolean" => "true".into(),
            "array" => "[1]".into(),
            t => panic!("{k}: type {t}"),
        };
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t.toml");
        std::fs::write(&f, format!("{k} = {sample}\n")).unwrap();
        gpu_manager::config::Options::from_toml(&f)
            .unwrap_or_else(|e| panic!("schema key {k}: the manager refuses it: {e}"));
    }
    // And the values' defaults satisfy the manager as rendered (the
    // ConfigMap's settings, checked in check_rendered).
}

/// The chart's kube-scheduler configuration is
/// deploy/scheduler/kube-scheduler-config.yaml.
#[test]
fn the_kube_scheduler_configuration_is_deploys() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &["--set", "scheduler.enabled=true"]);
    let cm = find(
        &objects,
        "ConfigMap",
        "vcuda-scheduler-kube-scheduler-config",
    );
    let ours: Value =
        serde_yaml::from_str(cm["data"]["kube-scheduler-config.yaml"].as_str().unwrap()).unwrap();
    let theirs: Value = serde_yaml::from_str(
        &std::fs::read_to_string(super::deploy_dir().join("scheduler/kube-scheduler-config.yaml"))
            .unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    diff("kube-scheduler-config", &ours, &theirs, &mut out);
    assert!(out.is_empty(), "{}", out.join("\n"));
}

/// nodeConfig: one whole settings file per node, which that node's daemon
/// (either mode) starts with; other nodes keep gpu-manager.toml.
#[test]
fn node_config_gives_a_node_its_own_file() {
    let Some(helm) = helm() else { return };
    for (mode, ds, binary, flag) in [
        (
            "devicePlugin",
            "gpu-manager",
            "/usr/bin/gpu-manager",
            "--config",
        ),
        (
            "dra",
            "vcuda-dra-driver",
            "/usr/bin/vcuda-dra-driver",
            "--manager-config",
        ),
    ] {
        let objects = template(
            &helm,
            &[
                "--set",
                &format!("mode={mode},nodeConfig.gpu-node-7.sample-period=2"),
                "--set-json",
                "nodeConfig.gpu-node-7.ignored-xids=[13,79]",
            ],
        );
        check_rendered(&format!("nodeConfig, {mode}"), &objects);
        let data = &find(&objects, "ConfigMap", "gpu-manager")["data"];
        let all = manager_settings(
            "gpu-manager.toml",
            data["gpu-manager.toml"].as_str().unwrap(),
        );
        let node = manager_settings(
            "node-gpu-node-7.toml",
            data["node-gpu-node-7.toml"].as_str().unwrap(),
        );
        assert_eq!(all.sample_period.as_secs(), 1);
        assert_eq!(node.sample_period.as_secs(), 2);
        assert_eq!(node.ignored_xids, [13, 79]);
        assert_eq!(node.http, all.http, "the rest is the cluster's");
        assert_eq!(node.virtual_manager_path, all.virtual_manager_path);
        let c = kustomize::container(find(&objects, "DaemonSet", ds));
        let script = c["command"][2].as_str().unwrap();
        assert_eq!(c["command"][0], "/bin/sh");
        for part in [
            "/etc/gpu-manager/config/node-$NODE_NAME.toml",
            "/etc/gpu-manager/config/gpu-manager.toml",
            &format!("exec {binary} \"{flag}=$c\" \"$@\""),
        ] {
            assert!(script.contains(part), "{mode}: {part:?} not in {script}");
        }
        assert!(
            !kustomize::args(find(&objects, "DaemonSet", ds))
                .iter()
                .any(|a| a.starts_with(flag)),
            "{mode}: the script passes {flag}"
        );
        // Run it: a node with a file gets its file, any other the cluster's.
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config");
        std::fs::create_dir(&cfg).unwrap();
        std::fs::write(cfg.join("node-gpu-node-7.toml"), "").unwrap();
        let script = script
            .replace("/etc/gpu-manager/config", cfg.to_str().unwrap())
            .replace(&format!("exec {binary}"), "exec echo");
        for (node, want) in [
            ("gpu-node-7", "node-gpu-node-7.toml"),
            ("gpu-node-8", "gpu-manager.toml"),
        ] {
            let out = Command::new("/bin/sh")
                .args(["-c", &script, "daemon", "--x"])
                .env("NODE_NAME", node)
                .output()
                .unwrap();
            let line = String::from_utf8(out.stdout).unwrap();
            assert_eq!(
                line.trim(),
                format!("{flag}={}/{want} --x", cfg.display()),
                "{mode} on {node}"
            );
        }
    }
}

/// The webhook's objects (templates/webhook/) for each certificate source.
#[test]
fn the_webhook_renders_for_each_certificate_source() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &["--set", "webhook.enabled=true"]);
    check_rendered("webhook", &objects);
    let dep = find(&objects, "Deployment", "vcuda-webhook");
    let c = kustomize::container(dep);
    assert_eq!(c["command"], json!(["/usr/bin/vcuda-webhook"]));
    let args = kustomize::args(dep);
    for a in [
        "--listen=0.0.0.0:8443",
        "--tls-cert=/etc/vcuda-webhook/tls/tls.crt",
        "--tls-key=/etc/vcuda-webhook/tls/tls.key",
        "--mode=device-plugin",
        "--health-listen=0.0.0.0:8081",
        "--trusted-user=system:serviceaccount:kube-system:vcuda-scheduler",
        "--trusted-user=system:serviceaccount:kube-system:gpu-manager",
        // Its own CA (certificate.source: self-managed, the default).
        "--self-managed=kube-system/vcuda-webhook-tls",
        "--ca-bundle-of=validating/vcuda-webhook",
        "--cert-name=vcuda-webhook.kube-system.svc",
        "--ca-validity=365d",
        "--cert-validity=90d",
    ] {
        assert!(args.contains(&a.to_string()), "{a} not in {args:?}");
    }
    assert!(!args.iter().any(|a| a.starts_with("--scheduler-name")));
    // No /mutate registered: no bundle kept on it.
    assert!(!args.contains(&"--ca-bundle-of=mutating/vcuda-webhook".to_string()));
    // It writes the files it serves: a writable volume of its own.
    assert_eq!(c["volumeMounts"][0]["readOnly"], false);
    assert_eq!(
        dep["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"],
        "Memory"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(
            c[probe]["httpGet"],
            json!({"path": "/healthz", "port": "health"})
        );
    }
    let svc = find(&objects, "Service", "vcuda-webhook");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "https");
    // Nothing to mutate in device-plugin mode without a scheduler name.
    assert!(
        !objects
            .iter()
            .any(|v| v["kind"] == "MutatingWebhookConfiguration")
    );
    // The Secret goes with the release, empty: the webhook fills it, and
    // no caBundle is rendered for an upgrade to reset.
    let secret = find(&objects, "Secret", "vcuda-webhook-tls");
    assert!(secret["data"].is_null(), "{secret}");
    let v = find(&objects, "ValidatingWebhookConfiguration", "vcuda-webhook");
    let hook = &v["webhooks"][0];
    assert_eq!(hook["clientConfig"]["service"]["path"], "/validate");
    assert!(hook["clientConfig"]["caBundle"].is_null(), "{hook}");
    assert_eq!(hook["failurePolicy"], "Ignore");
    assert_eq!(hook["sideEffects"], "None");
    // Placement annotations are patched onto existing pods.
    assert_eq!(hook["rules"][0]["operations"], json!(["CREATE", "UPDATE"]));
    let role = find(&objects, "ClusterRole", "vcuda-webhook");
    assert_eq!(
        role["rules"],
        json!([
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["admissionregistration.k8s.io"],
             "resources": ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"],
             "resourceNames": ["vcuda-webhook"], "verbs": ["get", "update"]}
        ])
    );
    let secrets = find(&objects, "Role", "vcuda-webhook");
    assert_eq!(
        secrets["rules"][0]["resourceNames"],
        json!(["vcuda-webhook-tls"])
    );

    let objects = template(
        &helm,
        &[
            "--set",
            "mode=dra,webhook.enabled=true,webhook.schedulerName=vcuda-scheduler,webhook.failurePolicy=Fail,webhook.certificate.source=cert-manager",
        ],
    );
    check_rendered("webhook, cert-manager", &objects);
    let args = kustomize::args(find(&objects, "Deployment", "vcuda-webhook"));
    assert!(args.contains(&"--mode=dra".to_string()));
    assert!(args.contains(&"--scheduler-name=vcuda-scheduler".to_string()));
    assert!(!args.iter().any(|a| a.starts_with("--self-managed")));
    assert!(
        !objects
            .iter()
            .any(|v| v["kind"] == "Secret" || v["kind"] == "Role")
    );
    let cert = find(&objects, "Certificate", "vcuda-webhook");
    assert_eq!(cert["spec"]["secretName"], "vcuda-webhook-tls");
    assert!(
        cert["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .contains(&json!("vcuda-webhook.kube-system.svc"))
    );
    assert_eq!(cert["spec"]["issuerRef"]["name"], "vcuda-webhook");
    find(&objects, "Issuer", "vcuda-webhook");
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        let w = find(&objects, kind, "vcuda-webhook");
        assert_eq!(
            w["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            "kube-system/vcuda-webhook"
        );
        assert!(w["webhooks"][0]["clientConfig"]["caBundle"].is_null());
        assert_eq!(w["webhooks"][0]["failurePolicy"], "Fail");
    }
    let m = find(&objects, "MutatingWebhookConfiguration", "vcuda-webhook");
    assert_eq!(
        m["webhooks"][0]["clientConfig"]["service"]["path"],
        "/mutate"
    );
}

/// The packaged chart (what a chart repository serves) holds the files the
/// directory links to (the dashboard, volume.conf) and renders the same.
#[test]
fn the_packaged_chart_renders_as_the_directory() {
    let Some(helm) = helm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&helm)
        .arg("package")
        .arg(chart())
        .arg("--destination")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tgz = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let sets = ["--set", "monitoring.dashboard.enabled=true"];
    let out = Command::new(&helm)
        .arg("template")
        .arg("vcuda")
        .arg(&tgz)
        .args(["--namespace", "kube-system", "--kube-version", KUBE])
        .args(sets)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let packaged = parse(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(packaged, template(&helm, &sets));
    let dash = find(&packaged, "ConfigMap", "vcuda-grafana-dashboard");
    assert_eq!(
        dash["data"]["vcuda-dashboard.json"].as_str().unwrap(),
        std::fs::read_to_string(super::deploy_dir().join("monitoring/vcuda-dashboard.json"))
            .unwrap()
    );
}
