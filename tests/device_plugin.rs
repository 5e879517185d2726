//! Device-plugin runtime against the kubelet emulator, over real unix
//! sockets in temp dirs: registration of two resources from one process,
//! health propagation, kubelet restart, allocation, and input validation.

use std::sync::Arc;
use std::time::Duration;

use device_plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreStartContainerRequest, PreferredAllocationRequest, device_plugin_client::DevicePluginClient,
};
use device_plugin::{CancellationToken, PluginRuntime, RuntimeHandle, connect_unix};
use kubelet_emulator::checkpoint::CheckpointData;
use kubelet_emulator::demo::DemoPlugin;
use kubelet_emulator::{KubeletEmulator, PodRef, View};
use test_support::kubelet_with_plugin;
use tonic::Code;
use vcuda_api::podresources::v1 as pr;

const VCORE: &str = "tencent.com/vcuda-core";
const VMEM: &str = "tencent.com/vcuda-memory";
const WAIT: Duration = Duration::from_secs(5);

struct Node {
    tmp: tempfile::TempDir,
    emu: KubeletEmulator,
    cancel: CancellationToken,
    handle: Option<RuntimeHandle>,
    vcore: Arc<DemoPlugin>,
    vmem: Arc<DemoPlugin>,
}

impl Node {
    fn dir(&self) -> std::path::PathBuf {
        self.tmp.path().join("device-plugins")
    }
    fn pod_resources(&self) -> std::path::PathBuf {
        self.tmp.path().join("pod-resources/kubelet.sock")
    }
    async fn plugin_client(&self, sock: &str) -> DevicePluginClient<tonic::transport::Channel> {
        DevicePluginClient::new(connect_unix(self.dir().join(sock), WAIT).await.unwrap())
    }
    async fn shutdown(mut self) {
        self.cancel.cancel();
        self.handle.take().unwrap().wait().await.unwrap();
        self.emu.stop().await;
    }
}

/// An emulated kubelet plus one process's runtime serving vcore (200 IDs) and
/// vmemory (64 IDs).
async fn node(vcore: DemoPlugin, vmem: DemoPlugin) -> Node {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let emu = KubeletEmulator::start(&dir, tmp.path().join("pod-resources/kubelet.sock"))
        .await
        .unwrap();
    let (vcore, vmem) = (Arc::new(vcore), Arc::new(vmem));
    let cancel = CancellationToken::new();
    let handle = PluginRuntime::new(&dir)
        .plugin(VCORE, "vcore.sock", vcore.clone())
        .plugin(VMEM, "vmemory.sock", vmem.clone())
        .start(cancel.clone())
        .unwrap();
    emu.wait_for(WAIT, |v| {
        connected(v, VCORE, vcore.devices.snapshot().len())
            && connected(v, VMEM, vmem.devices.snapshot().len())
    })
    .await
    .expect("both plugins registered and listed");
    Node {
        tmp,
        emu,
        cancel,
        handle: Some(handle),
        vcore,
        vmem,
    }
}

fn connected(v: &View, res: &str, n: usize) -> bool {
    v.resources
        .get(res)
        .is_some_and(|r| r.connected && r.devices.len() == n)
}

fn pod(uid: &str) -> PodRef {
    PodRef {
        uid: uid.into(),
        name: format!("{uid}-name"),
        namespace: "default".into(),
    }
}

fn default_node() -> (DemoPlugin, DemoPlugin) {
    (DemoPlugin::new("vcore", 200), DemoPlugin::new("vmem", 64))
}

async fn pod_resources_client(
    node: &Node,
) -> pr::pod_resources_lister_client::PodResourcesListerClient<tonic::transport::Channel> {
    pr::pod_resources_lister_client::PodResourcesListerClient::new(
        connect_unix(node.pod_resources(), WAIT).await.unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_resources_register_from_one_process() {
    let (a, b) = default_node();
    let node = node(a, b).await;
    let view = node.emu.view().borrow().clone();
    let core = &view.resources[VCORE];
    let mem = &view.resources[VMEM];
    assert_eq!(
        (core.endpoint.as_str(), core.devices.len()),
        ("vcore.sock", 200)
    );
    assert_eq!(
        (mem.endpoint.as_str(), mem.devices.len()),
        ("vmemory.sock", 64)
    );
    assert!(core.devices.contains_key("vcore-199") && mem.devices.contains_key("vmem-0"));
    assert!(core.options.pre_start_required && core.options.get_preferred_allocation_available);
    assert_eq!(core.registrations, 1);
    let st = node
        .handle
        .as_ref()
        .unwrap()
        .status(VCORE)
        .unwrap()
        .borrow()
        .clone();
    assert!(
        st.registered && st.registrations == 1 && st.last_error.is_none(),
        "{st:?}"
    );

    // pod-resources reports what kubelet knows as allocatable.
    let alloc = pod_resources_client(&node)
        .await
        .get_allocatable_resources(pr::AllocatableResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let n = |r: &str| {
        alloc
            .devices
            .iter()
            .filter(|d| d.resource_name == r)
            .count()
    };
    assert_eq!((n(VCORE), n(VMEM)), (200, 64));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_change_reaches_list_and_watch() {
    let (a, b) = default_node();
    let node = node(a, b).await;
    // Seen by kubelet within WAIT (how fast: device_plugin_bench).
    assert!(node.vcore.devices.set_health("vcore-42", false));
    node.emu
        .wait_for(WAIT, |v| !v.resources[VCORE].devices["vcore-42"].healthy)
        .await
        .expect("unhealthy device seen by kubelet");
    node.vcore.devices.set_health("vcore-42", true);
    node.emu
        .wait_for(WAIT, |v| v.resources[VCORE].devices["vcore-42"].healthy)
        .await
        .expect("healthy again seen by kubelet");

    // A count change (GPU lost) is streamed too.
    node.vmem
        .devices
        .replace(node.vmem.devices.snapshot()[..32].to_vec());
    let v = node
        .emu
        .wait_for(WAIT, |v| v.resources[VMEM].devices.len() == 32)
        .await
        .unwrap();
    assert_eq!(v.resources[VMEM].healthy_ids().len(), 32);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_reregisters_and_keeps_allocations() {
    let (a, b) = default_node();
    let node = node(a, b).await;
    let first = node
        .emu
        .admit(&pod("p1"), "main", &[(VCORE, 30), (VMEM, 8)])
        .await
        .unwrap();
    let p1_ids = first[VCORE].envs["DEMO_DEVICES"].clone();

    node.emu.restart().await.unwrap();
    // Plugins notice the deleted sockets by themselves, within WAIT (how
    // fast: device_plugin_bench).
    node.emu
        .wait_for(WAIT, |v| {
            [VCORE, VMEM]
                .iter()
                .all(|r| v.resources[*r].registrations == 2 && v.resources[*r].connected)
        })
        .await
        .expect("both plugins re-registered after kubelet restart");
    for res in [VCORE, VMEM] {
        // The kubelet counts a registration when the request arrives, the
        // plugin once the answer is back: wait for the plugin's side (a
        // soak under load once read it in between).
        let mut st = node.handle.as_ref().unwrap().status(res).unwrap();
        let done =
            tokio::time::timeout(WAIT, st.wait_for(|s| s.registered && s.registrations == 2));
        let ok = done.await.is_ok_and(|r| r.is_ok());
        let st = st.borrow().clone();
        assert!(ok, "{res}: not registered again: {st:?}");
        assert_eq!((st.registrations, st.binds), (2, 2), "{res}: {st:?}");
    }
    assert!(node.dir().join("vcore.sock").exists() && node.dir().join("vmemory.sock").exists());

    // Allocations survived through the checkpoint.
    let allocs = node.emu.allocations();
    assert_eq!(
        allocs.iter().filter(|e| e.pod_uid == "p1").count(),
        2,
        "{allocs:?}"
    );
    let list = pod_resources_client(&node)
        .await
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let p1 = list
        .pod_resources
        .iter()
        .find(|p| p.name == "p1-name")
        .expect("p1 listed after restart");
    assert_eq!(p1.containers[0].devices.len(), 2);

    // New allocations continue and never reuse p1's devices.
    let second = node
        .emu
        .admit(&pod("p2"), "main", &[(VCORE, 50)])
        .await
        .unwrap();
    let p2_ids = second[VCORE].envs["DEMO_DEVICES"].clone();
    assert_eq!(p2_ids.split(',').count(), 50);
    assert!(
        p2_ids
            .split(',')
            .all(|id| !p1_ids.split(',').any(|x| x == id)),
        "{p1_ids} vs {p2_ids}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_prestart_and_preferred_allocation() {
    let (mut core, mut mem) = default_node();
    core.prefer = vec!["vcore-7".into(), "vcore-3".into(), "vcore-150".into()];
    // vmemory offers no preference: kubelet then takes available IDs in order.
    mem.options.get_preferred_allocation_available = false;
    let node = node(core, mem).await;

    let resp = node
        .emu
        .admit(&pod("p1"), "train", &[(VCORE, 3), (VMEM, 2)])
        .await
        .unwrap();
    assert_eq!(
        resp[VCORE].envs["DEMO_DEVICES"],
        "vcore-7,vcore-3,vcore-150"
    );
    assert_eq!(
        resp[VCORE].annotations["demo/devices"],
        "vcore-7,vcore-3,vcore-150"
    );
    assert_eq!(resp[VCORE].devices[0].permissions, "rwm");
    assert!(resp[VCORE].mounts[0].read_only);
    assert_eq!(resp[VMEM].envs["DEMO_DEVICES"], "vmem-0,vmem-1");
    // PreStartContainer was called with exactly the allocated IDs.
    assert_eq!(
        *node.vcore.prestarted.lock().unwrap(),
        vec![vec!["vcore-7", "vcore-3", "vcore-150"]]
    );
    assert_eq!(
        *node.vmem.prestarted.lock().unwrap(),
        vec![vec!["vmem-0", "vmem-1"]]
    );

    // Preferred IDs already taken: the plugin's next choices (reverse order).
    let resp = node
        .emu
        .admit(&pod("p2"), "train", &[(VCORE, 2)])
        .await
        .unwrap();
    assert_eq!(resp[VCORE].envs["DEMO_DEVICES"], "vcore-99,vcore-98");

    // Admitting more than is free fails without leaking devices.
    let err = node
        .emu
        .admit(&pod("p3"), "c", &[(VMEM, 2), (VCORE, 500)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("500 devices requested"), "{err}");
    assert_eq!(
        node.emu
            .allocations()
            .iter()
            .filter(|e| e.pod_uid == "p3")
            .count(),
        0
    );

    // The checkpoint is kubelet's format and verifies.
    let cp = CheckpointData::load(&node.emu.checkpoint_path())
        .unwrap()
        .unwrap();
    assert_eq!(cp.pod_device_entries.len(), 3);
    assert_eq!(cp.registered_devices[VCORE].len(), 200);
    let e = cp
        .pod_device_entries
        .iter()
        .find(|e| e.pod_uid == "p1" && e.resource_name == VCORE)
        .unwrap();
    assert_eq!(e.device_ids[&-1], vec!["vcore-7", "vcore-3", "vcore-150"]);

    // pod-resources Get answers from the recorded allocations.
    let got = pod_resources_client(&node)
        .await
        .get(pr::GetPodResourcesRequest {
            pod_name: "p1-name".into(),
            pod_namespace: "default".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_resources
        .unwrap();
    assert_eq!(got.containers[0].name, "train");
    assert_eq!(got.containers[0].devices.len(), 2);

    // Releasing frees the IDs for the next pod.
    node.emu.release_pod("p1").unwrap();
    let resp = node
        .emu
        .admit(&pod("p4"), "c", &[(VCORE, 1)])
        .await
        .unwrap();
    assert_eq!(resp[VCORE].envs["DEMO_DEVICES"], "vcore-7");
    node.shutdown().await;
}

fn alloc(ids: &[&[&str]]) -> AllocateRequest {
    AllocateRequest {
        container_requests: ids
            .iter()
            .map(|c| ContainerAllocateRequest {
                devices_ids: c.iter().map(|s| s.to_string()).collect(),
            })
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_and_plugin_keeps_serving() {
    let node = node(DemoPlugin::new("vcore", 4), DemoPlugin::new("vmem", 2)).await;
    let mut c = node.plugin_client("vcore.sock").await;
    let expect = |r: Result<tonic::Response<_>, tonic::Status>, needles: &[&str]| {
        let s = r.map(|_: tonic::Response<_>| ()).unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        for n in needles {
            assert!(s.message().contains(n), "{:?} lacks {n:?}", s.message());
        }
        println!("rejected: {}", s.message());
    };
    expect(
        c.allocate(alloc(&[&["vcore-1", "bogus-9", "gpu-x"]]))
            .await
            .map(|_| tonic::Response::new(())),
        &[
            "container_requests[0].devices_ids",
            "\"bogus-9\"",
            "\"gpu-x\"",
        ],
    );
    expect(
        c.allocate(alloc(&[]))
            .await
            .map(|_| tonic::Response::new(())),
        &["container_requests is empty"],
    );
    expect(
        c.allocate(alloc(&[&["vcore-0"], &[]]))
            .await
            .map(|_| tonic::Response::new(())),
        &["container_requests[1].devices_ids is empty"],
    );
    expect(
        c.allocate(alloc(&[&[
            "vcore-0", "vcore-1", "vcore-2", "vcore-3", "vcore-0",
        ]]))
        .await
        .map(|_| tonic::Response::new(())),
        &["5 device IDs", "only 4 devices"],
    );
    let many: Vec<&[&str]> = vec![&["vcore-0"]; 65];
    expect(
        c.allocate(alloc(&many))
            .await
            .map(|_| tonic::Response::new(())),
        &["65 container requests"],
    );
    expect(
        c.pre_start_container(PreStartContainerRequest {
            devices_ids: vec!["nope".into()],
        })
        .await
        .map(|_| tonic::Response::new(())),
        &["devices_ids", "\"nope\""],
    );
    expect(
        c.get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["vcore-0".into(), "vcore-1".into()],
                must_include_device_i_ds: vec![],
                allocation_size: 3,
            }],
        })
        .await
        .map(|_| tonic::Response::new(())),
        &["allocation_size is 3"],
    );
    assert!(
        node.vcore.allocated.lock().unwrap().is_empty(),
        "plugin must not see invalid requests"
    );

    // Still serving: a valid Allocate, ListAndWatch and a kubelet admission work.
    let ok = c
        .allocate(alloc(&[&["vcore-2"]]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.container_responses[0].envs["DEMO_DEVICES"], "vcore-2");
    let first = c
        .list_and_watch(Empty {})
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.devices.len(), 4);
    node.emu
        .admit(&pod("p1"), "c", &[(VCORE, 1)])
        .await
        .unwrap();
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_retries_until_kubelet_appears() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("dp");
    std::fs::create_dir_all(&dir).unwrap();
    let plugin = Arc::new(DemoPlugin::new("d", 3));
    let cancel = CancellationToken::new();
    let handle = PluginRuntime::new(&dir)
        .plugin("example.com/demo", "demo.sock", plugin)
        .start(cancel.clone())
        .unwrap();
    let mut st = handle.status("example.com/demo").unwrap();
    let s = tokio::time::timeout(WAIT, st.wait_for(|s| s.last_error.is_some()))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert!(!s.registered);
    assert!(
        s.last_error.as_deref().unwrap().contains("kubelet.sock"),
        "{s:?}"
    );

    tokio::time::sleep(Duration::from_millis(700)).await; // let the backoff grow
    // How fast: device_plugin_bench.
    let emu = kubelet_with_plugin(&dir, tmp.path().join("pr.sock"), "example.com/demo", WAIT).await;

    // Graceful shutdown removes the plugin socket and ends the stream.
    cancel.cancel();
    handle.wait().await.unwrap();
    assert!(!dir.join("demo.sock").exists());
    emu.wait_for(WAIT, |v| !v.resources["example.com/demo"].connected)
        .await
        .unwrap();
    emu.stop().await;
}

/// Kubelet ≥ 1.26 (as the emulator behaves, after
/// `pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go`, `runClient`)
/// drops the newest registration of a resource when an older
/// registration's stream ends: a second process registered the same
/// resources, then the first stopped gracefully. The runtime sees its
/// stream closed by kubelet and registers again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_dropped_when_a_replaced_process_stops_is_made_again() {
    let (a, b) = default_node();
    let node = node(a, b).await;
    let newer = CancellationToken::new();
    let vcore2 = Arc::new(DemoPlugin::new("vcore", 200));
    let vmem2 = Arc::new(DemoPlugin::new("vmem", 64));
    let h2 = PluginRuntime::new(node.dir())
        .plugin(VCORE, "vcore-2.sock", vcore2)
        .plugin(VMEM, "vmemory-2.sock", vmem2)
        .start(newer.clone())
        .unwrap();
    node.emu
        .wait_for(WAIT, |v| v.resources[VCORE].endpoint == "vcore-2.sock")
        .await
        .expect("the second process registered");
    let regs = node.emu.view().borrow().resources[VCORE].registrations;
    let mut st = h2.status(VCORE).unwrap();
    // The first process stops: its streams end, the emulator drops the
    // second's registration, which comes back.
    node.cancel.cancel();
    let Node { handle, emu, .. } = node;
    handle.unwrap().wait().await.unwrap();
    emu.wait_for(WAIT, |v| {
        let r = &v.resources[VCORE];
        r.connected && r.endpoint == "vcore-2.sock" && r.registrations > regs
    })
    .await
    .expect("the second process registered again");
    tokio::time::timeout(WAIT, st.wait_for(|s| s.registered && s.registrations >= 2))
        .await
        .unwrap()
        .unwrap();
    newer.cancel();
    h2.wait().await.unwrap();
    emu.stop().await;
}
