//! Shares on several GPUs (`tencent.com/vcuda-gpus`, docs/multi-gpu.md):
//! the annotation's errors, placement on an NVLink pair, the refusal when
//! no set of GPUs has room, gpu-admission's choice, and recovery.

use quota_config::{GpuQuota, MultiGpuQuota, Quota};

use super::*;

/// Four GPUs on one host bridge; GPUs 2 and 3 joined by NVLink.
fn nvlink_rig() -> Rig {
    let nvlink = |a: usize, b: usize| u32::from(a.min(b) == 2 && a.max(b) == 3) * 4;
    let topo = Topology::from_fn(gpus(4), |_, _| PcieLevel::HostBridge, nvlink).unwrap();
    Rig::with(MemoryCheckpoint::default(), topo)
}

/// `vcuda-core` 100 and `vcuda-memory` 64 over two GPUs: 50 cores and 32
/// units (8 GiB) on each.
fn tp2(name: &str, extra: serde_json::Value) -> Pod {
    let mut ann = json!({"tencent.com/vcuda-gpus": r#"{"c": 2}"#});
    ann.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    pod(name, 100, 64, ann)
}

fn env<'a>(resp: &'a device_plugin::api::ContainerAllocateResponse, key: &str) -> &'a str {
    resp.envs.get(key).map(String::as_str).unwrap_or("")
}

#[tokio::test]
async fn a_two_gpu_share_goes_to_the_free_nvlink_pair_with_a_ledger_per_gpu() {
    let rig = nvlink_rig();
    rig.pods.put(tp2("tp", json!({})));
    let resp = rig.mgr.allocate_vcore(vcore_ids(0, 100)).await.unwrap();
    let a = &rig.mgr.allocations()[0];
    assert_eq!(
        a.placement,
        PlacementRecord::Shares {
            gpus: vec![2, 3],
            cores: 50,
            memory_units: 32
        }
    );
    assert_eq!((a.cores, a.memory_units, a.memory_limit), (100, 64, 64));
    // The checkpoint holds it before the answer.
    assert_eq!(rig.checkpoint.saved().unwrap().1[0].placement, a.placement);
    // The answer: both GPUs, the interposer's volume, the vm directory.
    assert_eq!(env(&resp, "NVIDIA_VISIBLE_DEVICES"), "GPU-2,GPU-3");
    let devices: Vec<&str> = resp.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(&devices[..2], ["/dev/nvidia2", "/dev/nvidia3"]);
    assert!(resp.mounts.iter().any(|m| m.host_path.ends_with("nvidia")));
    // Each GPU's quota in the files, one ledger per GPU.
    let dir = rig.vm_dir("uid-tp", "c");
    let Quota::Multi(q) = quota_config::read_quota(&dir).unwrap() else {
        panic!("not a multi-GPU quota");
    };
    let per_gpu: Vec<_> = q
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), g.utilization, g.gpu_memory))
        .collect();
    assert_eq!(per_gpu, [("GPU-2", 50, 8 * GIB), ("GPU-3", 50, 8 * GIB)]);
    assert!(live_ledger(&dir, 0) && live_ledger(&dir, 1));
    assert!(dir.join(quota_config::SOCKET_FILE).exists());
    // gpu-admission's annotation names both GPUs.
    let patch = &rig.patches.submitted()[0];
    assert_eq!(patch.annotations["tencent.com/predicate-gpu-idx-0"], "2,3");
    // Released on both GPUs.
    rig.mgr.release(&a.id());
    assert!(rig.mgr.gpu_usages().iter().all(|u| u.allocated_cores == 0));
    assert!(!dir.exists());
}

#[tokio::test]
async fn a_bad_vcuda_gpus_annotation_is_refused_naming_the_pod_and_the_key() {
    let rig = Rig::new();
    for (i, (ann, cores, memory, says)) in [
        (
            "{c: 2}",
            100,
            64,
            "is not a JSON object of container name to GPU count",
        ),
        (
            r#"{"main": 2}"#,
            100,
            64,
            r#"names container "main", which is not one of the pod's containers"#,
        ),
        (
            r#"{"c": 0}"#,
            100,
            64,
            "a GPU count is an integer from 1 to 2",
        ),
        (
            r#"{"c": 3}"#,
            100,
            64,
            "a GPU count is an integer from 1 to 2",
        ),
        (r#"{"c": 2}"#, 81, 64, "vcuda-core does not split evenly"),
        (r#"{"c": 2}"#, 200, 64, "each GPU would get 100 cores"),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("bad{i}");
        rig.pods.put(pod(
            &name,
            cores,
            memory,
            json!({"tencent.com/vcuda-gpus": ann}),
        ));
        let e = rig
            .mgr
            .allocate_vcore(vcore_ids(0, cores as u32))
            .await
            .unwrap_err();
        let m = e.message();
        assert_eq!(e.kind(), RefusalKind::InvalidArgument, "{m}");
        assert!(m.contains(&format!("pod ns/{name}")), "{m}");
        assert!(m.contains("tencent.com/vcuda-gpus"), "{m}");
        assert!(m.contains(says), "{m}");
        let ev = rig.events.posted();
        assert_eq!(ev.last().unwrap().note, m);
        rig.pods.remove(&format!("uid-{name}"));
    }
    assert!(rig.mgr.allocations().is_empty());
}

#[tokio::test]
async fn no_two_gpus_with_room_is_refused_with_each_gpu_s_free_capacity() {
    let rig = Rig::new();
    rig.pods.put(pod("big", 80, 8, json!({})));
    rig.mgr.allocate_vcore(vcore_ids(0, 80)).await.unwrap();
    rig.pods.put(pod(
        "tp",
        60,
        8,
        json!({"tencent.com/vcuda-gpus": r#"{"c": 2}"#}),
    ));
    let e = rig.mgr.allocate_vcore(vcore_ids(1, 60)).await.unwrap_err();
    let m = e.message();
    assert_eq!(e.kind(), RefusalKind::ResourceExhausted, "{m}");
    assert!(m.starts_with("pod ns/tp container c: "), "{m}");
    assert!(
        m.contains("shares of 30 cores and 4 memory units (1024 MiB) on each of 2 GPUs"),
        "{m}"
    );
    assert!(m.contains("free per GPU: GPU0 20 cores/"), "{m}");
    assert!(m.contains("GPU1 100 cores/"), "{m}");
    assert_eq!(rig.mgr.allocations().len(), 1);
    assert_eq!(rig.events.posted().last().unwrap().note, m);
}

#[tokio::test]
async fn gpu_admission_s_two_gpus_are_followed_and_one_gpu_is_a_mismatch() {
    let rig = nvlink_rig();
    rig.pods
        .put(tp2("tp", json!({"tencent.com/predicate-gpu-idx-0": "0,1"})));
    rig.mgr.allocate_vcore(vcore_ids(0, 100)).await.unwrap();
    let a = &rig.mgr.allocations()[0];
    assert!(matches!(&a.placement, PlacementRecord::Shares { gpus, .. } if gpus == &[0, 1]));
    rig.pods
        .put(tp2("old", json!({"tencent.com/predicate-gpu-idx-0": "2"})));
    let e = rig.mgr.allocate_vcore(vcore_ids(2, 100)).await.unwrap_err();
    assert_eq!(e.kind(), RefusalKind::FailedPrecondition);
    assert!(
        e.message()
            .contains("predicate mismatch: gpu-admission chose /dev/nvidia2"),
        "{}",
        e.message()
    );
    assert!(e.message().contains("needs 2 GPU(s)"), "{}", e.message());
}

/// A checkpointed share of 50 cores and 32 units on GPUs 0 and 1.
fn saved_shares() -> MemoryCheckpoint {
    let a = crate::allocation::Allocation {
        pod_name: "tp".into(),
        cores: 100,
        memory_units: 64,
        memory_limit: 64,
        placement: PlacementRecord::Shares {
            gpus: vec![0, 1],
            cores: 50,
            memory_units: 32,
        },
        vcore_ids: vcore_ids(0, 100),
        ..checkpoint::sample_share("uid-tp", 0)
    };
    let uuids: Vec<String> = gpus(2).into_iter().map(|g| g.uuid).collect();
    MemoryCheckpoint::with_payload(checkpoint::encode(&uuids, [&a]))
}

#[tokio::test]
async fn restore_keeps_a_share_on_two_gpus_and_writes_its_files_back() {
    let rig = Rig::with_checkpoint(saved_shares());
    rig.pods.put(tp2("tp", json!({})));
    rig.runtime
        .add(rig.live("uid-tp", "tp", "c"), ContainerGpus::default());
    let report = rig.mgr.restore().await;
    assert_eq!((report.kept, report.released), (1, 0));
    let used: Vec<_> = rig
        .mgr
        .gpu_usages()
        .iter()
        .map(|u| (u.allocated_cores, u.allocated_memory_units))
        .collect();
    assert_eq!(used, [(50, 32), (50, 32)]);
    let dir = rig.vm_dir("uid-tp", "c");
    let Quota::Multi(q) = quota_config::read_quota(&dir).unwrap() else {
        panic!("not a multi-GPU quota");
    };
    assert_eq!(q.gpus.len(), 2);
    assert!(live_ledger(&dir, 1));
}

#[tokio::test]
async fn a_lost_share_on_two_gpus_is_rebuilt_from_its_quota_files() {
    let rig = Rig::with_checkpoint(MemoryCheckpoint::with_payload(b"{not json".to_vec()));
    let gpu = |i: usize| GpuQuota {
        bus_id: format!("0000:{:02X}:00.0", i + 1),
        uuid: format!("GPU-{i}"),
        gpu_memory: 8 * GIB,
        utilization: 50,
        limit: 50,
    };
    let q = MultiGpuQuota {
        pod_uid: "uid-tp".into(),
        container_name: "c".into(),
        hard_limit: true,
        driver_version: (550, 54),
        gpus: vec![gpu(0), gpu(1)],
    };
    node_agent::vm::VmDirs::new(&rig.tmp.path().join("vm"))
        .prepare_multi(&q)
        .unwrap();
    rig.pods.put(tp2("tp", json!({})));
    let seen = ContainerGpus {
        visible: vec!["GPU-0".into(), "GPU-1".into()],
        devices: vec![],
    };
    rig.runtime.add(rig.live("uid-tp", "tp", "c"), seen);
    let report = rig.mgr.restore().await;
    assert_eq!(report.rebuilt, 1);
    let a = &rig.mgr.allocations()[0];
    assert_eq!(
        a.placement,
        PlacementRecord::Shares {
            gpus: vec![0, 1],
            cores: 50,
            memory_units: 32
        }
    );
    assert_eq!((a.cores, a.memory_units), (100, 64));
}

/// The manager (this process) holds GPU `gpu`'s sealed ledger of the
/// container in `dir`, the one its id record names.
fn live_ledger(dir: &std::path::Path, gpu: usize) -> bool {
    let Ok(text) = std::fs::read_to_string(node_agent::ledgers::id_file(dir, gpu)) else {
        return false;
    };
    let Some(id) = container_ledger::MemfdId::parse(&text) else {
        return false;
    };
    container_ledger::find_live(gpu, id, [std::process::id() as i32]).is_some()
}
