//! The manager's decisions through the in-memory world: a rig of two GPUs,
//! pods set in the API server double, kubelet's records and the runtime's
//! containers set by each test; vm directories in a temporary directory.

use std::sync::Arc;
use std::time::Duration;

use crate::manager::RefusalKind;
use gpu_allocator::{Allocator, GpuInfo, PcieLevel, Topology};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::*;
use crate::allocation::PlacementRecord;
use crate::world::ApiHealth;
use crate::world::PodKey;
use crate::world::checkpoint;
use crate::world::doubles::{
    MemoryCheckpoint, MemoryKubelet, MemoryPatches, MemoryPods, MemoryRuntime,
};
use crate::world::{ContainerGpus, LiveContainer};
use node_agent::events::{self, MemoryEvents};

mod repeat;
mod shares;

const GIB: u64 = 1 << 30;

struct Rig {
    mgr: Arc<Manager>,
    pods: Arc<MemoryPods>,
    patches: Arc<MemoryPatches>,
    events: Arc<MemoryEvents>,
    kubelet: Arc<MemoryKubelet>,
    checkpoint: Arc<MemoryCheckpoint>,
    runtime: Arc<MemoryRuntime>,
    /// The doubles above, as a manager takes them.
    world: World,
    tmp: tempfile::TempDir,
}

fn gpus(n: usize) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32,
            memory_bytes: 16 * GIB,
            numa_node: None,
            pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
        })
        .collect()
}

/// The pods that hold an allocation, by UID.
fn booked(rig: &Rig) -> Vec<String> {
    rig.mgr
        .allocations()
        .into_iter()
        .map(|a| a.pod_uid)
        .collect()
}

/// Two GPUs on one PCIe switch.
fn two_gpus() -> Topology {
    Topology::from_fn(gpus(2), |_, _| PcieLevel::Single, |_, _| 0).unwrap()
}

/// A manager over `world`, its vm directories under `root`.
fn start(root: &std::path::Path, topo: Topology, world: World) -> Arc<Manager> {
    Manager::new(ManagerParts {
        config: config(root),
        allocator: Allocator::new(topo),
        driver_version: (550, 54),
        extra: Default::default(),
        world,
    })
}

fn config(root: &std::path::Path) -> ManagerConfig {
    ManagerConfig {
        node_name: "node-1".into(),
        share_mode: true,
        vm_root: root.join("vm"),
        vdriver_dir: root.join("vdriver"),
    }
}

impl Rig {
    fn new() -> Rig {
        Rig::with_checkpoint(MemoryCheckpoint::default())
    }

    fn with_checkpoint(cp: MemoryCheckpoint) -> Rig {
        Rig::with(cp, two_gpus())
    }

    fn with(cp: MemoryCheckpoint, topo: Topology) -> Rig {
        let tmp = tempfile::tempdir().unwrap();
        let (pods, patches, events) = (
            Arc::new(MemoryPods::default()),
            Arc::new(MemoryPatches::default()),
            Arc::new(MemoryEvents::default()),
        );
        let (kubelet, checkpoint, runtime) = (
            Arc::new(MemoryKubelet::default()),
            Arc::new(cp),
            Arc::new(MemoryRuntime::default()),
        );
        let world = World {
            pods: pods.clone(),
            patcher: patches.clone(),
            events: events.clone(),
            kubelet: kubelet.clone(),
            checkpoint: checkpoint.clone(),
            runtime: runtime.clone(),
        };
        Rig {
            mgr: start(tmp.path(), topo, world.clone()),
            pods,
            patches,
            events,
            kubelet,
            checkpoint,
            runtime,
            world,
            tmp,
        }
    }

    fn vm_dir(&self, uid: &str, container: &str) -> std::path::PathBuf {
        self.tmp.path().join("vm").join(uid).join(container)
    }

    /// A live container of the runtime that mounts its vm directory.
    fn live(&self, uid: &str, name: &str, container: &str) -> LiveContainer {
        LiveContainer {
            id: format!("ctr-{uid}"),
            pod_uid: uid.into(),
            pod_name: name.into(),
            namespace: "ns".into(),
            container: container.into(),
            alive: true,
            vm_source: Some(self.vm_dir(uid, container)),
        }
    }
}

/// A pending pod `name` (uid `uid-<name>`) with one GPU container `c`.
fn pod(name: &str, cores: u64, memory: u64, annotations: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                     "creationTimestamp": "2024-01-01T00:00:00Z", "annotations": annotations},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {
            ids::VCORE_RESOURCE: cores.to_string(),
            ids::VMEMORY_RESOURCE: memory.to_string(),
        }}}]},
        "status": {"phase": "Pending"}
    }))
    .unwrap()
}

fn vcore_ids(gpu: usize, n: u32) -> Vec<String> {
    (0..n).map(|k| ids::vcore_id(gpu, k)).collect()
}

fn vmemory_ids(n: u64) -> Vec<String> {
    (0..n).map(|k| ids::vmemory_id(0, k)).collect()
}

/// How many vcore device IDs the plugin lists as not healthy.
fn unhealthy_vcore_ids(rig: &Rig) -> usize {
    rig.mgr
        .vcore
        .subscribe()
        .borrow()
        .iter()
        .filter(|d| d.health != "Healthy")
        .count()
}

fn holds(rig: &Rig, name: &str, resource: &str, ids: &[String]) {
    rig.kubelet.record(
        PodKey::Name {
            namespace: "ns".into(),
            name: name.into(),
        },
        "c",
        resource,
        ids,
    );
}

#[tokio::test]
async fn a_share_is_placed_recorded_durably_and_the_pod_patched() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    let resp = rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    let a = &rig.mgr.allocations()[0];
    assert_eq!(
        (a.pod_uid.as_str(), a.cores, a.memory_units),
        ("uid-a", 30, 4)
    );
    assert!(matches!(
        a.placement,
        PlacementRecord::Share {
            cores: 30,
            memory_units: 4,
            ..
        }
    ));
    // Durable before the answer.
    let (uuids, saved) = rig.checkpoint.saved().expect("a checkpoint was written");
    assert_eq!((uuids.len(), saved.len()), (2, 1));
    assert!(
        rig.vm_dir("uid-a", "c")
            .join(quota_config::CONFIG_FILE)
            .is_file()
    );
    assert!(resp.mounts.iter().any(|m| m.container_path == "/etc/vcuda"));
    let patch = &rig.patches.submitted()[0];
    assert_eq!(patch.uid, "uid-a");
    assert_eq!(patch.annotations[crate::decide::pods::GPU_ASSIGNED], "true");
    assert!(rig.events.posted().is_empty());
}

#[tokio::test]
async fn a_request_that_fits_nowhere_is_refused_with_an_event_on_the_pod() {
    let rig = Rig::new();
    rig.pods.put(pod("big", 300, 0, json!({})));
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 300)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::InvalidArgument, "{}", e.message());
    assert!(e.message().contains("pod ns/big"), "{}", e.message());
    assert!(rig.mgr.allocations().is_empty());
    let ev = rig.events.posted();
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].reason, ev[0].uid.as_str()),
        (events::ALLOCATE_FAILED, "uid-big")
    );
    assert_eq!(ev[0].note, e.message());
}

#[tokio::test]
async fn a_failed_checkpoint_write_undoes_the_allocation() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 50, 8, json!({})));
    rig.checkpoint.fail_writes(Some("disk full"));
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 50)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::Internal);
    assert!(e.message().contains("disk full"), "{}", e.message());
    assert!(rig.mgr.allocations().is_empty());
    assert!(rig.mgr.gpu_usages().iter().all(|u| u.allocated_cores == 0));
    assert!(!rig.vm_dir("uid-a", "c").exists());
    // Writable again: the same request goes through.
    rig.checkpoint.fail_writes(None);
    rig.mgr.allocate_vcore(vcore_ids(0, 50)).await.unwrap();
    assert_eq!(rig.mgr.allocations().len(), 1);
}

#[tokio::test]
async fn without_a_matching_pod_the_answer_says_why() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 20)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::FailedPrecondition);
    assert!(e.message().contains("vcuda-core 20"), "{}", e.message());
    rig.pods
        .set_health(ApiHealth::Failing("connection refused".into()));
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 20)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::Unavailable);
    assert!(
        e.message().contains("connection refused"),
        "{}",
        e.message()
    );
}

#[tokio::test]
async fn gpu_admission_s_choice_is_followed_or_refused_with_both_sides() {
    let rig = Rig::new();
    let on = |gpu: &str| json!({"tencent.com/predicate-gpu-idx-0": gpu});
    rig.pods.put(pod("a", 30, 4, on("1")));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    let a = &rig.mgr.allocations()[0];
    assert!(matches!(a.placement, PlacementRecord::Share { gpu: 1, .. }));
    rig.pods.put(pod("b", 30, 4, on("7")));
    let e = rig.mgr.allocate_vcore(vcore_ids(1, 30)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::FailedPrecondition);
    assert!(e.message().contains("/dev/nvidia7"), "{}", e.message());
}

#[tokio::test]
async fn vcuda_memory_ids_before_vcuda_core_are_adopted() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vmemory(vmemory_ids(4));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    assert_eq!(rig.mgr.allocations()[0].vmemory_ids, vmemory_ids(4));
}

#[tokio::test]
async fn pre_start_verifies_a_right_guess() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    holds(&rig, "a", ids::VCORE_RESOURCE, &vcore_ids(0, 30));
    rig.mgr
        .pre_start(ids::VCORE_RESOURCE, &vcore_ids(0, 30))
        .await
        .unwrap();
    assert!(rig.mgr.allocations()[0].verified);
}

#[tokio::test]
async fn pre_start_withdraws_a_wrong_guess_and_says_so_on_both_pods() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.pods.put(pod("b", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    let guessed = rig.mgr.allocations()[0].pod_name.clone();
    let other = if guessed == "a" { "b" } else { "a" };
    holds(&rig, other, ids::VCORE_RESOURCE, &vcore_ids(0, 30));
    let e = rig
        .mgr
        .pre_start(ids::VCORE_RESOURCE, &vcore_ids(0, 30))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::FailedPrecondition);
    assert!(rig.mgr.allocations().is_empty());
    assert!(!rig.vm_dir(&format!("uid-{guessed}"), "c").exists());
    let revert = rig.patches.submitted().pop().unwrap();
    assert_eq!(revert.uid, format!("uid-{guessed}"));
    assert_eq!(
        revert.annotations[crate::decide::pods::GPU_ASSIGNED],
        "false"
    );
    let mut on: Vec<_> = rig
        .events
        .posted()
        .into_iter()
        .filter(|e| e.reason == events::WRONG_POD_GUESS)
        .map(|e| e.name)
        .collect();
    on.sort();
    assert_eq!(on, ["a", "b"]);
    // Withdrawn: the guessed pod is a candidate again.
    rig.mgr.allocate_vcore(vcore_ids(1, 30)).await.unwrap();
    assert_eq!(rig.mgr.allocations().len(), 1);
}

/// A pod kubelet refused at admission (no healthy devices while the
/// manager was down) stays Pending in the API server for a while, but
/// kubelet lists it no more (pod-resources `List`: active pods), so it is
/// not guessed. Seen on the 1.36 node: the guess of such a pod made every
/// later guess wrong, and their containers failed until deleted.
#[tokio::test]
async fn a_pod_kubelet_does_not_list_is_not_guessed() {
    async fn guess(active: Option<&[(&str, &str)]>) -> String {
        let rig = Rig::new();
        rig.pods.put(pod("a", 30, 4, json!({})));
        rig.pods.put(pod("b", 30, 4, json!({})));
        if let Some(a) = active {
            rig.kubelet.set_active(a);
        }
        rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
        rig.mgr.allocations()[0].pod_name.clone()
    }
    // Kubelet's list unknown: the guess by order.
    let first = guess(None).await;
    let other = if first == "a" { "b" } else { "a" };
    // Kubelet lists only the other one (the first was refused).
    assert_eq!(
        guess(Some(&[("ns", other), ("ns", "unrelated")])).await,
        other
    );
    assert_eq!(guess(Some(&[("ns", &first), ("ns", other)])).await, first);
    // Kubelet lists neither: after the pod wait (5 s), the guess by order.
    assert_eq!(guess(Some(&[])).await, first);
}

/// The pod kubelet admits reaches the watch while the manager waits for
/// kubelet's `List`: that change must wake the wait, not be lost until
/// the pod wait runs out and the guess falls to every pending pod (which
/// took the other one, first by order: CI, 2026-12-02).
#[tokio::test]
async fn a_pod_that_arrives_during_kubelet_s_list_is_the_one_taken() {
    let rig = Rig::new();
    rig.pods.put(pod(
        "a",
        30,
        4,
        json!({"tencent.com/predicate-time": "100"}),
    ));
    rig.kubelet.set_active(&[("ns", "b")]);
    let pods = rig.pods.clone();
    rig.kubelet.during_next_list(move || {
        pods.put(pod(
            "b",
            30,
            4,
            json!({"tencent.com/predicate-time": "200"}),
        ));
    });
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    assert_eq!(booked(&rig), ["uid-b"]);
}

/// A pod kubelet lists but the watch has not brought is waited for (the
/// watch's order says earlier deletions were seen first), and kubelet's
/// List is not asked again meanwhile: it named the pod already.
#[tokio::test]
async fn a_listed_pod_the_watch_has_not_brought_is_waited_for() {
    let rig = Rig::new();
    rig.pods.put(pod(
        "a",
        30,
        4,
        json!({"tencent.com/predicate-time": "100"}),
    ));
    rig.kubelet.set_active(&[("ns", "b")]);
    let pods = rig.pods.clone();
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        pods.put(pod(
            "b",
            30,
            4,
            json!({"tencent.com/predicate-time": "200"}),
        ));
    });
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    later.await.unwrap();
    assert_eq!(booked(&rig), ["uid-b"]);
    assert_eq!(rig.kubelet.lists(), 1, "one List for the call");
}

/// A pod the watch has seen deleted frees its capacity before the next
/// placement, whether or not the release task has run yet: the scheduler
/// (and gpu-admission) placed the new pod after that deletion.
#[tokio::test]
async fn an_allocate_first_frees_pods_the_watch_saw_deleted() {
    let rig = Rig::new();
    rig.kubelet.set_active(&[("ns", "a")]);
    rig.pods.put(pod("a", 60, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 60)).await.unwrap();
    rig.pods.put(pod("c", 100, 0, json!({})));
    rig.kubelet.set_active(&[("ns", "c")]);
    rig.mgr.allocate_vcore(vcore_ids(1, 100)).await.unwrap();
    rig.pods.remove("uid-a");
    // IDs nobody holds: kubelet need not hand out the deleted pod's.
    rig.pods.put(pod("b", 60, 4, json!({})));
    rig.kubelet.set_active(&[("ns", "b")]);
    let ids: Vec<String> = (100..160).map(|k| ids::vcore_id(0, k)).collect();
    rig.mgr.allocate_vcore(ids).await.unwrap();
    let mut on = booked(&rig);
    on.sort();
    assert_eq!(on, ["uid-b", "uid-c"]);
}

#[tokio::test]
async fn pre_start_without_kubelet_s_records_keeps_the_allocation_unverified() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    rig.kubelet
        .set_unreachable("pod-resources: connection refused");
    rig.mgr
        .pre_start(ids::VCORE_RESOURCE, &vcore_ids(0, 30))
        .await
        .unwrap();
    let a = &rig.mgr.allocations()[0];
    assert!(!a.verified);
    // Devices the manager never allocated fail the container.
    let e = rig
        .mgr
        .pre_start(ids::VCORE_RESOURCE, &vcore_ids(1, 10))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::FailedPrecondition);
}

#[tokio::test]
async fn a_deleted_pod_frees_its_capacity_only_when_the_api_server_says_so() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    rig.pods.set_health(ApiHealth::Failing("timeout".into()));
    rig.pods.remove("uid-a");
    assert_eq!(rig.mgr.release_deleted_pods(), 0);
    rig.pods.set_health(ApiHealth::Ok);
    assert_eq!(rig.mgr.release_deleted_pods(), 1);
    assert!(rig.mgr.allocations().is_empty());
    assert!(!rig.vm_dir("uid-a", "c").exists());
    assert!(
        rig.mgr.checkpoint_dirty(),
        "a release waits for the next write"
    );
    rig.mgr.flush().await.unwrap();
    assert!(rig.checkpoint.saved().unwrap().1.is_empty());
}

#[tokio::test]
async fn the_periodic_check_releases_a_dead_container_once_runtime_and_kubelet_agree() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    // Runtime unreachable: nothing is released on its account.
    rig.runtime.set_unreachable();
    rig.mgr.check_allocations(Duration::ZERO).await;
    assert_eq!(rig.mgr.allocations().len(), 1);
    // Reachable, the container gone and kubelet holding nothing: released.
    let rig2 = Rig::new();
    rig2.pods.put(pod("a", 30, 4, json!({})));
    rig2.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    rig2.mgr.check_allocations(Duration::ZERO).await;
    assert!(rig2.mgr.allocations().is_empty());
    assert!(
        !rig2.mgr.checkpoint_dirty(),
        "the check writes what changed"
    );
}

/// A checkpoint of two shares on GPU 0: pods `a` and `b`.
fn saved_two() -> MemoryCheckpoint {
    let allocs: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| crate::allocation::Allocation {
            pod_name: n.to_string(),
            container: "c".into(),
            vcore_ids: vcore_ids(0, 30),
            ..checkpoint::sample_share(&format!("uid-{n}"), 0)
        })
        .collect();
    let uuids: Vec<String> = gpus(2).into_iter().map(|g| g.uuid).collect();
    MemoryCheckpoint::with_payload(checkpoint::encode(&uuids, &allocs))
}

#[tokio::test]
async fn restore_keeps_live_containers_and_releases_the_gone() {
    let rig = Rig::with_checkpoint(saved_two());
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.runtime
        .add(rig.live("uid-a", "a", "c"), ContainerGpus::default());
    let report = rig.mgr.restore().await;
    assert_eq!((report.kept, report.released, report.rebuilt), (1, 1, 0));
    assert!(report.unreachable.is_empty(), "{:?}", report.unreachable);
    assert_eq!(booked(&rig), ["uid-a"]);
    // Its files and socket are back; the record is written again.
    assert!(
        rig.vm_dir("uid-a", "c")
            .join(quota_config::CONFIG_FILE)
            .is_file()
    );
    assert_eq!(rig.checkpoint.saved().unwrap().1.len(), 1);
}

#[tokio::test]
async fn restore_with_every_source_unreachable_releases_nothing() {
    let rig = Rig::with_checkpoint(saved_two());
    rig.pods.set_health(ApiHealth::Failing("refused".into()));
    rig.kubelet.set_unreachable("no socket");
    rig.runtime.set_unreachable();
    let report = rig.mgr.restore().await;
    assert_eq!((report.kept, report.released), (2, 0));
    assert_eq!(report.unreachable.len(), 3, "{:?}", report.unreachable);
}

/// A node whose checkpoint is unreadable, with pod "a" (30 cores, 4
/// units, `annotations`) running on GPU-1: its share must be rebuilt.
fn lost_share(annotations: serde_json::Value) -> Rig {
    let rig = Rig::with_checkpoint(MemoryCheckpoint::with_payload(b"{not json".to_vec()));
    rig.pods.put(pod("a", 30, 4, annotations));
    holds(&rig, "a", ids::VCORE_RESOURCE, &vcore_ids(0, 30));
    holds(&rig, "a", ids::VMEMORY_RESOURCE, &vmemory_ids(4));
    let gpus = ContainerGpus {
        visible: vec!["GPU-1".into()],
        devices: vec![],
    };
    rig.runtime.add(rig.live("uid-a", "a", "c"), gpus);
    rig
}

#[tokio::test]
async fn restore_sets_an_unreadable_checkpoint_aside_and_rebuilds_from_the_node() {
    let rig = lost_share(json!({}));
    let report = rig.mgr.restore().await;
    assert!(report.set_aside.is_some());
    assert_eq!((report.kept, report.rebuilt), (0, 1));
    let a = &rig.mgr.allocations()[0];
    assert_eq!((a.cores, a.memory_limit, a.verified), (30, 4, true));
    assert!(matches!(a.placement, PlacementRecord::Share { gpu: 1, .. }));
}

/// A rebuilt share takes its tier and memory limit from the pod's
/// annotations again (the quota files do not hold them).
#[tokio::test]
async fn a_rebuilt_share_keeps_its_tier_and_memory_limit() {
    let ann = json!({"tencent.com/vcuda-tier": "batch", "tencent.com/vcuda-memory-limit": "3Gi"});
    let rig = lost_share(ann);
    assert_eq!(rig.mgr.restore().await.rebuilt, 1);
    let a = &rig.mgr.allocations()[0];
    assert_eq!(a.tier, qos_page::Tier::Batch);
    assert_eq!(a.memory_ceiling, Some(3 << 30));
}

#[tokio::test]
async fn a_poisoned_state_fails_health_and_refuses_allocate() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    assert!(rig.mgr.health().is_ok());
    let mgr = rig.mgr.clone();
    let _ = std::thread::spawn(move || {
        let _st = mgr.state.lock().unwrap();
        panic!("injected: a panic while the state lock is held");
    })
    .join();
    let why = rig.mgr.health().unwrap_err();
    assert!(why.to_string().contains("poisoned"), "{why}");
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::Unavailable, "{}", e.message());
    // Readers keep working for the display.
    assert!(rig.mgr.allocations().is_empty());
}

#[tokio::test]
async fn whole_gpus_are_exclusive_and_get_no_socket() {
    let rig = Rig::new();
    rig.pods.put(pod("whole", 200, 0, json!({})));
    let resp = rig.mgr.allocate_vcore(vcore_ids(0, 200)).await.unwrap();
    let a = &rig.mgr.allocations()[0];
    assert_eq!(a.placement, PlacementRecord::Exclusive { gpus: vec![0, 1] });
    assert_eq!(
        a.memory_units,
        2 * 16 * GIB / gpu_allocator::MEMORY_UNIT_BYTES
    );
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-0,GPU-1");
    assert!(!rig.vm_dir("uid-whole", "c").join("vcuda.sock").exists());
    assert!(rig.mgr.registry().pids(&a.id()).is_empty());
}

#[tokio::test]
async fn a_bad_soft_limit_annotation_is_refused_and_names_it() {
    let rig = Rig::new();
    rig.pods.put(pod(
        "soft",
        30,
        4,
        json!({crate::decide::pods::VCORE_LIMIT: "150"}),
    ));
    let e = rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::InvalidArgument);
    assert!(
        e.message().contains(crate::decide::pods::VCORE_LIMIT),
        "{}",
        e.message()
    );
    assert!(rig.mgr.gpu_usages().iter().all(|u| u.allocated_cores == 0));
    rig.pods.put(pod(
        "soft",
        30,
        4,
        json!({crate::decide::pods::VCORE_LIMIT: "50"}),
    ));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    assert_eq!(rig.mgr.allocations()[0].soft_limit, Some(50));
}

#[tokio::test]
async fn an_unhealthy_gpu_takes_no_new_placements_and_its_ids_go_unhealthy() {
    let rig = Rig::new();
    rig.mgr.set_gpu_health(0, false);
    assert_eq!(unhealthy_vcore_ids(&rig), 100);
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(1, 30)).await.unwrap();
    assert!(matches!(
        rig.mgr.allocations()[0].placement,
        PlacementRecord::Share { gpu: 1, .. }
    ));
    rig.mgr.set_gpu_health(0, true);
    assert_eq!(unhealthy_vcore_ids(&rig), 0);
}

#[tokio::test]
async fn the_periodic_check_patches_a_complete_pod_whose_annotation_is_missing() {
    let rig = Rig::new();
    rig.pods.put(pod("a", 30, 4, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    holds(&rig, "a", ids::VCORE_RESOURCE, &vcore_ids(0, 30));
    let before = rig.patches.submitted().len();
    rig.mgr.check_allocations(Duration::from_secs(3600)).await;
    let after = rig.patches.submitted();
    assert_eq!(after.len(), before + 1, "the annotation is submitted again");
    assert_eq!(
        after.last().unwrap().annotations[crate::decide::pods::GPU_ASSIGNED],
        "true"
    );
    assert_eq!(rig.mgr.allocations().len(), 1, "kubelet holds it: kept");
}

#[tokio::test]
async fn restore_drops_allocations_on_gpus_that_changed_and_removes_orphan_directories() {
    let allocs = vec![crate::allocation::Allocation {
        pod_name: "a".into(),
        ..checkpoint::sample_share("uid-a", 0)
    }];
    let other_gpus = vec!["GPU-replaced".to_string(), "GPU-1".to_string()];
    let rig = Rig::with_checkpoint(MemoryCheckpoint::with_payload(checkpoint::encode(
        &other_gpus,
        &allocs,
    )));
    rig.pods.put(pod("a", 30, 4, json!({})));
    let orphan = rig.vm_dir("uid-gone", "c");
    std::fs::create_dir_all(&orphan).unwrap();
    let report = rig.mgr.restore().await;
    assert_eq!((report.kept, report.orphans_removed), (0, 1));
    assert!(rig.mgr.allocations().is_empty());
    assert!(!orphan.exists());
    // The record is rewritten for this node's GPUs.
    let (uuids, saved) = rig.checkpoint.saved().unwrap();
    assert_eq!((uuids[0].as_str(), saved.len()), ("GPU-0", 0));
}

#[tokio::test]
async fn restore_keeps_orphan_directories_while_the_runtime_is_unreachable() {
    // No checkpoint and a blind runtime: a live container may still mount
    // the directory, so it must not be pulled away.
    let rig = Rig::new();
    rig.runtime.set_unreachable();
    let dir = rig.vm_dir("uid-live", "c");
    std::fs::create_dir_all(&dir).unwrap();
    let report = rig.mgr.restore().await;
    assert_eq!(report.orphans_removed, 0);
    assert!(dir.exists());
}

#[tokio::test]
async fn restore_rebuilds_no_container_of_a_finished_pod_but_keeps_the_directory_it_mounts() {
    let rig = Rig::new();
    let mut finished = pod("done", 30, 4, json!({}));
    finished.status = Some(k8s_openapi::api::core::v1::PodStatus {
        phase: Some("Succeeded".into()),
        ..Default::default()
    });
    rig.pods.put(finished);
    holds(&rig, "done", ids::VCORE_RESOURCE, &vcore_ids(0, 30));
    let gpus = ContainerGpus {
        visible: vec!["GPU-0".into()],
        devices: vec![],
    };
    rig.runtime.add(rig.live("uid-done", "done", "c"), gpus);
    let dir = rig.vm_dir("uid-done", "c");
    std::fs::create_dir_all(&dir).unwrap();
    let report = rig.mgr.restore().await;
    assert_eq!((report.rebuilt, report.orphans_removed), (0, 0));
    assert!(rig.mgr.allocations().is_empty());
    assert!(dir.exists(), "a live container still mounts it");
}
