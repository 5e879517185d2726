//! Which pod is asking: kubelet's Allocate names only device IDs, so the
//! manager picks the pod the way gpu-admission and the original do: pending
//! GPU pods on this node, not yet assigned, ordered by
//! `tencent.com/predicate-time`, then the order they were bound here, then
//! creation, first container whose
//! `vcuda-core` limit equals the request. Pure selection here; reading a
//! pod's requests and annotations is `gpu_pods`'s (shared with the
//! scheduler extender); the API server plumbing is in [`crate::world::kube_api`].

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

pub use gpu_pods::{
    GPU_ASSIGNED, MULTI_GPU_LABEL, PREDICATE_GPU_IDX_PREFIX, PREDICATE_TIME, VCORE_LIMIT,
    VCUDA_GPUS, annotation, assigned_annotations, gpu_containers, gpu_count, is_gpu_container,
    limit, name, namespace, predicate_minors, tier, uid,
};

use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};

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

/// Sort key: predicate time (ns) when gpu-admission or the extender set
/// one (the order they let the scheduler bind); else the order this node's
/// pod watch first saw each pod bound here (`seen`: kubelet admits pods as
/// they arrive on the same watch, which is binding order, not creation
/// order: pods held Pending through a manager restart are bound youngest
/// first, their scheduling backoff being shortest); then creation.
fn order_key(pod: &Pod, seen: Option<u64>) -> (i128, u64, i128, String) {
    let created = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_nanosecond())
        .unwrap_or(0);
    let predicate = annotation(pod, PREDICATE_TIME)
        .and_then(|s| s.parse::<u64>().ok())
        .map_or(i128::MAX, i128::from);
    (
        predicate,
        seen.unwrap_or(u64::MAX),
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
    select_in_order(pods, cores, allocated, withdrawn, |_| None)
}

/// [`select`] with `seen(uid)`: the order the pod watch first saw each pod
/// on this node (see [`order_key`]).
pub fn select_in_order(
    pods: &[Arc<Pod>],
    cores: u64,
    allocated: impl Fn(&str, &str) -> bool,
    withdrawn: impl Fn(&str) -> bool,
    seen: impl Fn(&str) -> Option<u64>,
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
    cands.sort_by_cached_key(|p| (!started(p), order_key(p, seen(uid(p)))));
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

/// Pods bound here that the kubelet has yet to admit (candidates), by
/// namespace/name: a stopping manager serves until none is left, as the
/// scheduler may have bound them before it saw the node's allocatable 0.
pub fn awaiting_admission(pods: &[Arc<Pod>]) -> Vec<String> {
    pods.iter()
        .filter(|p| is_candidate(p))
        .map(|p| format!("{}/{}", namespace(p), name(p)))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

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

    /// Without predicate times, pods go in the order the node's watch saw
    /// them bound (kubelet's admission order), not by creation: pods held
    /// Pending through a manager restart are bound youngest first. Seen on
    /// the real node: two equal pods, the older guessed, the container of
    /// the younger refused ("VcudaWrongPodGuess").
    #[test]
    fn binding_order_before_creation_without_predicate_times() {
        let older = pod("older", None, &[("m", 5, 1)]);
        let younger = pod("younger", None, &[("m", 5, 1)]);
        let pods = vec![older, younger];
        let seen = |u: &str| match u {
            "uid-younger" => Some(1),
            "uid-older" => Some(2),
            _ => None,
        };
        let c = select_in_order(&pods, 5, |_, _| false, |_| false, seen).unwrap();
        assert_eq!(super::name(&c.pod), "younger");
        // Unknown order: creation, as before.
        let c = select(&pods, 5, |_, _| false, |_| false).unwrap();
        assert_eq!(super::name(&c.pod), "older");
        // A predicate time (gpu-admission, the extender) decides first.
        let timed = pod("timed", Some(99), &[("m", 5, 1)]);
        let pods = vec![pods[0].clone(), pods[1].clone(), timed];
        let c = select_in_order(&pods, 5, |_, _| false, |_| false, seen).unwrap();
        assert_eq!(super::name(&c.pod), "timed");
    }

    /// What a stopping manager waits for: pending vcuda pods not yet
    /// assigned; not one assigned, running, deleted or asking no vcuda.
    #[test]
    fn awaiting_admission_is_the_unassigned_pending_gpu_pods() {
        let with = |p: Arc<Pod>, f: &dyn Fn(&mut Pod)| {
            let mut p = (*p).clone();
            f(&mut p);
            Arc::new(p)
        };
        let pods = vec![
            pod("waits", None, &[("a", 30, 4)]),
            with(pod("assigned", None, &[("a", 30, 4)]), &|p| {
                p.metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(GPU_ASSIGNED.into(), "true".into());
            }),
            with(pod("running", None, &[("a", 30, 4)]), &|p| {
                p.status.as_mut().unwrap().phase = Some("Running".into());
            }),
            with(pod("deleted", None, &[("a", 30, 4)]), &|p| {
                p.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        "2024-01-01T00:00:00Z".parse().unwrap(),
                    ));
            }),
            pod("cpu-only", None, &[("a", 0, 0)]),
        ];
        assert_eq!(awaiting_admission(&pods), ["ns/waits"]);
        assert!(awaiting_admission(&pods[1..]).is_empty());
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
        let m = assigned_annotations(&BTreeMap::from([(0, (vec![1, 3], None))]));
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
