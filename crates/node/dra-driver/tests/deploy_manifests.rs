//! deploy/dra/: every document is a valid object of its kind (k8s-openapi
//! types, fields kept), the DaemonSet's arguments resolve to settings whose
//! directories are mounted at their host paths, the RBAC rules are what the
//! driver calls, and the example claim asks for this driver's class and
//! capacities with parameters the driver accepts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;
use dra_driver::cli::{Args, resolve};
use dra_driver::params::GpuConfig;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde::Deserialize;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

fn docs(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("deploy/dra").join(file)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// Deserializes into `T` and checks no field was dropped on the way.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(v: &Value) -> T {
    let t: T = serde_json::from_value(v.clone()).unwrap();
    let back = serde_json::to_value(&t).unwrap();
    fn subset(a: &Value, b: &Value, path: &str) {
        match (a, b) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in a {
                    subset(
                        v,
                        b.get(k).unwrap_or_else(|| panic!("{path}.{k} dropped")),
                        &format!("{path}.{k}"),
                    );
                }
            }
            (Value::Array(a), Value::Array(b)) => {
                for (i, v) in a.iter().enumerate() {
                    subset(v, &b[i], &format!("{path}[{i}]"));
                }
            }
            _ => assert_eq!(a, b, "{path}"),
        }
    }
    subset(v, &back, "");
    t
}

fn find<'a>(all: &'a [Value], kind: &str) -> &'a Value {
    all.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

#[test]
fn driver_manifest() {
    let all = docs("driver.yaml");
    let ds: DaemonSet = typed(find(&all, "DaemonSet"));
    let role: ClusterRole = typed(find(&all, "ClusterRole"));
    let _: k8s_openapi::api::rbac::v1::ClusterRoleBinding = typed(find(&all, "ClusterRoleBinding"));
    let _: k8s_openapi::api::core::v1::ServiceAccount = typed(find(&all, "ServiceAccount"));

    let spec = ds.spec.unwrap().template.spec.unwrap();
    let c = &spec.containers[0];
    let mut argv = vec!["vcuda-dra-driver".to_string()];
    for a in c.args.iter().flatten() {
        argv.push(a.replace("$(NODE_NAME)", "node-1").replace(
            "/etc/gpu-manager/config/gpu-manager.toml",
            &root().join("config/gpu-manager.toml").display().to_string(),
        ));
    }
    let s = resolve(Args::try_parse_from(argv).unwrap()).unwrap();
    assert_eq!(s.node, "node-1");
    let mounts = c.volume_mounts.as_ref().unwrap();
    let volumes = spec.volumes.as_ref().unwrap();
    let host_path = |mount: &str| -> String {
        let m = mounts
            .iter()
            .find(|m| m.mount_path == mount)
            .unwrap_or_else(|| panic!("{mount} is not mounted"));
        let v = volumes.iter().find(|v| v.name == m.name).unwrap();
        v.host_path.as_ref().unwrap().path.clone()
    };
    // Directories whose host paths end up in CDI specs or the kubelet's
    // view must be the same inside and out.
    for dir in [
        &s.vm_dir,
        &s.vdriver_dir,
        &s.cdi_dir,
        &s.plugins_dir,
        &s.registry_dir,
    ] {
        let d = dir.display().to_string();
        assert_eq!(host_path(&d), d);
    }
    assert!(
        s.state_dir.starts_with(&s.plugins_dir),
        "the checkpoint survives the pod"
    );
    for sub in ["usr", "lib", "etc", "dev"] {
        host_path(&s.host_root.join(sub).display().to_string());
    }
    assert_eq!(spec.host_pid, Some(true));

    let rules: BTreeSet<(String, String)> = role
        .rules
        .unwrap()
        .iter()
        .flat_map(|r| {
            let res = r.resources.clone().unwrap_or_default();
            r.verbs.iter().flat_map(move |v| {
                res.iter()
                    .map(move |x| (x.clone(), v.clone()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let want: BTreeSet<(String, String)> = [
        ("resourceclaims", "get"),
        ("resourceslices", "list"),
        // The driver watches its slice: a starting kubelet deletes it.
        ("resourceslices", "watch"),
        ("resourceslices", "create"),
        ("resourceslices", "update"),
        ("resourceslices", "delete"),
        ("deviceclasses", "create"),
        // An earlier release's classes are brought to this release's.
        ("deviceclasses", "get"),
        ("deviceclasses", "update"),
        // A reclaimed borrower's Event on its pods (docs/qos.md, "Memory").
        ("events", "create"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(rules, want);
}

/// The query port's NetworkPolicy selects the driver's pods and admits
/// the metrics port from labelled namespaces only.
#[test]
fn query_port_policy() {
    let all = docs("driver.yaml");
    let ds: DaemonSet = typed(find(&all, "DaemonSet"));
    let tpl = ds.spec.unwrap().template;
    let labels = tpl.metadata.unwrap().labels.unwrap();
    let port = tpl.spec.unwrap().containers[0].ports.clone().unwrap()[0].container_port;
    let np: k8s_openapi::api::networking::v1::NetworkPolicy =
        typed(find(&docs("networkpolicy.yaml"), "NetworkPolicy"));
    let spec = np.spec.unwrap();
    for (k, v) in spec.pod_selector.unwrap().match_labels.unwrap() {
        assert_eq!(labels.get(&k), Some(&v), "{k}");
    }
    let rule = &spec.ingress.unwrap()[0];
    assert_eq!(
        rule.ports.as_ref().unwrap()[0].port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(port))
    );
    assert!(rule.from.as_ref().unwrap()[0].namespace_selector.is_some());
}

#[test]
fn claim_example() {
    let all = docs("claim-example.yaml");
    let t: ResourceClaimTemplate = typed(find(&all, "ResourceClaimTemplate"));
    let pod: Pod = typed(find(&all, "Pod"));
    let devices = t.spec.spec.devices.unwrap();
    let req = &devices.requests.as_ref().unwrap()[0];
    let ex = req.exactly.as_ref().unwrap();
    assert_eq!(ex.device_class_name, dra_driver::slices::SHARE_CLASS);
    let caps = ex.capacity.as_ref().unwrap().requests.as_ref().unwrap();
    let keys: Vec<&str> = caps.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [dra_driver::CAPACITY_CORES, dra_driver::CAPACITY_MEMORY]
    );
    let cfg = &devices.config.as_ref().unwrap()[0];
    let o = cfg.opaque.as_ref().unwrap();
    assert_eq!(o.driver, dra_driver::DRIVER_NAME);
    assert_eq!(
        GpuConfig::parse(&o.parameters.0).unwrap().core_limit,
        Some(60)
    );
    let spec = pod.spec.unwrap();
    assert_eq!(
        spec.resource_claims.as_ref().unwrap()[0]
            .resource_claim_template_name
            .as_deref(),
        Some("gpu-30-1g")
    );
    assert_eq!(
        spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .claims
            .as_ref()
            .unwrap()[0]
            .name,
        "gpu"
    );
}
