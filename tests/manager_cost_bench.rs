//! Benchmark harness (prints figures, asserts nothing about time): what
//! the device-plugin daemon costs a node. RSS and CPU of the supervisor
//! and the manager it runs, idle, then with 40 shares admitted through the
//! kubelet emulator and one process registered on each (4 registrations
//! per process, the most one may hold), each phase `VCUDA_COST_SECS` long
//! (60 by default). Run with
//! `cargo build --workspace && cargo bench --profile dev -p vcuda-tests --bench manager_cost_bench`,
//! or `--profile release` (after `cargo build --release --workspace`) for
//! the shipped build's figures.

use std::time::{Duration, Instant};

use test_support::hostile::{self, children_of, rss_kib};
use test_support::manager::{Env, Options};

const SHARES: usize = 40;

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: state is the 3rd
    // field overall, utime the 14th and stime the 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    n(11) + n(12)
}

fn tree(supervisor: i32) -> Vec<i32> {
    let mut v = vec![supervisor];
    v.extend(children_of(supervisor));
    v
}

/// Measures the tree for `secs`; prints RSS per process and CPU in percent
/// of one core.
async fn measure(what: &str, supervisor: i32, secs: u64) {
    let pids = tree(supervisor);
    let t0: u64 = pids.iter().map(|&p| cpu_ticks(p)).sum();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let ticks = pids.iter().map(|&p| cpu_ticks(p)).sum::<u64>() - t0;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let cpu = ticks as f64 / hz / start.elapsed().as_secs_f64() * 100.0;
    let rss: Vec<String> = pids
        .iter()
        .map(|&p| format!("{} KiB", rss_kib(p)))
        .collect();
    println!(
        "gpu-manager {what} {secs} s: RSS supervisor + manager {}, CPU {cpu:.2} % of a core",
        rss.join(" + ")
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let secs: u64 = std::env::var("VCUDA_COST_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let mut env = Env::start("sim-8gpu-nvlink", Options::default()).await;
    let supervisor = env.manager.id() as i32;
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
