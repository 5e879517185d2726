//! The extender at scale, without a cluster (`cargo bench -p vcuda-scheduler`):
//!
//! 1. 1,000 nodes × 8 GPUs (NVLink within each quad) with 10,000 placed
//!    pods (shares and whole GPUs): the cluster's rebuild from the API
//!    objects (time, memory), then `filter` + `prioritize` of pending pods
//!    over all 1,000 nodes (per call: p50, p99, max).
//! 2. A placement trace replayed three ways on 50 nodes × 4 GPUs: this
//!    extender (binpack), kube-scheduler alone (node totals, least
//!    allocated; what does not fit a GPU is refused at Allocate), and
//!    gpu-admission's rule (per-GPU fit, the node whose fitting GPU has the
//!    least free cores): pods placed, Allocate refusals, nodes touched.
//!
//! Prints a report; asserts nothing (figures go to docs/scheduler.md with
//! the machine named).

use std::time::Instant;

use gpu_allocator::inventory::{ANNOTATION, Inventory};
use gpu_allocator::{Allocator, GpuInfo, PcieLevel, Placement, Topology};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;
use vcuda_scheduler::api::ExtenderArgs;
use vcuda_scheduler::cluster::Cluster;
use vcuda_scheduler::extender::{filter, prioritize};
use vcuda_scheduler::policy::Policy;

/// xorshift: the same trace every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn allocator(gpus: usize) -> Allocator {
    let infos = (0..gpus)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32,
            memory_bytes: 80 << 30,
            numa_node: Some(i as u32 / 4),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
        })
        .collect();
    let pcie = |a: usize, b: usize| {
        if a / 4 == b / 4 {
            PcieLevel::Node
        } else {
            PcieLevel::System
        }
    };
    let links = |a: usize, b: usize| u32::from(a / 4 == b / 4) * 12;
    Allocator::new(Topology::from_fn(infos, pcie, links).unwrap())
}

fn node(name: &str, a: &Allocator) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name,
        "annotations": {ANNOTATION: Inventory::of(a, true).to_json()}}}))
    .unwrap()
}

/// A random request: mostly shares, some whole GPUs.
fn request(r: &mut Rng) -> (u64, u64) {
    match r.below(10) {
        0 => (100, 0),
        1 => (200, 0),
        _ => (10 * (1 + r.below(9)), 4 * (1 + r.below(16))),
    }
}

fn pod(name: &str, (cores, units): (u64, u64), placed: Option<(&str, String)>) -> Pod {
    let mut ann = serde_json::Map::new();
    let mut spec = json!({"containers": [{"name": "c", "resources": {"limits": {
        "tencent.com/vcuda-core": cores.to_string(), "tencent.com/vcuda-memory": units.to_string()}}}]});
    if let Some((n, minors)) = placed {
        ann.insert("tencent.com/predicate-gpu-idx-0".into(), json!(minors));
        spec["nodeName"] = json!(n);
    }
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": "b",
        "uid": name, "annotations": ann}, "spec": spec}))
    .unwrap()
}

fn minors(p: &Placement) -> String {
    p.gpus()
        .iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn scale() {
    let (n_nodes, n_pods) = (1000, 10_000);
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let mut allocs: Vec<Allocator> = (0..n_nodes).map(|_| allocator(8)).collect();
    let nodes: Vec<Node> = allocs
        .iter()
        .enumerate()
        .map(|(i, a)| node(&format!("n{i}"), a))
        .collect();
    let mut pods = Vec::with_capacity(n_pods);
    while pods.len() < n_pods {
        let req = request(&mut r);
        let i = r.below(n_nodes as u64) as usize;
        let rq = gpu_allocator::Request::from_totals(req.0, req.1, 1, true).unwrap();
        if let Ok(p) = allocs[i].allocate(format!("p{}", pods.len()), &rq) {
            let name = format!("p{}", pods.len());
            pods.push(pod(&name, req, Some((&format!("n{i}"), minors(&p)))));
        }
    }
    let rss0 = rss_kib();
    let t = Instant::now();
    let cluster = Cluster::build(&nodes, &pods);
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    let grown = rss_kib().saturating_sub(rss0);
    let names: Vec<String> = (0..n_nodes).map(|i| format!("n{i}")).collect();
    let mut lat = Vec::new();
    for k in 0..200 {
        let args = ExtenderArgs {
            pod: pod(&format!("new{k}"), request(&mut r), None),
            nodes: None,
            node_names: Some(names.clone()),
        };
        let t = Instant::now();
        let f = filter(&cluster, &args);
        let fits = f.node_names.clone().unwrap();
        let pa = ExtenderArgs {
            node_names: Some(fits),
            ..args
        };
        prioritize(&cluster, &pa, Policy::Binpack).unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let max = lat.iter().cloned().fold(0.0, f64::max);
    let event_ms = one_pod_changed(&nodes, &pods);
    println!(
        "scale: {n_nodes} nodes x 8 GPUs, {} placed pods",
        pods.len()
    );
    println!(
        "  cluster rebuilt from the API objects in {build_ms:.1} ms, RSS +{} MiB",
        grown / 1024
    );
    println!(
        "  after one pod's event (its node rebuilt, the others kept; 200 events): p50 {:.2} ms, p99 {:.2} ms",
        percentile(&mut event_ms.clone(), 0.5),
        percentile(&mut event_ms.clone(), 0.99)
    );
    println!(
        "  filter + prioritize over {n_nodes} nodes (200 pods): p50 {:.2} ms, p99 {:.2} ms, max {max:.2} ms",
        percentile(&mut lat, 0.5),
        percentile(&mut lat, 0.99)
    );
}

/// One strategy's node choice for a request, given each node's allocator.
type Choose = fn(&[Allocator], &gpu_allocator::Request) -> Option<usize>;

fn extender_choice(nodes: &[Allocator], rq: &gpu_allocator::Request) -> Option<usize> {
    // Binpack: the fullest node (by allocated cores) where it fits.
    let used = |a: &Allocator| a.usages().iter().map(|u| u.allocated_cores).sum::<u32>();
    (0..nodes.len())
        .filter(|&i| nodes[i].evaluate(rq).is_ok())
        .max_by_key(|&i| (used(&nodes[i]) + rq.cores, std::cmp::Reverse(i)))
}

fn default_choice(nodes: &[Allocator], rq: &gpu_allocator::Request) -> Option<usize> {
    // Node totals only (kubelet's allocatable), least allocated first.
    let free = |a: &Allocator| {
        let u = a.usages();
        (
            u.iter().map(|g| g.free_cores()).sum::<u32>(),
            u.iter().map(|g| g.free_memory_units()).sum::<u64>(),
        )
    };
    (0..nodes.len())
        .filter(|&i| {
            let (c, m) = free(&nodes[i]);
            c >= rq.cores && m >= rq.memory_units
        })
        .max_by_key(|&i| (free(&nodes[i]).0, std::cmp::Reverse(i)))
}

fn admission_choice(nodes: &[Allocator], rq: &gpu_allocator::Request) -> Option<usize> {
    // gpu-admission: per-GPU fit; the node whose chosen GPU has the least
    // free cores (least free first), whole GPUs on any node that fits.
    (0..nodes.len())
        .filter_map(|i| {
            let p = nodes[i].evaluate(rq).ok()?;
            let free: u32 = p
                .gpus()
                .iter()
                .map(|&g| nodes[i].usage(g).free_cores())
                .sum();
            Some((free, i))
        })
        .min()
        .map(|(_, i)| i)
}

/// (pods placed, cores placed, refused at Allocate, nodes touched).
fn replay(choose: Choose, trace: &[(u64, u64)]) -> (usize, u64, usize, usize) {
    let mut nodes: Vec<Allocator> = (0..50).map(|_| allocator(4)).collect();
    let (mut placed, mut cores, mut refused) = (0, 0, 0);
    for (k, req) in trace.iter().enumerate() {
        let rq = gpu_allocator::Request::from_totals(req.0, req.1, 1, true).unwrap();
        let Some(i) = choose(&nodes, &rq) else {
            continue;
        };
        match nodes[i].allocate(format!("p{k}"), &rq) {
            Ok(_) => {
                placed += 1;
                cores += req.0;
            }
            Err(_) => refused += 1, // placed on the node, refused at Allocate
        }
    }
    let touched = nodes
        .iter()
        .filter(|a| a.usages().iter().any(|u| !u.is_idle()))
        .count();
    (placed, cores, refused, touched)
}

fn trace() {
    let mut r = Rng(0x2545_f491_4f6c_dd1d);
    let all: Vec<(u64, u64)> = (0..1000).map(|_| request(&mut r)).collect();
    // ~60 % of the 20,000 cores asked, then far more than fit.
    for n in [170, 1000] {
        let trace = &all[..n];
        let asked: u64 = trace.iter().map(|r| r.0).sum();
        println!("trace: {n} pods asking {asked} cores onto 50 nodes x 4 GPUs (20,000 cores):");
        println!(
            "  {:<38} {:>6} {:>7} {:>9} {:>8}",
            "strategy", "pods", "cores", "refused*", "nodes"
        );
        for (name, f) in [
            ("vcuda-scheduler (binpack)", extender_choice as Choose),
            ("kube-scheduler alone (least allocated)", default_choice),
            ("gpu-admission (least free cores)", admission_choice),
        ] {
            let (p, c, x, t) = replay(f, trace);
            println!("  {name:<38} {p:>6} {c:>7} {x:>9} {t:>8}");
        }
    }
    println!("  * placed on a node, then refused at Allocate (UnexpectedAdmissionError)");
}

fn main() {
    scale();
    trace();
}

/// The view updated after one pod's event (the stores copied, as the
/// extender's reflectors give them, and its node rebuilt), 200 times:
/// what the extender pays per watch event since `changes`, instead of a
/// whole rebuild.
fn one_pod_changed(nodes: &[Node], pods: &[Pod]) -> Vec<f64> {
    use std::sync::Arc;
    use vcuda_scheduler::changes::Changes;
    let ns: Vec<Arc<Node>> = nodes.iter().cloned().map(Arc::new).collect();
    let ps: Vec<Arc<Pod>> = pods.iter().cloned().map(Arc::new).collect();
    let now = std::time::SystemTime::now();
    let mut changes = Changes::default();
    let mut view = changes.take().apply(
        &Arc::new(Cluster::default()),
        || (ns.clone(), ps.clone()),
        now,
    );
    let mut out = Vec::with_capacity(200);
    for k in 0..200 {
        changes.pod(&ps[k * 37 % ps.len()], false);
        let t = Instant::now();
        view = changes
            .take()
            .apply(&view, || (ns.clone(), ps.clone()), now);
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    out
}
