//! A latency tenant beside batch work on one simulated A100
//! (config/nodes/sim-1gpu.toml; the sim time-slices the contexts of
//! different processes on a 2 ms timeslice, a context switch between
//! them, as NVIDIA's scheduler does): requests of three 200 us
//! kernels at 100 per second (tests/c/qos_latency.c: open loop, latency
//! from when a request was due to its stream's synchronize), alone and
//! beside a saturating batch tenant (tests/c/shim_compute.c: 1 ms kernels
//! and a sync every 4, or `blockmix`'s 120 us and 10 us kernels and a sync
//! every 10), each in a 50 % hard share under the interposer, and
//! with no interposer at all (the driver's time-slicing alone); plain
//! launches and a CUDA-graph variant. The batch tenant's part of the GPU
//! comes from the sim's timeline over the latency tenant's run.
//!
//! With tiers (docs/qos.md) the latency share is `latency` and the batch
//! one `batch` (hard 50, or soft 50 that may burst to 100), sharing the
//! GPU's QoS page as the node agent hands it. A benchmark, never a test:
//! it prints and asserts nothing. About 4 min.
//! `cargo build --release --workspace && cargo bench -p cuda-shim --bench qos_latency`

use qos_page::Tier;
use simnode::{Container, ShimNode};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use test_support::shim::server::Qos;
use test_support::shim::{report, simnode, workload};

const SECONDS: f64 = 10.0;
/// The first seconds of each run are not counted (the quota controller's
/// start-up), nor the last half second (the workload is ending).
const WARMUP: f64 = 2.0;
/// Requests per second, kernels per request, blocks per kernel (200 us).
const REQUEST: [&str; 3] = ["100", "3", "17280"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

struct Progs {
    latency: PathBuf,
    batch: PathBuf,
}

/// What one case measured.
struct Figures {
    lat: HashMap<String, f64>,
    lat_busy: f64,
    batch_busy: Option<f64>,
}

fn parse(out: &str) -> HashMap<String, f64> {
    out.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// A batch workload: its name, `shim_compute` mode and sync interval.
type Batch = (&'static str, &'static str, &'static str);
const BATCHES: [Batch; 2] = [
    ("1 ms kernels", "saturate", "4"),
    ("120 us + 10 us kernels", "blockmix", "10"),
];

/// The latency tenant in `lat` (with `extra` arguments), beside the batch
/// tenant in `batch` when given.
fn case(
    n: &ShimNode,
    p: &Progs,
    lat: &Container,
    batch: Option<(&Container, Batch)>,
    extra: &[&str],
) -> Figures {
    let secs = format!("{}", SECONDS + 2.0);
    let b = batch.map(|(c, (_, mode, sync))| workload::start(c, &p.batch, &[mode, &secs, sync]));
    if b.is_some() {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    let secs = format!("{SECONDS}");
    let warmup = format!("warmup={WARMUP}");
    let mut args = vec![secs.as_str()];
    args.extend(REQUEST);
    args.extend(extra);
    args.push(&warmup);
    let l = workload::start(lat, &p.latency, &args);
    let pid = l.pid;
    let from = l.start + workload::s(WARMUP);
    let to = l.start + workload::s(SECONDS - 0.5);
    workload::sleep_until(to);
    let lat_busy = n.busy(&[pid], from, to);
    let batch_busy = b.as_ref().map(|b| n.busy(&[b.pid], from, to));
    let out = workload::finish(l);
    if let Some(b) = b {
        workload::finish(b);
    }
    Figures {
        lat: parse(&out),
        lat_busy,
        batch_busy,
    }
}

fn main() {
    let n = ShimNode::install(
        &workspace(),
        &test_support::artifact("gpu-sim"),
        &test_support::target_dir().join("libvcuda.so"),
        "sim-1gpu",
    );
    let p = Progs {
        latency: n.compile_c(&workspace().join("tests/c/qos_latency.c")),
        batch: n.compile_c(&workspace().join("tests/c/shim_compute.c")),
    };
    println!(
        "latency tenant ({} req/s of {} x {}-block kernels) beside batch, {SECONDS} s each",
        REQUEST[0], REQUEST[1], REQUEST[2]
    );
    let mut md = report::Markdown::new(&[
        "batch",
        "launch",
        "setting",
        "p50 us",
        "p99 us",
        "max us",
        "late",
        "latency busy %",
        "batch busy %",
        "batch of idle %",
    ]);
    let launches = [("kernels", &[][..]), ("graph", &["graph"][..])];
    // VCUDA_QOS_BATCH=<shim_compute mode> runs that batch workload alone.
    let only = std::env::var("VCUDA_QOS_BATCH").ok();
    let batches = BATCHES
        .iter()
        .filter(|b| only.as_deref().is_none_or(|o| o == b.1));
    for (bw, (launch, extra)) in batches.flat_map(|b| launches.map(|l| (*b, l))) {
        let shares = || (n.container(50, true, 0), n.container(50, true, 0));
        // Tiers: the latency share and the batch one (hard 50, or soft 50
        // bursting to 100) get their tier and one page for the GPU.
        let tiered = |batch_hard: bool| {
            let page = Qos::page();
            let l = n.container(50, true, 0);
            let b = n.container(50, batch_hard, if batch_hard { 0 } else { 100 });
            l.manager
                .as_ref()
                .unwrap()
                .set_qos(page.with(Tier::Latency));
            b.manager.as_ref().unwrap().set_qos(page.with(Tier::Batch));
            (l, b)
        };
        let cases: Vec<(&str, Figures)> = vec![
            ("alone, 50 % share", case(&n, &p, &shares().0, None, extra)),
            ("beside batch, 50 % + 50 % shares", {
                let (l, b) = shares();
                case(&n, &p, &l, Some((&b, bw)), extra)
            }),
            ("beside batch, 50 % + soft 50..100 shares", {
                let (l, b) = (n.container(50, true, 0), n.container(50, false, 100));
                case(&n, &p, &l, Some((&b, bw)), extra)
            }),
            ("beside batch, tiers, batch hard 50", {
                let (l, b) = tiered(true);
                case(&n, &p, &l, Some((&b, bw)), extra)
            }),
            ("beside batch, tiers, batch soft 50..100", {
                let (l, b) = tiered(false);
                case(&n, &p, &l, Some((&b, bw)), extra)
            }),
            (
                "beside batch, no interposer",
                case(&n, &p, &n.direct(), Some((&n.direct(), bw)), extra),
            ),
        ];
        for (setting, f) in cases {
            let g = |k: &str| f.lat.get(k).copied().unwrap_or(f64::NAN);
            let batch = f.batch_busy.map_or("-".into(), |b| format!("{b:.1}"));
            // What batch kept of the time the latency tenant left idle.
            let of_idle = f.batch_busy.map_or("-".into(), |b| {
                format!("{:.0}", 100.0 * b / (100.0 - f.lat_busy))
            });
            println!(
                "{:<22} {launch:<8} {setting:<40} p50 {:>7.0} us  p99 {:>7.0} us  max {:>7.0} us  late {:>4}  latency {:>5.1} %  batch {batch:>5} % ({of_idle} % of idle)",
                bw.0,
                g("p50_us"),
                g("p99_us"),
                g("max_us"),
                g("late"),
                f.lat_busy
            );
            md.row(vec![
                bw.0.into(),
                launch.into(),
                setting.into(),
                format!("{:.0}", g("p50_us")),
                format!("{:.0}", g("p99_us")),
                format!("{:.0}", g("max_us")),
                format!("{}", g("late")),
                format!("{:.1}", f.lat_busy),
                batch,
                of_idle,
            ]);
        }
    }
    md.print(
        "cargo bench -p cuda-shim --bench qos_latency",
        "the simulated A100 (sim-1gpu)",
    );
}
