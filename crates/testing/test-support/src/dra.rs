//! A node for the DRA tests: the API server emulator, the driver (its
//! kubelet plugin and registration sockets in temp dirs) and the emulated
//! kubelet registered with it (crates/node/dra-driver/tests).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use apiserver_emulator::{ApiServer, Kind};
use dra_driver::driver::{Config, Driver};
use dra_driver::grpc::{self, RegistrationState, Sockets};
use dra_driver::kube_api::KubeApi;
use dra_kubelet_emulator::plugin::{self, DraPlugin};
use gpu_allocator::GpuInfo;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub const NODE: &str = "node-a";
pub const NS: &str = "team";

/// The whole driver's settings on the simulated node at `sim` (the
/// interposer this build made, no display, no MIG configuration), its
/// directories in `dirs`; tests change what they are about.
pub fn sim_settings(sim: &Path, dirs: &Dirs) -> dra_driver::daemon::Settings {
    dra_driver::daemon::Settings {
        node: NODE.into(),
        host_root: sim.to_path_buf(),
        nvml_library: None,
        volume_config: crate::workspace_root().join("config/volume.conf"),
        interposer: Some(crate::target_dir().join("libvcuda.so")),
        // Inside the sim root, so the sim's libraries find their state.
        vdriver_dir: sim.join("vdriver"),
        vm_dir: dirs.p("vm"),
        cdi_dir: dirs.p("cdi"),
        state_dir: dirs.p("state"),
        plugins_dir: dirs.p("plugins"),
        registry_dir: dirs.p("plugins_registry"),
        kubeconfig: Some(dirs.p("kubeconfig")),
        xid_quiet_period: Duration::from_secs(2),
        ignored_xids: vec![13, 31, 43, 45, 68, 109],
        unhealthy: dra_driver::slices::Unhealthy::Taint("NoSchedule"),
        resync_period: Duration::from_secs(60),
        extra_devices: vec![],
        display: None,
        sample_period: Duration::from_secs(1),
        // Report (the default).
        escape_policy: Default::default(),
        mig_geometry: Default::default(),
        mig_dynamic: vec![],
        // Read at start only: a test that wants rescans says so.
        mig_rescan_period: None,
    }
}

/// A claim `name` for one MIG device of `profile` (the MIG class, a
/// selector on the profile, as docs/mig.md shows it), created.
pub fn mig_claim(server: &ApiServer, name: &str, profile: &str) -> Value {
    let selector = format!(
        "device.attributes['{}'].profile == '{profile}'",
        dra_driver::DRIVER_NAME
    );
    server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({
                "metadata": {"name": name, "namespace": NS},
                "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
                    "deviceClassName": dra_driver::slices::MIG_CLASS,
                    "selectors": [{"cel": {"expression": selector}}]}}]}}
            }),
        )
        .unwrap()
}

pub async fn kube(server: &ApiServer, dir: &Path) -> KubeApi {
    let path = dir.join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    KubeApi {
        client: kube::Client::try_from(cfg).unwrap(),
    }
}

pub fn gpus() -> Vec<GpuInfo> {
    (0..2)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-0000000{i}"),
            minor: i as u32,
            memory_bytes: 16 << 30,
            numa_node: Some(0),
            pci_bus_id: format!("00000000:3{i}:00.0"),
        })
        .collect()
}

pub struct Dirs {
    pub tmp: tempfile::TempDir,
}

impl Default for Dirs {
    fn default() -> Self {
        Dirs::new()
    }
}

impl Dirs {
    pub fn new() -> Dirs {
        Dirs {
            tmp: tempfile::tempdir().unwrap(),
        }
    }
    pub fn p(&self, s: &str) -> PathBuf {
        self.tmp.path().join(s)
    }
    pub fn config(&self) -> Config {
        Config {
            node: NODE.into(),
            vm_root: self.p("vm"),
            vdriver_dir: self.p("vdriver"),
            cdi_dir: self.p("cdi"),
            state_dir: self.p("state"),
            driver_version: (550, 54),
            extra_devices: vec![],
        }
    }
    pub fn sockets(&self) -> Sockets {
        Sockets::new(&self.p("plugins"), &self.p("plugins_registry"))
    }
}

/// A running driver: cancel to stop it (a restart is another `start`).
pub struct Running {
    pub driver: Arc<Driver>,
    pub registration: Arc<std::sync::Mutex<RegistrationState>>,
    /// This instance's own sockets.
    pub sockets: Sockets,
    pub cancel: CancellationToken,
}

pub async fn start(dirs: &Dirs, gpus: Vec<GpuInfo>, api: &KubeApi) -> Running {
    let driver = Arc::new(Driver::start(dirs.config(), gpus, Arc::new(api.clone())).unwrap());
    let cancel = CancellationToken::new();
    let sockets = dirs.sockets();
    let registration = grpc::serve(driver.clone(), &sockets, cancel.clone())
        .await
        .unwrap();
    Running {
        driver,
        registration,
        sockets,
        cancel,
    }
}

/// The whole driver (`daemon::run`) on `settings`, registered with the
/// emulated kubelet, its slice published.
pub async fn run_daemon(
    server: &ApiServer,
    dirs: &Dirs,
    settings: dra_driver::daemon::Settings,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<anyhow::Result<()>>,
    DraPlugin,
) {
    let cancel = CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(dra_driver::daemon::run(settings, cancel.clone(), Some(tx)));
    tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .expect("the driver served its sockets within 60 s")
        .expect("the driver said it was ready");
    let kubelet = kubelet(dirs, false).await;
    let slice = dra_driver::slices::slice_name(NODE);
    until(10, "the slice published", || {
        server.get(Kind::ResourceSlice, None, &slice).is_some()
    })
    .await;
    (cancel, daemon, kubelet)
}

pub async fn kubelet(dirs: &Dirs, beta: bool) -> DraPlugin {
    plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(20), beta)
        .await
        .unwrap()
}

/// Creates a share claim (`cores` %, `memory`) with optional opaque params.
pub fn share_claim(
    server: &ApiServer,
    name: &str,
    cores: u32,
    memory: &str,
    params: Option<Value>,
) -> Value {
    let mut c = json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": dra_driver::slices::SHARE_CLASS,
            "capacity": {"requests": {"cores": cores.to_string(), "memory": memory}}}}]}}
    });
    if let Some(p) = params {
        c["spec"]["devices"]["config"] = json!([{"requests": ["gpu"], "opaque": {"driver": "vcuda.tencent.com", "parameters": p}}]);
    }
    server.create(Kind::ResourceClaim, Some(NS), c).unwrap()
}

/// A claim for shares of `cores` and `memory` on each of two GPUs (one
/// request, `count: 2`), allocated on gpu-0 and gpu-1 as the scheduler
/// would (the emulated allocator places count 1 only).
pub fn two_gpu_claim(server: &ApiServer, name: &str, cores: &str, memory: &str) -> String {
    two_gpu_claim_nth(server, name, cores, memory, 0)
}

/// [`two_gpu_claim`] as the `nth` claim allocated on gpu-0 and gpu-1: its
/// own share IDs, so several such claims share the two GPUs.
pub fn two_gpu_claim_nth(
    server: &ApiServer,
    name: &str,
    cores: &str,
    memory: &str,
    nth: u32,
) -> String {
    claim_on_gpus(server, name, (cores, memory), nth, &[0, 1], None)
}

/// A claim for shares of `cores` and `memory` on each of `gpus` (one
/// request, `gpus`, with `params` as its opaque config when given),
/// allocated there as the scheduler would, as the `nth` claim (its own
/// share IDs) of those GPUs.
pub fn claim_on_gpus(
    server: &ApiServer,
    name: &str,
    (cores, memory): (&str, &str),
    nth: u32,
    gpus: &[u32],
    params: Option<Value>,
) -> String {
    let mut spec = json!({"devices": {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": dra_driver::slices::SHARE_CLASS, "count": gpus.len(),
        "capacity": {"requests": {"cores": cores, "memory": memory}}}}]}});
    let mut config = json!([]);
    if let Some(p) = params {
        let opaque = json!({"driver": "vcuda.tencent.com", "parameters": p});
        spec["devices"]["config"] = json!([{"requests": ["gpus"], "opaque": opaque.clone()}]);
        config = json!([{"source": "FromClaim", "requests": ["gpus"], "opaque": opaque}]);
    }
    let c = server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({"metadata": {"name": name, "namespace": NS}, "spec": spec}),
        )
        .unwrap();
    let result = |gpu: u32| {
        json!({"request": "gpus", "driver": "vcuda.tencent.com", "pool": NODE,
               "device": format!("gpu-{gpu}"),
               "shareID": format!("{nth:07x}{gpu}-0000-4000-8000-000000000000"),
               "consumedCapacity": {"cores": cores, "memory": memory}})
    };
    let results: Vec<Value> = gpus.iter().map(|&g| result(g)).collect();
    let allocation = json!({"devices": {"results": results, "config": config}});
    server
        .patch(
            Kind::ResourceClaim,
            Some(NS),
            name,
            &json!({"status": {"allocation": allocation}}),
        )
        .unwrap();
    uid(&c)
}

pub fn uid(claim: &Value) -> String {
    claim["metadata"]["uid"].as_str().unwrap().to_string()
}

/// Polls `f` until it holds (or fails after `secs`).
pub async fn until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `env` with `CUDA_VISIBLE_DEVICES` set to its `NVIDIA_VISIBLE_DEVICES`,
/// as NVIDIA's container runtime turns one into the other.
pub fn exposed(mut env: Vec<(String, String)>) -> Vec<(String, String)> {
    let v = env
        .iter()
        .find(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
        .map(|(_, v)| v.clone())
        .expect("NVIDIA_VISIBLE_DEVICES in the CDI edits");
    env.push(("CUDA_VISIBLE_DEVICES".into(), v));
    env
}

/// What a runtime does with the CDI edits, without a mount namespace: the
/// env with container mount paths mapped to their host paths, and the
/// interposer pointed at the vm directory mounted at /etc/vcuda.
pub fn container_env(edits: &Value) -> Vec<(String, String)> {
    let mounts: Vec<(String, String)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap().to_string(),
                m["hostPath"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let mut env: Vec<(String, String)> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            let mut v = v.to_string();
            for (c, h) in &mounts {
                if let Some(rest) = v.strip_prefix(c.as_str()) {
                    v = format!("{h}{rest}");
                }
            }
            (k.to_string(), v)
        })
        .collect();
    // A share's vm directory (a MIG device or a whole GPU has none).
    if let Some(vm) = mounts.iter().find(|(c, _)| c == "/etc/vcuda") {
        env.push(("VCUDA_CONFIG_DIR".into(), vm.1.clone()));
    }
    env
}
