//! Recovery's decisions on its evidence, without a manager: what a
//! checkpointed allocation, a lost container and an orphan directory
//! become, and how a lost allocation is sized.

use std::collections::BTreeMap;

use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES, Placement};
use quota_config::ResourceData;

use super::*;
use crate::decide::ids::{VCORE_RESOURCE, VMEMORY_RESOURCE};
use crate::manager::rebuild::{RebuildError, Size, gpus_seen};
use crate::world::ContainerGpus;
use crate::world::PodKey;
use crate::world::checkpoint::sample_share;

const GIB: u64 = 1 << 30;

fn gpus() -> Vec<GpuInfo> {
    (0..2)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32 + 4,
            memory_bytes: 16 * GIB,
            numa_node: None,
            pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
        })
        .collect()
}

fn uuids() -> Vec<String> {
    vec!["GPU-0".into(), "GPU-1".into()]
}

fn live(uid: &str, alive: bool) -> LiveContainer {
    LiveContainer {
        id: format!("ctr-{uid}"),
        pod_uid: uid.into(),
        pod_name: "p".into(),
        namespace: "ns".into(),
        container: "c".into(),
        alive,
        vm_source: None,
    }
}

fn phases(p: &[(&str, PodPhase)]) -> Option<BTreeMap<String, PodPhase>> {
    Some(p.iter().map(|(u, ph)| (u.to_string(), *ph)).collect())
}

/// Every source answered: the API server has `api`, the runtime runs
/// `runtime`, kubelet holds `held`.
fn sources(api: &[(&str, PodPhase)], runtime: Vec<LiveContainer>, held: Vec<Held>) -> Sources {
    Sources {
        api: phases(api),
        kubelet: Some(held),
        runtime: Some(runtime),
        unreachable: vec![],
        runtime_blind: false,
    }
}

fn held(vcore: &[&str], vmemory: &[&str]) -> Held {
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    Held {
        pod: PodKey::Uid("u1".into()),
        container: "c".into(),
        ids: BTreeMap::from([
            (VCORE_RESOURCE.to_string(), ids(vcore)),
            (VMEMORY_RESOURCE.to_string(), ids(vmemory)),
        ]),
    }
}

#[test]
fn an_allocation_on_a_gpu_whose_uuid_changed_is_dropped_before_judging() {
    let start = AtStart {
        saved_gpus: vec!["GPU-replaced".into(), "GPU-1".into()],
        saved: vec![],
        node: sources(&[("u1", PodPhase::Active)], vec![live("u1", true)], vec![]),
    };
    assert_eq!(
        start.fate(&sample_share("u1", 0), &uuids(), 10),
        Fate::GpuChanged
    );
    // The other GPU kept its UUID: judged (and kept, it runs).
    assert!(matches!(
        start.fate(&sample_share("u1", 1), &uuids(), 10),
        Fate::Judged(Verdict::Keep { .. })
    ));
    // A checkpoint of fewer GPUs than the node has: the missing one changed.
    let fewer = AtStart {
        saved_gpus: vec!["GPU-0".into()],
        ..start
    };
    assert_eq!(
        fewer.fate(&sample_share("u1", 1), &uuids(), 10),
        Fate::GpuChanged
    );
}

#[test]
fn at_start_a_dead_container_kubelet_no_longer_holds_is_released_at_once() {
    let start = AtStart {
        saved_gpus: uuids(),
        saved: vec![],
        node: sources(&[("u1", PodPhase::Active)], vec![live("u1", false)], vec![]),
    };
    // No grace at start, even for an allocation made just now.
    let a = Allocation {
        created: 10,
        ..sample_share("u1", 0)
    };
    assert!(matches!(
        start.fate(&a, &uuids(), 10),
        Fate::Judged(Verdict::Release(_))
    ));
}

#[test]
fn kubelets_ids_come_with_a_kept_allocation() {
    let start = AtStart {
        saved_gpus: uuids(),
        saved: vec![],
        node: sources(
            &[("u1", PodPhase::Active)],
            vec![live("u1", true)],
            vec![held(&["vcore-0-07"], &["vmemory-1"])],
        ),
    };
    let Fate::Judged(Verdict::Keep { ids, .. }) = start.fate(&sample_share("u1", 0), &uuids(), 10)
    else {
        panic!("not kept");
    };
    assert_eq!(
        ids,
        Some((vec!["vcore-0-07".into()], vec!["vmemory-1".into()]))
    );
}

#[test]
fn a_lost_container_is_rebuilt_only_when_alive_unallocated_and_its_pod_active() {
    let s = sources(
        &[("u1", PodPhase::Active), ("u2", PodPhase::Finished)],
        vec![],
        vec![],
    );
    assert!(s.rebuild_wanted(&live("u1", true), false));
    assert!(!s.rebuild_wanted(&live("u1", true), true), "allocated");
    assert!(!s.rebuild_wanted(&live("u1", false), false), "exited");
    assert!(!s.rebuild_wanted(&live("u2", true), false), "pod finished");
    assert!(!s.rebuild_wanted(&live("u3", true), false), "pod gone");
    // The API server cannot tell: rebuilt (the runtime says it runs).
    let blind = Sources { api: None, ..s };
    assert!(blind.rebuild_wanted(&live("u3", true), false));
}

#[test]
fn an_orphan_directory_goes_only_when_the_runtime_says_nobody_mounts_it() {
    let s = sources(&[], vec![live("u1", true), live("u2", false)], vec![]);
    assert_eq!(s.orphan("u1", "c"), Orphan::Mounted);
    assert_eq!(s.orphan("u2", "c"), Orphan::Remove, "its container exited");
    assert_eq!(s.orphan("u1", "other"), Orphan::Remove);
    let blind = Sources {
        runtime: None,
        runtime_blind: true,
        ..Sources::default()
    };
    assert_eq!(blind.orphan("u1", "c"), Orphan::Blind);
    // No runtime configured: nothing mounts anything that can be seen.
    assert_eq!(Sources::default().orphan("u1", "c"), Orphan::Remove);
}

fn quota(bus: &str, enable: bool, utilization: i32, units: u64) -> ResourceData {
    ResourceData {
        pod_uid: "u1".into(),
        limit: utilization,
        container_name: "c".into(),
        bus_id: bus.into(),
        gpu_memory: units * MEMORY_UNIT_BYTES,
        utilization,
        hard_limit: true,
        driver_version: (550, 54),
        enable,
    }
}

#[test]
fn a_lost_containers_gpus_come_from_its_environment_then_devices_then_quota_file() {
    let g = gpus();
    let both = ContainerGpus {
        visible: vec!["GPU-1".into(), "GPU-unknown".into()],
        devices: vec!["/dev/nvidia4".into()],
    };
    assert_eq!(gpus_seen(&g, &both, None), [1]);
    let devices = ContainerGpus {
        visible: vec![],
        devices: vec![
            "/dev/nvidia5".into(),
            "/dev/nvidia4".into(),
            "/dev/nvidia5".into(),
        ],
    };
    assert_eq!(gpus_seen(&g, &devices, None), [0, 1]);
    let cfg = quota("0000:02:00.0", true, 30, 4);
    assert_eq!(gpus_seen(&g, &ContainerGpus::default(), Some(&cfg)), [1]);
    assert!(gpus_seen(&g, &ContainerGpus::default(), None).is_empty());
}

#[test]
fn a_lost_allocation_is_sized_by_kubelets_ids_else_its_quota_file() {
    let g = gpus();
    let ids = |n: usize| (0..n).map(|i| format!("id-{i}")).collect::<Vec<_>>();
    // kubelet's IDs, no quota file: a share of 30 cores, 4 units.
    let s = Size::of(&g, &[1], None, &ids(30), &ids(4)).unwrap();
    assert_eq!((s.cores, s.memory_units, s.memory_limit), (30, 4, 4));
    assert_eq!(
        s.placement,
        Placement::Share {
            gpu: 1,
            cores: 30,
            memory_units: 4
        }
    );
    // The quota file alone: its utilization and memory.
    let cfg = quota("0000:01:00.0", true, 20, 8);
    let s = Size::of(&g, &[0], Some(&cfg), &[], &[]).unwrap();
    assert_eq!((s.cores, s.memory_units, s.memory_limit), (20, 8, 8));
    // Whole GPUs: 100 cores each and all their memory.
    let s = Size::of(&g, &[0, 1], None, &[], &[]).unwrap();
    assert_eq!(s.cores, 200);
    assert_eq!(s.memory_units, 2 * 16 * GIB / MEMORY_UNIT_BYTES);
    assert_eq!(s.placement, Placement::Exclusive { gpus: vec![0, 1] });
    // A share whose size nothing tells.
    let unknown = quota("0000:01:00.0", true, 0, 0);
    let e = Size::of(&g, &[0], Some(&unknown), &[], &[]).unwrap_err();
    assert!(matches!(e, RebuildError::SizeUnknown), "{e}");
}

/// A booking made moments before the manager died, its pod waiting, no
/// container and no kubelet record: kept for the Allocate the supervisor
/// resends. Older than that, or verified, it is released as before.
#[test]
fn at_start_a_booking_kubelet_got_no_answer_for_waits_for_the_resent_call() {
    let start = AtStart {
        saved_gpus: uuids(),
        saved: vec![],
        node: sources(&[("u1", PodPhase::Active)], vec![], vec![]),
    };
    let a = Allocation {
        created: 100,
        verified: false,
        ..sample_share("u1", 0)
    };
    assert_eq!(start.fate(&a, &uuids(), 101), Fate::Unanswered);
    assert!(matches!(
        start.fate(&a, &uuids(), 100 + RESEND_S),
        Fate::Judged(Verdict::Release(_))
    ));
    let verified = Allocation {
        verified: true,
        ..a
    };
    assert!(matches!(
        start.fate(&verified, &uuids(), 101),
        Fate::Judged(Verdict::Release(_))
    ));
}
