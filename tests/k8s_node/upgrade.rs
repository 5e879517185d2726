//! Phase 3b (issue 24): the DaemonSet's image changed under live shares, as
//! an operator upgrades (`kubectl apply -k` of the overlay with a new tag),
//! then rolled back (`kubectl rollout undo`). The "new" image holds the same
//! build under another tag: what differs between releases is covered by
//! tests/contracts.rs (every format of today read by this build); this drill
//! covers what the switch itself does to running pods.
//!
//! A share pod runs a process that holds memory for the whole drill and a
//! loop starting a new CUDA process every ~0.1 s that fills the share to its
//! quota (each run's registration times out after 300 ms, so a gap in
//! registration shows as failed runs). Per switch: no pod restarted, the
//! holding process registered with the new manager, the checkpoint adopted,
//! no run allocated past the quota, and the gap measured from the runs' log
//! timestamps.

use std::fs;
use std::time::{Duration, Instant};
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::{UNIT, in_node_pods, tail, wait};

use crate::deploy::ds_ready_pod;

/// What one switch showed.
struct Switch {
    ok: usize,
    failed: usize,
    /// Longest stretch without a successful new process (s), and the
    /// failed runs inside it.
    gap_s: f64,
    max_allocated: u64,
    rollout_s: f64,
    /// Pods created during the switch: created -> started (s, from the
    /// API's timestamps), or why not.
    during: Vec<(String, Result<f64, String>)>,
    /// A process started once the old manager was gone, with the default
    /// wait: how long until it ran (it must).
    held_s: f64,
    /// The old and the new manager's lines on the node's allocatable and
    /// their stop: what a refused pod is read against.
    node_status: Vec<String>,
}

/// Runs the drill; the DaemonSet of phase 3 serves with image `:local`,
/// installed from `overlay` (the copy's `test/`). `live` share pods already
/// run (the checkpoint must keep them and the new one).
pub fn run(
    c: &Cluster,
    w: &Work,
    overlay: &std::path::Path,
    live: usize,
    figures: &mut Vec<String>,
) {
    let next = "docker.io/vcuda-test/gpu-manager:next";
    let root = c.dir.join("work").join("gpu-manager-rootfs");
    test_support::k8s::cluster::import_image(c, next, &root, &["/usr/bin/gpu-manager"]);
    // 8 units of 256 MiB: the holder's 64 MiB and 7 blocks of 256 MiB fit.
    let quota_units = 8u64;
    let max_blocks = (quota_units * UNIT - 64 * (1 << 20)) / (256 << 20);
    c.apply(&pod_yaml(
        w,
        "ds-upgrade",
        30,
        quota_units as u32,
        // The holder logs its re-registrations (LOGGER_LEVEL=info): the
        // manager's own line for it may be one its per-container log budget
        // drops, this pod's loop registering ~8 times a second.
        "sleep 1000000 | LOGGER_LEVEL=info /work/shim_client hold 64 & \
         i=0; while true; do i=$((i+1)); \
         if VCUDA_REGISTER_TIMEOUT_MS=300 /work/shim_client quota 256 > /tmp/o 2>&1; \
         then echo \"run=$i ok $(grep -o 'allocated=[0-9]*' /tmp/o)\"; \
         else echo \"run=$i fail $(head -c 160 /tmp/o)\"; fi; sleep 0.1; done",
        "",
    ));
    c.wait_phase("ds-upgrade", &["Running"], 120);
    wait("ds-upgrade's first runs", 60, || {
        let l = c.logs("ds-upgrade");
        if l.matches(" ok ").count() >= 3 {
            Ok(())
        } else {
            Err(tail(&l, 5))
        }
    });
    let mut old = ds_ready_pod(c, None);
    // Upgrade: the overlay names the new tag, applied as an operator would.
    let k = overlay.join("kustomization.yaml");
    let plain = fs::read_to_string(&k).unwrap();
    fs::write(
        &k,
        format!("{plain}images:\n  - name: docker.io/vcuda-test/gpu-manager\n    newTag: next\n"),
    )
    .unwrap();
    let up = switch(c, w, "up", live + 1, &mut old, max_blocks, || {
        c.kubectl_ok(&["apply", "-k", overlay.to_str().unwrap()]);
    });
    assert_eq!(image(c, &old), next);
    fs::write(&k, plain).unwrap();
    let down = switch(c, w, "down", live + 1, &mut old, max_blocks, || {
        c.kubectl_ok(&[
            "-n",
            "kube-system",
            "rollout",
            "undo",
            "daemonset/gpu-manager",
        ]);
    });
    assert!(image(c, &old).ends_with(":local"), "{}", image(c, &old));
    for (what, s) in [("upgrade", &up), ("rollback", &down)] {
        let during: Vec<String> = s
            .during
            .iter()
            .map(|(n, r)| match r {
                Ok(t) => format!("{n} {t:.1} s"),
                Err(e) => format!("{n} NOT RUNNING ({e})"),
            })
            .collect();
        figures.push(format!(
            "DaemonSet {what} under live shares: rollout {:.1} s; new processes: {} ok, {} failed closed, \
             longest stretch without one {:.2} s; at most {} of {max_blocks} blocks allocated; \
             0 pods restarted; the holding processes registered again; {} live shares kept; \
             a process started in the gap (with surge: during the rollout) held {:.1} s, then ran; \
             pods created during it, created -> Running: {}",
            s.rollout_s,
            s.ok,
            s.failed,
            s.gap_s,
            s.max_allocated,
            live + 1,
            s.held_s,
            during.join(", ")
        ));
    }
    eprintln!("k8s_node: {}", figures[figures.len() - 2]);
    eprintln!("k8s_node: {}", figures[figures.len() - 1]);
    // The stopping manager wrote allocatable 0 (node_status.rs): the
    // scheduler keeps pods Pending through the gap instead of sending them
    // to a kubelet that has no devices and refuses them for good.
    let during: Vec<&(String, Result<f64, String>)> =
        up.during.iter().chain(&down.during).collect();
    let refused: Vec<_> = during
        .iter()
        .filter(|(_, r)| {
            r.as_ref()
                .is_err_and(|e| e.contains("UnexpectedAdmissionError"))
        })
        .collect();
    assert!(
        refused.is_empty(),
        "pods created during a switch refused at admission: {refused:?}\n\
         the managers' node status lines, upgrade:\n{}\nrollback:\n{}",
        up.node_status.join("\n"),
        down.node_status.join("\n")
    );
    let mut ms: Vec<u64> = during
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok().map(|s| (s * 1000.0) as u64))
        .collect();
    ms.sort_unstable();
    if !ms.is_empty() {
        figures.push(format!(
            "pods created during the upgrade and the rollback: {} of {} Running, created -> started (API timestamps, 1 s resolution) p50 {:.1} s, p99 {:.1} s; none refused at admission",
            ms.len(),
            during.len(),
            test_support::k8s::util::percentile(&ms, 0.5) as f64 / 1000.0,
            test_support::k8s::util::percentile(&ms, 0.99) as f64 / 1000.0,
        ));
        eprintln!("k8s_node: {}", figures[figures.len() - 1]);
    }
    c.kubectl_ok(&["delete", "pod", "ds-upgrade", "--wait=false"]);
}

/// One image change: `act` starts it; returns once the new manager pod
/// recovered, the holding process re-registered and runs succeed again.
fn switch(
    c: &Cluster,
    w: &Work,
    tag: &str,
    live: usize,
    mgr: &mut String,
    max_blocks: u64,
    act: impl FnOnce(),
) -> Switch {
    let before = c.logs("ds-upgrade").lines().count();
    // The old manager's log to its end (its pod, deleted, takes it along).
    let old_log = c.dir.join("work").join(format!("manager-before-{tag}.log"));
    let follow = c
        .kubectl_cmd(&["-n", "kube-system", "logs", "-f", "--timestamps", mgr])
        .stdout(fs::File::create(&old_log).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn();
    let t = Instant::now();
    act();
    // Without surge: once new processes fail (the old manager gone), one
    // more starts with a long registration wait: it must be held until the
    // new manager answers, not refused. With surge there is no gap to wait
    // for: the new manager takes over beside the old one, and that process
    // starts during the rollout.
    let surge = c.flavor.daemonset_surge();
    if !surge {
        wait("the old manager gone (a run failing)", 60, || {
            let l = c.logs("ds-upgrade");
            if l.lines().skip(before).any(|l| l.contains(" fail")) {
                Ok(())
            } else {
                Err(tail(&l, 2))
            }
        });
    }
    let held_t = Instant::now();
    let held = c
        // 120 s, not the default 30: on this loaded 2-core machine kubelet
        // once took 52 s to remove the old manager's pod (CI's full suite
        // timed out at 30 s); the check is that the process is held, not
        // how long a node's rollout takes.
        .kubectl_cmd(&[
            "exec",
            "ds-upgrade",
            "--",
            "env",
            "VCUDA_REGISTER_TIMEOUT_MS=120000",
            "/work/shim_client",
            "quota",
            "256",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its end stamped as it comes (the switch's checks run meanwhile).
    let held = std::thread::spawn(move || (held.wait_with_output(), Instant::now()));
    let during = pods_during(c, w, tag, t);
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "daemonset/gpu-manager",
        "--timeout=240s",
    ]);
    let new = ds_ready_pod(c, Some(mgr));
    let rollout_s = t.elapsed().as_secs_f64();
    let mlog = |p: &str| {
        c.kubectl(&["-n", "kube-system", "logs", p])
            .unwrap_or_default()
    };
    let rec = wait("the new manager's recovery", 60, || {
        let l = mlog(&new);
        l.lines()
            .find(|l| l.contains("recovery finished"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    // The live shares, and those of the pods created during the switch that
    // kubelet had admitted by then.
    let kept: usize = test_support::kv(&rec)
        .get("kept")
        .and_then(|k| k.parse().ok())
        .unwrap_or(0);
    assert!(
        kept >= live && rec.contains("unreachable=[]"),
        "the new manager adopted the checkpoint's {live} live shares: {rec}"
    );
    // Every process that held memory across the switch (this pod's and the
    // earlier share pods') registered again with the new manager: its line in
    // the manager's log, or (this pod's holder, whose container floods the
    // manager's log budget) its own "re-registered" line stamped after the
    // new manager started (no surge: the old one was gone by then).
    let holders = holders(c);
    assert!(!holders.is_empty(), "no holding process on the host");
    let started =
        seconds(
            c.json(&["-n", "kube-system", "pod", &new]).unwrap()["status"]["containerStatuses"][0]
                ["state"]["running"]["startedAt"]
                .as_str()
                .unwrap_or_default(),
        )
        .expect("the new manager pod's container start time");
    wait(
        "the holding processes registered with the new manager",
        60,
        || {
            let l = mlog(&new);
            let own = c
                .kubectl(&["logs", "--timestamps", "ds-upgrade"])
                .unwrap_or_default();
            let missing: Vec<_> = holders
                .iter()
                .filter(|p| {
                    !l.lines().any(|l| {
                        l.contains("interposer registered") && l.contains(&format!(" pid={p} "))
                    }) && !reregistered_since(&own, **p, started)
                })
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("not registered: {missing:?}; {}", tail(&l, 5)))
            }
        },
    );
    // A few runs after the switch, then read them with their timestamps.
    wait("new processes succeeding after the switch", 60, || {
        let l = c.logs("ds-upgrade");
        let n = l
            .lines()
            .skip(before)
            .filter(|l| l.contains(" ok "))
            .count();
        if n >= 5 { Ok(()) } else { Err(tail(&l, 3)) }
    });
    let stamped = c
        .kubectl(&["logs", "--timestamps", "ds-upgrade"])
        .unwrap_or_default();
    let s = runs(&stamped, before, max_blocks, rollout_s);
    let pod = c.pod("ds-upgrade").unwrap();
    let restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        .as_u64()
        .unwrap_or(99);
    assert_eq!(restarts, 0, "ds-upgrade restarted during the switch");
    let (out, held_end) = held.join().unwrap();
    let out = out.unwrap();
    let held_s = (held_end - held_t).as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success()
            && text.contains("allocated=")
            && (surge || text.contains("waiting for the GPU manager")),
        "a process started while the manager was away was not held until the new one answered:\n{text}"
    );
    let mut node_status = Vec::new();
    if let Ok(mut f) = follow {
        let _ = f.kill();
        let _ = f.wait();
    }
    let new_log = c
        .kubectl(&["-n", "kube-system", "logs", "--timestamps", &new])
        .unwrap_or_default();
    let old_log = fs::read_to_string(&old_log).unwrap_or_default();
    for (who, log) in [("old", &old_log), ("new", &new_log)] {
        node_status.extend(
            log.lines()
                .filter(|l| {
                    [
                        "allocatable",
                        "shutting down",
                        "SIGTERM",
                        "registered with kubelet",
                    ]
                    .iter()
                    .any(|k| l.contains(k))
                })
                .map(|l| format!("{who}: {l}")),
        );
    }
    *mgr = new;
    Switch {
        during: settle(c, &during),
        held_s,
        node_status,
        ..s
    }
}

/// Pods created while the switch goes on: one at 0.5, 2, 4, 6 and 8 s after
/// it started (the old manager's termination, the gap, the new one's
/// start), each a small share. Returns (name, when it was created).
fn pods_during(c: &Cluster, w: &Work, tag: &str, t0: Instant) -> Vec<(String, Instant)> {
    let mut out = Vec::new();
    for (i, at) in [0.5f64, 2.0, 4.0, 6.0, 8.0].iter().enumerate() {
        if let Some(d) = (t0 + Duration::from_secs_f64(*at)).checked_duration_since(Instant::now())
        {
            std::thread::sleep(d);
        }
        let name = format!("during-{tag}-{i}");
        c.apply(&pod_yaml(w, &name, 5, 1, "sleep 1000000", ""));
        out.push((name, Instant::now()));
    }
    out
}

/// Each pod's created -> Running time, or how it ended otherwise (kubelet
/// refusing it at admission); then the pods are deleted.
fn settle(c: &Cluster, pods: &[(String, Instant)]) -> Vec<(String, Result<f64, String>)> {
    let mut out: Vec<(String, Result<f64, String>)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut left: Vec<&(String, Instant)> = pods.iter().collect();
    while !left.is_empty() && Instant::now() < deadline {
        left.retain(|(name, created)| {
            let Ok(p) = c.pod(name) else { return true };
            match p["status"]["phase"].as_str().unwrap_or("") {
                "Running" => {
                    // From the API's timestamps: this loop looks only once
                    // the switch is over, long after most pods ran.
                    let api = || {
                        let started =
                            p["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
                                .as_str()?;
                        Some(
                            seconds(started)?
                                - seconds(p["metadata"]["creationTimestamp"].as_str()?)?,
                        )
                    };
                    let s = api()
                        .filter(|s| *s >= 0.0)
                        .unwrap_or_else(|| created.elapsed().as_secs_f64());
                    out.push((name.clone(), Ok(s)));
                    false
                }
                "Failed" => {
                    let why = format!(
                        "{}: {}",
                        p["status"]["reason"].as_str().unwrap_or("Failed"),
                        p["status"]["message"].as_str().unwrap_or("")
                    );
                    out.push((name.clone(), Err(why)));
                    false
                }
                _ => true,
            }
        });
        std::thread::sleep(Duration::from_millis(100));
    }
    for (name, _) in left {
        let state = c.pod(name).map_or_else(
            |e| e,
            |p| {
                format!(
                    "{} {}",
                    p["status"]["phase"],
                    test_support::k8s::util::condition_messages(&p)
                )
            },
        );
        // What kubelet said of it (the events name the step it is stuck at).
        let events = c
            .json(&[
                "events",
                "--field-selector",
                &format!("involvedObject.name={name}"),
            ])
            .map(|l| {
                l["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        format!(
                            "{}: {}",
                            e["reason"].as_str().unwrap_or(""),
                            e["message"].as_str().unwrap_or("")
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" | ")
            })
            .unwrap_or_default();
        out.push((
            name.clone(),
            Err(format!(
                "not Running after 180 s: {state}; events: {events}"
            )),
        ));
    }
    for (name, _) in pods {
        c.kubectl_ok(&["delete", "pod", name, "--wait=false"]);
    }
    // Gone before the next switch, whose recovery counts the live shares.
    wait("the pods created during the switch gone", 120, || {
        let here: Vec<&String> = pods
            .iter()
            .map(|(n, _)| n)
            .filter(|n| c.pod(n).is_ok())
            .collect();
        if here.is_empty() {
            Ok(())
        } else {
            Err(format!("{here:?}"))
        }
    });
    out
}

/// Host PIDs of the share pods' holding processes (`shim_client hold`).
fn holders(c: &Cluster) -> Vec<u32> {
    let pods = format!("{}/kubepods", c.flavor.cgroup_root());
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
                args.len() >= 2 && args[0].ends_with(b"/shim_client") && args[1] == b"hold"
            }) && in_node_pods(*p, &pods)
        })
        .collect()
}

/// Parses the loop's `<RFC3339> run=N ok allocated=K` / `... fail ...`
/// lines after the first `skip`.
fn runs(stamped: &str, skip: usize, max_blocks: u64, rollout_s: f64) -> Switch {
    let mut s = Switch {
        ok: 0,
        failed: 0,
        gap_s: 0.0,
        max_allocated: 0,
        rollout_s,
        during: Vec::new(),
        held_s: 0.0,
        node_status: Vec::new(),
    };
    let mut last_ok: Option<f64> = None;
    for line in stamped.lines().skip(skip) {
        let Some((ts, rest)) = line.split_once(' ') else {
            continue;
        };
        let Some(t) = seconds(ts) else { continue };
        if rest.contains(" ok ") {
            s.ok += 1;
            let k: u64 = rest
                .split("allocated=")
                .nth(1)
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("a run without its count: {line}"));
            assert!(
                k <= max_blocks,
                "a run allocated {k} blocks, past the quota's {max_blocks}: {line}"
            );
            s.max_allocated = s.max_allocated.max(k);
            if let Some(p) = last_ok {
                s.gap_s = s.gap_s.max(t - p);
            }
            last_ok = Some(t);
        } else if rest.contains(" fail") {
            s.failed += 1;
        }
    }
    s
}

/// Whether the interposer of host process `pid` logged a re-registration
/// (`kubectl logs --timestamps` lines) at or after `since` (seconds of the
/// day; the container start time is cut to the second, so never late).
fn reregistered_since(stamped: &str, pid: u32, since: f64) -> bool {
    let needle = format!("re-registered: host pid {pid},");
    stamped.lines().any(|l| {
        l.split_once(' ').is_some_and(|(ts, rest)| {
            rest.contains(&needle) && seconds(ts).is_some_and(|t| t >= since)
        })
    })
}

/// Seconds of the day of an RFC3339 timestamp (kubectl logs --timestamps;
/// the drill never spans midnight twice).
fn seconds(ts: &str) -> Option<f64> {
    let time = ts.split('T').nth(1)?.trim_end_matches('Z');
    let mut it = time.split(':');
    let (h, m, s): (f64, f64, f64) = (
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    );
    Some(h * 3600.0 + m * 60.0 + s)
}

fn image(c: &Cluster, pod: &str) -> String {
    c.json(&["-n", "kube-system", "pod", pod]).unwrap()["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}
