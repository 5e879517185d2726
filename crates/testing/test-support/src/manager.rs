//! A simulated GPU node with the real `gpu-manager` binary, the kubelet
//! emulator and the API server emulator: shared by the manager tests and
//! the benchmark harness.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::paths::{target_dir, workspace_root};
use crate::sim::SimNode;
use apiserver_emulator::ApiServer;
use kubelet_emulator::{KubeletEmulator, PodRef};
use serde_json::{Value, json};
use vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse;

pub const VCORE: &str = "tencent.com/vcuda-core";
pub const VMEM: &str = "tencent.com/vcuda-memory";
pub const NODE: &str = "sim-node";

pub struct Env {
    pub sim: SimNode,
    pub tmp: tempfile::TempDir,
    pub api: ApiServer,
    pub kubelet: KubeletEmulator,
    pub manager: Child,
    pub log: PathBuf,
    pub started: Instant,
    /// The display service's gRPC socket (`--display-socket`).
    pub display_socket: PathBuf,
    /// Its HTTP address (`--query-port 0`: the manager picks one and logs it).
    pub http_addr: SocketAddr,
    seq: u32,
}

pub struct Options {
    pub share_mode: bool,
    pub quiet_s: u64,
    /// More manager flags (a restart from its argv keeps them).
    pub extra_args: Vec<std::ffi::OsString>,
    /// Run on the installed node before the manager starts (an
    /// operator's MIG geometry, say).
    pub prepare: Option<fn(&SimNode)>,
    /// Run on the manager's directory (its `device-plugins` made, the
    /// kubelet emulator serving) just before the manager starts.
    pub beside: Option<fn(&std::path::Path)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            share_mode: true,
            quiet_s: 2,
            extra_args: Vec::new(),
            prepare: None,
            beside: None,
        }
    }
}

impl Env {
    pub async fn start(node: &str, opts: Options) -> Env {
        let sim = SimNode::install(node);
        if let Some(prepare) = opts.prepare {
            prepare(&sim);
        }
        let tmp = tempfile::tempdir().unwrap();
        let dp = tmp.path().join("device-plugins");
        std::fs::create_dir_all(&dp).unwrap();
        let api = ApiServer::start("127.0.0.1:0").await.unwrap();
        api.create_node(json!({"metadata": {"name": NODE}}))
            .unwrap();
        let kubeconfig = tmp.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let pr = tmp.path().join("pod-resources/kubelet.sock");
        let kubelet = KubeletEmulator::start(&dp, &pr).await.unwrap();
        let bin = target_dir().join("gpu-manager");
        assert!(
            bin.is_file(),
            "{} missing: run `cargo build --workspace` first",
            bin.display()
        );
        let log = tmp.path().join("manager.log");
        let display_socket = tmp.path().join("display.sock");
        let mut cmd = Command::new(&bin);
        cmd.arg("--host-root")
            .arg(sim.root())
            .arg("--volume-config")
            .arg(workspace_root().join("config/volume.conf"))
            .arg("--vdriver-path")
            .arg(tmp.path().join("vdriver"))
            .arg("--virtual-manager-path")
            .arg(tmp.path().join("vm"))
            .arg("--checkpoint-path")
            .arg(tmp.path().join("checkpoint"))
            .arg("--device-plugin-path")
            .arg(&dp)
            .arg("--pod-resources-socket")
            .arg(&pr)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--hostname-override")
            .arg(NODE)
            .arg("--xid-quiet-period")
            .arg(opts.quiet_s.to_string())
            .arg("--allocation-check-period")
            .arg("1")
            .arg("--api-timeout")
            .arg("10")
            // Concurrent managers must not collide on port 5678 or the socket.
            .arg("--query-port")
            .arg("0")
            .arg("--display-socket")
            .arg(&display_socket)
            .env("RUST_LOG", "info,gpu_manager=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if opts.share_mode {
            cmd.arg("--share-mode");
        }
        cmd.args(&opts.extra_args);
        if let Some(beside) = opts.beside {
            beside(tmp.path());
        }
        let started = Instant::now();
        let manager = cmd.spawn().unwrap();
        let mut env = Env {
            sim,
            tmp,
            api,
            kubelet,
            manager,
            log,
            started,
            display_socket,
            http_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            seq: 0,
        };
        env.wait_registered().await;
        // The display starts before the plugins register, so it is logged by now.
        env.http_addr = env.logged_http_addr().unwrap_or_else(|| {
            panic!(
                "manager logged no \"display: HTTP on\"; its log:\n{}",
                env.log_text()
            )
        });
        env
    }

    /// SIGKILL to the manager, then `args` (its command line, maybe
    /// changed: [`crate::cmdline`]) started with the same log; returns once
    /// it has registered.
    pub async fn kill9_and_start(&mut self, args: &[String]) {
        let regs = self.registrations();
        self.kill9();
        self.start_again(args, regs).await;
    }

    /// kill -9 of the manager, reaped.
    pub fn kill9(&mut self) {
        // SAFETY: SIGKILL to our own child, not yet reaped.
        unsafe { libc::kill(self.manager.id() as i32, libc::SIGKILL) };
        let _ = self.manager.wait();
    }

    /// A manager started with `args` after [`Env::kill9`], waited for
    /// until it registered (`regs`: [`Env::registrations`] before).
    pub async fn start_again(&mut self, args: &[String], regs: [u64; 2]) {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .unwrap();
        self.manager = Command::new(&args[0])
            .args(&args[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.wait_registered_since(regs).await;
    }

    /// Waits (30 s at most) until the manager registered both resources
    /// and the emulator follows them.
    pub async fn wait_registered(&self) {
        self.wait_registered_since([0, 0]).await;
    }

    /// Each resource's successful registrations so far: read before a
    /// manager is started again, for [`Env::wait_registered_since`].
    pub fn registrations(&self) -> [u64; 2] {
        let v = self.kubelet.view();
        let v = v.borrow();
        [VCORE, VMEM].map(|r| v.resources.get(r).map_or(0, |x| x.registrations))
    }

    /// Waits (30 s at most) until both resources registered again since
    /// `before` and the emulator follows the new registrations. After a
    /// kill, [`Env::wait_registered`] alone can return at once: the
    /// emulator reads the dead manager's stream as connected until it
    /// sees it end, and an admission then met no plugin (NotConnected).
    pub async fn wait_registered_since(&self, before: [u64; 2]) {
        let r = self
            .kubelet
            .wait_for(Duration::from_secs(30), |v| {
                [VCORE, VMEM].iter().zip(before).all(|(r, n)| {
                    v.resources.get(*r).is_some_and(|x| {
                        x.registrations > n && x.connected && !x.devices.is_empty()
                    })
                })
            })
            .await;
        if r.is_err() {
            panic!(
                "the manager did not register again (registrations before: {before:?}, now {:?}); its log:\n{}",
                self.registrations(),
                self.log_text()
            );
        }
    }

    /// The first `reason` Event about pod `name`, waited for (`within`);
    /// a panic naming the Events and the manager's log if none comes.
    pub async fn wait_event(&self, reason: &str, name: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let found = self
                .api
                .events()
                .into_iter()
                .find(|e| e["regarding"]["name"] == name && e["reason"] == reason);
            if let Some(e) = found {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no {reason} on {name}: {:?}\n{}",
                self.api.events(),
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (30 s at most) until `needle` appears `n` times in the
    /// manager's log; the log then.
    pub async fn wait_log(&self, needle: &str, n: usize) -> String {
        let t = Instant::now();
        loop {
            let log = self.log_text();
            if log.matches(needle).count() >= n {
                return log;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no {n}x {needle:?} in the manager's log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The address of the manager's "display: HTTP on <addr>, socket <path>" line.
    pub fn logged_http_addr(&self) -> Option<SocketAddr> {
        let log = self.log_text();
        let rest = log.rsplit_once("display: HTTP on ")?.1;
        rest.split([',', ' ', '\n']).next()?.parse().ok()
    }

    pub fn vm_dir(&self) -> PathBuf {
        self.tmp.path().join("vm")
    }

    /// Creates a pending pod on this node; returns its reference.
    pub fn pod(&mut self, containers: &[(&str, u64, u64)], annotations: &[(&str, &str)]) -> PodRef {
        self.seq += 1;
        let name = format!("pod-{}", self.seq);
        let cs: Vec<Value> = containers
            .iter()
            .map(|(n, core, mem)| {
                let mut l = serde_json::Map::new();
                if *core > 0 {
                    l.insert(VCORE.into(), json!(core.to_string()));
                }
                if *mem > 0 {
                    l.insert(VMEM.into(), json!(mem.to_string()));
                }
                json!({"name": n, "image": "cuda", "resources": {"limits": l}})
            })
            .collect();
        let ann: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let p = self
            .api
            .create_pod(json!({
                "metadata": {"name": name, "namespace": "default", "annotations": ann},
                "spec": {"nodeName": NODE, "containers": cs},
                "status": {"phase": "Pending"}
            }))
            .unwrap();
        PodRef {
            uid: p["metadata"]["uid"].as_str().unwrap().to_string(),
            name,
            namespace: "default".into(),
        }
    }

    /// Admits a container through the kubelet emulator (Allocate and
    /// PreStartContainer for each resource asked).
    pub async fn admit(
        &self,
        pod: &PodRef,
        container: &str,
        cores: usize,
        mem: usize,
    ) -> Result<BTreeMap<String, ContainerAllocateResponse>, kubelet_emulator::EmulatorError> {
        let mut req = vec![(VCORE, cores)];
        if mem > 0 {
            req.push((VMEM, mem));
        }
        self.kubelet.admit(pod, container, &req).await
    }

    /// The GPU minors of an admitted container (`tencent.com/vcuda-device`).
    pub fn minors(resp: &BTreeMap<String, ContainerAllocateResponse>) -> Vec<u32> {
        resp[VCORE].annotations["tencent.com/vcuda-device"]
            .split(',')
            .map(|d| d.trim_start_matches("/dev/nvidia").parse().unwrap())
            .collect()
    }

    /// Deletes the pod from the API server and kubelet; waits until the
    /// manager has released it.
    pub async fn delete(&self, pod: &PodRef) {
        self.api.delete_pod(&pod.namespace, &pod.name).unwrap();
        self.kubelet.release_pod(&pod.uid).unwrap();
        let dir = self.vm_dir().join(&pod.uid);
        let t = Instant::now();
        while dir.exists() && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            !dir.exists(),
            "manager kept {} after the pod was deleted",
            dir.display()
        );
    }

    /// The manager's checkpoint as it would load it (the newest slot that
    /// verifies), as JSON; no allocations when there is none.
    pub fn checkpoint(&self) -> Value {
        let cp = gpu_manager::world::checkpoint::Checkpoint::new(&self.checkpoint_dir());
        match cp.load() {
            Ok(Some((gpus, allocations))) => json!({"gpus": gpus, "allocations": allocations}),
            _ => json!({"allocations": []}),
        }
    }

    /// The checkpoint once every allocation in it (one at least) holds
    /// its vcuda-memory IDs and verified flag: those have no sync of their
    /// own and reach the checkpoint with the next Allocate's write or the
    /// lazy flush once Allocate calls pause
    /// (`gpu-manager/src/manager/persist.rs`), after the admission that
    /// made them answered. Panics with the last one after 10 s.
    pub async fn settled_checkpoint(&self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let cp = self.checkpoint();
            let all = cp["allocations"].as_array().cloned().unwrap_or_default();
            let settled = |a: &Value| {
                a["verified"] == true && a["vmemory_ids"].as_array().is_some_and(|v| !v.is_empty())
            };
            if !all.is_empty() && all.iter().all(settled) {
                return cp;
            }
            assert!(
                Instant::now() < deadline,
                "the checkpoint did not settle in 10 s: {all:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn checkpoint_dir(&self) -> PathBuf {
        self.tmp.path().join("checkpoint")
    }

    /// The checkpoint's allocations by `pod_uid/container`, without what
    /// may legitimately change (the verification flag).
    pub fn allocations_by_container(&self) -> BTreeMap<String, Value> {
        self.checkpoint()["allocations"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|mut a| {
                a.as_object_mut().unwrap().remove("verified");
                let id = format!(
                    "{}/{}",
                    a["pod_uid"].as_str().unwrap(),
                    a["container"].as_str().unwrap()
                );
                (id, a)
            })
            .collect()
    }

    /// The socket kubelet calls for `resource` now (each manager start
    /// names its own: `vcore-<instance>.sock`).
    pub fn plugin_socket(&self, resource: &str) -> PathBuf {
        let view = self.kubelet.view().borrow().clone();
        let r = view
            .resources
            .get(resource)
            .unwrap_or_else(|| panic!("{resource} is not registered"));
        self.kubelet.dir().join(&r.endpoint)
    }

    /// Allocate on the vcore plugin's socket directly (not through the emulator, which
    /// would refuse first for lack of free IDs): the manager's own capacity
    /// check. `ids` are of GPU 0's vcores no allocation holds (held ones
    /// would tell the manager that kubelet let their holder go).
    pub async fn direct_allocate(&self, ids: std::ops::Range<usize>) -> Result<(), tonic::Status> {
        use vcuda_api::deviceplugin::v1beta1::{
            AllocateRequest, ContainerAllocateRequest, device_plugin_client::DevicePluginClient,
        };
        let ch = device_plugin::connect_unix(self.plugin_socket(VCORE), Duration::from_secs(2))
            .await
            .unwrap();
        DevicePluginClient::new(ch)
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: ids.map(|k| format!("vcore-0-{k:02}")).collect(),
                }],
            })
            .await
            .map(|_| ())
    }

    pub fn allocation_count(&self) -> usize {
        self.checkpoint()["allocations"]
            .as_array()
            .map_or(0, |a| a.len())
    }

    pub fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.manager.id()))
            .unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn sim_root(&self) -> &Path {
        self.sim.root()
    }
}

/// The environment a container admitted with `resp` runs in, on this
/// host: the response's env with container paths under its mounts made
/// host paths, `VCUDA_CONFIG_DIR` at the host side of `/etc/vcuda`, and
/// `CUDA_VISIBLE_DEVICES` = `NVIDIA_VISIBLE_DEVICES` (the GPUs the
/// container runtime would expose, in that order).
pub fn container_env(resp: &ContainerAllocateResponse) -> Vec<(String, String)> {
    let host = |v: &str| {
        resp.mounts
            .iter()
            .find_map(|m| {
                v.strip_prefix(m.container_path.as_str())
                    .map(|rest| format!("{}{rest}", m.host_path))
            })
            .unwrap_or_else(|| v.to_string())
    };
    let mut env: Vec<(String, String)> = resp
        .envs
        .iter()
        .map(|(k, v)| (k.clone(), host(v)))
        .collect();
    env.push(("VCUDA_CONFIG_DIR".into(), host(quota_config::CONTAINER_DIR)));
    if let Some(v) = resp.envs.get("NVIDIA_VISIBLE_DEVICES") {
        env.push(("CUDA_VISIBLE_DEVICES".into(), v.clone()));
    }
    env
}

impl Drop for Env {
    fn drop(&mut self) {
        // SAFETY: SIGTERM to our own child, not yet reaped.
        unsafe { libc::kill(self.manager.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.manager.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.manager.kill();
        let _ = self.manager.wait();
    }
}
