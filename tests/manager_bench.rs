//! Benchmark harness (prints figures, asserts nothing about time): the
//! whole Allocate RPC through the emulators, manager start to registered,
//! resident memory of the idle daemon. Run with
//! `cargo build --workspace && cargo bench --profile dev -p vcuda-tests --bench manager_bench`
//! (the dev profile, so it drives the binaries `cargo build` made).

use std::time::{Duration, Instant};

use test_support::manager::{Env, Options, VCORE};
use test_support::options_rpc_floor;
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, device_plugin_client::DevicePluginClient,
};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// The manager's own figures from its "allocated" log lines (µs): the
/// whole Allocate handler and the wait for the checkpoint write.
fn logged_allocate_us(log: &str, field: &str) -> Vec<Duration> {
    let key = format!("{field}=");
    log.lines()
        .filter(|l| l.contains(" allocated"))
        .filter_map(|l| {
            l.split(key.as_str())
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map(Duration::from_micros)
        .collect()
}

fn ready_excluding_mirror(log: &str) -> Option<u64> {
    let line = log
        .lines()
        .find(|l| l.contains("ready_excluding_mirror_ms"))?;
    let v = line.split("ready_excluding_mirror_ms=").nth(1)?;
    v.split_whitespace().next()?.parse().ok()
}

/// Until the manager has removed the pod's vm directory (its watch saw the
/// deletion).
async fn wait_released(env: &Env, uid: &str) {
    let dir = env.vm_dir().join(uid);
    let t = Instant::now();
    while dir.exists() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // Start to registered.
    let mut starts = Vec::new();
    let mut internal = Vec::new();
    for _ in 0..3 {
        let env = Env::start("sim-8gpu-nvlink", Options::default()).await;
        starts.push(env.started.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
        internal.extend(ready_excluding_mirror(&env.log_text()));
    }
    println!("start -> registered (spawn to kubelet view, incl. mirror): {starts:?}");
    println!("start -> registered (manager's own clock, mirror excluded): {internal:?} ms");

    let mut env = Env::start("sim-8gpu-nvlink", Options::default()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    println!("idle RSS: {} KiB", env.rss_kib());

    // Whole Allocate RPC on the vcore socket (kubelet's view: one RPC), each with a
    // fresh pending pod; reusing the same IDs frees the previous holder, as
    // kubelet would only hand out free IDs.
    let sock = env.plugin_socket(VCORE);
    let ch = device_plugin::connect_unix(&sock, Duration::from_secs(2))
        .await
        .unwrap();
    let mut client = DevicePluginClient::new(ch);
    // The floor: an RPC that does nothing in the manager, same socket.
    let mut floor = options_rpc_floor(&mut client, 100).await;
    println!(
        "GetDevicePluginOptions RPC (floor, vcore socket) n={}: p50 {:?} p90 {:?} p99 {:?}",
        floor.len(),
        pct(&mut floor, 0.5),
        pct(&mut floor, 0.9),
        pct(&mut floor, 0.99)
    );
    let ids: Vec<String> = (0..10).map(|k| format!("vcore-0-{k:02}")).collect();
    let mut rpc = Vec::new();
    let mut last = None;
    for i in 0..300 {
        let pod = env.pod(&[("main", 10, 2)], &[]);
        // Let the reflector see the pod (Allocate would wait for it anyway;
        // that wait is API-server latency, not the manager's).
        while env.api.pod("default", &pod.name).is_none() {}
        tokio::time::sleep(Duration::from_millis(if i == 0 { 200 } else { 5 })).await;
        let t = Instant::now();
        client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: ids.clone(),
                }],
            })
            .await
            .unwrap();
        rpc.push(t.elapsed());
        env.api.delete_pod("default", &pod.name).unwrap();
        last = Some(pod);
    }
    println!(
        "Allocate RPC (share, vcore socket) n={}: p50 {:?} p90 {:?} p99 {:?} max {:?}",
        rpc.len(),
        pct(&mut rpc, 0.5),
        pct(&mut rpc, 0.9),
        pct(&mut rpc, 0.99),
        pct(&mut rpc, 1.0)
    );
    let log = env.log_text();
    for (what, field) in [
        ("handler", "took_us"),
        ("of which finding the pod (kubelet's List)", "found_us"),
        ("of which checkpoint write", "checkpoint_us"),
    ] {
        let mut v = logged_allocate_us(&log, field);
        if !v.is_empty() {
            println!(
                "  manager's clock, {what} n={}: p50 {:?} p90 {:?} p99 {:?} max {:?}",
                v.len(),
                pct(&mut v, 0.5),
                pct(&mut v, 0.9),
                pct(&mut v, 0.99),
                pct(&mut v, 1.0)
            );
        }
    }
    // The last pod released by the watch before admissions start: a pod
    // the reflector still lists as pending (its deletion not seen yet)
    // whose IDs kubelet hands out again would be taken for the next one.
    if let Some(p) = last {
        wait_released(&env, &p.uid).await;
    }

    // Whole admission through the kubelet emulator: Allocate + PreStart for
    // vcuda-core and vcuda-memory, pod-resources lookup included.
    let mut admit = Vec::new();
    for _ in 0..100 {
        let pod = env.pod(&[("main", 10, 2)], &[]);
        tokio::time::sleep(Duration::from_millis(5)).await;
        let t = Instant::now();
        env.admit(&pod, "main", 10, 2).await.unwrap();
        admit.push(t.elapsed());
        env.api.delete_pod("default", &pod.name).unwrap();
        env.kubelet.release_pod(&pod.uid).unwrap();
        wait_released(&env, &pod.uid).await;
    }
    println!(
        "kubelet admission (Allocate+PreStart x2) n={}: p50 {:?} p90 {:?} p99 {:?} max {:?}",
        admit.len(),
        pct(&mut admit, 0.5),
        pct(&mut admit, 0.9),
        pct(&mut admit, 0.99),
        pct(&mut admit, 1.0)
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!("RSS after the runs: {} KiB", env.rss_kib());
}
