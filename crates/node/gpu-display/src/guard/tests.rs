use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use super::*;
use crate::sampler::{GpuSample, ProcSample};

const MIB: u64 = 1 << 20;

fn share(name: &str, pids: &[u32], quota: u64) -> ContainerView {
    ContainerView {
        pod_uid: format!("uid-{name}"),
        pod_name: name.into(),
        namespace: "ns".into(),
        container: "main".into(),
        memory_quota_bytes: quota,
        host_pids: pids.to_vec(),
        vm_dir: Some(PathBuf::from(format!("/vm/uid-{name}/main"))),
        ..Default::default()
    }
}

fn snap(procs: &[(u32, u64)]) -> Snapshot {
    Snapshot {
        taken: None,
        gpus: vec![GpuSample {
            index: 0,
            processes: procs
                .iter()
                .map(|&(p, b)| {
                    (
                        p,
                        ProcSample {
                            utilization_percent: 0.0,
                            memory_used_bytes: b,
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }],
    }
}

/// Processes' `/etc/vcuda` and vm directories by made-up inode; kills
/// recorded.
#[derive(Default)]
struct Double {
    seen_at_etc_vcuda: HashMap<u32, u64>,
    dirs: HashMap<PathBuf, u64>,
    killed: Arc<Mutex<Vec<u32>>>,
}

impl World for Double {
    fn quota_dir_of(&self, pid: u32) -> Option<(u64, u64)> {
        self.seen_at_etc_vcuda.get(&pid).map(|&i| (1, i))
    }
    fn dir_id(&self, dir: &Path) -> Option<(u64, u64)> {
        self.dirs.get(dir).map(|&i| (1, i))
    }
    fn kill(&self, pid: u32) -> std::io::Result<()> {
        self.killed.lock().unwrap().push(pid);
        Ok(())
    }
}

fn metrics() -> ManagerMetrics {
    crate::metrics::MetricsRegistry::new("t").manager
}

#[test]
fn registered_processes_within_quota_are_quiet() {
    let cs = [share("a", &[10, 11], 1024 * MIB)];
    let f = judge(&snap(&[(10, 500 * MIB), (11, 500 * MIB)]), &cs, |_| None);
    assert_eq!(f, vec![]);
}

#[test]
fn an_unregistered_process_in_a_share_is_found_and_counted_in_its_use() {
    let cs = [share("a", &[10], 1024 * MIB), share("b", &[20], 1024 * MIB)];
    // 30 sees b's vm directory; 40 is a host process, 50 another pod's.
    let f = judge(
        &snap(&[
            (10, 100 * MIB),
            (20, 900 * MIB),
            (30, 300 * MIB),
            (40, 8000 * MIB),
        ]),
        &cs,
        |p| (p == 30).then_some(1),
    );
    assert_eq!(
        f,
        vec![
            Finding {
                container: 1,
                reason: Reason::Unregistered,
                pid: Some(30),
                bytes: 300 * MIB,
                quota: 1024 * MIB
            },
            Finding {
                container: 1,
                reason: Reason::OverQuota,
                pid: Some(20),
                bytes: 1200 * MIB,
                quota: 1024 * MIB
            },
        ]
    );
}

#[test]
fn over_quota_needs_more_than_the_slack_and_whole_gpus_are_never_judged() {
    let q = 1024 * MIB;
    let within = q + over_quota_slack(q);
    let cs = [share("a", &[10], q)];
    assert_eq!(judge(&snap(&[(10, within)]), &cs, |_| None), vec![]);
    assert_eq!(judge(&snap(&[(10, within + 1)]), &cs, |_| None).len(), 1);
    let mut whole = share("w", &[], q);
    whole.exclusive = true;
    assert_eq!(judge(&snap(&[(7, 10 * q)]), &[whole], |_| Some(0)), vec![]);
}

#[test]
fn the_guard_kills_under_kill_reports_once_and_forgets_a_gone_process() {
    let cs = [share("a", &[10], 1024 * MIB)];
    let killed = Arc::new(Mutex::new(Vec::new()));
    let w = Double {
        seen_at_etc_vcuda: [(30, 7)].into(),
        dirs: [(PathBuf::from("/vm/uid-a/main"), 7)].into(),
        killed: killed.clone(),
    };
    let told = Arc::new(Mutex::new(Vec::new()));
    let t = told.clone();
    let notify: Notify =
        Arc::new(move |c, f| t.lock().unwrap().push((c.pod_name.clone(), f.reason)));
    let mut g = Guard::new(w, Policy::Kill, metrics(), Some(notify));
    let s = snap(&[(10, 100 * MIB), (30, 100 * MIB)]);
    assert_eq!(g.check(&s, &cs).len(), 1);
    assert_eq!(g.check(&s, &cs).len(), 1, "still there on the next sample");
    assert_eq!(*killed.lock().unwrap(), vec![30], "ended once");
    assert_eq!(told.lock().unwrap().len(), 1, "told once");
    // Gone from NVML, then a new process with the same PID: reported again.
    g.check(&snap(&[(10, 100 * MIB)]), &cs);
    g.check(&s, &cs);
    assert_eq!(*killed.lock().unwrap(), vec![30, 30]);
}

/// A container over its memory quota on NVML's count (a process that
/// zeroed its ledger's counters, say) is reported once; under `kill` it
/// loses its largest process, and the next one each sample it stays over.
#[test]
fn a_container_over_its_quota_loses_its_largest_process_under_kill() {
    let cs = [
        share("a", &[10, 11], 1024 * MIB),
        share("b", &[20], 1024 * MIB),
    ];
    let killed = Arc::new(Mutex::new(Vec::new()));
    let w = Double {
        killed: killed.clone(),
        ..Default::default()
    };
    let told = Arc::new(Mutex::new(0));
    let t = told.clone();
    let notify: Notify = Arc::new(move |_, _| *t.lock().unwrap() += 1);
    let mut g = Guard::new(w, Policy::Kill, metrics(), Some(notify));
    let over = snap(&[(10, 300 * MIB), (11, 900 * MIB), (20, 1000 * MIB)]);
    let f = g.check(&over, &cs);
    assert_eq!(
        (f.len(), f[0].reason, f[0].pid),
        (1, Reason::OverQuota, Some(11))
    );
    assert!(
        f[0].describe().contains("the largest: process 11"),
        "{}",
        f[0].describe()
    );
    assert_eq!(*killed.lock().unwrap(), vec![11], "the largest, not b's");
    // Still over (the driver has not freed it yet, or another grew).
    g.check(&snap(&[(10, 1200 * MIB), (20, 1000 * MIB)]), &cs);
    assert_eq!(*killed.lock().unwrap(), vec![11, 10]);
    assert_eq!(*told.lock().unwrap(), 1, "one report while it stays over");
    // Back within its quota: nothing more.
    g.check(&snap(&[(20, 1000 * MIB)]), &cs);
    assert_eq!(*killed.lock().unwrap(), vec![11, 10]);
}

#[test]
fn report_never_kills() {
    let cs = [share("a", &[], 1024 * MIB)];
    let killed = Arc::new(Mutex::new(Vec::new()));
    let w = Double {
        seen_at_etc_vcuda: [(30, 7)].into(),
        dirs: [(PathBuf::from("/vm/uid-a/main"), 7)].into(),
        killed: killed.clone(),
    };
    let mut g = Guard::new(w, Policy::Report, metrics(), None);
    assert_eq!(g.check(&snap(&[(30, MIB)]), &cs).len(), 1);
    assert!(killed.lock().unwrap().is_empty());
}

#[test]
fn policies_parse_and_bad_ones_are_named() {
    assert_eq!("kill".parse::<Policy>(), Ok(Policy::Kill));
    assert_eq!("report".parse::<Policy>(), Ok(Policy::Report));
    let e = "stop".parse::<Policy>().unwrap_err();
    assert!(e.contains("\"stop\"") && e.contains("\"kill\""), "{e}");
}
