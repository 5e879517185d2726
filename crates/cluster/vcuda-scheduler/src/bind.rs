//! `bind`: the pod's GPUs chosen from state read fresh from the API server,
//! written where the manager reads them (`tencent.com/predicate-gpu-idx-<i>`,
//! `predicate-node`, `predicate-time`), then the Binding.
//!
//! Concurrent binds (replicas, or one replica's parallel binds) never
//! over-commit a GPU and never lock a node for a bind's duration: each bind
//! (1) reads the node and every pod holding or reserving GPUs on it,
//! (2) chooses, (3) annotates its pod (and labels it
//! `tencent.com/vcuda-node=<node>`, so other binders list it), then
//! (4) bumps the node's `tencent.com/vcuda-bind-seq` with the node's
//! resourceVersion from (1) as precondition. Whoever bumps second gets a
//! Conflict and starts again from (1), now seeing the first's annotated
//! pod. After [`ATTEMPTS`] lost races (or when the pod no longer fits) its
//! annotations are taken back and the bind fails: the scheduler queues the
//! pod again, it is not failed.
//!
//! The Binding (5) carries the reservation's annotations again, and the API
//! server sets them with the node in one write: a second bind of the same
//! pod (the scheduler gave up on a slow first one after its extender
//! timeout and asked again, maybe for another node) may re-annotate the pod
//! between our (3) and (5), and a pod bound to one node with the GPUs
//! chosen on another is a predicate mismatch at the kubelet.

use std::collections::BTreeMap;

use async_trait::async_trait;
use gpu_allocator::Placement;
use gpu_allocator::inventory::Inventory;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::api::{ExtenderBindingArgs, ExtenderBindingResult};
use crate::cluster::{Cluster, PodPlacement};
use crate::policy::Policy;

/// The pod label naming the node a bind in flight reserved GPUs on.
pub const NODE_LABEL: &str = "tencent.com/vcuda-node";
/// The node annotation every successful reservation bumps.
pub const BIND_SEQ: &str = "tencent.com/vcuda-bind-seq";
/// Races lost before a bind gives up (the scheduler retries the pod).
pub const ATTEMPTS: u32 = 8;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApiError {
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("{0}")]
    Other(String),
}

/// What bind needs of the API server.
#[async_trait]
pub trait BindApi: Send + Sync {
    /// The node and every live pod bound to it or labelled [`NODE_LABEL`]
    /// for it, read now (not from a cache).
    async fn fresh(&self, node: &str) -> Result<(Node, Vec<Pod>), ApiError>;
    async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, ApiError>;
    /// Sets (`Some`) or removes (`None`) the pod's annotations and labels,
    /// if its resourceVersion is still `rv`.
    async fn patch_pod(
        &self,
        pod: &Pod,
        annotations: &BTreeMap<String, Option<String>>,
        labels: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError>;
    /// Sets the node's [`BIND_SEQ`] to `seq` if its resourceVersion is
    /// still the one `node` carries.
    async fn bump(&self, node: &Node, seq: u64) -> Result<(), ApiError>;
    /// Binds `pod` to `node`, setting `annotations` in the same write.
    async fn bind(
        &self,
        pod: &Pod,
        node: &str,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError>;
}

/// Binds the pod `args` names to `args.node` (see the module's rules);
/// `default`: the cluster's policy, for the pod's GPUs within the node.
pub async fn bind(
    api: &dyn BindApi,
    args: &ExtenderBindingArgs,
    default: Policy,
) -> ExtenderBindingResult {
    let who = format!("pod {}/{}", args.pod_namespace, args.pod_name);
    match bind_inner(api, args, default).await {
        Ok(placed) => {
            tracing::info!(pod = %who, node = %args.node, gpus = %describe(&placed), "bound");
            ExtenderBindingResult::default()
        }
        Err(e) => {
            tracing::warn!(pod = %who, node = %args.node, "bind failed: {e}");
            ExtenderBindingResult {
                error: format!("{who} on node {}: {e}", args.node),
            }
        }
    }
}

async fn bind_inner(
    api: &dyn BindApi,
    args: &ExtenderBindingArgs,
    default: Policy,
) -> Result<PodPlacement, String> {
    let mut last = String::new();
    for _ in 0..ATTEMPTS {
        let (node, others) = api.fresh(&args.node).await.map_err(|e| e.to_string())?;
        let pod = api
            .pod(&args.pod_namespace, &args.pod_name)
            .await
            .map_err(|e| e.to_string())?;
        if gpu_pods::uid(&pod) != args.pod_uid {
            return Err(format!(
                "the pod now has UID {}, not {}",
                gpu_pods::uid(&pod),
                args.pod_uid
            ));
        }
        refuse(&pod)?;
        let others: Vec<&Pod> = others
            .iter()
            .filter(|p| gpu_pods::uid(p) != args.pod_uid)
            .collect();
        let cluster = Cluster::build([&node], others.iter().copied());
        let spread = Policy::of(&pod, default)? == Policy::Spread;
        let placed = match cluster.fit_with(&args.node, &pod, spread) {
            Ok(p) => p,
            Err(why) => {
                take_back(api, &args.pod_namespace, &args.pod_name).await;
                return Err(no_longer_fits(&why, &others));
            }
        };
        let inv = &cluster.nodes[&args.node].inventory;
        let (ann, labels) = reservation(&args.node, &placed, inv);
        match api.patch_pod(&pod, &ann, &labels).await {
            Ok(()) => {}
            Err(ApiError::Conflict(e)) => {
                last = e;
                continue;
            }
            Err(e) => return Err(e.to_string()),
        }
        match api.bump(&node, seq(&node) + 1).await {
            Ok(()) => {}
            Err(ApiError::Conflict(e)) => {
                last = e;
                continue;
            }
            Err(e) => {
                take_back(api, &args.pod_namespace, &args.pod_name).await;
                return Err(e.to_string());
            }
        }
        api.bind(&pod, &args.node, &ann)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(placed);
    }
    take_back(api, &args.pod_namespace, &args.pod_name).await;
    Err(format!(
        "lost {ATTEMPTS} races for the node's GPUs to other binds (last: {last}); the scheduler will place the pod again"
    ))
}

/// Pods bind never places, whoever asks: `/bind` is reachable by whoever
/// reaches the extender, and must not become a way to place pods past the
/// scheduler's filters (or move other tenants' pods).
fn refuse(pod: &Pod) -> Result<(), String> {
    if !crate::extender::asks_for_gpus(pod) {
        return Err(
            "asks for no tencent.com/vcuda-core: this extender binds only pods whose GPUs it places"
                .into(),
        );
    }
    if let Some(n) = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
    {
        return Err(format!("is already bound to node {n}"));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err("is being deleted".into());
    }
    Ok(())
}

/// Why a bind found no room, and whether other binds' reservations (which
/// may yet be taken back) are part of why: the scheduler tries again.
fn no_longer_fits(why: &str, others: &[&Pod]) -> String {
    let in_flight = others
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
        .count();
    if in_flight == 0 {
        format!("no longer fits: {why}")
    } else {
        format!(
            "no longer fits: {why} ({in_flight} other bind(s) in flight reserve GPUs here; the scheduler will try again)"
        )
    }
}

/// The annotations and label that reserve `placed` on `node` (GPUs by
/// their `/dev/nvidiaN` number, as the manager reads them).
fn reservation(
    node: &str,
    placed: &PodPlacement,
    inv: &Inventory,
) -> (
    BTreeMap<String, Option<String>>,
    BTreeMap<String, Option<String>>,
) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut ann: BTreeMap<String, Option<String>> = BTreeMap::new();
    for (r, p) in placed {
        let minors = p
            .gpus()
            .iter()
            .map(|&g| inv.gpus[g].minor.to_string())
            .collect::<Vec<_>>();
        ann.insert(
            format!("{}{}", gpu_pods::PREDICATE_GPU_IDX_PREFIX, r.index),
            Some(minors.join(",")),
        );
        let instance = match p {
            Placement::InMig { instance, .. } => Some(instance.clone()),
            _ => None,
        };
        ann.insert(
            format!("{}{}", gpu_pods::PREDICATE_MIG_PREFIX, r.index),
            instance,
        );
    }
    ann.insert(gpu_pods::PREDICATE_NODE.into(), Some(node.into()));
    ann.insert(gpu_pods::PREDICATE_TIME.into(), Some(now.to_string()));
    let labels = BTreeMap::from([(NODE_LABEL.to_string(), Some(node.to_string()))]);
    (ann, labels)
}

/// Removes a failed bind's reservation (best effort: a pod that is gone
/// holds nothing; a pod the scheduler retries is re-annotated).
async fn take_back(api: &dyn BindApi, namespace: &str, name: &str) {
    let Ok(pod) = api.pod(namespace, name).await else {
        return;
    };
    let ann = pod.metadata.annotations.clone().unwrap_or_default();
    let gone: BTreeMap<String, Option<String>> = ann
        .keys()
        .filter(|k| gpu_pods::is_placement_key(k))
        .map(|k| (k.clone(), None))
        .collect();
    let labels = BTreeMap::from([(NODE_LABEL.to_string(), None)]);
    if let Err(e) = api.patch_pod(&pod, &gone, &labels).await {
        tracing::warn!(pod = %format!("{namespace}/{name}"), "taking a reservation back: {e}");
    }
}

fn seq(node: &Node) -> u64 {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(BIND_SEQ))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn describe(placed: &PodPlacement) -> String {
    placed
        .iter()
        .map(|(r, p)| format!("{}: {p}", r.name))
        .collect::<Vec<_>>()
        .join("; ")
}
