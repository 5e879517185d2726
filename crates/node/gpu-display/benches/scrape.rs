//! Benchmarks of the display service (a small harness, not criterion):
//!
//! 1. a `/metrics` scrape with 100 containers on 8 GPUs (2 processes each):
//!    rendering alone, and a full HTTP GET over TCP through the server;
//! 2. the NVML sampler's CPU cost per second of wall time, against the
//!    simulated NVML with 100 live processes launching kernels (needs
//!    `cargo build --workspace` for gpu-sim and its libraries; skipped with
//!    a note otherwise).
//!
//! `cargo bench -p gpu-display --bench scrape`

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpu_display::sampler::{GpuSample, ProcSample};
use gpu_display::{ContainerView, Display, GpuRef, GpuView, NvmlReader, Snapshot};
use gpu_display_fixture::{FixtureState, StaticSource};
use tokio_util::sync::CancellationToken;

const CONTAINERS: u32 = 100;
const GPUS: u32 = 8;

fn synthetic_uuid(i: u32) -> String {
    format!("GPU-{i:08x}-0000-0000-0000-000000000000")
}

fn fixture(pids: &dyn Fn(u32) -> Vec<u32>, uuid: &dyn Fn(u32) -> String) -> FixtureState {
    let gpus: Vec<GpuView> = (0..GPUS)
        .map(|i| GpuView {
            index: i,
            uuid: uuid(i),
            bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_total_bytes: 80 << 30,
            allocated_cores: 100,
            allocated_memory_bytes: 60 << 30,
            healthy: true,
            tenants: CONTAINERS / GPUS,
            ..Default::default()
        })
        .collect();
    let containers = (0..CONTAINERS)
        .map(|c| {
            let g = &gpus[(c % GPUS) as usize];
            ContainerView {
                pod_uid: format!("3f1c6a2e-0000-4000-8000-{c:012}"),
                pod_name: format!("trainer-{c}-7c9f8d6b5-x2k4q"),
                namespace: format!("team-{}", c % 10),
                container: "main".into(),
                gpus: vec![GpuRef {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    bus_id: g.bus_id.clone(),
                }],
                core_quota: 10,
                memory_quota_bytes: 4 << 30,
                host_pids: pids(c),
                throttled_seconds: Some(12.5),
                refused_allocations: Some(3),
                ..Default::default()
            }
        })
        .collect();
    FixtureState {
        node: "gpu-node-17".into(),
        graph: None,
        gpus,
        containers,
    }
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn http_get(addr: SocketAddr, path: &str) -> usize {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::with_capacity(256 * 1024);
    s.read_to_end(&mut buf).unwrap();
    assert!(buf.starts_with(b"HTTP/1.1 200"));
    buf.len()
}

fn bench_scrape() {
    let display = Display::new(Arc::new(StaticSource::new(fixture(
        &|c| vec![10_000 + 2 * c, 10_001 + 2 * c],
        &synthetic_uuid,
    ))));
    let gpus = (0..GPUS)
        .map(|i| {
            let processes: HashMap<u32, ProcSample> = (0..CONTAINERS)
                .filter(|c| c % GPUS == i)
                .flat_map(|c| [10_000 + 2 * c, 10_001 + 2 * c])
                .map(|pid| {
                    (
                        pid,
                        ProcSample {
                            utilization_percent: 4.0,
                            memory_used_bytes: 1 << 30,
                        },
                    )
                })
                .collect();
            GpuSample {
                index: i,
                uuid: synthetic_uuid(i),
                utilization_percent: 96.0,
                memory_used_bytes: 50 << 30,
                memory_total_bytes: 80 << 30,
                processes,
                window_us: None,
                mig: Vec::new(),
            }
        })
        .collect();
    display.store_snapshot(Snapshot {
        taken: Some(std::time::SystemTime::now()),
        gpus,
    });
    for _ in 0..2000 {
        display
            .metrics()
            .observe_allocate(Duration::from_micros(700));
    }

    let n = 200;
    let text = display.render_metrics();
    let series = text.lines().filter(|l| !l.starts_with('#')).count();
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(display.render_metrics());
            t.elapsed()
        })
        .collect();
    println!(
        "render /metrics, {CONTAINERS} containers on {GPUS} GPUs ({series} series, {} KiB): median {:.2} ms, p99 {:.2} ms",
        text.len() / 1024,
        percentile(&mut times, 0.5).as_secs_f64() * 1e3,
        percentile(&mut times, 0.99).as_secs_f64() * 1e3
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let (addr, join) = rt
        .block_on(display.serve_http("127.0.0.1:0".parse().unwrap(), cancel.clone()))
        .unwrap();
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            http_get(addr, "/metrics");
            t.elapsed()
        })
        .collect();
    let median = percentile(&mut times, 0.5);
    println!(
        "HTTP GET /metrics (connect, render, transfer): median {:.2} ms, p99 {:.2} ms (target < 50 ms)",
        median.as_secs_f64() * 1e3,
        percentile(&mut times, 0.99).as_secs_f64() * 1e3
    );
    cancel.cancel();
    rt.block_on(join).unwrap();
}

/// Child mode: one process on the simulated GPU `gpu`, busy `duty_us` per
/// 100 ms period, holding some memory, until killed.
fn child(root: &str, gpu: usize, duty_us: u64) -> ! {
    use gpu_sim_core::{SharedState, SimRoot};
    let st = SharedState::open(&SimRoot::new(root)).expect("sim state");
    let me = st.attach().expect("attach");
    st.try_alloc(me, gpu, 64 << 20).expect("alloc");
    println!("ready");
    std::io::stdout().flush().unwrap();
    loop {
        let now = gpu_sim_core::state::now_ns();
        st.launch(me, gpu, duty_us * 1000, now);
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn find_gpu_sim() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("GPU_SIM_BIN") {
        return Some(PathBuf::from(p));
    }
    // target/<profile>/deps/<bench> -> target/{release,debug}/gpu-sim
    let exe = std::env::current_exe().ok()?;
    let target = exe.parent()?.parent()?.parent()?;
    ["release", "debug"]
        .iter()
        .map(|p| target.join(p).join("gpu-sim"))
        .find(|p| p.is_file())
}

struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn bench_sampler() {
    let Some(gpu_sim) = find_gpu_sim() else {
        println!("sampler CPU: skipped (no gpu-sim binary; run `cargo build --workspace` first)");
        return;
    };
    let node =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../config/nodes/sim-8gpu-nvlink.toml");
    let root = tempfile::tempdir().unwrap();
    let st = Command::new(&gpu_sim)
        .args(["install", "--node"])
        .arg(&node)
        .arg("--root")
        .arg(root.path())
        .output()
        .unwrap();
    if !st.status.success() {
        println!(
            "sampler CPU: skipped (gpu-sim install failed: {})",
            String::from_utf8_lossy(&st.stderr).trim()
        );
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut kids = Kids(Vec::new());
    let mut pids = Vec::new();
    for c in 0..CONTAINERS {
        let mut k = Command::new(&exe)
            .env(
                "GPU_DISPLAY_BENCH_CHILD",
                format!("{}:{}:{}", root.path().display(), c % GPUS, 4000),
            )
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut b = [0u8; 6];
        k.stdout.as_mut().unwrap().read_exact(&mut b).unwrap();
        pids.push(k.id());
        kids.0.push(k);
    }
    let spec = gpu_sim_core::NodeSpec::load(&node).unwrap();
    let display = Display::new(Arc::new(StaticSource::new(fixture(
        &|c| vec![pids[c as usize]],
        &|i| spec.gpus[i as usize].uuid.clone(),
    ))));
    let lib = root
        .path()
        .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let period = Duration::from_secs(1);
    let reader = NvmlReader::open(&lib, period).unwrap();
    let stats = display.sampler_stats();
    let sampler = display.start_sampler(reader, period).unwrap();
    // Skip the first tick (library load, first window), then measure.
    std::thread::sleep(Duration::from_millis(1500));
    let (cpu0, ticks0, t0) = (
        stats.cpu_ns.load(Ordering::Relaxed),
        stats.ticks.load(Ordering::Relaxed),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(10));
    let (cpu1, ticks1, wall) = (
        stats.cpu_ns.load(Ordering::Relaxed),
        stats.ticks.load(Ordering::Relaxed),
        t0.elapsed(),
    );
    sampler.stop();
    let ticks = (ticks1 - ticks0).max(1);
    let cpu = (cpu1 - cpu0) as f64 / 1e9;
    println!(
        "sampler, {CONTAINERS} processes on {GPUS} simulated GPUs, period {period:?}: {:.2} ms CPU per second of wall time ({:.3} % of a core), {:.2} ms CPU per tick, last tick {:.2} ms wall",
        cpu * 1e3 / wall.as_secs_f64(),
        cpu * 100.0 / wall.as_secs_f64(),
        cpu * 1e3 / ticks as f64,
        stats.last_tick_ns.load(Ordering::Relaxed) as f64 / 1e6
    );
    // Sanity: the sampled figures reached the containers.
    let text = display.render_metrics();
    let seen = text
        .lines()
        .filter(|l| l.starts_with("vcuda_container_gpu_utilization_ratio{") && !l.ends_with(" 0"))
        .count();
    println!("  containers with a non-zero sampled utilization: {seen}/{CONTAINERS}");
}

fn main() {
    if let Ok(spec) = std::env::var("GPU_DISPLAY_BENCH_CHILD") {
        let mut it = spec.rsplitn(3, ':');
        let duty: u64 = it.next().unwrap().parse().unwrap();
        let gpu: usize = it.next().unwrap().parse().unwrap();
        child(it.next().unwrap(), gpu, duty);
    }
    bench_scrape();
    bench_sampler();
}
