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
//! takes a GPU out of the slice (generation + 1), the scheduler places
//! around it, and it comes back after the quiet period; two 30 % /
//! 1 GiB claims packed onto one GPU by the scheduler; each pod's `-lcuda`
//! program sees 1024 MiB and is refused past it; a driver kill -9 and
//! restart keeps both prepared claims (same files, a process in a running
//! pod registers again and is still held to 1 GiB) and prepares new ones;
//! deleting a pod unprepares its claim. Printed: claim-to-running latency
//! and NodePrepareResources p50 / p99.

#[allow(dead_code)]
#[path = "k8s/cluster.rs"]
mod cluster;
#[allow(dead_code)]
#[path = "k8s/util.rs"]
mod util;

use serde_json::Value;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use util::{
    HostDevCleanup, IMAGE, MIB, MachineLock, NODE_FILE, get_u64, kv, percentile, tail, wait,
};
use vcuda_tests::{target_dir, workspace_root};

const NS: &str = "vcuda-dra-test";
const DRIVER: &str = "vcuda.tencent.com";
const CDI_DIR: &str = "/var/run/cdi";
const DRA_IMAGE: &str = "docker.io/vcuda-test/vcuda-dra-driver:local";

struct Node {
    kubeconfig: PathBuf,
    containerd: PathBuf,
}

impl Node {
    fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("kubectl")
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PATH", path_with_kubectl())
            .args(args)
            .output()
            .map_err(|e| format!("kubectl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn ok(&self, args: &[&str]) -> String {
        self.kubectl(args).unwrap_or_else(|e| panic!("{e}"))
    }

    fn json(&self, args: &[&str]) -> Result<Value, String> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&a)?).map_err(|e| e.to_string())
    }

    fn apply(&self, yaml: &str) {
        let f = tempfile::NamedTempFile::new().unwrap();
        fs::write(f.path(), yaml).unwrap();
        self.ok(&["apply", "-f", f.path().to_str().unwrap()]);
    }
}

/// kubectl from the node's binaries when it is not on PATH.
fn path_with_kubectl() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    match std::env::var("VCUDA_DRA_KUBECTL_DIR") {
        Ok(d) => format!("{d}:{path}"),
        Err(_) => path,
    }
}

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A one-layer image of `root`, made by tests/containerd/start.sh's
/// `vcuda_image_tar` and imported into the node's containerd.
fn import(n: &Node, tag: &str, root: &Path, entry: &str) {
    let tar = root.with_extension("tar");
    let script = workspace_root().join("tests/containerd/start.sh");
    sh(Command::new("bash").arg("-c").arg(format!(
        "source {} && vcuda_image_tar {tag} {} {} {entry}",
        script.display(),
        root.display(),
        tar.display()
    )));
    sh(Command::new("ctr")
        .arg("--address")
        .arg(&n.containerd)
        .args(["-n", "k8s.io", "images", "import"])
        .arg(&tar));
}

/// The busybox image; the host's glibc is mounted at run time.
fn import_busybox(n: &Node, dir: &Path) {
    let root = dir.join("busybox-rootfs");
    for d in [
        "bin",
        "tmp",
        "proc",
        "sys",
        "dev",
        "etc",
        "run",
        "usr/local",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::copy("/bin/busybox", root.join("bin/busybox")).expect("/bin/busybox (busybox-static)");
    for a in [
        "sh", "ls", "cat", "echo", "sleep", "env", "test", "true", "grep", "head",
    ] {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(a));
    }
    import(n, IMAGE, &root, "/bin/sh");
}

/// The driver binary on the host, as a DaemonSet would run it.
struct DriverProc {
    child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
}

impl DriverProc {
    fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Some(
            Command::new(target_dir().join("vcuda-dra-driver"))
                .args(&self.args)
                .env("RUST_LOG", "info")
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("vcuda-dra-driver (cargo build --workspace)"),
        );
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn count(&self, needle: &str) -> usize {
        self.text().matches(needle).count()
    }

    /// `ms=` of every line with `needle`.
    fn millis(&self, needle: &str) -> Vec<u64> {
        self.text()
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("ms="))
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .map(|v| (v * 1000.0) as u64)
            .collect()
    }
}

impl Drop for DriverProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn claim_template(name: &str, cores: u32, memory: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: vcuda-share.vcuda.tencent.com
          capacity:
            requests: {{cores: "{cores}", memory: {memory}}}
"#
    )
}

/// A pod of the busybox image with the host's glibc, the test programs at
/// /work and the simulated driver's state at /run/gpu-sim, holding one
/// claim from `template`.
fn pod(name: &str, template: &str, cmd: &str, bin: &Path, sim: &Path) -> String {
    let lib64 = Path::new("/usr/lib64").exists();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: {template}
  containers:
  - name: main
    image: {IMAGE}
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", {cmd:?}]
    resources:
      claims: [{{name: gpu}}]
    volumeMounts:
    - {{name: glibc, mountPath: /lib/x86_64-linux-gnu, readOnly: true}}
{m64}    - {{name: work, mountPath: /work, readOnly: true}}
    - {{name: gpu-sim, mountPath: /run/gpu-sim}}
  volumes:
  - {{name: glibc, hostPath: {{path: /usr/lib/x86_64-linux-gnu}}}}
{v64}  - {{name: work, hostPath: {{path: {bin}}}}}
  - {{name: gpu-sim, hostPath: {{path: {state}}}}}
"#,
        m64 = if lib64 {
            "    - {name: lib64, mountPath: /lib64, readOnly: true}\n"
        } else {
            ""
        },
        v64 = if lib64 {
            "  - {name: lib64, hostPath: {path: /usr/lib64}}\n"
        } else {
            ""
        },
        bin = bin.display(),
        state = sim.join("run/gpu-sim").display(),
    )
}

/// The pod's claim (made from its template) as the API server has it.
fn pod_claim(n: &Node, pod: &str) -> Result<Value, String> {
    let p = n.json(&["-n", NS, "get", "pod", pod])?;
    let name = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .ok_or("no resourceClaimStatuses yet")?
        .to_string();
    n.json(&["-n", NS, "get", "resourceclaim", &name])
}

fn wait_running(n: &Node, pod: &str, secs: u64) -> Duration {
    let t0 = Instant::now();
    wait(&format!("pod {pod} Running"), secs, || {
        let p = n.json(&["-n", NS, "get", "pod", pod])?;
        match p["status"]["phase"].as_str() {
            Some("Running") => Ok(()),
            Some("Failed") => panic!(
                "pod {pod} failed: {}\n{}",
                p["status"],
                n.kubectl(&["-n", NS, "describe", "pod", pod])
                    .unwrap_or_default()
            ),
            other => Err(format!(
                "{other:?}; events: {}",
                tail(
                    &n.kubectl(&["-n", NS, "get", "events"]).unwrap_or_default(),
                    5
                )
            )),
        }
    });
    t0.elapsed()
}

/// Waits until the pod's log has `marker`, then returns the log.
fn log_with(n: &Node, pod: &str, marker: &str) -> String {
    wait(&format!("pod {pod}'s log to show {marker:?}"), 60, || {
        let l = n.kubectl(&["-n", NS, "logs", pod])?;
        if l.contains(marker) { Ok(l) } else { Err(l) }
    })
}

fn check_quota(out: &str, who: &str) {
    let a = kv(out);
    assert_eq!(
        get_u64(&a, "start_total", out),
        1024 * MIB,
        "{who}: total = 1 GiB\n{out}"
    );
    assert_eq!(
        get_u64(&a, "start_device_total", out),
        1024 * MIB,
        "{who}\n{out}"
    );
    assert_eq!(
        get_u64(&a, "last", out),
        2,
        "{who}: refused past 1 GiB (OOM)\n{out}"
    );
    assert!(
        get_u64(&a, "allocated", out) >= 3,
        "{who}: 3 × 256 MiB fit\n{out}"
    );
}

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
    // SAFETY: plain libc query.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the node's host side needs root"
    );
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
    let _host_dev = HostDevCleanup(
        installed
            .lines()
            .filter_map(|l| l.strip_prefix("host device node "))
            .filter_map(|l| {
                l.strip_suffix(" created (1:3)")
                    .or_else(|| l.strip_suffix(" kept (1:3)"))
            })
            .map(PathBuf::from)
            .collect(),
    );
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(bin.join("shim_client"))
        .arg(workspace_root().join("tests/c/shim_client.c"))
        .arg(format!("-I{}", workspace_root().join("tests/c").display()))
        .arg("-L")
        .arg(sim.join("usr/lib/x86_64-linux-gnu"))
        .arg("-lcuda"));
    import_busybox(&n, w);
    let _ = n.kubectl(&["delete", "namespace", NS, "--wait=true"]);
    n.ok(&["create", "namespace", NS]);

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
    wait("the kubelet to register the plugin", 60, || {
        if drv.count("registered with the kubelet") > 0 {
            Ok(())
        } else {
            Err(tail(&drv.text(), 5))
        }
    });

    // ------------------------------------------------ a critical Xid
    // gpu-0 leaves the slice (generation + 1), the real scheduler places a
    // claim elsewhere, and the quiet period brings gpu-0 back (+ 2).
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
    sh(Command::new(target_dir().join("gpu-sim"))
        .arg("xid")
        .arg("--root")
        .arg(&sim)
        .args(["--gpu", "0", "--code", "79"]));
    wait("gpu-0 out of the slice", 30, || ours(gen0 + 1, 3));
    n.apply(&claim_template("gpu-30-1g", 30, "1Gi"));
    let mut to_running = Vec::new();
    n.apply(&pod("xid-probe", "gpu-30-1g", "sleep 100000", &bin, &sim));
    to_running.push(wait_running(&n, "xid-probe", 120));
    let probe = pod_claim(&n, "xid-probe").unwrap();
    let probe_dev = &probe["status"]["allocation"]["devices"]["results"][0]["device"];
    assert_ne!(
        probe_dev, "gpu-0",
        "the scheduler placed a claim on a GPU out of the slice: {probe}"
    );
    n.ok(&["-n", NS, "delete", "pod", "xid-probe", "--wait=true"]);
    wait("gpu-0 back in the slice after the quiet period", 60, || {
        ours(gen0 + 2, 4)
    });
    let generation = Value::from(gen0 + 2);

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
    wait("the restarted driver serving", 60, || {
        if drv.count("DRA driver serving") >= 2 {
            Ok(())
        } else {
            Err(tail(&drv.text(), 5))
        }
    });
    wait("the kubelet to register the restarted driver", 60, || {
        if drv.count("registered with the kubelet") >= 2 {
            Ok(())
        } else {
            Err(tail(&drv.text(), 5))
        }
    });
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

    // ------------------------------------------------ a batch for the figures
    n.apply(&claim_template("gpu-5", 5, "256Mi"));
    let batch: Vec<String> = (0..40).map(|i| format!("batch-{i}")).collect();
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
        prep.len() >= 44,
        "44 claims prepared with their ms in the driver's log:\n{}",
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

/// deploy/dra/driver.yaml applied as users apply it, with the test overlay
/// (local image, host paths of the simulated root): the DaemonSet Ready
/// under the RBAC authorizer with only its ClusterRole's verbs, a share
/// served, nothing forbidden in its log, everything removed after.
fn daemonset_phase(n: &Node, node: &str, w: &Path, sim: &Path, bin: &Path) {
    eprintln!("k8s_dra: deploy/dra/driver.yaml under RBAC");
    let etc = Path::new("/etc/gpu-manager");
    let _etc = util::Cleanup((!etc.exists()).then(|| etc.to_path_buf()));
    let root = cluster::daemon_rootfs(w, "vcuda-dra-driver");
    import(n, DRA_IMAGE, &root, "/usr/bin/vcuda-dra-driver");
    let deploy = workspace_root().join("deploy");
    for f in ["configmap.yaml", "dra/driver.yaml"] {
        n.ok(&["apply", "-f", deploy.join(f).to_str().unwrap()]);
    }
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
    let pod_name = wait("the driver's DaemonSet pod Ready", 180, || {
        let l = n.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=vcuda-dra-driver",
        ])?;
        for p in l["items"].as_array().into_iter().flatten() {
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if ready {
                return Ok(p["metadata"]["name"].as_str().unwrap().to_string());
            }
        }
        Err(format!(
            "{}",
            l["items"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| p["status"].to_string())
                .collect::<Vec<_>>()
                .join("; ")
        ))
    });
    eprintln!(
        "k8s_dra: DaemonSet pod Ready {:.2} s after the node was labelled",
        t0.elapsed().as_secs_f64()
    );
    let logs = || {
        n.kubectl(&["-n", "kube-system", "logs", &pod_name])
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
    n.ok(&["delete", "namespace", NS, "--wait=true", "--timeout=120s"]);
    wait("the DaemonSet's driver unprepared the claim", 60, || {
        let l = logs();
        if l.contains("claim unprepared") {
            Ok(())
        } else {
            Err(tail(&l, 5))
        }
    });
    let l = logs();
    assert!(
        !l.to_lowercase().contains("forbidden") && !l.contains("ERROR"),
        "the driver under its ClusterRole:\n{}",
        tail(&l, 30)
    );
    assert!(!l.contains("\u{1b}["), "no colour codes in the pod's log");
    n.ok(&["label", "node", node, "vcuda.tencent.com/mode-"]);
    n.ok(&[
        "delete",
        "-f",
        deploy.join("dra/driver.yaml").to_str().unwrap(),
        "--wait=true",
    ]);
    n.ok(&[
        "delete",
        "-f",
        deploy.join("configmap.yaml").to_str().unwrap(),
    ]);
    wait("the driver's pod gone", 120, || {
        let l = n.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=vcuda-dra-driver",
        ])?;
        if l["items"].as_array().is_none_or(Vec::is_empty) {
            Ok(())
        } else {
            Err("still there".into())
        }
    });
    let _ = n.kubectl(&["delete", "resourceslice", &format!("{node}-{DRIVER}")]);
}
