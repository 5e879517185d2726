//! A one-node cluster on a simulated GPU node: `gpu-sim install`, the API
//! server and kubelet emulators in this process, and the real `gpu-manager`
//! binary against them (the same set-up as `crates/testing/test-support/src/manager.rs`, plus the
//! interposer and the query port).

use crate::DemoError;
use crate::samples::{VCORE, VMEM};
use apiserver_emulator::ApiServer;
use kubelet_emulator::{KubeletEmulator, PodRef};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse;

pub const NODE: &str = "sim-node";

/// Where everything lives under the demo's work dir.
#[derive(Debug, Clone)]
pub struct Layout {
    pub work: PathBuf,
    pub sim_root: PathBuf,
    pub device_plugins: PathBuf,
    pub pod_resources: PathBuf,
    pub kubeconfig: PathBuf,
    pub vdriver: PathBuf,
    pub vm: PathBuf,
    pub checkpoint: PathBuf,
    pub manager_log: PathBuf,
    pub manager_out: PathBuf,
}

impl Layout {
    pub fn new(work: &Path) -> Layout {
        Layout {
            work: work.to_path_buf(),
            sim_root: work.join("sim"),
            device_plugins: work.join("device-plugins"),
            pod_resources: work.join("pod-resources/kubelet.sock"),
            kubeconfig: work.join("kubeconfig"),
            vdriver: work.join("vdriver"),
            vm: work.join("vm"),
            checkpoint: work.join("checkpoint"),
            manager_log: work.join("gpu-manager.log"),
            manager_out: work.join("gpu-manager.out"),
        }
    }
}

/// Runs `gpu-sim install`; returns its one-line report.
pub fn install(gpu_sim: &Path, node: &Path, root: &Path) -> Result<String, DemoError> {
    let out = Command::new(gpu_sim)
        .arg("install")
        .arg("--node")
        .arg(node)
        .arg("--root")
        .arg(root)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| DemoError::Io {
            what: format!("running {}", gpu_sim.display()),
            source,
        })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(DemoError::Setup(format!(
            "gpu-sim install failed: {}",
            stderr.trim()
        )));
    }
    if stderr.contains("cannot be passed to containers") {
        return Err(DemoError::Setup(format!(
            "gpu-sim install could not create character devices (run the demo as root): {}",
            stderr.trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The API server and kubelet emulators. Their servers run on `rt`.
pub struct Emulators {
    pub rt: tokio::runtime::Runtime,
    pub api: ApiServer,
    pub kubelet: KubeletEmulator,
}

impl Emulators {
    pub fn start(l: &Layout) -> Result<Emulators, DemoError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|source| DemoError::Io {
                what: "starting the async runtime".into(),
                source,
            })?;
        for d in [&l.device_plugins, l.pod_resources.parent().unwrap()] {
            std::fs::create_dir_all(d).map_err(|source| DemoError::Io {
                what: format!("creating {}", d.display()),
                source,
            })?;
        }
        let (api, kubelet) = rt.block_on(async {
            let api = ApiServer::start("127.0.0.1:0")
                .await
                .map_err(|e| DemoError::Setup(format!("API server emulator: {e}")))?;
            api.create_node(
                json!({"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}}),
            )
            .map_err(|e| DemoError::Setup(format!("creating node {NODE}: {e}")))?;
            api.write_kubeconfig(&l.kubeconfig)
                .map_err(|e| DemoError::Setup(format!("kubeconfig: {e}")))?;
            let kubelet = KubeletEmulator::start(&l.device_plugins, &l.pod_resources)
                .await
                .map_err(|e| DemoError::Setup(format!("kubelet emulator: {e}")))?;
            Ok::<_, DemoError>((api, kubelet))
        })?;
        Ok(Emulators { rt, api, kubelet })
    }

    /// Whether both vcuda device plugins registered and listed devices.
    pub fn registered(&self) -> bool {
        let v = self.kubelet.view().borrow().clone();
        [VCORE, VMEM].iter().all(|r| {
            v.resources
                .get(*r)
                .is_some_and(|x| x.connected && !x.devices.is_empty())
        })
    }

    /// Creates the pod bound to the node, pending; returns the kubelet's
    /// reference to it.
    pub fn create_pod(&self, object: &serde_json::Value) -> Result<PodRef, DemoError> {
        let mut pod = object.clone();
        pod["spec"]["nodeName"] = json!(NODE);
        pod["status"] = json!({"phase": "Pending"});
        let name = pod["metadata"]["name"].as_str().unwrap_or("").to_string();
        let namespace = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let stored = self
            .api
            .create_pod(pod)
            .map_err(|e| DemoError::Setup(format!("creating pod {namespace}/{name}: {e}")))?;
        Ok(PodRef {
            uid: stored["metadata"]["uid"].as_str().unwrap_or("").to_string(),
            name,
            namespace,
        })
    }

    /// kubelet's admission of one container: Allocate (+ PreStartContainer)
    /// for each resource; the responses merged as kubelet merges them into
    /// the container's runtime config.
    pub fn admit(
        &self,
        pod: &PodRef,
        container: &str,
        cores: u64,
        memory_units: u64,
    ) -> Result<Admission, String> {
        let mut req = vec![(VCORE, cores as usize)];
        if memory_units > 0 {
            req.push((VMEM, memory_units as usize));
        }
        let resp = self
            .rt
            .block_on(self.kubelet.admit(pod, container, &req))
            .map_err(|e| e.to_string())?;
        Ok(Admission::merge(&resp))
    }

    pub fn set_phase(&self, pod: &PodRef, phase: &str) {
        let _ = self.api.patch_pod(
            &pod.namespace,
            &pod.name,
            &json!({"status": {"phase": phase}}),
        );
    }

    /// Deletes the pod from the API server and frees its devices in kubelet.
    pub fn delete_pod(&self, pod: &PodRef) {
        let _ = self.api.delete_pod(&pod.namespace, &pod.name);
        let _ = self.kubelet.release_pod(&pod.uid);
    }

    pub fn stop(self) {
        self.rt.block_on(self.kubelet.stop());
        self.api.stop();
        self.rt.shutdown_timeout(Duration::from_secs(2));
    }
}

/// What kubelet hands the container runtime for one container.
#[derive(Debug, Clone, Default)]
pub struct Admission {
    /// (host path, container path)
    pub devices: Vec<(String, String)>,
    /// (host path, container path, read-only)
    pub mounts: Vec<(String, String, bool)>,
    pub envs: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

impl Admission {
    fn merge(resp: &BTreeMap<String, ContainerAllocateResponse>) -> Admission {
        let mut a = Admission::default();
        for r in resp.values() {
            for d in &r.devices {
                if !a.devices.iter().any(|(_, c)| *c == d.container_path) {
                    a.devices
                        .push((d.host_path.clone(), d.container_path.clone()));
                }
            }
            for m in &r.mounts {
                if !a.mounts.iter().any(|(_, c, _)| *c == m.container_path) {
                    a.mounts
                        .push((m.host_path.clone(), m.container_path.clone(), m.read_only));
                }
            }
            a.envs
                .extend(r.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
            a.annotations
                .extend(r.annotations.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        a
    }

    /// GPU minors from `tencent.com/vcuda-device`.
    pub fn minors(&self) -> Vec<u32> {
        self.annotations
            .get("tencent.com/vcuda-device")
            .map(|s| {
                s.split(',')
                    .filter_map(|d| d.trim().trim_start_matches("/dev/nvidia").parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The memory quota in bytes (`tencent.com/vcuda-memory`), 0 for whole GPUs.
    pub fn memory_bytes(&self) -> u64 {
        self.annotations
            .get("tencent.com/vcuda-memory")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// Shares get the interposer volume (`<vdriver>/nvidia`).
    pub fn shared(&self) -> bool {
        self.mounts
            .iter()
            .any(|(h, c, _)| c == "/usr/local/nvidia" && h.ends_with("/nvidia"))
    }
}

/// The `gpu-manager` process.
pub struct Manager {
    pub child: Child,
    pub query_port: u16,
}

impl Manager {
    /// `docker_endpoint`: the engine the workloads run in, which the manager
    /// reconciles its allocations with; `None` when they run as processes.
    pub fn start(
        bin_dir: &Path,
        volume_config: &Path,
        l: &Layout,
        docker_endpoint: Option<&str>,
    ) -> Result<Manager, DemoError> {
        let query_port = free_port()?;
        let log = std::fs::File::create(&l.manager_log).map_err(|source| DemoError::Io {
            what: format!("creating {}", l.manager_log.display()),
            source,
        })?;
        let out = std::fs::File::create(&l.manager_out).map_err(|source| DemoError::Io {
            what: format!("creating {}", l.manager_out.display()),
            source,
        })?;
        let bin = bin_dir.join("gpu-manager");
        let mut cmd = Command::new(&bin);
        cmd.arg("--share-mode")
            .args(["--hostname-override", NODE])
            .arg("--host-root")
            .arg(&l.sim_root)
            .arg("--volume-config")
            .arg(volume_config)
            .arg("--kubeconfig")
            .arg(&l.kubeconfig)
            .arg("--device-plugin-path")
            .arg(&l.device_plugins)
            .arg("--pod-resources-socket")
            .arg(&l.pod_resources)
            .arg("--vdriver-path")
            .arg(&l.vdriver)
            .arg("--virtual-manager-path")
            .arg(&l.vm)
            .arg("--checkpoint-path")
            .arg(&l.checkpoint)
            .arg("--interposer")
            // The file itself: the mirror links what it is given, and a
            // symlink into the build tree would dangle inside containers.
            .arg({
                let shim = bin_dir.join("libvcuda.so");
                shim.canonicalize().unwrap_or(shim)
            })
            .args(["--query-addr", "127.0.0.1"])
            .args(["--query-port", &query_port.to_string()])
            .args(["--sample-period", "1"])
            // Released pods are noticed within a second at the end.
            .args(["--allocation-check-period", "1"])
            .args(["--api-timeout", "10"])
            .env("RUST_LOG", "info")
            // Settings through the environment (each flag has one): a
            // manager build without these flags ignores them.
            .env("GPU_MANAGER_DISPLAY_SOCKET", l.work.join("display.sock"))
            .env(
                "GPU_MANAGER_CONTAINER_RUNTIME",
                if docker_endpoint.is_some() {
                    "docker"
                } else {
                    "none"
                },
            )
            .env(
                "GPU_MANAGER_CONTAINER_RUNTIME_ENDPOINT",
                docker_endpoint.unwrap_or("unix:///var/run/docker.sock"),
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log);
        // Its own process group: a Ctrl-C on the terminal reaches only the
        // demo, which then shuts everything down in order.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().map_err(|source| DemoError::Io {
            what: format!("starting {}", bin.display()),
            source,
        })?;
        Ok(Manager { child, query_port })
    }

    /// SIGTERM, then up to `grace` for it to exit; SIGKILL after that.
    /// Returns a description of how it ended and whether that was clean.
    pub fn stop(&mut self, grace: Duration) -> (bool, String) {
        if let Ok(Some(st)) = self.child.try_wait() {
            return (false, format!("had already exited ({st})"));
        }
        // SAFETY: SIGTERM to our own child, which we have not reaped yet (its PID is still ours).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < grace {
            if let Ok(Some(st)) = self.child.try_wait() {
                return (
                    st.success(),
                    format!(
                        "exited on SIGTERM in {:.1} s ({st})",
                        t.elapsed().as_secs_f64()
                    ),
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        (false, format!("ignored SIGTERM for {grace:?}; killed"))
    }
}

fn free_port() -> Result<u16, DemoError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| DemoError::Io {
        what: "finding a free TCP port for --query-port".into(),
        source,
    })?;
    Ok(l.local_addr().map(|a| a.port()).unwrap_or(5678))
}

/// The last `n` lines of a file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
