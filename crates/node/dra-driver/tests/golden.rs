//! The DRA driver's checkpoint of today (version 1), kept as a golden file
//! in the repository's `tests/golden/` (see `tests/contracts.rs` for the
//! rules): an upgraded driver adopts the claims it records.

use dra_driver::checkpoint::{Checkpoint, PreparedClaim, Store, VERSION};
use dra_driver::plan::PlannedDevice;
use std::collections::BTreeMap;

fn today() -> Checkpoint {
    let device = |i: usize| PlannedDevice {
        request: "gpu".into(),
        pool: "node-a".into(),
        device: format!("gpu-{i}-share"),
        gpu_index: i,
        gpu_uuid: format!("GPU-{i}"),
        cores: 30,
        memory_bytes: 8 << 30,
        soft_limit: Some(60),
        tier: Default::default(),
        memory_limit: None,
        whole: false,
        share_id: Some(format!("claim-uid-1-{i}")),
        mig: None,
    };
    let claim = PreparedClaim {
        namespace: "default".into(),
        name: "tp-server-gpus".into(),
        uid: "claim-uid-1".into(),
        devices: vec![device(0), device(1)],
        prepared_at: 1_795_000_000,
    };
    Checkpoint {
        version: VERSION,
        node: "node-a".into(),
        claims: BTreeMap::from([(claim.uid.clone(), claim)]),
    }
}

#[test]
fn a_dra_checkpoint_of_version_1_is_adopted() {
    let golden = test_support::workspace_root().join("tests/golden/dra-checkpoint-v1.json");
    if !golden.exists() && std::env::var("VCUDA_BLESS").as_deref() == Ok("1") {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::new(dir.path());
        s.save(&today()).unwrap();
        std::fs::copy(s.path(), &golden).unwrap();
    }
    let bytes = std::fs::read(&golden).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (golden files are never regenerated; restore it from git)",
            golden.display()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let s = Store::new(dir.path());
    std::fs::write(s.path(), bytes).unwrap();
    assert_eq!(s.load("node-a").unwrap(), today());
}

/// Today's slot file (`checkpoint.json.a`, the manager's engine): the next
/// release reads only these, and must adopt what this one wrote.
#[test]
fn a_dra_checkpoint_slot_of_version_1_is_adopted() {
    let golden = test_support::workspace_root().join("tests/golden/dra-checkpoint.json.a");
    if !golden.exists() && std::env::var("VCUDA_BLESS").as_deref() == Ok("1") {
        let dir = tempfile::tempdir().unwrap();
        Store::new(dir.path()).save(&today()).unwrap();
        std::fs::copy(dir.path().join("checkpoint.json.a"), &golden).unwrap();
    }
    let bytes = std::fs::read(&golden).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (golden files are never regenerated; restore it from git)",
            golden.display()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("checkpoint.json.a"), bytes).unwrap();
    assert_eq!(Store::new(dir.path()).load("node-a").unwrap(), today());
}

/// The single file this release still writes beside the slots is the one
/// of the releases before it plus the slot's generation, a field their
/// parse ignores: rolled back to, they read the record.
#[test]
fn the_single_file_is_the_earlier_releases_plus_the_slot_generation() {
    let golden = test_support::workspace_root().join("tests/golden/dra-checkpoint-v1.json");
    let earlier: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = Store::new(dir.path());
    s.save(&today()).unwrap();
    let mut written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.path()).unwrap()).unwrap();
    let generation = written
        .as_object_mut()
        .unwrap()
        .remove(checkpoint_slots::MIRROR_GENERATION);
    assert_eq!(generation, Some(1.into()));
    assert_eq!(written, earlier);
}
