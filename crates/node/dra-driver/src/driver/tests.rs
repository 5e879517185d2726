use super::*;
use std::collections::HashMap;

/// What a test does (once) when a claim is next read: after the
/// driver loaded its checkpoint, before it saves it.
type OnRead = std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>;

/// Claims in memory; a missing one answers like a 404.
#[derive(Default)]
struct MapClaims(
    std::sync::Mutex<HashMap<(String, String), ResourceClaim>>,
    OnRead,
);

#[async_trait::async_trait]
impl ClaimSource for MapClaims {
    async fn claim(&self, ns: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        if let Some(f) = self.1.lock().unwrap().take() {
            f();
        }
        self.0
            .lock()
            .unwrap()
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| ApiError::ReadClaim {
                namespace: ns.to_string(),
                name: name.to_string(),
                source: crate::kube_api::not_found("resourceclaims", name),
            })
    }
}

fn gpu() -> GpuInfo {
    crate::fixtures::gpu(0, 0)
}

fn claim(name: &str, uid: &str) -> ResourceClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": crate::DRIVER_NAME, "pool": "n1", "device": "gpu-0",
            "consumedCapacity": {"cores": "30", "memory": "1Gi"}}]}}}
    }))
    .unwrap()
}

fn config(tmp: &std::path::Path) -> Config {
    Config {
        node: "n1".into(),
        vm_root: tmp.join("vm"),
        vdriver_dir: tmp.join("vdriver"),
        cdi_dir: tmp.join("cdi"),
        state_dir: tmp.join("state"),
        driver_version: (550, 54),
        extra_devices: vec![],
    }
}

fn driver(tmp: &std::path::Path, claims: Arc<MapClaims>) -> Driver {
    let cfg = config(tmp);
    Driver::start(cfg, vec![gpu()], claims).unwrap()
}

fn r(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

#[tokio::test]
async fn unreadable_unhealthy_and_unwritable() {
    let tmp = tempfile::tempdir().unwrap();
    let claims = Arc::new(MapClaims::default());
    let d = driver(tmp.path(), claims.clone());
    let e = d.prepare(&r("gone", "u0")).await.unwrap_err();
    let missing = crate::kube_api::not_found("resourceclaims", "gone");
    assert_eq!(
        e.to_string(),
        format!("claim ns/gone: reading it from the API server: {missing}")
    );

    claims
        .0
        .lock()
        .unwrap()
        .insert(("ns".into(), "a".into()), claim("a", "u1"));
    d.set_healthy(0, false, "Xid 79");
    let e = d.prepare(&r("a", "u1")).await.unwrap_err().to_string();
    assert_eq!(
        e,
        "claim ns/a: gpu-0 (GPU-0) had a critical Xid and is out of the ResourceSlice until it is healthy again"
    );
    d.set_healthy(0, true, "");

    // A checkpoint that cannot be written fails the claim and leaves
    // nothing (a directory appears where it goes, after the driver read
    // it and before it saves: the rename over it fails).
    let blocker = tmp.path().join("state/checkpoint.json");
    let b = blocker.clone();
    *claims.1.lock().unwrap() = Some(Box::new(move || {
        let _ = std::fs::remove_file(&b);
        std::fs::create_dir(&b).unwrap();
    }));
    let e = d.prepare(&r("a", "u1")).await.unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("claim ns/a: checkpoint {}: ", blocker.display())),
        "{e}"
    );
    assert!(!tmp.path().join("vm/u1").exists());
    assert!(!cdi::spec_path(&tmp.path().join("cdi"), "u1").exists());
    assert!(d.prepared().is_empty());
    let temps = std::fs::read_dir(tmp.path().join("state"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp."))
        .collect::<Vec<_>>();
    assert!(temps.is_empty(), "{temps:?}");
    std::fs::remove_dir(&blocker).unwrap();
    assert_eq!(d.prepare(&r("a", "u1")).await.unwrap().len(), 1);
    assert_eq!(d.prepared().len(), 1);
    // An unknown claim is already unprepared.
    d.unprepare(&r("other", "u9")).await.unwrap();
    d.unprepare(&r("a", "u1")).await.unwrap();
    assert!(d.prepared().is_empty() && !tmp.path().join("vm/u1").exists());
}

/// GPU 0 in MIG mode with one 3g.40gb instance (gi 2, ci 0), whose
/// capability files are under `host`.
fn mig_driver(tmp: &std::path::Path, claims: Arc<MapClaims>) -> Driver {
    let gi = tmp.join("host/proc/driver/nvidia/capabilities/gpu0/mig/gi2");
    std::fs::create_dir_all(gi.join("ci0")).unwrap();
    std::fs::write(gi.join("access"), "DeviceFileMinor: 21\n").unwrap();
    std::fs::write(gi.join("ci0/access"), "DeviceFileMinor: 22\n").unwrap();
    let cfg = config(tmp);
    let inventory = Inventory {
        gpus: vec![gpu()],
        mig: vec![Some(vec![crate::fixtures::mig_3g()])],
        host_root: tmp.join("host"),
        ..Default::default()
    };
    Driver::start(cfg, inventory, claims).unwrap()
}

fn mig_claim(name: &str, uid: &str) -> ResourceClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [{
            "request": "mig", "driver": crate::DRIVER_NAME, "pool": "n1",
            "device": "gpu-0-mig-2-0"}]}}}
    }))
    .unwrap()
}

#[tokio::test]
async fn a_mig_device_is_one_claims_spec_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let claims = Arc::new(MapClaims::default());
    for (name, uid) in [("a", "u1"), ("b", "u2")] {
        claims
            .0
            .lock()
            .unwrap()
            .insert(("ns".into(), name.into()), mig_claim(name, uid));
    }
    let d = mig_driver(tmp.path(), claims);
    let p = d.prepare(&r("a", "u1")).await.unwrap();
    assert_eq!(p[0].cdi_id, "vcuda.tencent.com/gpu=u1-mig-gpu-0-mig-2-0");
    let spec: cdi::Spec = serde_json::from_slice(
        &std::fs::read(cdi::spec_path(&tmp.path().join("cdi"), "u1")).unwrap(),
    )
    .unwrap();
    let nodes: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia0",
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia-caps/nvidia-cap22"
        ]
    );
    assert!(!tmp.path().join("vm/u1").exists(), "no vm directory");

    // The same instance for a second claim at once: refused.
    let e = d.prepare(&r("b", "u2")).await.unwrap_err().to_string();
    assert_eq!(
        e,
        "claim ns/b: gpu-0-mig-2-0 is already prepared for claim ns/a: a MIG device is one claim's"
    );
    assert!(!cdi::spec_path(&tmp.path().join("cdi"), "u2").exists());
    d.unprepare(&r("a", "u1")).await.unwrap();
    assert!(!cdi::spec_path(&tmp.path().join("cdi"), "u1").exists());

    // Its instance destroyed behind the driver's back: no spec, no claim.
    std::fs::remove_dir_all(tmp.path().join("host/proc")).unwrap();
    let e = d.prepare(&r("b", "u2")).await.unwrap_err().to_string();
    assert!(
        e.starts_with("claim ns/b: gpu-0-mig-2-0: reading ") && e.contains("gi2/access"),
        "{e}"
    );
    assert!(d.prepared().is_empty());
    assert!(!cdi::spec_path(&tmp.path().join("cdi"), "u2").exists());
}

#[tokio::test]
async fn a_destroyed_instance_under_a_prepared_claim_is_unhealthy_until_unprepared() {
    let tmp = tempfile::tempdir().unwrap();
    let claims = Arc::new(MapClaims::default());
    claims
        .0
        .lock()
        .unwrap()
        .insert(("ns".into(), "a".into()), mig_claim("a", "u1"));
    let d = mig_driver(tmp.path(), claims.clone());
    let key = ("n1".to_string(), "gpu-0-mig-2-0".to_string());
    let health = d.health_watch();
    assert!(health.borrow().mig.is_empty(), "nothing prepared yet");
    d.prepare(&r("a", "u1")).await.unwrap();
    assert!(health.borrow().mig[&key].healthy, "{:?}", health.borrow());
    assert!(d.lost_mig_devices().is_empty());

    // An Xid inside its GPU instance, then its quiet period.
    d.set_instance_xid(0, 2, Some(43));
    let h = health.borrow().mig[&key].clone();
    assert!(!h.healthy && h.message.contains("Xid 43"), "{h:?}");
    d.set_instance_xid(0, 2, None);
    assert!(health.borrow().mig[&key].healthy);

    // The rescan finds the instance gone.
    d.set_mig(0, Some(vec![]));
    let lost = d.lost_mig_devices();
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(
        (lost[0].namespace.as_str(), lost[0].name.as_str()),
        ("ns", "a")
    );
    let h = health.borrow().mig[&key].clone();
    assert!(
        !h.healthy && h.message.contains("MIG-3g") && h.message.contains("destroyed"),
        "{h:?}"
    );
    // The GPUs themselves stay healthy.
    assert!(health.borrow().gpus.iter().all(|g| g.healthy));

    // A restarted driver finds it lost from its checkpoint.
    let again = {
        let cfg = config(tmp.path());
        let inventory = Inventory {
            gpus: vec![gpu()],
            mig: vec![Some(vec![])],
            host_root: tmp.path().join("host"),
            ..Default::default()
        };
        Driver::start(cfg, inventory, claims).unwrap()
    };
    assert_eq!(again.lost_mig_devices(), lost);
    assert!(!again.health_watch().borrow().mig[&key].healthy);

    // Unprepared: nothing more to report.
    d.unprepare(&r("a", "u1")).await.unwrap();
    assert!(health.borrow().mig.is_empty(), "{:?}", health.borrow());
    assert!(d.lost_mig_devices().is_empty());
}
