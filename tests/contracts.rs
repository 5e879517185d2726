//! The formats other programs (or other releases of this one) read, kept as
//! golden files in `tests/golden/` and read here by this build's decoders:
//! a release that can no longer read what an earlier one wrote fails here,
//! before an upgrade or a rollback meets it on a node with live shares.
//!
//! A golden file is written once (`VCUDA_BLESS=1` creates the missing ones,
//! never overwrites) and then only read: a format change that must stay
//! readable adds a file beside the old one, it does not replace it.
//! `vcuda.config` (the original gpu-manager's byte layout) and
//! `vcuda-gpus.config` have theirs in `crates/formats/quota-config/tests/golden/`;
//! the DRA driver's checkpoint is read by `crates/node/dra-driver/tests/golden.rs`.

use container_ledger::Ledger;
use gpu_allocator::inventory::{Inventory, InventoryGpu, InventoryInstance};
use gpu_manager::allocation::{Allocation, PlacementRecord};
use gpu_manager::world::checkpoint::Checkpoint;
use prost::Message;
use std::path::PathBuf;
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse, register_response::Status};

const GIB: u64 = 1 << 30;

/// The golden file `name`, created from `make` only when it is missing and
/// `VCUDA_BLESS=1`.
fn golden(name: &str, make: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    let path: PathBuf = test_support::workspace_root()
        .join("tests/golden")
        .join(name);
    match std::fs::read(&path) {
        Ok(b) => b,
        Err(_) if std::env::var("VCUDA_BLESS").as_deref() == Ok("1") => {
            let b = make();
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &b).unwrap();
            b
        }
        Err(e) => panic!(
            "golden file {} missing ({e}): golden files are never regenerated; \
             restore it from git (or, for a new one, run once with VCUDA_BLESS=1 and commit it)",
            path.display()
        ),
    }
}

fn request_v1() -> RegisterRequest {
    RegisterRequest {
        protocol_version: 1,
        pod_uid: "6a0e0a3c-1f2b-4c5d-8e9f-0a1b2c3d4e5f".into(),
        container_name: "server".into(),
        bus_id: "00000000:3B:00.0".into(),
        local_pid: 7,
        program: "/usr/bin/python3".into(),
        previous_slot: None,
        previous_slots: Vec::new(),
        qos_pages: false,
        qos_flags: false,
    }
}

/// Registration bodies of protocol 1 and 2 (what an interposer of an
/// earlier release sends to this manager) decode to the same fields.
#[test]
fn registration_requests_of_both_protocols_are_read() {
    let v1 = golden("register-request-v1.pb", || request_v1().encode_to_vec());
    assert_eq!(
        RegisterRequest::decode(v1.as_slice()).unwrap(),
        request_v1()
    );
    let v2_want = RegisterRequest {
        protocol_version: 2,
        previous_slot: Some(3),
        previous_slots: vec![3, 4],
        qos_pages: false,
        ..request_v1()
    };
    let v2 = golden("register-request-v2.pb", || v2_want.encode_to_vec());
    assert_eq!(RegisterRequest::decode(v2.as_slice()).unwrap(), v2_want);
    // Today's interposer says it reads a QoS page per GPU (field 9); the
    // bodies above, from before, read as not.
    let today = RegisterRequest {
        qos_pages: true,
        ..v2_want.clone()
    };
    let b = golden("register-request-v2-qos-pages.pb", || today.encode_to_vec());
    assert_eq!(RegisterRequest::decode(b.as_slice()).unwrap(), today);
    // And, since, that it reads pages of layout 2 and latency flags (field
    // 10); the bodies above, from before, read as not: such an interposer
    // is sent no QoS descriptor and runs plain.
    let flags = RegisterRequest {
        qos_flags: true,
        ..today.clone()
    };
    let b = golden("register-request-v2-qos-flags.pb", || flags.encode_to_vec());
    assert_eq!(RegisterRequest::decode(b.as_slice()).unwrap(), flags);
    assert!(!today.qos_flags);
}

/// A reply from a manager of today's release; and one from before the
/// reply carried its version (field 6 absent: read as 0, the request's).
#[test]
fn registration_replies_are_read() {
    let want = RegisterResponse {
        status: Status::Accepted as i32,
        message: String::new(),
        host_pid: 4711,
        ledger_slot: Some(3),
        ledger_slots: vec![3, 4],
        protocol_version: 2,
        qos_tier: 0,
        qos_page: false,
        qos_slot: None,
        memory_limit: 0,
        reclaim: false,
        qos_pages: 0,
        qos_slots: vec![],
    };
    let b = golden("register-response-v2.pb", || want.encode_to_vec());
    assert_eq!(RegisterResponse::decode(b.as_slice()).unwrap(), want);
    let old = RegisterResponse {
        protocol_version: 0,
        ..want.clone()
    };
    let b = golden("register-response-unversioned.pb", || old.encode_to_vec());
    let r = RegisterResponse::decode(b.as_slice()).unwrap();
    assert_eq!((r.protocol_version, r.status()), (0, Status::Accepted));
    // A latency-tier process's reply (docs/qos.md): the tier, the page
    // after the ledger, its slot; the replies above carry none of them.
    let qos = RegisterResponse {
        ledger_slots: vec![],
        protocol_version: 1,
        qos_tier: 1,
        qos_page: true,
        qos_slot: Some(5),
        ..want.clone()
    };
    let b = golden("register-response-qos.pb", || qos.encode_to_vec());
    let one = RegisterResponse::decode(b.as_slice()).unwrap();
    assert_eq!(one, qos);
    assert_eq!(r.qos_tier, 0, "a reply without a tier is plain");
    // A latency-tier process of a share on two GPUs: a page per GPU after
    // the ledgers (fields 12, 13), the one-page fields unset; a one-GPU
    // reply names no such pages.
    let multi = RegisterResponse {
        qos_tier: 1,
        qos_pages: 2,
        qos_slots: vec![5, 9],
        ..want.clone()
    };
    let b = golden("register-response-qos-2gpus.pb", || multi.encode_to_vec());
    assert_eq!(RegisterResponse::decode(b.as_slice()).unwrap(), multi);
    assert_eq!((one.qos_pages, one.qos_slots.len()), (0, 0));
}

/// Memory requests below limits (docs/qos.md, "Memory"): a reply naming a
/// borrower's limit and the reclaim, a BORROW and its refusal, as the
/// interposer and the node agent of this release write them; a reply
/// from before the fields reads as "no limit, no reclaim".
#[test]
fn memory_requests_and_a_borrowers_reply_are_read() {
    use vcuda_api::vcuda::{MemoryRequest, MemoryResponse, memory_request, memory_response};
    let reply = RegisterResponse {
        status: 1,
        host_pid: 4711,
        ledger_slot: Some(3),
        protocol_version: 1,
        memory_limit: 12 * GIB,
        reclaim: true,
        ..Default::default()
    };
    let b = golden("register-response-memory.pb", || reply.encode_to_vec());
    assert_eq!(RegisterResponse::decode(b.as_slice()).unwrap(), reply);
    let old = golden("register-response-unversioned.pb", Vec::new);
    let old = RegisterResponse::decode(old.as_slice()).unwrap();
    assert_eq!((old.memory_limit, old.reclaim), (0, false));
    let req = MemoryRequest {
        kind: memory_request::Kind::Borrow as i32,
        bytes: 7 * GIB,
    };
    let b = golden("memory-request-borrow.pb", || req.encode_to_vec());
    assert_eq!(MemoryRequest::decode(b.as_slice()).unwrap(), req);
    let resp = MemoryResponse {
        status: memory_response::Status::Refused as i32,
        message: "GPU GPU-0 has 4096 MiB nobody is guaranteed".into(),
        available: 3 * GIB,
        reclaimed: 0,
        ..Default::default()
    };
    let b = golden("memory-response-refused.pb", || resp.encode_to_vec());
    let read = MemoryResponse::decode(b.as_slice()).unwrap();
    assert_eq!(read, resp);
    assert!(
        !read.qos,
        "an answer from before the flags is a memory answer"
    );
    // A batch process's QOS_FLAGS (kind 4) and its answer: two latency
    // flags of page 0, their descriptors on the frame.
    let req = MemoryRequest {
        kind: memory_request::Kind::QosFlags as i32,
        bytes: 0,
    };
    let b = golden("memory-request-qos-flags.pb", || req.encode_to_vec());
    assert_eq!(MemoryRequest::decode(b.as_slice()).unwrap(), req);
    let resp = MemoryResponse {
        status: memory_response::Status::Granted as i32,
        qos: true,
        qos_flags: vec![
            vcuda_api::vcuda::QosFlag { page: 0, slot: 0 },
            vcuda_api::vcuda::QosFlag { page: 0, slot: 3 },
        ],
        ..Default::default()
    };
    let b = golden("memory-response-qos-flags.pb", || resp.encode_to_vec());
    assert_eq!(MemoryResponse::decode(b.as_slice()).unwrap(), resp);
}

/// A container ledger as a manager and two processes left it (layout 1):
/// a restarted or upgraded manager, and an interposer of a later release,
/// read its quota, use, slots and counters.
#[test]
fn a_ledger_of_layout_1_is_read() {
    let bytes = golden("ledger-v1.bin", || {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger");
        let (l, _f) = Ledger::create(&path, 4 * GIB).unwrap();
        let a = l.claim_slot(4711, None).unwrap();
        let b = l.claim_slot(4712, None).unwrap();
        l.set_local_pid(a, 1);
        l.set_local_pid(b, 2);
        l.try_reserve(a, GIB).unwrap();
        l.try_reserve(b, GIB / 2).unwrap();
        l.add_throttled_ns(1_500_000);
        l.count_refused_allocation();
        std::fs::read(&path).unwrap()
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(Ledger::peek(&path).unwrap(), (4 * GIB, GIB + GIB / 2));
    let (l, _f) = Ledger::open(&path).unwrap();
    let slots: Vec<_> = l.slots().map(|s| (s.pid, s.used, s.local_pid)).collect();
    assert_eq!(slots, vec![(4711, GIB, 1), (4712, GIB / 2, 2)]);
    assert_eq!((l.throttled_ns(), l.refused_allocations()), (1_500_000, 1));
    // Its layout version is the one this build writes: a change of layout
    // keeps this file and adds ledger-v2.bin.
    assert_eq!(bytes[8..12], container_ledger::VERSION.to_ne_bytes());
}

/// `pids.config`: host PIDs back to back, as the original gpu-manager
/// wrote them (no header, no version: its readers cannot take one).
#[test]
fn pids_config_is_read() {
    let b = golden("pids.config", || {
        quota_config::encode_pids(&[4711, 4712, 90001])
    });
    assert_eq!(
        quota_config::decode_pids(&b).unwrap(),
        vec![4711, 4712, 90001]
    );
    assert_eq!(b.len(), 12);
}

fn allocation() -> Allocation {
    Allocation {
        pod_uid: "6a0e0a3c-1f2b-4c5d-8e9f-0a1b2c3d4e5f".into(),
        namespace: "default".into(),
        pod_name: "tp-server".into(),
        container: "server".into(),
        container_index: 0,
        cores: 30,
        memory_units: 8,
        memory_limit: 8,
        placement: PlacementRecord::Share {
            gpu: 1,
            cores: 30,
            memory_units: 8,
        },
        soft_limit: None,
        tier: Default::default(),
        memory_ceiling: None,
        vcore_ids: (0..30).map(|i| format!("vcore-{i}")).collect(),
        vmemory_ids: (0..8).map(|i| format!("vmem-{i}")).collect(),
        verified: true,
        created: 1_795_000_000,
    }
}

/// gpu-manager's checkpoint slot (layout "vcuda-checkpoint v2", payload
/// version 1): an upgraded manager adopts the allocations it records.
#[test]
fn a_manager_checkpoint_of_today_is_adopted() {
    let slot = golden("gpu-manager.json.a", || {
        let dir = tempfile::tempdir().unwrap();
        Checkpoint::new(dir.path())
            .store(&["GPU-0".into(), "GPU-1".into()], [&allocation()])
            .unwrap();
        std::fs::read(dir.path().join("gpu-manager.json.a")).unwrap()
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("gpu-manager.json.a"), &slot).unwrap();
    let (gpus, allocs) = Checkpoint::new(dir.path()).load().unwrap().unwrap();
    assert_eq!(gpus, vec!["GPU-0", "GPU-1"]);
    assert_eq!(allocs, vec![allocation()]);
}

/// A checkpoint slot holding a share inside a MIG instance (placement
/// kind `in_mig`, docs/mig.md): read back the same by every later release.
#[test]
fn a_manager_checkpoint_with_a_share_inside_a_mig_instance_is_adopted() {
    let mut a = allocation();
    a.placement = gpu_manager::allocation::PlacementRecord::InMig {
        gpu: 1,
        instance: "MIG-5f1e0a3c-1f2b-5c5d-8e9f-0a1b2c3d4e5f".into(),
        cores: 30,
        memory_units: 8,
    };
    let slot = golden("gpu-manager-in-mig.json.a", || {
        let dir = tempfile::tempdir().unwrap();
        Checkpoint::new(dir.path())
            .store(&["GPU-0".into(), "GPU-1".into()], [&a])
            .unwrap();
        std::fs::read(dir.path().join("gpu-manager.json.a")).unwrap()
    });
    assert!(
        String::from_utf8_lossy(&slot)
            .contains(r#""kind":"in_mig","gpu":1,"instance":"MIG-5f1e0a3c"#),
        "{}",
        String::from_utf8_lossy(&slot)
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("gpu-manager.json.a"), &slot).unwrap();
    let (_, allocs) = Checkpoint::new(dir.path()).load().unwrap().unwrap();
    assert_eq!(allocs, vec![a]);
}

/// The node inventory annotation (version 1) the extender reads.
#[test]
fn a_node_inventory_of_version_1_is_read() {
    let gpu = |minor: u32| InventoryGpu {
        minor,
        uuid: format!("GPU-{minor}"),
        memory_bytes: 80 * GIB,
        numa_node: Some(0),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x3b + minor),
        healthy: minor == 0,
        mig: false,
    };
    let want = Inventory {
        version: 1,
        share_mode: true,
        gpus: vec![gpu(0), gpu(1)],
        pcie: vec![30],
        nvlink: vec![4],
        instances: vec![],
    };
    let b = golden("gpu-inventory-v1.json", || want.to_json().into_bytes());
    let inv = Inventory::from_json(std::str::from_utf8(&b).unwrap()).unwrap();
    assert_eq!(inv, want);
}

/// Version 1 with MIG instances that serve shares (docs/mig.md): the field
/// is additive, so the file without it (above) still reads, as none.
#[test]
fn a_node_inventory_with_shared_mig_instances_is_read() {
    let b = golden("gpu-inventory-v1-instances.json", || {
        let mut inv = Inventory::from_json(
            std::str::from_utf8(&golden("gpu-inventory-v1.json", Vec::new)).unwrap(),
        )
        .unwrap();
        inv.gpus[1].mig = true;
        inv.instances = vec![InventoryInstance {
            instance: gpu_allocator::SharedInstance {
                uuid: "MIG-5f1e0a3c-1f2b-5c5d-8e9f-0a1b2c3d4e5f".into(),
                gpu: 1,
                profile: "2g.20gb".into(),
                memory_bytes: 19968 << 20,
            },
            healthy: true,
        }];
        inv.to_json().into_bytes()
    });
    let inv = Inventory::from_json(std::str::from_utf8(&b).unwrap()).unwrap();
    let i = &inv.instances[0];
    assert_eq!(
        (i.instance.gpu, i.instance.profile.as_str(), i.healthy),
        (1, "2g.20gb", true)
    );
    let a = inv.allocator();
    let p = a
        .evaluate_for(&gpu_allocator::Request::share(50, 20), Some("2g.20gb"))
        .unwrap();
    assert_eq!(p.gpus(), &[1]);
}
