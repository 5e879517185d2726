//! Which nodes a watch event can change, so that the cluster view is
//! rebuilt for those nodes only: rebuilt whole it took 30.7 ms at 10,000
//! pods (docs/scheduler.md), paid on nearly every filter call of a busy
//! cluster. A pod concerns the node it is bound to and the node its
//! reservation names (`tencent.com/predicate-node`), before and after the
//! event; a node event, that node; a relist, everything. A reservation
//! also starts or stops counting with time alone
//! ([`Cluster::next_change`]), so those nodes are rebuilt once it passes.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::cluster::Cluster;

/// What changed since the view was last built.
#[derive(Debug)]
pub struct Changes {
    /// Everything (the first view, a relist).
    all: bool,
    nodes: BTreeSet<String>,
    /// Pod UID -> the nodes it concerned when last seen.
    seen: HashMap<String, Vec<String>>,
}

impl Default for Changes {
    fn default() -> Self {
        Changes {
            all: true,
            nodes: BTreeSet::new(),
            seen: HashMap::new(),
        }
    }
}

/// The nodes whose state `pod` can be part of.
fn concerned(pod: &Pod) -> Vec<String> {
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let reserved = gpu_pods::annotation(pod, gpu_pods::PREDICATE_NODE).map(str::to_string);
    bound
        .into_iter()
        .chain(reserved)
        .filter(|n| !n.is_empty())
        .collect()
}

impl Changes {
    /// The watch lists again (its objects follow as [`Changes::pod`]s):
    /// every node may have changed.
    pub fn relist(&mut self) {
        self.all = true;
        self.seen.clear();
    }

    /// Node `name` was added, changed or deleted.
    pub fn node(&mut self, name: &str) {
        self.nodes.insert(name.to_string());
    }

    /// `pod` was added or changed, or (`deleted`) is gone.
    pub fn pod(&mut self, pod: &Pod, deleted: bool) {
        let uid = gpu_pods::uid(pod).to_string();
        let now = concerned(pod);
        let before = if deleted || now.is_empty() {
            self.seen.remove(&uid)
        } else {
            self.seen.insert(uid, now.clone())
        };
        self.nodes.extend(before.into_iter().flatten().chain(now));
    }

    /// What changed since the last call (the pods' nodes stay known).
    pub fn take(&mut self) -> Pending {
        Pending {
            all: std::mem::take(&mut self.all),
            nodes: std::mem::take(&mut self.nodes),
        }
    }
}

/// The changes one rebuild of the view takes in.
#[derive(Debug)]
pub struct Pending {
    all: bool,
    nodes: BTreeSet<String>,
}

impl Pending {
    /// The view with these changes, and the reservations that started or
    /// stopped counting by `now`, rebuilt from the stores' nodes and pods
    /// (`stores`, read only when something changed: a filter call between
    /// events copies neither): `current` itself when nothing changed.
    pub fn apply(
        self,
        current: &Arc<Cluster>,
        stores: impl FnOnce() -> (Vec<Arc<Node>>, Vec<Arc<Pod>>),
        now: SystemTime,
    ) -> Arc<Cluster> {
        let at = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let due = current
            .next_change
            .iter()
            .filter(|(_, t)| **t <= at)
            .map(|(n, _)| n.clone());
        let mut names = self.nodes;
        names.extend(due);
        if !self.all && names.is_empty() {
            return current.clone();
        }
        let (nodes, pods) = stores();
        let nodes_ = nodes.iter().map(|n| &**n);
        let pods_ = pods.iter().map(|p| &**p);
        if self.all {
            return Arc::new(Cluster::build_at(nodes_, pods_, now));
        }
        Arc::new(current.with_nodes_rebuilt(&names, nodes_, pods_, now))
    }
}

#[cfg(test)]
mod tests;
