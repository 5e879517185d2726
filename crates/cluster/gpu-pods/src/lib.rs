//! What a pod asks of vcuda's GPUs and what was decided for it, read the
//! same way by the node's manager (Allocate) and the cluster's scheduler
//! extender (filter, bind): each GPU container's `vcuda-core` /
//! `vcuda-memory` limits, the pod's `tencent.com/vcuda-gpus` map (shares
//! on several GPUs, docs/multi-gpu.md) as the allocator's [`Request`], and
//! gpu-admission's annotations (`tencent.com/predicate-*`), which both
//! honour. Pure functions over `k8s_openapi`'s `Pod`.

use std::collections::BTreeMap;

use gpu_allocator::Request;
use k8s_openapi::api::core::v1::{Container, Pod};
pub use qos_page::Tier;

pub const VCORE_RESOURCE: &str = "tencent.com/vcuda-core";
pub const VMEMORY_RESOURCE: &str = "tencent.com/vcuda-memory";
/// gpu-admission's: the node it chose for the pod.
pub const PREDICATE_NODE: &str = "tencent.com/predicate-node";
pub const PREDICATE_TIME: &str = "tencent.com/predicate-time";
pub const PREDICATE_GPU_IDX_PREFIX: &str = "tencent.com/predicate-gpu-idx-";
/// vcuda's, beside `predicate-gpu-idx-<i>` (the instance's GPU): the MIG
/// instance (its UUID) a share inside one was placed in.
pub const PREDICATE_MIG_PREFIX: &str = "tencent.com/predicate-mig-";
/// The MIG profile (`2g.20gb`) whose instance a pod's shares go inside
/// (docs/mig.md, *Shares inside an instance*); every vcuda container of
/// the pod. Without it, shares go on whole GPUs.
pub const VCUDA_MIG_PROFILE: &str = "tencent.com/vcuda-mig-profile";
pub const GPU_ASSIGNED: &str = "tencent.com/gpu-assigned";
pub const VCORE_LIMIT: &str = "tencent.com/vcuda-core-limit";
/// A share's compute tier (docs/qos.md): `latency`, `batch` or `plain`.
/// Without it, the pod's PriorityClass decides ([`tier`]).
pub const VCUDA_TIER: &str = "tencent.com/vcuda-tier";
/// Pods of these PriorityClasses are latency- or batch-tier shares when
/// they carry no [`VCUDA_TIER`] (classes the cluster's administrators make:
/// vcuda creates none, a class's value is a scheduling decision).
pub const LATENCY_PRIORITY_CLASS: &str = "vcuda-latency";
pub const BATCH_PRIORITY_CLASS: &str = "vcuda-batch";
/// Memory a one-GPU share may borrow up to, above its `vcuda-memory`
/// (a quantity: `12Gi`; docs/qos.md, "Memory"): extended resources must
/// have requests equal to limits, so the limit rides on the pod. It
/// applies to each sharing container of the pod.
pub const VCUDA_MEMORY_LIMIT: &str = "tencent.com/vcuda-memory-limit";
/// JSON map container name -> number of GPUs its share spans
/// (docs/multi-gpu.md); containers it does not name span one.
pub const VCUDA_GPUS: &str = "tencent.com/vcuda-gpus";
/// The node label of a manager that serves [`VCUDA_GPUS`] (share mode, two
/// GPUs or more).
pub const MULTI_GPU_LABEL: &str = "tencent.com/vcuda-multi-gpu";

/// The names a DRA claim for vcuda uses (docs/dra.md): the driver
/// publishes them, the webhook's rewrite of a pod's limits asks for them.
pub mod dra {
    pub const DRIVER_NAME: &str = "vcuda.tencent.com";
    /// DeviceClass for shares: any vcuda GPU; the claim says how much with
    /// `capacity.requests` (`cores`, `memory`).
    pub const SHARE_CLASS: &str = "vcuda-share.vcuda.tencent.com";
    /// DeviceClass for whole GPUs: the defaults (all cores, all memory),
    /// the untouched driver.
    pub const WHOLE_CLASS: &str = "vcuda-gpu.vcuda.tencent.com";
    /// The extended resource the whole-GPU class maps (KEP-5004,
    /// `extendedResourceName`, GA in 1.37): a container's
    /// `limits: {vcuda.tencent.com/gpu: 2}` is two whole GPUs through DRA,
    /// no claim written. One device of that class is one GPU, so a count of
    /// devices means what it says; a share cannot be asked this way (30
    /// would be 30 devices), which is what the webhook's rewrite is for.
    pub const WHOLE_RESOURCE: &str = "vcuda.tencent.com/gpu";
    /// The device attribute naming its GPU (`distinctAttribute` keeps the
    /// shares of one claim on different GPUs).
    pub const UUID_ATTRIBUTE: &str = "vcuda.tencent.com/uuid";
    /// The device taint of a GPU with a recent critical Xid (KEP-5055); its
    /// value names the Xid (`xid-79`), so a claim can tolerate one kind.
    pub const UNHEALTHY_TAINT: &str = "vcuda.tencent.com/unhealthy";
    /// DeviceClass for MIG devices, taken whole; a claim picks a profile
    /// with a selector on [`PROFILE_ATTRIBUTE`].
    pub const MIG_CLASS: &str = "vcuda-mig.vcuda.tencent.com";
    /// A MIG device's profile (`1g.10gb`), under the driver's domain.
    pub const PROFILE_ATTRIBUTE: &str = "profile";
    /// The driver's opaque device configuration (`coreLimit`, `tier`, …).
    pub const CONFIG_API_VERSION: &str = "vcuda.tencent.com/v1alpha1";
    pub const CONFIG_KIND: &str = "GpuConfig";
}

/// Device-plugin mode's MIG resources are this prefix and a profile
/// (`tencent.com/mig-3g.40gb`; `--mig-resource-prefix` changes it).
pub const MIG_RESOURCE_PREFIX: &str = "tencent.com/mig-";

/// The MIG profile a resource name of `prefix` stands for: a `+` of the
/// profile (`1g.10gb+me`) is no resource-name character, so names carry
/// it as `.` (`1g.10gb.me`), as NVIDIA's plugin does.
pub fn mig_profile_of(prefix: &str, resource: &str) -> Option<String> {
    let rest = resource.strip_prefix(prefix).filter(|r| !r.is_empty())?;
    Some(match rest.strip_suffix(".me") {
        Some(base) => format!("{base}+me"),
        None => rest.to_string(),
    })
}

/// The resource name of MIG `profile` under `prefix`.
pub fn mig_resource_name(prefix: &str, profile: &str) -> String {
    format!("{prefix}{}", profile.replace('+', "."))
}

/// Annotations only vcuda writes (the extender's bind, the manager):
/// where a pod's GPUs are. A pod's owner who could write them would
/// hold GPUs without being placed.
pub fn placement_annotations(pod: &Pod) -> BTreeMap<&str, &str> {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| is_placement_key(k) || k.as_str() == GPU_ASSIGNED)
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// A key of a placement's reservation (what a bind writes and takes back).
pub fn is_placement_key(k: &str) -> bool {
    k == PREDICATE_NODE
        || k == PREDICATE_TIME
        || k.starts_with(PREDICATE_GPU_IDX_PREFIX)
        || k.starts_with(PREDICATE_MIG_PREFIX)
}

/// A MIG profile name as NVIDIA's tools print it: `<n>g.<m>gb`, an
/// optional `+me`-style suffix (`1g.10gb+me`, `1g.20gb+gfx`).
pub fn is_mig_profile_name(p: &str) -> bool {
    let (base, suffix) = p.split_once('+').unwrap_or((p, ""));
    let Some((g, mem)) = base.split_once("g.") else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(g)
        && mem.strip_suffix("gb").is_some_and(digits)
        && suffix.bytes().all(|b| b.is_ascii_lowercase())
        && p.contains('+') != suffix.is_empty()
}

/// The pod's [`VCUDA_MIG_PROFILE`]: `None` without it; an error naming the
/// pod and the value when it is no profile name.
pub fn mig_profile(pod: &Pod) -> Result<Option<String>, String> {
    let Some(v) = annotation(pod, VCUDA_MIG_PROFILE) else {
        return Ok(None);
    };
    if !is_mig_profile_name(v) {
        return Err(format!(
            "pod {}/{}: annotation {VCUDA_MIG_PROFILE}={v:?} is not a MIG profile name (as nvidia-smi prints them: 1g.10gb, 2g.20gb, 3g.40gb)",
            namespace(pod),
            name(pod)
        ));
    }
    Ok(Some(v.to_string()))
}

/// `tencent.com/predicate-mig-<i>`: the instance a share inside one was
/// placed in.
pub fn predicate_instance(pod: &Pod, container_index: usize) -> Option<&str> {
    annotation(pod, &format!("{PREDICATE_MIG_PREFIX}{container_index}"))
}

/// An integer extended-resource limit of a container (0 when absent).
pub fn limit(c: &Container, resource: &str) -> u64 {
    c.resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        .and_then(|q| integer_quantity(&q.0))
        .unwrap_or(0)
}

/// An integer resource quantity as the API server stores it: it writes
/// 1000 back as `1k` and 2000000 as `2M` (canonical decimal SI), and
/// accepts `1e3` and binary suffixes (`1Ki`). `None`: not a whole number.
pub fn integer_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let scale: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        e => {
            let exp: u32 = e.strip_prefix(['e', 'E'])?.parse().ok()?;
            10u64.checked_pow(exp)?
        }
    };
    n.checked_mul(scale)
}

pub fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

pub fn uid(pod: &Pod) -> &str {
    pod.metadata.uid.as_deref().unwrap_or("")
}

pub fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or("")
}

/// The compute tier the pod's shares run in: its [`VCUDA_TIER`]
/// annotation, else its PriorityClass ([`LATENCY_PRIORITY_CLASS`],
/// [`BATCH_PRIORITY_CLASS`]), else plain. Err: the annotation names no
/// tier (the message names the pod and the value).
pub fn tier(pod: &Pod) -> Result<Tier, String> {
    if let Some(v) = annotation(pod, VCUDA_TIER) {
        return Tier::parse(v.trim()).map_err(|e| {
            format!(
                "pod {}/{}: annotation {VCUDA_TIER}: {e}",
                namespace(pod),
                name(pod)
            )
        });
    }
    let class = pod
        .spec
        .as_ref()
        .and_then(|s| s.priority_class_name.as_deref());
    Ok(match class {
        Some(LATENCY_PRIORITY_CLASS) => Tier::Latency,
        Some(BATCH_PRIORITY_CLASS) => Tier::Batch,
        _ => Tier::Plain,
    })
}

/// Why a memory limit does not apply to a share (docs/qos.md, "Memory").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitProblem {
    /// The share is whole GPUs.
    Whole,
    /// It spans this many GPUs.
    Spans(u32),
    /// The limit is below the share's memory.
    Below,
}

/// The rule both modes apply to a memory limit of `limit` bytes on a share
/// of `memory` bytes on `gpus` GPUs (`whole`: whole GPUs): only a one-GPU
/// share takes one, not below its memory; equal to it is no limit.
pub fn check_memory_limit(
    limit: u64,
    whole: bool,
    gpus: u32,
    memory: u64,
) -> Result<Option<u64>, LimitProblem> {
    match limit {
        _ if whole => Err(LimitProblem::Whole),
        _ if gpus > 1 => Err(LimitProblem::Spans(gpus)),
        l if l < memory => Err(LimitProblem::Below),
        l if l == memory => Ok(None),
        l => Ok(Some(l)),
    }
}

/// The pod's memory limit ([`VCUDA_MEMORY_LIMIT`]) for a container's
/// share of `memory` bytes on `gpus` GPUs (`whole`: whole GPUs), if it
/// has one ([`check_memory_limit`]). The error names the annotation and
/// what is wrong.
pub fn memory_limit(pod: &Pod, whole: bool, gpus: u32, memory: u64) -> Result<Option<u64>, String> {
    let Some(v) = annotation(pod, VCUDA_MEMORY_LIMIT) else {
        return Ok(None);
    };
    let bad = |why: String| format!("annotation {VCUDA_MEMORY_LIMIT}={v:?} {why}");
    let limit = integer_quantity(v)
        .ok_or_else(|| bad("is not a quantity of bytes (12Gi, 12884901888)".into()))?;
    check_memory_limit(limit, whole, gpus, memory).map_err(|p| {
        bad(match p {
            LimitProblem::Whole => "applies to shares, not to whole GPUs".into(),
            LimitProblem::Spans(n) => format!("applies to one-GPU shares; this one spans {n}"),
            LimitProblem::Below => format!("is below the container's vcuda-memory, {memory} bytes"),
        })
    })
}

pub fn namespace(pod: &Pod) -> &str {
    pod.metadata.namespace.as_deref().unwrap_or("default")
}

/// Asks for `vcuda-core`.
pub fn is_gpu_container(c: &Container) -> bool {
    limit(c, VCORE_RESOURCE) > 0
}

/// `tencent.com/predicate-gpu-idx-<i>` parsed: the GPU minors gpu-admission chose.
pub fn predicate_minors(pod: &Pod, container_index: usize) -> Option<Result<Vec<u32>, String>> {
    let key = format!("{PREDICATE_GPU_IDX_PREFIX}{container_index}");
    let v = annotation(pod, &key)?;
    Some(
        v.split(',')
            .map(|s| {
                let s = s.trim();
                s.strip_prefix("/dev/nvidia")
                    .unwrap_or(s)
                    .parse::<u32>()
                    .map_err(|_| format!("annotation {key}={v:?} is not a list of GPU indices"))
            })
            .collect(),
    )
}

/// How many GPUs `container`'s share spans: its count in the pod's
/// [`VCUDA_GPUS`] map, 1 when the pod has no map or the map does not name
/// it. The whole map is checked (JSON object of the pod's GPU containers to
/// integers 1..=`node_gpus`); the error names the pod, the key and the
/// problem.
pub fn gpu_count(pod: &Pod, container: &str, node_gpus: usize) -> Result<u32, String> {
    let Some(v) = annotation(pod, VCUDA_GPUS) else {
        return Ok(1);
    };
    let bad = |problem: String| {
        format!(
            "pod {}/{}: annotation {VCUDA_GPUS}={v:?} {problem}",
            namespace(pod),
            name(pod)
        )
    };
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_str(v).map_err(|e| {
        bad(format!(
            "is not a JSON object of container name to GPU count ({e}), e.g. {{\"main\": 2}}"
        ))
    })?;
    let gpu = gpu_containers(pod);
    let mut mine = 1;
    for (c, n) in &map {
        if !gpu.iter().any(|(_, g)| g == c) {
            let names: Vec<&str> = gpu.iter().map(|(_, g)| g.as_str()).collect();
            return Err(bad(format!(
                "names container {c:?}, which is not one of the pod's containers asking for \
                 vcuda-core ({})",
                names.join(", ")
            )));
        }
        let count = n
            .as_u64()
            .filter(|&k| k >= 1 && k <= node_gpus as u64)
            .ok_or_else(|| {
                bad(format!(
                    "gives container {c:?} {n}; a GPU count is an integer from 1 to {node_gpus} \
                     (the GPUs of this node)"
                ))
            })?;
        if c == container {
            mine = count as u32;
        }
    }
    Ok(mine)
}

/// The share recorded inside MIG instance `instance` (`predicate-mig-<i>`)
/// of the one GPU in `gpus` (`predicate-gpu-idx-<i>`) for `req` of a pod
/// asking for `profile`; whether it still fits is the allocator's commit to
/// say. The error says which half of the record is missing or wrong.
pub fn recorded_in_instance(
    req: &Request,
    profile: Option<&str>,
    gpus: &[usize],
    instance: Option<&str>,
) -> Result<gpu_allocator::Placement, String> {
    let (Some(profile), Some(uuid)) = (profile, instance) else {
        let (has, lacks) = match instance {
            Some(_) => (PREDICATE_MIG_PREFIX, VCUDA_MIG_PROFILE),
            None => (VCUDA_MIG_PROFILE, PREDICATE_MIG_PREFIX),
        };
        return Err(format!(
            "{has}… without {lacks}…: a share inside a MIG instance is recorded with both"
        ));
    };
    let [gpu] = gpus else {
        return Err(format!(
            "a share inside a {profile} instance is on one GPU, {} recorded",
            gpus.len()
        ));
    };
    Ok(gpu_allocator::Placement::InMig {
        gpu: *gpu,
        instance: uuid.to_string(),
        cores: req.cores,
        memory_units: req.memory_units,
    })
}

/// Annotations patched once every GPU container of a pod is allocated:
/// each container's GPU minors, and its MIG instance when its share is
/// inside one.
pub fn assigned_annotations(
    per_container: &BTreeMap<usize, (Vec<u32>, Option<String>)>,
) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for (i, (minors, instance)) in per_container {
        let minors = minors.iter().map(u32::to_string).collect::<Vec<_>>();
        m.insert(format!("{PREDICATE_GPU_IDX_PREFIX}{i}"), minors.join(","));
        if let Some(uuid) = instance {
            m.insert(format!("{PREDICATE_MIG_PREFIX}{i}"), uuid.clone());
        }
    }
    m.insert(GPU_ASSIGNED.to_string(), "true".to_string());
    m
}

/// Indices of the pod's containers that ask for vcuda-core.
pub fn gpu_containers(pod: &Pod) -> Vec<(usize, String)> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter().enumerate())
        .filter(|(_, c)| is_gpu_container(c))
        .map(|(i, c)| (i, c.name.clone()))
        .collect()
}

/// One GPU container's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerRequest {
    /// Its index in the pod spec (`predicate-gpu-idx-<index>`).
    pub index: usize,
    pub name: String,
    pub request: Request,
    /// Inside an instance of this MIG profile ([`VCUDA_MIG_PROFILE`]).
    pub mig_profile: Option<String>,
}

/// Why a container's limits make no request.
#[derive(Debug)]
pub enum RequestError {
    /// The pod's `vcuda-gpus` annotation is malformed (the text names the
    /// pod, the key and the problem).
    Annotation(String),
    /// The totals do not split over the `gpus` the annotation gives.
    Split {
        gpus: u32,
        error: gpu_allocator::AllocError,
    },
}

/// The allocator's request for container `container` of `pod`, whose
/// limits are `cores` and `units`: those totals over the GPUs the pod's
/// `vcuda-gpus` map gives it (one when it does not name it), on a node of
/// `node_gpus` GPUs (`share_mode`: the node places shares). The manager's
/// Allocate and the extender's filter both ask this, so they agree.
pub fn container_request(
    pod: &Pod,
    container: &str,
    (cores, units): (u64, u64),
    node_gpus: usize,
    share_mode: bool,
) -> Result<Request, RequestError> {
    let n = gpu_count(pod, container, node_gpus).map_err(RequestError::Annotation)?;
    Request::from_totals(cores, units, n, share_mode)
        .map_err(|error| RequestError::Split { gpus: n, error })
}

/// What each GPU container of `pod` asks of a node with `node_gpus` GPUs
/// ([`container_request`] of each). The error names the pod, the
/// container and what is wrong.
pub fn requests(
    pod: &Pod,
    node_gpus: usize,
    share_mode: bool,
) -> Result<Vec<ContainerRequest>, String> {
    let mig_profile = mig_profile(pod)?;
    let mut out = Vec::new();
    let spec = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter().enumerate());
    for (index, c) in spec.filter(|(_, c)| is_gpu_container(c)) {
        let (cores, units) = (limit(c, VCORE_RESOURCE), limit(c, VMEMORY_RESOURCE));
        let request = container_request(pod, &c.name, (cores, units), node_gpus, share_mode)
            .map_err(|e| match e {
                RequestError::Annotation(e) => e,
                RequestError::Split { gpus, error } => format!(
                    "pod {}/{} container {}: vcuda-core {cores}, vcuda-memory {units} over {gpus} GPU(s): {error}",
                    namespace(pod),
                    name(pod),
                    c.name
                ),
            })?;
        out.push(ContainerRequest {
            index,
            name: c.name.clone(),
            request,
            mig_profile: mig_profile.clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_memory_limit_applies_to_one_gpu_shares_not_below_their_memory() {
        const G: u64 = 1 << 30;
        assert_eq!(
            check_memory_limit(12 * G, false, 1, 4 * G),
            Ok(Some(12 * G))
        );
        assert_eq!(check_memory_limit(4 * G, false, 1, 4 * G), Ok(None));
        assert_eq!(
            check_memory_limit(2 * G, false, 1, 4 * G),
            Err(LimitProblem::Below)
        );
        assert_eq!(
            check_memory_limit(12 * G, true, 1, 4 * G),
            Err(LimitProblem::Whole)
        );
        assert_eq!(
            check_memory_limit(12 * G, false, 2, 4 * G),
            Err(LimitProblem::Spans(2))
        );
    }

    fn pod(annotations: serde_json::Value, containers: &[(&str, u64, u64)]) -> Pod {
        let cs: Vec<_> = containers
            .iter()
            .map(|(n, core, mem)| {
                let mut l = serde_json::Map::new();
                if *core > 0 {
                    l.insert(VCORE_RESOURCE.into(), json!(core.to_string()));
                }
                if *mem > 0 {
                    l.insert(VMEMORY_RESOURCE.into(), json!(mem.to_string()));
                }
                json!({"name": n, "resources": {"limits": l}})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "annotations": annotations},
            "spec": {"containers": cs}
        }))
        .unwrap()
    }

    #[test]
    fn the_tier_comes_from_the_annotation_then_the_priority_class() {
        let with_class = |ann: serde_json::Value, class: &str| {
            let mut p = pod(ann, &[("main", 30, 8)]);
            p.spec.as_mut().unwrap().priority_class_name = Some(class.into());
            p
        };
        let t = |p: &Pod| tier(p);
        assert_eq!(t(&pod(json!({}), &[("main", 30, 8)])), Ok(Tier::Plain));
        assert_eq!(
            t(&with_class(json!({}), LATENCY_PRIORITY_CLASS)),
            Ok(Tier::Latency)
        );
        assert_eq!(
            t(&with_class(json!({}), BATCH_PRIORITY_CLASS)),
            Ok(Tier::Batch)
        );
        assert_eq!(
            t(&with_class(json!({}), "system-node-critical")),
            Ok(Tier::Plain)
        );
        // The annotation wins over the class.
        let p = with_class(json!({VCUDA_TIER: "batch"}), LATENCY_PRIORITY_CLASS);
        assert_eq!(t(&p), Ok(Tier::Batch));
        let e = t(&pod(json!({VCUDA_TIER: "gold"}), &[("main", 30, 8)])).unwrap_err();
        assert!(
            e.contains("ns/p") && e.contains(VCUDA_TIER) && e.contains("\"gold\""),
            "{e}"
        );
    }

    /// What the API server writes back for integer quantities
    /// (k8s.io/apimachinery resource.Quantity, canonical DecimalSI): seen
    /// on the 1.20 API server, `vcuda-memory: 1000` read back as `1k`.
    #[test]
    fn integer_quantities_in_every_form_the_api_server_writes() {
        for (s, n) in [
            ("30", Some(30)),
            ("1k", Some(1000)),
            ("2M", Some(2_000_000)),
            ("1e3", Some(1000)),
            ("1Ki", Some(1024)),
            ("1500", Some(1500)),
            (" 8 ", Some(8)),
            ("1.5", None),
            ("500m", None),
            ("-3", None),
            ("k", None),
            ("99999999999E", None),
        ] {
            assert_eq!(integer_quantity(s), n, "{s}");
        }
        let p = pod(json!({}), &[("main", 0, 0)]);
        let mut c = p.spec.unwrap().containers[0].clone();
        let q = k8s_openapi::apimachinery::pkg::api::resource::Quantity("1k".into());
        c.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
            limits: Some([(VMEMORY_RESOURCE.to_string(), q)].into()),
            ..Default::default()
        });
        assert_eq!(limit(&c, VMEMORY_RESOURCE), 1000);
    }

    #[test]
    fn each_gpu_container_asks_what_the_manager_will_place() {
        let p = pod(
            json!({VCUDA_GPUS: r#"{"tp": 2}"#}),
            &[
                ("side", 0, 0),
                ("one", 30, 8),
                ("tp", 100, 64),
                ("whole", 200, 0),
            ],
        );
        let r = requests(&p, 4, true).unwrap();
        let got: Vec<_> = r
            .iter()
            .map(|c| (c.index, c.name.as_str(), c.request))
            .collect();
        assert_eq!(
            got,
            [
                (1, "one", Request::share(30, 8)),
                (2, "tp", Request::shares(2, 50, 32)),
                (3, "whole", Request::whole(2)),
            ]
        );
    }

    #[test]
    fn a_request_that_does_not_split_names_pod_and_container() {
        let p = pod(json!({VCUDA_GPUS: r#"{"tp": 2}"#}), &[("tp", 81, 64)]);
        let e = requests(&p, 4, true).unwrap_err();
        assert!(e.starts_with("pod ns/p container tp: vcuda-core 81"), "{e}");
        assert!(e.contains("does not split evenly"), "{e}");
        let e = requests(&pod(json!({VCUDA_GPUS: "x"}), &[("tp", 50, 8)]), 4, true).unwrap_err();
        assert!(e.contains("is not a JSON object"), "{e}");
    }

    #[test]
    fn a_mig_profile_rides_on_every_request_and_bad_names_are_refused() {
        for (name, ok) in [
            ("2g.20gb", true),
            ("1g.10gb+me", true),
            ("7g.80gb", true),
            ("2g.20", false),
            ("g.20gb", false),
            ("2g.20gb+", false),
            ("2g.20gb+ME", false),
            ("3g.40gb ", false),
            ("", false),
        ] {
            assert_eq!(is_mig_profile_name(name), ok, "{name:?}");
        }
        let p = pod(
            json!({VCUDA_MIG_PROFILE: "2g.20gb"}),
            &[("a", 50, 20), ("b", 30, 8)],
        );
        let r = requests(&p, 2, true).unwrap();
        assert!(
            r.iter()
                .all(|c| c.mig_profile.as_deref() == Some("2g.20gb"))
        );
        let e = requests(
            &pod(json!({VCUDA_MIG_PROFILE: "big"}), &[("a", 50, 20)]),
            2,
            true,
        )
        .unwrap_err();
        assert!(
            e.contains("ns/p") && e.contains("\"big\" is not a MIG profile name"),
            "{e}"
        );
        let m = assigned_annotations(&BTreeMap::from([
            (0, (vec![1], Some("MIG-x".to_string()))),
            (1, (vec![0, 2], None)),
        ]));
        assert_eq!(m[&format!("{PREDICATE_MIG_PREFIX}0")], "MIG-x");
        assert_eq!(m[&format!("{PREDICATE_GPU_IDX_PREFIX}1")], "0,2");
        assert!(!m.contains_key(&format!("{PREDICATE_MIG_PREFIX}1")));
        assert!(is_placement_key("tencent.com/predicate-mig-0"));
    }
}
