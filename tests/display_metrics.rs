//! The display service over a simulated node with real load: C programs
//! linked with `-lcuda` keep the simulated GPU busy at known duty cycles,
//! the display samples the simulated NVML in-process, and its `/metrics`
//! is parsed with the Python `prometheus_client` parser and checked against
//! the simulator's own per-process accounting (ground truth).
//!
//! Needs the workspace built (`cargo build --workspace`: gpu-sim, vcudactl),
//! gcc, and python3 with prometheus_client (tests/python/requirements.txt).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, UNIX_EPOCH};

use gpu_display::{ContainerView, Display, DisplayOptions, GpuRef, GpuView, NvmlReader};
use gpu_display_fixture::{FixtureState, StaticSource};
use gpu_sim_core::state::epoch_us_to_mono;
use gpu_sim_core::{SharedState, SimRoot};
use test_support::{SimNode, compile_c, http_get, target_dir};
use tokio_util::sync::CancellationToken;

const MIB: u64 = 1 << 20;

/// Workload processes, killed when dropped.
struct Loads(Vec<Child>);

impl Drop for Loads {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Loads {
    /// Starts `display_load duty mem_mib` and waits for its first period.
    fn spawn(&mut self, exe: &Path, node: &SimNode, duty: u32, mem_mib: u64) -> u32 {
        let mut c = Command::new(exe)
            .args([duty.to_string(), mem_mib.to_string()])
            .env("LD_LIBRARY_PATH", node.lib_dir())
            .env_remove("GPU_SIM_ROOT")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting display_load");
        let mut line = String::new();
        BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line.trim(),
            "ready",
            "display_load {duty} {mem_mib}: {line}"
        );
        let pid = c.id();
        self.0.push(c);
        pid
    }
}

/// (name, labels, value) of every sample, as prometheus_client parses them.
type Samples = Vec<(String, HashMap<String, String>, f64)>;

fn parse_with_prometheus_client(text: &str) -> Samples {
    let code = "import sys, json\n\
                from prometheus_client.parser import text_string_to_metric_families as parse\n\
                fams = list(parse(sys.stdin.read()))\n\
                print(json.dumps([[s.name, s.labels, s.value] for f in fams for s in f.samples]))\n";
    let mut child = Command::new("python3")
        .args(["-c", code])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("No module named 'prometheus_client'"),
        "python3 lacks prometheus_client: pip install -r tests/python/requirements.txt"
    );
    assert!(
        out.status.success(),
        "prometheus_client rejected /metrics: {err}\n{text}"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn value(s: &Samples, name: &str, want: &[(&str, &str)]) -> f64 {
    let hits: Vec<f64> = s
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|x| x.2)
        .collect();
    assert_eq!(hits.len(), 1, "{name}{want:?}: {} samples", hits.len());
    hits[0]
}

fn container(pod: &str, pids: Vec<u32>, cores: u32, mem: u64, gpu: &GpuRef) -> ContainerView {
    ContainerView {
        pod_uid: format!("uid-{pod}"),
        pod_name: pod.into(),
        namespace: "team".into(),
        container: "main".into(),
        gpus: vec![gpu.clone()],
        core_quota: cores,
        memory_quota_bytes: mem,
        host_pids: pids,
        throttled_seconds: Some(1.5),
        refused_allocations: Some(2),
        compute_unattributed: Some(true),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_simulator_ground_truth() {
    let node = SimNode::install("sim-1gpu");
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c("display_load", &node, tmp.path());
    let state = SharedState::open(&SimRoot::new(node.root())).unwrap();
    let spec = state.node().gpus[0].clone();

    // Container A: two processes (15 % + 10 %); B: one at 30 %; a stray
    // process at 10 % that belongs to no container.
    let mut loads = Loads(Vec::new());
    let a1 = loads.spawn(&exe, &node, 15, 256);
    let a2 = loads.spawn(&exe, &node, 10, 128);
    let b = loads.spawn(&exe, &node, 30, 512);
    let _stray = loads.spawn(&exe, &node, 10, 64);

    let gref = GpuRef {
        index: 0,
        uuid: spec.uuid.clone(),
        bus_id: spec.pci_bus_id.clone(),
    };
    let fixture = FixtureState {
        node: "sim-node-1".into(),
        graph: None,
        gpus: vec![GpuView {
            index: 0,
            uuid: spec.uuid.clone(),
            bus_id: spec.pci_bus_id.clone(),
            model: spec.name.clone(),
            memory_total_bytes: spec.memory_bytes(),
            allocated_cores: 60,
            allocated_memory_bytes: 3 << 30,
            healthy: true,
            tenants: 2,
            batch_held_seconds: Some(0.25),
            batch_holds: Some(7),
            memory_lent_bytes: 512 * MIB,
        }],
        containers: vec![
            container("pod-a", vec![a1, a2], 30, 1 << 30, &gref),
            container("pod-b", vec![b], 30, 2 << 30, &gref),
        ],
    };
    let display = Display::new(Arc::new(StaticSource::new(fixture)));
    let reader = NvmlReader::open(
        &node.lib_dir().join("libnvidia-ml.so.1"),
        Duration::from_secs(1),
    )
    .unwrap();
    let cancel = CancellationToken::new();
    let opts = DisplayOptions {
        socket: tmp.path().join("display.sock"),
        query_addr: "127.0.0.1:0".parse().unwrap(),
        sample_period: Duration::from_secs(1),
        ..Default::default()
    };
    let running = display
        .start(&opts, Some(Box::new(reader)), cancel.clone())
        .await
        .unwrap();
    display.set_ready(true);
    let addr = running.http_addr;

    // Two full windows after the first tick.
    let stats = display.sampler_stats();
    let t0 = Instant::now();
    while stats.ticks.load(Ordering::Relaxed) < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "sampler does not tick"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A scrape and the window it reflects (retry if a tick fell in between).
    let (text, window, taken) = loop {
        let snap = display.snapshot();
        let w0 = snap.gpu(0).and_then(|g| g.window_us);
        let (status, text) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
            .await
            .unwrap();
        assert_eq!(status, 200);
        let w1 = display.snapshot().gpu(0).and_then(|g| g.window_us);
        if let Some(w) = w0.filter(|_| w0 == w1) {
            break (text, w, snap.taken.unwrap());
        }
    };
    let samples = parse_with_prometheus_client(&text);

    // Ground truth over the same window, from the simulator's timeline.
    let truth: HashMap<u32, f64> = state
        .process_utilization(0, epoch_us_to_mono(window.0), epoch_us_to_mono(window.1))
        .into_iter()
        .map(|(p, pct)| (p.pid(), pct))
        .collect();
    let sum = |pids: &[u32]| {
        pids.iter()
            .map(|p| truth.get(p).copied().unwrap_or(0.0))
            .sum::<f64>()
    };
    for (pod, pids, nominal) in [("pod-a", vec![a1, a2], 25.0), ("pod-b", vec![b], 30.0)] {
        let expect = sum(&pids);
        // The loads run what they were asked to (sanity of the fixture).
        assert!(
            (expect - nominal).abs() < 5.0,
            "{pod}: ground truth {expect} vs nominal {nominal}"
        );
        let l = [
            ("pod", pod),
            ("namespace", "team"),
            ("container", "main"),
            ("node", "sim-node-1"),
            ("gpu", "0"),
            ("uuid", spec.uuid.as_str()),
        ];
        let got = value(&samples, "vcuda_container_gpu_utilization_ratio", &l) * 100.0;
        eprintln!("{pod}: metric {got:.2} %, ground truth {expect:.2} %, nominal {nominal} %");
        assert!(
            (got - expect).abs() <= 5.0,
            "{pod}: metric {got:.1} vs ground truth {expect:.1} over {window:?}"
        );
        let legacy = [
            ("pod_name", pod),
            ("namespace", "team"),
            ("container_name", "main"),
            ("node", "sim-node-1"),
        ];
        let total = value(
            &samples,
            "container_gpu_utilization",
            &[legacy.as_slice(), &[("gpu", "total")]].concat(),
        );
        let card = value(
            &samples,
            "container_gpu_utilization",
            &[legacy.as_slice(), &[("gpu", "gpu0")]].concat(),
        );
        assert!(
            (total - got).abs() < 1e-6 && (card - got).abs() < 1e-6,
            "{pod}: legacy {total} {card} vs {got}"
        );
        assert_eq!(
            value(
                &samples,
                "container_request_gpu_utilization",
                &[legacy.as_slice(), &[("req_of_gpu", "total")]].concat()
            ),
            0.3
        );
    }
    // Each load's context, its 8 MiB device heap and its module image (one
    // page) are its memory too, as with a real driver.
    let per_load = spec.context_overhead_bytes() + 8 * MIB + 4096;
    let la = [
        ("pod_name", "pod-a"),
        ("namespace", "team"),
        ("container_name", "main"),
        ("node", "sim-node-1"),
    ];
    let lb = [
        ("pod_name", "pod-b"),
        ("namespace", "team"),
        ("container_name", "main"),
        ("node", "sim-node-1"),
    ];
    assert_eq!(
        value(
            &samples,
            "container_request_gpu_memory",
            &[la.as_slice(), &[("req_of_gpu_memory", "total")]].concat()
        ),
        1024.0
    );
    assert_eq!(
        value(
            &samples,
            "container_request_gpu_memory",
            &[lb.as_slice(), &[("req_of_gpu_memory", "total")]].concat()
        ),
        2048.0
    );
    assert_eq!(
        value(
            &samples,
            "container_gpu_memory_total",
            &[la.as_slice(), &[("gpu_memory", "total")]].concat()
        ),
        (384 * MIB + 2 * per_load) as f64 / MIB as f64
    );
    let ca = [
        ("pod", "pod-a"),
        ("namespace", "team"),
        ("container", "main"),
        ("node", "sim-node-1"),
    ];
    assert_eq!(
        value(
            &samples,
            "vcuda_container_gpu_memory_used_bytes",
            &[ca.as_slice(), &[("gpu", "0")]].concat()
        ),
        (384 * MIB + 2 * per_load) as f64
    );
    assert_eq!(
        value(&samples, "vcuda_container_core_quota_ratio", &ca),
        0.3
    );
    assert_eq!(
        value(&samples, "vcuda_container_memory_quota_bytes", &ca),
        (1u64 << 30) as f64
    );
    assert_eq!(
        value(&samples, "vcuda_container_throttled_seconds_total", &ca),
        1.5
    );
    assert_eq!(
        value(&samples, "vcuda_container_allocations_refused_total", &ca),
        2.0
    );
    assert_eq!(
        value(&samples, "vcuda_container_compute_unattributed", &ca),
        1.0
    );

    // Per GPU: NVML's device utilization (all four loads, 65 % on average)
    // against the simulator's over the window NVML reported at the tick (a
    // real driver's: one 1/6 s period, in which these 100 ms bursts read
    // anywhere from ~50 to ~80 %), and memory of all processes.
    let g = [
        ("node", "sim-node-1"),
        ("gpu", "0"),
        ("uuid", spec.uuid.as_str()),
    ];
    let gpu_util = value(&samples, "vcuda_gpu_utilization_ratio", &g) * 100.0;
    let taken_us = taken.duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
    // The tick stamps its snapshot just after asking NVML: a window that
    // turned over in between is the one before.
    let truth_at = |back_us: u64| {
        let at = epoch_us_to_mono(taken_us.saturating_sub(back_us));
        let (from, to) = state.node().nvml_sampling.device_window(at);
        state.utilization(0, from, to)
    };
    let gpu_truth = [truth_at(0), truth_at(20_000)];
    eprintln!("GPU: metric {gpu_util:.0} %, ground truth {gpu_truth:.2?} % over its window");
    assert!(
        gpu_truth
            .iter()
            .any(|t| (gpu_util - t).abs() <= 1.0 && (t - 65.0).abs() <= 25.0),
        "GPU utilization {gpu_util} vs ground truth {gpu_truth:.1?} over its window"
    );
    assert_eq!(
        value(&samples, "vcuda_gpu_memory_used_bytes", &g),
        (960 * MIB + 4 * per_load) as f64
    );
    assert_eq!(
        value(&samples, "vcuda_gpu_memory_total_bytes", &g),
        spec.memory_bytes() as f64
    );
    assert_eq!(value(&samples, "vcuda_gpu_allocated_cores_ratio", &g), 0.6);
    assert_eq!(value(&samples, "vcuda_gpu_healthy", &g), 1.0);
    assert_eq!(value(&samples, "vcuda_gpu_tenants", &g), 2.0);
    assert_eq!(
        value(&samples, "vcuda_gpu_batch_held_seconds_total", &g),
        0.25
    );
    assert_eq!(value(&samples, "vcuda_gpu_batch_holds_total", &g), 7.0);
    assert_eq!(
        value(&samples, "vcuda_gpu_memory_lent_bytes", &g),
        (512 * MIB) as f64
    );
    assert!(value(&samples, "vcuda_display_samples_total", &[]) >= 3.0);
    assert!(value(&samples, "vcuda_display_sampler_cpu_seconds_total", &[]) > 0.0);
    assert_eq!(value(&samples, "vcuda_manager_ready", &[]), 1.0);

    // vcudactl on the same service: every container with its quotas and
    // PIDs; graph identical to /graph.
    let vcudactl = target_dir().join("vcudactl");
    assert!(
        vcudactl.is_file(),
        "{} missing: cargo build --workspace",
        vcudactl.display()
    );
    let out = Command::new(&vcudactl)
        .args([
            "--socket".as_ref(),
            opts.socket.as_os_str(),
            "usage".as_ref(),
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "vcudactl usage: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Rows by namespace and pod name (the UID only with --wide).
    let row = |pod: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["team", pod]))
            .unwrap_or_else(|| panic!("team/{pod} not in\n{table}"))
            .to_string()
    };
    let ra = row("pod-a");
    assert!(
        ra.contains("/ 30%")
            && ra.contains("/ 1024 MiB")
            && ra.contains(&format!("{},{}", a1.min(a2), a1.max(a2))),
        "{table}"
    );
    let rb = row("pod-b");
    assert!(
        rb.contains("/ 30%")
            && rb.contains(&format!("{} / 2048 MiB", (512 * MIB + per_load) / MIB))
            && rb.contains(&b.to_string()),
        "{table}"
    );
    let out = Command::new(&vcudactl)
        .args([
            "--socket".as_ref(),
            opts.socket.as_os_str(),
            "graph".as_ref(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let (_, http_graph) = tokio::task::spawn_blocking(move || http_get(addr, "/graph"))
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), http_graph);
    assert!(http_graph.contains("cores 60/100"), "{http_graph}");

    cancel.cancel();
    running.wait().await;
    assert!(!opts.socket.exists(), "socket removed on shutdown");
}
