//! The compute quota's accuracy gate, on a simulated GPU whose kernels run
//! by laws the interposer cannot see (declared in the module image of
//! `tests/c/shim_laws.c`, see `crates/sim/gpu-sim-core/src/law.rs`): the
//! interposer prices a launch by its waves, the device times it otherwise,
//! and only NVML's samples tell the controller what a unit really costs.
//!
//! * the matrix (`crates/testing/test-support/src/shim/matrix.rs`): hard limits
//!   {10, 30, 50, 70, 90} x five mixes alone, and 30 + 70, 20 + 20 + 60 on
//!   one GPU; every tenant within ±3 points of its quota over a
//!   [`WINDOW_S`] window after [`WARMUP_S`] of warm-up (ground truth: the
//!   sim's timeline). [`JOBS`] single-tenant cases run at once, each on its
//!   own node; each shared GPU then runs alone.
//! * the model really disagrees with the price: with NVML's samples cut
//!   off after calibrating on one mix, the bucket keeps the wave-priced rate
//!   it learned and misses the quota on another mix by tens of points;
//!   with feedback the same run holds it.
//!
//! Windows and warm-up: the controller lands one 100 ms period after it
//! learns its scale (~1 s of samples) and its integral settles within ~2 s,
//! so 3 s of warm-up; 5 s windows average NVML's whole-percent samples and
//! the laws' jitter well inside ±3. Needs `cargo build --workspace` first.

use simnode::ShimNode;
use std::path::Path;
use std::sync::Mutex;
use test_support::shim::{matrix, simnode, workload};
use test_support::{target_dir, workspace_root};

const WARMUP_S: f64 = 3.0;
const WINDOW_S: f64 = 5.0;
/// Single-tenant cases at once: the workloads sleep on the device or the
/// bucket most of the time, so three fit on two cores (each keeps 3 rounds
/// queued: a late wake-up does not idle its device).
const JOBS: usize = 3;
/// Points a tenant may be off its quota.
const BOUND: f64 = 3.0;

/// One test at a time: both keep the two cores busy.
static SERIAL: Mutex<()> = Mutex::new(());

fn setup(jobs: usize) -> matrix::Setup {
    matrix::Setup {
        workspace: workspace_root(),
        gpu_sim: target_dir().join("gpu-sim"),
        shim: target_dir().join("libvcuda.so"),
        warmup_s: WARMUP_S,
        window_s: WINDOW_S,
        jobs,
    }
}

#[test]
fn every_case_of_the_matrix_holds_its_quota_within_3_points() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = std::time::Instant::now();
    let jobs = std::env::var("VCUDA_ACCURACY_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(JOBS);
    let outcomes = matrix::run_all(&setup(jobs), &matrix::selected(matrix::cases()));
    let misses = matrix::print(&outcomes, BOUND);
    eprintln!(
        "matrix: {} cases in {:.0} s ({jobs} at once, {WARMUP_S} s warm-up, {WINDOW_S} s windows)",
        outcomes.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        misses.is_empty(),
        "{} tenants outside ±{BOUND} points:\n{}",
        misses.len(),
        misses.join("\n")
    );
}

/// What a hard 50 % container achieved running `shim_laws phases`:
/// (calibration mix, then the other mix). With `feedback` false, NVML's
/// samples stop and events no longer time (the sim's knobs) the moment the
/// mix changes, so the bucket keeps the rate learned on the first mix: a
/// wave-priced bucket, open loop. (With the events still timing, the
/// interposer's timed launches closed the loop again: 50.3 % on the second
/// mix.)
fn phases(s: &matrix::Setup, prog: &Path, feedback: bool) -> (f64, f64) {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, matrix::NODE);
    let c = n.container(50, true, 0);
    let mut r = workload::start(&c, prog, &["phases", "14"]);
    let switch = r.wait_for("phase_ns");
    if !feedback {
        for knob in ["nvml-samples-off", "event-timing-off"] {
            std::fs::write(n.root().join("run/gpu-sim").join(knob), b"").unwrap();
        }
    }
    let calibrated = n.busy(&[r.pid], r.start + workload::s(WARMUP_S), switch);
    // The controller's scale averages the last second: from 2.5 s on it
    // has forgotten the first mix (open loop: nothing changes anyway).
    let (from, to) = (switch + workload::s(2.5), switch + workload::s(6.5));
    workload::sleep_until(to + 20_000_000);
    let after = n.busy(&[r.pid], from, to);
    workload::finish(r);
    (calibrated, after)
}

#[test]
fn a_wave_priced_bucket_without_feedback_misses_the_quota_and_feedback_holds_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = setup(2);
    let dir = tempfile::tempdir().unwrap();
    let prog = matrix::compile(&s, dir.path());
    let (open, closed) = std::thread::scope(|scope| {
        let open = scope.spawn(|| phases(&s, &prog, false));
        let closed = scope.spawn(|| phases(&s, &prog, true));
        (open.join().unwrap(), closed.join().unwrap())
    });
    eprintln!(
        "hard 50, uniform then gridless: open loop {:.1} % then {:.1} %; with feedback {:.1} % then {:.1} %",
        open.0, open.1, closed.0, closed.1
    );
    for (what, got) in [("open loop", open.0), ("with feedback", closed.0)] {
        assert!(
            (got - 50.0).abs() <= BOUND,
            "{what}: the calibration mix itself missed: {got:.1} %"
        );
    }
    assert!(
        (open.1 - 50.0).abs() > 10.0,
        "without feedback the wave price held the quota on another mix ({:.1} %): \
         the simulator's timing agrees with the interposer's price",
        open.1
    );
    assert!(
        (closed.1 - 50.0).abs() <= BOUND,
        "with feedback: {:.1} % after the mix changed",
        closed.1
    );
}

/// Start-up: what a fresh hard-30 % process that queues short launches as
/// fast as it can, never waiting for them (`shim_laws burst`, and
/// `burstlong` whose one-wave kernels last 8 times what the interposer
/// assumes before it has measured one), kept the device busy over its
/// first 1, 2 and 5 s, and from 2 to 5 s.
fn startup(s: &matrix::Setup, prog: &Path, mix: &str) -> [f64; 4] {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, matrix::NODE);
    let c = n.container(STARTUP_QUOTA, true, 0);
    let r = workload::start(&c, prog, &[mix, "5.2"]);
    // Each second read right after it ends: the sim's timeline keeps the
    // last 16,384 busy intervals, under 3 s of these short kernels.
    let sec: Vec<f64> = (0..5u64)
        .map(|i| {
            let to = r.start + (i + 1) * 1_000_000_000;
            workload::sleep_until(to + 20_000_000);
            n.busy(&[r.pid], to - 1_000_000_000, to)
        })
        .collect();
    workload::finish(r);
    let mean = |a: usize, b: usize| sec[a..b].iter().sum::<f64>() / (b - a) as f64;
    [mean(0, 1), mean(0, 2), mean(0, 5), mean(2, 5)]
}

const STARTUP_QUOTA: i32 = 30;
/// Points over the quota a fresh process may run over its first second
/// and its first two (the controller's first NVML sample comes 0.1-0.2 s
/// in; until then the bucket charges an assumed wave time), and the bound
/// from 2 s on (as the matrix).
const STARTUP_BOUNDS: [f64; 3] = [20.0, 10.0, BOUND];

#[test]
fn a_fresh_process_that_never_synchronises_holds_its_quota_from_the_first_launch() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = setup(2);
    let dir = tempfile::tempdir().unwrap();
    let prog = matrix::compile(&s, dir.path());
    let mixes = ["burst", "burstlong"];
    let got: Vec<[f64; 4]> = std::thread::scope(|scope| {
        let h: Vec<_> = mixes
            .iter()
            .map(|m| scope.spawn(|| startup(&s, &prog, m)))
            .collect();
        h.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let q = STARTUP_QUOTA as f64;
    let mut misses = Vec::new();
    for (mix, g) in mixes.iter().zip(&got) {
        eprintln!(
            "hard {q}, {mix}: first 1 s {:.1} %, first 2 s {:.1} %, first 5 s {:.1} %, 2-5 s {:.1} %",
            g[0], g[1], g[2], g[3]
        );
        let [b1, b2, b] = STARTUP_BOUNDS;
        if g[0] > q + b1 || g[1] > q + b2 || (g[3] - q).abs() > b {
            misses.push(format!("{mix}: {g:.1?}"));
        }
    }
    assert!(
        misses.is_empty(),
        "over ({b1}, {b2}) points over the first (1, 2) s or ±{b} from 2 to 5 s: {misses:?}",
        b1 = STARTUP_BOUNDS[0],
        b2 = STARTUP_BOUNDS[1],
        b = STARTUP_BOUNDS[2]
    );
}

/// An MPS client (the sim's knob: its NVML names only the MPS server in
/// utilization samples, its driver says the context is an MPS client)
/// whose kernels are long single waves (`shim_laws burstlong`, 0.4 ms):
/// too few waves a period for the controller to notice on its own that
/// no sample names the container, so it ran open (as a CUDA graph of
/// large matmuls did on an H100 under MPS: 85 % under a hard 30 %). Told
/// by the driver, the interposer charges it all busy time: the quota
/// holds, and the ledger's flag says the container is unattributed.
#[test]
fn an_mps_client_with_long_kernels_holds_its_quota() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = setup(1);
    let dir = tempfile::tempdir().unwrap();
    let prog = matrix::compile(&s, dir.path());
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, matrix::NODE);
    let c = n.container(STARTUP_QUOTA, true, 0);
    let r = workload::start_with(
        &c,
        &prog,
        &["burstlong", "5.2"],
        &[(gpu_sim_core::MPS_SERVER_PID_ENV, "4000000")],
    );
    let to = r.start + 5_000_000_000;
    workload::sleep_until(to + 20_000_000);
    let u = n.busy(&[r.pid], to - 3_000_000_000, to);
    workload::finish(r);
    let flag = c.manager.as_ref().unwrap().ledger().compute_unattributed();
    eprintln!(
        "hard {STARTUP_QUOTA}, MPS client, burstlong: 2-5 s {u:.1} %, unattributed flag {flag}"
    );
    assert_eq!(flag, 1, "the controller does not say it is blind");
    let q = STARTUP_QUOTA as f64;
    assert!(
        u < q + 10.0 && u > q - 15.0,
        "achieved {u:.1} % under a hard {q} %"
    );
}

/// A soft share (guarantee 30, cap 70: `vcuda-core-limit`) bursts to its
/// cap while alone; when a hard-70 neighbour starts on its GPU, it is back
/// to its guarantee (every later 0.5 s window ≤ 33 %) within
/// [`matrix::SETTLE_S`], and from then on the neighbour gets its 70, or
/// what the soft share leaves of the GPU, ± 3 (over [`matrix::AFTER_S`]).
/// The share alone over 3 s.
#[test]
fn a_soft_share_bursts_alone_and_yields_to_a_neighbour_within_2_s() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = setup(1);
    s.window_s = 3.0;
    let dir = tempfile::tempdir().unwrap();
    let prog = matrix::compile(&s, dir.path());
    let a = matrix::arrival(&s, &prog, "uniform", "gridless");
    eprintln!(
        "soft 30 (cap 70) alone {:.1} %; hard 70 arrives: back to the guarantee after {}; \
         from {} s on soft {:.1} %, neighbour {:.1} % (over {} s)",
        a.alone,
        a.to_guarantee_s
            .map_or("never".into(), |t| format!("{t:.1} s")),
        matrix::SETTLE_S,
        a.soft_after,
        a.neighbour,
        matrix::AFTER_S
    );
    assert!((a.alone - 70.0).abs() <= BOUND, "alone: {a:?}");
    assert!(
        a.to_guarantee_s.is_some_and(|t| t <= matrix::SETTLE_S),
        "not back to its guarantee within {} s: {a:?}",
        matrix::SETTLE_S
    );
    assert!(a.soft_after <= 30.0 + BOUND, "{a:?}");
    // The two quotas fill the GPU: the neighbour gets what the soft share
    // leaves, up to its 70. Against 70 alone, a soft share at 30.9 (inside
    // its own bound) left the neighbour 69.1 at most, and a fresh machine's
    // run read 67.0 as a failure.
    let room = 70f64.min(100.0 - a.soft_after);
    assert!(
        a.neighbour >= room - BOUND && a.neighbour <= 70.0 + BOUND,
        "the neighbour got {:.1} % where the soft share left it {room:.1}: {a:?}",
        a.neighbour
    );
}

/// The gate above means something only while the simulator's timing is its
/// own: no simulator crate may depend on the interposer (directly or
/// through another crate), and no simulator source may name the
/// interposer's price (`kernel_cost`, `WAVE_UNITS`, `throttle::`).
#[test]
fn the_simulator_shares_no_pricing_code_with_the_interposer() {
    let root = workspace_root();
    for krate in ["gpu-sim-core", "gpu-sim-cuda", "gpu-sim-nvml", "gpu-sim"] {
        let out = std::process::Command::new(env!("CARGO"))
            .args([
                "tree",
                "--offline",
                "-e",
                "normal,build",
                "--prefix",
                "none",
            ])
            .args(["-p", krate])
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(out.status.success(), "cargo tree -p {krate}: {out:?}");
        let tree = String::from_utf8_lossy(&out.stdout);
        let deps: Vec<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
        assert!(deps.contains(&krate), "{tree}");
        assert!(
            !deps.contains(&"cuda-shim"),
            "{krate} depends on cuda-shim:\n{tree}"
        );
    }
    let mut sources = Vec::new();
    for dir in ["gpu-sim-core", "gpu-sim-cuda", "gpu-sim-nvml", "gpu-sim"] {
        rust_files(&root.join("crates/sim").join(dir).join("src"), &mut sources);
    }
    assert!(sources.len() > 10, "{sources:?}");
    for f in sources {
        let text = std::fs::read_to_string(&f).unwrap();
        for word in [
            "kernel_cost",
            "WAVE_UNITS",
            "throttle::",
            "cuda_shim",
            "vcuda::throttle",
        ] {
            assert!(
                !text.contains(word),
                "{} names the interposer's {word}",
                f.display()
            );
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}
