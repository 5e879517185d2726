//! How close the compute quota holds a container to its share, on a
//! simulated A100 (config/nodes/sim-1gpu.toml): saturating workloads
//! (tests/c/shim_compute.c: 1 ms kernels, a stream sync every 4 launches)
//! run under the interposer; what they achieved is read from the sim's
//! kernel timeline over 10 s windows after a 3 s warm-up (the ground truth,
//! not the NVML samples the controller steers by).
//!
//! * a hard limit L in {10, 30, 50, 70, 90}, alone: achieved vs L;
//! * two containers at 30 and 70, both saturating, on one GPU;
//! * a hard 30 whose workload mixes two shapes (`shim_compute mixed`: each
//!   1 ms kernel followed by five 0.1 ms kernels with half the threads per
//!   unit of time);
//! * a hard 30 whose workload mixes kernel sizes as real programs do
//!   (`shim_compute blockmix`: 10,000-block kernels and 1-block ones);
//! * a soft limit (30, may burst to 100) alone: how far above 30.
//!
//! Launch cost: `cargo bench -p cuda-shim --bench overhead`.
//! A benchmark, never a test: it prints and asserts nothing. About 2.5 min.
//! Ends with the results as markdown rows (cuda-shim/README.md's figures).
//! `cargo build --release --workspace && cargo bench -p cuda-shim --bench compute_accuracy`
//! (gpu-sim falls back to target/debug).

use simnode::{Container, ShimNode};
use std::path::{Path, PathBuf};
use test_support::shim::{report, simnode, workload};

const WARMUP_S: f64 = 3.0;
const WINDOW_S: f64 = 10.0;
const LIMITS: [i32; 5] = [10, 30, 50, 70, 90];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn node() -> (ShimNode, PathBuf) {
    let n = ShimNode::install(
        &workspace(),
        &test_support::artifact("gpu-sim"),
        &test_support::target_dir().join("libvcuda.so"),
        "sim-1gpu",
    );
    let prog = n.compile_c(&workspace().join("tests/c/shim_compute.c"));
    (n, prog)
}

/// Achieved percent of each workload (`shim_compute <mode>`) over the same
/// 10 s window.
fn measure(n: &ShimNode, c: &[&Container], prog: &Path, mode: &str) -> Vec<f64> {
    workload::measure(n, c, prog, &[mode, "{secs}"], (WARMUP_S, WINDOW_S))
}

fn main() {
    println!(
        "compute quota accuracy on the sim ({WARMUP_S} s warm-up, {WINDOW_S} s windows, timeline ground truth)"
    );
    println!(
        "{:<34} {:>8} {:>9} {:>8} {:>6}",
        "case", "quota", "achieved", "error", "±2"
    );
    let md = std::cell::RefCell::new(report::Markdown::new(&[
        "case (sim A100)",
        "quota",
        "achieved",
        "error",
    ]));
    let row = |case: &str, quota: f64, got: f64| {
        let err = got - quota;
        println!(
            "{case:<34} {quota:>7.0}% {got:>8.1}% {err:>+8.1} {:>6}",
            if err.abs() <= 2.0 { "ok" } else { "MISS" }
        );
        md.borrow_mut().row(vec![
            case.to_string(),
            format!("{quota:.0} %"),
            format!("{got:.1} %"),
            format!("{err:+.1}"),
        ]);
    };
    for l in LIMITS {
        let (n, prog) = node();
        let c = n.container(l, true, 0);
        let got = measure(&n, &[&c], &prog, "saturate")[0];
        row(&format!("hard {l}, alone"), l as f64, got);
    }
    {
        let (n, prog) = node();
        let a = n.container(30, true, 0);
        let b = n.container(70, true, 0);
        let got = measure(&n, &[&a, &b], &prog, "saturate");
        row("hard 30 + hard 70, together: 30", 30.0, got[0]);
        row("hard 30 + hard 70, together: 70", 70.0, got[1]);
        println!(
            "{:<34} {:>8} {:>8.1}%",
            "  (device total)",
            "",
            got[0] + got[1]
        );
    }
    {
        let (n, prog) = node();
        let c = n.container(30, true, 0);
        let got = measure(&n, &[&c], &prog, "mixed")[0];
        row("hard 30, mixed 1 ms + 5 x 0.1 ms", 30.0, got);
    }
    {
        let (n, prog) = node();
        let c = n.container(30, true, 0);
        let got = measure(&n, &[&c], &prog, "blockmix")[0];
        row("hard 30, 10,000-block + 4 x 1-block", 30.0, got);
    }
    {
        let (n, prog) = node();
        let c = n.container(30, false, 100);
        let got = measure(&n, &[&c], &prog, "saturate")[0];
        println!(
            "{:<34} {:>7.0}% {got:>8.1}% {:>+8.1} {:>6}",
            "soft 30 (limit 100), alone",
            30.0,
            got - 30.0,
            if got > 30.0 { "burst" } else { "NO" }
        );
        md.borrow_mut().row(vec![
            "soft 30 (limit 100), alone: bursts".into(),
            "30 %".into(),
            format!("{got:.1} %"),
            format!("{:+.1}", got - 30.0),
        ]);
    }
    md.borrow().print(
        "cargo bench -p cuda-shim --bench compute_accuracy",
        &format!("simulated A100 node (sim-1gpu), {WARMUP_S} s warm-up, {WINDOW_S} s windows, ground truth from the sim's timeline"),
    );
}
