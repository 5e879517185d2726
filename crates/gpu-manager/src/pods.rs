//! Which pod is asking: kubelet's Allocate names only device IDs, so the
//! manager picks the pod the way gpu-admission and the original do: pending
//! GPU pods on this node, not yet assigned, ordered by
//! `tencent.com/predicate-time` then creation, first container whose
//! `vcuda-core` limit equals the request. Pure selection here; the API
//! server plumbing is in [`crate::kube_api`].

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};

pub const PREDICATE_TIME: &str = "tencent.com/predicate-time";
pub const PREDICATE_GPU_IDX_PREFIX: &str = "tencent.com/predicate-gpu-idx-";
pub const GPU_ASSIGNED: &str = "tencent.com/gpu-assigned";
pub const VCORE_LIMIT: &str = "tencent.com/vcuda-core-limit";
/// JSON map container name -> number of GPUs its share spans
/// (docs/multi-gpu.md); containers it does not name span one.
pub const VCUDA_GPUS: &str = "tencent.com/vcuda-gpus";
/// The node label of a manager that serves [`VCUDA_GPUS`] (share mode, two
/// GPUs or more).
pub const MULTI_GPU_LABEL: &str = "tencent.com/vcuda-multi-gpu";

/// An integer extended-resource limit of a container (0 when absent).
pub fn limit(c: &Container, resource: &str) -> u64 {
    c.resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        .and_then(|q| q.0.trim().parse::<u64>().ok())
        .unwrap_or(0)
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

pub fn namespace(pod: &Pod) -> &str {
    pod.metadata.namespace.as_deref().unwrap_or("default")
}

fn is_gpu_container(c: &Container) -> bool {
    limit(c, VCORE_RESOURCE) > 0
}

/// Pending (or not yet reported), not being deleted, asks for vcuda-core,
/// and gpu-admission / this manager have not marked it assigned.
pub fn is_candidate(pod: &Pod) -> bool {
    is_candidate_unless(pod, false)
}

/// [`is_candidate`]; `withdrawn`: the manager took its own assignment back,
/// whatever the (possibly not yet reverted) annotation says.
pub fn is_candidate_unless(pod: &Pod, withdrawn: bool) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let pending = matches!(phase, None | Some("Pending"));
    let assigned = !withdrawn && annotation(pod, GPU_ASSIGNED).is_some_and(|v| v != "false");
    let gpu = pod
        .spec
        .as_ref()
        .is_some_and(|s| s.containers.iter().any(is_gpu_container));
    pending && !assigned && pod.metadata.deletion_timestamp.is_none() && gpu
}

/// Sort key: predicate time (ns) when gpu-admission set one, else creation.
fn order_key(pod: &Pod) -> (i128, i128, String) {
    let created = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_nanosecond())
        .unwrap_or(0);
    let predicate = annotation(pod, PREDICATE_TIME)
        .and_then(|s| s.parse::<u64>().ok())
        .map(i128::from)
        .unwrap_or(created);
    (
        predicate,
        created,
        format!("{}/{}", namespace(pod), name(pod)),
    )
}

/// The container that an Allocate for `cores` vcuda-core is for.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub pod: Arc<Pod>,
    pub container_index: usize,
    pub container: String,
    /// Its `vcuda-core` and `vcuda-memory` limits: the container's totals.
    pub cores: u64,
    pub memory_units: u64,
}

/// Picks the container. `allocated(uid, container)` says which containers
/// the manager has already served; a pod with some of its GPU containers
/// served comes first (kubelet admits one pod's containers in a row).
pub fn select(
    pods: &[Arc<Pod>],
    cores: u64,
    allocated: impl Fn(&str, &str) -> bool,
    withdrawn: impl Fn(&str) -> bool,
) -> Option<Candidate> {
    let mut cands: Vec<&Arc<Pod>> = pods
        .iter()
        .filter(|p| is_candidate_unless(p, withdrawn(uid(p))))
        .collect();
    let started = |p: &Pod| {
        p.spec.as_ref().is_some_and(|s| {
            s.containers
                .iter()
                .any(|c| is_gpu_container(c) && allocated(uid(p), &c.name))
        })
    };
    cands.sort_by_cached_key(|p| (!started(p), order_key(p)));
    for p in cands {
        let Some(spec) = p.spec.as_ref() else {
            continue;
        };
        for (i, c) in spec.containers.iter().enumerate() {
            if !is_gpu_container(c) || allocated(uid(p), &c.name) {
                continue;
            }
            if limit(c, VCORE_RESOURCE) == cores {
                return Some(Candidate {
                    pod: p.clone(),
                    container_index: i,
                    container: c.name.clone(),
                    cores,
                    memory_units: limit(c, VMEMORY_RESOURCE),
                });
            }
        }
    }
    None
}

/// A readable list of what the pending pods ask, for "no matching pod" errors.
pub fn describe_pending(pods: &[Arc<Pod>]) -> String {
    let mut out = Vec::new();
    for p in pods.iter().filter(|p| is_candidate(p)) {
        for c in p.spec.iter().flat_map(|s| s.containers.iter()) {
            let n = limit(c, VCORE_RESOURCE);
            if n > 0 {
                out.push(format!("{}/{}:{}={n}", namespace(p), name(p), c.name));
            }
        }
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    }
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

/// Annotations patched once every GPU container of a pod is allocated.
pub fn assigned_annotations(per_container: &BTreeMap<usize, Vec<u32>>) -> BTreeMap<String, String> {
    let mut m: BTreeMap<String, String> = per_container
        .iter()
        .map(|(i, minors)| {
            (
                format!("{PREDICATE_GPU_IDX_PREFIX}{i}"),
                minors
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            )
        })
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, predicate: Option<u64>, containers: &[(&str, u64, u64)]) -> Arc<Pod> {
        let mut ann = serde_json::Map::new();
        if let Some(t) = predicate {
            ann.insert(PREDICATE_TIME.into(), json!(t.to_string()));
        }
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
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                             "creationTimestamp": "2024-01-01T00:00:00Z", "annotations": ann},
                "spec": {"containers": cs},
                "status": {"phase": "Pending"}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn predicate_time_then_first_equal_container() {
        let pods = vec![
            pod("late", Some(20), &[("a", 30, 4)]),
            pod(
                "early",
                Some(10),
                &[("side", 0, 0), ("b", 50, 2), ("c", 30, 8)],
            ),
        ];
        let c = select(&pods, 30, |_, _| false, |_| false).unwrap();
        assert_eq!((super::name(&c.pod), c.container.as_str()), ("early", "c"));
        assert_eq!((c.container_index, c.memory_units), (2, 8));
        // Once early/c is served, late/a is next.
        let c = select(&pods, 30, |u, n| u == "uid-early" && n == "c", |_| false).unwrap();
        assert_eq!(super::name(&c.pod), "late");
        assert!(select(&pods, 70, |_, _| false, |_| false).is_none());
        assert_eq!(
            describe_pending(&pods),
            "ns/late:a=30, ns/early:b=50, ns/early:c=30"
        );
    }

    #[test]
    fn started_pod_first_and_assigned_skipped() {
        let pods = vec![
            pod("first", Some(1), &[("x", 100, 0)]),
            pod("multi", Some(5), &[("a", 100, 0), ("b", 100, 0)]),
        ];
        let c = select(&pods, 100, |u, n| u == "uid-multi" && n == "a", |_| false).unwrap();
        assert_eq!((super::name(&c.pod), c.container.as_str()), ("multi", "b"));
        let mut assigned = (*pods[0]).clone();
        assigned
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(GPU_ASSIGNED.into(), "true".into());
        assert!(!is_candidate(&assigned));
    }

    #[test]
    fn predicate_idx_and_assigned_annotations() {
        let mut p = (*pod("p", None, &[("a", 100, 0)])).clone();
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert(format!("{PREDICATE_GPU_IDX_PREFIX}0"), "1,3".into());
        assert_eq!(predicate_minors(&p, 0), Some(Ok(vec![1, 3])));
        assert_eq!(predicate_minors(&p, 1), None);
        let m = assigned_annotations(&BTreeMap::from([(0, vec![1, 3])]));
        assert_eq!(m[&format!("{PREDICATE_GPU_IDX_PREFIX}0")], "1,3");
        assert_eq!(m[GPU_ASSIGNED], "true");
    }

    #[test]
    fn gpu_counts_from_the_annotation_and_its_errors() {
        let with = |v: &str| {
            let mut p = (*pod("p", None, &[("main", 100, 64), ("side", 0, 0)])).clone();
            p.metadata
                .annotations
                .get_or_insert_default()
                .insert(VCUDA_GPUS.into(), v.into());
            p
        };
        let plain = pod("q", None, &[("main", 100, 64)]);
        assert_eq!(gpu_count(&plain, "main", 4), Ok(1));
        assert_eq!(gpu_count(&with(r#"{"main": 2}"#), "main", 4), Ok(2));
        assert_eq!(gpu_count(&with("{}"), "main", 4), Ok(1));
        let err = |v: &str| gpu_count(&with(v), "main", 4).unwrap_err();
        let e = err("main=2");
        assert!(
            e.starts_with(
                "pod ns/p: annotation tencent.com/vcuda-gpus=\"main=2\" is not a JSON object"
            ),
            "{e}"
        );
        let e = err(r#"{"mian": 2}"#);
        assert!(e.contains(r#"names container "mian", which is not one of the pod's containers asking for vcuda-core (main)"#), "{e}");
        // A container without vcuda-core is not a GPU container either.
        assert!(err(r#"{"side": 2}"#).contains(r#"names container "side""#));
        for (v, got) in [
            (r#"{"main": 0}"#, "0"),
            (r#"{"main": 5}"#, "5"),
            (r#"{"main": "2"}"#, "\"2\""),
            (r#"{"main": 1.5}"#, "1.5"),
        ] {
            let e = err(v);
            assert!(
                e.contains(&format!(
                    "gives container \"main\" {got}; a GPU count is an integer from 1 to 4"
                )),
                "{v}: {e}"
            );
        }
    }
}
