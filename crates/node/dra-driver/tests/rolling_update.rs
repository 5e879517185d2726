//! Two driver instances on one node at once, as a rolling update with
//! `maxSurge: 1` runs them (deploy/dra/driver.yaml): the new one registers
//! beside the old under its own socket names and removes the old one's
//! once registered; a claim the old one prepares after the new one loaded
//! the checkpoint is not lost when the new one writes it, and a claim the
//! new one unprepares is dropped by the old one. Through the emulated
//! kubelet over the real protobuf, against the API server emulator.

use apiserver_emulator::ApiServer;
use dra_driver::checkpoint::Store;
use dra_driver::publish::Publisher;
use dra_driver::slices::GpuDevice;
use dra_kubelet_emulator::{allocator, plugin};
use test_support::dra::*;

fn devices() -> Vec<GpuDevice> {
    gpus()
        .into_iter()
        .map(|info| GpuDevice {
            info,
            model: "NVIDIA A100-SXM4-40GB".into(),
            xid: None,
            mig: None,
            pcie_root: None,
            nvlink_domain: None,
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        })
        .collect()
}

fn on_disk(dirs: &Dirs) -> Vec<String> {
    let ck = Store::new(&dirs.p("state")).load(NODE).unwrap();
    ck.claims.values().map(|c| c.name.clone()).collect()
}

fn names(r: &Running) -> Vec<String> {
    let mut v: Vec<String> = r.driver.prepared().into_iter().map(|c| c.name).collect();
    v.sort();
    v
}

async fn prepare(kubelet: &plugin::DraPlugin, c: &dra_api::dra::v1::Claim) {
    let r = kubelet.prepare(std::slice::from_ref(c)).await.unwrap();
    assert_eq!(r.claims[&c.uid].error, "", "{}", c.name);
}

async fn unprepare(kubelet: &plugin::DraPlugin, c: &dra_api::dra::v1::Claim) {
    let r = kubelet.unprepare(std::slice::from_ref(c)).await.unwrap();
    assert_eq!(r.claims[&c.uid].error, "", "{}", c.name);
}

async fn claim(server: &ApiServer, name: &str) -> dra_api::dra::v1::Claim {
    let c = share_claim(server, name, 20, "1Gi", None);
    allocator::allocate(server, NS, name, NODE).unwrap();
    plugin::claim(NS, name, &uid(&c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_new_instance_serve_one_checkpoint() {
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let api = kube(&server, dirs.tmp.path()).await;
    let p = Publisher::new(
        NODE,
        "550.54.15",
        dra_driver::slices::Unhealthy::Taint("NoSchedule"),
    );
    p.ensure_classes(&api).await.unwrap();
    p.reconcile(&api, &devices()).await.unwrap();

    let old = start(&dirs, gpus(), &api).await;
    let to_old = plugin::register(&old.sockets.registration, false)
        .await
        .unwrap();
    let c1 = claim(&server, "c1").await;
    prepare(&to_old, &c1).await;

    // The new instance starts (loads the checkpoint: c1) and registers
    // under its own names; the old one's are still there.
    let new = start(&dirs, gpus(), &api).await;
    assert_ne!(new.sockets.registration, old.sockets.registration);
    assert_ne!(new.sockets.plugin, old.sockets.plugin);
    let to_new = plugin::register(&new.sockets.registration, false)
        .await
        .unwrap();
    assert_eq!(names(&new), ["c1"]);

    // The kubelet's call in flight to the old one lands after that.
    let c2 = claim(&server, "c2").await;
    prepare(&to_old, &c2).await;
    // The new one's next write keeps it, and it serves c2's socket.
    let c3 = claim(&server, "c3").await;
    prepare(&to_new, &c3).await;
    let mut disk = on_disk(&dirs);
    disk.sort();
    assert_eq!(disk, ["c1", "c2", "c3"]);
    assert_eq!(names(&new), ["c1", "c2", "c3"]);
    // Asked again for c2 (a kubelet retry), the new one answers from it.
    prepare(&to_new, &c2).await;

    // The new one unprepares c2; the old one, at its next call, no longer
    // counts it.
    unprepare(&to_new, &c2).await;
    assert!(!dirs.p("vm").join(&c2.uid).exists());
    prepare(&to_old, &c1).await;
    assert_eq!(names(&old), ["c1", "c3"]);

    // Registered, the new one removes the old one's files (the kubelet
    // drops that endpoint) and keeps its own.
    let removed = new.sockets.remove_older();
    assert!(removed.contains(&old.sockets.registration), "{removed:?}");
    assert!(removed.contains(&old.sockets.plugin), "{removed:?}");
    assert!(new.sockets.registration.exists() && new.sockets.plugin.exists());
    // The old one stopping leaves the new one's alone; the new one stopping
    // removes its own (the kubelet unregisters it at once).
    old.cancel.cancel();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(new.sockets.registration.exists() && new.sockets.plugin.exists());
    new.cancel.cancel();
    until(10, "the stopped instance's sockets removed", || {
        !new.sockets.registration.exists() && !new.sockets.plugin.exists()
    })
    .await;
}
