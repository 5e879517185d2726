//! The kube-scheduler extender protocol (`k8s.io/kube-scheduler/extender/v1`,
//! JSON over HTTP POST). Its Go types carry no JSON tags, so kube-scheduler
//! sends the Go field names (`Pod`, `NodeNames`, `PodName`, ...) and reads
//! answers case-insensitively: requests are read under both spellings,
//! answers written in lower camel case.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

/// Scores an extender returns are 0..=MAX_PRIORITY (the scheduler scales
/// them by the extender's weight).
pub const MAX_PRIORITY: i64 = 10;

/// What `filter` and `prioritize` are sent: the pod and the candidate
/// nodes, whole (`nodes`) or by name when the extender is
/// `nodeCacheCapable` (`nodenames`).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ExtenderArgs {
    #[serde(alias = "Pod")]
    pub pod: Pod,
    #[serde(default, alias = "Nodes", skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    #[serde(
        default,
        rename = "nodenames",
        alias = "NodeNames",
        skip_serializing_if = "Option::is_none"
    )]
    pub node_names: Option<Vec<String>>,
}

/// The part of a `v1.NodeList` the protocol carries (compared by names).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<Node>,
}

impl PartialEq for NodeList {
    fn eq(&self, other: &Self) -> bool {
        let names = |l: &NodeList| -> Vec<Option<String>> {
            l.items.iter().map(|n| n.metadata.name.clone()).collect()
        };
        names(self) == names(other)
    }
}

impl Eq for NodeList {}

impl ExtenderArgs {
    /// The candidate nodes' names, in the order sent.
    pub fn candidates(&self) -> Vec<String> {
        if let Some(n) = &self.node_names {
            return n.clone();
        }
        self.nodes
            .iter()
            .flat_map(|l| l.items.iter())
            .filter_map(|n| n.metadata.name.clone())
            .collect()
    }
}

/// `filter`'s answer. Nodes in `failed_nodes` may fit later (preemption
/// may help); the scheduler shows every reason in the pod's events.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ExtenderFilterResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    #[serde(default, rename = "nodenames", skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    #[serde(
        default,
        rename = "failedNodes",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub failed_nodes: BTreeMap<String, String>,
    #[serde(
        default,
        rename = "failedAndUnresolvableNodes",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub failed_and_unresolvable: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// One node's score.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct HostPriority {
    pub host: String,
    pub score: i64,
}

/// What `bind` is sent.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "podName", alias = "PodName")]
    pub pod_name: String,
    #[serde(rename = "podNamespace", alias = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "podUID", alias = "PodUID")]
    pub pod_uid: String,
    #[serde(alias = "Node")]
    pub node: String,
}

/// `bind`'s answer: empty `error` on success; an error makes the scheduler
/// put the pod back in its queue (scheduled again, not failed).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ExtenderBindingResult {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_names_are_kube_schedulers() {
        let args: ExtenderArgs = serde_json::from_str(
            r#"{"pod": {"metadata": {"name": "p"}}, "nodenames": ["a", "b"]}"#,
        )
        .unwrap();
        assert_eq!(args.candidates(), ["a", "b"]);
        let args: ExtenderArgs = serde_json::from_str(
            r#"{"pod": {"metadata": {"name": "p"}}, "nodes": {"items": [{"metadata": {"name": "n1"}}]}}"#,
        )
        .unwrap();
        assert_eq!(args.candidates(), ["n1"]);
        let r = ExtenderFilterResult {
            node_names: Some(vec!["a".into()]),
            failed_nodes: [("b".to_string(), "why".to_string())].into(),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"nodenames":["a"],"failedNodes":{"b":"why"}}"#
        );
        // As kube-scheduler's Go types (no JSON tags) marshal them.
        let go: ExtenderArgs = serde_json::from_str(
            r#"{"Pod": {"metadata": {"name": "p"}}, "Nodes": null, "NodeNames": ["a"]}"#,
        )
        .unwrap();
        assert_eq!(go.candidates(), ["a"]);
        let go: ExtenderBindingArgs = serde_json::from_str(
            r#"{"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}"#,
        )
        .unwrap();
        assert_eq!((go.pod_name.as_str(), go.node.as_str()), ("p", "n"));
        let b: ExtenderBindingArgs = serde_json::from_str(
            r#"{"podName": "p", "podNamespace": "ns", "podUID": "u", "node": "n"}"#,
        )
        .unwrap();
        assert_eq!((b.pod_uid.as_str(), b.node.as_str()), ("u", "n"));
        let h = serde_json::to_string(&HostPriority {
            host: "n".into(),
            score: 7,
        })
        .unwrap();
        assert_eq!(h, r#"{"host":"n","score":7}"#);
    }
}
