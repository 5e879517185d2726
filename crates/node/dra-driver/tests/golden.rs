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
