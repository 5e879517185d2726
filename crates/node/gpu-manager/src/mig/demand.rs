//! What MIG devices pods need on this node (pure), for dynamic MIG in
//! device-plugin mode ([`super::dynamic`]): the devices of the pods bound
//! here that have not ended (held or about to be), and those of pods the
//! scheduler found no node for (`PodScheduled=False`, `Unschedulable`)
//! that could land here otherwise ([`super::fits`]: node selector,
//! required affinity, taints). The latter are what makes instances: every
//! dynamic node they fit sees them, so each may make one; the pod lands on
//! one, and the others' instances, needed by nobody, are destroyed after
//! the grace period.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::fits::{NodeView, fits};

/// A pod waiting for a node that could land here, and the MIG devices it
/// needs per profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub uid: String,
    /// `namespace/name`, for the log.
    pub name: String,
    pub need: BTreeMap<String, usize>,
}

/// The unschedulable pods that could land here and need MIG devices of
/// `profiles` (the names this node can make: a resource of another name
/// is no dynamic node's).
pub fn waiting(
    prefix: &str,
    profiles: &[String],
    unschedulable: &[&Pod],
    node: &NodeView,
) -> Vec<Waiting> {
    unschedulable
        .iter()
        .filter(|p| waits_for_a_node(p) && fits(p, node))
        .filter_map(|pod| {
            let need = need_of(prefix, profiles, pod);
            (!need.is_empty()).then(|| Waiting {
                uid: gpu_pods::uid(pod).to_string(),
                name: format!("{}/{}", gpu_pods::namespace(pod), gpu_pods::name(pod)),
                need,
            })
        })
        .collect()
}

/// Per profile, how many MIG devices the pods bound here that have not
/// ended and the `waiting` ones need.
pub fn needed(
    prefix: &str,
    profiles: &[String],
    bound_here: &[&Pod],
    waiting: &[Waiting],
) -> BTreeMap<String, usize> {
    let mut need: BTreeMap<String, usize> = BTreeMap::new();
    let live = bound_here.iter().filter(|p| !ended(p));
    let of_bound = live.map(|pod| need_of(prefix, profiles, pod));
    for n in of_bound.chain(waiting.iter().map(|w| w.need.clone())) {
        for (p, k) in n {
            *need.entry(p).or_default() += k;
        }
    }
    need
}

fn need_of(prefix: &str, profiles: &[String], pod: &Pod) -> BTreeMap<String, usize> {
    profiles
        .iter()
        .map(|p| {
            (
                p.clone(),
                devices(pod, &gpu_pods::mig_resource_name(prefix, p)),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The devices of `resource` a pod holds at once: its containers run
/// together, its init containers one at a time before them (and hand
/// their devices on), so the larger of the two.
fn devices(pod: &Pod, resource: &str) -> usize {
    let Some(spec) = &pod.spec else { return 0 };
    let of = |c: &Container| gpu_pods::limit(c, resource) as usize;
    let main: usize = spec.containers.iter().map(of).sum();
    let init = spec.init_containers.iter().flatten().map(of).max();
    main.max(init.unwrap_or(0))
}

fn ended(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// Not bound, not being deleted, and told by the scheduler that no node
/// fits it.
fn waits_for_a_node(pod: &Pod) -> bool {
    let unbound = pod
        .spec
        .as_ref()
        .is_some_and(|s| s.node_name.as_deref().unwrap_or("").is_empty());
    let unschedulable = pod
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        });
    unbound && unschedulable && pod.metadata.deletion_timestamp.is_none() && !ended(pod)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PREFIX: &str = "tencent.com/mig-";

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn asking(node: &str, containers: &[(&str, u32)], selector: serde_json::Value) -> Pod {
        let cs: Vec<_> = containers
            .iter()
            .enumerate()
            .map(|(i, (r, n))| {
                json!({"name": format!("c{i}"), "resources": {"limits": {*r: n.to_string()}}})
            })
            .collect();
        pod(json!({
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"nodeName": node, "containers": cs, "nodeSelector": selector},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
            ]}
        }))
    }

    fn profiles() -> Vec<String> {
        vec!["1g.10gb".into(), "3g.40gb".into(), "1g.10gb+me".into()]
    }

    #[test]
    fn pods_bound_here_and_unschedulable_pods_this_node_may_take_add_up() {
        let here = asking(
            "node-a",
            &[
                ("tencent.com/mig-3g.40gb", 1),
                ("tencent.com/mig-1g.10gb", 2),
            ],
            json!({}),
        );
        let waiting_ = asking("", &[("tencent.com/mig-3g.40gb", 1)], json!({"pool": "a"}));
        let elsewhere = asking("", &[("tencent.com/mig-3g.40gb", 1)], json!({"pool": "b"}));
        let media = asking("", &[("tencent.com/mig-1g.10gb.me", 1)], json!({}));
        let node = NodeView {
            labels: BTreeMap::from([("pool".to_string(), "a".to_string())]),
            ..Default::default()
        };
        let w = waiting(PREFIX, &profiles(), &[&waiting_, &elsewhere, &media], &node);
        assert_eq!(w.len(), 2, "{w:?}");
        let need = needed(PREFIX, &profiles(), &[&here], &w);
        assert_eq!(
            need,
            BTreeMap::from([
                ("1g.10gb".to_string(), 2),
                ("3g.40gb".to_string(), 2),
                ("1g.10gb+me".to_string(), 1)
            ])
        );
    }

    #[test]
    fn pods_not_yet_tried_ended_or_being_deleted_need_nothing_new() {
        let mut fresh = asking("", &[("tencent.com/mig-3g.40gb", 1)], json!({}));
        fresh.status.as_mut().unwrap().conditions = None;
        let mut done = asking("node-a", &[("tencent.com/mig-3g.40gb", 1)], json!({}));
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let mut going = asking("", &[("tencent.com/mig-3g.40gb", 1)], json!({}));
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-06T00:00:00Z".parse().unwrap(),
            ));
        let w = waiting(PREFIX, &profiles(), &[&fresh, &going], &NodeView::default());
        assert!(w.is_empty(), "{w:?}");
        let need = needed(PREFIX, &profiles(), &[&done], &w);
        assert!(need.is_empty(), "{need:?}");
    }

    #[test]
    fn init_containers_hand_their_devices_on() {
        let p = pod(json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": "node-a",
                "initContainers": [{"name": "i", "resources": {"limits": {"tencent.com/mig-1g.10gb": "2"}}}],
                "containers": [{"name": "c", "resources": {"limits": {"tencent.com/mig-1g.10gb": "1"}}}]}
        }));
        let need = needed(PREFIX, &profiles(), &[&p], &[]);
        assert_eq!(need, BTreeMap::from([("1g.10gb".to_string(), 2)]));
    }
}
