//! Issue #13: recovery against a real containerd through CRI v1. This test
//! stands in for kubelet: it creates pod sandboxes (host network, no CNI)
//! and containers through containerd's CRI with the AllocateResponse
//! applied (devices, the `/etc/vcuda` bind mount, env) and the labels
//! kubelet sets, then kills the real `gpu-manager` with SIGKILL and starts
//! it again with `--container-runtime containerd`.
//!
//! Needs the private containerd of `tests/containerd/start.sh`
//! (`VCUDA_CONTAINERD_ENDPOINT`); tests/run.sh starts it and sets
//! `VCUDA_REQUIRE_CONTAINERD=1`, so there a missing one fails the test.
//! The `auto` test also needs the Docker engine of `tests/docker/engine.sh`.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cri_api::v1::runtime_service_client::RuntimeServiceClient;
use cri_api::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, Device, ImageSpec, KeyValue, Mount,
    PodSandboxConfig, PodSandboxMetadata, RemoveContainerRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
    VersionRequest,
};
use gpu_manager::world::ContainerRuntime;
use kubelet_emulator::PodRef;
use test_support::manager::{self, Env, Options};
use test_support::{Capability, cmdline};
use tonic::transport::Channel;
use vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse;

/// The test's containerd, if one answers CRI.
struct Containerd {
    endpoint: String,
    image: String,
}

impl Containerd {
    async fn get() -> Option<Containerd> {
        let endpoint = std::env::var("VCUDA_CONTAINERD_ENDPOINT").unwrap_or_default();
        let image = std::env::var("VCUDA_CRI_IMAGE")
            .unwrap_or_else(|_| "docker.io/vcuda-test/busybox:cri".into());
        let c = Containerd { endpoint, image };
        let answer = if c.endpoint.is_empty() {
            Err("VCUDA_CONTAINERD_ENDPOINT is not set".to_string())
        } else {
            match c.client().await {
                Ok(mut cl) => cl
                    .version(VersionRequest {
                        version: "v1".into(),
                    })
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("CRI Version: {s}")),
                Err(e) => Err(e),
            }
        };
        match answer {
            Ok(()) => Some(c),
            Err(e) => {
                let why = format!(
                    "no containerd answers CRI at VCUDA_CONTAINERD_ENDPOINT={:?} ({e})",
                    c.endpoint
                );
                test_support::missing(Capability::Containerd, &why);
                None
            }
        }
    }

    async fn client(&self) -> Result<RuntimeServiceClient<Channel>, String> {
        let path = self.endpoint.trim_start_matches("unix://");
        device_plugin::connect_unix(path, Duration::from_secs(5))
            .await
            .map(RuntimeServiceClient::new)
            .map_err(|e| e.to_string())
    }

    /// Removes what an earlier run left (a killed test cannot clean up;
    /// the API server emulator's UIDs repeat, and so would sandbox names).
    async fn remove_leftovers(&self) {
        let mut cri = self.client().await.unwrap();
        cri_api::remove_labelled_sandboxes(&mut cri, TEST_LABEL, "1")
            .await
            .unwrap();
    }

    fn manager_args(&self, endpoint: &str) -> Vec<std::ffi::OsString> {
        vec![
            "--container-runtime".into(),
            "containerd".into(),
            "--container-runtime-endpoint".into(),
            endpoint.into(),
        ]
    }
}

/// A pod as kubelet would run it: its sandbox and one container.
struct CriPod {
    sandbox: String,
    container: String,
}

/// What the test created, removed again when it ends.
struct Pods {
    cri: RuntimeServiceClient<Channel>,
    image: String,
    made: Vec<CriPod>,
}

/// Marks this test's sandboxes (for [`Containerd::remove_leftovers`]).
const TEST_LABEL: &str = "vcuda-test/manager-cri";

fn kubelet_labels(pod: &PodRef, container: Option<&str>) -> HashMap<String, String> {
    let mut l: HashMap<String, String> = [
        (TEST_LABEL, "1"),
        ("io.kubernetes.pod.uid", pod.uid.as_str()),
        ("io.kubernetes.pod.name", pod.name.as_str()),
        ("io.kubernetes.pod.namespace", pod.namespace.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    if let Some(c) = container {
        l.insert("io.kubernetes.container.name".into(), c.into());
    }
    l
}

impl Pods {
    /// RunPodSandbox, CreateContainer (the AllocateResponse applied; device
    /// host paths inside the simulated node's root), StartContainer.
    async fn run(
        &mut self,
        env: &Env,
        pod: &PodRef,
        container: &str,
        resp: &ContainerAllocateResponse,
    ) -> usize {
        let sandbox_config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: pod.name.clone(),
                uid: pod.uid.clone(),
                namespace: pod.namespace.clone(),
                attempt: 0,
            }),
            labels: kubelet_labels(pod, None),
            // The host network: no CNI on the test machine.
            linux: Some(cri_api::host_network_linux()),
            ..Default::default()
        };
        let sandbox = self
            .cri
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(sandbox_config.clone()),
                runtime_handler: String::new(),
            })
            .await
            .unwrap_or_else(|s| panic!("RunPodSandbox {}: {s}", pod.name))
            .into_inner()
            .pod_sandbox_id;
        let root = env.sim_root().display().to_string();
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: container.into(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: self.image.clone(),
                ..Default::default()
            }),
            command: vec!["/bin/sleep".into(), "3600".into()],
            envs: resp
                .envs
                .iter()
                .map(|(k, v)| KeyValue {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            mounts: resp
                .mounts
                .iter()
                .map(|m| Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    readonly: m.read_only,
                    ..Default::default()
                })
                .collect(),
            devices: resp
                .devices
                .iter()
                .map(|d| Device {
                    container_path: d.container_path.clone(),
                    host_path: format!("{root}{}", d.host_path),
                    permissions: d.permissions.clone(),
                })
                .collect(),
            labels: kubelet_labels(pod, Some(container)),
            ..Default::default()
        };
        let id = self
            .cri
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(config),
                sandbox_config: Some(sandbox_config),
            })
            .await
            .unwrap_or_else(|s| panic!("CreateContainer {}: {s}", pod.name))
            .into_inner()
            .container_id;
        self.made.push(CriPod {
            sandbox,
            container: id.clone(),
        });
        self.cri
            .start_container(StartContainerRequest { container_id: id })
            .await
            .unwrap_or_else(|s| panic!("StartContainer {}: {s}", pod.name));
        self.made.len() - 1
    }

    /// The container exits (SIGKILL at once), as a crashed workload.
    async fn stop(&mut self, i: usize) {
        let id = self.made[i].container.clone();
        self.cri
            .stop_container(StopContainerRequest {
                container_id: id,
                timeout: 0,
            })
            .await
            .unwrap();
    }

    /// Container and sandbox removed, as kubelet does for a deleted pod.
    async fn remove(&mut self, i: usize) {
        let p = &self.made[i];
        let (c, s) = (p.container.clone(), p.sandbox.clone());
        let _ = self
            .cri
            .stop_container(StopContainerRequest {
                container_id: c.clone(),
                timeout: 0,
            })
            .await;
        let _ = self
            .cri
            .remove_container(RemoveContainerRequest { container_id: c })
            .await;
        let _ = self
            .cri
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: s.clone(),
            })
            .await;
        let _ = self
            .cri
            .remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: s })
            .await;
    }
}

/// SIGKILL, then the same command line with `extra` (flag, value pairs),
/// appending to the log; waits for the recovery summary (`restarts`: how
/// many restarts came before).
async fn kill9_and_restart(env: &mut Env, base: &[String], extra: &[&str], restarts: usize) {
    // SAFETY: SIGKILL to our own child, not yet reaped (its PID is still ours).
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    respawn(env, base, extra, restarts).await;
}

async fn respawn(env: &mut Env, base: &[String], extra: &[&str], restarts: usize) {
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(&env.log)
        .unwrap();
    // clap refuses a flag given twice: `extra` replaces the value of a flag
    // already on the command line.
    let regs = env.registrations();
    let mut args = base.to_vec();
    for pair in extra.chunks(2) {
        match args.iter().position(|a| a == pair[0]) {
            Some(i) => args[i + 1] = pair[1].to_string(),
            None => args.extend(pair.iter().map(|s| s.to_string())),
        }
    }
    env.manager = Command::new(&args[0])
        .args(&args[1..])
        .env("RUST_LOG", "info,gpu_manager=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    env.wait_registered_since(regs).await;
    // Registered comes after recovery; its summary is logged once a start.
    env.wait_log("recovery finished", restarts + 2).await;
}

fn id(p: &PodRef) -> String {
    format!("{}/main", p.uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_recovery_keeps_live_containers_frees_dead_ones_and_degrades_when_unreachable() {
    let Some(ctrd) = Containerd::get().await else {
        return;
    };
    ctrd.remove_leftovers().await;
    let opts = Options {
        extra_args: ctrd.manager_args(&ctrd.endpoint),
        ..Options::default()
    };
    let mut env = Env::start("sim-1gpu", opts).await;
    let mut pods = Pods {
        cri: ctrd.client().await.unwrap(),
        image: ctrd.image.clone(),
        made: vec![],
    };
    let log = env.log_text();
    assert!(
        log.contains(&format!("containerd (CRI) at {}", ctrd.endpoint)),
        "the log names the runtime:\n{log}"
    );

    // A, B: live. C: its pod is deleted while the manager is down. D: its
    // container exits and kubelet lets its devices go, the pod stays.
    let mut refs = Vec::new();
    let mut resps = Vec::new();
    // (Distinct core counts: the manager finds a pod by its request.)
    for cores in [30, 20, 25, 15] {
        let p = env.pod(&[("main", cores, 4)], &[]);
        let r = env.admit(&p, "main", cores as usize, 4).await.unwrap();
        let i = pods.run(&env, &p, "main", &r[manager::VCORE]).await;
        refs.push((p, i));
        resps.push(r);
    }
    let [(a, _), (b, ib), (c, ic), (d, id_)] = <[_; 4]>::try_from(refs).ok().unwrap();
    let before = env.allocations_by_container();
    assert_eq!(before.len(), 4);

    // The backend itself, on A: kubelet's labels, alive, the /etc/vcuda
    // source, and the GPUs from the verbose status.
    let rt = gpu_manager::world::runtime::Cri::new("containerd", &ctrd.endpoint);
    let listed = rt.containers().await.unwrap().unwrap();
    let la = listed
        .iter()
        .find(|l| l.pod_uid == a.uid)
        .unwrap_or_else(|| panic!("A not listed: {listed:?}"));
    assert_eq!(
        (
            la.pod_name.as_str(),
            la.namespace.as_str(),
            la.container.as_str()
        ),
        (a.name.as_str(), "default", "main")
    );
    assert!(la.alive);
    assert_eq!(
        la.vm_source.as_deref(),
        Some(env.vm_dir().join(&a.uid).join("main").as_path())
    );
    let ra = &resps[0][manager::VCORE];
    let gpus = rt.gpus(&la.id).await.unwrap();
    assert_eq!(
        gpus.visible.join(","),
        ra.envs["NVIDIA_VISIBLE_DEVICES"],
        "{gpus:?}"
    );
    let want: Vec<String> = ra
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .filter(|p| p.trim_start_matches("/dev/nvidia").parse::<u32>().is_ok())
        .collect();
    assert_eq!(gpus.devices, want);

    let base = cmdline(env.manager.id());
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    env.api.delete_pod(&c.namespace, &c.name).unwrap();
    env.kubelet.release_pod(&c.uid).unwrap();
    pods.remove(ic).await;
    pods.stop(id_).await;
    env.kubelet.release_pod(&d.uid).unwrap();
    respawn(&mut env, &base, &[], 0).await;

    let after = env.allocations_by_container();
    let mut expect = before.clone();
    expect.remove(&id(&c));
    expect.remove(&id(&d));
    assert_eq!(after, expect, "A and B kept, C and D released");
    for p in [&c, &d] {
        assert!(
            !env.vm_dir().join(&p.uid).exists(),
            "{}'s vm dir removed",
            p.name
        );
    }
    for p in [&a, &b] {
        assert!(
            env.vm_dir()
                .join(&p.uid)
                .join("main/vcuda.config")
                .is_file()
        );
    }
    let log = env.log_text();
    assert!(
        !log.contains("recovery: source unreachable"),
        "containerd answered:\n{log}"
    );

    // Never double-booked: A and B hold 8 of the GPU's 160 memory units;
    // a pod asking 155 fits only if the restarted manager forgot them.
    let e = env.pod(&[("main", 10, 155)], &[]);
    let t = Instant::now();
    loop {
        match env.direct_allocate(90..100).await {
            Err(s) if s.code() == tonic::Code::ResourceExhausted => break,
            Ok(()) => panic!("A and B forgotten: 155 units allocated next to them"),
            // Not seen by the manager's pod watch yet.
            Err(s) => assert!(t.elapsed() < Duration::from_secs(10), "{s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.api.delete_pod(&e.namespace, &e.name).unwrap();

    // containerd unreachable: B's container exits and kubelet lets its
    // devices go, but with no runtime to confirm, nothing is released.
    // (Stopped after the kill: a running manager's periodic check would
    // rightly release B first.)
    let before = env.allocations_by_container();
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    pods.stop(ib).await;
    env.kubelet.release_pod(&b.uid).unwrap();
    respawn(
        &mut env,
        &base,
        &[
            "--container-runtime-endpoint",
            "unix:///nonexistent/containerd.sock",
        ],
        1,
    )
    .await;
    let log = env.log_text();
    assert!(log.contains("recovery: source unreachable"), "{log}");
    assert!(log.contains("/nonexistent/containerd.sock"), "{log}");
    // Two periodic checks (1 s period) pass with the runtime unreachable.
    let unreachable = "periodic check: source unreachable";
    env.wait_log(unreachable, log.matches(unreachable).count() + 2)
        .await;
    assert_eq!(
        env.allocations_by_container(),
        before,
        "nothing released while unreachable"
    );

    // containerd back: B's exit is confirmed and B released; A kept.
    kill9_and_restart(&mut env, &base, &[], 2).await;
    let now = env.allocations_by_container();
    assert_eq!(now.keys().cloned().collect::<Vec<_>>(), vec![id(&a)]);

    // Checkpoint lost: A rebuilt from containerd's view (labels, the
    // /etc/vcuda mount, NVIDIA_VISIBLE_DEVICES from the verbose status),
    // kubelet's IDs and its vm directory.
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    for slot in gpu_manager::world::checkpoint::SLOT_FILES {
        let _ = std::fs::remove_file(env.checkpoint_dir().join(slot));
    }
    respawn(&mut env, &base, &[], 3).await;
    let log = env.log_text();
    assert!(
        log.contains("recovery: allocation rebuilt from the node"),
        "{log}"
    );
    let rebuilt = env.allocations_by_container();
    for k in [
        "placement",
        "cores",
        "memory_units",
        "vcore_ids",
        "pod_name",
    ] {
        assert_eq!(rebuilt[&id(&a)][k], now[&id(&a)][k], "{k} rebuilt");
    }
    ctrd.remove_leftovers().await;
}

/// `auto` against real runtimes: a CRI endpoint is named by what it says
/// it is; Docker's own containerd (CRI plugin disabled) is passed over for
/// Docker; containerd comes before Docker; no socket at all is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_the_runtime_that_serves_cri_else_docker_else_none() {
    use gpu_manager::world::runtime::{Kind, Sockets, detect, select};
    let Some(ctrd) = Containerd::get().await else {
        return;
    };
    let Some(docker) = test_support::Docker::get() else {
        return;
    };
    let cri = select(Kind::Auto, &ctrd.endpoint).await;
    assert_eq!(
        cri.describe(),
        format!("containerd (CRI) at {}", ctrd.endpoint)
    );
    let docker_sock = docker.host.trim_start_matches("unix://").to_string();
    // tests/docker/engine.sh's engine runs its own containerd under its
    // exec root, with `disabled_plugins = ["cri"]`.
    let docker_containerd = std::path::Path::new(&docker_sock)
        .with_file_name("exec/containerd/containerd.sock")
        .display()
        .to_string();
    if !std::path::Path::new(&docker_containerd).exists() {
        test_support::missing(
            Capability::Docker,
            &format!("no containerd of the Docker engine at {docker_containerd}"),
        );
        return;
    }
    let nowhere = "/nonexistent/vcuda/runtime.sock".to_string();
    let picked = detect(&Sockets {
        containerd: docker_containerd,
        crio: nowhere.clone(),
        docker: docker_sock.clone(),
    })
    .await;
    assert_eq!(picked.describe(), format!("docker at unix://{docker_sock}"));
    let picked = detect(&Sockets {
        containerd: ctrd.endpoint.trim_start_matches("unix://").into(),
        crio: nowhere.clone(),
        docker: docker_sock,
    })
    .await;
    assert_eq!(
        picked.describe(),
        format!("containerd (CRI) at {}", ctrd.endpoint)
    );
    let picked = detect(&Sockets {
        containerd: nowhere.clone(),
        crio: nowhere.clone(),
        docker: nowhere,
    })
    .await;
    assert_eq!(picked.describe(), "none");
}
