//! The emulator against the real `kube` client: list, reflector watch,
//! merge patch (with conflicts), get, nodes.

mod common;

use std::time::Duration;

use apiserver_emulator::ApiServer;
use common::client;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;

fn pod(name: &str, node: &str) -> serde_json::Value {
    json!({"metadata": {"name": name, "namespace": "ns1"},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
           "status": {"phase": "Pending"}})
}

#[tokio::test]
async fn list_watch_patch_with_kube() {
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    server.create_pod(pod("a", "n1")).unwrap();
    server.create_pod(pod("b", "n2")).unwrap();
    server
        .create_node(json!({"metadata": {"name": "n1"}}))
        .unwrap();
    let client = client(&server).await;

    let pods: Api<Pod> = Api::all(client.clone());
    let lp = ListParams::default().fields("spec.nodeName=n1");
    let list = pods.list(&lp).await.unwrap();
    assert_eq!(list.items.len(), 1);

    let (store, writer) = reflector::store::<Pod>();
    let cfg = watcher::Config::default().fields("spec.nodeName=n1");
    let stream = reflector(writer, watcher(pods.clone(), cfg)).applied_objects();
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        while stream.next().await.is_some() {}
    });
    tokio::time::timeout(Duration::from_secs(5), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.state().len(), 1);

    server.create_pod(pod("c", "n1")).unwrap();
    let until = |n: usize| {
        let store = store.clone();
        async move {
            for _ in 0..200 {
                if store.state().len() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("store never reached {n} pods");
        }
    };
    until(2).await;

    let ns: Api<Pod> = Api::namespaced(client.clone(), "ns1");
    server.inject_conflicts(1);
    let patch = json!({"metadata": {"annotations": {"k": "v"}}});
    let err = ns
        .patch("a", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 409),
        e => panic!("{e}"),
    }
    let p = ns
        .patch("a", &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
    assert_eq!(p.metadata.annotations.unwrap()["k"], "v");
    let got = ns.get("a").await.unwrap();
    assert_eq!(got.metadata.annotations.unwrap()["k"], "v");

    server.delete_pod("ns1", "c").unwrap();
    until(1).await;

    let nodes: Api<Node> = Api::all(client);
    let n = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"gpu-model": "T4"}}})),
        )
        .await
        .unwrap();
    assert_eq!(n.metadata.labels.unwrap()["gpu-model"], "T4");
}
