//! How close the compute quota holds a container that launches CUDA graphs
//! to its share, on a simulated A100 (config/nodes/sim-1gpu.toml): a hard
//! 30% container runs `tests/c/shim_graph.c loop`, a captured graph launched
//! back to back (a stream sync every 2 launches); what it achieved is read
//! from the sim's kernel timeline over a 10 s window after a 3 s warm-up.
//!
//! * a graph of 10 kernels of 86,400 blocks (1 ms each: 10 ms a launch);
//! * a graph of 20 kernels of 4,096 blocks of 256 threads (an 8192²
//!   matmul's 128x128 tiles: 5 waves, 50 us each on the sim: 1 ms a launch);
//! * for comparison, the same container launching 1 ms kernels directly
//!   (`shim_compute saturate`).
//!
//! Each graph launch is charged the cost of its kernel nodes (the exec's
//! cost is computed at instantiation); a flat per-launch cost would let the
//! 10 ms graph run far above its share.
//! A benchmark, never a test: it prints and asserts nothing. About 50 s.
//! `cargo build --release --workspace && cargo bench -p cuda-shim --bench graph_accuracy`
//! (gpu-sim falls back to target/debug).

use simnode::ShimNode;
use std::path::{Path, PathBuf};
use test_support::shim::{report, simnode, workload};

const WARMUP_S: f64 = 3.0;
const WINDOW_S: f64 = 10.0;
const LIMIT: i32 = 30;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn node() -> ShimNode {
    ShimNode::install(
        &workspace(),
        &test_support::artifact("gpu-sim"),
        &test_support::target_dir().join("libvcuda.so"),
        "sim-1gpu",
    )
}

fn main() {
    println!(
        "compute quota accuracy with CUDA graphs on the sim (hard {LIMIT}%; {WARMUP_S} s warm-up, {WINDOW_S} s window, timeline ground truth)"
    );
    println!(
        "{:<44} {:>8} {:>9} {:>8} {:>6}",
        "case", "quota", "achieved", "error", "±2"
    );
    let mut md = report::Markdown::new(&["case (sim A100)", "quota", "achieved", "error"]);
    let mut row = |case: &str, got: f64| {
        let err = got - LIMIT as f64;
        println!(
            "{case:<44} {LIMIT:>7}% {got:>8.1}% {err:>+8.1} {:>6}",
            if err.abs() <= 2.0 { "ok" } else { "MISS" }
        );
        md.row(vec![
            case.to_string(),
            format!("hard {LIMIT} %"),
            format!("{got:.1} %"),
            format!("{err:+.1}"),
        ]);
    };
    let cases: [(&str, &str, &[&str]); 3] = [
        (
            "graph: 10 x 1 ms kernels (86,400 blocks)",
            "shim_graph.c",
            &["loop", "{secs}", "86400", "10"],
        ),
        (
            "graph: 20 x 8192² matmul tiles (4,096 blocks)",
            "shim_graph.c",
            &["loop", "{secs}", "4096", "20"],
        ),
        (
            "direct launches: 1 ms kernels",
            "shim_compute.c",
            &["saturate", "{secs}"],
        ),
    ];
    for (case, src, args) in cases {
        let n = node();
        let prog = n.compile_c(&workspace().join("tests/c").join(src));
        let c = n.container(LIMIT, true, 0);
        let got = workload::measure(&n, &[&c], &prog, args, (WARMUP_S, WINDOW_S))[0];
        row(case, got);
    }
    md.print(
        "cargo bench -p cuda-shim --bench graph_accuracy",
        &format!("simulated A100 node (sim-1gpu), {WARMUP_S} s warm-up, {WINDOW_S} s window, ground truth from the sim's timeline"),
    );
}
