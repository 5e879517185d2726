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
//!   claim is left as it is.

use gpu_allocator::{MEMORY_UNIT_BYTES, WHOLE_GPU_CORES};
use gpu_pods::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde_json::{Value, json};

use crate::review::pointer_token;

/// The pod claims the rewrite adds are named `vcuda-c<container index>`.
pub const CLAIM_PREFIX: &str = "vcuda-";
/// Label on the templates the webhook creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "vcuda-webhook");

#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Set `spec.schedulerName` of vcuda pods that use the default one.
    pub scheduler_name: Option<String>,
    /// Rewrite vcuda limits into ResourceClaims.
    pub dra: bool,
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
    let gpu = gpu_pods::gpu_containers(pod);
    let spec = match &pod.spec {
        Some(spec) if !gpu.is_empty() => spec,
        _ => return m,
    };
    if let Some(name) = &s.scheduler_name {
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
    let mut claims_exist = spec.resource_claims.is_some();
    for (index, name) in gpu {
        let c = &spec.containers[index];
        let (cores, units) = (
            gpu_pods::limit(c, VCORE_RESOURCE),
            gpu_pods::limit(c, VMEMORY_RESOURCE),
        );
        let gpus = gpu_pods::gpu_count(pod, &name, usize::MAX).unwrap_or(1);
        let t = template(gpu_pods::namespace(pod), cores, units, gpus);
        let claim = format!("{CLAIM_PREFIX}c{index}");
        let base = format!("/spec/containers/{index}/resources");
        let res = c.resources.as_ref();
        for (field, map) in [
            ("limits", res.and_then(|r| r.limits.as_ref())),
            ("requests", res.and_then(|r| r.requests.as_ref())),
        ] {
            for r in [VCORE_RESOURCE, VMEMORY_RESOURCE] {
                if map.is_some_and(|m| m.contains_key(r)) {
                    let path = format!("{base}/{field}/{}", pointer_token(r));
                    m.ops.push(json!({"op": "remove", "path": path}));
                }
            }
        }
        let entry = json!({"name": claim, "resourceClaimTemplateName": t.metadata.name});
        m.ops.push(if claims_exist {
            json!({"op": "add", "path": "/spec/resourceClaims/-", "value": entry})
        } else {
            json!({"op": "add", "path": "/spec/resourceClaims", "value": [entry]})
        });
        claims_exist = true;
        let bound = res.and_then(|r| r.claims.as_ref()).is_some();
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
    m
}

/// The template of a container's totals over `gpus` GPUs: whole GPUs
/// (`vcuda-gpu-<n>`), or a share of `cores` and `units` split evenly
/// (`vcuda-<cores>c-<MiB>mi`, `vcuda-<n>x<cores>c-<MiB>mi` per GPU).
pub fn template(namespace: &str, cores: u64, units: u64, gpus: u32) -> ResourceClaimTemplate {
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
    let mut devices = json!({"requests": [request]});
    if !whole && gpus > 1 {
        devices["constraints"] = json!([{"distinctAttribute": gpu_pods::dra::UUID_ATTRIBUTE}]);
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
