//! What the webhook changes in a pod it admits, as JSON Patch operations:
//!
//! * the scheduler name of the extender's profile, when the operator
//!   asks for it (device-plugin clusters whose extender runs in a second
//!   profile);
//! * on DRA clusters, each GPU container's `vcuda-core` / `vcuda-memory`
//!   limits become a ResourceClaim from a template of that shape
//!   (`capacity.requests` `cores` and `memory` of the share class, or a
//!   count of whole GPUs), bound to the container, so a manifest written
//!   for the device plugins runs unchanged. Templates are named by shape
//!   and created once per namespace; a pod that already names a vcuda
//!   claim is left as it is;
//! * on DRA clusters too, each `tencent.com/mig-<profile>: N` limit (the
//!   device plugins' MIG resources) becomes a claim for N MIG devices of
//!   that profile (the MIG class, a selector on the profile).

use gpu_allocator::{MEMORY_UNIT_BYTES, WHOLE_GPU_CORES};
use gpu_pods::Tier;
use gpu_pods::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde_json::{Value, json};

use crate::review::pointer_token;

/// The pod claims the rewrite adds are named `vcuda-c<container index>`.
pub const CLAIM_PREFIX: &str = "vcuda-";
/// Label on the templates the webhook creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "vcuda-webhook");

#[derive(Debug, Clone)]
pub struct Settings {
    /// Set `spec.schedulerName` of vcuda pods that use the default one.
    pub scheduler_name: Option<String>,
    /// Rewrite vcuda limits into ResourceClaims.
    pub dra: bool,
    /// The device plugins' MIG resources: this prefix and a profile
    /// (`gpu_pods::MIG_RESOURCE_PREFIX` unless the manager's
    /// `--mig-resource-prefix` says otherwise).
    pub mig_prefix: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            scheduler_name: None,
            dra: false,
            mig_prefix: gpu_pods::MIG_RESOURCE_PREFIX.to_string(),
        }
    }
}

/// The operations, and the templates they need in the pod's namespace.
#[derive(Debug, Default)]
pub struct Mutation {
    pub ops: Vec<Value>,
    pub templates: Vec<ResourceClaimTemplate>,
}

const MIB: u64 = 1 << 20;

/// The mutation of `pod` (already found valid by `validate::check_pod`).
pub fn plan(pod: &Pod, s: &Settings) -> Mutation {
    let mut m = Mutation::default();
    let Some(spec) = &pod.spec else { return m };
    let gpu = gpu_pods::gpu_containers(pod);
    let mig = mig_limits(pod, &s.mig_prefix);
    if gpu.is_empty() && mig.is_empty() {
        return m;
    }
    if let Some(name) = &s.scheduler_name
        && !gpu.is_empty()
    {
        let current = spec.scheduler_name.as_deref();
        if current.is_none() || current == Some("default-scheduler") {
            m.ops
                .push(json!({"op": "add", "path": "/spec/schedulerName", "value": name}));
        }
    }
    let has_vcuda_claim = spec
        .resource_claims
        .iter()
        .flatten()
        .any(|c| c.name.starts_with(CLAIM_PREFIX));
    if !s.dra || has_vcuda_claim {
        return m;
    }
    let mut claims = Claims {
        pod,
        exist: spec.resource_claims.is_some(),
    };
    for (index, name) in gpu {
        let c = &spec.containers[index];
        let (cores, units) = (
            gpu_pods::limit(c, VCORE_RESOURCE),
            gpu_pods::limit(c, VMEMORY_RESOURCE),
        );
        let gpus = gpu_pods::gpu_count(pod, &name, usize::MAX).unwrap_or(1);
        // Valid: `validate::check_pod` refused any other tier or limit.
        let qos = Qos {
            tier: gpu_pods::tier(pod).unwrap_or_default(),
            memory_limit: crate::validate::memory_limit(pod, &name, cores, units)
                .ok()
                .flatten(),
        };
        let profile = gpu_pods::mig_profile(pod).ok().flatten();
        let shape = Shape {
            cores,
            units,
            gpus,
            in_mig: profile.as_deref(),
        };
        let t = template(gpu_pods::namespace(pod), shape, qos);
        let claim = format!("{CLAIM_PREFIX}c{index}");
        claims.bind(
            &mut m,
            index,
            &[VCORE_RESOURCE, VMEMORY_RESOURCE],
            &claim,
            t,
        );
    }
    for l in mig {
        let t = mig_template(gpu_pods::namespace(pod), &l.profile, l.count);
        let claim = format!("{CLAIM_PREFIX}m{}-{}", l.index, l.nth);
        claims.bind(&mut m, l.index, &[l.resource.as_str()], &claim, t);
    }
    m
}

/// Claims added to one pod.
struct Claims<'a> {
    pod: &'a Pod,
    /// `spec.resourceClaims` is there (add to it, not make it).
    exist: bool,
}

impl Claims<'_> {
    /// Container `index`'s `resources` leave the pod's limits and requests,
    /// and it gets `claim` from template `t` (added to `m` once).
    fn bind(
        &mut self,
        m: &mut Mutation,
        index: usize,
        resources: &[&str],
        claim: &str,
        t: ResourceClaimTemplate,
    ) {
        let c = &self
            .pod
            .spec
            .as_ref()
            .expect("a pod with containers")
            .containers[index];
        let base = format!("/spec/containers/{index}/resources");
        let res = c.resources.as_ref();
        for (field, map) in [
            ("limits", res.and_then(|r| r.limits.as_ref())),
            ("requests", res.and_then(|r| r.requests.as_ref())),
        ] {
            for r in resources {
                if map.is_some_and(|m| m.contains_key(*r)) {
                    let path = format!("{base}/{field}/{}", pointer_token(r));
                    m.ops.push(json!({"op": "remove", "path": path}));
                }
            }
        }
        let entry = json!({"name": claim, "resourceClaimTemplateName": t.metadata.name});
        m.ops.push(if self.exist {
            json!({"op": "add", "path": "/spec/resourceClaims/-", "value": entry})
        } else {
            json!({"op": "add", "path": "/spec/resourceClaims", "value": [entry]})
        });
        self.exist = true;
        // A container bound once here has `claims` from then on.
        let bound = res.and_then(|r| r.claims.as_ref()).is_some()
            || m.ops.iter().any(|o| o["path"] == format!("{base}/claims"));
        m.ops.push(if bound {
            json!({"op": "add", "path": format!("{base}/claims/-"), "value": {"name": claim}})
        } else {
            json!({"op": "add", "path": format!("{base}/claims"), "value": [{"name": claim}]})
        });
        if !m
            .templates
            .iter()
            .any(|x| x.metadata.name == t.metadata.name)
        {
            m.templates.push(t);
        }
    }
}

/// One container's limit of a MIG resource.
struct MigLimit {
    index: usize,
    /// Which of the container's MIG limits (claim names stay unique).
    nth: usize,
    resource: String,
    profile: String,
    count: u64,
}

/// The MIG resources each container asks for (limits, where extended
/// resources are given).
fn mig_limits(pod: &Pod, prefix: &str) -> Vec<MigLimit> {
    let mut out = Vec::new();
    for (index, c) in pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter().enumerate())
    {
        let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
        let mut nth = 0;
        for (resource, _) in limits.into_iter().flatten() {
            if let Some(profile) = gpu_pods::mig_profile_of(prefix, resource) {
                let count = gpu_pods::limit(c, resource);
                if count > 0 {
                    out.push(MigLimit {
                        index,
                        nth,
                        resource: resource.clone(),
                        profile,
                        count,
                    });
                    nth += 1;
                }
            }
        }
    }
    out
}

/// The template of `count` MIG devices of `profile`
/// (`vcuda-mig-<profile>-<count>`, `+` as `.`).
/// A share's compute tier and memory limit (docs/qos.md).
#[derive(Debug, Clone, Copy, Default)]
pub struct Qos {
    pub tier: Tier,
    pub memory_limit: Option<u64>,
}

/// A share's request moved into a MIG device of `profile`: the MIG class
/// and a selector on the profile, the same capacity.
fn in_profile(name: String, mut request: Value, profile: &str) -> (String, Value) {
    let exactly = &mut request["exactly"];
    exactly["deviceClassName"] = json!(gpu_pods::dra::MIG_CLASS);
    exactly["selectors"] = json!([{"cel": {"expression": profile_selector(profile)}}]);
    (format!("{name}-in-{}", profile.replace('+', ".")), request)
}

fn profile_selector(profile: &str) -> String {
    format!(
        "device.attributes['{}'].{} == '{profile}'",
        gpu_pods::dra::DRIVER_NAME,
        gpu_pods::dra::PROFILE_ATTRIBUTE
    )
}

pub fn mig_template(namespace: &str, profile: &str, count: u64) -> ResourceClaimTemplate {
    let name = format!("vcuda-mig-{}-{count}", profile.replace('+', "."));
    let selector = profile_selector(profile);
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {MANAGED_BY.0: MANAGED_BY.1}},
        "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": gpu_pods::dra::MIG_CLASS, "count": count,
            "selectors": [{"cel": {"expression": selector}}]}}]}}},
    }))
    .expect("a ResourceClaimTemplate")
}

/// A container's vcuda limits: its totals over `gpus` GPUs, inside an
/// instance of MIG profile `in_mig` when the pod names one.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub cores: u64,
    pub units: u64,
    pub gpus: u32,
    pub in_mig: Option<&'a str>,
}

/// The template of a container's totals over `gpus` GPUs: whole GPUs
/// (`vcuda-gpu-<n>`), or a share of `cores` and `units` split evenly
/// (`vcuda-<cores>c-<MiB>mi`, `vcuda-<n>x<cores>c-<MiB>mi` per GPU), or
/// a share inside a MIG device of the pod's profile (the MIG class, a
/// selector on the profile, `-in-<profile>`), with its compute tier and
/// memory limit in the driver's config (`-latency`, `-batch`, `-to<MiB>mi`
/// names).
pub fn template(namespace: &str, shape: Shape<'_>, qos: Qos) -> ResourceClaimTemplate {
    let Shape {
        cores,
        units,
        gpus,
        in_mig,
    } = shape;
    let whole = cores.is_multiple_of(u64::from(WHOLE_GPU_CORES)) && gpus == 1;
    let (name, request) = if whole {
        let n = cores / u64::from(WHOLE_GPU_CORES);
        (
            format!("vcuda-gpu-{n}"),
            json!({"name": "gpu", "exactly": {
                "deviceClassName": gpu_pods::dra::WHOLE_CLASS, "count": n}}),
        )
    } else {
        let n = u64::from(gpus.max(1));
        let (per_cores, per_mib) = (cores / n, units / n * MEMORY_UNIT_BYTES / MIB);
        let name = if n == 1 {
            format!("vcuda-{per_cores}c-{per_mib}mi")
        } else {
            format!("vcuda-{n}x{per_cores}c-{per_mib}mi")
        };
        (
            name,
            json!({"name": "gpu", "exactly": {
                "deviceClassName": gpu_pods::dra::SHARE_CLASS, "count": n,
                "capacity": {"requests": {"cores": per_cores.to_string(), "memory": format!("{per_mib}Mi")}}}}),
        )
    };
    let (name, request) = match in_mig {
        Some(profile) if !whole => in_profile(name, request, profile),
        _ => (name, request),
    };
    let mut devices = json!({"requests": [request]});
    if !whole && gpus > 1 {
        devices["constraints"] = json!([{"distinctAttribute": gpu_pods::dra::UUID_ATTRIBUTE}]);
    }
    let mut name = name;
    if !whole && (!qos.tier.is_plain() || qos.memory_limit.is_some()) {
        use gpu_pods::dra::{CONFIG_API_VERSION, CONFIG_KIND, DRIVER_NAME};
        let mut params = json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND});
        if !qos.tier.is_plain() {
            name = format!("{name}-{}", qos.tier.name());
            params["tier"] = json!(qos.tier.name());
        }
        if let Some(l) = qos.memory_limit {
            // Bytes: the driver reads a quantity, and a plain number is one.
            name = if l % MIB == 0 {
                format!("{name}-to{}mi", l / MIB)
            } else {
                format!("{name}-to{l}b")
            };
            params["memoryLimit"] = json!(l.to_string());
        }
        devices["config"] = json!([{"requests": ["gpu"], "opaque": {"driver": DRIVER_NAME,
            "parameters": params}}]);
    }
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {MANAGED_BY.0: MANAGED_BY.1}},
        "spec": {"spec": {"devices": devices}},
    }))
    .expect("a ResourceClaimTemplate")
}
