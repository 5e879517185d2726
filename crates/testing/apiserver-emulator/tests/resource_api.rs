//! resource.k8s.io/v1 through the real `kube` client and k8s-openapi's
//! types: ResourceSlices (create, replace with generation and conflicts,
//! list by field, watch), DeviceClasses, ResourceClaims and their status.

mod common;

use std::time::Duration;

use apiserver_emulator::{ApiServer, Kind};
use common::client;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

fn slice(name: &str, node: &str, generation: i64) -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"driver": "vcuda.tencent.com", "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "allowMultipleAllocations": true,
                              "capacity": {"cores": {"value": "100"}}}]}
    }))
    .unwrap()
}

#[tokio::test]
async fn slices_classes_claims_with_kube() {
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let client = client(&server).await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let created = slices
        .create(&PostParams::default(), &slice("n1-vcuda", "n1", 1))
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let dev = &created.spec.devices.as_ref().unwrap()[0];
    assert_eq!(dev.allow_multiple_allocations, Some(true));

    // A watch sees the replacement.
    let mut w = watcher(slices.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.spec.pool.generation, 1);

    let mut next = slice("n1-vcuda", "n1", 2);
    next.metadata.resource_version = created.metadata.resource_version.clone();
    let replaced = slices
        .replace("n1-vcuda", &PostParams::default(), &next)
        .await
        .unwrap();
    assert_eq!(replaced.metadata.generation, Some(2));
    // A stale resourceVersion is a conflict.
    let err = slices
        .replace("n1-vcuda", &PostParams::default(), &next)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 409),
        "{err}"
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(seen.spec.pool.generation, 2);

    slices
        .create(&PostParams::default(), &slice("n2-vcuda", "n2", 1))
        .await
        .unwrap();
    let on_n1 = slices
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(on_n1.items.len(), 1);
    slices
        .delete("n2-vcuda", &Default::default())
        .await
        .unwrap();
    assert_eq!(server.list(Kind::ResourceSlice).len(), 1);
    let kinds: Vec<&str> = server
        .changes(Kind::ResourceSlice)
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(kinds, ["ADDED", "MODIFIED", "ADDED", "DELETED"]);

    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "vcuda-share.vcuda.tencent.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'vcuda.tencent.com'"}}]}
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
    assert!(classes.get("vcuda-share.vcuda.tencent.com").await.is_ok());

    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "ns1");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "vcuda-share.vcuda.tencent.com",
            "capacity": {"requests": {"cores": "30", "memory": "1Gi"}}}}]}}
    }))
    .unwrap();
    let c = claims.create(&PostParams::default(), &claim).await.unwrap();
    assert_eq!(c.metadata.namespace.as_deref(), Some("ns1"));
    let status = json!({"status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": "vcuda.tencent.com", "pool": "n1", "device": "gpu-0",
        "shareID": "11111111-0000-4000-8000-000000000001",
        "consumedCapacity": {"cores": "30", "memory": "1Gi"}}]}}}});
    let after = claims
        .patch_status("c1", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let r = &after
        .status
        .unwrap()
        .allocation
        .unwrap()
        .devices
        .unwrap()
        .results
        .unwrap()[0];
    assert_eq!(r.consumed_capacity.as_ref().unwrap()["memory"].0, "1Gi");
    // A spec patch through the main resource cannot write the status.
    let sneaky = json!({"status": null, "metadata": {"labels": {"a": "b"}}});
    let kept = claims
        .patch("c1", &PatchParams::default(), &Patch::Merge(&sneaky))
        .await
        .unwrap();
    assert!(kept.status.is_some());
    claims.delete("c1", &Default::default()).await.unwrap();
    assert!(server.get(Kind::ResourceClaim, Some("ns1"), "c1").is_none());
}
