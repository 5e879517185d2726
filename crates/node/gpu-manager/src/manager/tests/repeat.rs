//! A repeat of the same Allocate (a supervisor resends the call a manager
//! process died under, after it had booked but before it answered) is
//! answered by the next manager as the first would have been; the same
//! IDs for a pod that is gone, finished or running, or within one manager
//! process, release their old holder.

use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus};

use super::*;

/// Pod `a` allocated vcuda-core 30 on GPU 0; then what the API server
/// shows after the first answer's patch: `a` assigned, and `b` pending
/// with the same request (a candidate if the call went looking again).
async fn a_allocated_and_b_pending(
    rig: &Rig,
) -> (device_plugin::api::ContainerAllocateResponse, Allocation) {
    rig.pods.put(pod("a", 30, 4, json!({})));
    let first = rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    rig.pods.put(pod(
        "a",
        30,
        4,
        json!({crate::decide::pods::GPU_ASSIGNED: "true"}),
    ));
    rig.pods.put(pod("b", 30, 4, json!({})));
    (first, rig.mgr.allocations()[0].clone())
}

/// The allocation is still `before` (same id and time), the only one.
fn only(rig: &Rig, before: &Allocation) {
    let now = rig.mgr.allocations();
    assert_eq!(now.len(), 1, "{now:?}");
    assert_eq!(
        (&now[0].id(), now[0].created),
        (&before.id(), before.created)
    );
    assert_eq!(now[0].vcore_ids, before.vcore_ids);
}

/// The manager process killed after its booking was durable: the next
/// one over the same node (checkpoint, vm directories, API server,
/// kubelet and runtime answering) restores it. Kubelet has no record of
/// it and no container runs (its answer never came).
async fn restarted(rig: Rig) -> Rig {
    let rig = Rig {
        mgr: start(rig.tmp.path(), two_gpus(), rig.world.clone()),
        ..rig
    };
    let report = rig.mgr.restore().await;
    assert_eq!((report.kept, report.released), (1, 0), "{report:?}");
    rig
}

#[tokio::test]
async fn a_resent_allocate_is_answered_as_the_first_time() {
    let rig = Rig::new();
    let (first, before) = a_allocated_and_b_pending(&rig).await;
    let rig = restarted(rig).await;
    // The same call again (IDs in another order are the same set).
    let mut ids = vcore_ids(0, 30);
    ids.reverse();
    let again = rig.mgr.allocate_vcore(ids).await.unwrap();
    assert_eq!(
        (&again.envs, &again.mounts, &again.devices),
        (&first.envs, &first.mounts, &first.devices)
    );
    assert_eq!(again, first);
    only(&rig, &before);
    assert_eq!(rig.mgr.gpu_usages()[0].allocated_cores, 30, "b not booked");
    assert!(
        rig.vm_dir("uid-a", "c")
            .join(quota_config::CONFIG_FILE)
            .is_file()
    );
    assert!(rig.events.posted().is_empty());
    // The pod's patch again: the killed process may not have sent it.
    let patches = rig.patches.submitted();
    assert_eq!(patches.len(), 2);
    assert_eq!(patches[1].uid, "uid-a");
    assert_eq!(
        patches[1].annotations[crate::decide::pods::GPU_ASSIGNED],
        "true"
    );
    // Answered once: a third call with these IDs is no repeat.
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    b_booked(&rig, "asked a third time");
}

#[tokio::test]
async fn a_repeat_writes_a_wiped_vm_directory_again_at_the_same_path() {
    let rig = Rig::new();
    let (first, before) = a_allocated_and_b_pending(&rig).await;
    let rig = restarted(rig).await;
    std::fs::remove_dir_all(rig.vm_dir("uid-a", "c")).unwrap();
    let again = rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    assert_eq!(again, first);
    only(&rig, &before);
    let dir = rig.vm_dir("uid-a", "c");
    assert!(dir.join(quota_config::CONFIG_FILE).is_file());
    assert!(dir.join(quota_config::SOCKET_FILE).exists(), "served again");
}

/// `a` after its first answer, in each way that makes the same IDs not
/// a repeat: gone from the API server, finished, being deleted, started.
fn not_a_repeat() -> Vec<(&'static str, Option<Pod>)> {
    let assigned = || {
        pod(
            "a",
            30,
            4,
            json!({crate::decide::pods::GPU_ASSIGNED: "true"}),
        )
    };
    let with_status = |phase: &str, running: bool| {
        let mut p = assigned();
        let st = p.status.get_or_insert_default();
        st.phase = Some(phase.into());
        if running {
            st.container_statuses = Some(vec![ContainerStatus {
                name: "c".into(),
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }),
                ..Default::default()
            }]);
        }
        p
    };
    let mut deleting = assigned();
    deleting.metadata.deletion_timestamp =
        Some(serde_json::from_value(json!("2024-01-02T00:00:00Z")).unwrap());
    vec![
        ("deleted", None),
        ("succeeded", Some(with_status("Succeeded", false))),
        ("failed", Some(with_status("Failed", false))),
        ("being deleted", Some(deleting)),
        ("running", Some(with_status("Running", true))),
    ]
}

/// The same IDs went to `b`: `a`'s allocation was released.
fn b_booked(rig: &Rig, case: &str) {
    assert_eq!(booked(rig), ["uid-b"], "{case}");
    assert!(!rig.vm_dir("uid-a", "c").exists(), "{case}");
}

#[tokio::test]
async fn the_same_ids_after_the_pod_is_gone_or_started_go_to_the_next_pod() {
    for (case, a) in not_a_repeat() {
        let rig = Rig::new();
        a_allocated_and_b_pending(&rig).await;
        match a {
            Some(p) => rig.pods.put(p),
            None => rig.pods.remove("uid-a"),
        }
        let rig = Rig {
            mgr: start(rig.tmp.path(), two_gpus(), rig.world.clone()),
            ..rig
        };
        rig.mgr.restore().await;
        rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
        b_booked(&rig, case);
    }
}

/// Within one manager process a call is answered or refused: the same IDs
/// again come from kubelet for another container (it gives out only free
/// IDs: it let `a` go, its phase not seen here yet), never as a repeat,
/// and release their old holder.
#[tokio::test]
async fn within_one_process_the_same_ids_go_to_the_next_pod() {
    let rig = Rig::new();
    a_allocated_and_b_pending(&rig).await;
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    b_booked(&rig, "same process");
    // Verified at PreStart, then a restart: kubelet had the first answer.
    let rig = Rig::new();
    a_allocated_and_b_pending(&rig).await;
    let x = vcore_ids(0, 30);
    holds(&rig, "a", ids::VCORE_RESOURCE, &x);
    rig.mgr.pre_start(ids::VCORE_RESOURCE, &x).await.unwrap();
    assert!(rig.mgr.allocations()[0].verified);
    let rig = Rig {
        mgr: start(rig.tmp.path(), two_gpus(), rig.world.clone()),
        ..rig
    };
    rig.mgr.restore().await;
    rig.mgr.allocate_vcore(vcore_ids(0, 30)).await.unwrap();
    b_booked(&rig, "verified");
}
