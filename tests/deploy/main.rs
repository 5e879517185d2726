//! The manifests in deploy/ are what an operator applies: every document
//! must deserialize into the Kubernetes type of its kind without losing a
//! field (a misspelt key is dropped by the typed round trip and reported),
//! and the pieces must fit together (labels, ports, volumes, config keys).

mod helm;
mod kustomize;
mod ports;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn deploy_dir() -> PathBuf {
    test_support::workspace_root().join("deploy")
}

/// Every YAML document of the device-plugin install (deploy/base, its
/// settings in deploy/config, the monitoring objects and the sample pod), with the file it came from;
/// kustomization files are kustomize's, not API objects
/// (tests/deploy_kustomize.rs renders them).
fn documents() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = ["base", "config", "monitoring", "."]
        .iter()
        .flat_map(|d| std::fs::read_dir(deploy_dir().join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                out.push((f.file_name().unwrap().to_string_lossy().into_owned(), v));
            }
        }
    }
    out
}

/// Every field of `original` must survive in `typed` unchanged.
fn assert_subset(file: &str, path: &str, original: &Value, typed: &Value) {
    match (original, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (k, v) in o {
                let p = format!("{path}.{k}");
                let Some(tv) = t.get(k) else {
                    panic!(
                        "{file}: {p} is not a field of the Kubernetes type (misspelt or misplaced?)"
                    );
                };
                assert_subset(file, &p, v, tv);
            }
        }
        (Value::Array(o), Value::Array(t)) => {
            assert_eq!(o.len(), t.len(), "{file}: {path} changed length");
            for (i, (a, b)) in o.iter().zip(t).enumerate() {
                assert_subset(file, &format!("{path}[{i}]"), a, b);
            }
        }
        // Quantities and int-or-strings may come back in another JSON type.
        (a, b) if a == b || a.to_string().trim_matches('"') == b.to_string().trim_matches('"') => {}
        (a, b) => panic!("{file}: {path} is {a} but the Kubernetes type reads {b}"),
    }
}

fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(file: &str, v: &Value) -> T {
    let t: T = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_subset(file, "", v, &serde_json::to_value(&t).unwrap());
    t
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    namespace_selector: Option<NamespaceSelector>,
    endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct NamespaceSelector {
    match_names: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct Endpoint {
    port: String,
    path: Option<String>,
    interval: Option<String>,
    relabelings: Option<Vec<Relabeling>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct Relabeling {
    source_labels: Vec<String>,
    target_label: String,
}

struct Manifests {
    daemonset: DaemonSet,
    configmap: ConfigMap,
    service: Service,
    service_account: ServiceAccount,
    role: ClusterRole,
    binding: ClusterRoleBinding,
    monitor: ServiceMonitor,
    query_policy: k8s_openapi::api::networking::v1::NetworkPolicy,
    pods: Vec<Pod>,
}

fn manifests() -> Manifests {
    let (mut ds, mut cm, mut svc, mut sa, mut role, mut binding, mut mon) =
        (None, None, None, None, None, None, None);
    let mut policy = None;
    let mut pods = Vec::new();
    for (file, v) in documents() {
        let kind = v["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: a document without kind"));
        match kind {
            "DaemonSet" => ds = Some(typed::<DaemonSet>(&file, &v)),
            "ConfigMap" => cm = Some(typed::<ConfigMap>(&file, &v)),
            "Service" => svc = Some(typed::<Service>(&file, &v)),
            "ServiceAccount" => sa = Some(typed::<ServiceAccount>(&file, &v)),
            "ClusterRole" => role = Some(typed::<ClusterRole>(&file, &v)),
            "ClusterRoleBinding" => binding = Some(typed::<ClusterRoleBinding>(&file, &v)),
            "Pod" => pods.push(typed::<Pod>(&file, &v)),
            "NetworkPolicy" => policy = Some(typed(&file, &v)),
            "ServiceMonitor" => {
                assert_eq!(v["apiVersion"], "monitoring.coreos.com/v1", "{file}");
                mon = Some(
                    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{file}: {e}")),
                );
            }
            other => panic!("{file}: unexpected kind {other}"),
        }
    }
    Manifests {
        daemonset: ds.expect("a DaemonSet"),
        configmap: cm.expect("a ConfigMap"),
        service: svc.expect("a Service"),
        service_account: sa.expect("a ServiceAccount"),
        role: role.expect("a ClusterRole"),
        binding: binding.expect("a ClusterRoleBinding"),
        query_policy: policy.expect("a NetworkPolicy for the query port"),
        monitor: mon.expect("a ServiceMonitor"),
        pods,
    }
}

fn manager_config(m: &Manifests) -> toml::Table {
    let text = &m.configmap.data.as_ref().unwrap()["gpu-manager.toml"];
    toml::from_str(text).expect("gpu-manager.toml parses")
}

#[test]
fn every_document_is_a_valid_kubernetes_object() {
    let m = manifests();
    assert!(!m.pods.is_empty(), "a sample pod");
}

#[test]
fn the_config_map_is_what_the_manager_reads() {
    let m = manifests();
    let data = m.configmap.data.as_ref().unwrap();
    let repo_volume =
        std::fs::read_to_string(test_support::workspace_root().join("config/volume.conf")).unwrap();
    assert_eq!(
        data["volume.conf"].trim_end(),
        repo_volume.trim_end(),
        "deploy/config/configmap.yaml's volume.conf differs from config/volume.conf"
    );
    // The manager's own parser accepts the file (unknown keys are errors there).
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("gpu-manager.toml");
    std::fs::write(&f, &data["gpu-manager.toml"]).unwrap();
    let opts = gpu_manager::config::Options::from_toml(&f).unwrap_or_else(|e| panic!("{e}"));
    let settings = gpu_manager::config::Settings::resolve(gpu_manager::config::Options {
        hostname_override: Some("node-1".into()),
        ..opts
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(settings.share_mode);
    // The query port (/usage: every tenant's pods and host PIDs) is inside
    // the pod alone; the kubelet's probes and Prometheus reach the pod IP,
    // each on a listener of its own.
    let http = settings.http;
    assert!(http.query.ip().is_loopback(), "{http:?}");
    for at in [http.health, http.metrics] {
        assert!(at.is_some_and(|a| a.ip().is_unspecified()), "{http:?}");
    }
    // volume.conf is read from the mounted ConfigMap.
    let ds = m
        .daemonset
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let c = &ds.containers[0];
    let config_mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|vm| vm.name == "config")
        .expect("config mount");
    assert!(settings.volume_config.starts_with(&config_mount.mount_path));
    let args = c.args.as_ref().unwrap();
    let config_arg = args
        .iter()
        .find_map(|a| a.strip_prefix("--config="))
        .expect("--config");
    assert!(config_arg.starts_with(&config_mount.mount_path));
}

#[test]
fn the_daemonset_fits_the_design() {
    let m = manifests();
    let cfg = manager_config(&m);
    let spec = m.daemonset.spec.as_ref().unwrap();
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(
        pod.host_pid,
        Some(true),
        "host PIDs from SO_PEERCRED need hostPID"
    );
    assert_eq!(
        pod.service_account_name.as_deref(),
        m.service_account.metadata.name.as_deref()
    );
    let c = &pod.containers[0];
    assert_eq!(c.security_context.as_ref().unwrap().privileged, Some(true));

    // The metrics port (/metrics alone), and the probes on a port of their
    // own (/healthz and /readyz alone: a flood of the metrics port cannot
    // starve them), both the config's; the query port is not published.
    let port_named = |name: &str| {
        let ports = c.ports.as_ref().unwrap();
        ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no container port {name:?}"))
            .container_port
    };
    let config_port =
        |key: &str| cfg[key].as_integer().unwrap_or_else(|| panic!("no {key}")) as i32;
    assert_eq!(port_named("metrics"), config_port("metrics-port"));
    assert_eq!(port_named("health"), config_port("health-port"));
    assert!(
        c.ports
            .iter()
            .flatten()
            .all(|p| p.container_port != config_port("query-port")),
        "the query port is published"
    );
    for (probe, path) in [
        (&c.readiness_probe, "/readyz"),
        (&c.liveness_probe, "/healthz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(serde_json::to_value(&get.port).unwrap(), "health");
    }

    // NODE_NAME from the downward API, used as the node name.
    let env = c.env.as_ref().unwrap();
    let node = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    let field = node
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    assert!(
        c.args
            .as_ref()
            .unwrap()
            .iter()
            .any(|a| a == "--hostname-override=$(NODE_NAME)")
    );

    // Every mount names a volume; the vm and vdriver trees are at the same
    // path on the host and in the manager, because kubelet mounts the host
    // paths the manager hands out into workload containers.
    let volumes: BTreeMap<_, _> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| (v.name.clone(), v))
        .collect();
    let mounts = c.volume_mounts.as_ref().unwrap();
    for vm in mounts {
        assert!(
            volumes.contains_key(&vm.name),
            "mount {} has no volume",
            vm.name
        );
    }
    for key in ["virtual-manager-path", "vdriver-path", "checkpoint-path"] {
        let path = cfg[key].as_str().unwrap();
        let mount = mounts
            .iter()
            .find(|vm| vm.mount_path == path)
            .unwrap_or_else(|| panic!("{key} {path} not mounted"));
        let host = volumes[&mount.name].host_path.as_ref().unwrap();
        assert_eq!(
            host.path, path,
            "{key}: host path and container path differ"
        );
    }
    let dp = cfg["device-plugin-path"].as_str().unwrap();
    assert!(mounts.iter().any(|vm| vm.mount_path == dp));
    let pr = cfg["pod-resources-socket"].as_str().unwrap();
    assert!(mounts.iter().any(|vm| pr.starts_with(&vm.mount_path)));
    // The host root holds the driver's files.
    let root = cfg["host-root"].as_str().unwrap();
    for sub in ["usr", "etc", "dev", "proc/driver"] {
        let want = format!("{root}/{sub}");
        let m = mounts
            .iter()
            .find(|vm| vm.mount_path == want)
            .unwrap_or_else(|| panic!("{want} not mounted"));
        assert_eq!(m.read_only, Some(true), "{want} must be read-only");
    }
    let cm_volume = volumes["config"].config_map.as_ref().unwrap();
    assert_eq!(cm_volume.name, m.configmap.metadata.name.clone().unwrap());
}

#[test]
fn every_runtime_socket_auto_looks_for_is_mounted_at_its_host_path() {
    let m = manifests();
    let cfg = manager_config(&m);
    let runtime = cfg["container-runtime"].as_str().unwrap();
    assert_eq!(
        gpu_manager::world::runtime::Kind::parse(runtime),
        Some(gpu_manager::world::runtime::Kind::Auto)
    );
    let pod = m
        .daemonset
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    let volumes: BTreeMap<_, _> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| (v.name.clone(), v))
        .collect();
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    for kind in [
        gpu_manager::world::runtime::Kind::Containerd,
        gpu_manager::world::runtime::Kind::CriO,
        gpu_manager::world::runtime::Kind::Docker,
    ] {
        let endpoint = kind.default_endpoint().unwrap();
        let sock = endpoint.strip_prefix("unix://").unwrap();
        // The manager looks the socket up at the host's path: a hostPath
        // mounted at its own path must hold it.
        let m = mounts
            .iter()
            .find(|vm| sock.starts_with(&format!("{}/", vm.mount_path)))
            .unwrap_or_else(|| panic!("{kind:?}: no mount holds {sock}"));
        let host = volumes[&m.name].host_path.as_ref().unwrap();
        assert_eq!(
            host.path, m.mount_path,
            "{kind:?}: {sock} is elsewhere on the host"
        );
    }
}

#[test]
fn service_and_monitor_select_the_manager() {
    let m = manifests();
    let pod_labels = m
        .daemonset
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    let svc = m.service.spec.as_ref().unwrap();
    for (k, v) in svc.selector.as_ref().unwrap() {
        assert_eq!(pod_labels.get(k), Some(v), "service selector {k}={v}");
    }
    let svc_port = &svc.ports.as_ref().unwrap()[0];
    assert_eq!(
        serde_json::to_value(svc_port.target_port.as_ref().unwrap()).unwrap(),
        "metrics"
    );
    // The metrics port is admitted from the monitoring namespace only.
    let np = m.query_policy.spec.as_ref().unwrap();
    for (k, v) in np
        .pod_selector
        .as_ref()
        .unwrap()
        .match_labels
        .as_ref()
        .unwrap()
    {
        assert_eq!(pod_labels.get(k), Some(v), "NetworkPolicy selector {k}={v}");
    }
    let metrics_port = m
        .daemonset
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap()
        .container_port;
    let rule = &np.ingress.as_ref().unwrap()[0];
    let admitted: Vec<_> = rule
        .ports
        .iter()
        .flatten()
        .map(|p| p.port.clone())
        .collect();
    assert_eq!(
        admitted,
        [Some(
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(metrics_port)
        )],
        "the metrics port alone"
    );
    assert!(rule.from.as_ref().unwrap()[0].namespace_selector.is_some());
    let svc_labels = m.service.metadata.labels.clone().unwrap();
    for (k, v) in m.monitor.spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            svc_labels.get(k),
            Some(v),
            "ServiceMonitor selector {k}={v}"
        );
    }
    assert_eq!(
        m.monitor.spec.endpoints[0].port,
        svc_port.name.clone().unwrap()
    );
    assert_eq!(
        m.monitor.spec.endpoints[0].path.as_deref(),
        Some("/metrics")
    );
}

#[test]
fn rbac_grants_only_what_the_manager_uses() {
    let m = manifests();
    let mut granted: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for rule in &m.role.rules.clone().unwrap() {
        let group = rule.api_groups.as_ref().unwrap()[0].clone();
        for r in rule.resources.as_ref().unwrap() {
            let r = if group.is_empty() {
                r.clone()
            } else {
                format!("{r}.{group}")
            };
            granted
                .entry(r)
                .or_default()
                .extend(rule.verbs.iter().cloned());
        }
    }
    let want: BTreeMap<String, BTreeSet<String>> = [
        ("pods", vec!["get", "list", "watch", "patch"]),
        ("nodes", vec!["get", "patch"]),
        ("nodes/status", vec!["patch"]),
        ("events.events.k8s.io", vec!["create"]),
    ]
    .into_iter()
    .map(|(r, v)| (r.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(granted, want);
    assert!(
        !granted.values().flatten().any(|v| v == "*"),
        "no wildcards"
    );
    assert_eq!(
        m.binding.role_ref.name,
        m.role.metadata.name.clone().unwrap()
    );
    let subject = &m.binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        Some(&subject.name),
        m.service_account.metadata.name.as_ref()
    );
    assert_eq!(subject.namespace, m.service_account.metadata.namespace);
}

#[test]
fn sample_pod_asks_for_a_share() {
    let m = manifests();
    let limits = m.pods[0].spec.as_ref().unwrap().containers[0]
        .resources
        .as_ref()
        .unwrap()
        .limits
        .clone()
        .unwrap();
    let core: u32 = limits["tencent.com/vcuda-core"].0.parse().unwrap();
    let mem: u32 = limits["tencent.com/vcuda-memory"].0.parse().unwrap();
    assert!((1..100).contains(&core) && mem >= 1);
}

#[test]
fn dockerfile_builds_what_exists() {
    let root = test_support::workspace_root();
    let text = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
    // Packages it builds are workspace members.
    let build = text.lines().find(|l| l.contains("cargo build")).unwrap();
    for pkg in build
        .split_whitespace()
        .skip_while(|w| *w != "-p")
        .collect::<Vec<_>>()
        .chunks(2)
    {
        if pkg[0] == "-p" {
            // crates/<floor>/<package>, or the interposer at the top.
            let found = std::iter::once(root.join(pkg[1]))
                .chain(
                    std::fs::read_dir(root.join("crates"))
                        .unwrap()
                        .flatten()
                        .map(|floor| floor.path().join(pkg[1])),
                )
                .any(|dir| dir.join("Cargo.toml").is_file());
            assert!(found, "Dockerfile builds {} which is not a crate", pkg[1]);
        }
    }
    // Files copied from the context exist; artifacts copied from the build
    // stage are what those packages produce.
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from") && !l.contains(". ."))
    {
        let src = line.split_whitespace().nth(1).unwrap();
        assert!(root.join(src).exists(), "Dockerfile copies missing {src}");
    }
    let shim = std::fs::read_to_string(root.join("cuda-shim/Cargo.toml")).unwrap();
    assert!(
        shim.contains("name = \"vcuda\""),
        "the interposer cdylib is libvcuda.so"
    );
    // The interposer shipped is the glibc-2.17 build (tests/glibc_floor.rs).
    assert!(text.contains(
        "cargo zigbuild --release --locked -p cuda-shim --target x86_64-unknown-linux-gnu.2.17"
    ));
    assert!(text.contains(
        "target/x86_64-unknown-linux-gnu/release/libvcuda.so /usr/lib/vcuda/libvcuda.so"
    ));
    let cfg = std::fs::read_to_string(root.join("deploy/config/configmap.yaml")).unwrap();
    assert!(cfg.contains("interposer = \"/usr/lib/vcuda/libvcuda.so\""));
}

/// deploy/scheduler/: the extender's Deployment, Service and RBAC fit
/// together and grant exactly what `vcuda-scheduler` calls (watch caches,
/// bind's reads and conflict-checked patches, pods/binding); the
/// kube-scheduler configuration reaches it through the Service with the
/// verbs it serves, for both vcuda resources.
#[test]
fn the_scheduler_extender_manifests_fit_together() {
    use k8s_openapi::api::apps::v1::Deployment;
    let dir = deploy_dir().join("scheduler");
    let text = std::fs::read_to_string(dir.join("scheduler.yaml")).unwrap();
    let (mut dep, mut svc, mut role, mut binding, mut sa) = (None, None, None, None, None);
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).unwrap();
        let f = "scheduler/scheduler.yaml";
        match v["kind"].as_str().unwrap() {
            "Deployment" => dep = Some(typed::<Deployment>(f, &v)),
            "Service" => svc = Some(typed::<Service>(f, &v)),
            "ClusterRole" => role = Some(typed::<ClusterRole>(f, &v)),
            "ClusterRoleBinding" => binding = Some(typed::<ClusterRoleBinding>(f, &v)),
            "ServiceAccount" => sa = Some(typed::<ServiceAccount>(f, &v)),
            "NetworkPolicy" => {
                let np = typed::<k8s_openapi::api::networking::v1::NetworkPolicy>(f, &v);
                let port = &np.spec.unwrap().ingress.unwrap()[0].ports.clone().unwrap()[0];
                assert_eq!(
                    port.port,
                    Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8888))
                );
            }
            k => panic!("unexpected kind {k}"),
        }
    }
    let (dep, svc, role, binding, sa) = (
        dep.unwrap(),
        svc.unwrap(),
        role.unwrap(),
        binding.unwrap(),
        sa.unwrap(),
    );
    let pod = dep.spec.as_ref().unwrap().template.clone();
    let labels = pod.metadata.as_ref().unwrap().labels.clone().unwrap();
    let selector = svc.spec.as_ref().unwrap().selector.clone().unwrap();
    assert!(selector.iter().all(|(k, v)| labels.get(k) == Some(v)));
    let spec = pod.spec.unwrap();
    assert_eq!(spec.service_account_name, sa.metadata.name);
    let c = &spec.containers[0];
    assert_eq!(
        c.command.as_deref(),
        Some(&["/usr/bin/vcuda-scheduler".to_string()][..])
    );
    let port = &c.ports.as_ref().unwrap()[0];
    let sport = &svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
    assert_eq!(sport.port, port.container_port);
    let args = c.args.clone().unwrap().join(" ");
    assert!(
        args.contains(&format!("--listen=0.0.0.0:{}", port.container_port)),
        "{args}"
    );
    // Outside loopback the extender requires mTLS, its files from the
    // mounted Secret; the probes use the plain health port.
    let mount = &c.volume_mounts.as_ref().unwrap()[0];
    for flag in ["--tls-cert", "--tls-key", "--client-ca"] {
        assert!(
            args.contains(&format!("{flag}={}/", mount.mount_path)),
            "{flag}: {args}"
        );
    }
    let health = &c.ports.as_ref().unwrap()[1];
    assert!(args.contains(&format!(
        "--health-listen=0.0.0.0:{}",
        health.container_port
    )));
    for probe in [&c.readiness_probe, &c.liveness_probe] {
        let port = &probe.as_ref().unwrap().http_get.as_ref().unwrap().port;
        assert_eq!(
            port,
            &k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("health".into())
        );
    }
    let mut granted: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for rule in role.rules.unwrap() {
        for r in rule.resources.unwrap() {
            granted
                .entry(r)
                .or_default()
                .extend(rule.verbs.iter().cloned());
        }
    }
    let want: BTreeMap<String, BTreeSet<String>> = [
        ("pods", vec!["get", "list", "watch", "patch"]),
        ("nodes", vec!["get", "list", "watch", "patch"]),
        ("pods/binding", vec!["create"]),
    ]
    .into_iter()
    .map(|(r, v)| (r.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(granted, want);
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    assert_eq!(binding.subjects.unwrap()[0].name, sa.metadata.name.unwrap());

    let cfg: Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("kube-scheduler-config.yaml")).unwrap(),
    )
    .unwrap();
    let ext = &cfg["extenders"][0];
    let url = format!(
        "https://{}.{}.svc:{}",
        svc.metadata.name.unwrap(),
        svc.metadata.namespace.unwrap(),
        sport.port
    );
    assert_eq!(ext["urlPrefix"], url.as_str());
    for f in ["certFile", "keyFile", "caFile"] {
        assert!(ext["tlsConfig"][f].is_string(), "tlsConfig.{f}");
    }
    // The routes vcuda-scheduler serves (crates/cluster/vcuda-scheduler/src/http.rs).
    let http = std::fs::read_to_string(
        test_support::workspace_root().join("crates/cluster/vcuda-scheduler/src/http.rs"),
    )
    .unwrap();
    for verb in ["filterVerb", "prioritizeVerb", "bindVerb"] {
        let v = ext[verb].as_str().unwrap();
        assert!(http.contains(&format!(".route(\"/{v}\"")), "{verb}: {v}");
    }
    let managed: Vec<&str> = ext["managedResources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        managed,
        ["tencent.com/vcuda-core", "tencent.com/vcuda-memory"]
    );
    assert_eq!(ext["nodeCacheCapable"], true);
}
