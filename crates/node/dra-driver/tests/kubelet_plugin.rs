//! The driver through the emulated kubelet over the real protobuf on unix
//! sockets, against the API server emulator: registration, publishing,
//! two 30 % / 1 GiB claims packed on one GPU, idempotent prepare, soft
//! limits and bad parameters, a driver restart keeping prepared claims,
//! unprepare, a v1beta1 kubelet. No GPU simulator: the GPUs are given.

use std::os::unix::fs::MetadataExt;

use apiserver_emulator::{ApiServer, Kind};
use dra_driver::kube_api::KubeApi;
use dra_driver::publish::{Published, Publisher};
use dra_driver::slices::{self, GpuDevice};
use dra_kubelet_emulator::{allocator, cdi, plugin};
use serde_json::json;
use test_support::dra::{self, *};

fn devices(healthy: [bool; 2]) -> Vec<GpuDevice> {
    gpus()
        .into_iter()
        .zip(healthy)
        .map(|(info, healthy)| GpuDevice {
            info,
            model: "Tesla T4".into(),
            xid: (!healthy).then_some(79),
            mig: None,
            pcie_root: None,
            nvlink_domain: None,
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_once_bump_on_health_never_duplicate() {
    let (server, _dirs, api) = emulator().await;
    let p = publisher();
    p.ensure_classes(&api).await.unwrap();
    p.ensure_classes(&api).await.unwrap();
    assert_eq!(server.list(Kind::DeviceClass).len(), 3, "share, whole, MIG");

    assert_eq!(
        p.reconcile(&api, &devices([true, true])).await.unwrap(),
        Published::Created { generation: 1 }
    );
    // A restart on the same hardware writes nothing.
    assert_eq!(
        p.reconcile(&api, &devices([true, true])).await.unwrap(),
        Published::Unchanged { generation: 1 }
    );
    // An Xid on GPU 1: the device stays, tainted; the pool generation goes up.
    assert_eq!(
        p.reconcile(&api, &devices([true, false])).await.unwrap(),
        Published::Replaced { generation: 2 }
    );
    let s = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    assert_eq!(s["spec"]["pool"]["generation"], 2);
    assert_eq!(s["spec"]["devices"].as_array().unwrap().len(), 2);
    assert_eq!(s["spec"]["devices"][0].get("taints"), None);
    assert_eq!(
        s["spec"]["devices"][1]["taints"][0]["value"], "xid-79",
        "{s}"
    );
    assert_eq!(
        p.reconcile(&api, &devices([true, false])).await.unwrap(),
        Published::Unchanged { generation: 2 }
    );
    assert_eq!(
        p.reconcile(&api, &devices([true, true])).await.unwrap(),
        Published::Replaced { generation: 3 }
    );
    // A stray slice of this driver on this node (an older name) is removed.
    let mut stray = serde_json::to_value(slices::build(
        NODE,
        &devices([true, true]),
        "550.54.15",
        1,
        slices::Unhealthy::LeftOut,
    ))
    .unwrap();
    stray["metadata"]["name"] = json!("node-a-old");
    server.create(Kind::ResourceSlice, None, stray).unwrap();
    assert_eq!(
        p.reconcile(&api, &devices([true, true])).await.unwrap(),
        Published::Unchanged { generation: 3 }
    );
    let ours: Vec<_> = server.list(Kind::ResourceSlice);
    assert_eq!(ours.len(), 1, "never two slices for one node");
    let kinds: Vec<&str> = server
        .changes(Kind::ResourceSlice)
        .into_iter()
        .filter(|(_, o)| o["metadata"]["name"] == slices::slice_name(NODE).as_str())
        .map(|(t, _)| t)
        .collect();
    assert_eq!(kinds, ["ADDED", "MODIFIED", "MODIFIED"]);
}

/// The API server emulator, the test's directories and a client of it.
/// An earlier release's share class (the driver selector alone, no
/// label) is brought to this release's; an operator's own class of the
/// whole class's name is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_releases_classes_are_updated_at_start() {
    let (server, _dirs, api) = emulator().await;
    let driver_only = json!([{"cel": {"expression": "device.driver == 'vcuda.tencent.com'"}}]);
    server
        .create(
            Kind::DeviceClass,
            None,
            json!({"metadata": {"name": slices::SHARE_CLASS}, "spec": {"selectors": driver_only}}),
        )
        .unwrap();
    let operators = json!([{"cel": {"expression": "device.driver == 'vcuda.tencent.com'"}},
                           {"cel": {"expression": "device.attributes['vcuda.tencent.com'].model == 'A100'"}}]);
    server
        .create(
            Kind::DeviceClass,
            None,
            json!({"metadata": {"name": slices::WHOLE_CLASS}, "spec": {"selectors": operators}}),
        )
        .unwrap();
    publisher().ensure_classes(&api).await.unwrap();
    let share = server
        .get(Kind::DeviceClass, None, slices::SHARE_CLASS)
        .unwrap();
    let want = slices::type_selector("gpu");
    assert_eq!(
        share["spec"]["selectors"][1]["cel"]["expression"], want,
        "{share}"
    );
    assert_eq!(
        share["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "vcuda-dra-driver"
    );
    let whole = server
        .get(Kind::DeviceClass, None, slices::WHOLE_CLASS)
        .unwrap();
    assert_eq!(
        whole["spec"]["selectors"], operators,
        "the operator's, kept"
    );
    assert!(
        server
            .get(Kind::DeviceClass, None, slices::MIG_CLASS)
            .is_some()
    );
}

async fn emulator() -> (ApiServer, Dirs, KubeApi) {
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let api = kube(&server, dirs.tmp.path()).await;
    (server, dirs, api)
}

/// The container paths of resolved edits' device nodes.
fn node_paths(edits: &serde_json::Value) -> Vec<&str> {
    edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].as_str().unwrap())
        .collect()
}

fn publisher() -> Publisher {
    Publisher::new(
        NODE,
        "550.54.15",
        dra_driver::slices::Unhealthy::Taint("NoSchedule"),
    )
}

/// The API server emulator with both GPUs published on [`NODE`], the driver
/// started on them and a v1 kubelet connected to it.
async fn node_with_driver() -> (ApiServer, Dirs, KubeApi, Running, plugin::DraPlugin) {
    let (server, dirs, api) = emulator().await;
    let p = publisher();
    p.ensure_classes(&api).await.unwrap();
    p.reconcile(&api, &devices([true, true])).await.unwrap();
    let run = start(&dirs, gpus(), &api).await;
    let kubelet = kubelet(&dirs, false).await;
    (server, dirs, api, run, kubelet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_pack_restart_unprepare() {
    let (server, dirs, api, run, kubelet) = node_with_driver().await;
    assert_eq!(kubelet.name, "vcuda.tencent.com");
    assert_eq!(kubelet.version, plugin::Version::V1);
    until(10, "the registration notification", || {
        run.registration.lock().unwrap().registered
    })
    .await;

    // Two 30 % / 1 GiB claims: the allocator packs them on gpu-0.
    let c1 = share_claim(&server, "c1", 30, "1Gi", None);
    let c2 = share_claim(&server, "c2", 30, "1Gi", None);
    let a1 = allocator::allocate(&server, NS, "c1", NODE).unwrap();
    let a2 = allocator::allocate(&server, NS, "c2", NODE).unwrap();
    assert_eq!(a1["devices"]["results"][0]["device"], "gpu-0");
    assert_eq!(a2["devices"]["results"][0]["device"], "gpu-0");
    assert_eq!(
        a2["devices"]["results"][0]["consumedCapacity"],
        json!({"cores": "30", "memory": "1Gi"})
    );

    let claims = [
        plugin::claim(NS, "c1", &uid(&c1)),
        plugin::claim(NS, "c2", &uid(&c2)),
    ];
    let r = kubelet.prepare(&claims).await.unwrap();
    for c in &claims {
        let one = &r.claims[&c.uid];
        assert_eq!(one.error, "", "{}", c.name);
        let d = &one.devices[0];
        assert_eq!(
            (
                d.request_names.as_slice(),
                d.device_name.as_str(),
                d.pool_name.as_str()
            ),
            (&["gpu".to_string()][..], "gpu-0", NODE)
        );
        assert!(d.share_id.is_some());
        let id = &d.cdi_device_ids[0];
        assert_eq!(id, &format!("vcuda.tencent.com/gpu={}-gpu-gpu-0", c.uid));
        // The runtime's view: the spec validates and the ID resolves.
        let edits = cdi::resolve(&dirs.p("cdi"), id).unwrap();
        let mounts: Vec<&str> = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["containerPath"].as_str().unwrap())
            .collect();
        assert_eq!(mounts, ["/usr/local/nvidia", "/etc/vcuda"]);
        assert_eq!(
            edits["mounts"][0]["hostPath"],
            dirs.p("vdriver/nvidia").display().to_string()
        );
        assert!(
            edits["env"]
                .as_array()
                .unwrap()
                .contains(&json!("NVIDIA_VISIBLE_DEVICES=GPU-00000000"))
        );
        let nodes = node_paths(&edits);
        assert_eq!(nodes, ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"]);
        let vm = dirs.p("vm").join(&c.uid).join("gpu");
        let data = quota_config::read_config(&vm.join(quota_config::CONFIG_FILE)).unwrap();
        assert_eq!(
            (
                data.gpu_memory,
                data.utilization,
                data.limit,
                data.hard_limit,
                data.enable
            ),
            (1 << 30, 30, 30, true, true)
        );
        assert_eq!(data.pod_uid, c.uid);
        assert!(vm.join(quota_config::SOCKET_FILE).exists());
        assert!(test_support::ledger::try_live(&vm, 0).is_some());
    }

    // Idempotent: preparing again answers the same and rewrites nothing.
    let cfg1 = dirs
        .p("vm")
        .join(uid(&c1))
        .join("gpu")
        .join(quota_config::CONFIG_FILE);
    let ino = std::fs::metadata(&cfg1).unwrap().ino();
    let again = kubelet.prepare(&claims[..1]).await.unwrap();
    assert_eq!(again.claims[&uid(&c1)], r.claims[&uid(&c1)]);
    assert_eq!(std::fs::metadata(&cfg1).unwrap().ino(), ino);

    // Soft limit from opaque parameters; bad parameters fail only their claim.
    let params = |v| {
        Some(
            json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": v}),
        )
    };
    let soft = share_claim(&server, "soft", 20, "512Mi", params(json!(60)));
    let bad = share_claim(&server, "bad", 20, "512Mi", params(json!("lots")));
    allocator::allocate(&server, NS, "soft", NODE).unwrap();
    allocator::allocate(&server, NS, "bad", NODE).unwrap();
    let unallocated = share_claim(&server, "pending", 10, "256Mi", None);
    let r = kubelet
        .prepare(&[
            plugin::claim(NS, "soft", &uid(&soft)),
            plugin::claim(NS, "bad", &uid(&bad)),
            plugin::claim(NS, "pending", &uid(&unallocated)),
            plugin::claim(NS, "c1", "not-the-uid"),
        ])
        .await
        .unwrap();
    assert_eq!(r.claims[&uid(&soft)].error, "");
    let data = quota_config::read_config(
        &dirs
            .p("vm")
            .join(uid(&soft))
            .join("gpu")
            .join(quota_config::CONFIG_FILE),
    )
    .unwrap();
    assert_eq!(
        (data.utilization, data.limit, data.hard_limit),
        (20, 60, false)
    );
    let e = &r.claims[&uid(&bad)].error;
    assert!(
        e.starts_with(
            "claim team/bad: opaque parameters for vcuda.tencent.com: invalid type: string \"lots\""
        ),
        "{e}"
    );
    assert!(
        r.claims[&uid(&unallocated)]
            .error
            .contains("is not allocated")
    );
    assert!(
        r.claims["not-the-uid"]
            .error
            .contains("the kubelet asked for \"not-the-uid\"")
    );
    assert!(
        !dirs.p("vm").join(uid(&bad)).exists(),
        "a failed claim leaves nothing behind"
    );

    // A driver restart: the claims stay prepared, their files untouched;
    // prepare answers from the checkpoint even with the claim gone from the
    // API server.
    run.cancel.cancel();
    run.driver.shutdown();
    drop(run);
    drop(kubelet);
    server.delete(Kind::ResourceClaim, Some(NS), "c2").unwrap();
    // A CDI spec lost while the driver was down comes back; the others are
    // not rewritten.
    let spec1 = dirs
        .p("cdi")
        .join(format!("vcuda.tencent.com-{}.json", uid(&c1)));
    let spec2 = dirs
        .p("cdi")
        .join(format!("vcuda.tencent.com-{}.json", uid(&c2)));
    let spec1_ino = std::fs::metadata(&spec1).unwrap().ino();
    std::fs::remove_file(&spec2).unwrap();
    // A spec of a claim that never made it into the checkpoint goes.
    let stray = dirs
        .p("cdi")
        .join("vcuda.tencent.com-00000000-dead-4000-8000-000000000000.json");
    std::fs::write(&stray, b"{}").unwrap();
    let foreign = dirs.p("cdi").join("nvidia.com-gpu.json");
    std::fs::write(&foreign, b"{}").unwrap();
    let run = start(&dirs, gpus(), &api).await;
    assert!(!stray.exists() && foreign.exists());
    std::fs::remove_file(&foreign).unwrap();
    assert_eq!(std::fs::metadata(&spec1).unwrap().ino(), spec1_ino);
    assert!(
        cdi::resolve(
            &dirs.p("cdi"),
            &format!("vcuda.tencent.com/gpu={}-gpu-gpu-0", uid(&c2))
        )
        .is_ok()
    );
    let kubelet = dra::kubelet(&dirs, false).await;
    assert_eq!(std::fs::metadata(&cfg1).unwrap().ino(), ino);
    let r2 = kubelet.prepare(&claims[1..]).await.unwrap();
    assert_eq!(r2.claims[&uid(&c2)].error, "");
    assert_eq!(r2.claims[&uid(&c2)].devices[0].device_name, "gpu-0");
    let sock = dirs
        .p("vm")
        .join(uid(&c2))
        .join("gpu")
        .join(quota_config::SOCKET_FILE);
    until(10, "vcuda.sock served again", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .await;
    assert_eq!(run.driver.prepared().len(), 3);

    // Unprepare releases everything; again is fine.
    let u = kubelet.unprepare(&claims[1..]).await.unwrap();
    assert_eq!(u.claims[&uid(&c2)].error, "");
    assert!(!dirs.p("vm").join(uid(&c2)).exists());
    assert!(
        !dirs
            .p("cdi")
            .join(format!("vcuda.tencent.com-{}.json", uid(&c2)))
            .exists()
    );
    assert!(
        cdi::resolve(
            &dirs.p("cdi"),
            &format!("vcuda.tencent.com/gpu={}-gpu-gpu-0", uid(&c2))
        )
        .is_err()
    );
    assert_eq!(
        kubelet.unprepare(&claims[1..]).await.unwrap().claims[&uid(&c2)].error,
        ""
    );
    let ck: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dirs.p("state/checkpoint.json")).unwrap()).unwrap();
    assert!(ck["claims"].get(uid(&c2)).is_none() && ck["claims"].get(uid(&c1)).is_some());

    // A kubelet that speaks v1beta1 only.
    let old = kubelet_beta(&dirs).await;
    assert_eq!(old.version, plugin::Version::V1beta1);
    let r = old.prepare(&claims[..1]).await.unwrap();
    assert_eq!(
        r.claims[&uid(&c1)].devices[0].cdi_device_ids,
        again.claims[&uid(&c1)].devices[0].cdi_device_ids
    );
    assert_eq!(
        old.unprepare(&claims[..1]).await.unwrap().claims[&uid(&c1)].error,
        ""
    );
    assert!(!dirs.p("vm").join(uid(&c1)).exists());
    run.cancel.cancel();
}

async fn kubelet_beta(dirs: &Dirs) -> plugin::DraPlugin {
    dra::kubelet(dirs, true).await
}

/// Not a timed test: prints NodePrepareResources latency (one claim per
/// call, through the emulated kubelet, the claim read from the API server
/// emulator over HTTP, files and the fsynced checkpoint written) with 100
/// claims prepared one after another, and NodeUnprepareResources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_prepare_latency_printout() {
    let (server, _dirs, _api, run, kubelet) = node_with_driver().await;
    const N: usize = 100;
    let mut claims = Vec::new();
    for i in 0..N {
        let name = format!("c{i}");
        let c = share_claim(&server, &name, 1, "256Mi", None);
        allocator::allocate(&server, NS, &name, NODE).unwrap();
        claims.push(plugin::claim(NS, &name, &uid(&c)));
    }
    let mut prep = Vec::new();
    for c in &claims {
        let t = std::time::Instant::now();
        let r = kubelet.prepare(std::slice::from_ref(c)).await.unwrap();
        prep.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(r.claims[&c.uid].error, "");
    }
    let mut unprep = Vec::new();
    for c in &claims {
        let t = std::time::Instant::now();
        let r = kubelet.unprepare(std::slice::from_ref(c)).await.unwrap();
        unprep.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(r.claims[&c.uid].error, "");
    }
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
    };
    println!(
        "NodePrepareResources over {N} claims: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; NodeUnprepareResources: p50 {:.2} ms, p99 {:.2} ms",
        pct(&mut prep, 0.5),
        pct(&mut prep, 0.99),
        pct(&mut prep, 1.0),
        pct(&mut unprep, 0.5),
        pct(&mut unprep, 0.99),
    );
    assert!(run.driver.prepared().is_empty());
    run.cancel.cancel();
}

/// The whole-GPU class: a claim asking no capacity takes a whole free GPU
/// (the shares' GPU is passed over), gets the untouched driver volume, a
/// disabled `vcuda.config` and no socket; asking a part of a GPU under the
/// whole-GPU class is refused at prepare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpu_class() {
    let (server, dirs, _api, run, kubelet) = node_with_driver().await;
    let share = share_claim(&server, "share", 30, "1Gi", None);
    allocator::allocate(&server, NS, "share", NODE).unwrap();
    let whole = server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({"metadata": {"name": "whole"}, "spec": {"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": slices::WHOLE_CLASS}}]}}}),
        )
        .unwrap();
    let a = allocator::allocate(&server, NS, "whole", NODE).unwrap();
    assert_eq!(a["devices"]["results"][0]["device"], "gpu-1");
    assert_eq!(a["devices"]["config"][0]["source"], "FromClass");
    let partial = server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({"metadata": {"name": "partial"}, "spec": {"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": slices::WHOLE_CLASS,
                            "capacity": {"requests": {"cores": "50", "memory": "1Gi"}}}}]}}}),
        )
        .unwrap();
    allocator::allocate(&server, NS, "partial", NODE).unwrap();
    let r = kubelet
        .prepare(&[
            plugin::claim(NS, "share", &uid(&share)),
            plugin::claim(NS, "whole", &uid(&whole)),
            plugin::claim(NS, "partial", &uid(&partial)),
        ])
        .await
        .unwrap();
    assert_eq!(r.claims[&uid(&whole)].error, "");
    let edits = cdi::resolve(
        &dirs.p("cdi"),
        &r.claims[&uid(&whole)].devices[0].cdi_device_ids[0],
    )
    .unwrap();
    assert_eq!(
        edits["mounts"][0]["hostPath"],
        dirs.p("vdriver/origin").display().to_string()
    );
    let nodes = node_paths(&edits);
    assert_eq!(nodes, ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"]);
    let vm = dirs.p("vm").join(uid(&whole)).join("gpu");
    let data = quota_config::read_config(&vm.join(quota_config::CONFIG_FILE)).unwrap();
    assert!(!data.enable);
    assert!(!vm.join(quota_config::SOCKET_FILE).exists());
    let e = &r.claims[&uid(&partial)].error;
    assert!(
        e.contains("is for a whole GPU (exclusive) but consumed 50 cores"),
        "{e}"
    );
    run.cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_on_two_gpus_for_one_container() {
    let (server, dirs, api, run, kubelet) = node_with_driver().await;
    // Another tenant's share on gpu-0 first.
    let other = share_claim(&server, "other", 30, "1Gi", None);
    allocator::allocate(&server, NS, "other", NODE).unwrap();
    let tp = two_gpu_claim(&server, "tp2", "50", "8Gi");
    let claims = [
        plugin::claim(NS, "other", &uid(&other)),
        plugin::claim(NS, "tp2", &tp),
    ];
    let r = kubelet.prepare(&claims).await.unwrap();
    assert_eq!(r.claims[&uid(&other)].error, "");
    let one = &r.claims[&tp];
    assert_eq!(one.error, "");
    let names: Vec<&str> = one.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
    // The runtime's view of each device: the common edits once (both GPUs
    // visible, the interposer's volume), each device its own node.
    for (i, d) in one.devices.iter().enumerate() {
        let edits = cdi::resolve(&dirs.p("cdi"), &d.cdi_device_ids[0]).unwrap();
        assert!(
            edits["env"]
                .as_array()
                .unwrap()
                .contains(&json!("NVIDIA_VISIBLE_DEVICES=GPU-00000000,GPU-00000001")),
            "{edits}"
        );
        assert_eq!(
            edits["mounts"][0]["hostPath"],
            dirs.p("vdriver/nvidia").display().to_string()
        );
        let nodes = node_paths(&edits);
        assert_eq!(
            nodes.last().copied(),
            Some(format!("/dev/nvidia{i}").as_str())
        );
    }
    // One vm directory: each GPU's quota, a ledger per GPU, one socket.
    let vm = dirs.p("vm").join(&tp).join("gpus");
    let quota_config::Quota::Multi(q) = quota_config::read_quota(&vm).unwrap() else {
        panic!("{}: not a quota on several GPUs", vm.display());
    };
    let per_gpu: Vec<_> = q
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), g.utilization, g.gpu_memory, g.limit))
        .collect();
    assert_eq!(
        per_gpu,
        [
            ("GPU-00000000", 50, 8 << 30, 50),
            ("GPU-00000001", 50, 8 << 30, 50)
        ]
    );
    assert_eq!((q.pod_uid.as_str(), q.hard_limit), (tp.as_str(), true));
    assert!(test_support::ledger::try_live(&vm, 0).is_some());
    assert!(test_support::ledger::try_live(&vm, 1).is_some());
    assert!(vm.join(quota_config::SOCKET_FILE).exists());
    let prepared = run.driver.prepared();
    let held = prepared.iter().find(|c| c.uid == tp).unwrap();
    assert_eq!(held.devices.len(), 2);
    // The display lists one container holding both GPUs.
    let view = dra_driver::display::DraSource {
        driver: run.driver.clone(),
        node: NODE.into(),
        models: vec![],
        healthy: Default::default(),
    };
    let rows = gpu_display::DisplaySource::containers(&view);
    let row = rows.iter().find(|c| c.pod_uid == tp).unwrap();
    let on: Vec<u32> = row.gpus.iter().map(|g| g.index).collect();
    assert_eq!(
        (on, row.core_quota, row.memory_quota_bytes, row.exclusive),
        (vec![0, 1], 100, 16 << 30, false)
    );

    // A restart re-serves it from the checkpoint.
    run.cancel.cancel();
    run.driver.shutdown();
    drop(run);
    drop(kubelet);
    let run = start(&dirs, gpus(), &api).await;
    let kubelet = dra::kubelet(&dirs, false).await;
    let sock = vm.join(quota_config::SOCKET_FILE);
    until(10, "vcuda.sock served again", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .await;
    let again = kubelet.prepare(&claims[1..]).await.unwrap();
    assert_eq!(again.claims[&tp], r.claims[&tp]);
    assert!(matches!(
        quota_config::read_quota(&vm).unwrap(),
        quota_config::Quota::Multi(_)
    ));

    // Unprepare removes all of it.
    let u = kubelet.unprepare(&claims[1..]).await.unwrap();
    assert_eq!(u.claims[&tp].error, "");
    assert!(!dirs.p("vm").join(&tp).exists());
    assert_eq!(run.driver.prepared().len(), 1);
}

/// Compute tiers in DRA mode (docs/qos.md): the claim's `GpuConfig` `tier`
/// reaches the share like the device-plugin mode's annotation: a process
/// registering over the claim's `vcuda.sock` gets the tier and its GPU's
/// QoS page (one for both claims on gpu-0), a latency one a slot; a tier
/// that is none fails its claim naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_claims_get_their_tier_and_the_gpus_qos_page() {
    use qos_page::{QosPage, Tier};
    use std::os::fd::AsFd;
    let (server, dirs, _api, _run, kubelet) = node_with_driver().await;
    let tier = |t: &str| {
        Some(json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "tier": t}))
    };
    let lat = share_claim(&server, "lat", 30, "1Gi", tier("latency"));
    let bat = share_claim(&server, "bat", 30, "1Gi", tier("batch"));
    let bad = share_claim(&server, "gold", 10, "256Mi", tier("gold"));
    for n in ["lat", "bat", "gold"] {
        allocator::allocate(&server, NS, n, NODE).unwrap();
    }
    let r = kubelet
        .prepare(&[
            plugin::claim(NS, "lat", &uid(&lat)),
            plugin::claim(NS, "bat", &uid(&bat)),
            plugin::claim(NS, "gold", &uid(&bad)),
        ])
        .await
        .unwrap();
    assert_eq!(r.claims[&uid(&lat)].error, "");
    assert_eq!(r.claims[&uid(&bat)].error, "");
    let e = &r.claims[&uid(&bad)].error;
    assert!(
        e.contains("unknown QoS tier \"gold\": expected latency, batch or plain"),
        "{e}"
    );

    let register = |claim: &serde_json::Value| {
        let u = uid(claim);
        let req = test_support::hostile::maximal_request(&u, "gpu");
        test_support::hostile::register(&dirs.p("vm").join(&u).join("gpu"), &req)
    };
    let (_l, l, lfds) = tokio::task::block_in_place(|| register(&lat));
    assert_eq!(
        (Tier::from_wire(l.qos_tier), l.qos_page, lfds.len()),
        (Tier::Latency, true, 2),
        "{l:?}"
    );
    assert!(l.qos_slot.is_some());
    let (_b, b, bfds) = tokio::task::block_in_place(|| register(&bat));
    assert_eq!(
        (Tier::from_wire(b.qos_tier), b.qos_slot),
        (Tier::Batch, None),
        "{b:?}"
    );
    let page = QosPage::from_fd(bfds[1].as_fd()).unwrap();
    assert_eq!(
        page.latency_live(),
        1,
        "the latency claim's process is in the same page"
    );
}
