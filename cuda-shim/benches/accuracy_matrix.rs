//! The compute accuracy matrix at bench precision: every case of
//! test-support's `shim::matrix` (hard limits {10, 30, 50, 70, 90} x five
//! kernel mixes timed by laws the interposer cannot see, alone; 30 + 70 and
//! 20 + 20 + 60 on one GPU) over 10 s windows after 4 s of warm-up, each
//! tenant against a ±0.5-point target. CI gates the same matrix at ±3
//! points over 5 s windows (`tests/shim_accuracy.rs`).
//!
//! A benchmark: prints and asserts nothing; ends with the markdown rows of
//! cuda-shim/README.md's figures. Two cases at a time (`VCUDA_ACCURACY_JOBS`),
//! about 3.5 min. `cargo build --release --workspace &&
//! cargo bench -p cuda-shim --bench accuracy_matrix` (gpu-sim falls back to
//! target/debug).

use std::path::Path;
use test_support::shim::{matrix, report};

const WARMUP_S: f64 = 4.0;
const WINDOW_S: f64 = 10.0;
const TARGET: f64 = 0.5;

fn main() {
    let jobs = std::env::var("VCUDA_ACCURACY_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(2);
    let setup = matrix::Setup {
        workspace: Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf(),
        gpu_sim: test_support::artifact("gpu-sim"),
        shim: test_support::target_dir().join("libvcuda.so"),
        warmup_s: WARMUP_S,
        window_s: WINDOW_S,
        jobs,
    };
    println!(
        "compute quota accuracy matrix on the sim: law-timed kernels, {WARMUP_S} s warm-up, \
         {WINDOW_S} s windows, timeline ground truth, {jobs} cases at a time"
    );
    let mut md = report::Markdown::new(&["case (sim A100)", "quota", "achieved", "error"]);
    let outcomes = matrix::run_all(&setup, &matrix::selected(matrix::cases()));
    let misses = matrix::print(&outcomes, TARGET);
    for o in &outcomes {
        for ((t, err), got) in o.errors().zip(&o.achieved) {
            md.row(vec![
                matrix::tenant_name(&o.case, t),
                format!("{} %", t.expected()),
                format!("{got:.1} %"),
                format!("{err:+.1}"),
            ]);
        }
        if o.achieved.len() > 1 {
            println!(
                "  ({}: device total {:.1} %)",
                o.case.name,
                o.achieved.iter().sum::<f64>()
            );
        }
    }
    println!("{} of the tenants outside ±{TARGET}", misses.len());
    md.print(
        "cargo bench -p cuda-shim --bench accuracy_matrix",
        &format!(
            "simulated A100 node ({}) with law-timed kernels and a real driver's NVML sampling, \
             {WARMUP_S} s warm-up, {WINDOW_S} s windows, {jobs} cases at a time, ground truth from the sim's timeline",
            matrix::NODE
        ),
    );
}
