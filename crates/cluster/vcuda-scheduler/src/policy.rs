//! How candidate nodes are ranked: by policy (binpack fills the fullest
//! nodes first and keeps whole nodes free for big jobs; spread evens the
//! load), per pod by annotation with a cluster default, and for a request
//! of several GPUs by how closely the GPUs it would get are linked.

use gpu_allocator::{PcieLevel, Placement, WHOLE_GPU_CORES};

use crate::api::MAX_PRIORITY;
use crate::cluster::{NodeState, PodPlacement};

/// The pod annotation that picks a policy for one pod.
pub const ANNOTATION: &str = "tencent.com/vcuda-policy";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Binpack,
    Spread,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "binpack" => Ok(Policy::Binpack),
            "spread" => Ok(Policy::Spread),
            other => Err(format!("{other:?} is no policy: binpack or spread")),
        }
    }
}

impl Policy {
    /// The pod's policy: its annotation's, else `default`. A value that is
    /// no policy is an error naming the pod (the extender reports it
    /// instead of guessing).
    pub fn of(pod: &k8s_openapi::api::core::v1::Pod, default: Policy) -> Result<Policy, String> {
        match gpu_pods::annotation(pod, ANNOTATION) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|e| {
                format!(
                    "pod {}/{}: annotation {ANNOTATION}: {e}",
                    gpu_pods::namespace(pod),
                    gpu_pods::name(pod)
                )
            }),
        }
    }
}

/// The node's score (0..=MAX_PRIORITY) for placing `placed` on it.
pub fn score(node: &NodeState, placed: &PodPlacement, policy: Policy) -> i64 {
    // GPUs and the MIG instances that take shares: 100 cores each.
    let cards = node.inventory.gpus.len() + node.inventory.instances.len();
    let total = cards as u64 * u64::from(WHOLE_GPU_CORES);
    let on_instances = node.allocator.instances().map(|(_, u)| u.allocated_cores);
    let used: u64 = node
        .allocator
        .usages()
        .iter()
        .map(|u| u.allocated_cores)
        .chain(on_instances)
        .map(u64::from)
        .sum();
    let adding: u64 = placed.iter().map(|(_, p)| placement_cores(p)).sum();
    let total = total.max(1);
    let after = (used + adding).min(total);
    let kept = match policy {
        Policy::Binpack => after,
        Policy::Spread => total - after,
    };
    // Rounded to the nearest score, in integers (no float ties).
    let by_policy = (kept * 2 * MAX_PRIORITY as u64 + total) / (2 * total);
    let multi: Vec<&Placement> = placed
        .iter()
        .map(|(_, p)| p)
        .filter(|p| p.gpus().len() >= 2)
        .collect();
    if multi.is_empty() {
        return by_policy as i64;
    }
    let closeness = multi
        .iter()
        .map(|p| closeness(node, p.gpus()))
        .fold(f64::MAX, f64::min);
    ((2.0 * by_policy as f64 + closeness) / 3.0).round() as i64
}

fn placement_cores(p: &Placement) -> u64 {
    match p {
        Placement::Share { cores, .. } | Placement::InMig { cores, .. } => u64::from(*cores),
        Placement::Exclusive { gpus } => gpus.len() as u64 * u64::from(WHOLE_GPU_CORES),
        Placement::Shares { gpus, cores, .. } => gpus.len() as u64 * u64::from(*cores),
    }
}

/// How closely `gpus` are linked, 0..=MAX_PRIORITY: every pair by NVLink
/// is the best; else the loosest pair's PCIe level.
fn closeness(node: &NodeState, gpus: &[usize]) -> f64 {
    let t = node.allocator.topology();
    let pairs = gpus
        .iter()
        .enumerate()
        .flat_map(|(i, &a)| gpus[i + 1..].iter().map(move |&b| (a, b)));
    let mut worst = MAX_PRIORITY as f64;
    for (a, b) in pairs {
        let s = if t.nvlink_count(a, b) > 0 {
            10.0
        } else {
            match t.pcie_level(a, b) {
                PcieLevel::Internal | PcieLevel::Single => 7.0,
                PcieLevel::Multiple => 5.0,
                PcieLevel::HostBridge | PcieLevel::Node => 3.0,
                PcieLevel::System => 0.0,
            }
        };
        worst = worst.min(s);
    }
    worst
}
