//! Phase 3d (issue 24): a node reboot (`cluster.sh node-reboot`: kubelet
//! and containerd down, every pod process killed, /run gone; disk kept)
//! under the DaemonSet's manager with two shares: `ds-share` (restartPolicy
//! Never: its container is gone for good) and `ds-always` (Always: kubelet
//! starts it again). The manager that comes back must release the dead
//! share and keep the other, whose restarted container runs under its
//! quota; once the dead pod is deleted, nothing of it is left booked.

use std::path::Path;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::{UNIT, get_u64, tail, wait};
use test_support::kv;

use crate::deploy::ds_ready_pod;

/// The pod that stays live after the drill (the uninstall drill's share).
pub const LIVE: &str = "ds-always";

pub fn run(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    let units = 4u32;
    let yaml = pod_yaml(
        w,
        LIVE,
        20,
        units,
        "/work/shim_client quota 256; sleep 1000000 | /work/shim_client hold 64",
        "",
    )
    .replace("restartPolicy: Never", "restartPolicy: Always");
    c.apply(&yaml);
    let pod = c.wait_phase(LIVE, &["Running"], 120);
    let always_uid = pod["metadata"]["uid"].as_str().unwrap().to_string();
    let share_uid = c.pod("ds-share").unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    wait("ds-always holding", 60, || {
        let l = c.logs(LIVE);
        if l.contains("holding pid=") {
            Ok(())
        } else {
            Err(tail(&l, 3))
        }
    });
    let old_mgr = ds_ready_pod(c, None);
    let mgr_restarts =
        c.json(&["-n", "kube-system", "pod", &old_mgr]).unwrap()["status"]["containerStatuses"][0]
            ["restartCount"]
            .as_u64()
            .unwrap_or(0);

    let t = std::time::Instant::now();
    c.script_ok(&["node-reboot"]);
    // kubelet starts the DaemonSet pod's container again (the same pod) and
    // ds-always's.
    let mgr = old_mgr;
    wait(
        "the manager's container started again and Ready",
        240,
        || {
            let p = c.json(&["-n", "kube-system", "pod", &mgr])?;
            let st = &p["status"]["containerStatuses"][0];
            if st["restartCount"].as_u64().unwrap_or(0) > mgr_restarts && st["ready"] == true {
                Ok(())
            } else {
                Err(format!("{st}"))
            }
        },
    );
    // Kubelet 1.20 starts it again from its device checkpoint. A kubelet
    // of 1.27 or later allocates again for every container it must start,
    // and rejects the pod if that comes before the manager's DaemonSet pod
    // registered (kubernetes#125579, open upstream: every DaemonSet device
    // plugin): the pod ends Failed, its share must be released, and the
    // replacement a controller would create is served.
    let rejected = wait(
        "ds-always's container started again (or rejected)",
        180,
        || {
            let p = c.pod(LIVE)?;
            let st = &p["status"]["containerStatuses"][0];
            if st["restartCount"].as_u64().unwrap_or(0) >= 1 && st["state"]["running"].is_object() {
                Ok(false)
            } else if p["status"]["reason"] == "UnexpectedAdmissionError" {
                Ok(true)
            } else {
                Err(format!("{}", p["status"]))
            }
        },
    );
    let mut always_uid = always_uid;
    if rejected {
        let why = c.pod(LIVE).unwrap()["status"]["message"].to_string();
        assert!(
            c.flavor.reboot_may_reject_device_pods() && why.contains("tencent.com/vcuda-"),
            "ds-always rejected at admission after the reboot ({}): {why}",
            c.flavor.label()
        );
        eprintln!("k8s_node: reboot: ds-always rejected by the kubelet (kubernetes#125579): {why}");
        always_uid = replace_rejected(c, &yaml, &always_uid);
    }
    let back = t.elapsed();
    // Its new container ran under the same quota (the cached Allocate
    // response points at the vm directory the manager kept).
    let log = wait("ds-always's restarted container holding", 120, || {
        let l = c.kubectl(&["logs", LIVE]).unwrap_or_default();
        if l.contains("holding pid=") {
            Ok(l)
        } else {
            Err(tail(&l, 3))
        }
    });
    assert_eq!(
        get_u64(&kv(&log), "start_total", &log),
        units as u64 * UNIT,
        "the restarted container's quota:\n{log}"
    );
    assert_eq!(get_u64(&kv(&log), "last", &log), 2, "{log}");
    let mlog = |p: &str| {
        c.kubectl(&["-n", "kube-system", "logs", p])
            .unwrap_or_default()
    };
    let rec = wait("the manager's recovery after the reboot", 60, || {
        let l = mlog(&mgr);
        l.lines()
            .find(|l| l.contains("recovery finished"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    // ds-share's container is gone for good: its pod ends Failed, and once
    // deleted nothing of it is left booked.
    c.wait_phase("ds-share", &["Failed", "Succeeded"], 180);
    c.kubectl_ok(&["delete", "pod", "ds-share", "--wait=false"]);
    let vm = Path::new("/etc/gpu-manager/vm");
    wait("ds-share's vm directory released", 120, || {
        if vm.join(&share_uid).exists() {
            Err(format!("{} still there", vm.join(&share_uid).display()))
        } else {
            Ok(())
        }
    });
    assert!(
        vm.join(&always_uid).is_dir(),
        "ds-always's vm directory was released under its live container ({rec})"
    );
    let left: Vec<String> = std::fs::read_dir(vm)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        left,
        vec![always_uid.clone()],
        "booked after the reboot: {left:?} ({rec})"
    );
    eprintln!("k8s_node: reboot: {rec}");
    let always = if rejected {
        "ds-always rejected by the kubelet at re-admission (kubernetes#125579), released, its \
         replacement served"
    } else {
        "ds-always's container back"
    };
    figures.push(format!(
        "Node reboot (kubelet, containerd, every pod process, /run): the manager and {always} in \
         {:.1} s, ds-always under its {units}-unit quota again, ds-share (restartPolicy Never) \
         released once deleted, nothing else booked ({})",
        back.as_secs_f64(),
        rec.split("recovery finished").nth(1).unwrap_or("").trim()
    ));
}

/// The rejected ds-always deleted (its share released) and created again,
/// as its controller would; the new pod's uid once it runs.
fn replace_rejected(c: &Cluster, yaml: &str, old_uid: &str) -> String {
    c.kubectl_ok(&["delete", "pod", LIVE, "--wait=true"]);
    let vm = Path::new("/etc/gpu-manager/vm").join(old_uid);
    wait(
        "the rejected ds-always's vm directory released",
        120,
        || {
            if vm.exists() {
                Err(format!("{} still there", vm.display()))
            } else {
                Ok(())
            }
        },
    );
    c.apply(yaml);
    let pod = c.wait_phase(LIVE, &["Running"], 120);
    pod["metadata"]["uid"].as_str().unwrap().to_string()
}
