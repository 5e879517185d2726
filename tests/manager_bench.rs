//! Benchmark harness (prints figures, asserts nothing about time): the
//! whole Allocate RPC through the emulators, manager start to registered,
//! resident memory of the idle daemon. Run with
//! `cargo build --workspace && cargo bench --profile dev -p vcuda-tests --bench manager_bench`
//! (the dev profile, so it drives the binaries `cargo build` made).

#[path = "manager_env.rs"]
mod manager_env;

use std::time::{Duration, Instant};

use manager_env::{Env, Options};
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, device_plugin_client::DevicePluginClient,
};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ready_excluding_mirror(log: &str) -> Option<u64> {
    let line = log
        .lines()
        .find(|l| l.contains("ready_excluding_mirror_ms"))?;
    let v = line.split("ready_excluding_mirror_ms=").nth(1)?;
    v.split_whitespace().next()?.parse().ok()
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

    // Whole Allocate RPC on vcore.sock (kubelet's view: one RPC), each with a
    // fresh pending pod; reusing the same IDs frees the previous holder, as
    // kubelet would only hand out free IDs.
    let sock = env.kubelet.dir().join("vcore.sock");
    let ch = device_plugin::connect_unix(&sock, Duration::from_secs(2))
        .await
        .unwrap();
    let mut client = DevicePluginClient::new(ch);
    let ids: Vec<String> = (0..10).map(|k| format!("vcore-0-{k:02}")).collect();
    let mut rpc = Vec::new();
    for i in 0..300 {
        let pod = env.pod(&[("main", 10, 2)], &[]);
        // Let the reflector see the pod (Allocate would wait for it anyway;
        // that wait is API-server latency, not the manager's).
        while !env.api.pod("default", &pod.name).is_some() {}
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
    }
    println!(
        "Allocate RPC (share, vcore.sock) n={}: p50 {:?} p90 {:?} p99 {:?} max {:?}",
        rpc.len(),
        pct(&mut rpc, 0.5),
        pct(&mut rpc, 0.9),
        pct(&mut rpc, 0.99),
        pct(&mut rpc, 1.0)
    );

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
