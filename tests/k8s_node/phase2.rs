//! Phase 2: 20 live pods; the manager killed with -9 and restarted, kubelet
//! restarted, every pod deleted.

use crate::host_manager::HostManager;
use serde_json::Value;
use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::Instant;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::{UNIT, get_u64, percentile, wait};
use test_support::kv;

/// Phase 2, on phase 1's manager `m` and the sim's `state`.
pub fn run(
    c: &Cluster,
    w: &Work,
    figures: &mut Vec<String>,
    m: &mut HostManager,
    state: &gpu_sim_core::SharedState,
) {
    let uid = |p: &Value| p["metadata"]["uid"].as_str().unwrap().to_string();
    // ------------------------------------------------ phase 2: restarts
    eprintln!("k8s_node: phase 2: 20 live pods, manager kill -9, kubelet restart, deletion");
    let n = 20;
    let t_pods = Instant::now();
    for i in 0..n {
        c.apply(&pod_yaml(
            w,
            &format!("live-{i}"),
            10,
            2,
            "sleep 1000000 | /work/shim_client hold 64",
            ", group: live",
        ));
    }
    let mut before: HashMap<String, (String, String)> = HashMap::new();
    for i in 0..n {
        let name = format!("live-{i}");
        let p = c.wait_phase(&name, &["Running"], 240);
        wait(&format!("{name} holding memory"), 120, || {
            let l = c.logs(&name);
            if l.contains("holding pid=") {
                Ok(())
            } else {
                Err(l)
            }
        });
        let cid = p["status"]["containerStatuses"][0]["containerID"]
            .as_str()
            .unwrap_or("")
            .to_string();
        before.insert(name, (uid(&p), cid));
    }
    eprintln!(
        "k8s_node: {n} live pods holding memory after {:.1} s",
        t_pods.elapsed().as_secs_f64()
    );
    let allocs = m.allocate_us();
    let sim_procs = |st: &gpu_sim_core::SharedState| -> usize {
        (0..st.gpu_count()).map(|g| st.processes(g).len()).sum()
    };
    assert!(
        sim_procs(state) >= n,
        "every live pod holds memory on the sim"
    );

    // The manager killed with -9 and restarted.
    m.kill9();
    let log_mark = m.log_text().len();
    let t_restart = Instant::now();
    m.spawn();
    m.wait_ready(120);
    let recovery = t_restart.elapsed();
    let recovery_ms = m
        .log_text()
        .lines()
        .rfind(|l| l.contains("recovery finished"))
        .and_then(|l| kv(l).get("recovery_ms").cloned())
        .unwrap_or_else(|| "?".into());
    let rec_line = m
        .log_text()
        .lines()
        .rfind(|l| l.contains("recovery finished"))
        .unwrap_or("")
        .to_string();
    let rk = kv(&rec_line);
    assert!(
        rk.get("kept")
            .is_some_and(|k| k.parse::<usize>().unwrap_or(0) >= n)
            && rk.get("unreachable").is_some_and(|u| u == "[]"),
        "recovery kept every live pod, every source reachable (containerd through CRI, kubelet, API server): {rec_line}"
    );
    figures.push(format!(
        "recovery with {n} live pods: /readyz {:.2} s after the restart (recovery_ms={recovery_ms})",
        recovery.as_secs_f64()
    ));
    c.wait_allocatable("resources after the manager's restart", (400, 240), 60);
    for (name, (uid, _)) in &before {
        let cfg = w.vm().join(uid).join("main/vcuda.config");
        assert!(cfg.is_file(), "{name}: {} kept", cfg.display());
    }
    assert!(
        sim_procs(state) >= n,
        "the live pods' processes still hold their memory"
    );
    // The live processes reconnect to the restarted manager by themselves.
    let registered_since = |uid: &str| -> usize {
        let text = m.log_text();
        text.get(log_mark..)
            .unwrap_or("")
            .lines()
            .filter(|l| l.contains("interposer registered") && l.contains(uid))
            .count()
    };
    let t_rereg = Instant::now();
    wait("every live pod's process registered again", 120, || {
        let missing: Vec<&String> = before
            .iter()
            .filter(|(_, (uid, _))| registered_since(uid) == 0)
            .map(|(name, _)| name)
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("not yet: {missing:?}"))
        }
    });
    figures.push(format!(
        "after the kill -9: all {n} live processes registered again {:.2} s after /readyz",
        t_rereg.elapsed().as_secs_f64()
    ));
    // A new process in a live pod registers and sees its quota.
    let live0 = before["live-0"].0.clone();
    let regs0 = registered_since(&live0);
    let out = c.kubectl_ok(&["exec", "live-0", "--", "/work/shim_client", "quota", "64"]);
    assert!(
        registered_since(&live0) > regs0,
        "the exec'd process registered with the restarted manager"
    );
    let e = kv(&out);
    assert_eq!(
        get_u64(&e, "start_total", &out),
        2 * UNIT,
        "quota after the restart\n{out}"
    );
    assert_eq!(get_u64(&e, "last", &out), 2, "refused past it\n{out}");

    // kubelet restarted: the plugins re-register, pods undisturbed.
    let regs = m.count("registered with kubelet");
    let sock = Path::new("/var/lib/kubelet/device-plugins/kubelet.sock");
    let sock_id = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(p)
            .ok()
            .map(|m| (m.ino(), m.ctime_nsec(), m.ctime()))
    };
    let old_sock = sock_id(sock);
    c.script_ok(&["kubelet-stop"]);
    let t_kubelet = Instant::now();
    c.script_ok(&["kubelet-start"]);
    wait(
        "the new kubelet's registration socket",
        120,
        || match sock_id(sock) {
            Some(id) if Some(id) != old_sock => Ok(()),
            _ => Err("kubelet.sock not re-created yet".to_string()),
        },
    );
    let t_sock = t_kubelet.elapsed();
    wait(
        "the plugins re-registered with the new kubelet",
        120,
        || {
            let now = m.count("registered with kubelet");
            if now >= regs + 2 {
                Ok(())
            } else {
                Err(format!("{now} registrations (were {regs})"))
            }
        },
    );
    let rereg = t_kubelet.elapsed();
    c.wait_allocatable("resources after kubelet's restart", (400, 240), 120);
    let back = t_kubelet.elapsed();
    figures.push(format!(
        "kubelet restart: its kubelet.sock up {:.2} s after the start, plugins re-registered {:.2} s after that, 400/240 allocatable again {:.2} s after the start",
        t_sock.as_secs_f64(),
        (rereg.saturating_sub(t_sock)).as_secs_f64(),
        back.as_secs_f64()
    ));
    for (name, (_, cid)) in &before {
        let p = c.pod(name).unwrap();
        assert_eq!(p["status"]["phase"], "Running", "{name}: {}", p["status"]);
        let cs = &p["status"]["containerStatuses"][0];
        assert_eq!(
            cs["containerID"].as_str().unwrap_or(""),
            cid,
            "{name} kept its container"
        );
        assert_eq!(cs["restartCount"], 0, "{name}");
    }
    assert!(
        sim_procs(state) >= n,
        "the live pods' processes survived kubelet's restart"
    );
    // A new pod after both restarts is served.
    let log = c.run_pod(
        &pod_yaml(w, "after", 20, 4, "/work/cudart_loader 128", ""),
        "after",
    );
    assert_eq!(get_u64(&kv(&log), "total", &log), 4 * UNIT, "{log}");

    // Pods deleted: allocations released.
    let t_del = Instant::now();
    c.kubectl_ok(&["delete", "pods", "--all", "--wait=false"]);
    wait(
        "every allocation released (vm directories gone)",
        180,
        || {
            let left: Vec<String> = fs::read_dir(w.vm())
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{} vm dirs left", left.len()))
            }
        },
    );
    let released = t_del.elapsed();
    wait("the pods gone", 180, || {
        let l = c.json(&["pods"])?;
        let k = l["items"].as_array().map(|a| a.len()).unwrap_or(0);
        if k == 0 {
            Ok(())
        } else {
            Err(format!("{k} pods"))
        }
    });
    figures.push(format!(
        "{} pods deleted: every allocation released {:.1} s after the delete (the pod objects gone after {:.1} s)",
        n + 1,
        released.as_secs_f64(),
        t_del.elapsed().as_secs_f64()
    ));
    let all = m.allocate_us();
    assert!(
        all.len() > allocs.len() && allocs.len() >= n,
        "{} allocated lines",
        allocs.len()
    );
    figures.push(format!(
        "Allocate on the real kubelet (manager's handler, took_us, {} calls): p50 {:.2} ms, p99 {:.2} ms",
        all.len(),
        percentile(&all, 0.5) as f64 / 1000.0,
        percentile(&all, 0.99) as f64 / 1000.0
    ));
    // Where it went: finding the pod (the kubelet's List, the reflector)
    // and the checkpoint's write.
    for field in ["found_us", "list_us", "checkpoint_us"] {
        let v = m.allocate_field(field);
        figures.push(format!(
            "  of which {field}: p50 {:.2} ms, p99 {:.2} ms",
            percentile(&v, 0.5) as f64 / 1000.0,
            percentile(&v, 0.99) as f64 / 1000.0
        ));
    }
    m.stop();
}
