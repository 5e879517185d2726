//! Shared fixtures (nodes publishing inventories, GPU pods) and the tests
//! of the cluster model, filter, prioritize and policies.

use gpu_allocator::inventory::{ANNOTATION, Inventory};
use gpu_allocator::{Allocator, GpuInfo, PcieLevel, Topology};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

use crate::api::ExtenderArgs;
use crate::cluster::Cluster;
use crate::extender::{filter, prioritize};
use crate::policy::Policy;

/// A node of `gpus` 16 GiB GPUs (64 units), PCIe switches of two (or, with
/// `nvlink`, every pair of a switch NVLinked), minors 0..n.
pub fn node(name: &str, gpus: usize, nvlink: bool) -> Node {
    let infos = (0..gpus)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{name}-{i}"),
            minor: i as u32,
            memory_bytes: 16 << 30,
            numa_node: Some(i as u32 / 4),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
        })
        .collect();
    let pcie = |a: usize, b: usize| {
        if a / 2 == b / 2 {
            PcieLevel::Single
        } else {
            PcieLevel::System
        }
    };
    let links = |a: usize, b: usize| u32::from(nvlink && a / 2 == b / 2) * 4;
    let t = Topology::from_fn(infos, pcie, links).unwrap();
    let inv = Inventory::of(&Allocator::new(t), true);
    serde_json::from_value(json!({
        "metadata": {"name": name, "resourceVersion": "1",
                     "annotations": {ANNOTATION: inv.to_json()}}
    }))
    .unwrap()
}

/// A node whose GPU 1 is in MIG mode with a 2g.20gb that serves shares.
pub fn node_with_shared_instance(name: &str) -> Node {
    let mut n = node(name, 2, false);
    let ann = n.metadata.annotations.as_mut().unwrap();
    let key = gpu_allocator::inventory::ANNOTATION;
    let mut inv = gpu_allocator::inventory::Inventory::from_json(&ann[key]).unwrap();
    inv.gpus[1].mig = true;
    inv.instances = vec![gpu_allocator::inventory::InventoryInstance {
        instance: gpu_allocator::SharedInstance {
            uuid: "MIG-2g".into(),
            gpu: 1,
            profile: "2g.20gb".into(),
            memory_bytes: 20 << 30,
        },
        healthy: true,
    }];
    ann.insert(key.into(), inv.to_json());
    n
}

/// A pod with one container per `(cores, units)`; `placed`: bound to a
/// node with each container's `/dev/nvidia` numbers.
pub fn pod(name: &str, containers: &[(u64, u64)], annotations: serde_json::Value) -> Pod {
    let cs: Vec<_> = containers
        .iter()
        .enumerate()
        .map(|(i, (c, m))| {
            json!({"name": format!("c{i}"), "resources": {"limits": {
                "tencent.com/vcuda-core": c.to_string(), "tencent.com/vcuda-memory": m.to_string()}}})
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                     "resourceVersion": "1", "annotations": annotations},
        "spec": {"containers": cs},
    }))
    .unwrap()
}

/// `pod` bound to `node` on GPUs `minors` (one list per container).
pub fn placed(name: &str, containers: &[(u64, u64)], node: &str, minors: &[&str]) -> Pod {
    let mut ann = serde_json::Map::new();
    for (i, m) in minors.iter().enumerate() {
        ann.insert(format!("tencent.com/predicate-gpu-idx-{i}"), json!(m));
    }
    let mut p = pod(name, containers, ann.into());
    p.spec.as_mut().unwrap().node_name = Some(node.into());
    p
}

fn args(pod: Pod, nodes: &[&str]) -> ExtenderArgs {
    ExtenderArgs {
        pod,
        nodes: None,
        node_names: Some(nodes.iter().map(|s| s.to_string()).collect()),
    }
}

#[test]
fn a_share_fits_where_one_gpu_has_room_and_the_reason_says_what_is_free() {
    let nodes = [node("a", 2, false), node("b", 2, false)];
    // a: both GPUs hold 80 cores; b: GPU 1 holds 80.
    let pods = [
        placed("x", &[(80, 8)], "a", &["0"]),
        placed("y", &[(80, 8)], "a", &["1"]),
        placed("z", &[(80, 8)], "b", &["1"]),
    ];
    let c = Cluster::build(&nodes, &pods);
    let r = filter(&c, &args(pod("new", &[(30, 8)], json!({})), &["a", "b"]));
    assert_eq!(r.node_names, Some(vec!["b".to_string()]));
    let why = &r.failed_nodes["a"];
    assert!(why.contains("container c0"), "{why}");
    assert!(
        why.contains("no healthy GPU has 30 free cores and 8 free memory units"),
        "{why}"
    );
    assert!(
        why.contains("the roomiest is GPU0 with 20 cores and 56 units free"),
        "{why}"
    );
    assert!(r.failed_and_unresolvable.is_empty());
}

#[test]
fn a_node_without_an_inventory_or_with_another_version_is_refused_by_name() {
    let mut old = node("old", 2, false);
    let ann = old.metadata.annotations.as_mut().unwrap();
    let v = ann[ANNOTATION].replace("\"version\":1", "\"version\":9");
    ann.insert(ANNOTATION.into(), v);
    let plain: Node = serde_json::from_value(json!({"metadata": {"name": "cpu"}})).unwrap();
    let c = Cluster::build([&old, &plain], []);
    let r = filter(
        &c,
        &args(pod("new", &[(30, 8)], json!({})), &["old", "cpu"]),
    );
    assert_eq!(r.node_names, Some(vec![]));
    assert!(r.failed_nodes["old"].contains("version 9; this build reads version 1"));
    assert!(r.failed_nodes["cpu"].contains("publishes no GPU inventory"));
    // A pod without vcuda resources passes everywhere.
    let cpu_pod: Pod = serde_json::from_value(
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}),
    )
    .unwrap();
    let r = filter(&c, &args(cpu_pod, &["old", "cpu"]));
    assert_eq!(
        r.node_names,
        Some(vec!["old".to_string(), "cpu".to_string()])
    );
}

#[test]
fn every_gpu_container_of_a_pod_must_fit_together() {
    let nodes = [node("a", 2, false)];
    let c = Cluster::build(&nodes, []);
    // 60 + 60 fit on two GPUs; 60 + 60 + 60 do not.
    let two = filter(&c, &args(pod("p", &[(60, 8), (60, 8)], json!({})), &["a"]));
    assert_eq!(two.node_names, Some(vec!["a".to_string()]));
    let three = filter(
        &c,
        &args(pod("q", &[(60, 8), (60, 8), (60, 8)], json!({})), &["a"]),
    );
    assert!(
        three.failed_nodes["a"].contains("container c2"),
        "{three:?}"
    );
}

#[test]
fn a_malformed_request_is_unresolvable_everywhere() {
    let c = Cluster::build([&node("a", 4, false)], []);
    let bad = pod(
        "p",
        &[(81, 64)],
        json!({"tencent.com/vcuda-gpus": r#"{"c0": 2}"#}),
    );
    let r = filter(&c, &args(bad, &["a"]));
    assert!(r.failed_nodes.is_empty());
    assert!(
        r.failed_and_unresolvable["a"].contains("does not split evenly"),
        "{r:?}"
    );
}

#[test]
fn binpack_prefers_the_fuller_node_and_spread_the_emptier() {
    let nodes = [node("full", 2, false), node("empty", 2, false)];
    let pods = [placed("x", &[(90, 8)], "full", &["0"])];
    let c = Cluster::build(&nodes, &pods);
    let a = args(pod("new", &[(30, 8)], json!({})), &["full", "empty"]);
    let scores = |p: Policy| {
        prioritize(&c, &a, p)
            .unwrap()
            .into_iter()
            .map(|h| (h.host, h.score))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        scores(Policy::Binpack),
        [("full".into(), 6), ("empty".into(), 2)]
    );
    assert_eq!(
        scores(Policy::Spread),
        [("full".into(), 4), ("empty".into(), 9)]
    );
    // The pod's annotation wins over the default; a bad one is an error.
    let spread = args(
        pod(
            "s",
            &[(30, 8)],
            json!({"tencent.com/vcuda-policy": "spread"}),
        ),
        &["full"],
    );
    assert_eq!(
        prioritize(&c, &spread, Policy::Binpack).unwrap()[0].score,
        4
    );
    let bad = args(
        pod(
            "b",
            &[(30, 8)],
            json!({"tencent.com/vcuda-policy": "tight"}),
        ),
        &["full"],
    );
    let e = prioritize(&c, &bad, Policy::Binpack).unwrap_err();
    assert_eq!(
        e,
        "pod default/b: annotation tencent.com/vcuda-policy: \"tight\" is no policy: binpack or spread"
    );
}

#[test]
fn a_share_on_two_gpus_scores_nvlinked_pairs_higher() {
    let nodes = [node("nv", 4, true), node("pcie", 4, false)];
    let c = Cluster::build(&nodes, []);
    let tp = pod(
        "tp",
        &[(100, 64)],
        json!({"tencent.com/vcuda-gpus": r#"{"c0": 2}"#}),
    );
    let s = prioritize(&c, &args(tp, &["nv", "pcie"]), Policy::Binpack).unwrap();
    assert!(s[0].score > s[1].score, "{s:?}");
}

#[test]
fn placed_pods_are_counted_on_their_gpus_and_bad_records_reported() {
    let nodes = [node("a", 2, false)];
    let pods = [
        placed("whole", &[(100, 0)], "a", &["1"]),
        placed("tp", &[(100, 16)], "a", &["0,7"]),
    ];
    let c = Cluster::build(&nodes, &pods);
    let st = &c.nodes["a"];
    assert!(st.allocator.usage(1).exclusive);
    assert_eq!(st.allocator.usage(0).allocated_cores, 0);
    assert_eq!(st.problems.len(), 1, "{:?}", st.problems);
    assert!(
        st.problems[0].contains("/dev/nvidia7 is not one of the node's"),
        "{:?}",
        st.problems
    );
    // Finished pods hold nothing.
    let mut done = placed("done", &[(100, 0)], "a", &["0"]);
    done.status = Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
    let c = Cluster::build(&nodes, [&done]);
    assert_eq!(c.nodes["a"].allocator.usage(0).allocated_cores, 0);
}

/// Two records claim GPU 0 (a 30-core share whose bind lost its race still
/// carries it, a whole-GPU pod won it): whichever replays first, a 60-core
/// share goes elsewhere, never onto the GPU the manager may hold whole
/// (a real three-node run bound one there, and the manager refused it:
/// "GPU0 is held whole").
#[test]
fn a_gpu_two_records_claim_takes_nothing_new() {
    let nodes = [node("a", 2, false)];
    for (share, whole) in [("a-share", "b-whole"), ("b-share", "a-whole")] {
        let pods = [
            placed(share, &[(30, 8)], "a", &["0"]),
            placed(whole, &[(100, 0)], "a", &["0"]),
        ];
        let c = Cluster::build(&nodes, &pods);
        assert_eq!(
            c.nodes["a"].problems.len(),
            1,
            "{:?}",
            c.nodes["a"].problems
        );
        let fit = c.fit("a", &pod("new", &[(60, 16)], json!({}))).unwrap();
        assert_eq!(
            fit[0].1.gpus(),
            [1],
            "{share} replayed before {whole}: {fit:?}"
        );
    }
}

#[test]
fn a_pod_whose_bind_was_cut_off_fits_in_its_own_reservation_and_no_one_else_does() {
    let nodes = [node("a", 1, false)];
    // The extender annotated `cut` (60 cores on GPU 0) and died before the
    // Binding: the pod is pending again, its reservation still on it.
    let cut = pod(
        "cut",
        &[(60, 16)],
        json!({"tencent.com/predicate-node": "a", "tencent.com/predicate-gpu-idx-0": "0",
               "tencent.com/predicate-time": ns_ago(5).to_string()}),
    );
    let pods = [placed("other", &[(40, 16)], "a", &["0"]), cut.clone()];
    let c = Cluster::build(&nodes, &pods);
    assert_eq!(c.nodes["a"].allocator.usage(0).allocated_cores, 100);
    let r = filter(&c, &args(cut, &["a"]));
    assert_eq!(r.node_names, Some(vec!["a".to_string()]), "{r:?}");
    // Anyone else still finds GPU 0 full.
    let r = filter(&c, &args(pod("late", &[(60, 16)], json!({})), &["a"]));
    assert_eq!(r.node_names, Some(vec![]), "{r:?}");
    assert!(r.failed_nodes["a"].contains("free"), "{r:?}");
}

/// A reservation over what bound pods hold is a bind that lost its race
/// or was cut off: it holds nothing, and the GPU stays open to others, in
/// either replay order. (A real three-node trace, the extender killed
/// mid-run: taking GPU 3 out over such a reservation left its own pod
/// Unschedulable.)
#[test]
fn a_reservation_over_bound_pods_is_dropped_not_the_gpu() {
    let nodes = [node("a", 2, false)];
    let reservation = |name: &str| {
        pod(
            name,
            &[(80, 16)],
            json!({"tencent.com/predicate-node": "a", "tencent.com/predicate-gpu-idx-0": "0",
                   "tencent.com/predicate-time": ns_ago(5).to_string()}),
        )
    };
    for (bound, cut) in [("a-bound", "b-cut"), ("b-bound", "a-cut")] {
        let cut = reservation(cut);
        let pods = [cut.clone(), placed(bound, &[(40, 16)], "a", &["0"])];
        let c = Cluster::build(&nodes, &pods);
        let st = &c.nodes["a"];
        assert_eq!(st.allocator.usage(0).allocated_cores, 40, "{bound}");
        assert!(
            st.problems.len() == 1 && st.problems[0].contains("reservation is not counted"),
            "{:?}",
            st.problems
        );
        // GPU 0 takes what fits beside the bound pod (the fullest first)...
        let fit = c.fit("a", &pod("new", &[(30, 8)], json!({}))).unwrap();
        assert_eq!(fit[0].1.gpus(), [0], "{bound}: {fit:?}");
        // ...and the cut-off pod, scheduled again, fits on GPU 1.
        let r = filter(&c, &args(cut, &["a"]));
        assert_eq!(r.node_names, Some(vec!["a".to_string()]), "{r:?}");
    }
}

/// Epoch nanoseconds `secs` ago (negative: ahead).
fn ns_ago(secs: i64) -> u128 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i128;
    (now - secs as i128 * 1_000_000_000) as u128
}

#[test]
fn reservations_on_unbound_pods_count_only_while_fresh_so_forged_ones_expire() {
    let nodes = [node("a", 1, false)];
    let reserved = |name: &str, time: Option<u128>| {
        let mut ann =
            json!({"tencent.com/predicate-node": "a", "tencent.com/predicate-gpu-idx-0": "0"});
        if let Some(t) = time {
            ann["tencent.com/predicate-time"] = json!(t.to_string());
        }
        pod(name, &[(100, 64)], ann)
    };
    let ttl = crate::cluster::RESERVATION_TTL.as_secs() as i64;
    let skew = crate::cluster::CLOCK_SKEW.as_secs() as i64;
    for (p, counts) in [
        (reserved("fresh", Some(ns_ago(10))), true),
        (reserved("skewed", Some(ns_ago(-skew / 2))), true),
        (reserved("stale", Some(ns_ago(ttl + 5))), false),
        (reserved("forged-future", Some(ns_ago(-3600))), false),
        (reserved("no-time", None), false),
        (
            pod(
                "garbage-time",
                &[(100, 64)],
                json!({"tencent.com/predicate-node": "a", "tencent.com/predicate-gpu-idx-0": "0",
                       "tencent.com/predicate-time": "soon"}),
            ),
            false,
        ),
    ] {
        let c = Cluster::build(&nodes, [&p]);
        let held = c.nodes["a"].allocator.usage(0).allocated_cores;
        assert_eq!(
            held == 100,
            counts,
            "{}: {held} cores held",
            gpu_pods::name(&p)
        );
    }
    // Bound, the annotations count whatever their time.
    let c = Cluster::build(&nodes, &[placed("bound", &[(100, 64)], "a", &["0"])]);
    assert_eq!(c.nodes["a"].allocator.usage(0).allocated_cores, 100);
}

#[test]
fn the_score_counts_shared_instances_as_cards() {
    let profile = json!({"tencent.com/vcuda-mig-profile": "2g.20gb"});
    let nodes = [
        node_with_shared_instance("full"),
        node_with_shared_instance("empty"),
    ];
    let mut x = placed("x", &[(70, 8)], "full", &["1"]);
    let ann = x.metadata.annotations.get_or_insert_with(Default::default);
    ann.insert("tencent.com/vcuda-mig-profile".into(), "2g.20gb".into());
    ann.insert("tencent.com/predicate-mig-0".into(), "MIG-2g".into());
    let c = Cluster::build(&nodes, &[x]);
    let a = args(pod("new", &[(30, 8)], profile), &["full", "empty"]);
    let scores: Vec<_> = prioritize(&c, &a, Policy::Binpack)
        .unwrap()
        .into_iter()
        .map(|h| (h.host, h.score))
        .collect();
    // 300 cores (two GPUs and the instance): 100 used after it on "full",
    // 30 on "empty".
    assert_eq!(scores, [("full".into(), 3), ("empty".into(), 1)]);
}
