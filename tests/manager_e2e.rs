//! The manager end to end: the real `gpu-manager` binary on a simulated
//! node (`gpu-sim install`), driven by the kubelet emulator (Allocate,
//! PreStartContainer, pod-resources) and the API server emulator (pods,
//! annotations). Needs `cargo build --workspace` first.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpu_allocator::{Allocator, Request};
use kubelet_emulator::EmulatorError;
use prost::Message;
use test_support::manager::{Env, Options, VCORE, VMEM};
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse, register_response::Status};

/// The allocator the manager should agree with: same topology (through the
/// sim's NVML), same sequence.
fn predictor(env: &Env) -> Allocator {
    let lib = env
        .sim_root()
        .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let nvml = node_agent::nvml::load(&lib).unwrap();
    let found = node_agent::nvml::discover(&nvml).unwrap();
    Allocator::new(found.topology)
}

fn code(e: &EmulatorError) -> tonic::Code {
    match e {
        EmulatorError::Rpc { code, .. } => *code,
        // kubelet refuses before Allocate when too few IDs are free.
        EmulatorError::Insufficient { .. } => tonic::Code::ResourceExhausted,
        other => panic!("not an RPC error: {other}"),
    }
}

/// Runs a mixed sequence and checks every placement against the allocator's.
async fn sequence(node: &str, steps: &[(usize, usize)]) -> Env {
    let mut env = Env::start(node, Options::default()).await;
    let mut want = predictor(&env);
    let minor_of: Vec<u32> = want.topology().gpus().iter().map(|g| g.minor).collect();
    let mut live = Vec::new();
    for (i, &(cores, mem)) in steps.iter().enumerate() {
        let pod = env.pod(&[("main", cores as u64, mem as u64)], &[]);
        let req = Request::share(cores as u32, mem as u64);
        let expected = want.allocate(format!("{}/main", pod.uid), &req);
        let got = env.admit(&pod, "main", cores, mem).await;
        match (expected, got) {
            (Ok(p), Ok(resp)) => {
                let mut minors = Env::minors(&resp);
                minors.sort();
                let mut exp: Vec<u32> = p.gpus().iter().map(|&g| minor_of[g]).collect();
                exp.sort();
                assert_eq!(
                    minors, exp,
                    "{node} step {i} ({cores} cores, {mem} units): {p}"
                );
                live.push(pod);
            }
            (Err(e), Err(g)) => {
                assert_eq!(
                    code(&g),
                    tonic::Code::ResourceExhausted,
                    "{node} step {i}: {g} (allocator: {e})"
                );
            }
            (e, g) => panic!(
                "{node} step {i}: allocator says {e:?}, manager says {:?}",
                g.map(|_| ())
            ),
        }
        // Every third pod goes away again, so later steps reuse its room.
        if i % 3 == 2
            && let Some(p) = live.first().cloned()
        {
            live.remove(0);
            env.delete(&p).await;
            want.release(&format!("{}/main", p.uid)).unwrap();
        }
    }
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_4gpu_pcie() {
    let env = sequence(
        "sim-4gpu-pcie",
        &[
            (30, 8),
            (40, 8),
            (200, 0),
            (100, 0),
            (30, 4),
            (10, 1),
            (50, 20),
            (100, 0),
            (20, 2),
            (60, 4),
            (200, 0),
            (90, 1),
        ],
    )
    .await;
    // A clean pair for two whole GPUs: the PCIe switch pairs are {0,1} and {2,3}.
    let mut env = env;
    let mut pairs = Vec::new();
    for _ in 0..2 {
        let p = env.pod(&[("main", 200, 0)], &[]);
        if let Ok(r) = env.admit(&p, "main", 200, 0).await {
            let mut m = Env::minors(&r);
            m.sort();
            pairs.push(m);
        }
    }
    for m in pairs {
        assert!(
            m == [0, 1] || m == [2, 3],
            "200 cores should take one PCIe switch, got {m:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_8gpu_nvlink() {
    let mut env = sequence(
        "sim-8gpu-nvlink",
        &[
            (400, 0),
            (25, 4),
            (25, 4),
            (100, 0),
            (200, 0),
            (50, 10),
            (300, 0),
            (75, 2),
            (100, 0),
        ],
    )
    .await;
    // On a fresh node four whole GPUs stay within one NUMA node.
    drop(env);
    env = Env::start("sim-8gpu-nvlink", Options::default()).await;
    let p = env.pod(&[("main", 400, 0)], &[]);
    let m = Env::minors(&env.admit(&p, "main", 400, 0).await.unwrap());
    assert!(
        m.iter().all(|&x| x < 4) || m.iter().all(|&x| x >= 4),
        "{m:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_16gpu() {
    sequence(
        "sim-16gpu",
        &[
            (800, 0),
            (30, 4),
            (100, 0),
            (400, 0),
            (60, 8),
            (200, 0),
            (1600, 0),
            (10, 1),
            (300, 0),
            (40, 4),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_response_files_and_annotations() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    env.api.inject_conflicts(2);
    let pod = env.pod(
        &[("side", 0, 0), ("main", 30, 8)],
        &[("tencent.com/vcuda-core-limit", "60")],
    );
    let resp = env.admit(&pod, "main", 30, 8).await.unwrap();
    let r = &resp[VCORE];
    let minor = Env::minors(&resp)[0];
    let paths: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        [
            format!("/dev/nvidia{minor}").as_str(),
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    assert_eq!(r.envs["LD_LIBRARY_PATH"], "/usr/local/nvidia/lib64");
    assert!(r.envs["NVIDIA_VISIBLE_DEVICES"].starts_with("GPU-"));
    assert_eq!(r.annotations[VCORE], "30");
    assert_eq!(r.annotations[VMEM], (8u64 << 28).to_string());
    let vm = env.vm_dir().join(&pod.uid).join("main");
    let m: HashMap<&str, (&str, bool)> = r
        .mounts
        .iter()
        .map(|m| {
            (
                m.container_path.as_str(),
                (m.host_path.as_str(), m.read_only),
            )
        })
        .collect();
    assert_eq!(m["/etc/vcuda"], (vm.to_str().unwrap(), true));
    assert!(m["/usr/local/nvidia"].0.ends_with("/vdriver/nvidia") && m["/usr/local/nvidia"].1);

    let cfg = quota_config::read_config(&vm.join("vcuda.config")).unwrap();
    assert_eq!(
        (cfg.pod_uid.as_str(), cfg.container_name.as_str()),
        (pod.uid.as_str(), "main")
    );
    assert_eq!(
        (cfg.utilization, cfg.limit, cfg.hard_limit, cfg.enable),
        (30, 60, false, true)
    );
    assert_eq!(cfg.gpu_memory, 8 << 28);
    assert_eq!(cfg.driver_version, (550, 54));

    // Annotations arrive despite two conflicts.
    let t = Instant::now();
    loop {
        let p = env.api.pod("default", &pod.name).unwrap();
        let a = &p["metadata"]["annotations"];
        if a["tencent.com/gpu-assigned"] == "true" {
            assert_eq!(a["tencent.com/predicate-gpu-idx-1"], minor.to_string());
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "pod never annotated: {p}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(env.api.patch_requests() >= 3);

    // Whole GPU: origin volume, quota disabled.
    let whole = env.pod(&[("w", 100, 0)], &[]);
    let resp = env.admit(&whole, "w", 100, 0).await.unwrap();
    assert!(resp[VCORE].mounts[0].host_path.ends_with("/vdriver/origin"));
    let cfg =
        quota_config::read_config(&env.vm_dir().join(&whole.uid).join("w/vcuda.config")).unwrap();
    assert!(!cfg.enable);
    assert_eq!(env.allocation_count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_change_nothing() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let ok = env.pod(&[("main", 50, 4)], &[]);
    env.admit(&ok, "main", 50, 4).await.unwrap();

    /// A request that must be refused, and how.
    struct Bad<'a> {
        what: &'a str,
        containers: Vec<(&'a str, u64, u64)>,
        annotations: Vec<(&'a str, &'a str)>,
        cores: usize,
        memory: usize,
        code: tonic::Code,
        message: &'a str,
    }
    let cases = vec![
        Bad {
            what: "vcuda-core 150",
            containers: vec![("main", 150, 0)],
            annotations: vec![],
            cores: 150,
            memory: 0,
            code: tonic::Code::InvalidArgument,
            message: "vcuda-core 150",
        },
        Bad {
            what: "share without memory",
            containers: vec![("main", 30, 0)],
            annotations: vec![],
            cores: 30,
            memory: 0,
            code: tonic::Code::InvalidArgument,
            message: "vcuda-memory is 0",
        },
        Bad {
            what: "memory over any GPU",
            // Not 30 cores: the previous case's deleted pod can still be in
            // the manager's view for a moment, and Allocate matches by cores.
            containers: vec![("main", 31, 61)],
            annotations: vec![],
            cores: 31,
            memory: 61,
            code: tonic::Code::InvalidArgument,
            message: "largest GPU",
        },
        Bad {
            what: "predicate on a missing GPU",
            containers: vec![("main", 20, 2)],
            annotations: vec![("tencent.com/predicate-gpu-idx-0", "9")],
            cores: 20,
            memory: 2,
            code: tonic::Code::FailedPrecondition,
            message: "/dev/nvidia9",
        },
        Bad {
            what: "predicate count mismatch",
            containers: vec![("main", 200, 0)],
            annotations: vec![("tencent.com/predicate-gpu-idx-0", "1")],
            cores: 200,
            memory: 0,
            code: tonic::Code::FailedPrecondition,
            message: "predicate mismatch",
        },
    ];
    for Bad {
        what,
        containers,
        annotations,
        cores,
        memory,
        code: want,
        message,
    } in cases
    {
        let pod = env.pod(&containers, &annotations);
        let err = env.admit(&pod, "main", cores, memory).await.unwrap_err();
        assert_eq!(code(&err), want, "{what}: {err}");
        assert!(err.to_string().contains(message), "{what}: {err}");
        assert!(
            !env.vm_dir().join(&pod.uid).exists(),
            "{what}: vm dir written"
        );
        env.api.delete_pod("default", &pod.name).unwrap();
    }
    // No pod asks for this.
    let ghost = kubelet_emulator::PodRef {
        uid: "ghost".into(),
        name: "ghost".into(),
        namespace: "default".into(),
    };
    let err = env.admit(&ghost, "main", 42, 1).await.unwrap_err();
    assert_eq!(code(&err), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.to_string().contains("vcuda-core 42"), "{err}");

    // Share mode off.
    drop(env);
    let mut env = Env::start(
        "sim-4gpu-pcie",
        Options {
            share_mode: false,
            ..Default::default()
        },
    )
    .await;
    let pod = env.pod(&[("main", 30, 4)], &[]);
    let err = env.admit(&pod, "main", 30, 4).await.unwrap_err();
    assert_eq!(code(&err), tonic::Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("share mode is off"), "{err}");
    assert_eq!(env.allocation_count(), 0);
    assert!(env.kubelet.allocations().is_empty());
    let whole = env.pod(&[("main", 100, 0)], &[]);
    env.admit(&whole, "main", 100, 0).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_leave_state_untouched() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let ok = env.pod(&[("main", 50, 4)], &[]);
    env.admit(&ok, "main", 50, 4).await.unwrap();
    // Its vcuda-memory IDs and verified flag are written after the admission
    // (the lazy flush): the state to compare against is the one with them.
    let cp = env.settled_checkpoint().await;
    let kubelet = env.kubelet.allocations().len();
    for (cores, mem) in [(150, 0), (30, 0), (30, 61)] {
        let pod = env.pod(&[("main", cores as u64, mem as u64)], &[]);
        assert!(env.admit(&pod, "main", cores, mem).await.is_err());
        env.api.delete_pod("default", &pod.name).unwrap();
    }
    assert_eq!(env.kubelet.allocations().len(), kubelet);
    // The same GPU accepts a fitting share afterwards: nothing leaked. Its
    // Allocate answers once a write covering every earlier change is
    // durable, so the checkpoint now shows whatever the refusals did.
    let more = env.pod(&[("main", 50, 4)], &[]);
    env.admit(&more, "main", 50, 4).await.unwrap();
    let after = env.checkpoint();
    let allocs = after["allocations"].as_array().unwrap();
    let uids: Vec<&str> = allocs
        .iter()
        .map(|a| a["pod_uid"].as_str().unwrap())
        .collect();
    assert_eq!(uids.len(), 2, "allocations after the refusals: {uids:?}");
    assert!(uids.contains(&more.uid.as_str()), "{uids:?}");
    let kept = allocs.iter().find(|a| a["pod_uid"] == ok.uid.as_str());
    assert_eq!(
        kept,
        Some(&cp["allocations"][0]),
        "the accepted allocation changed by refused requests"
    );
    assert_eq!(after["gpus"], cp["gpus"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicate_is_honoured() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let pod = env.pod(
        &[("main", 30, 4)],
        &[("tencent.com/predicate-gpu-idx-0", "3")],
    );
    let r = env.admit(&pod, "main", 30, 4).await.unwrap();
    assert_eq!(Env::minors(&r), [3]);
    // GPU 3 has 70 cores left: a 80-core share predicated there is refused with both sides named.
    let pod = env.pod(
        &[("main", 80, 4)],
        &[("tencent.com/predicate-gpu-idx-0", "3")],
    );
    let err = env.admit(&pod, "main", 80, 4).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("gpu-admission chose /dev/nvidia3")
            && msg.contains("the manager would choose"),
        "{msg}"
    );
    // kubectl describe pod shows why.
    let ev = event_on(&env, &pod.name, "VcudaAllocateFailed").await;
    assert_eq!(ev["type"], "Warning");
    assert!(
        ev["note"]
            .as_str()
            .unwrap()
            .contains("gpu-admission chose /dev/nvidia3"),
        "{ev}"
    );
    assert_eq!(ev["regarding"]["uid"], pod.uid.as_str());
}

/// The Warning Event with `reason` on pod `name`, waiting for the manager's
/// background poster.
async fn event_on(env: &Env, name: &str, reason: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let found = env.api.events().into_iter().find(|e| {
            e["regarding"]["name"] == name
                && e["reason"] == reason
                && e["regarding"]["kind"] == "Pod"
        });
        if let Some(e) = found {
            return e;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {reason} event on pod {name}; events: {:?}",
            env.api.events()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_guess_fails_the_container() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    // a is first by predicate time, but kubelet admits b. While kubelet
    // lists only the pod it admits (List of active pods, 1.34+), the
    // manager takes b, not a.
    let a = env.pod(&[("main", 30, 4)], &[("tencent.com/predicate-time", "100")]);
    let b = env.pod(&[("main", 30, 4)], &[("tencent.com/predicate-time", "200")]);
    env.admit(&b, "main", 30, 4).await.unwrap();
    assert!(env.vm_dir().join(&b.uid).exists());
    assert!(!env.vm_dir().join(&a.uid).exists());
    env.delete(&b).await;
    env.api.delete_pod("default", &a.name).unwrap();

    // A kubelet that lists every pod it holds (1.20) shows both while it
    // admits b: the manager guesses a, and PreStart finds out.
    let a = env.pod(&[("main", 30, 4)], &[("tencent.com/predicate-time", "100")]);
    let b = env.pod(&[("main", 30, 4)], &[("tencent.com/predicate-time", "200")]);
    env.kubelet.hold_pods(&[&a, &b]);
    let err = env.admit(&b, "main", 30, 4).await.unwrap_err();
    let msg = err.to_string();
    assert_eq!(code(&err), tonic::Code::FailedPrecondition, "{msg}");
    assert!(
        msg.contains(&format!(
            "kubelet gave these devices to pod default/{}",
            b.name
        )),
        "{msg}"
    );
    assert!(msg.contains(&a.name), "{msg}");
    assert_eq!(
        env.allocation_count(),
        0,
        "the wrong allocation must be withdrawn"
    );
    assert!(!env.vm_dir().join(&a.uid).exists());
    for p in [&a, &b] {
        let ev = event_on(&env, &p.name, "VcudaWrongPodGuess").await;
        assert!(ev["note"].as_str().unwrap().contains("withdrawn"), "{ev}");
    }
    // In the right order both are fine.
    env.admit(&a, "main", 30, 4).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interposer_registers_over_vcuda_sock() {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let pod = env.pod(&[("main", 30, 8)], &[]);
    env.admit(&pod, "main", 30, 8).await.unwrap();
    let vm = env.vm_dir().join(&pod.uid).join("main");
    // What the interposer does: read the quota, connect, register.
    let cfg = quota_config::read_config(&vm.join("vcuda.config")).unwrap();
    assert_eq!(cfg.gpu_memory, 8 << 28);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(vm.join("vcuda.sock"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o666
    );

    let register = |uid: &str| {
        let mut s = UnixStream::connect(vm.join("vcuda.sock")).unwrap();
        let req = RegisterRequest {
            protocol_version: 1,
            pod_uid: uid.to_string(),
            container_name: "main".into(),
            bus_id: cfg.bus_id.clone(),
            local_pid: 1,
            program: "test".into(),
            previous_slot: None,
            previous_slots: Vec::new(),
            qos_pages: false,
            qos_flags: false,
        };
        vcuda_api::vcuda::frame::write(&mut s, &req).unwrap();
        let (body, fd) = container_ledger::fdpass::recv_frame(s.as_fd(), 65536).unwrap();
        (s, RegisterResponse::decode(body.as_slice()).unwrap(), fd)
    };
    let (bad, resp, fd) = register("someone-else");
    assert_eq!(resp.status, Status::Rejected as i32);
    assert!(fd.is_none());
    drop(bad);

    let me = std::process::id() as i32;
    let (conn, resp, fd) = register(&pod.uid);
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    assert_eq!(resp.host_pid, me);
    let ledger = container_ledger::Ledger::from_fd(fd.as_ref().unwrap().as_fd()).unwrap();
    assert_eq!(ledger.quota(), 8 << 28);
    let slot = resp.ledger_slot.unwrap() as usize;
    assert_eq!(ledger.slot(slot).unwrap().pid, me);
    ledger.try_reserve(slot, 1 << 20).unwrap();

    let pids =
        || quota_config::decode_pids(&std::fs::read(vm.join("pids.config")).unwrap()).unwrap();
    assert_eq!(pids(), vec![me]);
    drop(conn);
    let t = Instant::now();
    while !pids().is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pids().is_empty(), "PID not removed after disconnect");
    assert!(ledger.slot(slot).is_none(), "slot not cleared");
    assert_eq!(ledger.used(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_takes_a_gpu_out_until_the_quiet_period_ends() {
    let env = Env::start(
        "sim-4gpu-pcie",
        Options {
            quiet_s: 2,
            ..Default::default()
        },
    )
    .await;
    let gpu_healthy = |v: &kubelet_emulator::View, healthy: bool| {
        [VCORE, VMEM].iter().all(|r| {
            v.resources[*r]
                .devices
                .iter()
                .filter(|(id, _)| {
                    id.starts_with(&format!(
                        "{}-1-",
                        if *r == VCORE { "vcore" } else { "vmemory" }
                    ))
                })
                .all(|(_, d)| d.healthy == healthy)
        })
    };
    let xid = |code: &str| {
        let st = std::process::Command::new(test_support::target_dir().join("gpu-sim"))
            .args(["xid", "--root"])
            .arg(env.sim_root())
            .args(["--gpu", "1", "--code", code])
            .status()
            .unwrap();
        assert!(st.success());
    };
    // An application Xid (13) changes nothing.
    xid("13");
    let t = Instant::now();
    while !env.log_text().contains("Xid ignored (application error)") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "Xid 13 never reached the manager:\n{}",
            env.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gpu_healthy(&env.kubelet.view().borrow(), true));
    let t = Instant::now();
    xid("79");
    env.kubelet
        .wait_for(Duration::from_secs(5), |v| gpu_healthy(v, false))
        .await
        .unwrap_or_else(|_| panic!("GPU 1 never went unhealthy; log:\n{}", env.log_text()));
    let down = t.elapsed();
    // Other GPUs stay healthy.
    let v = env.kubelet.view().borrow().clone();
    assert!(
        v.resources[VCORE]
            .devices
            .iter()
            .filter(|(id, _)| id.starts_with("vcore-0-"))
            .all(|(_, d)| d.healthy)
    );
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| gpu_healthy(v, true))
        .await
        .unwrap();
    let up = t.elapsed();
    assert!(
        up >= Duration::from_secs(2),
        "recovered before the quiet period: {up:?}"
    );
    eprintln!("Xid 79 -> unhealthy in {down:?}, healthy again after {up:?}");
}
