//! What the webhook refuses at `kubectl apply`: a request the node would
//! refuse at Allocate (or the DRA driver at Prepare), with the same
//! message, instead of a pod stuck in admission on its node; and
//! placement annotations written by anyone but vcuda.
//!
//! A request is refused only when no vcuda node of the cluster could ever
//! place it, even empty: capacity comes and goes, a shape does not.

use gpu_allocator::inventory::Inventory;
use gpu_allocator::{ErrorKind, Request};
use gpu_pods::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use k8s_openapi::api::core::v1::Pod;

/// A vcuda node as the webhook knows it: its name and published GPUs.
#[derive(Debug, Clone)]
pub struct NodeGpus {
    pub name: String,
    pub inventory: Inventory,
}

/// Why a pod's vcuda request can never be placed; the text names the pod,
/// the container and what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Invalid {
    #[error(
        "pod {pod} container {container}: vcuda-memory {units} without vcuda-core: memory is part of a share, \
         ask for vcuda-core too (1..99 for a share of one GPU)"
    )]
    MemoryWithoutCores {
        pod: String,
        container: String,
        units: u64,
    },
    #[error("{0}")]
    Request(String),
    #[error("pod {pod} container {container}: {problem}")]
    Shape {
        pod: String,
        container: String,
        problem: String,
    },
    #[error(
        "pod {pod} container {container}: no vcuda node can place it (on {node}, the roomiest: {problem})"
    )]
    NoNode {
        pod: String,
        container: String,
        node: String,
        problem: String,
    },
}

fn who(pod: &Pod) -> String {
    format!("{}/{}", gpu_pods::namespace(pod), gpu_pods::name(pod))
}

/// Every container's vcuda request checked against `nodes` (the cluster's
/// vcuda nodes; none known: the checks no node changes).
pub fn check_pod(pod: &Pod, nodes: &[NodeGpus]) -> Result<(), Invalid> {
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
    for c in containers {
        let (cores, units) = (
            gpu_pods::limit(c, VCORE_RESOURCE),
            gpu_pods::limit(c, VMEMORY_RESOURCE),
        );
        if cores == 0 && units > 0 {
            return Err(Invalid::MemoryWithoutCores {
                pod: who(pod),
                container: c.name.clone(),
                units,
            });
        }
        if cores == 0 {
            continue;
        }
        gpu_pods::tier(pod).map_err(Invalid::Request)?;
        gpu_pods::mig_profile(pod).map_err(Invalid::Request)?;
        memory_limit(pod, &c.name, cores, units)?;
        check_container(pod, &c.name, (cores, units), nodes)?;
    }
    Ok(())
}

/// The container's memory limit (`tencent.com/vcuda-memory-limit`), the
/// manager's check.
pub fn memory_limit(
    pod: &Pod,
    container: &str,
    cores: u64,
    units: u64,
) -> Result<Option<u64>, Invalid> {
    let gpus = gpu_pods::gpu_count(pod, container, usize::MAX).unwrap_or(1);
    let whole = cores.is_multiple_of(100) && gpus == 1;
    gpu_pods::memory_limit(pod, whole, gpus, units * gpu_allocator::MEMORY_UNIT_BYTES)
        .map_err(|e| Invalid::Request(format!("pod {} container {container}: {e}", who(pod))))
}

fn check_container(
    pod: &Pod,
    container: &str,
    totals: (u64, u64),
    nodes: &[NodeGpus],
) -> Result<(), Invalid> {
    let shape = |e: gpu_allocator::AllocError| Invalid::Shape {
        pod: who(pod),
        container: container.to_string(),
        problem: e.to_string(),
    };
    // Inside a MIG instance of the pod's profile, when it names one.
    let profile = gpu_pods::mig_profile(pod).ok().flatten();
    if nodes.is_empty() {
        // The GPU count a node would cap is unknown: the annotation's.
        let req = request(pod, container, totals, usize::MAX, true)?;
        return match &profile {
            Some(p) => req.check_in_mig(p),
            None => req.check_shape(),
        }
        .map_err(shape);
    }
    let mut last = None;
    for n in roomiest_first(nodes) {
        let inv = &n.inventory;
        let placed = request(pod, container, totals, inv.gpus.len(), inv.share_mode).map(|req| {
            inv.allocator()
                .evaluate_for(&req, profile.as_deref())
                .map(|_| ())
        });
        match placed {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) if e.kind() != ErrorKind::InvalidRequest => return Ok(()),
            Ok(Err(e)) => {
                last.get_or_insert((n.name.clone(), e.to_string()));
            }
            Err(e) => {
                last.get_or_insert((n.name.clone(), e.to_string()));
            }
        }
    }
    let (node, problem) = last.expect("at least one node");
    Err(Invalid::NoNode {
        pod: who(pod),
        container: container.to_string(),
        node,
        problem,
    })
}

/// The allocator's request for a container, as the manager reads it.
fn request(
    pod: &Pod,
    container: &str,
    totals: (u64, u64),
    node_gpus: usize,
    share_mode: bool,
) -> Result<Request, Invalid> {
    gpu_pods::container_request(pod, container, totals, node_gpus, share_mode).map_err(|e| {
        Invalid::Request(match e {
            gpu_pods::RequestError::Annotation(e) => e,
            gpu_pods::RequestError::Split { gpus, error } => format!(
                "pod {} container {container}: vcuda-core {}, vcuda-memory {} over {gpus} GPU(s): {error}",
                who(pod),
                totals.0,
                totals.1
            ),
        })
    })
}

/// Nodes by their largest GPU, then GPU count, largest first: the first
/// refusal is the one of the node closest to taking the pod.
fn roomiest_first(nodes: &[NodeGpus]) -> Vec<&NodeGpus> {
    let key = |n: &NodeGpus| {
        let largest = n.inventory.gpus.iter().map(|g| g.memory_bytes).max();
        (largest.unwrap_or(0), n.inventory.gpus.len())
    };
    let mut v: Vec<&NodeGpus> = nodes.iter().collect();
    v.sort_by_key(|n| std::cmp::Reverse(key(n)));
    v
}

/// Who may write placement annotations: exact usernames, or a prefix
/// ending in `*` (`system:node:*`).
#[derive(Debug, Clone, Default)]
pub struct Trusted(pub Vec<String>);

impl Trusted {
    pub fn has(&self, user: &str) -> bool {
        self.0.iter().any(|t| match t.strip_suffix('*') {
            Some(prefix) => user.starts_with(prefix),
            None => t == user,
        })
    }
}

/// A placement annotation set or changed (`old`: the pod before an
/// update) by a user vcuda does not run as. Removing one is anyone's
/// right: it only gives GPUs back.
pub fn check_placement_writer(
    pod: &Pod,
    old: Option<&Pod>,
    user: &str,
    trusted: &Trusted,
) -> Result<(), String> {
    if trusted.has(user) {
        return Ok(());
    }
    let now = gpu_pods::placement_annotations(pod);
    let before = old.map(gpu_pods::placement_annotations).unwrap_or_default();
    let changed = now
        .iter()
        .find(|(k, v)| before.get(*k) != Some(v))
        .map(|(k, _)| *k);
    match changed {
        None => Ok(()),
        Some(key) => Err(format!(
            "pod {}: annotation {key} says where the pod's GPUs are and only vcuda writes it \
             (the scheduler extender, the node's manager); {user} is not one of the webhook's \
             --trusted-user. Remove it from the manifest.",
            who(pod)
        )),
    }
}
