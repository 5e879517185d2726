//! Load on a simulated node for tests/sim_nvml.rs: one process driving the
//! sim's shared state the way the simulated libcuda does (attach, allocate,
//! queue kernels), so the NVML checks do not depend on the CUDA library.
//!
//! Usage: `sim-nvml-load ROOT MODE`. Modes: `hold:GPU:BYTES` allocates and
//! idles; `saturate:GPU` keeps ~20 ms of 1 ms kernels queued; `half:GPU`
//! runs a 10 ms kernel at the start of every 20 ms period; `look:GPU` runs
//! one kernel, then prints how the sim names this GPU's processes to it:
//! `look listed=P,.. shown=P,..` (NVML's process lists; every process, as
//! utilization samples name them), and idles. Prints `ready host_pid=N`
//! once attached, then runs until its stdin closes.

use gpu_sim_core::state::now_ns;
use gpu_sim_core::{SharedState, SimRoot};
use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MS: u64 = 1_000_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, root, mode] = args.as_slice() else {
        eprintln!("usage: sim-nvml-load ROOT hold:GPU:BYTES|saturate:GPU|half:GPU|look:GPU");
        std::process::exit(2);
    };
    let parts: Vec<&str> = mode.split(':').collect();
    let gpu: usize = parts
        .get(1)
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("mode {mode:?}: no GPU index after the first ':'"));
    let state = SharedState::open(&SimRoot::new(root)).unwrap();
    let me = state.attach().unwrap();
    state.set_active(me, gpu);
    if parts[0] == "hold" {
        let bytes = parts.get(2).and_then(|b| b.parse().ok());
        let bytes = bytes.unwrap_or_else(|| panic!("mode {mode:?}: hold:GPU:BYTES"));
        state.try_alloc(me, gpu, bytes).unwrap();
    }
    println!("ready host_pid={}", own_host_pid());
    if parts[0] == "look" {
        state.launch(me, gpu, MS, 0);
        let join = |v: Vec<u32>| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let listed = state
            .listed_processes(gpu)
            .iter()
            .map(|p| p.pid())
            .collect();
        let shown = state.processes(gpu).iter().map(|p| p.pid()).collect();
        println!("look listed={} shown={}", join(listed), join(shown));
    }
    // Stop when the parent goes away.
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        s2.store(true, Ordering::SeqCst);
    });
    let t0 = now_ns();
    let mut period = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match parts[0] {
            "hold" | "look" => std::thread::sleep(Duration::from_millis(20)),
            "saturate" => {
                // 20 ms queued: a descheduled helper leaves no gap.
                let (_, end) = state.launch(me, gpu, MS, 0);
                sleep_until_mono(end.saturating_sub(20 * MS));
            }
            "half" => {
                // Anchored to absolute periods, so wake-up jitter does not
                // stretch the idle part.
                let start = t0 + period * 20 * MS;
                state.launch(me, gpu, 10 * MS, start);
                period += 1;
                sleep_until_mono(t0 + period * 20 * MS - 5 * MS);
            }
            other => panic!("unknown mode {other:?}: hold, saturate, half or look"),
        }
    }
}

/// PID of this process in the initial namespace, read from a /proc mounted
/// there: the first NSpid entry.
fn own_host_pid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(std::process::id)
}

fn sleep_until_mono(t: u64) {
    let now = now_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}
