//! bind against an in-memory API server with resourceVersion
//! preconditions (`Mem`): annotations where the manager reads them,
//! concurrent binds that never over-commit, lost races given back.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

use crate::api::ExtenderBindingArgs;
use crate::bind::{ApiError, BIND_SEQ, BindApi, NODE_LABEL, bind};
use crate::cluster::Cluster;
use crate::tests::{node, node_with_shared_instance, pod};

#[derive(Default)]
struct Inner {
    rv: u64,
    nodes: HashMap<String, Node>,
    pods: BTreeMap<String, Pod>,
    /// Every bump answers Conflict (a node that changes all the time).
    always_conflict: bool,
}

#[derive(Default)]
struct Mem(Mutex<Inner>);

fn rv_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    m.resource_version.clone().unwrap_or_default()
}

fn apply(map: &mut Option<BTreeMap<String, String>>, changes: &BTreeMap<String, Option<String>>) {
    let m = map.get_or_insert_with(BTreeMap::new);
    for (k, v) in changes {
        match v {
            Some(v) => m.insert(k.clone(), v.clone()),
            None => m.remove(k),
        };
    }
}

impl Mem {
    fn with(nodes: &[Node], pods: &[Pod]) -> Mem {
        let mut i = Inner {
            rv: 10,
            ..Default::default()
        };
        for n in nodes {
            i.nodes.insert(n.metadata.name.clone().unwrap(), n.clone());
        }
        for p in pods {
            i.pods.insert(gpu_pods::name(p).to_string(), p.clone());
        }
        Mem(Mutex::new(i))
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap()
    }
}

#[async_trait]
impl BindApi for Mem {
    async fn fresh(&self, node: &str) -> Result<(Node, Vec<Pod>), ApiError> {
        tokio::task::yield_now().await;
        let i = self.lock();
        let n = i
            .nodes
            .get(node)
            .cloned()
            .ok_or(ApiError::NotFound(node.into()))?;
        let on = |p: &&Pod| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                || p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(NODE_LABEL))
                    .map(String::as_str)
                    == Some(node)
        };
        Ok((n, i.pods.values().filter(on).cloned().collect()))
    }

    async fn pod(&self, _ns: &str, name: &str) -> Result<Pod, ApiError> {
        tokio::task::yield_now().await;
        self.lock()
            .pods
            .get(name)
            .cloned()
            .ok_or(ApiError::NotFound(name.into()))
    }

    async fn patch_pod(
        &self,
        pod: &Pod,
        annotations: &BTreeMap<String, Option<String>>,
        labels: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError> {
        tokio::task::yield_now().await;
        let mut i = self.lock();
        i.rv += 1;
        let rv = i.rv.to_string();
        let p = i.pods.get_mut(gpu_pods::name(pod)).unwrap();
        if rv_of(&p.metadata) != rv_of(&pod.metadata) {
            return Err(ApiError::Conflict("pod changed".into()));
        }
        apply(&mut p.metadata.annotations, annotations);
        apply(&mut p.metadata.labels, labels);
        p.metadata.resource_version = Some(rv);
        Ok(())
    }

    async fn bump(&self, node: &Node, seq: u64) -> Result<(), ApiError> {
        tokio::task::yield_now().await;
        let mut i = self.lock();
        i.rv += 1;
        let rv = i.rv.to_string();
        let conflict = i.always_conflict;
        let n = i
            .nodes
            .get_mut(node.metadata.name.as_deref().unwrap())
            .unwrap();
        if conflict || rv_of(&n.metadata) != rv_of(&node.metadata) {
            return Err(ApiError::Conflict("node changed".into()));
        }
        apply(
            &mut n.metadata.annotations,
            &BTreeMap::from([(BIND_SEQ.to_string(), Some(seq.to_string()))]),
        );
        n.metadata.resource_version = Some(rv);
        Ok(())
    }

    /// As the API server does: no resourceVersion precondition (1.20
    /// ignores one in a Binding), the annotations merged with the node.
    async fn bind(
        &self,
        pod: &Pod,
        node: &str,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError> {
        tokio::task::yield_now().await;
        let mut i = self.lock();
        i.rv += 1;
        let next = i.rv.to_string();
        let p = i.pods.get_mut(gpu_pods::name(pod)).unwrap();
        let spec = p.spec.as_mut().unwrap();
        if spec.node_name.is_some() {
            return Err(ApiError::Conflict("already bound".into()));
        }
        spec.node_name = Some(node.into());
        apply(&mut p.metadata.annotations, annotations);
        p.metadata.resource_version = Some(next);
        Ok(())
    }
}

async fn bind_b(api: &Mem, a: &ExtenderBindingArgs) -> crate::api::ExtenderBindingResult {
    bind(api, a, crate::policy::Policy::Binpack).await
}

fn args(name: &str, node: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: "default".into(),
        pod_uid: format!("uid-{name}"),
        node: node.into(),
    }
}

fn annotation(m: &Mem, pod: &str, key: &str) -> Option<String> {
    m.lock().pods[pod]
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .cloned()
}

#[tokio::test]
async fn bind_writes_the_gpus_where_the_manager_reads_them_then_binds() {
    let m = Mem::with(
        &[node("a", 4, false)],
        &[pod("p", &[(30, 8), (200, 0)], json!({}))],
    );
    let r = bind_b(&m, &args("p", "a")).await;
    assert_eq!(r.error, "");
    assert_eq!(
        annotation(&m, "p", "tencent.com/predicate-gpu-idx-0").as_deref(),
        Some("0")
    );
    assert_eq!(
        annotation(&m, "p", "tencent.com/predicate-gpu-idx-1").as_deref(),
        Some("2,3")
    );
    assert_eq!(
        annotation(&m, "p", "tencent.com/predicate-node").as_deref(),
        Some("a")
    );
    assert!(annotation(&m, "p", "tencent.com/predicate-time").is_some());
    let i = m.lock();
    assert_eq!(
        i.pods["p"].spec.as_ref().unwrap().node_name.as_deref(),
        Some("a")
    );
    assert_eq!(
        i.nodes["a"].metadata.annotations.as_ref().unwrap()[BIND_SEQ],
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_binds_never_overcommit_a_gpu() {
    // 20 pods of 30 cores for a 4-GPU node: 3 fit on each GPU.
    let pods: Vec<Pod> = (0..20)
        .map(|k| pod(&format!("p{k}"), &[(30, 8)], json!({})))
        .collect();
    let m = Arc::new(Mem::with(&[node("a", 4, false)], &pods));
    let tasks: Vec<_> = (0..20)
        .map(|k| {
            let m = m.clone();
            // A failed bind is queued again by the scheduler (others'
            // reservations in flight may have been taken back since):
            // retried here the same way, a bounded number of times.
            tokio::spawn(async move {
                let mut r = bind_b(m.as_ref(), &args(&format!("p{k}"), "a")).await;
                for _ in 0..100 {
                    if r.error.is_empty() {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    r = bind_b(m.as_ref(), &args(&format!("p{k}"), "a")).await;
                }
                r
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let r = t.await.unwrap();
        if r.error.is_empty() {
            ok += 1;
        } else {
            assert!(
                r.error.contains("no longer fits: container c0"),
                "{}",
                r.error
            );
        }
    }
    assert_eq!(ok, 12, "every GPU filled to 90 cores, never past");
    let i = m.lock();
    let c = Cluster::build(i.nodes.values(), i.pods.values());
    let st = &c.nodes["a"];
    assert!(st.problems.is_empty(), "{:?}", st.problems);
    assert!(
        st.allocator
            .usages()
            .iter()
            .all(|u| u.allocated_cores == 90)
    );
    // The losers hold nothing: no reservation left on them.
    for p in i
        .pods
        .values()
        .filter(|p| p.spec.as_ref().unwrap().node_name.is_none())
    {
        let ann = p.metadata.annotations.clone().unwrap_or_default();
        assert!(
            !ann.keys().any(|k| k.starts_with("tencent.com/predicate")),
            "{ann:?}"
        );
        assert!(
            p.metadata
                .labels
                .as_ref()
                .is_none_or(|l| !l.contains_key(NODE_LABEL))
        );
    }
}

#[tokio::test]
async fn two_binds_of_one_pod_never_leave_it_bound_with_the_other_nodes_gpus() {
    // The scheduler asks again after its extender timeout while the first
    // bind still runs, maybe for another node. Node b's GPU0 is full, so
    // the two nodes' choices differ (a: GPU0, b: GPU1). One thread: the
    // second bind starting `round` steps later walks every interleaving.
    for round in 0..40 {
        let full = crate::tests::placed("x", &[(100, 0)], "b", &["0"]);
        let m = Arc::new(Mem::with(
            &[node("a", 2, false), node("b", 2, false)],
            &[full, pod("p", &[(30, 8)], json!({}))],
        ));
        let (ra, rb) = tokio::join!(
            tokio::spawn({
                let m = m.clone();
                async move { bind_b(m.as_ref(), &args("p", "a")).await }
            }),
            tokio::spawn({
                let m = m.clone();
                async move {
                    for _ in 0..round {
                        tokio::task::yield_now().await;
                    }
                    bind_b(m.as_ref(), &args("p", "b")).await
                }
            }),
        );
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        let bound = m.lock().pods["p"].spec.as_ref().unwrap().node_name.clone();
        let ok = [&ra, &rb].iter().filter(|r| r.error.is_empty()).count();
        assert!(ok <= 1, "round {round}: both binds succeeded");
        let Some(bound) = bound else { continue };
        assert_eq!(ok, 1, "round {round}: bound, but no bind says so");
        let gpu = if bound == "a" { "0" } else { "1" };
        assert_eq!(
            annotation(&m, "p", "tencent.com/predicate-node").as_deref(),
            Some(bound.as_str()),
            "round {round}: a: {:?}, b: {:?}",
            ra.error,
            rb.error
        );
        assert_eq!(
            annotation(&m, "p", "tencent.com/predicate-gpu-idx-0").as_deref(),
            Some(gpu),
            "round {round}"
        );
    }
}

#[tokio::test]
async fn a_bind_that_keeps_losing_races_gives_its_reservation_back() {
    let m = Mem::with(&[node("a", 2, false)], &[pod("p", &[(30, 8)], json!({}))]);
    m.lock().always_conflict = true;
    let r = bind_b(&m, &args("p", "a")).await;
    assert!(r.error.contains("lost 8 races"), "{}", r.error);
    assert!(
        r.error.starts_with("pod default/p on node a:"),
        "{}",
        r.error
    );
    assert_eq!(annotation(&m, "p", "tencent.com/predicate-node"), None);
    assert_eq!(annotation(&m, "p", "tencent.com/predicate-gpu-idx-0"), None);
    assert!(
        m.lock().pods["p"]
            .spec
            .as_ref()
            .unwrap()
            .node_name
            .is_none()
    );
}

#[tokio::test]
async fn a_pod_replaced_under_its_name_is_not_bound() {
    let m = Mem::with(&[node("a", 2, false)], &[pod("p", &[(30, 8)], json!({}))]);
    let mut a = args("p", "a");
    a.pod_uid = "uid-old".into();
    let r = bind_b(&m, &a).await;
    assert!(
        r.error.contains("now has UID uid-p, not uid-old"),
        "{}",
        r.error
    );
}

#[tokio::test]
async fn spread_puts_a_share_on_the_emptiest_gpu_and_binpack_on_the_fullest() {
    let full = crate::tests::placed("x", &[(60, 8)], "a", &["2"]);
    let m = Mem::with(
        &[node("a", 4, false)],
        &[
            full,
            pod(
                "s",
                &[(30, 8)],
                json!({"tencent.com/vcuda-policy": "spread"}),
            ),
            pod("b", &[(30, 8)], json!({})),
        ],
    );
    assert_eq!(bind_b(&m, &args("s", "a")).await.error, "");
    assert_eq!(
        annotation(&m, "s", "tencent.com/predicate-gpu-idx-0").as_deref(),
        Some("0")
    );
    assert_eq!(bind_b(&m, &args("b", "a")).await.error, "");
    assert_eq!(
        annotation(&m, "b", "tencent.com/predicate-gpu-idx-0").as_deref(),
        Some("2")
    );
}

#[tokio::test]
async fn bind_refuses_pods_without_vcuda_requests_bound_pods_and_pods_being_deleted() {
    let cpu: Pod = serde_json::from_value(json!({
        "metadata": {"name": "cpu", "namespace": "default", "uid": "uid-cpu", "resourceVersion": "1"},
        "spec": {"containers": [{"name": "c"}]}
    }))
    .unwrap();
    let mut bound = pod("bound", &[(30, 8)], json!({}));
    bound.spec.as_mut().unwrap().node_name = Some("b".into());
    let mut leaving = serde_json::to_value(pod("leaving", &[(30, 8)], json!({}))).unwrap();
    leaving["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let leaving: Pod = serde_json::from_value(leaving).unwrap();
    let m = Mem::with(&[node("a", 4, false)], &[cpu, bound, leaving]);
    for (name, why) in [
        ("cpu", "asks for no tencent.com/vcuda-core"),
        ("bound", "is already bound to node b"),
        ("leaving", "is being deleted"),
    ] {
        let r = bind_b(&m, &args(name, "a")).await;
        assert!(r.error.contains(why), "{name}: {}", r.error);
        assert_eq!(
            annotation(&m, name, "tencent.com/predicate-node"),
            None,
            "{name}"
        );
    }
    let i = m.lock();
    assert_eq!(
        i.pods["bound"].spec.as_ref().unwrap().node_name.as_deref(),
        Some("b"),
        "not moved"
    );
    assert!(i.pods["cpu"].spec.as_ref().unwrap().node_name.is_none());
}

#[tokio::test]
async fn a_share_asking_for_a_mig_profile_is_bound_into_the_instance_and_counted() {
    let profile = json!({"tencent.com/vcuda-mig-profile": "2g.20gb"});
    let m = Mem::with(
        &[node_with_shared_instance("a")],
        &[
            pod("in", &[(50, 20)], profile.clone()),
            pod("over", &[(60, 4)], profile.clone()),
            pod("rest", &[(50, 4)], profile),
            pod("plain", &[(30, 4)], json!({})),
        ],
    );
    assert_eq!(bind_b(&m, &args("in", "a")).await.error, "");
    let ann = |p: &str, k: &str| annotation(&m, p, &format!("tencent.com/{k}"));
    assert_eq!(ann("in", "predicate-gpu-idx-0").as_deref(), Some("1"));
    assert_eq!(ann("in", "predicate-mig-0").as_deref(), Some("MIG-2g"));
    // The first share is counted in the instance (replayed from its
    // annotations): 60 more cores do not fit there, 50 do.
    let e = bind_b(&m, &args("over", "a")).await.error;
    assert!(
        e.contains("no healthy 2g.20gb MIG instance has 60 free cores"),
        "{e}"
    );
    assert_eq!(
        ann("over", "predicate-mig-0"),
        None,
        "a refused bind writes nothing"
    );
    assert_eq!(bind_b(&m, &args("rest", "a")).await.error, "");
    assert_eq!(ann("rest", "predicate-mig-0").as_deref(), Some("MIG-2g"));
    // A share without the annotation goes on GPU 0, never in the instance.
    assert_eq!(bind_b(&m, &args("plain", "a")).await.error, "");
    assert_eq!(ann("plain", "predicate-gpu-idx-0").as_deref(), Some("0"));
    assert_eq!(ann("plain", "predicate-mig-0"), None);
}
