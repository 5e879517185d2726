//! The driver's CDI specs injected by a real container runtime: containerd
//! 1.7 with `enable_cdi` (tests/containerd/cdi.sh; bookworm's 1.6 has no
//! CDI) reading the spec directory the driver writes to. The emulated
//! kubelet prepares a 30 % / 1 GiB share claim; this test, standing in for
//! kubelet, creates containers over CRI that name the prepared device (the
//! `CDI_devices` field, and separately a `cdi.k8s.io/` annotation), and a
//! busybox in each reports what it sees: `/etc/vcuda/vcuda.config`, the
//! `/dev/nvidia*` nodes, `LD_LIBRARY_PATH`, `NVIDIA_VISIBLE_DEVICES` and
//! `/usr/local/nvidia`; each must match what the spec says. A device the
//! spec does not name must make CreateContainer fail naming it (injection is
//! live: the test cannot pass vacuously), and after unprepare the spec file
//! is gone and the prepared device no longer resolves.
//!
//! Needs `VCUDA_CDI_CONTAINERD_ENDPOINT` and `VCUDA_CDI_SPEC_DIR`
//! (`source tests/containerd/start.sh tests/containerd/cdi.sh;
//! start_test_containerd_cdi`) and root (the spec's device nodes must exist
//! on the host: missing ones are created as the simulator's 1:3 nodes and
//! removed again). tests/run.sh sets `VCUDA_REQUIRE_CONTAINERD=1`: there a
//! missing runtime fails the test instead of skipping it.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use apiserver_emulator::{ApiServer, Kind};
use cri_api::v1::runtime_service_client::RuntimeServiceClient;
use cri_api::v1::{
    CdiDevice, ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest,
    CreateContainerRequest, ImageSpec, PodSandboxConfig, PodSandboxMetadata, RunPodSandboxRequest,
    StartContainerRequest, VersionRequest,
};
use dra_driver::driver::Driver;
use dra_driver::grpc;
use dra_driver::publish::Publisher;
use dra_driver::slices::GpuDevice;
use dra_kubelet_emulator::{allocator, cdi, plugin};
use serde_json::{Value, json};
use test_support::dra::*;
use test_support::{Capability, missing};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Marks this test's sandboxes (leftovers of a killed run are removed).
const TEST_LABEL: &str = "vcuda-test/dra-cdi-containerd";
const IMAGE_DEFAULT: &str = "docker.io/vcuda-test/busybox:cri";

/// What the container reports, one `key=value` per line.
const SCRIPT: &str = r#"f=/etc/vcuda/vcuda.config
if [ -f $f ]; then echo "config=$(/bin/busybox wc -c < $f)"; else echo config=missing; fi
echo "devices=$(echo /dev/nvidia*)"
for d in /dev/nvidia*; do [ -c "$d" ] || echo "not_a_char_device=$d"; done
echo "ld=$LD_LIBRARY_PATH"
echo "visible=$NVIDIA_VISIBLE_DEVICES"
echo "driver=$(echo $(ls /usr/local/nvidia/lib64))"
if [ ! -d /etc/vcuda ]; then echo etc_vcuda=absent
elif ( : >/etc/vcuda/probe ) 2>/dev/null; then echo etc_vcuda=rw; else echo etc_vcuda=ro; fi
echo done=1
"#;

async fn cri_client(endpoint: &str) -> Result<RuntimeServiceClient<Channel>, String> {
    let path = endpoint.trim_start_matches("unix://");
    device_plugin::connect_unix(path, Duration::from_secs(5))
        .await
        .map(RuntimeServiceClient::new)
        .map_err(|e| e.to_string())
}

/// The CDI containerd, its spec directory and the image, if all are there.
async fn runtime() -> Option<(RuntimeServiceClient<Channel>, PathBuf, String)> {
    let endpoint = std::env::var("VCUDA_CDI_CONTAINERD_ENDPOINT").unwrap_or_default();
    let spec_dir = std::env::var("VCUDA_CDI_SPEC_DIR").unwrap_or_default();
    if endpoint.is_empty() || spec_dir.is_empty() {
        missing(
            Capability::Containerd,
            "VCUDA_CDI_CONTAINERD_ENDPOINT or VCUDA_CDI_SPEC_DIR is not set",
        );
        return None;
    }
    let mut cri = match cri_client(&endpoint).await {
        Ok(c) => c,
        Err(e) => {
            missing(
                Capability::Containerd,
                &format!("no CRI at {endpoint:?}: {e}"),
            );
            return None;
        }
    };
    if let Err(s) = cri
        .version(VersionRequest {
            version: "v1".into(),
        })
        .await
    {
        missing(
            Capability::Containerd,
            &format!("CRI Version at {endpoint:?}: {s}"),
        );
        return None;
    }
    if std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        != 0
    {
        missing(
            Capability::Containerd,
            "not root: the spec's device nodes must exist on the host (mknod)",
        );
        return None;
    }
    let image = std::env::var("VCUDA_CRI_IMAGE").unwrap_or_else(|_| IMAGE_DEFAULT.into());
    Some((cri, PathBuf::from(spec_dir), image))
}

/// Host device nodes this test created (the simulator's 1:3, as
/// `gpu-sim install --host-dev` makes them), removed on drop.
struct HostDevs(Vec<PathBuf>);

const SIM_RDEV: u64 = (1 << 8) | 3;

impl HostDevs {
    fn ensure(&mut self, path: &Path) {
        if std::fs::symlink_metadata(path).is_ok() {
            return;
        }
        let out = Command::new("mknod")
            .args(["-m", "666"])
            .arg(path)
            .args(["c", "1", "3"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mknod {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        self.0.push(path.to_path_buf());
    }
}

impl Drop for HostDevs {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Ok(m) = std::fs::symlink_metadata(p)
                && m.file_type().is_char_device()
                && m.rdev() == SIM_RDEV
            {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// How a container names its CDI devices.
#[derive(Clone, Copy, Debug)]
enum Request {
    /// `ContainerConfig.CDI_devices` (field 17, kubelet >= 1.28).
    Field,
    /// A `cdi.k8s.io/<key>` annotation (what kubelet used before the field).
    Annotation,
}

struct Pod {
    cri: RuntimeServiceClient<Channel>,
    sandbox: String,
    config: PodSandboxConfig,
    logs: PathBuf,
    image: String,
}

impl Pod {
    /// Creates a container asking for `ids`; its error if CreateContainer fails.
    async fn create(
        &mut self,
        name: &str,
        ids: &[String],
        how: Request,
    ) -> Result<String, tonic::Status> {
        let (cdi_devices, annotations) = match how {
            Request::Field => (
                ids.iter().map(|n| CdiDevice { name: n.clone() }).collect(),
                HashMap::new(),
            ),
            Request::Annotation => (
                vec![],
                [("cdi.k8s.io/vcuda".to_string(), ids.join(","))].into(),
            ),
        };
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: self.image.clone(),
                ..Default::default()
            }),
            command: vec!["/bin/sh".into(), "-c".into(), SCRIPT.into()],
            labels: [(TEST_LABEL.to_string(), "1".to_string())].into(),
            annotations,
            log_path: format!("{name}.log"),
            cdi_devices,
            ..Default::default()
        };
        self.cri
            .create_container(CreateContainerRequest {
                pod_sandbox_id: self.sandbox.clone(),
                config: Some(config),
                sandbox_config: Some(self.config.clone()),
            })
            .await
            .map(|r| r.into_inner().container_id)
    }

    /// Creates and runs a container asking for `ids`; what it reported.
    async fn run(&mut self, name: &str, ids: &[String], how: Request) -> HashMap<String, String> {
        let id = self
            .create(name, ids, how)
            .await
            .unwrap_or_else(|s| panic!("CreateContainer {name} ({how:?} {ids:?}): {s}"));
        self.cri
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap_or_else(|s| panic!("StartContainer {name}: {s}"));
        let t0 = Instant::now();
        let status = loop {
            let s = self
                .cri
                .container_status(ContainerStatusRequest {
                    container_id: id.clone(),
                    verbose: false,
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            if s.state == ContainerState::ContainerExited as i32 {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "container {name} still {:?} after 30 s",
                s.state
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let log = std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap();
        assert_eq!(
            status.exit_code, 0,
            "container {name} failed; its log:\n{log}"
        );
        // CRI log lines: "<time> stdout F <text>".
        let lines: Vec<&str> = log
            .lines()
            .filter_map(|l| l.splitn(4, ' ').nth(3))
            .collect();
        eprintln!("cdi_containerd: {name} ({how:?}) saw:");
        for l in &lines {
            eprintln!("    {l}");
        }
        let seen: HashMap<String, String> = lines
            .iter()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            seen.get("done").map(String::as_str),
            Some("1"),
            "{name}: {log}"
        );
        seen
    }
}

/// A claim UID no earlier run used: the spec directory is the runtime's,
/// and the API server emulator's own UIDs repeat from run to run.
fn unique_uid() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{:08x}-0000-4000-8000-{:012x}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff
    )
}

fn env_value(edits: &Value, key: &str) -> String {
    edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find_map(|e| e.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("the spec sets no {key}: {edits}"))
        .to_string()
}

fn mount_host(edits: &Value, container_path: &str) -> (PathBuf, bool) {
    let m = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["containerPath"] == container_path)
        .unwrap_or_else(|| panic!("the spec mounts nothing at {container_path}: {edits}"));
    let ro = m["options"]
        .as_array()
        .is_some_and(|o| o.iter().any(|x| x == "ro"));
    (PathBuf::from(m["hostPath"].as_str().unwrap()), ro)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_injects_the_prepared_cdi_device() {
    let Some((mut cri, spec_dir, image)) = runtime().await else {
        return;
    };
    cri_api::remove_labelled_sandboxes(&mut cri, TEST_LABEL, "1")
        .await
        .unwrap();
    // In a task: a failed assertion still stops the pod (its shim and
    // sleeping "pause" would outlive the test).
    let result = tokio::spawn(inject(cri.clone(), spec_dir, image)).await;
    cri_api::remove_labelled_sandboxes(&mut cri, TEST_LABEL, "1")
        .await
        .unwrap();
    if let Err(e) = result {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn inject(cri: RuntimeServiceClient<Channel>, spec_dir: PathBuf, image: String) {
    // The driver on two given GPUs, writing its specs where containerd reads.
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let api = kube(&server, dirs.tmp.path()).await;
    let publisher = Publisher::new(
        NODE,
        "550.54.15",
        dra_driver::slices::Unhealthy::Taint("NoSchedule"),
    );
    publisher.ensure_classes(&api).await.unwrap();
    let devices: Vec<GpuDevice> = gpus()
        .into_iter()
        .map(|info| GpuDevice {
            info,
            model: "Tesla T4".into(),
            xid: None,
            mig: None,
            pcie_root: None,
            nvlink_domain: None,
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        })
        .collect();
    publisher.reconcile(&api, &devices).await.unwrap();
    let mut cfg = dirs.config();
    cfg.cdi_dir = spec_dir.clone();
    // The interposer volume: a stand-in library the container must see.
    let lib64 = cfg.vdriver_dir.join("nvidia/lib64");
    std::fs::create_dir_all(&lib64).unwrap();
    std::fs::write(lib64.join("libcuda.so.1"), b"stand-in").unwrap();
    let driver = Arc::new(Driver::start(cfg, gpus(), Arc::new(api.clone())).unwrap());
    let cancel = CancellationToken::new();
    let _registration = grpc::serve(driver.clone(), &dirs.sockets(), cancel.clone())
        .await
        .unwrap();
    let kubelet = kubelet(&dirs, false).await;

    // A 30 % / 1 GiB share claim, allocated and prepared.
    let uid = unique_uid();
    server
        .create(
            Kind::ResourceClaim,
            Some(NS),
            json!({
                "metadata": {"name": "cdi", "namespace": NS, "uid": uid},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": dra_driver::slices::SHARE_CLASS,
                    "capacity": {"requests": {"cores": "30", "memory": "1Gi"}}}}]}}
            }),
        )
        .unwrap();
    let a = allocator::allocate(&server, NS, "cdi", NODE).unwrap();
    assert_eq!(a["devices"]["results"][0]["device"], "gpu-0");
    let claim = plugin::claim(NS, "cdi", &uid);
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let prepared = &r.claims[&uid];
    assert_eq!(prepared.error, "");
    let ids = prepared.devices[0].cdi_device_ids.clone();
    assert_eq!(ids.len(), 1, "{ids:?}");
    eprintln!("cdi_containerd: prepared {ids:?} in {}", spec_dir.display());

    // What the spec says the container gets (device and spec-wide edits).
    let edits = cdi::resolve(&spec_dir, &ids[0]).unwrap();
    let mut want_devices: Vec<String> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].as_str().unwrap().to_string())
        .collect();
    want_devices.sort();
    assert!(
        want_devices.contains(&"/dev/nvidia0".to_string()),
        "{want_devices:?}"
    );
    // /dev/nvidia* is the machine's: the real-node suite makes and removes
    // the same nodes, so one of them at a time.
    let _machine = test_support::k8s::util::MachineLock::take();
    let mut host_devs = HostDevs(vec![]);
    for d in edits["deviceNodes"].as_array().unwrap() {
        let host = d["hostPath"].as_str().or(d["path"].as_str()).unwrap();
        host_devs.ensure(Path::new(host));
    }
    let ld = env_value(&edits, "LD_LIBRARY_PATH");
    let visible = env_value(&edits, "NVIDIA_VISIBLE_DEVICES");
    assert_eq!(
        (ld.as_str(), visible.as_str()),
        ("/usr/local/nvidia/lib64", "GPU-00000000")
    );
    let (driver_host, driver_ro) = mount_host(&edits, "/usr/local/nvidia");
    let (vm_host, vm_ro) = mount_host(&edits, "/etc/vcuda");
    assert!(driver_ro && vm_ro, "{edits}");
    let config_size = std::fs::metadata(vm_host.join(quota_config::CONFIG_FILE))
        .unwrap()
        .len();
    assert_eq!(config_size, quota_config::CONFIG_SIZE as u64);
    let mut libs: Vec<String> = std::fs::read_dir(driver_host.join("lib64"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    libs.sort();

    // A pod on the host network (no CNI), its logs in the test's directory.
    let logs = dirs.p("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "cdi".into(),
            uid: format!("pod-{uid}"),
            namespace: NS.into(),
            attempt: 0,
        }),
        log_directory: logs.display().to_string(),
        labels: [(TEST_LABEL.to_string(), "1".to_string())].into(),
        linux: Some(cri_api::host_network_linux()),
        ..Default::default()
    };
    let mut cri = cri;
    let sandbox = cri
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|s| panic!("RunPodSandbox: {s}"))
        .into_inner()
        .pod_sandbox_id;
    let mut pod = Pod {
        cri: cri.clone(),
        sandbox,
        config,
        logs,
        image,
    };

    // The device through each of CRI's two ways of naming it.
    for (name, how) in [
        ("field", Request::Field),
        ("annotation", Request::Annotation),
    ] {
        let seen = pod.run(name, &ids, how).await;
        let got = |k: &str| seen.get(k).map(String::as_str).unwrap_or("<not printed>");
        assert_eq!(got("config"), config_size.to_string(), "{name}: /etc/vcuda");
        assert_eq!(got("etc_vcuda"), "ro", "{name}: /etc/vcuda is read-only");
        let mut devs: Vec<&str> = got("devices").split(' ').collect();
        devs.sort();
        assert_eq!(devs, want_devices, "{name}: /dev/nvidia*");
        assert!(
            !seen.contains_key("not_a_char_device"),
            "{name}: {}",
            got("not_a_char_device")
        );
        assert_eq!(got("ld"), ld, "{name}: LD_LIBRARY_PATH");
        assert_eq!(got("visible"), visible, "{name}: NVIDIA_VISIBLE_DEVICES");
        assert_eq!(got("driver"), libs.join(" "), "{name}: /usr/local/nvidia");
    }

    // Injection is live: a device no spec names fails CreateContainer.
    let bogus = format!("vcuda.tencent.com/gpu={uid}-no-such-request");
    for (name, how) in [
        ("bogus-field", Request::Field),
        ("bogus-annotation", Request::Annotation),
    ] {
        let err = pod
            .create(name, std::slice::from_ref(&bogus), how)
            .await
            .expect_err("a container asking for an unknown CDI device was created");
        eprintln!("cdi_containerd: {name}: {}", err.message());
        assert!(
            err.message().contains(&bogus),
            "{name}: the error names no {bogus}: {}",
            err.message()
        );
    }

    // Unprepare: the spec goes, and with it the device.
    let u = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(u.claims[&uid].error, "");
    let left: Vec<PathBuf> = std::fs::read_dir(&spec_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.display().to_string().contains(&uid))
        .collect();
    assert!(left.is_empty(), "spec files left after unprepare: {left:?}");
    assert!(cdi::resolve(&spec_dir, &ids[0]).is_err());
    let err = pod
        .create("after-unprepare", &ids, Request::Field)
        .await
        .expect_err("a container asking for an unprepared device was created");
    assert!(err.message().contains(&ids[0]), "{}", err.message());

    cancel.cancel();
    drop(host_devs);
}
