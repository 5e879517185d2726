//! Benchmark harness (prints figures, asserts nothing): how evenly two
//! processes that saturate one simulated GPU (tests/c/sim_cuda.c
//! `saturate`: two 1 ms kernels, then a synchronize) share it, over the
//! middle second of each run. The sim queues kernels in submission order,
//! so the split follows how often the host scheduler lets each process
//! submit: about 50/50 on an idle machine, 34–42 % each at a load average
//! of 14 on 2 cores. `tests/sim_cuda/main.rs` checks what the model guarantees
//! (one timeline, each process charged exactly its own kernels).
//!
//! `cargo build --workspace && cargo bench --profile dev -p vcuda-tests --bench sim_share_bench`

use gpu_sim_core::state::now_ns;
use gpu_sim_core::{SharedState, SimRoot};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use test_support::{SimNode, compile_c};

const RUNS: usize = 5;

fn read_until(child: &mut Child, want: &str) {
    let mut r = BufReader::new(child.stdout.as_mut().unwrap());
    loop {
        let mut line = String::new();
        assert!(r.read_line(&mut line).unwrap() > 0, "EOF before {want:?}");
        if line.starts_with(want) {
            return;
        }
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().next().unwrap_or("?").to_string())
        .unwrap_or_default()
}

fn main() {
    let node = SimNode::install("sim-1gpu");
    let bin = tempfile::tempdir().unwrap();
    let prog = compile_c("sim_cuda", &node, bin.path());
    let spawn = || {
        Command::new(&prog)
            .args(["saturate", "1500"])
            .env("LD_LIBRARY_PATH", node.lib_dir())
            .env_remove("GPU_SIM_ROOT")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "two saturating processes on one sim GPU, middle second of {RUNS} runs ({cores} cores)"
    );
    println!(
        "{:>4} {:>10} {:>10} {:>10} {:>6}",
        "run", "process A", "process B", "device", "load"
    );
    for run in 0..RUNS {
        let (mut a, mut b) = (spawn(), spawn());
        read_until(&mut a, "ready");
        read_until(&mut b, "ready");
        let start = now_ns();
        read_until(&mut a, "done");
        read_until(&mut b, "done");
        let (from, to) = (start + 250_000_000, start + 1_250_000_000);
        let state = SharedState::open(&SimRoot::new(node.root())).unwrap();
        let per = state.process_utilization(0, from, to);
        let total = state.utilization(0, from, to);
        let share = |c: &Child| {
            per.iter()
                .find(|(p, _)| p.pid() == c.id())
                .map_or(0.0, |(_, u)| *u)
        };
        println!(
            "{run:>4} {:>9.1}% {:>9.1}% {total:>9.1}% {:>6}",
            share(&a),
            share(&b),
            load()
        );
        for mut c in [a, b] {
            c.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
            let _ = c.wait();
        }
    }
}
