//! Phase 1: the manager on the host; both resources on the node, a share's
//! quota as the card, 30/70 packed on one GPU, Xid health through
//! ListAndWatch.

use crate::host_manager::HostManager;
use serde_json::Value;
use std::collections::HashMap;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::{UNIT, get_u64, pids_of_pod, tail, wait};
use test_support::kv;
use test_support::target_dir;

/// Phase 1; hands the running manager and the sim's state on to phase 2.
pub fn run(
    c: &Cluster,
    w: &Work,
    figures: &mut Vec<String>,
) -> (HostManager, gpu_sim_core::SharedState) {
    let quota = 8 * UNIT;
    let uid = |p: &Value| p["metadata"]["uid"].as_str().unwrap().to_string();
    // ------------------------------------------------ phase 1: resources
    eprintln!("k8s_node: phase 1: the manager on the host, resources, quotas");
    let t0 = Instant::now();
    let mut m = HostManager::start(c, w);
    m.wait_ready(120);
    let t_ready = t0.elapsed();
    c.wait_allocatable("both resources on the node", (400, 240), 120);
    let t_node = t0.elapsed();
    figures.push(format!(
        "host manager: /readyz after {:.2} s, 400/240 allocatable on the node after {:.2} s",
        t_ready.as_secs_f64(),
        t_node.as_secs_f64()
    ));
    // kubelet 1.20 dials with the socket path as :authority; the
    // registrations and ListAndWatch above went over it.
    let kubelet_log = fs::read_to_string(c.dir.join("log/kubelet.log")).unwrap_or_default();
    assert!(
        !kubelet_log.contains("tencent.com/vcuda-core") || !kubelet_log.contains("Unimplemented"),
        "kubelet reported an RPC error for the plugin:\n{}",
        tail(&kubelet_log, 30)
    );

    // A share: 30 % and 2 GiB; a -lcuda program and a cudart-style loader.
    let log = c.run_pod(
        &pod_yaml(
            w,
            "quota",
            30,
            8,
            "/work/shim_client quota 256 && echo --- && /work/cudart_loader 256",
            "",
        ),
        "quota",
    );
    let (lcuda, cudart) = log.split_once("---").expect("both programs' output");
    let a = kv(lcuda);
    assert_eq!(
        get_u64(&a, "start_total", &log),
        quota,
        "-lcuda: cuMemGetInfo total = quota\n{log}"
    );
    assert_eq!(get_u64(&a, "start_device_total", &log), quota, "{log}");
    assert_eq!(
        get_u64(&a, "last", &log),
        2,
        "-lcuda: refused past the quota (OOM)\n{log}"
    );
    assert!(get_u64(&a, "allocated", &log) >= 6, "{log}");
    let b = kv(cudart);
    assert_eq!(
        get_u64(&b, "total", &log),
        quota,
        "cudart-style: total = quota\n{log}"
    );
    assert_eq!(get_u64(&b, "device_total", &log), quota, "{log}");
    assert_eq!(
        get_u64(&b, "last", &log),
        2,
        "cudart-style: refused past the quota\n{log}"
    );
    assert!(get_u64(&b, "allocated", &log) >= 6, "{log}");
    c.kubectl_ok(&["delete", "pod", "quota", "--wait=false"]);

    // Two shares on one GPU at 30/70, measured out of the other real-node
    // suite's heavy phases (it runs beside this one): the lock is taken
    // before the pods, whose programs run 50 s (taken after them, a 160 s
    // wait outlived them, 5e18ffa).
    let load = test_support::k8s::host_load::HostLoad::measure("the 30/70 figure");
    let secs = 50;
    for (name, cores) in [("share30", 30), ("share70", 70)] {
        c.apply(&pod_yaml(
            w,
            name,
            cores,
            8,
            &format!("exec /work/shim_compute saturate {secs}"),
            "",
        ));
    }
    let p30 = c.wait_phase("share30", &["Running"], 120);
    let p70 = c.wait_phase("share70", &["Running"], 120);
    let gpu_of = |p: &Value| -> usize {
        let name = p["metadata"]["name"].as_str().unwrap().to_string();
        wait(&format!("{name}'s GPU annotation"), 30, || {
            let p = c.pod(&name)?;
            p["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("annotations {}", p["metadata"]["annotations"]))
        })
    };
    let (g30, g70) = (gpu_of(&p30), gpu_of(&p70));
    assert_eq!(g30, g70, "the 30 and 70 shares are packed on one GPU");
    let state = gpu_sim_core::SharedState::open(&gpu_sim_core::SimRoot::new(&w.sim)).unwrap();
    let (u30, u70) = (uid(&p30), uid(&p70));
    wait("both shares' processes on the GPU", 60, || {
        let pids: Vec<u32> = state
            .processes(g30)
            .iter()
            .filter_map(|p| p.host_pid)
            .collect();
        if !pids_of_pod(&u30, &pids).is_empty() && !pids_of_pod(&u70, &pids).is_empty() {
            Ok(())
        } else {
            Err(format!("host pids on GPU {g30}: {pids:?}"))
        }
    });
    // Warm-up (the controllers settle), then a measured window.
    std::thread::sleep(Duration::from_secs(6));
    let from = gpu_sim_core::state::now_ns();
    std::thread::sleep(Duration::from_secs(20));
    let to = gpu_sim_core::state::now_ns();
    drop(load);
    let mut busy: HashMap<&str, f64> = HashMap::new();
    for (p, pct) in state.process_utilization(g30, from, to) {
        let Some(hp) = p.host_pid else { continue };
        if !pids_of_pod(&u30, &[hp]).is_empty() {
            *busy.entry("30").or_default() += pct;
        } else if !pids_of_pod(&u70, &[hp]).is_empty() {
            *busy.entry("70").or_default() += pct;
        }
    }
    let (b30, b70) = (busy.get("30").copied(), busy.get("70").copied());
    let (Some(b30), Some(b70)) = (b30, b70) else {
        // A share that ran no kernel in the window: what its pod and the
        // GPU's process table say (a CI run once found the 30 share idle).
        let procs: Vec<String> = state
            .processes(g30)
            .iter()
            .map(|p| {
                format!(
                    "slot {} gen {} host pid {:?}",
                    p.slot, p.generation, p.host_pid
                )
            })
            .collect();
        let pod = |n: &str| {
            let st = c
                .pod(n)
                .map(|p| p["status"]["containerStatuses"].to_string());
            format!("{n}: status {st:?}\nlogs:\n{}", tail(&c.logs(n), 20))
        };
        panic!(
            "no kernel of a share in the 20 s window on GPU {g30}: busy {busy:?}\nprocesses: {procs:?}\n{}\n{}",
            pod("share30"),
            pod("share70")
        );
    };
    figures.push(format!(
        "30/70 on GPU {g30} under the real kubelet: {b30:.1} % / {b70:.1} %"
    ));
    eprintln!("k8s_node: 30/70 achieved {b30:.1} / {b70:.1}");
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    assert!(
        (b30 - 30.0).abs() <= 5.0 && (b70 - 70.0).abs() <= 5.0,
        "30/70 achieved {b30:.1} / {b70:.1} % (load average {})",
        load.trim()
    );
    c.kubectl_ok(&["delete", "pod", "share30", "share70", "--wait=false"]);

    // Health through ListAndWatch: a critical Xid on GPU 3 takes its 100
    // cores and 60 memory units out of kubelet's allocatable; after the
    // quiet period (5 s here) they are back.
    let xid = Command::new(target_dir().join("gpu-sim"))
        .args([
            "xid",
            "--root",
            w.sim.to_str().unwrap(),
            "--gpu",
            "3",
            "--code",
            "79",
        ])
        .output()
        .unwrap();
    assert!(
        xid.status.success(),
        "gpu-sim xid: {}",
        String::from_utf8_lossy(&xid.stderr)
    );
    let t_xid = Instant::now();
    c.wait_allocatable(
        "GPU 3 out of the node's allocatable after Xid 79",
        (300, 180),
        60,
    );
    let t_out = t_xid.elapsed();
    c.wait_allocatable("GPU 3 back after the quiet period", (400, 240), 90);
    figures.push(format!(
        "Xid 79 on GPU 3: out of kubelet's allocatable after {:.2} s, back {:.2} s after the Xid (quiet period 5 s) (ListAndWatch updates through the real kubelet)",
        t_out.as_secs_f64(),
        t_xid.elapsed().as_secs_f64()
    ));
    (m, state)
}
