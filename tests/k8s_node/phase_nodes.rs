//! Phase 2c: three nodes under one API server and kube-scheduler (with
//! `vcuda-scheduler` as its extender): this node and two more
//! (`cluster.sh node-up 2|3`: each its own address, client certificate,
//! containerd, CNI bridge, cgroup root and, in a mount namespace of its
//! own, `/var/lib/kubelet`), each with its own simulated 4-GPU node and
//! manager (`nsenter` into that namespace).
//!
//! 200 pods of random shares and whole GPUs (the same seeded trace every
//! run) across the three nodes, the extender killed with -9 while they are
//! being placed and started again: no pod fails admission, no GPU holds
//! over 100 cores or over its memory, and the cores placed are at least
//! gpu-admission's rule's on the same trace (replayed here in creation
//! order).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use gpu_allocator::inventory::Inventory;
use serde_json::Value;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::{MANAGER_PORT, wait};

use crate::host_manager::{HostManager, Site};
use crate::phase_sched::{Extender, scheduler_config};

const PODS: usize = 200;

/// Where every node's pods find their node's simulated driver state: a
/// bind mount of that node's `run/gpu-sim` in each node's namespace.
fn state_dir(c: &Cluster) -> PathBuf {
    c.dir.join("gpu-sim-state")
}

/// `mount --bind src dst`, in the mount namespace of `pid` (or here).
fn bind(pid: Option<u32>, src: &std::path::Path, dst: &std::path::Path) {
    let mut cmd = match pid {
        Some(p) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--mount=/proc/{p}/ns/mnt"))
                .arg("--")
                .arg("mount");
            c
        }
        None => Command::new("mount"),
    };
    let st = cmd.arg("--bind").arg(src).arg(dst).status().unwrap();
    assert!(
        st.success(),
        "mount --bind {} {}",
        src.display(),
        dst.display()
    );
}

/// Node K (2, 3): up, its simulated GPUs, the busybox image, its manager.
fn node(c: &Cluster, k: u32) -> (String, HostManager) {
    let name = c.node_up(k);
    let w = Work::new(&c.dir.join(format!("node-{k}/work")));
    w.install_sim();
    let pid = c.node_pid(k);
    bind(Some(pid), &w.sim.join("run/gpu-sim"), &state_dir(c));
    let tar = c.dir.join("work/busybox-rootfs.tar");
    c.script_ok(&[
        "import",
        tar.to_str().unwrap(),
        c.node_containerd(k).to_str().unwrap(),
    ]);
    let mut m = HostManager::start_at(
        c,
        Site {
            node: &name,
            w: &w,
            port: MANAGER_PORT + k as u16,
            containerd: c.node_containerd(k),
            prefix: vec![
                "nsenter".into(),
                format!("--mount=/proc/{pid}/ns/mnt"),
                "--".into(),
            ],
        },
    );
    m.wait_ready(120);
    (name, m)
}

/// The seeded trace: (cores, memory units); one pod in ten a whole GPU,
/// one in ten two, the rest shares of 10-90 cores and 1-16 units.
fn trace() -> Vec<(u32, u32)> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    (0..PODS)
        .map(|_| match next(10) {
            0 => (100, 0),
            1 => (200, 0),
            _ => (10 * (1 + next(9) as u32), 1 + next(16) as u32),
        })
        .collect()
}

fn pods(c: &Cluster) -> Vec<Value> {
    c.json(&["pods", "-l", "group=trace"])
        .map(|v| v["items"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default()
}

fn phase(p: &Value) -> &str {
    p["status"]["phase"].as_str().unwrap_or("")
}

/// Whether the scheduler is done with the pod: Running, or found to fit
/// on no node ("0/3 nodes are available: …"). kube-scheduler 1.20 records
/// every failed attempt as Unschedulable, one whose extender could not be
/// reached or whose bind was cut off by the kill too; such a pod is tried
/// again (within a minute), so it is not decided yet.
fn decided(p: &Value) -> bool {
    let no_fit = |c: &Value| {
        c["type"] == "PodScheduled"
            && c["reason"] == "Unschedulable"
            && c["message"].as_str().is_some_and(|m| m.starts_with("0/"))
    };
    phase(p) == "Running"
        || p["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(no_fit))
}

fn limit(p: &Value, r: &str) -> u64 {
    p["spec"]["containers"][0]["resources"]["limits"][r]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Every Running pod's cores and memory units on its node's GPUs (from the
/// GPUs its annotation names); panics on any GPU over its capacity.
fn check_no_overcommit(c: &Cluster, ps: &[Value], units_per_gpu: u64) -> (u64, GpuUse) {
    let mut use_ = GpuUse::new();
    let mut placed = 0;
    for p in ps.iter().filter(|p| phase(p) == "Running") {
        let node = p["spec"]["nodeName"].as_str().unwrap().to_string();
        let gpus: Vec<String> = p["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"]
            .as_str()
            .unwrap_or_else(|| panic!("a running pod without its GPUs: {}", p["metadata"]))
            .split(',')
            .map(str::to_string)
            .collect();
        let cores = limit(p, "tencent.com/vcuda-core");
        placed += cores;
        let units = limit(p, "tencent.com/vcuda-memory");
        for g in &gpus {
            let e = use_.entry((node.clone(), g.clone())).or_default();
            if cores >= 100 {
                *e = (e.0 + 100, e.1 + units_per_gpu);
            } else {
                *e = (e.0 + cores, e.1 + units);
            }
        }
    }
    for ((n, g), (cores, units)) in &use_ {
        assert!(
            *cores <= 100 && *units <= units_per_gpu,
            "{n} GPU {g}: {cores} cores, {units} units (of {units_per_gpu}); cluster dir {}",
            c.dir.display()
        );
    }
    (placed, use_)
}

/// Cores and memory units the Running pods hold, per (node, GPU).
type GpuUse = BTreeMap<(String, String), (u64, u64)>;

/// gpu-admission's rule on the same trace, in creation order: per-GPU
/// fit; of the nodes where a pod fits, the one whose chosen GPUs have the
/// least free cores. Returns the cores it places.
fn admission_rule(inv: &Inventory, nodes: usize, trace: &[(u32, u32)]) -> u64 {
    let mut a: Vec<_> = (0..nodes).map(|_| inv.allocator()).collect();
    let mut placed = 0;
    for (k, &(cores, units)) in trace.iter().enumerate() {
        let rq = gpu_allocator::Request::from_totals(cores.into(), units.into(), 1, true).unwrap();
        let best = (0..nodes)
            .filter_map(|i| {
                let p = a[i].evaluate(&rq).ok()?;
                let free: u32 = p.gpus().iter().map(|&g| a[i].usage(g).free_cores()).sum();
                Some((free, i))
            })
            .min();
        if let Some((_, i)) = best {
            a[i].allocate(format!("p{k}"), &rq).unwrap();
            placed += u64::from(cores);
        }
    }
    placed
}

/// 13 pods of 30 cores for 4-GPU nodes: with three nodes the 13th goes
/// to another node, never to a full one (no admission error).
fn thirteen(c: &Cluster, w: &Work, names: &[&str]) {
    for i in 0..13 {
        let y = pod_yaml(
            w,
            &format!("t13-{i}"),
            30,
            1,
            "sleep 1000000",
            ", group: t13",
        )
        .replace(
            &w.sim.join("run/gpu-sim").display().to_string(),
            &state_dir(c).display().to_string(),
        );
        c.apply(&y);
    }
    let ps = wait("13 pods Running", 180, || {
        let ps = c
            .json(&["pods", "-l", "group=t13"])?
            .get("items")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        no_pod_failed(&ps);
        let up = ps.iter().filter(|p| phase(p) == "Running").count();
        if up == 13 {
            Ok(ps)
        } else {
            Err(format!("{up} Running"))
        }
    });
    let mut by_node: BTreeMap<String, usize> = BTreeMap::new();
    for p in &ps {
        *by_node
            .entry(p["spec"]["nodeName"].as_str().unwrap_or("").to_string())
            .or_default() += 1;
    }
    assert!(by_node.values().all(|&n| n <= 12), "{by_node:?}");
    assert!(
        by_node.keys().all(|n| names.contains(&n.as_str())),
        "{by_node:?}"
    );
    eprintln!("k8s_node: 13 x 30 cores over three nodes: {by_node:?}");
    c.kubectl_ok(&[
        "delete",
        "pods",
        "-l",
        "group=t13",
        "--grace-period=1",
        "--wait=true",
    ]);
}

pub fn run(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 2c: three nodes, kube-scheduler with the extender, a 200-pod trace");
    crate::phase_sched::wait_no_pods(c);
    // Two more nodes and 200 pods load the host: the other real-node
    // suite's sim-timed figures wait (until this phase returns).
    let _load = test_support::k8s::host_load::HostLoad::heavy("phase 2c (three nodes, 200 pods)");
    std::fs::create_dir_all(state_dir(c)).unwrap();
    bind(None, &w.sim.join("run/gpu-sim"), &state_dir(c));
    let t_up = Instant::now();
    let extra: Vec<(String, HostManager)> = [2, 3].into_iter().map(|k| node(c, k)).collect();
    let up_s = t_up.elapsed().as_secs_f64();
    let names: Vec<&str> = std::iter::once(c.node.as_str())
        .chain(extra.iter().map(|(n, _)| n.as_str()))
        .collect();
    let mut ext = Extender::start(c);
    c.script_ok(&["scheduler-restart", scheduler_config(c).to_str().unwrap()]);
    // Every node's inventory published and in the extender's cache.
    let inv = wait("three inventories", 60, || {
        let mut last = None;
        for n in &names {
            let node = c.json(&["node", n])?;
            let v = node["metadata"]["annotations"]["tencent.com/vcuda-gpu-inventory"]
                .as_str()
                .ok_or(format!("{n}: none yet"))?;
            last = Some(Inventory::from_json(v).map_err(|e| e.to_string())?);
        }
        Ok(last.unwrap())
    });
    thirteen(c, w, &names);
    let trace = trace();
    let docs: Vec<String> = trace
        .iter()
        .enumerate()
        .map(|(i, &(cores, units))| {
            let units = if cores >= 100 { 0 } else { units };
            pod_yaml(
                w,
                &format!("trace-{i}"),
                cores,
                units,
                "sleep 1000000",
                ", group: trace",
            )
            .replace(
                &w.sim.join("run/gpu-sim").display().to_string(),
                &state_dir(c).display().to_string(),
            )
        })
        .collect();
    let t0 = Instant::now();
    c.apply(&docs.join("---\n"));
    // The extender dies while the pods are being placed, and comes back.
    wait("a third of the pods decided", 180, || {
        let n = pods(c).iter().filter(|p| decided(p)).count();
        if n * 3 >= PODS {
            Ok(())
        } else {
            Err(format!("{n} decided"))
        }
    });
    let _ = ext.0.kill();
    let _ = ext.0.wait();
    std::thread::sleep(Duration::from_secs(3));
    ext = Extender::start(c);
    let ps = wait("every pod Running or Unschedulable", 420, || {
        let ps = pods(c);
        no_pod_failed(&ps);
        let n = ps.iter().filter(|p| decided(p)).count();
        if n == PODS {
            Ok(ps)
        } else {
            Err(format!("{n} of {PODS} decided"))
        }
    });
    let settled_s = t0.elapsed().as_secs_f64();
    let units_per_gpu = inv.gpus[0].memory_bytes / gpu_allocator::MEMORY_UNIT_BYTES;
    let (placed, gpu_use) = check_no_overcommit(c, &ps, units_per_gpu);
    let running = ps.iter().filter(|p| phase(p) == "Running").count();
    let per_node: BTreeMap<&str, usize> = names
        .iter()
        .map(|n| {
            (
                *n,
                ps.iter()
                    .filter(|p| phase(p) == "Running" && p["spec"]["nodeName"] == *n)
                    .count(),
            )
        })
        .collect();
    let rule = admission_rule(&inv, names.len(), &trace);
    figures.push(format!(
        "three nodes ({up_s:.0} s to add two): 200-pod trace with the extender killed and restarted mid-run settled in {settled_s:.0} s: {running} Running {per_node:?}, {placed} cores placed (gpu-admission's rule on the same trace: {rule}), no admission error, no GPU over capacity"
    ));
    // Pods not running that still carry a reservation (a bind cut off by
    // the kill): what would explain cores missing.
    let extender_log =
        std::fs::read_to_string(c.dir.join("log/vcuda-scheduler.log")).unwrap_or_default();
    let scheduler_log =
        std::fs::read_to_string(c.dir.join("log/kube-scheduler.log")).unwrap_or_default();
    let lines_of = |log: &str, name: &str, last: usize| -> Vec<String> {
        let hits: Vec<&str> = log.lines().filter(|l| l.contains(name)).collect();
        hits[hits.len().saturating_sub(last)..]
            .iter()
            .map(|l| l.to_string())
            .collect()
    };
    let reserved: Vec<String> =
        ps.iter()
            .filter(|p| phase(p) != "Running")
            .filter_map(|p| {
                let a = &p["metadata"]["annotations"];
                a["tencent.com/predicate-node"].as_str().map(|n| {
                // Why the scheduler left it, and what the extender said of
                // it: what tells a stale reservation from a full GPU.
                let name = p["metadata"]["name"].as_str().unwrap_or_default();
                let said: Vec<String> = extender_log
                    .lines()
                    .filter(|l| l.split_whitespace().any(|w| w.ends_with(&format!("/{name}"))))
                    .map(str::to_string)
                    .collect();
                format!(
                    "{name} ({} cores on {n} GPUs {}; scheduler: {}; the extender of it: {said:?}; kube-scheduler's last lines of it: {:?})",
                    limit(p, "tencent.com/vcuda-core"),
                    a["tencent.com/predicate-gpu-idx-0"],
                    test_support::k8s::util::condition_messages(p),
                    lines_of(&scheduler_log, &format!("/{name}"), 6)
                )
            })
            })
            .collect();
    // What each GPU holds at the verdict: a reserved pod that would fit
    // one of them was left out by a stale count, one that fits none by
    // the order the kill left (a bind cut off goes back in the queue).
    let held: Vec<String> = gpu_use
        .iter()
        .map(|((n, g), (cores, units))| format!("{n} GPU {g}: {cores} cores, {units} units"))
        .collect();
    assert!(
        placed >= rule,
        "{placed} cores placed, gpu-admission's rule places {rule}; pods not running with a reservation:\n{}\nwhat the Running pods hold (of 100 cores, {units_per_gpu} units a GPU):\n{}",
        reserved.join("\n"),
        held.join("\n")
    );
    drop(ext);
    c.kubectl_ok(&[
        "delete",
        "pods",
        "-l",
        "group=trace",
        "--grace-period=1",
        "--wait=true",
    ]);
    c.script_ok(&["scheduler-restart"]);
    for (k, (name, mut m)) in (2..).zip(extra) {
        m.stop();
        c.script_ok(&["node-down", &k.to_string()]);
        c.kubectl_ok(&["delete", "node", &name]);
    }
}

/// Panics, naming the pod, its node and the placement it was given, if a
/// pod failed (a refused Allocate: the extender's and the manager's views
/// of a GPU disagreed).
fn no_pod_failed(ps: &[Value]) {
    if let Some(f) = ps.iter().find(|p| phase(p) == "Failed") {
        panic!(
            "pod {} on {} failed: {}; its annotations: {}",
            f["metadata"]["name"], f["spec"]["nodeName"], f["status"], f["metadata"]["annotations"]
        );
    }
}
