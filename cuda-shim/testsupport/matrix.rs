//! The compute accuracy matrix: hard limits {10, 30, 50, 70, 90} over five
//! kernel mixes whose device time follows laws the interposer cannot see
//! (`tests/c/shim_laws.c`), alone, and tenants sharing one GPU (30 + 70,
//! 20 + 20 + 60). Each case runs on its own simulated node (its own GPU), so
//! cases run side by side; what each tenant achieved is read from the sim's
//! timeline (ground truth) over one window after a warm-up.
//!
//! Shared by the CI gate (`tests/shim_accuracy.rs`, ±3 points) and the
//! bench (`benches/accuracy_matrix.rs`, ±0.5-point targets, longer windows).
//! Include beside `server.rs`, `simnode.rs` and `workload.rs`.

#![allow(dead_code)]

use crate::simnode::{Container, ShimNode};
use crate::workload;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

pub const LIMITS: [i32; 5] = [10, 30, 50, 70, 90];
/// An A100 whose NVML samples as a real driver does (late, wandering,
/// skipping a period now and then): `config/nodes/<NODE>.toml`.
pub const NODE: &str = "sim-1gpu-driver-sampling";
pub const MIXES: [&str; 5] = ["uniform", "blockmix", "saturate", "graph", "gridless"];

/// One container: its hard limit and the mix its workload runs.
#[derive(Debug, Clone, Copy)]
pub struct Tenant {
    pub quota: i32,
    pub mix: &'static str,
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub tenants: Vec<Tenant>,
}

/// Every case: each limit with each mix alone, then the shared GPUs (each
/// tenant a different mix, so each container learns another law).
pub fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for mix in MIXES {
        for quota in LIMITS {
            out.push(Case {
                name: format!("hard {quota}, {mix}, alone"),
                tenants: vec![Tenant { quota, mix }],
            });
        }
    }
    let shared = |name: &str, t: &[(i32, &'static str)]| Case {
        name: name.into(),
        tenants: t
            .iter()
            .map(|&(quota, mix)| Tenant { quota, mix })
            .collect(),
    };
    out.push(shared(
        "30 + 70 (uniform, gridless)",
        &[(30, "uniform"), (70, "gridless")],
    ));
    out.push(shared(
        "20 + 20 + 60 (blockmix, saturate, graph)",
        &[(20, "blockmix"), (20, "saturate"), (60, "graph")],
    ));
    out
}

/// The cases whose name contains one of the `|`-separated parts of
/// `$VCUDA_ACCURACY_ONLY` (all when unset): a few rows of the matrix at a
/// time while looking into them.
pub fn selected(cases: Vec<Case>) -> Vec<Case> {
    match std::env::var("VCUDA_ACCURACY_ONLY") {
        Ok(only) if !only.is_empty() => cases
            .into_iter()
            .filter(|c| only.split('|').any(|o| c.name.contains(o)))
            .collect(),
        _ => cases,
    }
}

/// What a case's tenants achieved, in percent of the device, in order.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub case: Case,
    pub achieved: Vec<f64>,
}

impl Outcome {
    /// (tenant, achieved - quota) of each tenant.
    pub fn errors(&self) -> impl Iterator<Item = (Tenant, f64)> + '_ {
        self.case
            .tenants
            .iter()
            .zip(&self.achieved)
            .map(|(t, a)| (*t, a - t.quota as f64))
    }
}

/// Where the binaries come from and how long each case runs.
pub struct Setup {
    pub workspace: PathBuf,
    pub gpu_sim: PathBuf,
    pub shim: PathBuf,
    pub warmup_s: f64,
    pub window_s: f64,
    /// Cases run at once.
    pub jobs: usize,
}

/// Runs one case on a fresh node; `prog` is shim_laws, compiled once.
pub fn run_case(s: &Setup, case: &Case, prog: &Path) -> Outcome {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, NODE);
    let containers: Vec<Container> = case
        .tenants
        .iter()
        .map(|t| n.container(t.quota, true, 0))
        .collect();
    let secs = format!("{}", s.warmup_s + s.window_s + 0.5);
    let runs: Vec<workload::Running> = containers
        .iter()
        .zip(&case.tenants)
        .map(|(c, t)| workload::start(c, prog, &[t.mix, &secs]))
        .collect();
    let from = runs.iter().map(|r| r.start).max().unwrap() + workload::s(s.warmup_s);
    let to = from + workload::s(s.window_s);
    workload::sleep_until(to + 20_000_000);
    let achieved = runs.iter().map(|r| n.busy(&[r.pid], from, to)).collect();
    for r in runs {
        workload::finish(r);
    }
    Outcome {
        case: case.clone(),
        achieved,
    }
}

/// Compiles shim_laws once (into a node that is then dropped: the binary
/// links `-lcuda` by name and finds each node's through LD_LIBRARY_PATH).
pub fn compile(s: &Setup, into: &Path) -> PathBuf {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, NODE);
    let built = n.compile_c(&s.workspace.join("tests/c/shim_laws.c"));
    let prog = into.join("shim_laws");
    std::fs::copy(&built, &prog).unwrap();
    prog
}

/// Runs `cases`, outcomes in the cases' order: single tenants `s.jobs` at a
/// time, then each shared GPU alone (its tenants together need the whole
/// device, so a loaded host shows in them first).
pub fn run_all(s: &Setup, cases: &[Case]) -> Vec<Outcome> {
    let dir = tempfile::tempdir().unwrap();
    let prog = compile(s, dir.path());
    let out: Mutex<Vec<Option<Outcome>>> = Mutex::new(vec![None; cases.len()]);
    let (alone, shared): (Vec<usize>, Vec<usize>) =
        (0..cases.len()).partition(|&i| cases[i].tenants.len() == 1);
    for (batch, jobs) in [(alone, s.jobs), (shared, 1)] {
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..jobs.max(1) {
                scope.spawn(|| {
                    while let Some(&i) = batch.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let o = run_case(s, &cases[i], &prog);
                        out.lock().unwrap()[i] = Some(o);
                    }
                });
            }
        });
    }
    out.into_inner()
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap())
        .collect()
}

/// Prints one line per tenant: case, quota, achieved, error, and whether it
/// is within `bound` points. Returns the lines outside it.
pub fn print(outcomes: &[Outcome], bound: f64) -> Vec<String> {
    println!(
        "{:<44} {:>6} {:>9} {:>7} {:>6}",
        "case",
        "quota",
        "achieved",
        "error",
        format!("±{bound}")
    );
    let mut misses = Vec::new();
    for o in outcomes {
        for ((t, err), got) in o.errors().zip(&o.achieved) {
            let ok = err.abs() <= bound;
            let line = format!(
                "{:<44} {:>5}% {:>8.1}% {:>+7.1} {:>6}",
                tenant_name(&o.case, t),
                t.quota,
                got,
                err,
                if ok { "ok" } else { "MISS" }
            );
            println!("{line}");
            if !ok {
                misses.push(line);
            }
        }
    }
    misses
}

/// "hard 30, uniform, alone", or for a shared GPU the case and the tenant.
pub fn tenant_name(case: &Case, t: Tenant) -> String {
    if case.tenants.len() == 1 {
        case.name.clone()
    } else {
        format!("{}: {} {}", case.name, t.quota, t.mix)
    }
}
