//! Phase 2b: the real kube-scheduler 1.20 with `vcuda-scheduler` as its
//! extender (the `KubeSchedulerConfiguration` of docs/scheduler.md), over
//! the host manager's published GPU inventory:
//!
//! - 13 pods of 30 cores on the 4-GPU node: 12 Running (3 on each GPU,
//!   the GPUs the extender wrote where the manager reads them) and the
//!   13th Pending, Unschedulable with the extender's reason — never
//!   placed and then refused at Allocate (`UnexpectedAdmissionError`), as
//!   without the extender;
//! - the extender killed with -9 while a pod waits, a running pod deleted,
//!   the extender started again: the waiting pod takes the freed GPU,
//!   nothing lost, no GPU over 90 cores.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::wait;
use test_support::target_dir;

const PORT: u16 = 18888;
const PODS: usize = 13;

/// The extender on the host, killed when dropped.
pub struct Extender(pub Child);

impl Extender {
    pub fn start(c: &Cluster) -> Extender {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(c.dir.join("log/vcuda-scheduler.log"))
            .unwrap();
        let mut child = Command::new(target_dir().join("vcuda-scheduler"))
            .args(["--listen", &format!("127.0.0.1:{PORT}"), "--kubeconfig"])
            .arg(c.kubeconfig())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let addr = ([127, 0, 0, 1], PORT).into();
        wait("the extender's /healthz", 30, || {
            // Another process on the port (an extender a killed run left)
            // would answer for it.
            if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
                panic!(
                    "vcuda-scheduler exited ({st}): {}",
                    std::fs::read_to_string(c.dir.join("log/vcuda-scheduler.log"))
                        .unwrap_or_default()
                );
            }
            std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
            match test_support::http_get(addr, "/healthz") {
                (200, _) => Ok(()),
                (code, body) => Err(format!("{code} {body}")),
            }
        });
        Extender(child)
    }
}

impl Drop for Extender {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// kube-scheduler's configuration with the extender (v1beta1 on 1.20, v1
/// on a modern node).
pub fn scheduler_config(c: &Cluster) -> std::path::PathBuf {
    let path = c.dir.join("scheduler-extender.yaml");
    let text = format!(
        r#"apiVersion: {api}
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: {kc}
leaderElection:
  leaderElect: false
extenders:
- urlPrefix: "http://127.0.0.1:{PORT}"
  filterVerb: filter
  prioritizeVerb: prioritize
  bindVerb: bind
  weight: 1
  nodeCacheCapable: true
  ignorable: false
  managedResources:
  - name: tencent.com/vcuda-core
    ignoredByScheduler: false
  - name: tencent.com/vcuda-memory
    ignoredByScheduler: false
"#,
        kc = c.dir.join("scheduler.kubeconfig").display(),
        api = c.flavor.scheduler_config_api(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn pods(c: &Cluster) -> Vec<Value> {
    c.json(&["pods", "-l", "group=sched"])
        .map(|v| v["items"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default()
}

fn phase(p: &Value) -> &str {
    p["status"]["phase"].as_str().unwrap_or("")
}

/// GPU (predicate-gpu-idx-0) -> pods on it, of the running pods.
fn per_gpu(ps: &[Value]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for p in ps.iter().filter(|p| phase(p) == "Running") {
        let g = p["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"]
            .as_str()
            .unwrap_or("none")
            .to_string();
        *m.entry(g).or_insert(0) += 1;
    }
    m
}

/// Waits for `running` Running pods and the rest Pending, Unschedulable
/// with the extender's reason; no pod Failed. Returns the pods.
fn settle(c: &Cluster, running: usize, secs: u64) -> Vec<Value> {
    wait(
        &format!("{running} Running, the rest Unschedulable"),
        secs,
        || {
            let ps = pods(c);
            if let Some(f) = ps.iter().find(|p| phase(p) == "Failed") {
                panic!("a pod failed (admission?): {}", f["status"]);
            }
            let up = ps.iter().filter(|p| phase(p) == "Running").count();
            let waiting: Vec<&Value> = ps.iter().filter(|p| phase(p) == "Pending").collect();
            let unschedulable = waiting.iter().all(|p| {
                p["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == "PodScheduled"
                            && c["reason"] == "Unschedulable"
                            && c["message"].as_str().is_some_and(|m| m.contains("free"))
                    })
                })
            });
            if up == running && up + waiting.len() == ps.len() && unschedulable {
                Ok(ps)
            } else {
                Err(format!("{up} running, {} pending", waiting.len()))
            }
        },
    )
}

/// Waits until the earlier phases' pods are gone: kubelet keeps their
/// device IDs until then, and would refuse a new pod at admission
/// whatever the extender chose.
pub fn wait_no_pods(c: &Cluster) {
    wait("the earlier phases' pods gone", 180, || {
        let n = c
            .json(&["pods"])?
            .get("items")
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n} pods left"))
        }
    });
}

pub fn run(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 2b: kube-scheduler with vcuda-scheduler as its extender");
    wait_no_pods(c);
    wait("the node's GPU inventory", 30, || {
        let n = c.json(&["node", &c.node])?;
        n["metadata"]["annotations"]["tencent.com/vcuda-gpu-inventory"]
            .as_str()
            .map(|_| ())
            .ok_or_else(|| "not published".to_string())
    });
    let mut ext = Extender::start(c);
    c.script_ok(&["scheduler-restart", scheduler_config(c).to_str().unwrap()]);
    let t0 = Instant::now();
    for i in 0..PODS {
        c.apply(&pod_yaml(
            w,
            &format!("sched-{i}"),
            30,
            1,
            "sleep 1000000",
            ", group: sched",
        ));
    }
    let ps = settle(c, 12, 180);
    let t_settled = t0.elapsed();
    let gpus = per_gpu(&ps);
    assert_eq!(
        gpus.values().copied().collect::<Vec<_>>(),
        [3, 3, 3, 3],
        "{gpus:?}"
    );
    let waiting = ps.iter().find(|p| phase(p) == "Pending").unwrap();
    let why = waiting["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    eprintln!("k8s_node: the 13th pod: {why}");

    // The extender dies; a running pod goes; the extender comes back.
    let _ = ext.0.kill();
    let _ = ext.0.wait();
    let victim = ps.iter().find(|p| phase(p) == "Running").unwrap();
    let name = victim["metadata"]["name"].as_str().unwrap().to_string();
    c.kubectl_ok(&["delete", "pod", &name, "--grace-period=1", "--wait=true"]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(pods(c).iter().all(|p| phase(p) != "Failed"));
    let t_restart = Instant::now();
    ext = Extender::start(c);
    let ps = settle(c, 12, 120);
    let gpus = per_gpu(&ps);
    assert!(
        gpus.values().all(|&n| n <= 3),
        "a GPU over 90 cores: {gpus:?}"
    );
    assert_eq!(gpus.values().sum::<usize>(), 12, "{gpus:?}");
    figures.push(format!(
        "kube-scheduler + vcuda-scheduler: 13 x 30-core pods on 4 GPUs settled (12 Running, 3 per GPU; 1 Unschedulable with the reason) in {:.1} s; after the extender's kill -9 and restart, the waiting pod took the freed GPU in {:.1} s",
        t_settled.as_secs_f64(),
        t_restart.elapsed().as_secs_f64()
    ));
    drop(ext);
    c.kubectl_ok(&[
        "delete",
        "pods",
        "-l",
        "group=sched",
        "--grace-period=1",
        "--wait=true",
    ]);
    c.script_ok(&["scheduler-restart"]);
}
