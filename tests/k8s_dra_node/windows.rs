//! Pods created while the driver restarts (issue 24): created one by one
//! from a thread while the disruption runs, each timed from its creation
//! to Running by one poll of the namespace's pods every 100 ms. A 1.36
//! kubelet that cannot reach the driver fails the pod's prepare and tries
//! again only at its resync (60–90 s), so a miss shows as a long time here.

use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use test_support::k8s::util::{Flavor, in_node_pods, percentile};

use crate::parts::*;

/// What `pods_during` measured.
pub struct Window {
    pub what: String,
    /// Created → Running, ms, sorted.
    pub ms: Vec<u64>,
    /// Each Running pod's created → Running, ms.
    pub pods: Vec<(String, u64)>,
    /// The pods created before the disruption began.
    pub before: Vec<String>,
    /// Pods that failed, with their status.
    pub failed: Vec<String>,
    /// The kubelet's FailedPrepareDynamicResources events (pod, message):
    /// a pod that missed the driver (it waits for the kubelet's retry).
    pub missed: Vec<(String, String)>,
    /// The p99 of the same pods created undisturbed right before
    /// ([`pods_during`]'s twin): the host's pace the bound scales with.
    pub quiet_p99: u64,
}

impl Window {
    pub fn p99(&self) -> u64 {
        percentile(&self.ms, 0.99)
    }

    pub fn print(&self) {
        eprintln!(
            "k8s_dra: pods created during {}: {} Running, p50 {} ms, p99 {} ms, max {} ms; {} failed",
            self.what,
            self.ms.len(),
            percentile(&self.ms, 0.5),
            self.p99(),
            self.ms.last().copied().unwrap_or(0),
            self.failed.len()
        );
    }

    /// Several windows' pods as one (`what` names them all), printed.
    pub fn combined(what: &str, parts: Vec<Window>) -> Window {
        let mut all = Window {
            what: what.to_string(),
            ms: vec![],
            pods: vec![],
            before: vec![],
            failed: vec![],
            missed: vec![],
            quiet_p99: 0,
        };
        for w in parts {
            all.quiet_p99 = all.quiet_p99.max(w.quiet_p99);
            all.ms.extend(w.ms);
            all.pods.extend(w.pods);
            all.before.extend(w.before);
            all.failed.extend(w.failed);
            all.missed.extend(w.missed);
        }
        all.ms.sort_unstable();
        all.print();
        all
    }

    /// No pod failed or missed the driver (the kubelet's
    /// FailedPrepareDynamicResources event: the pod waits for its retry),
    /// and the p99 is under `ms`, or under twice the p99 of the window's
    /// undisturbed twin and 2 s where the host is slower than that allows
    /// (on an idle node the twin's p99 is ~0.9 s and the bound `ms`; under
    /// load 3.5 s and 9.1 s). The time bound catches a call held for
    /// seconds without failing, the events a miss however fast. The twin
    /// is timed just before, in the same hold of the host-load lock: one
    /// baseline taken at the suite's start said nothing of the host beside
    /// the 1.20 suite minutes later (a manager rolling update's p99 15.7 s
    /// against a bound of 7.6 from a 2.8 s start, tests/soak.md).
    pub fn assert_running_within(&self, ms: u64) {
        self.assert_running_within_stalled(ms, 0);
    }

    /// [`Window::assert_running_within`] for a window whose disruption
    /// itself stalls the driver's calls for `stall_ms` (stopped before its
    /// kill): the same bound, that much later. Without it the bound held
    /// only while the baseline was slow (a run with a 1.5 s baseline beside
    /// the cargo tests: 6.0 s against 5.0; the kubelet's retry it tells
    /// apart takes 10-15 s).
    pub fn assert_running_within_stalled(&self, ms: u64, stall_ms: u64) {
        assert!(self.failed.is_empty(), "{}: {:?}", self.what, self.failed);
        assert!(
            self.missed.is_empty(),
            "pods created during {} missed the driver: {:?}",
            self.what,
            self.missed
        );
        let quiet = self.quiet_p99;
        let bound = ms.max(2 * quiet + 2000) + stall_ms;
        assert!(
            self.p99() < bound,
            "pods created during {}: p99 {} ms, bound {bound} ms ({ms} ms, or twice the p99 of {quiet} ms of the same pods created undisturbed just before, and 2 s; {stall_ms} ms of stall on top)",
            self.what,
            self.p99()
        );
    }
}

impl Window {
    /// [`Window::assert_running_within`] for a disruption that may lose the
    /// calls in flight when it lands (the whole driver killed, supervisor
    /// too: docs/dra.md, "Still not covered"): a pod created before it
    /// may have missed the driver and waited for the kubelet's retry (one
    /// in a CI run beside the 1.20 suite, 15.7 s); a pod created after it,
    /// whose calls wait in the socket holder's backlog, may not, and every
    /// pod that did not miss is held to the bound.
    pub fn assert_running_within_but_in_flight(&self, bound_ms: u64) {
        let late: Vec<&(String, String)> = self
            .missed
            .iter()
            .filter(|(pod, _)| !self.before.contains(pod))
            .collect();
        assert!(
            late.is_empty(),
            "pods created after {} began missed the driver: {late:?}",
            self.what
        );
        let lost = |pod: &String| self.missed.iter().any(|(p, _)| p == pod);
        for (pod, why) in &self.missed {
            eprintln!(
                "k8s_dra: {}: pod {pod}, created before it, missed the driver (a call in flight): {why}",
                self.what
            );
        }
        let pods: Vec<(String, u64)> = self
            .pods
            .iter()
            .filter(|(p, _)| !lost(p))
            .cloned()
            .collect();
        let mut ms: Vec<u64> = pods.iter().map(|(_, v)| *v).collect();
        ms.sort_unstable();
        Window {
            what: format!("{} (the pods that did not miss it)", self.what),
            ms,
            pods,
            before: vec![],
            failed: self.failed.clone(),
            missed: vec![],
            quiet_p99: self.quiet_p99,
        }
        .assert_running_within(bound_ms);
    }
}

/// Creates `count` pods named `<prefix>-<i>` (`yaml` of each name), one
/// every `every`, runs `disrupt` once the first two are created, and times
/// each to Running (up to `secs`). Before, its twin: the same pods
/// (`<prefix>-q-<i>`) created and timed with nothing disrupted, then
/// deleted; its p99 is the window's `quiet_p99`.
#[allow(clippy::too_many_arguments)]
pub fn pods_during(
    n: &Node,
    what: &str,
    prefix: &str,
    yaml: impl Fn(&str) -> String,
    count: usize,
    every: Duration,
    disrupt: impl FnOnce(),
    secs: u64,
) -> Window {
    // Time to Running is the host's pace as much as the driver's: beside
    // the 1.20 suite's 200-pod phase a rolling update's pods took up to
    // 8.3 s with the driver done in 1 s (tests/soak.md, 2026-12-07), so
    // every window and its twin are timed out of that phase, in one hold.
    let _load = test_support::k8s::host_load::HostLoad::measure(what);
    let twin = format!("{prefix}-q");
    let quiet = timed(
        n,
        &format!("{what}: its undisturbed twin"),
        &twin,
        &yaml,
        count,
        every,
        || {},
        secs,
    );
    delete_pods(n, &twin, count);
    let mut w = timed(n, what, prefix, &yaml, count, every, disrupt, secs);
    w.quiet_p99 = quiet.p99();
    w
}

/// [`pods_during`]'s window alone.
#[allow(clippy::too_many_arguments)]
fn timed(
    n: &Node,
    what: &str,
    prefix: &str,
    yaml: &impl Fn(&str) -> String,
    count: usize,
    every: Duration,
    disrupt: impl FnOnce(),
    secs: u64,
) -> Window {
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let names: Vec<String> = (0..count).map(|i| format!("{prefix}-{i}")).collect();
    let yamls: Vec<String> = names.iter().map(|p| yaml(p)).collect();
    let node = Node {
        kubeconfig: n.kubeconfig.clone(),
        containerd: n.containerd.clone(),
    };
    let c = created.clone();
    let names2 = names.clone();
    let creator = std::thread::spawn(move || {
        for (name, y) in names2.iter().zip(&yamls) {
            let t = Instant::now();
            node.apply(y);
            c.lock().unwrap().insert(name.clone(), t);
            std::thread::sleep(every.saturating_sub(t.elapsed()));
        }
    });
    while created.lock().unwrap().len() < 2.min(count) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let before: Vec<String> = created.lock().unwrap().keys().cloned().collect();
    disrupt();
    // Polled while the rest are still being created: a pod seen Running
    // only once every pod was created would count that wait too.
    let mut ms = HashMap::new();
    let mut failed = Vec::new();
    let t0 = Instant::now();
    while ms.len() + failed.len() < count {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: {} of {count} pods Running after {secs} s, {} failed: {failed:?}\n{}",
            ms.len(),
            failed.len(),
            n.kubectl(&["-n", NS, "get", "events"]).unwrap_or_default()
        );
        let pods = n.json(&["-n", NS, "get", "pods"]).unwrap_or(Value::Null);
        let now = Instant::now();
        for p in pods["items"].as_array().into_iter().flatten() {
            let name = p["metadata"]["name"].as_str().unwrap_or_default();
            if !names.iter().any(|x| x == name) || ms.contains_key(name) {
                continue;
            }
            match p["status"]["phase"].as_str() {
                Some("Running") => {
                    let Some(at) = created.lock().unwrap().get(name).copied() else {
                        continue;
                    };
                    ms.insert(name.to_string(), (now - at).as_millis() as u64);
                }
                Some("Failed") if !failed.iter().any(|f: &String| f.starts_with(name)) => {
                    failed.push(format!("{name}: {}", p["status"]));
                }
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    creator.join().unwrap();
    let slow: Vec<&String> = ms
        .iter()
        .filter(|(_, v)| **v > 5000)
        .map(|(k, _)| k)
        .collect();
    for p in slow {
        eprintln!(
            "k8s_dra: {what}: pod {p} took {} ms; its events:\n{}",
            ms[p],
            pod_events(n, p)
        );
    }
    let mut v: Vec<u64> = ms.values().copied().collect();
    v.sort_unstable();
    let w = Window {
        what: what.to_string(),
        ms: v,
        pods: ms.into_iter().collect(),
        before,
        failed,
        missed: missed_prepares(n, &names),
        quiet_p99: 0,
    };
    w.print();
    w
}

/// The kubelet's FailedPrepareDynamicResources events about pods `names`
/// (kubelet's pkg/kubelet/events/event.go, 1.37.2): pod, message.
fn missed_prepares(n: &Node, names: &[String]) -> Vec<(String, String)> {
    let events = n.json(&["-n", NS, "get", "events"]).unwrap_or(Value::Null);
    events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["reason"] == "FailedPrepareDynamicResources"
                && names
                    .iter()
                    .any(|p| e["involvedObject"]["name"] == p.as_str())
        })
        .map(|e| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (s(&e["involvedObject"]["name"]), s(&e["message"]))
        })
        .collect()
}

/// Deletes the pods `<prefix>-*` and waits until they are gone (their
/// claims unprepared).
pub fn delete_pods(n: &Node, prefix: &str, count: usize) {
    let names: Vec<String> = (0..count).map(|i| format!("{prefix}-{i}")).collect();
    let mut args = vec!["-n", NS, "delete", "pod", "--wait=true", "--timeout=180s"];
    args.extend(names.iter().map(String::as_str));
    n.ok(&args);
}

/// This node's processes whose executable (`argv[0]`) ends with `exe`:
/// each PID and its command line. This node's: this test's descendants (the
/// driver it runs on the host) and its pods' processes; the 1.20 node's
/// suite runs beside this one in CI, its managers on the host and in its
/// pods (tests/run.sh, tests/k8s/isolated.sh).
pub fn processes_of(exe: &str) -> Vec<(u32, Vec<u8>)> {
    let pods = format!("{}/kubepods", Flavor::Modern.cgroup_root());
    let ours = test_support::process::tree(std::process::id());
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmd
            .split(|b| *b == 0)
            .next()
            .is_some_and(|a| a.ends_with(exe.as_bytes()))
            && (ours.contains(&pid) || in_node_pods(pid, &pods))
        {
            out.push((pid, cmd));
        }
    }
    out
}

/// A supervised program on the host: its executable and the variable its
/// supervisor sets in each child's environment.
#[derive(Clone, Copy)]
pub struct Supervised {
    pub exe: &'static str,
    pub env: &'static str,
}

pub const DRA_DRIVER: Supervised = Supervised {
    exe: "vcuda-dra-driver",
    env: "VCUDA_DRA_LISTEN_FDS",
};
pub const GPU_MANAGER: Supervised = Supervised {
    exe: "gpu-manager",
    env: "VCUDA_MANAGER_SUPERVISOR_FDS",
};

/// PIDs of the supervisor's children (their environment names the fds
/// they inherited) whose command line has `needle`, on the host.
pub fn workers(of: Supervised, needle: &str) -> Vec<u32> {
    let key = format!("{}=", of.env);
    processes_of(of.exe)
        .into_iter()
        .filter(|(pid, cmd)| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            String::from_utf8_lossy(cmd).contains(needle)
                && env
                    .split(|b| *b == 0)
                    .any(|kv| kv.starts_with(key.as_bytes()))
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// kill -9 of the one supervised driver process whose command line has
/// `needle`; waits until its supervisor started another.
pub fn kill_worker(needle: &str) {
    kill_worker_after(DRA_DRIVER, needle, Duration::ZERO);
}

/// As [`kill_worker`], for any supervised program, the process stopped
/// (SIGSTOP) for `held` first: the kubelet's calls of that time are in its
/// hands when it dies.
pub fn kill_worker_after(of: Supervised, needle: &str, held: Duration) {
    let w = workers(of, needle);
    assert_eq!(w.len(), 1, "one supervised {} process: {w:?}", of.exe);
    if !held.is_zero() {
        // SAFETY: as below.
        unsafe { libc::kill(w[0] as i32, libc::SIGSTOP) };
        std::thread::sleep(held);
    }
    // SAFETY: signals a process found by its command line and environment.
    unsafe { libc::kill(w[0] as i32, libc::SIGKILL) };
    test_support::k8s::util::wait(
        &format!("the supervisor's new {} process", of.exe),
        30,
        || match workers(of, needle)[..] {
            [p] if p != w[0] => Ok(()),
            ref other => Err(format!("{other:?}")),
        },
    );
}

/// Two rolling updates of the DaemonSet `app` in kube-system (`rollout
/// restart`: a new pod beside the old one, maxSurge 1), 10 pods from
/// `yaml` created during each. After each, one pod of `app` left, a new
/// one; `check(k, before, after, seconds, its log)` judges it. Then the
/// running `share` pod not restarted and a new process in it still held
/// to its quota; every pod Running within 5 s (p99).
pub fn rolling_updates(
    n: &Node,
    app: &str,
    yaml: impl Fn(&str) -> String,
    share: &str,
    check: impl Fn(usize, &str, &str, f64, &str),
) {
    let mut updates = Vec::new();
    for k in 0..2 {
        let before = n.ready_pod(app).unwrap();
        let t0 = Instant::now();
        let prefix = format!("{app}-roll-{k}");
        let ds = format!("daemonset/{app}");
        let w = pods_during(
            n,
            &format!("a rolling update of {ds}"),
            &prefix,
            &yaml,
            10,
            Duration::from_millis(400),
            || {
                n.ok(&["-n", "kube-system", "rollout", "restart", &ds]);
            },
            240,
        );
        n.ok(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            &ds,
            "--timeout=180s",
        ]);
        let after = test_support::k8s::util::wait("one Ready pod after the update", 120, || {
            let p = n.ready_pod(app)?;
            let all = n.app_pods(app)?.len();
            if p != before && all == 1 {
                Ok(p)
            } else {
                Err(format!("{p}, {all} pods"))
            }
        });
        let l = n.ok(&["-n", "kube-system", "logs", &after]);
        check(k, &before, &after, t0.elapsed().as_secs_f64(), &l);
        updates.push(w);
        delete_pods(n, &prefix, 10);
    }
    let all = Window::combined(&format!("2 rolling updates of {app}"), updates);
    let pod = n.json(&["-n", NS, "get", "pod", share]).unwrap();
    assert_eq!(
        pod["status"]["containerStatuses"][0]["restartCount"], 0,
        "the share's pod was not restarted"
    );
    let again = n.ok(&[
        "-n",
        NS,
        "exec",
        share,
        "--",
        "/work/shim_client",
        "quota",
        "256",
    ]);
    check_quota(&again, &format!("{share} after two rolling updates"));
    all.assert_running_within(5000);
}
