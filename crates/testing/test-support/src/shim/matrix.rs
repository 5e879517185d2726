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

use super::simnode::{Container, ShimNode};
use super::workload;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

pub const LIMITS: [i32; 5] = [10, 30, 50, 70, 90];
/// An A100 whose NVML samples as a real driver does (late, wandering,
/// skipping a period now and then): `config/nodes/<NODE>.toml`.
pub const NODE: &str = "sim-1gpu-driver-sampling";
pub const MIXES: [&str; 5] = ["uniform", "blockmix", "saturate", "graph", "gridless"];

/// One container: its limit and the mix its workload runs.
#[derive(Debug, Clone, Copy)]
pub struct Tenant {
    /// The guarantee (`vcuda-core`).
    pub quota: i32,
    /// A soft share's cap (`vcuda-core-limit`); 0: a hard limit.
    pub cap: i32,
    pub mix: &'static str,
}

impl Tenant {
    /// What it should get alone on its GPU, or beside tenants whose hard
    /// limits add up to 100 with it: the cap of a soft share (bursting),
    /// else the quota.
    pub fn expected(&self) -> f64 {
        if self.cap > 0 { self.cap } else { self.quota }.into()
    }

    fn hard(quota: i32, mix: &'static str) -> Tenant {
        Tenant { quota, cap: 0, mix }
    }
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
                tenants: vec![Tenant::hard(quota, mix)],
            });
        }
    }
    let shared = |name: &str, t: &[(i32, &'static str)]| Case {
        name: name.into(),
        tenants: t
            .iter()
            .map(|&(quota, mix)| Tenant::hard(quota, mix))
            .collect(),
    };
    // Soft shares alone burst to their cap (`vcuda-core-limit`).
    for mix in ["uniform", "gridless"] {
        out.push(Case {
            name: format!("soft 30 (cap 70), {mix}, alone"),
            tenants: vec![Tenant {
                quota: 30,
                cap: 70,
                mix,
            }],
        });
    }
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
            .map(|(t, a)| (*t, a - t.expected()))
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
/// With `$VCUDA_ACCURACY_BINS` set, prints each tenant's use in every
/// 100 ms from its start (the sim's timeline): where a miss came from, a
/// burst or a steady offset (beside `$VCUDA_ACCURACY_LOG=debug`, the
/// controller's view of the same periods).
pub fn run_case(s: &Setup, case: &Case, prog: &Path) -> Outcome {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, NODE);
    let containers: Vec<Container> = case
        .tenants
        .iter()
        .map(|t| n.container(t.quota, t.cap == 0, t.cap))
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
    if std::env::var_os("VCUDA_ACCURACY_BINS").is_some() {
        for r in &runs {
            let bins: Vec<f64> = (0..(to - r.start) / BIN_NS)
                .map(|i| r.start + i * BIN_NS)
                .map(|a| n.busy(&[r.pid], a, a + BIN_NS))
                .collect();
            eprintln!("bins {} pid {}: {bins:.0?}", case.name, r.pid);
        }
    }
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
        "target",
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
                t.expected(),
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

/// A soft share's neighbour arrives: what [`arrival`] measured.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// The soft share alone (its warm-up over), percent.
    pub alone: f64,
    /// Seconds from the neighbour's first launch until every later 0.5 s
    /// window holds the soft share within 3 points of its guarantee;
    /// `None`: never within the run.
    pub to_guarantee_s: Option<f64>,
    /// The soft share and the neighbour over the [`AFTER_S`] window that
    /// starts [`SETTLE_S`] after the neighbour's first launch.
    pub soft_after: f64,
    pub neighbour: f64,
}

/// How long a soft share may take to give the device back.
pub const SETTLE_S: f64 = 2.0;
/// The window after [`SETTLE_S`]: the newcomer's own controller still
/// settles (it overshoots for ~1 s, then undershoots by 3-5 points for
/// ~1.5 s as the scale it learned while queued behind the soft share's
/// work is forgotten), so a longer one than the matrix's.
pub const AFTER_S: f64 = 5.0;
const BIN_NS: u64 = 100_000_000;

/// A soft share (guarantee 30, cap 70, `soft_mix`) runs alone for the
/// warm-up and `s.window_s` (its share alone is read over the latter);
/// then a hard-70 neighbour (`hard_mix`) starts
/// on the same GPU. Its share is read in 100 ms bins as they end (the
/// sim's timeline keeps a bounded history).
pub fn arrival(s: &Setup, prog: &Path, soft_mix: &str, hard_mix: &str) -> Arrival {
    let n = ShimNode::install(&s.workspace, &s.gpu_sim, &s.shim, NODE);
    let soft = n.container(30, false, 70);
    let hard = n.container(70, true, 0);
    let total = s.warmup_s + s.window_s + SETTLE_S + AFTER_S + 1.0;
    let a = workload::start(&soft, prog, &[soft_mix, &format!("{total}")]);
    let from = a.start + workload::s(s.warmup_s);
    let to = from + workload::s(s.window_s);
    workload::sleep_until(to + 20_000_000);
    let alone = n.busy(&[a.pid], from, to);
    let rest = format!("{}", SETTLE_S + AFTER_S + 0.5);
    let b = workload::start(&hard, prog, &[hard_mix, &rest]);
    let bins = (workload::s(SETTLE_S + AFTER_S) / BIN_NS) as usize;
    let (mut soft_bins, mut hard_bins) = (Vec::new(), Vec::new());
    for i in 0..bins as u64 {
        let end = b.start + (i + 1) * BIN_NS;
        workload::sleep_until(end + 20_000_000);
        soft_bins.push(n.busy(&[a.pid], end - BIN_NS, end));
        hard_bins.push(n.busy(&[b.pid], end - BIN_NS, end));
    }
    if std::env::var_os("VCUDA_ACCURACY_BINS").is_some() {
        eprintln!("soft {soft_bins:.0?}\nhard {hard_bins:.0?}");
    }
    workload::finish(b);
    workload::finish(a);
    let settle = (workload::s(SETTLE_S) / BIN_NS) as usize;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Arrival {
        alone,
        to_guarantee_s: settled_at(&soft_bins, 30.0 + 3.0).map(|i| i as f64 * BIN_NS as f64 / 1e9),
        soft_after: mean(&soft_bins[settle..]),
        neighbour: mean(&hard_bins[settle..]),
    }
}

/// The first bin from which every 5-bin (0.5 s) window averages at most
/// `bound`.
fn settled_at(bins: &[f64], bound: f64) -> Option<usize> {
    let w = 5;
    let over: Vec<bool> = bins
        .windows(w)
        .map(|x| x.iter().sum::<f64>() / w as f64 > bound)
        .collect();
    let last_over = over.iter().rposition(|&o| o);
    match last_over {
        None => Some(0),
        Some(i) if i + 1 < over.len() => Some(i + 1),
        Some(_) => None,
    }
}
