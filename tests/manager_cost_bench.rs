//! Benchmark harness (prints figures, asserts nothing about time): what
//! the device-plugin daemon costs a node. RSS and CPU of the supervisor
//! and the manager it runs, idle, then with 40 shares admitted through the
//! kubelet emulator and one process registered on each (4 registrations
//! per process, the most one may hold), each phase `VCUDA_COST_SECS` long
//! (60 by default). Run with
//! `cargo build --workspace && cargo bench --profile dev -p vcuda-tests --bench manager_cost_bench`,
//! or `--profile release` (after `cargo build --release --workspace`) for
//! the shipped build's figures.

use std::time::Duration;

use test_support::hostile::{self, rss_kib};
use test_support::manager::{Env, Options};
use test_support::process::{CpuSample, tree};

const SHARES: usize = 40;

/// Measures the supervisor and the manager for `secs`; prints RSS per
/// process and CPU in percent of one core.
async fn measure(what: &str, supervisor: u32, secs: u64) {
    let sample = CpuSample::take(supervisor);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (cpu, restarted) = sample.percent_since(supervisor);
    let rss: Vec<String> = tree(supervisor)
        .iter()
        .map(|&p| format!("{} KiB", rss_kib(p as i32)))
        .collect();
    println!(
        "gpu-manager {what} {secs} s: RSS supervisor + manager {}, CPU {cpu:.2} % of a core{}",
        rss.join(" + "),
        if restarted {
            " (the manager restarted meanwhile: CPU not comparable)"
        } else {
            ""
        }
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let secs: u64 = std::env::var("VCUDA_COST_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let mut env = Env::start("sim-8gpu-nvlink", Options::default()).await;
    let supervisor = env.manager.id();
    tokio::time::sleep(Duration::from_secs(2)).await;
    measure("idle", supervisor, secs).await;

    let mut held = Vec::new();
    for _ in 0..SHARES {
        let pod = env.pod(&[("main", 10, 2)], &[]);
        env.admit(&pod, "main", 10, 2)
            .await
            .unwrap_or_else(|e| panic!("admitting share {}: {e}", held.len()));
        let dir = env.vm_dir().join(&pod.uid).join("main");
        let req = hostile::maximal_request(&pod.uid, "main");
        held.push(tokio::task::block_in_place(|| {
            hostile::hold_registrations(&dir, &req, 1)
        }));
    }
    measure(
        &format!("{SHARES} shares, a registered process each"),
        supervisor,
        secs,
    )
    .await;
    drop(held);
}
