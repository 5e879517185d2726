use super::*;
use crate::world::PodKey;
use crate::world::doubles::MemoryKubelet;
use device_plugin::api::ContainerAllocateRequest;
use k8s_openapi::api::core::v1::Pod;
use node_agent::events::MemoryEvents;

fn gpu(index: usize, minor: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        minor,
        memory_bytes: 80 << 30,
        numa_node: Some(index as u32),
        pci_bus_id: String::new(),
    }
}

fn mig(uuid: &str, profile: &str, gi: u32) -> MigDevice {
    MigDevice {
        uuid: uuid.into(),
        profile: profile.into(),
        gpu_instance: gi,
        compute_instance: 0,
        memory_bytes: 10 << 30,
        multiprocessors: 16,
    }
}

/// GPU 0 (minor 4) in MIG mode with a 3g.40gb (GI 2) and two 1g.10gb (GI
/// 9, 10); GPU 1 whole. The driver's capability files under `root` for
/// GI 2 and 9 only (GI 10's are missing).
fn node(root: &Path) -> MigPlugins {
    let gi_dir = |gi: u32| root.join(format!("proc/driver/nvidia/capabilities/gpu4/mig/gi{gi}"));
    for (gi, minor) in [(2u32, 561u32), (9, 624)] {
        std::fs::create_dir_all(gi_dir(gi).join("ci0")).unwrap();
        std::fs::write(
            gi_dir(gi).join("access"),
            format!("DeviceFileMinor: {minor}\n"),
        )
        .unwrap();
        std::fs::write(
            gi_dir(gi).join("ci0/access"),
            format!("DeviceFileMinor: {}\n", minor + 1),
        )
        .unwrap();
    }
    let gpus = [gpu(0, 4), gpu(1, 5)];
    let states = [
        MigGpu {
            enabled: true,
            pending_change: false,
            devices: vec![
                mig("MIG-a", "3g.40gb", 2),
                mig("MIG-b", "1g.10gb", 9),
                mig("MIG-c", "1g.10gb", 10),
            ],
        },
        MigGpu::default(),
    ];
    MigPlugins::new(
        "nvidia.com/mig-",
        &gpus,
        &states,
        MigContext {
            host_root: root.to_path_buf(),
            vdriver_dir: "/v".into(),
            extra_devices: vec![],
        },
    )
}

fn ids(p: &MigPlugin) -> Vec<(String, String)> {
    p.list
        .snapshot()
        .into_iter()
        .map(|d| (d.id, d.health))
        .collect()
}

#[test]
fn one_plugin_per_profile() {
    let tmp = tempfile::tempdir().unwrap();
    let m = node(tmp.path());
    let names: Vec<_> = m.resources();
    assert_eq!(names, ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]);
    let small = &m.plugin("nvidia.com/mig-1g.10gb").unwrap();
    assert_eq!(
        ids(small),
        [
            ("MIG-b".to_string(), "Healthy".to_string()),
            ("MIG-c".to_string(), "Healthy".to_string())
        ]
    );
    assert_eq!(
        mig_resource_name("tencent.com/mig-", "1g.10gb+me"),
        "tencent.com/mig-1g.10gb.me"
    );
    // An Xid on GPU 0 and its quiet period; GPU 1 has no MIG device.
    m.set_gpu_health(0, false);
    assert!(ids(small).iter().all(|(_, h)| h == "Unhealthy"));
    m.set_gpu_health(1, true);
    assert!(ids(small).iter().all(|(_, h)| h == "Unhealthy"));
    m.set_gpu_health(0, true);
    assert!(
        ids(&m.plugin("nvidia.com/mig-3g.40gb").unwrap())
            .iter()
            .all(|(_, h)| h == "Healthy")
    );
    // An Xid inside GI 9 (MIG-b): that device alone, and it stays out
    // while its own quiet period runs whatever the GPU's does.
    let out = |m: &MigPlugins| -> Vec<String> {
        m.resources()
            .iter()
            .flat_map(|r| ids(&m.plugin(r).unwrap()))
            .filter(|(_, h)| h == "Unhealthy")
            .map(|(id, _)| id)
            .collect()
    };
    m.set_instance_health(0, 9, false);
    assert_eq!(out(&m), ["MIG-b"]);
    m.set_gpu_health(0, false);
    assert_eq!(out(&m).len(), 3);
    m.set_gpu_health(0, true);
    assert_eq!(out(&m), ["MIG-b"]);
    m.set_instance_health(0, 9, true);
    assert!(out(&m).is_empty());
}

fn request(ids: &[&str]) -> AllocateRequest {
    AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: ids.iter().map(|s| s.to_string()).collect(),
        }],
    }
}

#[tokio::test]
async fn allocate_gives_the_instance_and_the_untouched_driver() {
    let tmp = tempfile::tempdir().unwrap();
    let m = node(tmp.path());
    let big = &m.plugin("nvidia.com/mig-3g.40gb").unwrap();
    let r = big.allocate(request(&["MIG-a"])).await.unwrap();
    let c = &r.container_responses[0];
    let nodes: Vec<_> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia4",
            "/dev/nvidia-caps/nvidia-cap561",
            "/dev/nvidia-caps/nvidia-cap562",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], "MIG-a");
    let mounts: Vec<_> = c.mounts.iter().map(|m| m.host_path.as_str()).collect();
    assert_eq!(mounts, ["/v/origin"]);

    let small = &m.plugin("nvidia.com/mig-1g.10gb").unwrap();
    let e = small.allocate(request(&["MIG-a"])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("no MIG device \"MIG-a\""),
        "{}",
        e.message()
    );
    // GI 10's files are gone (destroyed behind the manager's back).
    let e = small.allocate(request(&["MIG-c"])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("gi10/access"), "{}", e.message());
    let e = small.allocate(request(&[])).await.unwrap_err();
    assert!(
        e.message().contains("asks for no device"),
        "{}",
        e.message()
    );
}

#[test]
fn two_devices_in_one_container() {
    let tmp = tempfile::tempdir().unwrap();
    let gi_dir = tmp
        .path()
        .join("proc/driver/nvidia/capabilities/gpu4/mig/gi10");
    std::fs::create_dir_all(gi_dir.join("ci0")).unwrap();
    std::fs::write(gi_dir.join("access"), "DeviceFileMinor: 633\n").unwrap();
    std::fs::write(gi_dir.join("ci0/access"), "DeviceFileMinor: 634\n").unwrap();
    let m = node(tmp.path());
    let e = m
        .plugin("nvidia.com/mig-1g.10gb")
        .unwrap()
        .edits(&["MIG-b".into(), "MIG-c".into()])
        .unwrap();
    let nodes: Vec<_> = e.device_nodes().map(|d| d.path.as_str()).collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia4",
            "/dev/nvidia-caps/nvidia-cap624",
            "/dev/nvidia-caps/nvidia-cap625",
            "/dev/nvidia-caps/nvidia-cap633",
            "/dev/nvidia-caps/nvidia-cap634",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    let env: BTreeMap<_, _> = e.common.env.iter().cloned().collect();
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "MIG-b,MIG-c");
}

/// A rescan ([`MigPlugins::refresh`]): the 1g.10gb at GI 9 destroyed, one
/// made at GI 11 and a 2g.20gb made by an operator while the manager runs.
/// The 1g.10gb plugin advertises what is there (its Xid-out device still
/// out), the new profile gets a plugin of its own, and a profile whose
/// last instance went advertises nothing (its plugin stays). A device
/// destroyed meanwhile is listed Unhealthy until the kubelet says no pod
/// holds it.
#[tokio::test]
async fn a_rescan_follows_the_instances_made_and_destroyed_meanwhile() {
    let tmp = tempfile::tempdir().unwrap();
    let m = node(tmp.path());
    m.set_instance_health(0, 10, false);
    let gpus = [gpu(0, 4), gpu(1, 5)];
    let (kubelet, events) = (MemoryKubelet::default(), MemoryEvents::default());
    m.refresh(
        &gpus,
        &state(vec![
            mig("MIG-a", "3g.40gb", 2),
            mig("MIG-c", "1g.10gb", 10),
            mig("MIG-d", "1g.10gb", 11),
            mig("MIG-e", "2g.20gb", 5),
        ]),
    )
    .unwrap();
    assert_eq!(
        m.resources(),
        [
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/mig-2g.20gb",
            "nvidia.com/mig-3g.40gb"
        ]
    );
    let small = m.plugin("nvidia.com/mig-1g.10gb").unwrap();
    assert_eq!(
        ids(&small),
        [
            ("MIG-c".to_string(), "Unhealthy".to_string()),
            ("MIG-d".to_string(), "Healthy".to_string()),
            ("MIG-b".to_string(), "Unhealthy".to_string())
        ]
    );
    let e = small.edits(&["MIG-b".into()]).unwrap_err().to_string();
    assert_eq!(
        e,
        "nvidia.com/mig-1g.10gb: MIG device MIG-b's instance was destroyed"
    );
    assert!(m.has_lost());
    m.settle_lost(&kubelet, &[], &events).await;
    assert!(!m.has_lost() && events.posted().is_empty());
    assert!(matches!(
        small.edits(&["MIG-b".into()]),
        Err(MigRefusal::Unknown { .. })
    ));
    assert_eq!(ids(&small).len(), 2);
    assert_eq!(
        ids(&m.plugin("nvidia.com/mig-2g.20gb").unwrap()),
        [("MIG-e".to_string(), "Healthy".to_string())]
    );
    m.refresh(&gpus, &state(vec![mig("MIG-e", "2g.20gb", 5)]))
        .unwrap();
    m.settle_lost(&kubelet, &[], &events).await;
    assert!(m.plugin("nvidia.com/mig-3g.40gb").unwrap().is_empty());
    assert!(ids(&small).is_empty());
}

fn state(devices: Vec<MigDevice>) -> [MigGpu; 2] {
    [
        MigGpu {
            enabled: true,
            pending_change: false,
            devices,
        },
        MigGpu::default(),
    ]
}

/// Every Event posted (no repeat suppression: the tests count the posts).
#[derive(Default)]
struct AllEvents(std::sync::Mutex<Vec<node_agent::events::PodEvent>>);

impl node_agent::events::EventSink for AllEvents {
    fn post(&self, ev: node_agent::events::PodEvent) {
        self.0.lock().unwrap().push(ev);
    }
}

impl AllEvents {
    fn posted(&self) -> Vec<node_agent::events::PodEvent> {
        self.0.lock().unwrap().clone()
    }
}

/// A destroyed instance under a pod: listed Unhealthy, the pod told once
/// (by name and UID), kept while the kubelet is unreachable or the pod
/// holds it, withdrawn once it does not; an instance that comes back is
/// served again.
#[tokio::test]
async fn a_device_destroyed_under_a_pod_stays_unhealthy_and_the_pod_is_told() {
    let tmp = tempfile::tempdir().unwrap();
    let m = node(tmp.path());
    let gpus = [gpu(0, 4), gpu(1, 5)];
    let (kubelet, events) = (MemoryKubelet::default(), AllEvents::default());
    let resource = "nvidia.com/mig-1g.10gb";
    let holder = PodKey::Name {
        namespace: "ns".into(),
        name: "infer".into(),
    };
    kubelet.record(holder.clone(), "main", resource, &["MIG-b".into()]);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "ns", "name": "infer", "uid": "u-infer"}
    }))
    .unwrap();
    let pods = [Arc::new(pod)];
    let without_b = || {
        state(vec![
            mig("MIG-a", "3g.40gb", 2),
            mig("MIG-c", "1g.10gb", 10),
        ])
    };
    m.refresh(&gpus, &without_b()).unwrap();
    let small = m.plugin(resource).unwrap();
    let b = ("MIG-b".to_string(), "Unhealthy".to_string());
    assert!(ids(&small).contains(&b), "{:?}", ids(&small));

    kubelet.set_unreachable("pod-resources: connection refused");
    m.settle_lost(&kubelet, &pods, &events).await;
    assert!(ids(&small).contains(&b) && events.posted().is_empty());

    kubelet.record(holder, "main", resource, &["MIG-b".into()]);
    for _ in 0..2 {
        m.refresh(&gpus, &without_b()).unwrap();
        m.settle_lost(&kubelet, &pods, &events).await;
    }
    let told = events.posted();
    assert_eq!(told.len(), 1, "once: {told:?}");
    let ev = &told[0];
    assert_eq!(
        (
            ev.namespace.as_str(),
            ev.name.as_str(),
            ev.uid.as_str(),
            ev.reason
        ),
        (
            "ns",
            "infer",
            "u-infer",
            node_agent::events::MIG_DEVICE_LOST
        )
    );
    assert!(
        ev.note.contains("MIG-b") && ev.note.contains("destroyed"),
        "{}",
        ev.note
    );
    assert!(ids(&small).contains(&b));
    let shown = m.lost_views();
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(
        (
            shown[0].gpu,
            shown[0].uuid.as_str(),
            shown[0].holder.as_str()
        ),
        (0, "MIG-b", resource)
    );

    // The instance is made again with the same UUID: served, healthy.
    m.refresh(
        &gpus,
        &state(vec![
            mig("MIG-c", "1g.10gb", 10),
            mig("MIG-b", "1g.10gb", 9),
        ]),
    )
    .unwrap();
    assert!(ids(&small).contains(&("MIG-b".to_string(), "Healthy".to_string())));
    assert!(!m.lost_views().iter().any(|l| l.uuid == "MIG-b"));
    // Gone again under the pod: told again.
    m.refresh(&gpus, &without_b()).unwrap();
    m.settle_lost(&kubelet, &pods, &events).await;
    assert_eq!(events.posted().len(), 2);
    // The pod gone: withdrawn at the next settle.
    let empty = MemoryKubelet::default();
    m.settle_lost(&empty, &pods, &events).await;
    assert!(!ids(&small).iter().any(|(id, _)| id == "MIG-b"));
    assert_eq!(events.posted().len(), 2);
}

/// A manager started after instances were destroyed while none ran
/// ([`MigPlugins::with_record`]): what its predecessor recorded and NVML
/// no longer has is listed lost, Unhealthy (a profile with nothing left
/// gets a plugin for it), so the pods holding it can be told; a device of
/// a GPU no longer on the node is dropped; the record then follows what is
/// listed, and a lost device withdrawn leaves it.
#[tokio::test]
async fn a_manager_started_after_a_destruction_lists_the_device_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("state");
    std::fs::create_dir(&state_dir).unwrap();
    let gpus = [gpu(0, 4), gpu(1, 5)];
    drop(node(tmp.path()).with_record(&state_dir, &gpus));
    let mut rec = record::load(&state_dir);
    let uuids = |r: &[record::RecordedDevice]| {
        let mut u: Vec<String> = r.iter().map(|d| d.device.uuid.clone()).collect();
        u.sort();
        u
    };
    assert_eq!(uuids(&rec), ["MIG-a", "MIG-b", "MIG-c"]);
    let mut elsewhere = rec[0].clone();
    elsewhere.gpu = "GPU-9".into();
    elsewhere.device.uuid = "MIG-z".into();
    rec.push(elsewhere);
    record::store(&state_dir, rec).unwrap();

    // Meanwhile the 3g.40gb and one 1g.10gb were destroyed.
    let next = MigPlugins::new(
        "nvidia.com/mig-",
        &gpus,
        &state(vec![mig("MIG-c", "1g.10gb", 10)]),
        MigContext {
            host_root: tmp.path().to_path_buf(),
            vdriver_dir: "/v".into(),
            extra_devices: vec![],
        },
    )
    .with_record(&state_dir, &gpus);
    assert_eq!(
        next.resources(),
        ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]
    );
    let small = next.plugin("nvidia.com/mig-1g.10gb").unwrap();
    assert_eq!(
        ids(&small),
        [
            ("MIG-c".to_string(), "Healthy".to_string()),
            ("MIG-b".to_string(), "Unhealthy".to_string())
        ]
    );
    assert_eq!(
        ids(&next.plugin("nvidia.com/mig-3g.40gb").unwrap()),
        [("MIG-a".to_string(), "Unhealthy".to_string())]
    );
    assert!(matches!(
        small.edits(&["MIG-b".into()]),
        Err(MigRefusal::Lost { .. })
    ));
    let lost: Vec<_> = next
        .lost_views()
        .into_iter()
        .map(|v| (v.uuid, v.gpu))
        .collect();
    assert_eq!(lost, [("MIG-b".to_string(), 0), ("MIG-a".to_string(), 0)]);
    assert_eq!(
        uuids(&record::load(&state_dir)),
        ["MIG-a", "MIG-b", "MIG-c"]
    );

    // At start a pod holds the 1g.10gb: it stays, Unhealthy, and the pod
    // is told; the 3g.40gb nobody holds is withdrawn, and the plugin made
    // for it alone dropped before anything is served.
    let (kubelet, events) = (MemoryKubelet::default(), AllEvents::default());
    let holder = PodKey::Name {
        namespace: "ns".into(),
        name: "infer".into(),
    };
    let resource = "nvidia.com/mig-1g.10gb";
    kubelet.record(holder.clone(), "main", resource, &["MIG-b".into()]);
    next.settle_recorded(&kubelet, &[], &events).await;
    assert_eq!(next.resources(), [resource]);
    assert_eq!(ids(&small).len(), 2);
    assert_eq!(events.posted().len(), 1);
    assert_eq!(uuids(&record::load(&state_dir)), ["MIG-b", "MIG-c"]);

    // No pod holds it any more: withdrawn, and out of the record.
    let nobody = MemoryKubelet::default();
    next.settle_lost(&nobody, &[], &events).await;
    assert!(!next.has_lost());
    assert_eq!(uuids(&record::load(&state_dir)), ["MIG-c"]);
}
