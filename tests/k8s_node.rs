//! vcuda against a real Kubernetes 1.20 node (issue 13): etcd, kube-apiserver
//! (Node,RBAC), controller-manager, scheduler, containerd + runc + a CNI
//! bridge and kubelet, brought up by `tests/k8s/cluster.sh` from binaries
//! built out of Debian's `kubernetes` source package
//! (`tests/k8s/build-kubernetes.sh`), over a simulated 4-GPU node
//! (`gpu-sim install --host-dev`). Workloads are the C test programs in pods
//! of a local busybox image (`imagePullPolicy: Never`).
//!
//! One test, in phases (a failure names its phase):
//!  1. the real `gpu-manager` binary on the host: both resources on the node
//!     (400 / 240), a share's `-lcuda` and cudart-style programs see the quota
//!     as the card and are refused past it, two shares at 30/70 on one GPU;
//!  2. 20 live pods, the manager killed with -9 and restarted: quotas kept,
//!     a new process registers; kubelet restarted: resources back, pods
//!     undisturbed; pods deleted: allocations released;
//!  3. `deploy/` applied as users apply it, with the test overlay
//!     `deploy/test/daemonset-sim-patch.yaml` (local image, host paths of the
//!     simulated root): the DaemonSet Ready under the RBAC authorizer with
//!     only the ClusterRole's verbs, a share pod served, a refusal as a
//!     Warning Event.
//!
//! It runs when `VCUDA_K8S_BIN` is set or `VCUDA_REQUIRE_K8S=1` (tests/run.sh,
//! so CI, sets both) and skips with a line otherwise; with
//! `VCUDA_REQUIRE_K8S=1` anything missing fails it, named. One run per
//! machine at a time (`/tmp/vcuda-k8s.lock`). Figures are
//! printed (`k8s_node:` lines), never asserted on timing.
//! `VCUDA_K8S_KEEP=1` leaves the cluster up afterwards (tests/k8s/cluster.sh down).

use serde_json::Value;
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vcuda_tests::{http_get, target_dir, workspace_root};

const NODE_FILE: &str = "config/nodes/sim-4gpu-pcie.toml";
const IMAGE: &str = "docker.io/vcuda-test/busybox:local";
const MANAGER_IMAGE: &str = "docker.io/vcuda-test/gpu-manager:local";
const MANAGER_PORT: u16 = 25678;
const MIB: u64 = 1 << 20;
const UNIT: u64 = 256 * MIB;

fn k8s_bin() -> Option<PathBuf> {
    if let Some(b) = std::env::var_os("VCUDA_K8S_BIN") {
        return Some(PathBuf::from(b));
    }
    let mut found: Vec<PathBuf> = fs::read_dir("/var/cache/vcuda")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|n| n.to_string_lossy().starts_with("k8s-"))
                && p.join("kubelet").is_file()
        })
        .collect();
    found.sort();
    found.pop()
}

/// CI (tests/run.sh) says the suite must run: `VCUDA_REQUIRE_K8S=1`, or
/// `VCUDA_REQUIRE_ALL=1` (every test must run).
fn required() -> bool {
    ["VCUDA_REQUIRE_K8S", "VCUDA_REQUIRE_ALL"]
        .iter()
        .any(|v| std::env::var(v).as_deref() == Ok("1"))
}

/// Polls `f` every 200 ms until it gives a value; panics after `secs`
/// naming `what` and the last state `f` reported.
fn wait<T>(what: &str, secs: u64, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("waited {secs} s for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn kv(text: &str) -> HashMap<String, String> {
    text.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn get_u64(m: &HashMap<String, String>, k: &str, text: &str) -> u64 {
    m.get(k)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {k}= in:\n{text}"))
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
    node: String,
    script: PathBuf,
    keep: bool,
}

impl Cluster {
    fn up(bin: PathBuf) -> Cluster {
        let dir = PathBuf::from(
            std::env::var("VCUDA_K8S_DIR").unwrap_or_else(|_| "/tmp/vcuda-k8s".into()),
        );
        let c = Cluster {
            dir,
            bin,
            node: std::env::var("VCUDA_K8S_NODE").unwrap_or_else(|_| "vcuda-k8s-node".into()),
            script: workspace_root().join("tests/k8s/cluster.sh"),
            keep: std::env::var("VCUDA_K8S_KEEP").as_deref() == Ok("1"),
        };
        // A cluster left by an earlier run goes first: its pods and state
        // would mix with this run's.
        c.script_ok(&["down"]);
        c.script_ok(&["up"]);
        c
    }

    fn script(&self, args: &[&str]) -> std::process::Output {
        Command::new("bash")
            .arg(&self.script)
            .args(args)
            .env("VCUDA_K8S_BIN", &self.bin)
            .env("VCUDA_K8S_DIR", &self.dir)
            .env("VCUDA_K8S_NODE", &self.node)
            .output()
            .expect("bash tests/k8s/cluster.sh")
    }

    fn script_ok(&self, args: &[&str]) -> String {
        let out = self.script(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprint!("{stderr}");
        assert!(
            out.status.success(),
            "tests/k8s/cluster.sh {args:?} failed ({}): {stderr}",
            out.status
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    fn kubectl_cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(self.bin.join("kubectl"));
        c.arg("--kubeconfig").arg(self.kubeconfig()).args(args);
        c
    }

    fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let out = self.kubectl_cmd(args).output().expect("kubectl");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    fn kubectl_ok(&self, args: &[&str]) -> String {
        self.kubectl(args).unwrap_or_else(|e| panic!("{e}"))
    }

    fn apply(&self, yaml: &str) {
        let mut child = self
            .kubectl_cmd(&["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(yaml.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn json(&self, args: &[&str]) -> Result<Value, String> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        let s = self.kubectl(&a)?;
        serde_json::from_str(&s).map_err(|e| e.to_string())
    }

    /// The node's allocatable (vcuda-core, vcuda-memory).
    fn allocatable(&self) -> Result<(i64, i64), String> {
        let n = self.json(&["node", &self.node])?;
        let a = &n["status"]["allocatable"];
        let get = |k: &str| {
            a[k].as_str()
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0)
        };
        Ok((
            get("tencent.com/vcuda-core"),
            get("tencent.com/vcuda-memory"),
        ))
    }

    fn wait_allocatable(&self, what: &str, want: (i64, i64), secs: u64) {
        wait(what, secs, || match self.allocatable()? {
            got if got == want => Ok(()),
            got => Err(format!("allocatable {got:?}")),
        })
    }

    fn pod(&self, name: &str) -> Result<Value, String> {
        self.json(&["pod", name])
    }

    fn wait_phase(&self, name: &str, phases: &[&str], secs: u64) -> Value {
        wait(&format!("pod {name} in {phases:?}"), secs, || {
            let p = self.pod(name)?;
            let phase = p["status"]["phase"].as_str().unwrap_or("").to_string();
            if phases.contains(&phase.as_str()) {
                Ok(p)
            } else {
                Err(format!("phase {phase:?}, status {}", p["status"]))
            }
        })
    }

    fn logs(&self, name: &str) -> String {
        self.kubectl(&["logs", name]).unwrap_or_default()
    }

    /// Runs a pod to completion and returns its log.
    fn run_pod(&self, yaml: &str, name: &str) -> String {
        self.apply(yaml);
        let p = self.wait_phase(name, &["Succeeded", "Failed"], 180);
        let log = self.logs(name);
        assert_eq!(
            p["status"]["phase"], "Succeeded",
            "pod {name} failed: {}\nlog:\n{log}",
            p["status"]
        );
        log
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "k8s_node: VCUDA_K8S_KEEP=1: cluster left up in {} (tests/k8s/cluster.sh down)",
                self.dir.display()
            );
            return;
        }
        let out = self.script(&["down"]);
        if !out.status.success() {
            eprintln!(
                "k8s_node: cluster.sh down: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Paths of this run's node: the simulated root, the programs, the
/// manager's directories.
struct Work {
    sim: PathBuf,
    bin: PathBuf,
    mgr: PathBuf,
}

impl Work {
    fn new(dir: &Path) -> Work {
        let w = Work {
            sim: dir.join("sim"),
            bin: dir.join("work/bin"),
            mgr: dir.join("work/manager"),
        };
        fs::create_dir_all(&w.bin).unwrap();
        fs::create_dir_all(&w.mgr).unwrap();
        w
    }

    fn vm(&self) -> PathBuf {
        self.mgr.join("vm")
    }
}

/// A pod of the busybox image with the host's glibc, the test programs at
/// /work and the simulated driver's state at /run/gpu-sim (where the real
/// driver's kernel module would be): `sh -c CMD` under the given limits.
fn pod_yaml(w: &Work, name: &str, cores: u32, mem_units: u32, cmd: &str, labels: &str) -> String {
    let mut limits = format!("tencent.com/vcuda-core: \"{cores}\"");
    if mem_units > 0 {
        limits.push_str(&format!(", tencent.com/vcuda-memory: \"{mem_units}\""));
    }
    let mut lib64 = String::new();
    if Path::new("/usr/lib64").exists() {
        lib64 = "        - {name: lib64, mountPath: /lib64, readOnly: true}\n".into();
    }
    let mut lib64_vol = String::new();
    if !lib64.is_empty() {
        lib64_vol = "    - {name: lib64, hostPath: {path: /usr/lib64}}\n".into();
    }
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{app: vcuda-k8s-test{labels}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  containers:
    - name: main
      image: {IMAGE}
      imagePullPolicy: Never
      command: ["/bin/sh", "-c", {cmd:?}]
      resources:
        limits: {{{limits}}}
      volumeMounts:
        - {{name: glibc, mountPath: /lib/x86_64-linux-gnu, readOnly: true}}
{lib64}        - {{name: work, mountPath: /work, readOnly: true}}
        - {{name: gpu-sim, mountPath: /run/gpu-sim}}
  volumes:
    - {{name: glibc, hostPath: {{path: /usr/lib/x86_64-linux-gnu}}}}
{lib64_vol}    - {{name: work, hostPath: {{path: {bin}}}}}
    - {{name: gpu-sim, hostPath: {{path: {state}}}}}
"#,
        bin = w.bin.display(),
        state = w.sim.join("run/gpu-sim").display(),
    )
}

/// The real gpu-manager binary on the host, against the real kubelet.
struct HostManager {
    child: Option<Child>,
    log: PathBuf,
    args: Vec<String>,
}

impl HostManager {
    fn start(c: &Cluster, w: &Work) -> HostManager {
        let t = target_dir();
        let args: Vec<String> = [
            "--share-mode",
            "--hostname-override",
            &c.node,
            "--host-root",
            w.sim.to_str().unwrap(),
            "--volume-config",
            workspace_root()
                .join("config/volume.conf")
                .to_str()
                .unwrap(),
            "--interposer",
            t.join("libvcuda.so").to_str().unwrap(),
            "--kubeconfig",
            c.kubeconfig().to_str().unwrap(),
            "--vdriver-path",
            w.mgr.join("vdriver").to_str().unwrap(),
            "--virtual-manager-path",
            w.vm().to_str().unwrap(),
            "--checkpoint-path",
            w.mgr.join("checkpoint").to_str().unwrap(),
            "--display-socket",
            w.mgr.join("display.sock").to_str().unwrap(),
            "--query-port",
            &MANAGER_PORT.to_string(),
            // The node's containerd through CRI, with kubelet and the API
            // server, is what recovery asks.
            "--container-runtime",
            "containerd",
            "--container-runtime-endpoint",
            &format!(
                "unix://{}",
                c.dir.join("containerd/containerd.sock").display()
            ),
            "--xid-quiet-period",
            "5",
            "--allocation-check-period",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut m = HostManager {
            child: None,
            log: w.mgr.join("gpu-manager.log"),
            args,
        };
        m.spawn();
        m
    }

    fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(target_dir().join("gpu-manager"))
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("gpu-manager (cargo build --workspace)");
        self.child = Some(child);
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }

    fn ready(&self) -> bool {
        let addr: SocketAddr = ([127, 0, 0, 1], MANAGER_PORT).into();
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
            && http_get(addr, "/readyz").0 == 200
    }

    fn wait_ready(&mut self, secs: u64) {
        wait("gpu-manager /readyz", secs, || {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "gpu-manager exited ({st}); log:\n{}",
                    tail(&self.log_text(), 40)
                );
            }
            if self.ready() {
                Ok(())
            } else {
                Err(tail(&self.log_text(), 5))
            }
        });
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
            c.wait().unwrap();
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `took_us` of every "allocated" line so far.
    fn allocate_us(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .log_text()
            .lines()
            .filter(|l| l.contains(" allocated "))
            .filter_map(|l| kv(l).get("took_us").and_then(|x| x.parse().ok()))
            .collect();
        v.sort_unstable();
        v
    }
}

impl Drop for HostManager {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn compile(w: &Work, src: &Path, name: &str, with_cuda: bool) {
    let mut c = Command::new("gcc");
    c.arg("-O1")
        .arg("-o")
        .arg(w.bin.join(name))
        .arg(src)
        .arg(format!("-I{}", workspace_root().join("tests/c").display()));
    if with_cuda {
        c.arg("-L")
            .arg(w.sim.join("usr/lib/x86_64-linux-gnu"))
            .arg("-lcuda");
    } else {
        c.arg("-ldl");
    }
    let st = c.status().expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
}

/// A one-layer image imported into containerd's k8s.io namespace.
fn import_image(c: &Cluster, tag: &str, rootfs: &Path, entry: &[&str]) {
    let tar = rootfs.with_extension("tar");
    let mut args = vec![
        "image-tar",
        tag,
        rootfs.to_str().unwrap(),
        tar.to_str().unwrap(),
    ];
    args.extend_from_slice(entry);
    c.script_ok(&args);
    c.script_ok(&["import", tar.to_str().unwrap()]);
}

fn busybox_image(c: &Cluster, dir: &Path) {
    let root = dir.join("busybox-rootfs");
    fs::create_dir_all(root.join("bin")).unwrap();
    for d in ["tmp", "proc", "sys", "dev", "etc", "run", "usr/local"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    assert!(
        Path::new("/bin/busybox").is_file(),
        "/bin/busybox missing (apt-get install busybox-static)"
    );
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for a in [
        "sh", "ls", "cat", "echo", "sleep", "env", "test", "true", "grep", "head",
    ] {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(a));
    }
    import_image(c, IMAGE, &root, &["/bin/sh"]);
}

/// The manager image without a registry: the workspace's gpu-manager, its
/// shared libraries (from ldd) and the interposer where the ConfigMap
/// expects it, as deploy/Dockerfile lays them out.
fn manager_image(c: &Cluster, dir: &Path) {
    let root = dir.join("manager-rootfs");
    let t = target_dir();
    for d in [
        "usr/bin",
        "usr/lib/vcuda",
        "tmp",
        "etc/gpu-manager",
        "var/run",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::copy(t.join("gpu-manager"), root.join("usr/bin/gpu-manager")).unwrap();
    fs::copy(
        t.join("libvcuda.so"),
        root.join("usr/lib/vcuda/libvcuda.so"),
    )
    .unwrap();
    let ldd = Command::new("ldd")
        .arg(t.join("gpu-manager"))
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        let Some(p) = path else { continue };
        let real = fs::canonicalize(&p).unwrap();
        let dest = root.join(p.strip_prefix("/").unwrap());
        fs::create_dir_all(dest.parent().unwrap()).unwrap();
        fs::copy(&real, &dest).unwrap();
    }
    import_image(c, MANAGER_IMAGE, &root, &["/usr/bin/gpu-manager"]);
}

/// Host PIDs of the processes in pod `uid`'s cgroups among `pids`.
fn pids_of_pod(uid: &str, pids: &[u32]) -> Vec<u32> {
    let alt = uid.replace('-', "_");
    pids.iter()
        .copied()
        .filter(|p| {
            fs::read_to_string(format!("/proc/{p}/cgroup"))
                .is_ok_and(|s| s.contains(uid) || s.contains(&alt))
        })
        .collect()
}

/// One real node per machine (kubelet's /var/lib/kubelet, the ports, the
/// address on lo): a second run waits for the first.
/// Holds the flock while alive.
struct MachineLock {
    _file: fs::File,
}

impl MachineLock {
    fn take() -> MachineLock {
        use std::os::fd::AsRawFd;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/vcuda-k8s.lock")
            .unwrap();
        wait(
            "the real-node lock (/tmp/vcuda-k8s.lock: another run of this suite)",
            1200,
            || {
                // SAFETY: a valid open fd.
                if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                    Ok(())
                } else {
                    Err("held".into())
                }
            },
        );
        MachineLock { _file: f }
    }
}

#[test]
fn real_node_suite() {
    // The suite takes minutes and the whole machine's kubelet directory: it
    // runs when asked (tests/run.sh sets both), never as a side effect of a
    // plain `cargo test --workspace`.
    if std::env::var_os("VCUDA_K8S_BIN").is_none() && !required() {
        eprintln!(
            "skipped: the real-node suite runs with VCUDA_K8S_BIN=<dir> or VCUDA_REQUIRE_K8S=1 \
             (tests/run.sh sets them; see tests/k8s/README.md)"
        );
        return;
    }
    let Some(bin) = k8s_bin() else {
        let msg = "no Kubernetes binaries (VCUDA_K8S_BIN unset and no /var/cache/vcuda/k8s-*/bin/kubelet): \
                   run tests/k8s/build-kubernetes.sh (tests/run.sh does)";
        if required() {
            panic!(
                "the real-node suite must run here (VCUDA_REQUIRE_K8S=1 or VCUDA_REQUIRE_ALL=1) but {msg}"
            );
        }
        eprintln!("skipped: {msg}");
        return;
    };
    // SAFETY: plain libc query.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            !required(),
            "the real-node suite must run here (VCUDA_REQUIRE_K8S=1 or VCUDA_REQUIRE_ALL=1) but this is not root"
        );
        eprintln!("skipped: the real node needs root");
        return;
    }
    for f in ["gpu-manager", "gpu-sim", "libvcuda.so", "libcuda.so"] {
        assert!(
            target_dir().join(f).is_file(),
            "{f} missing in {}: cargo build --workspace first",
            target_dir().display()
        );
    }
    let _lock = MachineLock::take();
    let t_up = Instant::now();
    let c = Cluster::up(bin);
    eprintln!(
        "k8s_node: cluster up in {:.1} s",
        t_up.elapsed().as_secs_f64()
    );
    let w = Work::new(&c.dir);
    let mut figures: Vec<String> = Vec::new();

    // ------------------------------------------------------------ setup
    let out = Command::new(target_dir().join("gpu-sim"))
        .args(["install", "--node"])
        .arg(workspace_root().join(NODE_FILE))
        .arg("--root")
        .arg(&w.sim)
        .arg("--host-dev")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-sim install --host-dev: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let installed = String::from_utf8_lossy(&out.stdout).into_owned();
    eprint!("{installed}");
    // The sim's host device nodes go again at the end (those this install
    // created, and any a killed earlier run left: only this suite makes them).
    let _host_dev = HostDevCleanup(if c.keep {
        Vec::new()
    } else {
        installed
            .lines()
            .filter_map(|l| l.strip_prefix("host device node "))
            .filter_map(|l| {
                l.strip_suffix(" created (1:3)")
                    .or_else(|| l.strip_suffix(" kept (1:3)"))
            })
            .map(PathBuf::from)
            .collect()
    });
    let tc = workspace_root().join("tests/c");
    compile(&w, &tc.join("shim_client.c"), "shim_client", true);
    compile(&w, &tc.join("shim_compute.c"), "shim_compute", true);
    compile(
        &w,
        &workspace_root().join("tests/k8s/c/cudart_loader.c"),
        "cudart_loader",
        false,
    );
    busybox_image(&c, &c.dir.join("work"));

    // VCUDA_K8S_ONLY=deploy runs phase 3 alone (while working on it).
    let host_phases = std::env::var("VCUDA_K8S_ONLY").as_deref() != Ok("deploy");
    let quota = 8 * UNIT;
    if host_phases {
        host_manager_phases(&c, &w, &mut figures);
    }

    // ------------------------------------------------ phase 3: deploy/
    eprintln!("k8s_node: phase 3: deploy/ manifests, the DaemonSet under RBAC");
    let etc_existed = Path::new("/etc/gpu-manager").exists();
    let _etc_cleanup = Cleanup(if etc_existed {
        None
    } else {
        Some(PathBuf::from("/etc/gpu-manager"))
    });
    manager_image(&c, &c.dir.join("work"));
    let deploy = workspace_root().join("deploy");
    for f in ["rbac.yaml", "configmap.yaml", "daemonset.yaml"] {
        c.kubectl_ok(&["apply", "-f", deploy.join(f).to_str().unwrap()]);
    }
    let patch = fs::read_to_string(deploy.join("test/daemonset-sim-patch.yaml"))
        .unwrap()
        .replace("@SIM_ROOT@", w.sim.to_str().unwrap())
        .replace("@API_HOST@", "198.51.100.1")
        .replace("@API_PORT@", "26443")
        .replace(
            "@CONTAINERD_DIR@",
            c.dir.join("containerd").to_str().unwrap(),
        );
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "gpu-manager",
        "--type",
        "strategic",
        "-p",
        &patch,
    ]);
    let t_ds = Instant::now();
    c.kubectl_ok(&[
        "label",
        "node",
        &c.node,
        "nvidia-device-enable=enable",
        "--overwrite",
    ]);
    let mgr_pod = ds_ready_pod(&c, None);
    let ds_ready = t_ds.elapsed();
    figures.push(format!(
        "DaemonSet: pod Ready {:.2} s after the node was labelled (image built locally, RBAC authorizer)",
        ds_ready.as_secs_f64()
    ));
    c.wait_allocatable("resources from the DaemonSet's manager", (400, 240), 120);
    // A share served by it, which then stays, holding memory.
    c.apply(&pod_yaml(
        &w,
        "ds-share",
        30,
        8,
        "/work/shim_client quota 256 && echo --- && /work/cudart_loader 256 && echo --- \
         && sleep 1000000 | /work/shim_client hold 64",
        "",
    ));
    let share = c.wait_phase("ds-share", &["Running"], 120);
    let log = wait("ds-share's programs done and holding", 120, || {
        let l = c.logs("ds-share");
        if l.contains("holding pid=") {
            Ok(l)
        } else {
            Err(l)
        }
    });
    let parts: Vec<&str> = log.split("---").collect();
    let (lcuda, cudart) = (parts[0], parts[1]);
    assert_eq!(get_u64(&kv(lcuda), "start_total", &log), quota, "{log}");
    assert_eq!(get_u64(&kv(lcuda), "last", &log), 2, "{log}");
    assert_eq!(get_u64(&kv(cudart), "total", &log), quota, "{log}");
    assert_eq!(get_u64(&kv(cudart), "last", &log), 2, "{log}");

    // The manager's pod deleted: the DaemonSet's new pod recovers the live
    // share (checkpoint on the host path, kubelet, API server, containerd
    // through CRI) and its process registers again.
    let share_uid = share["metadata"]["uid"].as_str().unwrap().to_string();
    let t_re = Instant::now();
    c.kubectl_ok(&[
        "-n",
        "kube-system",
        "delete",
        "pod",
        &mgr_pod,
        "--wait=false",
    ]);
    // The DaemonSet makes the new pod once kubelet has removed the old one.
    wait("the DaemonSet's new pod", 240, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager",
        ])?;
        let names: Vec<String> = l["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
            .collect();
        if names.iter().any(|n| *n != mgr_pod) {
            Ok(())
        } else {
            Err(format!("{names:?}"))
        }
    });
    let t_new = t_re.elapsed();
    let mgr_pod = ds_ready_pod(&c, Some(&mgr_pod));
    let re_ready = t_re.elapsed().saturating_sub(t_new);
    let mlog_of = |pod: &str| {
        c.kubectl(&["-n", "kube-system", "logs", pod])
            .unwrap_or_default()
    };
    let rec = wait("the new manager pod's recovery line", 60, || {
        let l = mlog_of(&mgr_pod);
        l.lines()
            .find(|l| l.contains("recovery finished"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    let rk = kv(&rec);
    assert!(
        rk.get("kept").is_some_and(|k| k == "1")
            && rk.get("unreachable").is_some_and(|u| u == "[]"),
        "the new manager pod kept the live share, every source reachable: {rec}"
    );
    wait(
        "ds-share's process registered with the new manager pod",
        60,
        || {
            let l = mlog_of(&mgr_pod);
            if l.lines()
                .any(|l| l.contains("interposer registered") && l.contains(&share_uid))
            {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    let out = c.kubectl_ok(&["exec", "ds-share", "--", "/work/shim_client", "quota", "64"]);
    assert_eq!(get_u64(&kv(&out), "start_total", &out), quota, "{out}");
    figures.push(format!(
        "DaemonSet pod deleted with a live share: the new pod created {:.2} s after the delete (kubelet removing the old one), Ready {:.2} s after that ({rec_ms}), the share's process registered again",
        t_new.as_secs_f64(),
        re_ready.as_secs_f64(),
        rec_ms = rk.get("recovery_ms").map(|v| format!("recovery_ms={v}")).unwrap_or_default()
    ));
    // A refused request becomes a Warning Event on the pod (events.k8s.io/v1
    // create, the ClusterRole's only events verb).
    c.apply(&pod_yaml(&w, "refused", 30, 0, "true", ""));
    let ev = wait(
        "a VcudaAllocateFailed Warning Event on pod refused",
        120,
        || {
            let l = c.json(&["events.v1.events.k8s.io", "-n", "default"])?;
            l["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| {
                    e["reason"] == "VcudaAllocateFailed" && e["regarding"]["name"] == "refused"
                })
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "events: {}",
                        l["items"]
                            .as_array()
                            .map(|a| a
                                .iter()
                                .map(|e| e["reason"].to_string())
                                .collect::<Vec<_>>()
                                .join(","))
                            .unwrap_or_default()
                    )
                })
        },
    );
    assert_eq!(ev["type"], "Warning", "{ev}");
    let mlog = c
        .kubectl(&["-n", "kube-system", "logs", &mgr_pod])
        .unwrap_or_default();
    for l in mlog.lines().filter(|l| {
        l.contains(" WARN ")
            || l.contains(" ERROR ")
            || l.contains("container runtime for recovery")
            || l.contains("recovery finished")
    }) {
        eprintln!("k8s_node: DaemonSet manager: {l}");
    }
    assert!(
        !mlog.contains("no container runtime socket"),
        "the DaemonSet's manager found no runtime (the overlay mounts the node's containerd at /run/containerd):\n{}",
        tail(&mlog, 40)
    );
    assert!(
        !mlog.contains("forbidden") && !mlog.contains("Forbidden"),
        "the manager was refused by the RBAC authorizer:\n{}",
        tail(&mlog, 40)
    );
    c.kubectl_ok(&["delete", "pods", "--all", "--wait=false"]);
    c.kubectl_ok(&["-n", "kube-system", "delete", "daemonset", "gpu-manager"]);
    wait("the DaemonSet's pod gone", 120, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager",
        ])?;
        let k = l["items"].as_array().map(|a| a.len()).unwrap_or(0);
        if k == 0 {
            Ok(())
        } else {
            Err(format!("{k} pods"))
        }
    });

    eprintln!("k8s_node: figures (kubelet 1.20, containerd 1.6, 2-core machine):");
    for f in &figures {
        eprintln!("k8s_node:   {f}");
    }
}

/// Phases 1 and 2: the real gpu-manager binary on the host.
fn host_manager_phases(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    let quota = 8 * UNIT;
    let uid = |p: &Value| p["metadata"]["uid"].as_str().unwrap().to_string();
    // ------------------------------------------------ phase 1: resources
    eprintln!("k8s_node: phase 1: the manager on the host, resources, quotas");
    let t0 = Instant::now();
    let mut m = HostManager::start(&c, &w);
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
            &w,
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

    // Two shares on one GPU at 30/70.
    let secs = 50;
    for (name, cores) in [("share30", 30), ("share70", 70)] {
        c.apply(&pod_yaml(
            &w,
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
    let mut busy: HashMap<&str, f64> = HashMap::new();
    for (p, pct) in state.process_utilization(g30, from, to) {
        let Some(hp) = p.host_pid else { continue };
        if !pids_of_pod(&u30, &[hp]).is_empty() {
            *busy.entry("30").or_default() += pct;
        } else if !pids_of_pod(&u70, &[hp]).is_empty() {
            *busy.entry("70").or_default() += pct;
        }
    }
    let (b30, b70) = (busy["30"], busy["70"]);
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
        "Xid 79 on GPU 3: out of kubelet's allocatable after {:.2} s, back {:.2} s after the Xid (quiet period 5 s) (ListAndWatch updates through kubelet 1.20)",
        t_out.as_secs_f64(),
        t_xid.elapsed().as_secs_f64()
    ));

    // ------------------------------------------------ phase 2: restarts
    eprintln!("k8s_node: phase 2: 20 live pods, manager kill -9, kubelet restart, deletion");
    let n = 20;
    let t_pods = Instant::now();
    for i in 0..n {
        c.apply(&pod_yaml(
            &w,
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
        sim_procs(&state) >= n,
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
        .filter(|l| l.contains("recovery finished"))
        .next_back()
        .and_then(|l| kv(l).get("recovery_ms").cloned())
        .unwrap_or_else(|| "?".into());
    let rec_line = m
        .log_text()
        .lines()
        .filter(|l| l.contains("recovery finished"))
        .next_back()
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
        sim_procs(&state) >= n,
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
        sim_procs(&state) >= n,
        "the live pods' processes survived kubelet's restart"
    );
    // A new pod after both restarts is served.
    let log = c.run_pod(
        &pod_yaml(&w, "after", 20, 4, "/work/cudart_loader 128", ""),
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
    m.stop();
}

/// The DaemonSet's Ready pod (another than `not`).
fn ds_ready_pod(c: &Cluster, not: Option<&str>) -> String {
    wait("the DaemonSet's pod Ready", 240, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager",
        ])?;
        let items = l["items"].as_array().cloned().unwrap_or_default();
        for p in &items {
            let name = p["metadata"]["name"].as_str().unwrap_or("");
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if ready && Some(name) != not {
                return Ok(name.to_string());
            }
        }
        Err(items
            .iter()
            .map(|p| p["status"].to_string())
            .collect::<Vec<_>>()
            .join("\n"))
    })
}

/// Removes a directory the test created on the host (/etc/gpu-manager).
struct Cleanup(Option<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = fs::remove_dir_all(p);
        }
    }
}

/// Removes the host device nodes `gpu-sim install --host-dev` created, if
/// they are still the sim's 1:3 nodes.
struct HostDevCleanup(Vec<PathBuf>);

impl Drop for HostDevCleanup {
    fn drop(&mut self) {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        for p in &self.0 {
            if let Ok(m) = fs::symlink_metadata(p) {
                if m.file_type().is_char_device() && m.rdev() == libc::makedev(1, 3) {
                    let _ = fs::remove_file(p);
                }
            }
        }
    }
}
