//! What the interposer costs, measured against calling the simulated driver
//! directly in the same run: the same C program (tests/c/shim_client.c,
//! `bench` mode) runs alternately on the sim's own driver directory and
//! under the interposer (a vdriver mirror of the sim: test-support's
//! `shim::simnode`)
//! in two enforced containers registered with a stand-in manager: memory
//! quota without a compute limit, and memory quota with a hard compute
//! quota. Prints medians over runs, the difference and the ratio, against
//! the budgets of issue 12 (`cuLaunchKernel`, median: at most 5 ns more
//! without a compute limit, 10 ns with one and tokens available). A benchmark, never a test: it
//! asserts nothing.
//!
//! Tokens available: each round is 2000 one-thread launches (20 ms of
//! device time on the sim, whose waves take 10 µs) followed by a 60 ms
//! sleep, so the container uses about 25 % of the GPU under its 50 % quota
//! and a round fits in the bucket's 50 ms burst; every configuration runs
//! the same pacing. The bench reads the container's bucket afterwards and
//! says whether any launch waited.
//!
//! Side by side with another build: `VCUDA_BENCH_BASELINE=<libvcuda.so>`
//! (`cuda-shim/benches/baseline.sh <ref>` builds one) adds its column, run
//! in the same rounds on a node of its own, and what this build adds over
//! it.
//!
//! `cargo build --release --workspace && cargo bench -p cuda-shim --bench overhead`
//! (gpu-sim and the sim's libraries fall back to target/debug).

use simnode::{Container, ShimNode};
use std::path::Path;
use test_support::shim::{report, simnode};
use vcuda::throttle::bucket::Bucket;

const RUNS: usize = 11;
const LAUNCHES_PER_ROUND: &str = "2000";
const SLEEP_MS: &str = "60";
/// The compute quota of the throttled container (hard).
const QUOTA: i32 = 50;

/// (cuInit, launch, alloc+free) in ns, from one run.
type Sample = (f64, f64, f64);
/// A table row: name, samples, the baseline build's (maybe none), field, budget.
type Row<'a> = (
    &'static str,
    &'a [Sample],
    &'a [Sample],
    fn(&Sample) -> f64,
    f64,
);

/// ns, or µs / ms where that reads better.
fn ns(v: f64) -> String {
    match v.abs() {
        x if x >= 1e6 => format!("{:.2} ms", v / 1e6),
        x if x >= 1e4 => format!("{:.1} µs", v / 1e3),
        _ => format!("{v:.1} ns"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(c: &Container, client: &Path) -> Sample {
    let out = c
        .command(client)
        .args(["bench", LAUNCHES_PER_ROUND, SLEEP_MS])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let get = |k: &str| -> f64 {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {s}"))
            .parse()
            .unwrap()
    };
    (get("init_ns"), get("launch_ns"), get("alloc_free_ns"))
}

fn main() {
    // Created first: its load average is the one at the start.
    let baseline = std::env::var_os("VCUDA_BENCH_BASELINE").map(std::path::PathBuf::from);
    let mut md = report::Markdown::new(&[
        "call (median)",
        "sim directly",
        "baseline build",
        "interposer",
        "added",
        "added over baseline",
        "budget",
    ]);
    // `cargo bench` passes --bench; nothing else is accepted.
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let n = ShimNode::install(
        workspace,
        &test_support::artifact("gpu-sim"),
        &test_support::target_dir().join("libvcuda.so"),
        "sim-1gpu",
    );
    let client = n.compile_c(&workspace.join("tests/c/shim_client.c"));
    let direct = n.direct();
    // Both enforce a 4 GiB memory quota; 100 %: no compute limit.
    let uncapped = n.container(100, true, 0);
    let capped = n.container(QUOTA, true, 0);
    let ledger = capped.manager.as_ref().unwrap().ledger();
    // SAFETY: the ledger stays mapped until `capped` is dropped, after use.
    let bucket = unsafe { Bucket::at(ledger.compute_words().as_ptr()) };

    // The baseline build on a node of its own (its own vdriver mirror).
    let base_node = baseline
        .as_ref()
        .map(|b| ShimNode::install(workspace, &test_support::artifact("gpu-sim"), b, "sim-1gpu"));
    let base = base_node
        .as_ref()
        .map(|n| (n.container(100, true, 0), n.container(QUOTA, true, 0)));
    let (mut d, mut u, mut q) = (Vec::new(), Vec::new(), Vec::new());
    let (mut bu, mut bq) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        d.push(run(&direct, &client));
        u.push(run(&uncapped, &client));
        q.push(run(&capped, &client));
        if let Some((bu_c, bq_c)) = &base {
            bu.push(run(bu_c, &client));
            bq.push(run(bq_c, &client));
        }
    }
    println!(
        "cuda-shim overhead vs the simulated driver, medians of {RUNS} runs (each: 31 rounds of {LAUNCHES_PER_ROUND} launches, {SLEEP_MS} ms apart)"
    );
    println!(
        "{:<56} {:>10} {:>10} {:>12} {:>10} {:>7} {:>10}",
        "", "direct", "baseline", "interposer", "added", "ratio", "budget"
    );
    // Budgets: issue 37's targets over the simulated driver.
    let rows: [Row; 5] = [
        ("cuInit, no compute limit", &u, &bu, |r| r.0, 300_000.0),
        (
            "cuInit, compute quota (loads the real NVML)",
            &q,
            &bq,
            |r| r.0,
            300_000.0,
        ),
        ("cuLaunchKernel, no compute limit", &u, &bu, |r| r.1, 2.0),
        (
            "cuLaunchKernel, compute quota active, tokens available",
            &q,
            &bq,
            |r| r.1,
            10.0,
        ),
        (
            "cuMemAlloc+cuMemFree (memory + compute quota)",
            &q,
            &bq,
            |r| r.2,
            200.0,
        ),
    ];
    let signed = |v: f64| format!("+{}", ns(v)).replace("+-", "−");
    for (name, shimmed, based, f, budget) in rows {
        let dm = median(d.iter().map(f).collect());
        let sm = median(shimmed.iter().map(f).collect());
        let bm = (!based.is_empty()).then(|| median(based.iter().map(f).collect()));
        let added = sm - dm;
        println!(
            "{name:<56} {dm:>8.1}ns {:>10} {sm:>10.1}ns {added:>8.1}ns {:>7.3} {budget:>8.0}ns {}",
            bm.map_or("-".into(), |b| format!("{b:.1}ns")),
            sm / dm,
            if added <= budget { "ok" } else { "OVER" }
        );
        md.row(vec![
            name.to_string(),
            ns(dm),
            bm.map_or("-".into(), ns),
            ns(sm),
            signed(added),
            bm.map_or("-".into(), |b| signed(sm - b)),
            ns(budget),
        ]);
    }
    let rate = bucket.rate();
    md.print(
        "cargo bench -p cuda-shim --bench overhead",
        &format!(
            "simulated A100 node (sim-1gpu), medians of {RUNS} runs, launches waited for tokens: {}",
            bucket.waits()
        ),
    );
    println!(
        "compute quota: hard {QUOTA} %, learned rate {:.1} one-wave launches/ms; launches that waited for tokens: {}, asleep {:.1} ms{}",
        rate * 1e6 / vcuda::throttle::cost::WAVE_UNITS as f64,
        bucket.waits(),
        ledger.throttled_ns() as f64 / 1e6,
        if bucket.waits() == 0 && rate > 0.0 {
            ""
        } else {
            "  (NOT tokens-available: the throttle line measured waiting)"
        }
    );
}
