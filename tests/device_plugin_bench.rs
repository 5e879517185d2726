//! Benchmark harness (prints figures, asserts nothing about time): how fast
//! the device-plugin runtime reacts, against the kubelet emulator over real
//! unix sockets, each figure beside a baseline taken in the same run:
//!
//! * a health change reaching kubelet's view (ListAndWatch), against one
//!   plugin RPC round trip on the same socket;
//! * re-registration after a kubelet restart, against the restart itself;
//! * registration once a late kubelet appears (after failed attempts grew the
//!   backoff), against registration with kubelet already there.
//!
//! `tests/device_plugin.rs` checks that each of these happens at all.
//! Run with `cargo bench --profile dev -p vcuda-tests --bench device_plugin_bench`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use device_plugin::api::device_plugin_client::DevicePluginClient;
use device_plugin::{CancellationToken, PluginRuntime, RuntimeHandle, connect_unix};
use kubelet_emulator::demo::DemoPlugin;
use kubelet_emulator::{KubeletEmulator, View};
use test_support::{kubelet_with_plugin, options_rpc_floor};

const VCORE: &str = "tencent.com/vcuda-core";
const VMEM: &str = "tencent.com/vcuda-memory";
const WAIT: Duration = Duration::from_secs(10);

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn summary(v: &mut [Duration]) -> String {
    format!("n={} p50 {:?} p99 {:?}", v.len(), pct(v, 0.5), pct(v, 0.99))
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

fn registered(v: &View, res: &str, registrations: u64) -> bool {
    v.resources
        .get(res)
        .is_some_and(|r| r.connected && r.registrations == registrations)
}

struct Node {
    _tmp: tempfile::TempDir,
    emu: KubeletEmulator,
    cancel: CancellationToken,
    handle: RuntimeHandle,
    vcore: Arc<DemoPlugin>,
    /// Runtime start to both plugins registered and listed.
    registered_in: Duration,
}

async fn start_node() -> Node {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let emu = KubeletEmulator::start(&dir, tmp.path().join("pod-resources/kubelet.sock"))
        .await
        .unwrap();
    let vcore = Arc::new(DemoPlugin::new("vcore", 200));
    let vmem = Arc::new(DemoPlugin::new("vmem", 64));
    let cancel = CancellationToken::new();
    let t = Instant::now();
    let handle = PluginRuntime::new(&dir)
        .plugin(VCORE, "vcore.sock", vcore.clone())
        .plugin(VMEM, "vmemory.sock", vmem)
        .start(cancel.clone())
        .unwrap();
    emu.wait_for(WAIT, |v| registered(v, VCORE, 1) && registered(v, VMEM, 1))
        .await
        .expect("both plugins registered");
    Node {
        _tmp: tmp,
        emu,
        cancel,
        handle,
        vcore,
        registered_in: t.elapsed(),
    }
}

impl Node {
    async fn shutdown(self) {
        self.cancel.cancel();
        self.handle.wait().await.unwrap();
        self.emu.stop().await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let node = start_node().await;

    // Baseline: one RPC that does nothing, on the plugin's socket.
    let mut client = DevicePluginClient::new(
        connect_unix(node.emu.dir().join("vcore.sock"), WAIT)
            .await
            .unwrap(),
    );
    let mut floor = options_rpc_floor(&mut client, 100).await;
    println!(
        "baseline: GetDevicePluginOptions RPC on vcore.sock {}",
        summary(&mut floor)
    );

    // A health flip, until kubelet's view shows it.
    let (mut down, mut up) = (Vec::new(), Vec::new());
    for k in 0..50 {
        let id = format!("vcore-{}", k % 200);
        let t = Instant::now();
        assert!(node.vcore.devices.set_health(&id, false));
        node.emu
            .wait_for(WAIT, |v| !v.resources[VCORE].devices[&id].healthy)
            .await
            .unwrap();
        down.push(t.elapsed());
        let t = Instant::now();
        node.vcore.devices.set_health(&id, true);
        node.emu
            .wait_for(WAIT, |v| v.resources[VCORE].devices[&id].healthy)
            .await
            .unwrap();
        up.push(t.elapsed());
    }
    let floor_p50 = pct(&mut floor, 0.5);
    let down_p50 = pct(&mut down, 0.5);
    println!(
        "health change -> kubelet view: unhealthy {}, healthy again {}; p50 {:.1}x the RPC baseline",
        summary(&mut down),
        summary(&mut up),
        ratio(down_p50, floor_p50)
    );

    // Kubelet restarts (stop, delete the sockets, start): until both plugins
    // registered with the new kubelet, against the restart itself.
    let (mut restarts, mut reregs) = (Vec::new(), Vec::new());
    for k in 0..5u64 {
        let t = Instant::now();
        node.emu.restart().await.unwrap();
        restarts.push(t.elapsed());
        node.emu
            .wait_for(WAIT, |v| {
                registered(v, VCORE, k + 2) && registered(v, VMEM, k + 2)
            })
            .await
            .expect("both plugins re-registered after kubelet restart");
        reregs.push(t.elapsed());
    }
    let first = node.registered_in;
    node.shutdown().await;
    let (restart_p50, rereg_p50) = (pct(&mut restarts, 0.5), pct(&mut reregs, 0.5));
    println!(
        "kubelet restart: the restart itself {}; both plugins re-registered {} after it began ({:?} after it ended, p50)",
        summary(&mut restarts),
        summary(&mut reregs),
        rereg_p50.saturating_sub(restart_p50)
    );

    // A kubelet that appears late, after failed attempts grew the backoff,
    // against registration with kubelet already there.
    let mut present = vec![first];
    for _ in 0..2 {
        let n = start_node().await;
        present.push(n.registered_in);
        n.shutdown().await;
    }
    let mut late = Vec::new();
    for _ in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("dp");
        std::fs::create_dir_all(&dir).unwrap();
        let cancel = CancellationToken::new();
        let handle = PluginRuntime::new(&dir)
            .plugin(
                "example.com/demo",
                "demo.sock",
                Arc::new(DemoPlugin::new("d", 3)),
            )
            .start(cancel.clone())
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await; // let the backoff grow
        let t = Instant::now();
        let emu =
            kubelet_with_plugin(&dir, tmp.path().join("pr.sock"), "example.com/demo", WAIT).await;
        late.push(t.elapsed());
        cancel.cancel();
        handle.wait().await.unwrap();
        emu.stop().await;
    }
    let (late_p50, present_p50) = (pct(&mut late, 0.5), pct(&mut present, 0.5));
    println!(
        "registration: kubelet there from the start {}; kubelet appearing after 700 ms of failed attempts {}; p50 {:.1}x",
        summary(&mut present),
        summary(&mut late),
        ratio(late_p50, present_p50)
    );
}
