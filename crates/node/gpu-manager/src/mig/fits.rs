//! Whether a pending pod could land on this node for reasons other than
//! its MIG devices (pure), so that dynamic MIG ([`super::demand`]) makes no
//! instance for a pod the scheduler would never place here: the pod's
//! `nodeSelector`, its required node affinity, and the node's
//! `NoSchedule`/`NoExecute` taints against its tolerations, as the
//! scheduler's NodeAffinity and TaintToleration plugins judge them
//! (`k8s.io/component-helpers/scheduling/corev1/nodeaffinity` and
//! `helpers.go`'s `TolerationsTolerateTaint`, v0.37). Other resources,
//! ports and spreading are left to the scheduler: an instance made for a
//! pod that goes elsewhere is destroyed after the grace period.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};

/// What of this node the scheduler's filters read.
#[derive(Debug, Clone, Default)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
}

/// The pod's selector, required affinity and tolerations admit `node`.
pub fn fits(pod: &Pod, node: &NodeView) -> bool {
    let Some(spec) = &pod.spec else { return false };
    let selector = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| node.labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    // Terms are ORed; none at all selects no node (the API refuses an
    // empty list, so that is only a malformed pod).
    let affinity =
        required.is_none_or(|r| r.node_selector_terms.iter().any(|t| term_matches(t, node)));
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    let tolerated = node
        .taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .all(|t| tolerations.iter().any(|tol| tolerates(tol, t)));
    selector && affinity && tolerated
}

/// A term matches when all its expressions and fields do; an empty term
/// matches nothing.
fn term_matches(t: &NodeSelectorTerm, node: &NodeView) -> bool {
    let exprs = t.match_expressions.as_deref().unwrap_or_default();
    let fields = t.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let name = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
    exprs.iter().all(|r| requirement(r, &node.labels))
        && fields.iter().all(|r| requirement(r, &name))
}

fn requirement(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let got = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    let compare = |f: fn(i64, i64) -> bool| match (got.and_then(|g| number(g)), values) {
        (Some(g), [v]) => number(v).is_some_and(|v| f(g, v)),
        _ => false,
    };
    match r.operator.as_str() {
        "In" => got.is_some_and(|g| values.contains(g)),
        "NotIn" => got.is_none_or(|g| !values.contains(g)),
        "Exists" => got.is_some(),
        "DoesNotExist" => got.is_none(),
        "Gt" => compare(|g, v| g > v),
        "Lt" => compare(|g, v| g < v),
        _ => false,
    }
}

/// `helpers.go`'s `ToleratesTaint`: an empty effect tolerates every
/// effect; an empty key with `Exists` tolerates every taint.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    let effect = tol.effect.as_deref().unwrap_or("");
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or("");
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" => tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node() -> NodeView {
        NodeView {
            name: "gpu-7".into(),
            labels: BTreeMap::from([
                ("pool".to_string(), "a".to_string()),
                ("gen".to_string(), "9".to_string()),
            ]),
            taints: vec![
                serde_json::from_value(
                    json!({"key": "gpu", "value": "mig", "effect": "NoSchedule"}),
                )
                .unwrap(),
            ],
        }
    }

    fn pod(spec: serde_json::Value) -> Pod {
        let mut s = spec;
        s["containers"] = json!([{"name": "c"}]);
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": s})).unwrap()
    }

    fn tolerating(extra: serde_json::Value) -> serde_json::Value {
        let mut s = extra;
        s["tolerations"] =
            json!([{"key": "gpu", "operator": "Equal", "value": "mig", "effect": "NoSchedule"}]);
        s
    }

    #[test]
    fn taints_need_a_toleration() {
        let n = node();
        assert!(!fits(&pod(json!({})), &n));
        assert!(fits(&pod(tolerating(json!({}))), &n));
        let all = pod(json!({"tolerations": [{"operator": "Exists"}]}));
        assert!(fits(&all, &n));
        let wrong =
            pod(json!({"tolerations": [{"key": "gpu", "value": "whole", "effect": "NoSchedule"}]}));
        assert!(!fits(&wrong, &n));
        let any_value = pod(json!({"tolerations": [{"key": "gpu", "operator": "Exists"}]}));
        assert!(fits(&any_value, &n));
        // A PreferNoSchedule taint filters nothing.
        let mut soft = node();
        soft.taints[0].effect = "PreferNoSchedule".into();
        assert!(fits(&pod(json!({})), &soft));
    }

    #[test]
    fn selector_and_required_affinity() {
        let n = node();
        assert!(fits(
            &pod(tolerating(json!({"nodeSelector": {"pool": "a"}}))),
            &n
        ));
        assert!(!fits(
            &pod(tolerating(json!({"nodeSelector": {"pool": "b"}}))),
            &n
        ));
        let affinity = |terms: serde_json::Value| {
            pod(tolerating(json!({"affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}})))
        };
        let expr = |key: &str, op: &str, values: &[&str]| json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]);
        assert!(fits(&affinity(expr("pool", "In", &["a", "b"])), &n));
        assert!(!fits(&affinity(expr("pool", "NotIn", &["a"])), &n));
        assert!(fits(&affinity(expr("zone", "DoesNotExist", &[])), &n));
        assert!(!fits(&affinity(expr("zone", "Exists", &[])), &n));
        assert!(fits(&affinity(expr("gen", "Gt", &["8"])), &n));
        assert!(!fits(&affinity(expr("gen", "Lt", &["9"])), &n));
        // Terms are ORed.
        let either = json!([
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}
        ]);
        assert!(fits(&affinity(either), &n));
        assert!(
            !fits(&affinity(json!([{}])), &n),
            "an empty term matches nothing"
        );
    }
}
