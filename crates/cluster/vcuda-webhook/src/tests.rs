use std::sync::Arc;

use gpu_allocator::inventory::{Inventory, InventoryGpu, VERSION};
use serde_json::{Value, json};

use crate::http::Webhook;
use crate::mutate::Settings;
use crate::review::{Request, UserInfo, Verdict};
use crate::validate::{NodeGpus, Trusted};
use crate::world::doubles::{MemoryNodes, MemoryTemplates};

const GIB: u64 = 1 << 30;

fn node(name: &str, gpus: usize, gib: u64) -> NodeGpus {
    NodeGpus {
        name: name.into(),
        inventory: Inventory {
            version: VERSION,
            share_mode: true,
            gpus: (0..gpus)
                .map(|i| InventoryGpu {
                    minor: i as u32,
                    uuid: format!("GPU-{name}-{i}"),
                    memory_bytes: gib * GIB,
                    numa_node: None,
                    pci_bus_id: format!("00000000:{:02X}:00.0", i + 1),
                    healthy: true,
                    mig: false,
                })
                .collect(),
            pcie: vec![20; gpus * gpus.saturating_sub(1) / 2],
            nvlink: vec![0; gpus * gpus.saturating_sub(1) / 2],
            instances: vec![],
        },
    }
}

struct Rig {
    hook: Webhook,
    nodes: Arc<MemoryNodes>,
    templates: Arc<MemoryTemplates>,
}

fn rig(settings: Settings) -> Rig {
    let nodes = Arc::new(MemoryNodes::default());
    let templates = Arc::new(MemoryTemplates::default());
    Rig {
        hook: Webhook {
            nodes: nodes.clone(),
            templates: templates.clone(),
            settings,
            trusted: Trusted(vec![
                "system:serviceaccount:kube-system:vcuda-scheduler".into(),
                "system:node:*".into(),
            ]),
        },
        nodes,
        templates,
    }
}

/// A pod whose container `main` has these limits (and equal requests).
fn pod(limits: Value, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team", "annotations": annotations},
        "spec": {"containers": [
            {"name": "side", "image": "busybox"},
            {"name": "main", "image": "cuda", "resources": {"limits": limits.clone(), "requests": limits}}
        ]}
    })
}

fn req(op: &str, object: Value, old: Option<Value>, user: &str) -> Request {
    Request {
        uid: "u1".into(),
        namespace: "team".into(),
        operation: op.into(),
        object: Some(object),
        old_object: old,
        dry_run: false,
        user_info: UserInfo {
            username: user.into(),
            groups: vec![],
        },
    }
}

fn denied(v: Verdict) -> String {
    match v {
        Verdict::Deny(m) => m,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn vcuda(core: u64, mem: u64) -> Value {
    let mut m = serde_json::Map::new();
    if core > 0 {
        m.insert("tencent.com/vcuda-core".into(), json!(core.to_string()));
    }
    if mem > 0 {
        m.insert("tencent.com/vcuda-memory".into(), json!(mem.to_string()));
    }
    Value::Object(m)
}

#[test]
fn requests_no_node_could_place_are_refused_with_allocate_s_words() {
    let r = rig(Settings::default());
    let create = |core, mem| {
        r.hook.validate(&req(
            "CREATE",
            pod(vcuda(core, mem), json!({})),
            None,
            "alice",
        ))
    };
    // No vcuda node known yet: the shape alone.
    let m = denied(create(150, 4));
    assert!(m.contains("pod team/p container main:"), "{m}");
    assert!(m.contains("vcuda-core 150 is not a valid request"), "{m}");
    let m = denied(create(30, 0));
    assert!(
        m.contains("asks for a share of one GPU but vcuda-memory is 0"),
        "{m}"
    );
    let m = denied(create(0, 8));
    assert!(m.contains("vcuda-memory 8 without vcuda-core"), "{m}");
    assert_eq!(create(30, 8), Verdict::Allow);
    assert_eq!(create(200, 0), Verdict::Allow);
    // Nodes known: memory beyond the largest GPU of the cluster, whole
    // GPUs beyond the largest node.
    *r.nodes.0.lock().unwrap() = vec![node("small", 4, 16), node("big", 2, 80)];
    assert_eq!(create(30, 300), Verdict::Allow, "80 GiB holds 300 units");
    let m = denied(create(30, 400));
    assert!(
        m.contains("no vcuda node can place it (on big, the roomiest"),
        "{m}"
    );
    assert!(
        m.contains("vcuda-memory 400 (102400 MiB) is more than the largest GPU"),
        "{m}"
    );
    assert_eq!(create(400, 0), Verdict::Allow, "small has 4 GPUs");
    let m = denied(create(500, 0));
    assert!(
        m.contains("asks for 5 whole GPUs but this node has only"),
        "{m}"
    );
}

#[test]
fn a_bad_multi_gpu_split_is_refused_naming_the_annotation() {
    let r = rig(Settings::default());
    let p = pod(
        vcuda(31, 8),
        json!({"tencent.com/vcuda-gpus": r#"{"main": 2}"#}),
    );
    let m = denied(r.hook.validate(&req("CREATE", p, None, "alice")));
    assert!(
        m.contains("vcuda-core 31, vcuda-memory 8 over 2 GPU(s)"),
        "{m}"
    );
    assert!(m.contains("does not split evenly"), "{m}");
    let p = pod(vcuda(30, 8), json!({"tencent.com/vcuda-gpus": "{not json"}));
    let m = denied(r.hook.validate(&req("CREATE", p, None, "alice")));
    assert!(m.contains("tencent.com/vcuda-gpus"), "{m}");
}

#[test]
fn a_tier_that_is_none_is_refused_naming_the_annotation() {
    let r = rig(Settings::default());
    let p = pod(vcuda(30, 8), json!({"tencent.com/vcuda-tier": "gold"}));
    let m = denied(r.hook.validate(&req("CREATE", p, None, "alice")));
    assert!(
        m.contains("pod team/p: annotation tencent.com/vcuda-tier"),
        "{m}"
    );
    assert!(
        m.contains("\"gold\": expected latency, batch or plain"),
        "{m}"
    );
    for t in ["latency", "batch", "plain"] {
        let p = pod(vcuda(30, 8), json!({"tencent.com/vcuda-tier": t}));
        assert_eq!(
            r.hook.validate(&req("CREATE", p, None, "alice")),
            Verdict::Allow
        );
    }
}

#[test]
fn a_mig_profile_that_is_none_is_refused_naming_the_annotation() {
    let r = rig(Settings::default());
    let p = pod(
        vcuda(30, 8),
        json!({"tencent.com/vcuda-mig-profile": "half"}),
    );
    let m = denied(r.hook.validate(&req("CREATE", p, None, "alice")));
    assert!(
        m.contains("annotation tencent.com/vcuda-mig-profile=\"half\" is not a MIG profile name"),
        "{m}"
    );
    let p = pod(
        vcuda(30, 8),
        json!({"tencent.com/vcuda-mig-profile": "2g.20gb"}),
    );
    assert_eq!(
        r.hook.validate(&req("CREATE", p, None, "alice")),
        Verdict::Allow
    );
}

#[test]
fn a_memory_limit_is_checked_as_the_manager_checks_it() {
    let r = rig(Settings::default());
    let limit = |v: &str| pod(vcuda(30, 8), json!({"tencent.com/vcuda-memory-limit": v}));
    for (v, why) in [
        ("lots", "is not a quantity of bytes"),
        (
            "1Gi",
            "is below the container's vcuda-memory, 2147483648 bytes",
        ),
    ] {
        let m = denied(r.hook.validate(&req("CREATE", limit(v), None, "alice")));
        assert!(
            m.contains("pod team/p container main: annotation tencent.com/vcuda-memory-limit"),
            "{m}"
        );
        assert!(m.contains(why), "{m}");
    }
    let whole = pod(
        vcuda(100, 0),
        json!({"tencent.com/vcuda-memory-limit": "12Gi"}),
    );
    let m = denied(r.hook.validate(&req("CREATE", whole, None, "alice")));
    assert!(m.contains("applies to shares, not to whole GPUs"), "{m}");
    assert_eq!(
        r.hook
            .validate(&req("CREATE", limit("12Gi"), None, "alice")),
        Verdict::Allow
    );
}

#[test]
fn placement_annotations_are_vcuda_s_alone() {
    let r = rig(Settings::default());
    let forged =
        json!({"tencent.com/predicate-gpu-idx-1": "0", "tencent.com/predicate-node": "n1"});
    let m = denied(r.hook.validate(&req(
        "CREATE",
        pod(vcuda(30, 8), forged.clone()),
        None,
        "alice",
    )));
    assert!(m.contains("only vcuda writes it"), "{m}");
    assert!(
        m.contains("alice is not one of the webhook's --trusted-user"),
        "{m}"
    );
    // The instance a share inside MIG was placed in, too.
    let instance = json!({"tencent.com/predicate-mig-0": "MIG-x"});
    let m = denied(
        r.hook
            .validate(&req("CREATE", pod(vcuda(30, 8), instance), None, "alice")),
    );
    assert!(
        m.contains("tencent.com/predicate-mig-0") && m.contains("only vcuda writes it"),
        "{m}"
    );
    // The extender's bind and a node's manager may.
    let sched = "system:serviceaccount:kube-system:vcuda-scheduler";
    let before = pod(vcuda(30, 8), json!({}));
    let after = pod(vcuda(30, 8), forged.clone());
    assert_eq!(
        r.hook
            .validate(&req("UPDATE", after.clone(), Some(before.clone()), sched)),
        Verdict::Allow
    );
    assert_eq!(
        r.hook.validate(&req(
            "UPDATE",
            after.clone(),
            Some(before.clone()),
            "system:node:gpu-1"
        )),
        Verdict::Allow
    );
    denied(
        r.hook
            .validate(&req("UPDATE", after.clone(), Some(before), "alice")),
    );
    // Unchanged ones, or removed ones, are anyone's.
    assert_eq!(
        r.hook
            .validate(&req("UPDATE", after.clone(), Some(after.clone()), "alice")),
        Verdict::Allow
    );
    assert_eq!(
        r.hook.validate(&req(
            "UPDATE",
            pod(vcuda(30, 8), json!({})),
            Some(after),
            "alice"
        )),
        Verdict::Allow
    );
}

/// Applies `add` (with `-`) and `remove` operations the way the API
/// server's JSON Patch does, for these tests.
fn apply(mut doc: Value, ops: &[Value]) -> Value {
    for op in ops {
        let path = op["path"].as_str().unwrap();
        let (parent, last) = path.rsplit_once('/').unwrap();
        let key = last.replace("~1", "/").replace("~0", "~");
        let target = doc
            .pointer_mut(parent)
            .unwrap_or_else(|| panic!("no {parent} for {op}"));
        match (op["op"].as_str().unwrap(), target) {
            ("add", Value::Array(a)) if key == "-" => a.push(op["value"].clone()),
            ("add", Value::Object(o)) => {
                o.insert(key, op["value"].clone());
            }
            ("remove", Value::Object(o)) => {
                o.remove(&key)
                    .unwrap_or_else(|| panic!("remove of a missing {path}"));
            }
            (o, t) => panic!("unsupported {o} on {t}"),
        }
    }
    doc
}

/// `p` created on a DRA cluster: the rig and the pod as the webhook's
/// patch leaves it.
async fn on_dra(p: Value) -> (Rig, Value) {
    let r = rig(Settings {
        dra: true,
        ..Settings::default()
    });
    let Verdict::Patch(ops) = r
        .hook
        .mutate(&req("CREATE", p.clone(), None, "alice"))
        .await
    else {
        panic!("no patch")
    };
    (r, apply(p, &ops))
}

/// A tiered pod's claim carries its tier in the driver's config (the
/// device-plugin mode's annotation, docs/qos.md), in a template of its own.
#[tokio::test]
async fn on_dra_clusters_the_tier_goes_into_the_claims_config() {
    let (r, out) = on_dra(pod(
        vcuda(30, 8),
        json!({"tencent.com/vcuda-tier": "latency"}),
    ))
    .await;
    assert_eq!(
        out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        "vcuda-30c-2048mi-latency"
    );
    let t = serde_json::to_value(&r.templates.created.lock().unwrap()[0]).unwrap();
    let config = &t["spec"]["spec"]["devices"]["config"][0];
    assert_eq!(config["requests"], json!(["gpu"]));
    assert_eq!(
        config["opaque"],
        json!({"driver": "vcuda.tencent.com", "parameters": {
            "apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "tier": "latency"}})
    );
}

/// A memory limit goes into the claim's config as bytes, beside a tier.
#[tokio::test]
async fn on_dra_clusters_the_memory_limit_goes_into_the_claims_config() {
    let (r, out) = on_dra(pod(
        vcuda(30, 8),
        json!({"tencent.com/vcuda-memory-limit": "12Gi", "tencent.com/vcuda-tier": "batch"}),
    ))
    .await;
    assert_eq!(
        out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        "vcuda-30c-2048mi-batch-to12288mi"
    );
    let t = serde_json::to_value(&r.templates.created.lock().unwrap()[0]).unwrap();
    assert_eq!(
        t["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"],
        json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig",
               "tier": "batch", "memoryLimit": "12884901888"})
    );
}

#[tokio::test]
async fn on_dra_clusters_limits_become_a_claim_bound_to_the_container() {
    let (r, out) = on_dra(pod(vcuda(30, 8), json!({}))).await;
    let main = &out["spec"]["containers"][1];
    assert_eq!(main["resources"]["limits"], json!({}), "{out}");
    assert_eq!(main["resources"]["requests"], json!({}), "{out}");
    assert_eq!(main["resources"]["claims"], json!([{"name": "vcuda-c1"}]));
    assert_eq!(
        out["spec"]["resourceClaims"],
        json!([{"name": "vcuda-c1", "resourceClaimTemplateName": "vcuda-30c-2048mi"}])
    );
    let t = r.templates.created.lock().unwrap().clone();
    assert_eq!(t.len(), 1);
    let t = serde_json::to_value(&t[0]).unwrap();
    assert_eq!(t["metadata"]["namespace"], "team");
    let ex = &t["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(ex["deviceClassName"], "vcuda-share.vcuda.tencent.com");
    assert_eq!(
        ex["capacity"]["requests"],
        json!({"cores": "30", "memory": "2048Mi"})
    );
    // Again (a retry): the same template, not a second one.
    r.hook
        .mutate(&req("CREATE", pod(vcuda(30, 8), json!({})), None, "alice"))
        .await;
    assert_eq!(r.templates.created.lock().unwrap().len(), 1);
}

/// A share asking for a MIG profile (docs/mig.md) becomes a claim of a MIG
/// device of that profile with the same capacity: one manifest, both modes.
#[tokio::test]
async fn on_dra_clusters_a_share_in_a_mig_profile_claims_a_mig_device() {
    let (r, out) = on_dra(pod(
        vcuda(50, 20),
        json!({"tencent.com/vcuda-mig-profile": "1g.10gb+me", "tencent.com/vcuda-tier": "batch"}),
    ))
    .await;
    assert_eq!(
        out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        "vcuda-50c-5120mi-in-1g.10gb.me-batch"
    );
    let t = serde_json::to_value(&r.templates.created.lock().unwrap()[0]).unwrap();
    let ex = &t["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(ex["deviceClassName"], "vcuda-mig.vcuda.tencent.com");
    assert_eq!(
        ex["selectors"][0]["cel"]["expression"],
        "device.attributes['vcuda.tencent.com'].profile == '1g.10gb+me'"
    );
    assert_eq!(
        ex["capacity"]["requests"],
        json!({"cores": "50", "memory": "5120Mi"})
    );
}

/// What no instance could hold is refused at admission, as the manager
/// would refuse it: a whole GPU's cores with a profile.
#[test]
fn a_whole_request_with_a_mig_profile_is_refused() {
    let r = rig(Settings::default());
    let p = pod(
        vcuda(100, 0),
        json!({"tencent.com/vcuda-mig-profile": "2g.20gb"}),
    );
    let m = denied(r.hook.validate(&req("CREATE", p, None, "alice")));
    assert!(
        m.contains("inside a 2g.20gb MIG instance") && m.contains("1..99"),
        "{m}"
    );
}

#[tokio::test]
async fn whole_and_multi_gpu_requests_get_their_templates() {
    let r = rig(Settings {
        dra: true,
        ..Settings::default()
    });
    r.hook
        .mutate(&req("CREATE", pod(vcuda(200, 0), json!({})), None, "alice"))
        .await;
    let tp = pod(
        vcuda(80, 40),
        json!({"tencent.com/vcuda-gpus": r#"{"main": 2}"#}),
    );
    r.hook.mutate(&req("CREATE", tp, None, "alice")).await;
    let t: Vec<Value> = r
        .templates
        .created
        .lock()
        .unwrap()
        .iter()
        .map(|t| serde_json::to_value(t).unwrap())
        .collect();
    assert_eq!(t[0]["metadata"]["name"], "vcuda-gpu-2");
    assert_eq!(
        t[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"],
        2
    );
    assert_eq!(
        t[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"],
        "vcuda-gpu.vcuda.tencent.com"
    );
    assert_eq!(t[1]["metadata"]["name"], "vcuda-2x40c-5120mi");
    let d = &t[1]["spec"]["spec"]["devices"];
    assert_eq!(
        d["requests"][0]["exactly"]["capacity"]["requests"],
        json!({"cores": "40", "memory": "5120Mi"})
    );
    assert_eq!(
        d["constraints"],
        json!([{"distinctAttribute": "vcuda.tencent.com/uuid"}])
    );
}

#[tokio::test]
async fn dry_runs_invalid_pods_and_pods_with_vcuda_claims_are_not_rewritten() {
    let r = rig(Settings {
        dra: true,
        ..Settings::default()
    });
    let mut dry = req("CREATE", pod(vcuda(30, 8), json!({})), None, "alice");
    dry.dry_run = true;
    assert!(matches!(r.hook.mutate(&dry).await, Verdict::Patch(_)));
    assert!(
        r.templates.created.lock().unwrap().is_empty(),
        "a dry run creates nothing"
    );
    assert_eq!(
        r.hook
            .mutate(&req("CREATE", pod(vcuda(150, 8), json!({})), None, "alice"))
            .await,
        Verdict::Allow
    );
    let mut p = pod(json!({}), json!({}));
    p["spec"]["resourceClaims"] =
        json!([{"name": "vcuda-gpu", "resourceClaimTemplateName": "mine"}]);
    assert_eq!(
        r.hook.mutate(&req("CREATE", p, None, "alice")).await,
        Verdict::Allow
    );
    // A template that cannot be created: the pod is not admitted without it.
    *r.templates.fail.lock().unwrap() = Some("forbidden".into());
    let m = denied(
        r.hook
            .mutate(&req("CREATE", pod(vcuda(20, 4), json!({})), None, "alice"))
            .await,
    );
    assert!(
        m.contains("creating ResourceClaimTemplate team/vcuda-20c-1024mi: forbidden"),
        "{m}"
    );
}

#[tokio::test]
async fn the_scheduler_name_goes_only_on_vcuda_pods_of_the_default_scheduler() {
    let r = rig(Settings {
        dra: false,
        scheduler_name: Some("vcuda-scheduler".into()),
        ..Settings::default()
    });
    let p = pod(vcuda(30, 8), json!({}));
    assert_eq!(
        r.hook.mutate(&req("CREATE", p, None, "alice")).await,
        Verdict::Patch(vec![
            json!({"op": "add", "path": "/spec/schedulerName", "value": "vcuda-scheduler"})
        ])
    );
    assert_eq!(
        r.hook
            .mutate(&req("CREATE", pod(json!({}), json!({})), None, "alice"))
            .await,
        Verdict::Allow
    );
    let mut own = pod(vcuda(30, 8), json!({}));
    own["spec"]["schedulerName"] = json!("volcano");
    assert_eq!(
        r.hook.mutate(&req("CREATE", own, None, "alice")).await,
        Verdict::Allow
    );
}

/// The device plugins' MIG resources on a DRA cluster: each limit becomes
/// a claim for that many MIG devices of its profile (the MIG class and a
/// selector on the profile, as docs/mig.md's DRA example), the vcuda
/// limits beside them their own claim; `.me` names a `+me` profile. In
/// device-plugin mode nothing changes.
#[tokio::test]
async fn mig_limits_become_mig_claims() {
    let r = rig(Settings {
        dra: true,
        ..Settings::default()
    });
    let limits = json!({"tencent.com/mig-3g.40gb": "1", "tencent.com/mig-1g.10gb.me": "2"});
    let p = pod(limits.clone(), json!({}));
    let Verdict::Patch(ops) = r
        .hook
        .mutate(&req("CREATE", p.clone(), None, "alice"))
        .await
    else {
        panic!("no patch")
    };
    let out = apply(p, &ops);
    let main = &out["spec"]["containers"][1];
    assert_eq!(main["resources"]["limits"], json!({}), "{out}");
    assert_eq!(main["resources"]["requests"], json!({}), "{out}");
    assert_eq!(
        main["resources"]["claims"],
        json!([{"name": "vcuda-m1-0"}, {"name": "vcuda-m1-1"}])
    );
    assert_eq!(
        out["spec"]["resourceClaims"],
        json!([
            {"name": "vcuda-m1-0", "resourceClaimTemplateName": "vcuda-mig-1g.10gb.me-2"},
            {"name": "vcuda-m1-1", "resourceClaimTemplateName": "vcuda-mig-3g.40gb-1"}
        ])
    );
    let t = r.templates.created.lock().unwrap().clone();
    let t: Vec<Value> = t.iter().map(|t| serde_json::to_value(t).unwrap()).collect();
    let ex = &t[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(ex["deviceClassName"], "vcuda-mig.vcuda.tencent.com");
    assert_eq!(ex["count"], 2);
    assert_eq!(
        ex["selectors"][0]["cel"]["expression"],
        "device.attributes['vcuda.tencent.com'].profile == '1g.10gb+me'"
    );

    let dp = rig(Settings::default());
    let v = dp
        .hook
        .mutate(&req("CREATE", pod(limits, json!({})), None, "alice"))
        .await;
    assert!(!matches!(v, Verdict::Patch(_)), "device-plugin mode: {v:?}");
}
