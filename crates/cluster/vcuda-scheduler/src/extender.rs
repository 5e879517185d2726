//! `filter` and `prioritize` over a [`Cluster`]: pure, so they answer from
//! whatever snapshot the caller holds (the watch caches in production).

use k8s_openapi::api::core::v1::Pod;

use crate::api::{ExtenderArgs, ExtenderFilterResult, HostPriority};
use crate::cluster::Cluster;
use crate::policy::{self, Policy};

/// Keeps the candidate nodes where every GPU container of the pod fits on
/// the node's GPUs (as its manager will place them); every other one gets
/// the reason (what was asked, what each GPU has free), which the
/// scheduler puts in the pod's events. A pod that asks for no vcuda
/// resource passes everywhere; a malformed request fails everywhere,
/// unresolvably, with what is wrong.
pub fn filter(cluster: &Cluster, args: &ExtenderArgs) -> ExtenderFilterResult {
    let pod = &args.pod;
    let candidates = args.candidates();
    let mut out = ExtenderFilterResult::default();
    let mut fits = Vec::new();
    if !asks_for_gpus(pod) {
        fits = candidates;
    } else {
        for node in candidates {
            match cluster.fit(&node, pod) {
                Ok(_) => fits.push(node),
                Err(why) if malformed(&why) => {
                    out.failed_and_unresolvable.insert(node, why);
                }
                Err(why) => {
                    out.failed_nodes.insert(node, why);
                }
            }
        }
    }
    if args.node_names.is_some() {
        out.node_names = Some(fits);
    } else {
        let keep: std::collections::HashSet<&String> = fits.iter().collect();
        let items = args
            .nodes
            .iter()
            .flat_map(|l| l.items.iter())
            .filter(|n| n.metadata.name.as_ref().is_some_and(|x| keep.contains(x)))
            .cloned()
            .collect();
        out.nodes = Some(crate::api::NodeList { items });
    }
    out
}

/// Whether any container limits `tencent.com/vcuda-core`.
pub fn asks_for_gpus(pod: &Pod) -> bool {
    !gpu_pods::gpu_containers(pod).is_empty()
}

/// A request no node could ever take (bad annotation, totals that do not
/// split, an invalid share): retrying elsewhere or preempting cannot help.
fn malformed(why: &str) -> bool {
    why.contains("annotation") || why.contains("invalid") || why.contains("does not split")
}

/// Scores the candidates (0..=10) by the pod's policy; nodes where it does
/// not fit score 0 (filter already removed them when the scheduler asks in
/// order). A bad policy annotation is an error for the whole call.
pub fn prioritize(
    cluster: &Cluster,
    args: &ExtenderArgs,
    default: Policy,
) -> Result<Vec<HostPriority>, String> {
    let pod = &args.pod;
    let policy = Policy::of(pod, default)?;
    let gpu = asks_for_gpus(pod);
    Ok(args
        .candidates()
        .into_iter()
        .map(|host| {
            let score = match (gpu, cluster.nodes.get(&host)) {
                (true, Some(st)) => cluster
                    .fit_with(&host, pod, policy == Policy::Spread)
                    .map_or(0, |placed| policy::score(st, &placed, policy)),
                _ => 0,
            };
            HostPriority { host, score }
        })
        .collect())
}
