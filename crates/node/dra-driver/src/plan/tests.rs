use super::*;
use serde_json::json;

fn gpus() -> Inventory {
    Inventory::from(vec![crate::fixtures::gpu(0, 0)])
}

fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c1", "namespace": "ns", "uid": "u1"},
        "spec": {},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap()
}

fn result(cap: serde_json::Value) -> serde_json::Value {
    json!([{"request": "gpu", "driver": DRIVER_NAME, "pool": "n1", "device": "gpu-0",
            "shareID": "s1", "consumedCapacity": cap}])
}

#[test]
fn share_whole_and_soft() {
    let c = claim(result(json!({"cores": "30", "memory": "1Gi"})), json!([]));
    let p = plan(&c, "u1", "n1", &gpus()).unwrap();
    assert_eq!(
        (p[0].cores, p[0].memory_bytes, p[0].whole),
        (30, 1 << 30, false)
    );
    assert_eq!(p[0].share_id.as_deref(), Some("s1"));

    let whole = claim(result(json!(null)), json!([]));
    assert!(plan(&whole, "u1", "n1", &gpus()).unwrap()[0].whole);

    let cfg = json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER_NAME,
        "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 60}}}]);
    let soft = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
    assert_eq!(
        plan(&soft, "u1", "n1", &gpus()).unwrap()[0].soft_limit,
        Some(60)
    );
}

#[test]
fn a_share_is_alone_and_devices_are_distinct() {
    let mut g = gpus();
    g.gpus.push(GpuInfo {
        index: 1,
        uuid: "GPU-1".into(),
        ..g.gpus[0].clone()
    });
    let r = |req: &str, dev: &str, cap: serde_json::Value| {
        json!({"request": req, "driver": DRIVER_NAME, "pool": "n1", "device": dev,
               "consumedCapacity": cap})
    };
    let two_whole = claim(
        json!([
            r("gpu", "gpu-0", json!(null)),
            r("gpu", "gpu-1", json!(null))
        ]),
        json!([]),
    );
    let p = plan(&two_whole, "u1", "n1", &g).unwrap();
    assert_eq!(p.len(), 2);
    assert!(p.iter().all(|d| d.whole));

    let mixed = claim(
        json!([
            r("a", "gpu-0", json!({"cores": "30", "memory": "1Gi"})),
            r("b", "gpu-1", json!(null))
        ]),
        json!([]),
    );
    let e = plan(&mixed, "u1", "n1", &g).unwrap_err().to_string();
    assert!(e.contains("request \"a\" is a share of gpu-0"), "{e}");
    assert!(e.contains("a share must be the claim's only device"), "{e}");

    // Shares of two GPUs: one container's quotas on each.
    let two_shares = claim(
        json!([
            r("gpus", "gpu-0", json!({"cores": "40", "memory": "2Gi"})),
            r("gpus", "gpu-1", json!({"cores": "40", "memory": "2Gi"}))
        ]),
        json!([]),
    );
    let p = plan(&two_shares, "u1", "n1", &g).unwrap();
    let got: Vec<_> = p
        .iter()
        .map(|d| (d.gpu_index, d.cores, d.memory_bytes, d.whole))
        .collect();
    assert_eq!(got, [(0, 40, 2 << 30, false), (1, 40, 2 << 30, false)]);

    let twice = claim(
        json!([
            r("a", "gpu-0", json!({"cores": "30", "memory": "1Gi"})),
            r("b", "gpu-0", json!({"cores": "20", "memory": "1Gi"}))
        ]),
        json!([]),
    );
    let e = plan(&twice, "u1", "n1", &g).unwrap_err().to_string();
    assert!(e.contains("gpu-0 is allocated twice"), "{e}");
}

#[test]
fn errors_name_the_problem() {
    let c = claim(result(json!({"cores": "30", "memory": "1Gi"})), json!([]));
    let e = plan(&c, "other", "n1", &gpus()).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("claim ns/c1: the API server has UID"),
        "{e}"
    );
    let e = plan(&c, "u1", "n2", &gpus()).unwrap_err();
    assert!(e.to_string().contains("not this node's \"n2\""), "{e}");
    let bad = claim(result(json!({"cores": "30", "memory": "100Mi"})), json!([]));
    assert!(
        plan(&bad, "u1", "n1", &gpus())
            .unwrap_err()
            .to_string()
            .contains("multiple of 256 MiB")
    );
    let cfg = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER_NAME,
        "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 20}}}]);
    let low = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
    assert!(
        plan(&low, "u1", "n1", &gpus())
            .unwrap_err()
            .to_string()
            .contains("below the 30 cores")
    );
    let cfg = json!([{"source": "FromClass", "opaque": {"driver": DRIVER_NAME,
        "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "exclusive": true}}}]);
    let part = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
    assert!(
        plan(&part, "u1", "n1", &gpus())
            .unwrap_err()
            .to_string()
            .contains("exclusive")
    );
    let none: ResourceClaim = serde_json::from_value(
        json!({"metadata": {"name": "c1", "namespace": "ns", "uid": "u1"}, "spec": {}}),
    )
    .unwrap();
    assert!(
        plan(&none, "u1", "n1", &gpus())
            .unwrap_err()
            .to_string()
            .contains("not allocated")
    );
}

/// GPU 0 whole; GPU 1 in MIG mode with a 3g.40gb instance (gi 2).
fn with_mig() -> Inventory {
    let mut inv = gpus();
    inv.gpus.push(GpuInfo {
        index: 1,
        uuid: "GPU-1".into(),
        minor: 1,
        ..inv.gpus[0].clone()
    });
    inv.mig = vec![None, Some(vec![crate::fixtures::mig_3g()])];
    inv
}

fn on(dev: &str, cap: serde_json::Value) -> serde_json::Value {
    json!({"request": "mig", "driver": DRIVER_NAME, "pool": "n1", "device": dev,
           "consumedCapacity": cap})
}

#[test]
fn a_mig_device_is_planned_whole_with_its_instance() {
    let inv = with_mig();
    let c = claim(json!([on("gpu-1-mig-2-0", json!(null))]), json!([]));
    let p = plan(&c, "u1", "n1", &inv).unwrap();
    assert_eq!(p.len(), 1);
    let d = &p[0];
    assert_eq!(
        (d.gpu_index, d.gpu_uuid.as_str(), d.whole, d.soft_limit),
        (1, "GPU-1", true, None)
    );
    assert_eq!(d.memory_bytes, 40448 << 20);
    assert_eq!(
        d.mig,
        Some(PlannedMig {
            uuid: "MIG-3g".into(),
            gpu_instance: 2,
            compute_instance: 0,
            placement: None,
        })
    );
    // All of its memory, said, is the same.
    let all = claim(
        json!([on("gpu-1-mig-2-0", json!({"memory": "40448Mi"}))]),
        json!([]),
    );
    assert_eq!(plan(&all, "u1", "n1", &inv).unwrap(), p);
    // A checkpoint written before MIG devices still loads.
    let mut old = serde_json::to_value(&p[0]).unwrap();
    assert!(old.get("mig").is_some());
    old.as_object_mut().unwrap().remove("mig");
    let back: PlannedDevice = serde_json::from_value(old).unwrap();
    assert_eq!(back.mig, None);
    let plain = plan(&claim(result(json!(null)), json!([])), "u1", "n1", &inv).unwrap();
    let json = serde_json::to_value(&plain[0]).unwrap();
    assert!(json.get("mig").is_none(), "{json}");
}

#[test]
fn a_share_of_a_static_mig_device_is_planned_in_its_instance() {
    let inv = with_mig();
    let planned = |results: serde_json::Value, config: serde_json::Value| {
        plan(&claim(results, config), "u1", "n1", &inv)
    };
    let share = planned(
        json!([on("gpu-1-mig-2-0", json!({"cores": "50", "memory": "5Gi"}))]),
        json!([]),
    )
    .unwrap();
    let d = &share[0];
    assert_eq!(
        (d.whole, d.cores, d.memory_bytes, d.soft_limit),
        (false, 50, 5 << 30, None)
    );
    assert_eq!(d.mig.as_ref().unwrap().uuid, "MIG-3g");
    let cfg = |p: serde_json::Value| {
        let mut params = json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig"});
        params
            .as_object_mut()
            .unwrap()
            .extend(p.as_object().unwrap().clone());
        json!([{"source": "FromClaim", "requests": ["mig"],
                "opaque": {"driver": DRIVER_NAME, "parameters": params}}])
    };
    let soft = planned(
        json!([on("gpu-1-mig-2-0", json!({"cores": "30", "memory": "1Gi"}))]),
        cfg(json!({"coreLimit": 60})),
    )
    .unwrap();
    assert_eq!(soft[0].soft_limit, Some(60));
    // The whole instance has no soft limit, and exclusive means whole.
    let e = planned(
        json!([on("gpu-1-mig-2-0", json!(null))]),
        cfg(json!({"coreLimit": 60})),
    );
    assert!(matches!(
        e.unwrap_err().problem,
        Refusal::NotForMig {
            what: NotForMig::CoreLimit(60),
            ..
        }
    ));
    let e = planned(
        json!([on("gpu-1-mig-2-0", json!({"cores": "30", "memory": "1Gi"}))]),
        cfg(json!({"exclusive": true})),
    );
    assert!(matches!(
        e.unwrap_err().problem,
        Refusal::NotWhole { cores: 30, .. }
    ));
    // More than the instance has is refused, naming it.
    let e = planned(
        json!([on(
            "gpu-1-mig-2-0",
            json!({"cores": "30", "memory": "41Gi"})
        )]),
        json!([]),
    );
    assert!(
        matches!(e.unwrap_err().problem, Refusal::Memory { full_memory, .. } if full_memory == 40448 << 20)
    );
}

#[test]
fn a_dynamic_mig_device_is_taken_whole() {
    let inv = with_mig();
    let m = inv.mig[1].as_ref().unwrap()[0].clone();
    let parent = inv.gpus[1].clone();
    let r = |cap: serde_json::Value| -> DeviceRequestAllocationResult {
        serde_json::from_value(on("gpu-1-mig-2-0", cap)).unwrap()
    };
    let not_for = |what| Refusal::NotForMig {
        request: "mig".into(),
        device: "gpu-1-mig-2-0".into(),
        what,
    };
    let refused = |cap, configs: &[DeviceAllocationConfiguration]| {
        plan_mig(&r(cap), configs, &parent, &m).unwrap_err()
    };
    assert_eq!(
        refused(json!({"cores": "30", "memory": "1Gi"}), &[]),
        not_for(NotForMig::Cores("30".into()))
    );
    assert_eq!(
        refused(json!({"memory": "1Gi"}), &[]),
        not_for(NotForMig::Memory {
            asked: "1Gi".into(),
            instance: 40448 << 20
        })
    );
    let cfg: Vec<DeviceAllocationConfiguration> = serde_json::from_value(json!([{"source": "FromClaim", "requests": ["mig"], "opaque": {"driver": DRIVER_NAME,
        "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 60}}}])).unwrap();
    let e = refused(json!(null), &cfg);
    assert_eq!(e, not_for(NotForMig::CoreLimit(60)));
    assert_eq!(
        e.to_string(),
        "request \"mig\": gpu-1-mig-2-0 is a MIG device made for one claim, taken whole with the untouched driver: coreLimit 60 does not apply to it"
    );
}

#[test]
fn a_mig_device_is_alone_in_its_claim() {
    let inv = with_mig();
    let refused = |results: serde_json::Value, config: serde_json::Value| {
        plan(&claim(results, config), "u1", "n1", &inv)
            .unwrap_err()
            .problem
    };
    // Alone in its claim, once.
    let beside = json!([on("gpu-1-mig-2-0", json!(null)),
        {"request": "gpu", "driver": DRIVER_NAME, "pool": "n1", "device": "gpu-0"}]);
    assert_eq!(
        refused(beside, json!([])),
        Refusal::MigNotAlone {
            request: "mig".into(),
            device: "gpu-1-mig-2-0".into(),
            other: "gpu-0".into()
        }
    );
    let twice = json!([
        on("gpu-1-mig-2-0", json!(null)),
        on("gpu-1-mig-2-0", json!(null))
    ]);
    assert!(matches!(
        refused(twice, json!([])),
        Refusal::AllocatedTwice { device, .. } if device == "gpu-1-mig-2-0"
    ));
    // Unknown MIG devices, and the GPU in MIG mode itself, are no devices.
    for dev in ["gpu-1-mig-9-0", "gpu-1-mig-2-1", "gpu-1", "gpu-0-mig-2-0"] {
        assert_eq!(
            refused(json!([on(dev, json!(null))]), json!([])),
            Refusal::NoDevice {
                request: "mig".into(),
                device: dev.into()
            }
        );
    }
}
