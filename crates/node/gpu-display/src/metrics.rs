//! Prometheus metrics: the manager's own counters (registered once, bumped
//! by the manager through [`ManagerMetrics`]) and the per-GPU / per-container
//! gauges, rebuilt on each scrape from the source and the sampler's snapshot
//! so that containers that left simply disappear.

use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus::proto::MetricFamily;
use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounterVec, Opts, Registry,
    TextEncoder,
};

use crate::sampler::{SamplerStats, Snapshot};
use crate::source::{ContainerView, GpuView};
use crate::usage::{GpuUse, container_use};

const MIB: f64 = 1024.0 * 1024.0;

/// Content type of the text exposition format.
pub const TEXT_FORMAT: &str = prometheus::TEXT_FORMAT;

/// The manager's two extended resources.
pub const RESOURCES: [&str; 2] = ["tencent.com/vcuda-core", "tencent.com/vcuda-memory"];

/// Counters the manager bumps. Cheap to clone; all clones feed one registry.
#[derive(Clone)]
pub struct ManagerMetrics {
    allocations: IntCounterVec,
    failures: IntCounterVec,
    allocate_seconds: Histogram,
    recovery_seconds: Gauge,
    ready: Gauge,
    escapes: IntCounterVec,
}

impl ManagerMetrics {
    fn new(registry: &Registry, version: &str) -> ManagerMetrics {
        let allocations = IntCounterVec::new(
            Opts::new(
                "vcuda_manager_allocations_total",
                "Allocate calls the manager answered with devices, by extended resource.",
            ),
            &["resource"],
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "vcuda_manager_allocation_failures_total",
                "Allocate calls the manager refused or failed, by extended resource and reason.",
            ),
            &["resource", "reason"],
        )
        .expect("valid metric");
        let allocate_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "vcuda_manager_allocate_duration_seconds",
                "Time to answer a device-plugin Allocate call.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )
        .expect("valid metric");
        let recovery_seconds = Gauge::new(
            "vcuda_manager_recovery_duration_seconds",
            "Time the last start-up recovery (checkpoint + live containers) took.",
        )
        .expect("valid metric");
        let ready = Gauge::new(
            "vcuda_manager_ready",
            "1 once the manager serves allocations (what /readyz reports).",
        )
        .expect("valid metric");
        let escapes = IntCounterVec::new(
            Opts::new(
                "vcuda_container_escapes_total",
                "GPU use the interposer did not see, found from outside the process: a share's process that never registered, a share over its memory quota on NVML's count.",
            ),
            &["namespace", "pod", "container", "reason"],
        )
        .expect("valid metric");
        let build = GaugeVec::new(
            Opts::new(
                "vcuda_manager_build_info",
                "Version of the running manager; always 1.",
            ),
            &["version"],
        )
        .expect("valid metric");
        build.with_label_values(&[version]).set(1.0);
        // Series from 0 from the start, so rate() sees the first allocation.
        for r in RESOURCES {
            allocations.with_label_values(&[r]);
        }
        for c in [
            Box::new(allocations.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(failures.clone()),
            Box::new(allocate_seconds.clone()),
            Box::new(recovery_seconds.clone()),
            Box::new(ready.clone()),
            Box::new(escapes.clone()),
            Box::new(build),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        ManagerMetrics {
            allocations,
            failures,
            allocate_seconds,
            recovery_seconds,
            ready,
            escapes,
        }
    }

    /// The escape guard found something (`reason`: a fixed word).
    pub fn escape(&self, namespace: &str, pod: &str, container: &str, reason: &str) {
        self.escapes
            .with_label_values(&[namespace, pod, container, reason])
            .inc();
    }

    /// An Allocate for `resource` (e.g. `tencent.com/vcuda-core`) succeeded.
    pub fn allocation_succeeded(&self, resource: &str) {
        self.allocations.with_label_values(&[resource]).inc();
    }

    /// An Allocate failed; `reason` is a short fixed word (`insufficient`,
    /// `invalid`, `internal`...), never free text: it is a label value.
    pub fn allocation_failed(&self, resource: &str, reason: &str) {
        self.failures.with_label_values(&[resource, reason]).inc();
    }

    /// How long one Allocate took.
    pub fn observe_allocate(&self, took: Duration) {
        self.allocate_seconds.observe(took.as_secs_f64());
    }

    /// How long the start-up recovery took.
    pub fn set_recovery_duration(&self, took: Duration) {
        self.recovery_seconds.set(took.as_secs_f64());
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.set(if ready { 1.0 } else { 0.0 });
    }
}

/// The registry of long-lived metrics plus what each scrape adds.
pub(crate) struct MetricsRegistry {
    registry: Registry,
    pub(crate) manager: ManagerMetrics,
}

impl MetricsRegistry {
    pub(crate) fn new(version: &str) -> MetricsRegistry {
        let registry = Registry::new();
        let manager = ManagerMetrics::new(&registry, version);
        MetricsRegistry { registry, manager }
    }

    /// The whole exposition, in the text format.
    pub(crate) fn render(
        &self,
        node: &str,
        gpus: &[GpuView],
        containers: &[ContainerView],
        mig: &MigState,
        snap: &Snapshot,
        stats: &SamplerStats,
    ) -> String {
        let mut fams = self.registry.gather();
        fams.extend(scrape_families(node, gpus, containers, snap, stats));
        fams.extend(mig.families(node));
        fams.sort_by(|a, b| a.name().cmp(b.name()));
        let mut out = Vec::with_capacity(64 * 1024);
        TextEncoder::new()
            .encode(&fams, &mut out)
            .expect("text encoding of valid families");
        String::from_utf8(out).expect("text format is UTF-8")
    }
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique");
    g
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> CounterVec {
    let c = CounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique");
    c
}

/// Families built from the current state: per GPU, per container, the
/// original's four gauges, and the sampler's own figures. A fresh registry
/// each scrape, so containers that left simply disappear.
fn scrape_families(
    node: &str,
    gpus: &[GpuView],
    containers: &[ContainerView],
    snap: &Snapshot,
    stats: &SamplerStats,
) -> Vec<MetricFamily> {
    let r = Registry::new();
    let per_gpu = GpuGauges::register(&r);
    for g in gpus {
        per_gpu.record(node, g, snap);
    }
    if snap.gpus.iter().any(|g| !g.mig.is_empty()) {
        let per_mig = MigGauges::register(&r);
        for g in &snap.gpus {
            per_mig.record(node, g);
        }
    }
    let per_container = ContainerGauges::register(&r);
    let legacy = LegacyGauges::register(&r);
    for c in containers {
        let uses = container_use(c, snap);
        per_container.record(node, c, &uses);
        legacy.record(node, c, &uses);
    }
    record_sampler(&r, stats, snap);
    r.gather()
}

/// `vcuda_gpu_*`: one series per GPU, labelled node, index, UUID.
struct GpuGauges {
    util: GaugeVec,
    mem_used: GaugeVec,
    mem_total: GaugeVec,
    cores: GaugeVec,
    mem_alloc: GaugeVec,
    healthy: GaugeVec,
    tenants: GaugeVec,
    held: CounterVec,
    holds: CounterVec,
    lent: GaugeVec,
}

impl GpuGauges {
    fn register(r: &Registry) -> GpuGauges {
        const G: &[&str] = &["node", "gpu", "uuid"];
        GpuGauges {
            util: gauge(
                r,
                "vcuda_gpu_utilization_ratio",
                "Fraction of time the GPU ran kernels (NVML utilization.gpu / 100).",
                G,
            ),
            mem_used: gauge(
                r,
                "vcuda_gpu_memory_used_bytes",
                "GPU memory in use, all processes (NVML).",
                G,
            ),
            mem_total: gauge(r, "vcuda_gpu_memory_total_bytes", "GPU memory size.", G),
            cores: gauge(
                r,
                "vcuda_gpu_allocated_cores_ratio",
                "Fraction of the GPU's cores handed out to containers (vcuda-core / 100).",
                G,
            ),
            mem_alloc: gauge(
                r,
                "vcuda_gpu_allocated_memory_bytes",
                "GPU memory handed out to containers as quotas.",
                G,
            ),
            healthy: gauge(
                r,
                "vcuda_gpu_healthy",
                "1 if the GPU is healthy (no fatal Xid), 0 if the manager took it out.",
                G,
            ),
            tenants: gauge(
                r,
                "vcuda_gpu_tenants",
                "Containers holding a share or all of the GPU.",
                G,
            ),
            held: counter(
                r,
                "vcuda_gpu_batch_held_seconds_total",
                "Time batch-tier launches on the GPU were held while a latency-tier tenant had work (docs/qos.md).",
                G,
            ),
            holds: counter(
                r,
                "vcuda_gpu_batch_holds_total",
                "Batch-tier launches on the GPU that waited for a latency-tier tenant.",
                G,
            ),
            lent: gauge(
                r,
                "vcuda_gpu_memory_lent_bytes",
                "GPU memory shares hold above their guarantees (borrowed under a memory limit).",
                G,
            ),
        }
    }

    /// The manager's view of `g` plus the sampler's figures (0 while the
    /// sampler has none for it).
    fn record(&self, node: &str, g: &GpuView, snap: &Snapshot) {
        let idx = g.index.to_string();
        let l = [node, idx.as_str(), g.uuid.as_str()];
        let s = snap.gpu(g.index);
        self.util
            .with_label_values(&l)
            .set(s.map(|s| s.utilization_percent / 100.0).unwrap_or(0.0));
        self.mem_used
            .with_label_values(&l)
            .set(s.map(|s| s.memory_used_bytes as f64).unwrap_or(0.0));
        self.mem_total
            .with_label_values(&l)
            .set(g.memory_total_bytes as f64);
        self.cores
            .with_label_values(&l)
            .set(g.allocated_cores as f64 / 100.0);
        self.mem_alloc
            .with_label_values(&l)
            .set(g.allocated_memory_bytes as f64);
        self.healthy
            .with_label_values(&l)
            .set(if g.healthy { 1.0 } else { 0.0 });
        self.tenants.with_label_values(&l).set(g.tenants as f64);
        if let Some(s) = g.batch_held_seconds {
            self.held.with_label_values(&l).inc_by(s.max(0.0));
        }
        if let Some(n) = g.batch_holds {
            self.holds.with_label_values(&l).inc_by(n as f64);
        }
        self.lent
            .with_label_values(&l)
            .set(g.memory_lent_bytes as f64);
    }
}

/// `vcuda_mig_device_*`: one series per MIG device, labelled node, the
/// parent's index, the MIG UUID and the profile (only on nodes with one).
struct MigGauges {
    mem_total: GaugeVec,
    mem_used: GaugeVec,
    processes: GaugeVec,
}

impl MigGauges {
    fn register(r: &Registry) -> MigGauges {
        const M: &[&str] = &["node", "gpu", "uuid", "profile"];
        MigGauges {
            mem_total: gauge(
                r,
                "vcuda_mig_device_memory_total_bytes",
                "Memory of the MIG device's GPU instance.",
                M,
            ),
            mem_used: gauge(
                r,
                "vcuda_mig_device_memory_used_bytes",
                "GPU memory the processes on the MIG device hold (NVML).",
                M,
            ),
            processes: gauge(
                r,
                "vcuda_mig_device_processes",
                "Processes running on the MIG device.",
                M,
            ),
        }
    }

    fn record(&self, node: &str, g: &crate::sampler::GpuSample) {
        let idx = g.index.to_string();
        for m in &g.mig {
            let l = [node, idx.as_str(), m.uuid.as_str(), m.profile.as_str()];
            self.mem_total
                .with_label_values(&l)
                .set(m.memory_total_bytes as f64);
            self.mem_used
                .with_label_values(&l)
                .set(m.memory_used_bytes as f64);
            self.processes.with_label_values(&l).set(m.processes as f64);
        }
    }
}

/// `vcuda_container_*`: use per (container, GPU), quotas and the
/// interposer's ledger per container.
struct ContainerGauges {
    util: GaugeVec,
    mem: GaugeVec,
    core_quota: GaugeVec,
    mem_quota: GaugeVec,
    throttled: CounterVec,
    refused: CounterVec,
    unattributed: GaugeVec,
    borrowed: GaugeVec,
    reclaims: CounterVec,
    batch_held: CounterVec,
}

impl ContainerGauges {
    fn register(r: &Registry) -> ContainerGauges {
        const C: &[&str] = &["node", "namespace", "pod", "container"];
        const CG: &[&str] = &["node", "namespace", "pod", "container", "gpu", "uuid"];
        ContainerGauges {
            util: gauge(
                r,
                "vcuda_container_gpu_utilization_ratio",
                "Fraction of the GPU's time the container's processes ran kernels (NVML process samples of its host PIDs).",
                CG,
            ),
            mem: gauge(
                r,
                "vcuda_container_gpu_memory_used_bytes",
                "GPU memory held by the container's processes (NVML).",
                CG,
            ),
            core_quota: gauge(
                r,
                "vcuda_container_core_quota_ratio",
                "The container's core quota in GPUs (vcuda-core / 100).",
                C,
            ),
            mem_quota: gauge(
                r,
                "vcuda_container_memory_quota_bytes",
                "The container's GPU memory quota.",
                C,
            ),
            throttled: counter(
                r,
                "vcuda_container_throttled_seconds_total",
                "Time the interposer held the container's kernel launches back for its core quota.",
                C,
            ),
            refused: counter(
                r,
                "vcuda_container_allocations_refused_total",
                "GPU memory allocations the interposer refused for the container's memory quota.",
                C,
            ),
            unattributed: gauge(
                r,
                "vcuda_container_compute_unattributed",
                "1 while the interposer's compute quota cannot attribute NVML samples to the container (PID namespace, MPS, MIG) and holds it by a fallback.",
                C,
            ),
            borrowed: gauge(
                r,
                "vcuda_container_memory_borrowed_bytes",
                "GPU memory the container holds above its memory quota, lent from memory no share is guaranteed.",
                C,
            ),
            reclaims: counter(
                r,
                "vcuda_container_memory_reclaims_total",
                "The container's processes ended to give borrowed GPU memory back to a guaranteed allocation.",
                C,
            ),
            batch_held: counter(
                r,
                "vcuda_container_batch_held_seconds_total",
                "Time the container's batch-tier launches waited while a latency-tier tenant of their GPU had work (docs/qos.md).",
                C,
            ),
        }
    }

    /// Ledger figures the interposer does not keep (`None`) get no series.
    fn record(&self, node: &str, c: &ContainerView, uses: &[GpuUse]) {
        let cl = [
            node,
            c.namespace.as_str(),
            c.pod_name.as_str(),
            c.container.as_str(),
        ];
        for u in uses {
            let idx = u.gpu.index.to_string();
            let l = [
                cl[0],
                cl[1],
                cl[2],
                cl[3],
                idx.as_str(),
                u.gpu.uuid.as_str(),
            ];
            self.util
                .with_label_values(&l)
                .set(u.utilization_percent / 100.0);
            self.mem
                .with_label_values(&l)
                .set(u.memory_used_bytes as f64);
        }
        self.core_quota
            .with_label_values(&cl)
            .set(c.core_quota as f64 / 100.0);
        self.mem_quota
            .with_label_values(&cl)
            .set(c.memory_quota_bytes as f64);
        if let Some(t) = c.throttled_seconds {
            self.throttled.with_label_values(&cl).inc_by(t.max(0.0));
        }
        if let Some(n) = c.refused_allocations {
            self.refused.with_label_values(&cl).inc_by(n as f64);
        }
        if let Some(b) = c.memory_borrowed_bytes {
            self.borrowed.with_label_values(&cl).set(b as f64);
        }
        if let Some(s) = c.batch_held_seconds {
            self.batch_held.with_label_values(&cl).inc_by(s.max(0.0));
        }
        if let Some(n) = c.memory_reclaims {
            self.reclaims.with_label_values(&cl).inc_by(n as f64);
        }
        if let Some(b) = c.compute_unattributed {
            self.unattributed
                .with_label_values(&cl)
                .set(if b { 1.0 } else { 0.0 });
        }
    }
}

/// The original gpu-manager's four gauges, with its labels and units
/// (percent, MiB), so its dashboards keep working.
struct LegacyGauges {
    util: GaugeVec,
    mem: GaugeVec,
    req_util: GaugeVec,
    req_mem: GaugeVec,
}

impl LegacyGauges {
    fn register(r: &Registry) -> LegacyGauges {
        const L: &[&str] = &["pod_name", "namespace", "node", "container_name"];
        LegacyGauges {
            util: gauge(
                r,
                "container_gpu_utilization",
                "gpu utilization",
                &[L, &["gpu"]].concat(),
            ),
            mem: gauge(
                r,
                "container_gpu_memory_total",
                "gpu memory usage in MiB",
                &[L, &["gpu_memory"]].concat(),
            ),
            req_util: gauge(
                r,
                "container_request_gpu_utilization",
                "request of gpu utilization",
                &[L, &["req_of_gpu"]].concat(),
            ),
            req_mem: gauge(
                r,
                "container_request_gpu_memory",
                "request of gpu memory in MiB",
                &[L, &["req_of_gpu_memory"]].concat(),
            ),
        }
    }

    /// One series per GPU (`gpu<index>`) and a `total`, as the original.
    fn record(&self, node: &str, c: &ContainerView, uses: &[GpuUse]) {
        let ll = [
            c.pod_name.as_str(),
            c.namespace.as_str(),
            node,
            c.container.as_str(),
        ];
        let (mut util_total, mut mem_total) = (0.0, 0.0);
        for u in uses {
            let card = format!("gpu{}", u.gpu.index);
            let (pct, mib) = (u.utilization_percent, u.memory_used_bytes as f64 / MIB);
            util_total += pct;
            mem_total += mib;
            self.util.with_label_values(&plus(ll, &card)).set(pct);
            self.mem.with_label_values(&plus(ll, &card)).set(mib);
        }
        self.util
            .with_label_values(&plus(ll, "total"))
            .set(util_total);
        self.mem
            .with_label_values(&plus(ll, "total"))
            .set(mem_total);
        self.req_util
            .with_label_values(&plus(ll, "total"))
            .set(c.core_quota as f64 / 100.0);
        self.req_mem
            .with_label_values(&plus(ll, "total"))
            .set(c.memory_quota_bytes as f64 / MIB);
    }
}

/// `labels` and one more.
fn plus<'a>(labels: [&'a str; 4], last: &'a str) -> [&'a str; 5] {
    [labels[0], labels[1], labels[2], labels[3], last]
}

/// `vcuda_display_*`: the sampler's own cost and freshness.
fn record_sampler(r: &Registry, stats: &SamplerStats, snap: &Snapshot) {
    let none: &[&str] = &[];
    counter(
        r,
        "vcuda_display_sampler_cpu_seconds_total",
        "CPU time the NVML sampler thread used.",
        none,
    )
    .with_label_values(none)
    .inc_by(stats.cpu_ns.load(Ordering::Relaxed) as f64 / 1e9);
    counter(
        r,
        "vcuda_display_samples_total",
        "NVML sampling rounds.",
        none,
    )
    .with_label_values(none)
    .inc_by(stats.ticks.load(Ordering::Relaxed) as f64);
    counter(
        r,
        "vcuda_display_sample_errors_total",
        "NVML sampling rounds that failed (the previous sample was kept).",
        none,
    )
    .with_label_values(none)
    .inc_by(stats.errors.load(Ordering::Relaxed) as f64);
    gauge(
        r,
        "vcuda_display_sample_duration_seconds",
        "Wall time of the last NVML sampling round.",
        none,
    )
    .with_label_values(none)
    .set(stats.last_tick_ns.load(Ordering::Relaxed) as f64 / 1e9);
    if let Some(t) = snap.taken {
        gauge(
            r,
            "vcuda_display_sample_timestamp_seconds",
            "When the figures were sampled (Unix time).",
            none,
        )
        .with_label_values(none)
        .set(
            t.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
        );
    }
}

mod mig_state;
pub(crate) use mig_state::MigState;
