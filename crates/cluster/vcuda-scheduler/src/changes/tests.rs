//! The view kept up to date from events equals the view built whole from
//! the same objects at the same moment, over a seeded random history of
//! pods bound, reserved, rebound, finished and deleted, nodes changed,
//! removed and unreadable, and time passing reservations by.

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use gpu_allocator::GpuUsage;
use serde_json::json;

use super::*;
use crate::cluster::{CLOCK_SKEW, RESERVATION_TTL};
use crate::tests::{node, placed, pod};

/// What a filter call sees of a view: each node's GPUs, its problems, the
/// unreadable nodes.
type Summary = (
    BTreeMap<String, (Vec<GpuUsage>, Vec<String>)>,
    BTreeMap<String, String>,
);

fn summary(c: &Cluster) -> Summary {
    let nodes = c
        .nodes
        .iter()
        .map(|(n, st)| {
            (
                n.clone(),
                (st.allocator.usages().to_vec(), st.problems.clone()),
            )
        })
        .collect();
    (nodes, c.unreadable.clone())
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

const NODES: [&str; 4] = ["n0", "n1", "n2", "n3"];

#[test]
fn the_view_kept_from_events_is_the_view_built_whole() {
    let mut rng = Rng(0x5eed_1234_abcd);
    let mut now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let mut nodes: BTreeMap<String, Arc<Node>> = NODES
        .iter()
        .map(|n| (n.to_string(), Arc::new(node(n, 4, false))))
        .collect();
    let mut pods: BTreeMap<String, Arc<Pod>> = BTreeMap::new();
    let mut changes = Changes::default();
    let mut view = Arc::new(Cluster::default());
    let (mut kept, mut shared, mut total) = (0, 0, 0);
    for step in 0..600 {
        let pick = |rng: &mut Rng| NODES[rng.below(4) as usize].to_string();
        let some_pod = |rng: &mut Rng, pods: &BTreeMap<String, Arc<Pod>>| {
            let keys: Vec<&String> = pods.keys().collect();
            (!keys.is_empty()).then(|| keys[rng.below(keys.len() as u64) as usize].clone())
        };
        let stamp = |at: SystemTime| {
            at.duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
                .to_string()
        };
        match rng.below(10) {
            0..=2 => {
                let name = format!("p{step}");
                let share = (10 + rng.below(40), 1 + rng.below(8));
                let minor = rng.below(4).to_string();
                let p = if rng.below(2) == 0 {
                    placed(&name, &[share], &pick(&mut rng), &[&minor])
                } else {
                    // A reservation, fresh, stale, or a little ahead.
                    let age = rng.below(200) as i64 - 40;
                    let at = if age >= 0 {
                        now - Duration::from_secs(age as u64)
                    } else {
                        now + Duration::from_secs((-age) as u64)
                    };
                    pod(
                        &name,
                        &[share],
                        json!({gpu_pods::PREDICATE_NODE: pick(&mut rng),
                               gpu_pods::PREDICATE_TIME: stamp(at),
                               "tencent.com/predicate-gpu-idx-0": minor}),
                    )
                };
                changes.pod(&p, false);
                pods.insert(gpu_pods::uid(&p).to_string(), Arc::new(p));
            }
            3 | 4 => {
                // Bound where reserved, moved to another node, or finished.
                let Some(k) = some_pod(&mut rng, &pods) else {
                    continue;
                };
                let mut p = (*pods[&k]).clone();
                match rng.below(3) {
                    0 => {
                        let at = gpu_pods::annotation(&p, gpu_pods::PREDICATE_NODE)
                            .map(str::to_string)
                            .unwrap_or_else(|| pick(&mut rng));
                        p.spec.as_mut().unwrap().node_name = Some(at);
                    }
                    1 => {
                        let to = pick(&mut rng);
                        p.metadata
                            .annotations
                            .get_or_insert_default()
                            .insert(gpu_pods::PREDICATE_NODE.into(), to);
                    }
                    _ => {
                        p.status =
                            Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
                    }
                }
                changes.pod(&p, false);
                pods.insert(k, Arc::new(p));
            }
            5 => {
                let Some(k) = some_pod(&mut rng, &pods) else {
                    continue;
                };
                let p = pods.remove(&k).unwrap();
                changes.pod(&p, true);
            }
            6 => {
                // A node removed, published again, or unreadable.
                let n = pick(&mut rng);
                match rng.below(3) {
                    0 => {
                        nodes.remove(&n);
                    }
                    1 => {
                        nodes.insert(n.clone(), Arc::new(node(&n, 4, false)));
                    }
                    _ => {
                        let mut bad = node(&n, 4, false);
                        bad.metadata.annotations.as_mut().unwrap().insert(
                            gpu_allocator::inventory::ANNOTATION.into(),
                            "{not an inventory".into(),
                        );
                        nodes.insert(n.clone(), Arc::new(bad));
                    }
                }
                changes.node(&n);
            }
            7 => {
                // Time passes: reservations expire or start counting.
                let step = rng.below(RESERVATION_TTL.as_secs() + CLOCK_SKEW.as_secs());
                now += Duration::from_secs(step);
            }
            _ => {}
        }
        if step == 300 {
            changes.relist();
            for p in pods.values() {
                changes.pod(p, false);
            }
        }
        let ns: Vec<Arc<Node>> = nodes.values().cloned().collect();
        let ps: Vec<Arc<Pod>> = pods.values().cloned().collect();
        let before = view.clone();
        view = changes
            .take()
            .apply(&view, || (ns.clone(), ps.clone()), now);
        if Arc::ptr_eq(&before, &view) {
            kept += 1;
        }
        for (n, st) in &view.nodes {
            total += 1;
            shared += usize::from(before.nodes.get(n).is_some_and(|b| Arc::ptr_eq(b, st)));
        }
        let whole = Cluster::build_at(ns.iter().map(|n| &**n), ps.iter().map(|p| &**p), now);
        assert_eq!(
            summary(&view),
            summary(&whole),
            "step {step}: the kept view differs from the whole one"
        );
    }
    // The history exercised both ways: views kept as they were, and most
    // nodes' states carried over, not rebuilt.
    assert!(kept > 10, "{kept} views unchanged");
    assert!(
        2 * shared > total,
        "{shared} of {total} node states carried over"
    );
}
