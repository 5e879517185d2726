//! The cluster as the extender sees it, rebuilt from API objects alone:
//! each vcuda node's GPUs from the inventory its manager publishes
//! (`gpu_allocator::inventory`), and what is placed on them from the pods
//! that hold GPUs there — every live pod whose GPU containers carry
//! `tencent.com/predicate-gpu-idx-<i>` (written by this extender's bind, by
//! gpu-admission, or by the manager once it allocated), bound or, if not
//! bound yet, reserved within [`RESERVATION_TTL`]. Nothing is
//! remembered between requests, so a restart or a second replica sees the
//! same cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_allocator::inventory::{ANNOTATION, Inventory};
use gpu_allocator::{AllocError, Allocator, Placement, Request};
use gpu_pods::ContainerRequest;
use k8s_openapi::api::core::v1::{Node, Pod};

/// One vcuda node: its GPUs and what is placed on them.
#[derive(Debug, Clone)]
pub struct NodeState {
    pub inventory: Inventory,
    pub allocator: Allocator,
    /// Pods whose recorded placement could not be replayed (a GPU the
    /// node lacks, more than a GPU holds): why, by pod. Their capacity is
    /// not counted; the manager's Allocate is the last check.
    pub problems: Vec<String>,
}

/// Every vcuda node of the cluster.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    /// Shared between successive views: one rebuilt node leaves the others'.
    pub nodes: BTreeMap<String, Arc<NodeState>>,
    /// Nodes whose inventory annotation is unreadable: why.
    pub unreadable: BTreeMap<String, String>,
    /// By node, when (ns since the epoch) a reservation there next starts
    /// or stops counting ([`holding_node_at`]): the view is stale then.
    pub next_change: BTreeMap<String, u128>,
}

/// A placement of a pod's GPU containers on one node.
pub type PodPlacement = Vec<(ContainerRequest, Placement)>;

impl Cluster {
    /// From the nodes and pods the API server holds.
    pub fn build<'a>(
        nodes: impl IntoIterator<Item = &'a Node>,
        pods: impl IntoIterator<Item = &'a Pod>,
    ) -> Cluster {
        Cluster::build_at(nodes, pods, SystemTime::now())
    }

    /// [`Cluster::build`] with reservations judged at `now`.
    pub fn build_at<'a>(
        nodes: impl IntoIterator<Item = &'a Node>,
        pods: impl IntoIterator<Item = &'a Pod>,
        now: SystemTime,
    ) -> Cluster {
        let mut c = Cluster::default();
        for n in nodes {
            let Some(name) = n.metadata.name.clone() else {
                continue;
            };
            let ann = n
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION));
            let Some(text) = ann else { continue };
            match Inventory::from_json(text) {
                Ok(inventory) => {
                    let allocator = inventory.allocator();
                    c.nodes.insert(
                        name,
                        Arc::new(NodeState {
                            inventory,
                            allocator,
                            problems: Vec::new(),
                        }),
                    );
                }
                Err(e) => {
                    c.unreadable.insert(name, e.to_string());
                }
            }
        }
        // Bound pods first: their records are what the managers honour;
        // a reservation that conflicts with them lost its race.
        let (bound, reserving): (Vec<&Pod>, Vec<&Pod>) =
            pods.into_iter().partition(|p| bound_to(p).is_some());
        for p in &reserving {
            c.note_reservation(p, now);
        }
        for p in bound.into_iter().chain(reserving) {
            c.add_placed(p, now);
        }
        c
    }

    /// This view with the nodes `names` rebuilt from `nodes` and `pods`
    /// (the API server's, all of them: those holding GPUs elsewhere are
    /// skipped), every other node's state shared with it.
    pub fn with_nodes_rebuilt<'a>(
        &self,
        names: &BTreeSet<String>,
        nodes: impl IntoIterator<Item = &'a Node>,
        pods: impl IntoIterator<Item = &'a Pod>,
        now: SystemTime,
    ) -> Cluster {
        let named = nodes
            .into_iter()
            .filter(|n| n.metadata.name.as_ref().is_some_and(|x| names.contains(x)));
        let part = Cluster::build_at(named, pods, now);
        let mut c = self.clone();
        for n in names {
            c.nodes.remove(n);
            c.unreadable.remove(n);
            c.next_change.remove(n);
        }
        c.nodes.extend(part.nodes);
        c.unreadable.extend(part.unreadable);
        c.next_change.extend(part.next_change);
        c
    }

    /// Records when the reservation `pod` (not bound) names next starts or
    /// stops counting, for its node.
    fn note_reservation(&mut self, pod: &Pod, now: SystemTime) {
        let Some(node) = gpu_pods::annotation(pod, gpu_pods::PREDICATE_NODE) else {
            return;
        };
        let Some(at) = gpu_pods::annotation(pod, gpu_pods::PREDICATE_TIME)
            .and_then(|t| t.parse::<u128>().ok())
        else {
            return;
        };
        let Ok(now) = now.duration_since(UNIX_EPOCH).map(|d| d.as_nanos()) else {
            return;
        };
        let starts = at.saturating_sub(CLOCK_SKEW.as_nanos());
        let stops = at.saturating_add(RESERVATION_TTL.as_nanos()) + 1;
        let Some(next) = [starts, stops].into_iter().filter(|&t| t > now).min() else {
            return;
        };
        if self.nodes.contains_key(node) {
            let e = self.next_change.entry(node.to_string()).or_insert(next);
            *e = (*e).min(next);
        }
    }

    /// Counts what `pod` holds, if it holds GPUs on a vcuda node (a
    /// reservation judged at `now`).
    fn add_placed(&mut self, pod: &Pod, now: SystemTime) {
        let Some(node) = holding_node_at(pod, now) else {
            return;
        };
        let Some(st) = self.nodes.get_mut(node).map(Arc::make_mut) else {
            return;
        };
        let who = format!("{}/{}", gpu_pods::namespace(pod), gpu_pods::name(pod));
        let reqs = match gpu_pods::requests(pod, st.inventory.gpus.len(), st.inventory.share_mode) {
            Ok(r) => r,
            Err(e) => return st.problems.push(e),
        };
        for r in reqs {
            let Some(minors) = gpu_pods::predicate_minors(pod, r.index) else {
                continue; // not placed yet (the manager chooses at Allocate)
            };
            let instance = gpu_pods::predicate_instance(pod, r.index);
            let p = match minors.and_then(|m| placement_on(&st.inventory, &r, &m, instance)) {
                Ok(p) => p,
                Err(e) => {
                    st.problems
                        .push(format!("pod {who} container {}: {e}", r.name));
                    continue;
                }
            };
            let id = format!("{}/{}", gpu_pods::uid(pod), r.name);
            if let Err(e) = st.allocator.commit(id, &p) {
                if bound_to(pod).is_none() {
                    // A reservation over what bound pods hold: a bind that
                    // lost its race or was cut off (the extender killed).
                    // It holds nothing; taking the GPU out over it left a
                    // real three-node trace with a pod Unschedulable.
                    st.problems.push(format!(
                        "pod {who} container {}: its reservation is not counted, it conflicts with pods bound there: {e}",
                        r.name
                    ));
                    continue;
                }
                // Two records claim these GPUs (a bind that lost its race
                // keeps its old placement until its retry rewrites it):
                // which one holds them is unknown, so they take nothing
                // new until the records agree. Replayed in UID order, a
                // 30-core share's record hid a whole-GPU pod's, and a 60-core
                // share was bound onto the GPU the manager held whole.
                for &g in p.gpus() {
                    let _ = st.allocator.set_healthy(g, false);
                }
                st.problems
                    .push(format!("pod {who} container {}: {e}", r.name));
            }
        }
    }

    /// Where `pod`'s GPU containers would go on `node`, one after the
    /// other as the manager admits them; or why they do not fit there. The
    /// GPUs are the manager's choice (the fullest that fits).
    pub fn fit(&self, node: &str, pod: &Pod) -> Result<PodPlacement, String> {
        self.fit_with(node, pod, false)
    }

    /// [`Cluster::fit`]; `spread`: a share of one GPU goes to the emptiest
    /// GPU that takes it instead (most free cores, then memory, then the
    /// lowest index), which bind then writes for the manager to honour.
    pub fn fit_with(&self, node: &str, pod: &Pod, spread: bool) -> Result<PodPlacement, String> {
        let st = self.nodes.get(node).ok_or_else(|| self.not_vcuda(node))?;
        let reqs = gpu_pods::requests(pod, st.inventory.gpus.len(), st.inventory.share_mode)?;
        let mut a = st.allocator.clone();
        // Never against its own reservation: a bind cut off between
        // annotating the pod and binding it (the extender killed) leaves
        // the pod holding GPUs; counted against the pod itself, it made
        // the pod unschedulable and the GPUs lost for good.
        for r in &reqs {
            let _ = a.release(&format!("{}/{}", gpu_pods::uid(pod), r.name));
        }
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            let mut p = a
                .evaluate_for(&r.request, r.mig_profile.as_deref())
                .map_err(|e| describe(&r, e))?;
            if spread && let Placement::Share { .. } = p {
                p = emptiest(&a, &r.request).unwrap_or(p);
            }
            a.commit(format!("new/{}", r.name), &p)
                .map_err(|e| describe(&r, e))?;
            out.push((r, p));
        }
        Ok(out)
    }

    fn not_vcuda(&self, node: &str) -> String {
        match self.unreadable.get(node) {
            Some(e) => format!("node {node}: {e}"),
            None => format!(
                "node {node} publishes no GPU inventory ({ANNOTATION}): no vcuda manager runs there"
            ),
        }
    }
}

/// The healthy, shared GPU with the most room that takes a share of `req`.
fn emptiest(a: &Allocator, req: &Request) -> Option<Placement> {
    let fits = |u: &gpu_allocator::GpuUsage| {
        u.takes_placements()
            && !u.exclusive
            && u.free_cores() >= req.cores
            && u.free_memory_units() >= req.memory_units
    };
    let gpu = (0..a.usages().len())
        .filter(|&g| fits(&a.usage(g)))
        .max_by_key(|&g| {
            let u = a.usage(g);
            (u.free_cores(), u.free_memory_units(), std::cmp::Reverse(g))
        })?;
    Some(Placement::Share {
        gpu,
        cores: req.cores,
        memory_units: req.memory_units,
    })
}

fn describe(r: &ContainerRequest, e: AllocError) -> String {
    format!("container {}: {e}", r.name)
}

/// How long a reservation on a pod that is not bound yet counts: a bind
/// reserves and then binds at once, so an older one is a bind cut off (the
/// extender killed; the pod is scheduled again) — or annotations a tenant
/// wrote on pods that will never run, to deny GPUs to everyone else.
pub const RESERVATION_TTL: Duration = Duration::from_secs(120);
/// A reservation time this far ahead of our clock is another node's skew;
/// further ahead, it is forged to never expire.
pub const CLOCK_SKEW: Duration = Duration::from_secs(30);

/// The node whose GPUs a live pod holds: where it is bound, else where a
/// bind in flight put it (`tencent.com/predicate-node`) while its
/// `predicate-time` is fresh ([`RESERVATION_TTL`]).
/// A pod being deleted still holds them until its containers are gone.
pub fn holding_node(pod: &Pod) -> Option<&str> {
    holding_node_at(pod, SystemTime::now())
}

/// [`holding_node`] at `now`.
pub fn holding_node_at(pod: &Pod, now: SystemTime) -> Option<&str> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    if let Some(n) = bound_to(pod) {
        return Some(n);
    }
    let node = gpu_pods::annotation(pod, gpu_pods::PREDICATE_NODE)?;
    let at: u128 = gpu_pods::annotation(pod, gpu_pods::PREDICATE_TIME)?
        .parse()
        .ok()?;
    let now = now.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    let fresh = at.saturating_add(RESERVATION_TTL.as_nanos()) >= now
        && at <= now.saturating_add(CLOCK_SKEW.as_nanos());
    fresh.then_some(node)
}

/// The node `pod` is bound to, if it is.
fn bound_to(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// The placement `minors` (`/dev/nvidiaN` numbers) and `instance` (a MIG
/// instance's UUID, `predicate-mig-<i>`) record for `r` on a node with
/// inventory `inv`.
pub fn placement_on(
    inv: &Inventory,
    r: &ContainerRequest,
    minors: &[u32],
    instance: Option<&str>,
) -> Result<Placement, String> {
    let req = &r.request;
    let gpus = minors
        .iter()
        .map(|&m| {
            inv.by_minor(m)
                .ok_or_else(|| format!("GPU /dev/nvidia{m} is not one of the node's"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if r.mig_profile.is_some() || instance.is_some() {
        return gpu_pods::recorded_in_instance(req, r.mig_profile.as_deref(), &gpus, instance);
    }
    req.placement_on(&gpus).ok_or_else(|| {
        format!(
            "{} GPU(s) recorded ({minors:?}) for a request of {} cores over {} GPU(s)",
            gpus.iter().collect::<std::collections::BTreeSet<_>>().len(),
            req.cores,
            req.gpus
        )
    })
}
