//! vcuda's DRA driver against a real Kubernetes ≥ 1.34 node (issue 15): the
//! real kube-scheduler places ResourceClaims against the ResourceSlice the
//! driver publishes (consumable capacity), the real kubelet calls
//! NodePrepareResources over the plugin-registration socket, and a
//! CDI-capable containerd injects the spec the driver wrote. Simulated GPUs
//! (`gpu-sim install --host-dev`), the real `vcuda-dra-driver` binary on the
//! host, the C test programs in pods of a local busybox image.
//!
//! CI cannot run it: Debian has no Kubernetes ≥ 1.34 and no containerd with
//! CDI. It is `#[ignore]`d and runs on purpose against a node you bring up
//! yourself on this machine, as root (docs/dra.md, "Verifying on a real
//! node"):
//!
//! ```sh
//! VCUDA_DRA_KUBECONFIG=/path/admin.kubeconfig \
//! VCUDA_DRA_CONTAINERD=/run/.../containerd.sock \
//!   cargo test -p vcuda-tests --test k8s_dra_node -- --ignored --nocapture
//! ```
//!
//! The node: one node, kubelet root `/var/lib/kubelet`, containerd with
//! `enable_cdi` reading `/var/run/cdi`, `DRAConsumableCapacity` on (beta,
//! on by default, in 1.36). Checked: the slice and classes; a critical Xid
//! takes a running pod's GPU out of the slice (generation + 1), the kubelet
//! shows the pod's device Unhealthy, the scheduler places around it, and it
//! comes back, Healthy, after the quiet period; a claim of two
//! whole GPUs gets both device nodes and one `/etc/vcuda`; a share beside
//! another device in one claim is refused, named in the pod's events; two 30 % /
//! 1 GiB claims packed onto one GPU by the scheduler; each pod's `-lcuda`
//! program sees 1024 MiB and is refused past it; a driver kill -9 and
//! restart keeps both prepared claims (same files, a process in a running
//! pod registers again and is still held to 1 GiB) and prepares new ones;
//! deleting a pod unprepares its claim. Printed: claim-to-running latency
//! and NodePrepareResources p50 / p99.

mod parts;
mod windows;

use parts::*;
use serde_json::Value;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use test_support::k8s::util::{HostDevCleanup, MachineLock, NODE_FILE, percentile, tail, wait};
use test_support::kv;
use test_support::{target_dir, workspace_root};

#[test]
#[ignore = "needs a real Kubernetes ≥ 1.34 node with a CDI containerd: VCUDA_DRA_KUBECONFIG, VCUDA_DRA_CONTAINERD (docs/dra.md)"]
fn dra_on_a_real_node() {
    let env = |k: &str| {
        std::env::var_os(k).map(PathBuf::from).unwrap_or_else(|| {
            panic!("{k} is not set: this test runs against a node you bring up (docs/dra.md)")
        })
    };
    let n = Node {
        kubeconfig: env("VCUDA_DRA_KUBECONFIG"),
        containerd: env("VCUDA_DRA_CONTAINERD"),
    };
    assert!(test_support::is_root(), "the node's host side needs root");
    for f in ["vcuda-dra-driver", "gpu-sim", "libvcuda.so", "libcuda.so"] {
        assert!(
            target_dir().join(f).is_file(),
            "{f}: cargo build --workspace first"
        );
    }
    let _lock = MachineLock::take();
    let version = n.json(&["version"]).unwrap();
    let minor: u32 = version["serverVersion"]["minor"]
        .as_str()
        .unwrap()
        .trim_end_matches('+')
        .parse()
        .unwrap();
    assert!(
        minor >= 34,
        "resource.k8s.io/v1 needs 1.34+, the server is {}",
        version["serverVersion"]["gitVersion"]
    );
    let nodes = n.json(&["get", "nodes"]).unwrap();
    let node = nodes["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let kubelet_version = nodes["items"][0]["status"]["nodeInfo"]["kubeletVersion"].clone();
    let runtime = nodes["items"][0]["status"]["nodeInfo"]["containerRuntimeVersion"].clone();
    eprintln!(
        "k8s_dra: node {node}, server {}, kubelet {kubelet_version}, {runtime}",
        version["serverVersion"]["gitVersion"]
    );
    // What a killed earlier run's DaemonSet phase left would be a second
    // driver on the node.
    remove_daemonset(&n, &node);

    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let (sim, bin) = (w.join("sim"), w.join("bin"));
    fs::create_dir_all(&bin).unwrap();
    let installed = sh(Command::new(target_dir().join("gpu-sim"))
        .args(["install", "--node"])
        .arg(workspace_root().join(NODE_FILE))
        .arg("--root")
        .arg(&sim)
        .arg("--host-dev"));
    let _host_dev = HostDevCleanup::from_install_output(&installed);
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(bin.join("shim_client"))
        .arg(workspace_root().join("tests/c/shim_client.c"))
        .arg(format!("-I{}", workspace_root().join("tests/c").display()))
        .arg("-L")
        .arg(sim.join("usr/lib/x86_64-linux-gnu"))
        .arg("-lcuda"));
    import_busybox(&n, w);
    // A namespace a killed earlier run left: its pods' claims can only be
    // unprepared by a running driver, so it goes once the driver is up.
    let _ = n.kubectl(&["delete", "namespace", NS, "--wait=false"]);

    // ------------------------------------------------ the driver
    let vm = w.join("vm");
    let mut drv = DriverProc {
        child: None,
        log: w.join("driver.log"),
        args: [
            "--node-name",
            &node,
            "--host-root",
            sim.to_str().unwrap(),
            "--volume-config",
            workspace_root()
                .join("config/volume.conf")
                .to_str()
                .unwrap(),
            "--interposer",
            target_dir().join("libvcuda.so").to_str().unwrap(),
            "--vdriver-dir",
            w.join("vdriver").to_str().unwrap(),
            "--vm-dir",
            vm.to_str().unwrap(),
            "--cdi-dir",
            CDI_DIR,
            "--state-dir",
            w.join("state").to_str().unwrap(),
            "--kubeconfig",
            n.kubeconfig.to_str().unwrap(),
            "--display-socket",
            w.join("display.sock").to_str().unwrap(),
            "--query-addr",
            "127.0.0.1:25679",
            "--xid-quiet-period",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    };
    let slice_name = format!("{node}-{DRIVER}");
    // A slice a killed earlier run left: the driver must publish its own.
    let _ = n.kubectl(&["delete", "resourceslice", &slice_name]);
    let t0 = Instant::now();
    drv.spawn();
    let slice = wait("the driver's ResourceSlice", 60, || {
        n.json(&["get", "resourceslice", &slice_name])
    });
    eprintln!(
        "k8s_dra: slice published {:.2} s after the driver started",
        t0.elapsed().as_secs_f64()
    );
    let devices = slice["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4, "{slice}");
    assert_eq!(
        devices[0]["allowMultipleAllocations"], true,
        "the API server kept allowMultipleAllocations (DRAConsumableCapacity): {slice}"
    );
    assert!(
        devices[0]["capacity"]["cores"]["requestPolicy"].is_object(),
        "the API server kept requestPolicy (DRAConsumableCapacity): {slice}"
    );
    let gen0 = slice["spec"]["pool"]["generation"].as_i64().unwrap();
    for class in [
        "vcuda-share.vcuda.tencent.com",
        "vcuda-gpu.vcuda.tencent.com",
    ] {
        n.json(&["get", "deviceclass", class]).unwrap();
    }
    drv.wait_for(
        "the kubelet to register the plugin",
        "registered with the kubelet",
        1,
        60,
    );

    wait("an earlier run's namespace gone", 180, || {
        match n.kubectl(&["get", "namespace", NS]) {
            Ok(s) => Err(s),
            Err(_) => Ok(()),
        }
    });
    n.ok(&["create", "namespace", NS]);

    // ------------------------------------------------ a critical Xid
    // On the GPU of a running pod: it leaves the slice (generation + 1),
    // the kubelet shows the pod's device Unhealthy (the driver's health
    // stream), the real scheduler places a new claim elsewhere, and the
    // quiet period brings the GPU back (+ 2), Healthy.
    let ours = |want_gen: i64, want_devices: usize| {
        let s = n.json(&["get", "resourceslice", &slice_name])?;
        let g = s["spec"]["pool"]["generation"].as_i64().unwrap_or(0);
        let d = s["spec"]["devices"].as_array().map_or(0, Vec::len);
        if (g, d) == (want_gen, want_devices) {
            Ok(())
        } else {
            Err(format!("generation {g}, {d} devices"))
        }
    };
    n.apply(&claim_template("gpu-30-1g", 30, "1Gi"));
    let mut to_running = Vec::new();
    n.apply(&pod("xid-victim", "gpu-30-1g", "sleep 100000", &bin, &sim));
    to_running.push(wait_running(&n, "xid-victim", 120));
    let victim = pod_claim(&n, "xid-victim").unwrap();
    let bad = victim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string();
    // The kubelet names a resource by its CDI ID, `...=<claim uid>-<request>-<device>`.
    let health_of = |want: &str| {
        let p = n.json(&["-n", NS, "get", "pod", "xid-victim"])?;
        let st = &p["status"]["containerStatuses"][0]["allocatedResourcesStatus"];
        let found = st
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
            .any(|r| {
                r["resourceID"]
                    .as_str()
                    .is_some_and(|id| id.ends_with(&format!("-{bad}")))
                    && r["health"] == want
            });
        if found { Ok(()) } else { Err(st.to_string()) }
    };
    wait(
        "the kubelet's health of the victim's device: Healthy",
        60,
        || health_of("Healthy"),
    );
    sh(Command::new(target_dir().join("gpu-sim"))
        .arg("xid")
        .arg("--root")
        .arg(&sim)
        .args(["--gpu", bad.trim_start_matches("gpu-"), "--code", "79"]));
    wait("the GPU out of the slice", 30, || ours(gen0 + 1, 3));
    wait(
        "the kubelet's health of the victim's device: Unhealthy",
        30,
        || health_of("Unhealthy"),
    );
    n.apply(&pod("xid-probe", "gpu-30-1g", "sleep 100000", &bin, &sim));
    to_running.push(wait_running(&n, "xid-probe", 120));
    let probe = pod_claim(&n, "xid-probe").unwrap();
    let probe_dev = &probe["status"]["allocation"]["devices"]["results"][0]["device"];
    assert_ne!(
        probe_dev,
        bad.as_str(),
        "the scheduler placed a claim on a GPU out of the slice: {probe}"
    );
    n.ok(&["-n", NS, "delete", "pod", "xid-probe", "--wait=true"]);
    wait(
        "the GPU back in the slice after the quiet period",
        60,
        || ours(gen0 + 2, 4),
    );
    wait(
        "the kubelet's health of the victim's device: Healthy again",
        60,
        || health_of("Healthy"),
    );
    n.ok(&["-n", NS, "delete", "pod", "xid-victim", "--wait=true"]);
    let generation = Value::from(gen0 + 2);

    // ------------------------------------------------ several devices in a claim
    // Two whole GPUs from one spec: the runtime applies the spec's common
    // edits once (one /etc/vcuda) and each device's node.
    n.apply(&two_whole_template("two-whole"));
    n.apply(&pod(
        "two-whole",
        "two-whole",
        "ls /dev; echo visible=$NVIDIA_VISIBLE_DEVICES; \
         echo etc_vcuda=$(grep -c ' /etc/vcuda ' /proc/self/mountinfo); \
         test -f /etc/vcuda/vcuda.config && echo config=yes; echo ---done; sleep 100000",
        &bin,
        &sim,
    ));
    to_running.push(wait_running(&n, "two-whole", 120));
    let out = log_with(&n, "two-whole", "---done");
    let c = pod_claim(&n, "two-whole").unwrap();
    let results = c["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap();
    assert_eq!(results.len(), 2, "{c}");
    for r in results {
        let i = r["device"].as_str().unwrap().trim_start_matches("gpu-");
        assert!(
            out.lines().any(|l| l == format!("nvidia{i}")),
            "/dev/nvidia{i} injected:\n{out}"
        );
    }
    let visible = kv(&out).get("visible").cloned().unwrap_or_default();
    assert_eq!(visible.split(',').count(), 2, "both GPUs visible:\n{out}");
    assert!(
        out.contains("etc_vcuda=1"),
        "/etc/vcuda mounted once:\n{out}"
    );
    assert!(out.contains("config=yes"), "{out}");
    n.ok(&["-n", NS, "delete", "pod", "two-whole", "--wait=true"]);
    // A share beside another device: refused at prepare, named in the
    // pod's events by the real kubelet; the pod never starts.
    n.apply(&mixed_template("mixed"));
    n.apply(&pod("mixed", "mixed", "true", &bin, &sim));
    wait(
        "the refusal of the mixed claim in the pod's events",
        90,
        || {
            let ev = n.kubectl(&[
                "-n",
                NS,
                "get",
                "events",
                "--field-selector",
                "involvedObject.name=mixed",
            ])?;
            if ev.contains("a share must be the claim's only device") {
                Ok(())
            } else {
                Err(tail(&ev, 5))
            }
        },
    );
    let phase = n.json(&["-n", NS, "get", "pod", "mixed"]).unwrap()["status"]["phase"].clone();
    assert_eq!(phase, "Pending", "the refused pod never started");
    n.ok(&["-n", NS, "delete", "pod", "mixed", "--wait=true"]);

    // ------------------------------------------------ two 30 % / 1 GiB claims
    let cmd = "/work/shim_client quota 256; echo ---done; sleep 100000";
    for p in ["share-a", "share-b"] {
        n.apply(&pod(p, "gpu-30-1g", cmd, &bin, &sim));
        to_running.push(wait_running(&n, p, 120));
    }
    let mut claims = Vec::new();
    for p in ["share-a", "share-b"] {
        let out = log_with(&n, p, "---done");
        check_quota(&out, p);
        let c = pod_claim(&n, p).unwrap();
        let r = &c["status"]["allocation"]["devices"]["results"][0];
        assert_eq!(r["driver"], DRIVER, "{c}");
        assert_eq!(r["consumedCapacity"]["cores"], "30", "{c}");
        assert_eq!(r["consumedCapacity"]["memory"], "1Gi", "{c}");
        claims.push(c);
    }
    let dev = |c: &Value| c["status"]["allocation"]["devices"]["results"][0]["device"].clone();
    assert_eq!(
        dev(&claims[0]),
        dev(&claims[1]),
        "the scheduler packed both claims on one GPU"
    );
    let uid = |c: &Value| c["metadata"]["uid"].as_str().unwrap().to_string();
    let spec_a = PathBuf::from(CDI_DIR).join(format!("{DRIVER}-{}.json", uid(&claims[0])));
    assert!(spec_a.is_file(), "{} missing", spec_a.display());
    let config_a = vm.join(uid(&claims[0])).join("gpu/vcuda.config");
    let inode_a = fs::metadata(&config_a).unwrap().ino();

    // ------------------------------------------------ driver kill -9 and restart
    drv.kill9();
    let t_restart = Instant::now();
    drv.spawn();
    drv.wait_for("the restarted driver serving", "DRA driver serving", 2, 60);
    drv.wait_for(
        "the kubelet to register the restarted driver",
        "registered with the kubelet",
        2,
        60,
    );
    eprintln!(
        "k8s_dra: restart to serving {:.2} s",
        t_restart.elapsed().as_secs_f64()
    );
    assert_eq!(
        fs::metadata(&config_a).unwrap().ino(),
        inode_a,
        "the restart left claim A's files alone"
    );
    assert!(spec_a.is_file());
    let slices = n.json(&["get", "resourceslices"]).unwrap();
    let ours: Vec<&Value> = slices["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["spec"]["driver"] == DRIVER)
        .collect();
    assert_eq!(ours.len(), 1, "one slice after the restart: {slices}");
    assert_eq!(
        ours[0]["spec"]["pool"]["generation"], generation,
        "same hardware, same generation"
    );
    // A new process in a running pod registers with the new driver and is
    // still held to 1 GiB.
    let again = n.ok(&[
        "-n",
        NS,
        "exec",
        "share-a",
        "--",
        "/work/shim_client",
        "quota",
        "256",
    ]);
    check_quota(&again, "share-a after the restart");
    // New claims still prepare.
    n.apply(&pod("share-c", "gpu-30-1g", cmd, &bin, &sim));
    to_running.push(wait_running(&n, "share-c", 120));
    check_quota(&log_with(&n, "share-c", "---done"), "share-c");

    restart_windows(&n, &mut drv, &bin, &sim, w);

    // ------------------------------------------------ kubelet restart
    match std::env::var("VCUDA_DRA_KUBELET_RESTART") {
        Ok(restart) => kubelet_restart(&n, &drv, &restart),
        Err(_) => eprintln!(
            "k8s_dra: kubelet restart not checked (set VCUDA_DRA_KUBELET_RESTART to a command that restarts the node's kubelet)"
        ),
    }

    // ------------------------------------------------ a batch for the figures
    n.apply(&claim_template("gpu-5", 5, "256Mi"));
    let batch: Vec<String> = (0..39).map(|i| format!("batch-{i}")).collect();
    for p in &batch {
        n.apply(&pod(p, "gpu-5", "echo up; sleep 100000", &bin, &sim));
        to_running.push(wait_running(&n, p, 120));
    }

    // ------------------------------------------------ delete: unprepare
    let unprepared = drv.count("claim unprepared");
    n.ok(&["-n", NS, "delete", "pod", "share-a", "--wait=true"]);
    wait("claim A unprepared", 90, || {
        if !spec_a.exists() && !config_a.exists() && drv.count("claim unprepared") > unprepared {
            Ok(())
        } else {
            Err(format!(
                "spec {}, config {}",
                spec_a.exists(),
                config_a.exists()
            ))
        }
    });
    let gone = n.kubectl(&[
        "-n",
        NS,
        "get",
        "resourceclaim",
        claims[0]["metadata"]["name"].as_str().unwrap(),
    ]);
    assert!(
        gone.is_err(),
        "the template's claim goes with its pod: {gone:?}"
    );
    n.ok(&["delete", "namespace", NS, "--wait=true", "--timeout=120s"]);
    wait("every claim unprepared", 120, || {
        let left = fs::read_dir(CDI_DIR)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(DRIVER))
                    .count()
            })
            .unwrap_or(0);
        if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} CDI specs left"))
        }
    });

    // ------------------------------------------------ figures
    let mut run_ms: Vec<u64> = to_running.iter().map(|d| d.as_millis() as u64).collect();
    run_ms.sort_unstable();
    let mut prep = drv.millis("claim prepared");
    prep.sort_unstable();
    assert!(
        prep.len() >= 45,
        "45 claims prepared with their ms in the driver's log:\n{}",
        tail(&drv.text(), 20)
    );
    let mut unprep = drv.millis("claim unprepared");
    unprep.sort_unstable();
    eprintln!(
        "k8s_dra: figures ({}, kubelet {kubelet_version}, {runtime}, 2-core machine):",
        version["serverVersion"]["gitVersion"]
    );
    eprintln!(
        "k8s_dra:   pod created -> Running ({} pods, claim allocated by the scheduler, prepared, CDI-injected): p50 {} ms, max {} ms",
        run_ms.len(),
        percentile(&run_ms, 0.5),
        run_ms.last().unwrap()
    );
    eprintln!(
        "k8s_dra:   NodePrepareResources in the driver ({} claims): p50 {:.1} ms, p99 {:.1} ms",
        prep.len(),
        percentile(&prep, 0.5) as f64 / 1000.0,
        percentile(&prep, 0.99) as f64 / 1000.0
    );
    eprintln!(
        "k8s_dra:   NodeUnprepareResources ({}): p50 {:.1} ms",
        unprep.len(),
        percentile(&unprep, 0.5) as f64 / 1000.0
    );
    drv.kill9();
    n.ok(&["delete", "resourceslice", &slice_name]);

    daemonset_phase(&n, &node, w, &sim, &bin);
}

/// Pods created while the driver restarts (issue 24), all Running within
/// 5 s (p99) where the sockets stay open: three kill -9s of the driver
/// process (its supervisor starts another on the same sockets). The whole
/// driver killed (supervisor too) and started again, as a container
/// restart, is measured and printed: its new instance registers anew, and
/// pods whose prepare met the closed socket wait for the kubelet's resync.
fn restart_windows(n: &Node, drv: &mut DriverProc, bin: &Path, sim: &Path, w: &Path) {
    // This test's driver (its state directory is on its command line).
    let ours = w.join("state").display().to_string();
    n.apply(&claim_template("gpu-5", 5, "256Mi"));
    let every = std::time::Duration::from_millis(250);
    let mut all = windows::Window {
        what: "3 kill -9s of the supervised driver".into(),
        ms: vec![],
        failed: vec![],
    };
    for k in 0..3 {
        let prefix = format!("kill-{k}");
        let w = windows::pods_during(
            n,
            "a kill -9 of the supervised driver",
            &prefix,
            "gpu-5",
            (bin, sim),
            8,
            every,
            || windows::kill_worker(&ours),
            180,
        );
        all.ms.extend(w.ms);
        all.failed.extend(w.failed);
        windows::delete_pods(n, &prefix, 8);
    }
    all.ms.sort_unstable();
    all.print();
    assert!(all.failed.is_empty(), "{:?}", all.failed);
    assert!(
        all.p99() < 5000,
        "pods created during a driver kill -9: p99 {} ms",
        all.p99()
    );
    let registered = drv.count("registered with the kubelet");
    let w = windows::pods_during(
        n,
        "a kill -9 of the whole driver (supervisor too) and its start",
        "restart",
        "gpu-5",
        (bin, sim),
        6,
        every,
        || {
            drv.kill9();
            drv.spawn();
        },
        240,
    );
    drv.wait_for(
        "the new instance registered",
        "registered with the kubelet",
        registered + 1,
        60,
    );
    assert!(w.failed.is_empty(), "{:?}", w.failed);
    windows::delete_pods(n, "restart", 6);
}

/// The node's kubelet restarted under running claims: the driver is
/// registered again, the pods run on untouched (same containers, no
/// restarts), a new process in one is still held to 1 GiB.
fn kubelet_restart(n: &Node, drv: &DriverProc, restart: &str) {
    let containers = || -> Vec<(String, i64)> {
        ["share-a", "share-b", "share-c"]
            .iter()
            .map(|p| {
                let j = n.json(&["-n", NS, "get", "pod", p]).unwrap();
                let c = &j["status"]["containerStatuses"][0];
                (
                    c["containerID"].as_str().unwrap_or("").to_string(),
                    c["restartCount"].as_i64().unwrap_or(-1),
                )
            })
            .collect()
    };
    let before = containers();
    let registered = drv.count("registered with the kubelet");
    let t0 = Instant::now();
    sh(Command::new("sh").arg("-c").arg(restart));
    drv.wait_for(
        "the driver registered with the restarted kubelet",
        "registered with the kubelet",
        registered + 1,
        120,
    );
    eprintln!(
        "k8s_dra: kubelet restart to the driver registered again {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    wait("the node Ready again", 120, || {
        let j = n.json(&["get", "nodes"])?;
        let ready = j["items"][0]["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        if ready {
            Ok(())
        } else {
            Err("NotReady".into())
        }
    });
    assert_eq!(
        containers(),
        before,
        "the pods' containers after the kubelet restart"
    );
    // The restarted kubelet answers exec once it has its pods again.
    let again = wait("exec in share-b after the kubelet restart", 60, || {
        n.kubectl(&[
            "-n",
            NS,
            "exec",
            "share-b",
            "--",
            "/work/shim_client",
            "quota",
            "256",
        ])
    });
    check_quota(&again, "share-b after the kubelet restart");
}

/// deploy/dra/driver.yaml applied as users apply it, with the test overlay
/// (local image, host paths of the simulated root): the DaemonSet Ready
/// under the RBAC authorizer with only its ClusterRole's verbs, a share
/// served, nothing forbidden in its log, everything removed after.
fn daemonset_phase(n: &Node, node: &str, w: &Path, sim: &Path, bin: &Path) {
    eprintln!("k8s_dra: deploy/dra/driver.yaml under RBAC");
    let etc = Path::new("/etc/gpu-manager");
    let _etc = test_support::k8s::util::Cleanup((!etc.exists()).then(|| etc.to_path_buf()));
    let ds = DaemonSetCleanup {
        n,
        node: node.to_string(),
    };
    let root = test_support::k8s::cluster::daemon_rootfs(w, "vcuda-dra-driver");
    import(n, DRA_IMAGE, &root, "/usr/bin/vcuda-dra-driver");
    let deploy = workspace_root().join("deploy");
    n.ok(&["apply", "-k", deploy.join("overlays/dra").to_str().unwrap()]);
    let server = n.ok(&[
        "config",
        "view",
        "--raw",
        "-o",
        "jsonpath={.clusters[0].cluster.server}",
    ]);
    let (host, port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .expect("https://host:port");
    let patch = fs::read_to_string(deploy.join("test/dra-driver-sim-patch.yaml"))
        .unwrap()
        .replace("@SIM_ROOT@", sim.to_str().unwrap())
        .replace("@API_HOST@", host)
        .replace("@API_PORT@", port);
    n.ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "vcuda-dra-driver",
        "--type",
        "strategic",
        "-p",
        &patch,
    ]);
    let t0 = Instant::now();
    n.ok(&[
        "label",
        "node",
        node,
        "vcuda.tencent.com/mode=dra",
        "--overwrite",
    ]);
    wait("the driver's DaemonSet pod Ready", 180, || {
        let pods = n.driver_pods()?;
        for p in &pods {
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if ready {
                return Ok(p["metadata"]["name"].as_str().unwrap().to_string());
            }
        }
        Err(pods
            .iter()
            .map(|p| p["status"].to_string())
            .collect::<Vec<_>>()
            .join("; "))
    });
    eprintln!(
        "k8s_dra: DaemonSet pod Ready {:.2} s after the node was labelled",
        t0.elapsed().as_secs_f64()
    );
    let logs = || {
        let name = ready_driver_pod(n).unwrap_or_default();
        n.kubectl(&["-n", "kube-system", "logs", &name])
            .unwrap_or_default()
    };
    wait(
        "the DaemonSet's driver registered with the kubelet",
        60,
        || {
            let l = logs();
            if l.contains("registered with the kubelet") {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    n.ok(&["create", "namespace", NS]);
    n.apply(&claim_template("gpu-30-1g", 30, "1Gi"));
    n.apply(&pod(
        "ds-share",
        "gpu-30-1g",
        "/work/shim_client quota 256; echo ---done; sleep 100000",
        bin,
        sim,
    ));
    wait_running(n, "ds-share", 120);
    check_quota(&log_with(n, "ds-share", "---done"), "ds-share");
    rolling_update(n, bin, sim);
    match std::env::var("VCUDA_DRA_NODE_REBOOT") {
        Ok(cmd) => reboot_drill(n, bin, sim, &cmd),
        Err(_) => eprintln!(
            "k8s_dra: node reboot not checked (set VCUDA_DRA_NODE_REBOOT to a command that stops kubelet and containerd, kills every pod process, clears /var/run/cdi and starts both again)"
        ),
    }
    n.ok(&["delete", "namespace", NS, "--wait=true", "--timeout=120s"]);
    // Every claim unprepared while the driver runs (the kubelet finishes a
    // pod's deletion before it unprepares: the namespace gone is not enough).
    let ckpt = Path::new("/var/lib/kubelet/plugins/vcuda.tencent.com/checkpoint.json");
    wait("the DaemonSet's driver unprepared every claim", 120, || {
        let c: Value = serde_json::from_slice(&fs::read(ckpt).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        match c["claims"].as_object() {
            Some(m) if m.is_empty() => Ok(()),
            _ => Err(format!("{}; {}", c["claims"], tail(&logs(), 3))),
        }
    });
    let l = logs();
    assert!(
        !l.to_lowercase().contains("forbidden") && !l.contains("ERROR"),
        "the driver under its ClusterRole:\n{}",
        tail(&l, 30)
    );
    assert!(!l.contains("\u{1b}["), "no colour codes in the pod's log");
    uninstall_drill(n, node);
    drop(ds);
}

/// The driver's overlay deleted, then deploy/overlays/uninstall: its DRA
/// DaemonSet leaves nothing of the driver on the node (the claims were
/// unprepared while the driver ran).
fn uninstall_drill(n: &Node, node: &str) {
    let deploy = workspace_root().join("deploy");
    n.ok(&[
        "delete",
        "-k",
        deploy.join("overlays/dra").to_str().unwrap(),
        "--wait=true",
    ]);
    wait("the driver's pods gone", 120, || {
        if n.driver_pods()?.is_empty() {
            Ok(())
        } else {
            Err("still there".into())
        }
    });
    // The stopping driver removed its sockets itself.
    let reg: Vec<String> = fs::read_dir("/var/lib/kubelet/plugins_registry")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with(DRIVER))
        .collect();
    assert!(reg.is_empty(), "registration sockets left: {reg:?}");
    n.ok(&[
        "apply",
        "-k",
        deploy.join("overlays/uninstall").to_str().unwrap(),
    ]);
    let _un = UninstallCleanup(n);
    n.ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "vcuda-dra-driver-uninstall",
        "--type",
        "strategic",
        "-p",
        &format!(
            r#"{{"spec":{{"template":{{"spec":{{"containers":[{{"name":"uninstall","image":"{DRA_IMAGE}","imagePullPolicy":"Never"}}]}}}}}}}}"#
        ),
    ]);
    let t0 = Instant::now();
    let done = wait("the DRA uninstall's \"uninstalled\" line", 180, || {
        let l = n
            .kubectl(&[
                "-n",
                "kube-system",
                "logs",
                "-l",
                "app.kubernetes.io/name=vcuda-dra-driver-uninstall",
                "--tail=-1",
            ])
            .unwrap_or_default();
        l.lines()
            .find(|l| l.contains("uninstalled:"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    eprintln!(
        "k8s_dra: uninstall done {:.1} s after applying it: {done}",
        t0.elapsed().as_secs_f64()
    );
    for gone in [
        "/etc/gpu-manager/vdriver",
        "/etc/gpu-manager/vm",
        "/var/lib/kubelet/plugins/vcuda.tencent.com",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after the uninstall");
    }
    let specs: Vec<String> = fs::read_dir(CDI_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with(DRIVER))
        .collect();
    assert!(specs.is_empty(), "CDI specs left: {specs:?}");
    let slices = n.json(&["get", "resourceslices"]).unwrap();
    let ours: Vec<&Value> = slices["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["spec"]["driver"] == DRIVER && s["spec"]["nodeName"] == node)
        .collect();
    assert!(ours.is_empty(), "ResourceSlices left: {ours:?}");
}

/// Deletes the uninstall overlay (also when the drill fails).
struct UninstallCleanup<'a>(&'a Node);

impl Drop for UninstallCleanup<'_> {
    fn drop(&mut self) {
        let deploy = workspace_root().join("deploy");
        let _ = self.0.kubectl(&[
            "delete",
            "-k",
            deploy.join("overlays/uninstall").to_str().unwrap(),
            "--ignore-not-found",
            "--wait=true",
        ]);
    }
}

/// The one Ready driver pod's name.
fn ready_driver_pod(n: &Node) -> Result<String, String> {
    let pods = n.driver_pods()?;
    let ready: Vec<&Value> = pods
        .iter()
        .filter(|p| {
            p["metadata"]["deletionTimestamp"].is_null()
                && p["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .collect();
    match ready[..] {
        [p] => Ok(p["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string()),
        _ => Err(format!("{} Ready driver pods", ready.len())),
    }
}

/// Two rolling updates of the driver's DaemonSet (`rollout restart`: a new
/// pod beside the old one, maxSurge 1) with pods created meanwhile: all
/// Running within 5 s (p99), the running share untouched (no restart, a
/// new process in it still held), one driver pod left, which removed the
/// old one's sockets once registered.
fn rolling_update(n: &Node, bin: &Path, sim: &Path) {
    n.apply(&claim_template("gpu-5", 5, "256Mi"));
    let mut all = windows::Window {
        what: "2 rolling updates of the DaemonSet".into(),
        ms: vec![],
        failed: vec![],
    };
    for k in 0..2 {
        let before = ready_driver_pod(n).unwrap();
        let t0 = Instant::now();
        let prefix = format!("roll-{k}");
        let w = windows::pods_during(
            n,
            "a rolling update of the driver's DaemonSet",
            &prefix,
            "gpu-5",
            (bin, sim),
            10,
            std::time::Duration::from_millis(400),
            || {
                n.ok(&[
                    "-n",
                    "kube-system",
                    "rollout",
                    "restart",
                    "daemonset/vcuda-dra-driver",
                ]);
            },
            240,
        );
        n.ok(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "daemonset/vcuda-dra-driver",
            "--timeout=180s",
        ]);
        let after = wait("one Ready driver pod after the update", 120, || {
            let p = ready_driver_pod(n)?;
            if p != before && n.driver_pods()?.len() == 1 {
                Ok(p)
            } else {
                Err(format!("{p}, {} pods", n.driver_pods()?.len()))
            }
        });
        eprintln!(
            "k8s_dra: rolling update {k}: {before} -> {after} in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        let l = n.ok(&["-n", "kube-system", "logs", &after]);
        assert!(
            l.contains("removed an earlier instance's socket"),
            "the new driver removed the old one's sockets:\n{}",
            tail(&l, 20)
        );
        all.ms.extend(w.ms);
        all.failed.extend(w.failed);
        windows::delete_pods(n, &prefix, 10);
    }
    all.ms.sort_unstable();
    all.print();
    let share = n.json(&["-n", NS, "get", "pod", "ds-share"]).unwrap();
    assert_eq!(
        share["status"]["containerStatuses"][0]["restartCount"], 0,
        "the share's pod was not restarted"
    );
    let again = n.ok(&[
        "-n",
        NS,
        "exec",
        "ds-share",
        "--",
        "/work/shim_client",
        "quota",
        "256",
    ]);
    check_quota(&again, "ds-share after two rolling updates");
    assert!(all.failed.is_empty(), "{:?}", all.failed);
    assert!(
        all.p99() < 5000,
        "pods created during a rolling update: p99 {} ms",
        all.p99()
    );
}

/// A node reboot under the DaemonSet's driver: every pod process killed,
/// the runtime's state and the CDI specs (tmpfs on a real node) gone. The
/// driver comes back and re-serves its checkpoint (CDI specs written
/// again); the restartPolicy-Always pod runs again under its quota; the
/// Never pod, deleted after the reboot, is unprepared: nothing of its
/// claim stays booked.
fn reboot_drill(n: &Node, bin: &Path, sim: &Path, cmd: &str) {
    let ckpt = Path::new("/var/lib/kubelet/plugins/vcuda.tencent.com/checkpoint.json");
    let in_checkpoint = |uid: &str| {
        fs::read_to_string(ckpt)
            .unwrap_or_default()
            .contains(&format!("\"{uid}\""))
    };
    let spec = |uid: &str| PathBuf::from(CDI_DIR).join(format!("{DRIVER}-{uid}.json"));
    let quota = "/work/shim_client quota 256; echo ---done; sleep 100000";
    n.apply(
        &pod("reboot-always", "gpu-30-1g", quota, bin, sim)
            .replace("restartPolicy: Never", "restartPolicy: Always"),
    );
    n.apply(&pod("reboot-never", "gpu-5", "sleep 100000", bin, sim));
    wait_running(n, "reboot-always", 120);
    wait_running(n, "reboot-never", 120);
    check_quota(&log_with(n, "reboot-always", "---done"), "reboot-always");
    let uid_of = |p: &str| {
        pod_claim(n, p).unwrap()["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (always, never) = (uid_of("reboot-always"), uid_of("reboot-never"));
    assert!(in_checkpoint(&always) && in_checkpoint(&never));
    let t0 = Instant::now();
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "k8s_dra: node rebooted in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    wait("the driver's pod Ready after the reboot", 180, || {
        ready_driver_pod(n)
    });
    let running_again = wait("reboot-always running again", 240, || {
        let p = n.json(&["-n", NS, "get", "pod", "reboot-always"])?;
        let st = &p["status"]["containerStatuses"][0];
        if st["restartCount"].as_u64().unwrap_or(0) >= 1 && st["state"]["running"].is_object() {
            Ok(t0.elapsed())
        } else {
            Err(st.to_string())
        }
    });
    check_quota(
        &log_with(n, "reboot-always", "---done"),
        "reboot-always after the reboot",
    );
    assert!(spec(&always).is_file(), "its CDI spec written again");
    eprintln!(
        "k8s_dra: reboot: the Always pod ran again under its quota {:.1} s after the reboot began",
        running_again.as_secs_f64()
    );
    let t1 = Instant::now();
    n.ok(&[
        "-n",
        NS,
        "delete",
        "pod",
        "reboot-never",
        "--wait=true",
        "--timeout=180s",
    ]);
    wait("the Never pod's claim unprepared", 180, || {
        if !in_checkpoint(&never) && !spec(&never).exists() {
            Ok(())
        } else {
            Err(format!(
                "in checkpoint {}, spec {}",
                in_checkpoint(&never),
                spec(&never).exists()
            ))
        }
    });
    eprintln!(
        "k8s_dra: reboot: the Never pod's claim unprepared {:.1} s after its delete; nothing else booked",
        t1.elapsed().as_secs_f64()
    );
    n.ok(&[
        "-n",
        NS,
        "delete",
        "pod",
        "reboot-always",
        "--wait=true",
        "--timeout=180s",
    ]);
}

/// Removes what the DaemonSet phase applied (also when a run fails half
/// way, and at the start, for what a killed run left).
struct DaemonSetCleanup<'a> {
    n: &'a Node,
    node: String,
}

impl Drop for DaemonSetCleanup<'_> {
    fn drop(&mut self) {
        remove_daemonset(self.n, &self.node);
    }
}

fn remove_daemonset(n: &Node, node: &str) {
    let deploy = workspace_root().join("deploy");
    let _ = n.kubectl(&["label", "node", node, "vcuda.tencent.com/mode-"]);
    let _ = n.kubectl(&[
        "delete",
        "-k",
        deploy.join("overlays/dra").to_str().unwrap(),
        "--ignore-not-found",
        "--wait=true",
    ]);
    wait("the driver's DaemonSet pods gone", 120, || {
        if n.driver_pods()?.is_empty() {
            Ok(())
        } else {
            Err("still there".into())
        }
    });
    let _ = n.kubectl(&["delete", "resourceslice", &format!("{node}-{DRIVER}")]);
}
