//! The DRA real-node test's parts (tests/k8s_dra_node/main.rs): kubectl
//! against the node, images into its containerd, the driver binary on the
//! host, the claim and pod manifests, the quota check.

use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use test_support::k8s::util::{IMAGE, MIB, get_u64, tail, wait};
use test_support::kv;
use test_support::{target_dir, workspace_root};

pub const NS: &str = "vcuda-dra-test";
pub const DRIVER: &str = "vcuda.tencent.com";
pub const CDI_DIR: &str = "/var/run/cdi";
pub const DRA_IMAGE: &str = "docker.io/vcuda-test/vcuda-dra-driver:local";
/// The driver DaemonSet's `app.kubernetes.io/name`.
pub const DRIVER_APP: &str = "vcuda-dra-driver";

pub struct Node {
    pub kubeconfig: PathBuf,
    pub containerd: PathBuf,
}

impl Node {
    /// The pods in kube-system labelled `app.kubernetes.io/name=<app>`.
    pub fn app_pods(&self, app: &str) -> Result<Vec<Value>, String> {
        let l = self.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            &format!("app.kubernetes.io/name={app}"),
        ])?;
        Ok(l["items"].as_array().cloned().unwrap_or_default())
    }

    /// The driver DaemonSet's pods.
    pub fn driver_pods(&self) -> Result<Vec<Value>, String> {
        self.app_pods(DRIVER_APP)
    }

    /// The name of the one Ready pod of `app` not being deleted.
    pub fn ready_pod(&self, app: &str) -> Result<String, String> {
        let pods = self.app_pods(app)?;
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
            _ => Err(format!(
                "{} Ready {app} pods of {}",
                ready.len(),
                pods.len()
            )),
        }
    }

    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
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

    pub fn ok(&self, args: &[&str]) -> String {
        self.kubectl(args).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn json(&self, args: &[&str]) -> Result<Value, String> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&a)?).map_err(|e| e.to_string())
    }

    pub fn apply(&self, yaml: &str) {
        let f = tempfile::NamedTempFile::new().unwrap();
        fs::write(f.path(), yaml).unwrap();
        self.ok(&["apply", "-f", f.path().to_str().unwrap()]);
    }
}

/// kubectl from the node's binaries when it is not on PATH.
pub fn path_with_kubectl() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    match std::env::var("VCUDA_DRA_KUBECTL_DIR") {
        Ok(d) => format!("{d}:{path}"),
        Err(_) => path,
    }
}

pub fn sh(cmd: &mut Command) -> String {
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
pub fn import(n: &Node, tag: &str, root: &Path, entry: &str) {
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

/// `kubectl apply -k deploy/<overlay>` as users apply it, then the test's
/// strategic merge patch `deploy/test/<patch>` on the DaemonSet `ds` in
/// kube-system, its placeholders filled in: the simulated root, the API
/// server's address, this node's containerd directory. The API server's
/// (host, port).
pub fn install_overlay(
    n: &Node,
    overlay: &str,
    ds: &str,
    patch: &str,
    sim: &Path,
) -> (String, String) {
    let deploy = workspace_root().join("deploy");
    n.ok(&["apply", "-k", deploy.join(overlay).to_str().unwrap()]);
    let (host, port) = api_address(n);
    let patch = fill_patch(n, patch, sim, (&host, &port));
    n.ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        ds,
        "--type",
        "strategic",
        "-p",
        &patch,
    ]);
    (host, port)
}

/// [`NS`] anew: one an earlier run or phase left goes first (its pods'
/// claims unprepared by whichever driver runs).
pub fn fresh_namespace(n: &Node) {
    let _ = n.kubectl(&["delete", "namespace", NS, "--wait=false"]);
    wait("no namespace of an earlier run", 180, || {
        match n.kubectl(&["get", "namespace", NS]) {
            Ok(s) => Err(s),
            Err(_) => Ok(()),
        }
    });
    n.ok(&["create", "namespace", NS]);
}

/// The API server's host and port, as the kubeconfig names it (pods reach
/// it there: no kube-proxy for the kubernetes Service here).
pub fn api_address(n: &Node) -> (String, String) {
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
    (host.to_string(), port.to_string())
}

/// deploy/test/`patch` with the simulated root, the API server and
/// containerd's directory filled in.
pub fn fill_patch(n: &Node, patch: &str, sim: &Path, (host, port): (&str, &str)) -> String {
    let deploy = workspace_root().join("deploy");
    fs::read_to_string(deploy.join("test").join(patch))
        .unwrap()
        .replace("@SIM_ROOT@", sim.to_str().unwrap())
        .replace("@API_HOST@", host)
        .replace("@API_PORT@", port)
        .replace(
            "@CONTAINERD_DIR@",
            n.containerd.parent().unwrap().to_str().unwrap(),
        )
}

/// The busybox image; the host's glibc is mounted at run time.
pub fn import_busybox(n: &Node, dir: &Path) {
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

/// `vcuda-dra-driver hold-sockets` on the host, as the DaemonSet's sidecar.
pub struct SocketHolder(Child);

impl SocketHolder {
    pub fn start(sock: &Path, log: &Path) -> SocketHolder {
        let child = Command::new(target_dir().join("vcuda-dra-driver"))
            .arg("hold-sockets")
            .arg(sock)
            .env("RUST_LOG", "info")
            .stderr(fs::File::create(log).unwrap())
            .spawn()
            .expect("vcuda-dra-driver (cargo build --workspace)");
        wait("the socket holder listening", 10, || {
            std::os::unix::net::UnixStream::connect(sock)
                .map(drop)
                .map_err(|e| e.to_string())
        });
        SocketHolder(child)
    }
}

impl Drop for SocketHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The driver binary on the host, as a DaemonSet would run it.
pub struct DriverProc {
    pub child: Option<Child>,
    pub args: Vec<String>,
    pub log: PathBuf,
}

impl DriverProc {
    pub fn spawn(&mut self) {
        self.spawn_program("vcuda-dra-driver");
    }

    /// The workspace's binary `program` (`gpu-manager`: the device-plugin
    /// mode's daemon) with these arguments and log.
    pub fn spawn_program(&mut self, program: &str) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Some(
            Command::new(target_dir().join(program))
                .args(&self.args)
                .env("RUST_LOG", "info")
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("{program} (cargo build --workspace): {e}")),
        );
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn count(&self, needle: &str) -> usize {
        self.text().matches(needle).count()
    }

    /// Waits until the log has `needle` at least `times` times.
    pub fn wait_for(&self, what: &str, needle: &str, times: usize, secs: u64) {
        wait(what, secs, || {
            if self.count(needle) >= times {
                Ok(())
            } else {
                Err(tail(&self.text(), 5))
            }
        });
    }

    /// `ms=` of every line with `needle`.
    pub fn millis(&self, needle: &str) -> Vec<u64> {
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

pub fn claim_template(name: &str, cores: u32, memory: &str) -> String {
    claim_template_with(name, cores, memory, "", "")
}

/// [`claim_template`] with `extra` lines under the request's `exactly`
/// (selectors) and `config` under `devices` (the driver's opaque config).
pub fn claim_template_with(
    name: &str,
    cores: u32,
    memory: &str,
    extra: &str,
    config: &str,
) -> String {
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
{extra}{config}"#
    )
}

/// A pod of the busybox image with the host's glibc, the test programs at
/// /work and the simulated driver's state at /run/gpu-sim, holding one
/// claim from `template`.
pub fn pod(name: &str, template: &str, cmd: &str, bin: &Path, sim: &Path) -> String {
    let claim =
        format!("  resourceClaims:\n  - name: gpu\n    resourceClaimTemplateName: {template}\n");
    pod_asking(name, &claim, "claims: [{name: gpu}]", cmd, bin, sim)
}

/// The same pod asking the device plugins for a share: `cores` of
/// `tencent.com/vcuda-core`, `units` of `tencent.com/vcuda-memory`.
pub fn share_pod(name: &str, cores: u32, units: u32, cmd: &str, bin: &Path, sim: &Path) -> String {
    let limits = format!(
        "limits: {{tencent.com/vcuda-core: \"{cores}\", tencent.com/vcuda-memory: \"{units}\"}}"
    );
    pod_with_limits(name, &limits, cmd, bin, sim)
}

/// The same pod with `limits` (a YAML flow map line) and no claim.
pub fn pod_with_limits(name: &str, limits: &str, cmd: &str, bin: &Path, sim: &Path) -> String {
    pod_asking(name, "", limits, cmd, bin, sim)
}

fn pod_asking(
    name: &str,
    pod_spec: &str,
    resources: &str,
    cmd: &str,
    bin: &Path,
    sim: &Path,
) -> String {
    let lib64 = Path::new("/usr/lib64").exists();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
{pod_spec}  containers:
  - name: main
    image: {IMAGE}
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", {cmd:?}]
    resources:
      {resources}
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

/// Ok when the kubelet shows `device` of pod `pod`'s first container as
/// `want` (`allocatedResourcesStatus`, from the driver's health stream;
/// the kubelet names a resource by its CDI ID, `...=<claim uid>-<request>-<device>`);
/// else what it shows.
pub fn device_health_is(n: &Node, pod: &str, device: &str, want: &str) -> Result<(), String> {
    let p = n.json(&["-n", NS, "get", "pod", pod])?;
    let st = &p["status"]["containerStatuses"][0]["allocatedResourcesStatus"];
    let found = st
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
        .any(|r| {
            r["resourceID"]
                .as_str()
                .is_some_and(|id| id.ends_with(&format!("-{device}")))
                && r["health"] == want
        });
    if found { Ok(()) } else { Err(st.to_string()) }
}

/// The first `reason` Event about `pod` in the suite's namespace, waited
/// for (30 s).
pub fn event_on(n: &Node, reason: &str, pod: &str) -> Value {
    wait(&format!("the {reason} event"), 30, || {
        let selector = format!("reason={reason}");
        let list = n.json(&["-n", NS, "get", "events", "--field-selector", &selector])?;
        test_support::k8s::util::event_about(&list, pod)
    })
}

/// The pod's claim (made from its template) as the API server has it.
pub fn pod_claim(n: &Node, pod: &str) -> Result<Value, String> {
    let p = n.json(&["-n", NS, "get", "pod", pod])?;
    let name = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .ok_or("no resourceClaimStatuses yet")?
        .to_string();
    n.json(&["-n", NS, "get", "resourceclaim", &name])
}

pub fn wait_running(n: &Node, pod: &str, secs: u64) -> Duration {
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
    let took = t0.elapsed();
    if took > Duration::from_secs(5) {
        eprintln!(
            "k8s_dra: pod {pod} took {:.1} s to Running; its events:\n{}",
            took.as_secs_f64(),
            pod_events(n, pod)
        );
    }
    took
}

/// The events of pod `pod` in [`NS`] (empty when kubectl fails).
pub fn pod_events(n: &Node, pod: &str) -> String {
    n.kubectl(&[
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={pod}"),
    ])
    .unwrap_or_default()
}

/// Waits until the pod's log has `marker`, then returns the log.
pub fn log_with(n: &Node, pod: &str, marker: &str) -> String {
    wait(&format!("pod {pod}'s log to show {marker:?}"), 60, || {
        let l = n.kubectl(&["-n", NS, "logs", pod])?;
        if l.contains(marker) { Ok(l) } else { Err(l) }
    })
}

pub fn check_quota(out: &str, who: &str) {
    check_quota_of(out, who, 1024 * MIB);
}

/// `shim_client quota 256` held to `total` bytes: it sees them, fits all
/// but one 256 MiB block and is refused past them (OOM).
pub fn check_quota_of(out: &str, who: &str, total: u64) {
    let a = kv(out);
    let mib = total / MIB;
    assert_eq!(
        get_u64(&a, "start_total", out),
        total,
        "{who}: total = {mib} MiB\n{out}"
    );
    assert_eq!(
        get_u64(&a, "start_device_total", out),
        total,
        "{who}\n{out}"
    );
    assert_eq!(
        get_u64(&a, "last", out),
        2,
        "{who}: refused past {mib} MiB (OOM)\n{out}"
    );
    let fit = mib / 256 - 1;
    assert!(
        get_u64(&a, "allocated", out) >= fit,
        "{who}: {fit} × 256 MiB fit\n{out}"
    );
}

/// A template of two whole GPUs (the whole-GPU class, `count: 2`).
pub fn two_whole_template(name: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly:
          deviceClassName: vcuda-gpu.vcuda.tencent.com
          allocationMode: ExactCount
          count: 2
"#
    )
}

/// A template of a share and a whole GPU in one claim, which the driver
/// refuses at prepare (one `vcuda.config` per container).
pub fn mixed_template(name: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
      - name: share
        exactly:
          deviceClassName: vcuda-share.vcuda.tencent.com
          capacity:
            requests: {{cores: "30", memory: 1Gi}}
      - name: whole
        exactly:
          deviceClassName: vcuda-gpu.vcuda.tencent.com
"#
    )
}
