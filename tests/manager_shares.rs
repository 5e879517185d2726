//! Shares on several GPUs through the device plugins end to end: the real
//! `gpu-manager` on a simulated node, a pod with
//! `tencent.com/vcuda-gpus` admitted by the kubelet emulator
//! (docs/multi-gpu.md). Needs `cargo build --workspace` first.

use std::time::{Duration, Instant};

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use apiserver_emulator::Kind;
use prost::Message;
use quota_config::{MultiGpuQuota, Quota};
use test_support::manager::{Env, NODE, Options, VCORE, VMEM};
use vcuda_api::vcuda::{RegisterRequest, RegisterResponse, register_response::Status};

const GIB: u64 = 1 << 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_pod_gets_two_gpus_and_a_second_tenant_fits_beside_it() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    // The manager says on its node that it serves such pods.
    let node = env.api.get(Kind::Node, None, NODE).unwrap();
    assert_eq!(
        node["metadata"]["labels"]["tencent.com/vcuda-multi-gpu"], "true",
        "{node}"
    );
    // vcuda-core 100 and vcuda-memory 64 over 2 GPUs: 50 cores and 32
    // units (8 GiB) on each.
    let tp = env.pod(
        &[("main", 100, 64)],
        &[("tencent.com/vcuda-gpus", r#"{"main": 2}"#)],
    );
    let resp = env.admit(&tp, "main", 100, 64).await.unwrap();
    let r = &resp[VCORE];
    let mut minors = Env::minors(&resp);
    minors.sort();
    // One PCIe switch's pair: {0,1} or {2,3}.
    assert!(minors == [0, 1] || minors == [2, 3], "{minors:?}");
    let uuids: Vec<&str> = r.envs["NVIDIA_VISIBLE_DEVICES"].split(',').collect();
    assert_eq!(uuids.len(), 2, "{:?}", r.envs);
    let devices: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        devices,
        [
            format!("/dev/nvidia{}", minors[0]).as_str(),
            &format!("/dev/nvidia{}", minors[1]),
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    assert!(
        r.mounts
            .iter()
            .any(|m| m.host_path.ends_with("/vdriver/nvidia"))
    );
    assert_eq!(r.annotations[VCORE], "100");
    assert_eq!(r.annotations[VMEM], (64u64 << 28).to_string());

    // The files the interposer reads: each GPU's quota, a ledger per GPU.
    let dir = env.vm_dir().join(&tp.uid).join("main");
    let Quota::Multi(q) = quota_config::read_quota(&dir).unwrap() else {
        panic!("{}: not a quota on several GPUs", dir.display());
    };
    assert_eq!(
        (q.pod_uid.as_str(), q.container_name.as_str()),
        (tp.uid.as_str(), "main")
    );
    let per_gpu: Vec<_> = q
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), g.utilization, g.gpu_memory))
        .collect();
    assert_eq!(
        per_gpu,
        [(uuids[0], 50, 8 * GIB), (uuids[1], 50, 8 * GIB)],
        "{q:?}"
    );
    assert!(test_support::ledger::try_live(&dir, 0).is_some());
    assert!(test_support::ledger::try_live(&dir, 1).is_some());
    assert!(dir.join("vcuda.sock").exists());
    register_at_protocol_2(&dir, &tp.uid, &q);
    let by = env.allocations_by_container();
    let a = &by[&format!("{}/main", tp.uid)];
    assert_eq!(a["placement"]["kind"], "shares", "{a}");

    // gpu-admission's annotation names both GPUs.
    let t = Instant::now();
    loop {
        let p = env.api.pod("default", &tp.name).unwrap();
        let ann = &p["metadata"]["annotations"];
        if ann["tencent.com/gpu-assigned"] == "true" {
            let want = format!("{},{}", minors[0], minors[1]);
            assert_eq!(ann["tencent.com/predicate-gpu-idx-0"], want.as_str());
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "never annotated: {p}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // /usage lists one container holding both GPUs, with its totals.
    let (addr, uid) = (env.http_addr, tp.uid.clone());
    let usage = tokio::task::spawn_blocking(move || test_support::http_get(addr, "/usage"))
        .await
        .unwrap();
    assert_eq!(usage.0, 200);
    let v: serde_json::Value = serde_json::from_str(&usage.1).unwrap();
    let u = &v["usage"][&uid];
    assert_eq!(u["spec"]["main"]["gpu"], 100.0, "{v}");
    assert_eq!(u["spec"]["main"]["mem"], 16384.0, "{v}");
    assert_eq!(u["stat"]["main"]["dev"].as_array().unwrap().len(), 2, "{v}");

    // A second tenant's share fits beside it, on one of its GPUs (the
    // fullest that has room): 50 cores and 7 GiB of a 15 GiB T4.
    let other = env.pod(&[("main", 50, 28)], &[]);
    let resp = env.admit(&other, "main", 50, 28).await.unwrap();
    let m = Env::minors(&resp);
    assert!(minors.contains(&m[0]), "{m:?} beside {minors:?}");
    assert_eq!(env.allocation_count(), 2);

    // Deleting the TP pod frees both GPUs' part.
    env.delete(&tp).await;
    let t = Instant::now();
    while env.allocation_count() != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{:?}",
            env.checkpoint()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vcuda_gpus_annotation_that_does_not_split_is_refused() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let pod = env.pod(
        &[("main", 81, 64)],
        &[("tencent.com/vcuda-gpus", r#"{"main": 2}"#)],
    );
    let err = env.admit(&pod, "main", 81, 64).await.unwrap_err();
    let m = err.to_string();
    assert!(
        m.contains("InvalidArgument") || m.contains("invalid"),
        "{m}"
    );
    assert!(m.contains(&format!("pod default/{}", pod.name)), "{m}");
    assert!(m.contains("tencent.com/vcuda-gpus"), "{m}");
    assert!(m.contains("vcuda-core does not split evenly"), "{m}");
    assert!(!env.vm_dir().join(&pod.uid).exists());
    assert_eq!(env.allocation_count(), 0);
}

/// What an interposer does for a share on several GPUs: register over
/// `vcuda.sock` at protocol 2 and get one ledger per GPU, in record order,
/// each with that GPU's quota; at protocol 1 it is refused.
fn register_at_protocol_2(dir: &std::path::Path, uid: &str, q: &MultiGpuQuota) {
    let register = |version: u32| {
        let mut s = UnixStream::connect(dir.join("vcuda.sock")).unwrap();
        let req = RegisterRequest {
            protocol_version: version,
            pod_uid: uid.to_string(),
            container_name: "main".into(),
            bus_id: q.gpus[0].bus_id.clone(),
            local_pid: 1,
            program: "test".into(),
            previous_slot: None,
            previous_slots: Vec::new(),
            qos_pages: false,
            qos_flags: false,
        };
        vcuda_api::vcuda::frame::write(&mut s, &req).unwrap();
        let (body, fds) = container_ledger::fdpass::recv_frame_fds(s.as_fd(), 65536).unwrap();
        (s, RegisterResponse::decode(body.as_slice()).unwrap(), fds)
    };
    let (_old, resp, fds) = register(1);
    assert_eq!(resp.status, Status::Rejected as i32, "{}", resp.message);
    assert!(resp.message.contains("spans 2 GPUs"), "{}", resp.message);
    assert!(fds.is_empty());
    let (_conn, resp, fds) = register(2);
    assert_eq!(resp.status, Status::Accepted as i32, "{}", resp.message);
    let quotas: Vec<u64> = fds
        .iter()
        .map(|fd| {
            container_ledger::Ledger::from_fd(fd.as_fd())
                .unwrap()
                .quota()
        })
        .collect();
    assert_eq!(quotas, [q.gpus[0].gpu_memory, q.gpus[1].gpu_memory]);
    assert_eq!(resp.ledger_slots.len(), 2, "{resp:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_on_two_gpus_survives_a_manager_restart() {
    use std::os::unix::fs::MetadataExt;
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let tp = env.pod(
        &[("main", 100, 64)],
        &[("tencent.com/vcuda-gpus", r#"{"main": 2}"#)],
    );
    env.admit(&tp, "main", 100, 64).await.unwrap();
    let dir = env.vm_dir().join(&tp.uid).join("main");
    let ino = std::fs::metadata(dir.join("vcuda-gpus.config"))
        .unwrap()
        .ino();
    let before = env.allocations_by_container();

    // SIGKILL, then the same command line.
    let args = test_support::cmdline(env.manager.id());
    env.kill9_and_start(&args).await;
    env.wait_log("recovery finished", 2).await;

    // Kept on both GPUs, its files as they were, its socket served again
    // with a ledger per GPU.
    let id = format!("{}/main", tp.uid);
    let after = env.allocations_by_container();
    assert_eq!(after.len(), 1);
    for field in ["placement", "cores", "memory_units", "vcore_ids"] {
        assert_eq!(after[&id][field], before[&id][field], "{field}");
    }
    assert_eq!(
        std::fs::metadata(dir.join("vcuda-gpus.config"))
            .unwrap()
            .ino(),
        ino
    );
    let Quota::Multi(q) = quota_config::read_quota(&dir).unwrap() else {
        panic!("not a quota on several GPUs");
    };
    register_at_protocol_2(&dir, &tp.uid, &q);
    // Both GPUs' parts are still booked: a share of 60 cores fits on
    // neither of them (each has 50 free).
    let held: Vec<u64> = before[&id]["placement"]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_u64().unwrap())
        .collect();
    let other = env.pod(&[("main", 60, 8)], &[]);
    let resp = env.admit(&other, "main", 60, 8).await.unwrap();
    let m = u64::from(Env::minors(&resp)[0]);
    assert!(!held.contains(&m), "GPU {m} of {held:?} booked twice");
}

/// The TP = 2 serving workload (`test_support::shim::tp`) through the
/// device plugins: a server pod (vcuda-core 100, vcuda-memory 32 over 2
/// GPUs: 50 cores and 4 GiB on each) and a second tenant with the same
/// annotation (50 cores and 2 GiB on each), both admitted by the kubelet
/// emulator onto the same PCIe pair, each run with what its Allocate
/// response gives a container (env, mounts, the GPUs it exposes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_server_beside_a_second_tenant_through_the_device_plugins() {
    use test_support::manager::container_env;
    use test_support::shim::tp::{EvenTenant, Programs, ledgers_by_device, serve_beside_even};
    let opts = Options {
        extra_args: vec![
            "--interposer".into(),
            test_support::target_dir().join("libvcuda.so").into(),
        ],
        ..Options::default()
    };
    let mut env = Env::start("sim-4gpu-pcie", opts).await;
    let tp2 = [("tencent.com/vcuda-gpus", r#"{"main": 2}"#)];
    let server = env.pod(&[("main", 100, 32)], &tp2);
    let rs = env.admit(&server, "main", 100, 32).await.unwrap();
    let other = env.pod(&[("main", 100, 16)], &tp2);
    let ro = env.admit(&other, "main", 100, 16).await.unwrap();
    let mut pair = Env::minors(&rs);
    pair.sort();
    let mut beside = Env::minors(&ro);
    beside.sort();
    assert_eq!(pair, beside, "the fullest pair with room");

    let (rs, ro) = (rs[VCORE].clone(), ro[VCORE].clone());
    let state = env.sim.state();
    // CUDA device r of a container is its r-th GPU in NVIDIA_VISIBLE_DEVICES.
    let uuids: Vec<String> = rs.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(str::to_string)
        .collect();
    let node_gpu = |u: &str| state.node().gpus.iter().position(|g| g.uuid == u).unwrap();
    let gpus = [node_gpu(&uuids[0]), node_gpu(&uuids[1])];
    assert_eq!(
        ro.envs["NVIDIA_VISIBLE_DEVICES"], rs.envs["NVIDIA_VISIBLE_DEVICES"],
        "both tenants' devices in the same order"
    );
    let ledgers = |pod: &kubelet_emulator::PodRef| {
        ledgers_by_device(&env.vm_dir().join(&pod.uid).join("main"), &uuids)
    };
    let (ls, lo) = (ledgers(&server), ledgers(&other));
    let tmp = tempfile::tempdir().unwrap();
    let progs = Programs {
        tp: test_support::compile_c("tp_serve", &env.sim, tmp.path()),
        load: test_support::compile_c("multi_gpu", &env.sim, tmp.path()),
        sock: tmp.path().join("tp.sock"),
    };
    // The manager's driver mirror lies outside the sim's root: its
    // libraries find the node's state by GPU_SIM_ROOT.
    let sim_root = env.sim_root().to_path_buf();
    let in_container = |r: &vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse,
                        p: &std::path::Path| {
        let mut c = std::process::Command::new(p);
        c.envs(container_env(r))
            .env("GPU_SIM_ROOT", &sim_root)
            .env_remove("LOGGER_LEVEL");
        c
    };
    tokio::task::block_in_place(|| {
        serve_beside_even(
            &state,
            gpus,
            &progs,
            EvenTenant {
                command: &|p| in_container(&rs, p),
                mem: 4 * GIB,
                cores: 50.0,
                ledgers: &ls,
            },
            EvenTenant {
                command: &|p| in_container(&ro, p),
                mem: 2 * GIB,
                cores: 50.0,
                ledgers: &lo,
            },
        )
    });
}

/// No two GPUs have room for a share's part: Allocate is refused with what
/// was asked and what each GPU has free (the message kubelet puts in the
/// pod's events), and nothing is booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_on_two_gpus_is_refused_when_no_pair_has_room() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    // 60 cores on three GPUs (one each: 40 free beside a 60), GPU 3 idle.
    for _ in 0..3 {
        let p = env.pod(&[("main", 60, 8)], &[]);
        env.admit(&p, "main", 60, 8).await.unwrap();
    }
    let tp = env.pod(
        &[("main", 100, 32)],
        &[("tencent.com/vcuda-gpus", r#"{"main": 2}"#)],
    );
    let err = env.admit(&tp, "main", 100, 32).await.unwrap_err();
    let m = err.to_string();
    assert!(
        m.contains("shares of 50 cores and 16 memory units (4096 MiB) on each of 2 GPUs requested"),
        "{m}"
    );
    assert!(m.contains("1 GPU(s) have room"), "{m}");
    assert!(m.contains("free per GPU: GPU0 "), "{m}");
    assert!(!env.vm_dir().join(&tp.uid).exists());
    assert_eq!(env.allocation_count(), 3);
}

/// Compute tiers through the real manager (docs/qos.md): a pod annotated
/// `latency` and one annotated `batch` on the one GPU register over their
/// own `vcuda.sock`s and get their tier and the same QoS page (the
/// latency process a slot in it, which its exit frees); a pod naming no
/// tier gets no page; a tier that is none is refused at Allocate naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_pods_get_their_tier_and_their_gpus_qos_page() {
    use qos_page::{QosPage, Tier};
    use std::os::unix::fs::MetadataExt;
    let mut env = Env::start("sim-1gpu", Options::default()).await;
    let vm = env.vm_dir();
    let request = |uid: &str| RegisterRequest {
        protocol_version: 1,
        pod_uid: uid.to_string(),
        container_name: "main".into(),
        bus_id: "0000:00:00.0".into(),
        local_pid: 1,
        program: "test".into(),
        previous_slot: None,
        previous_slots: Vec::new(),
        qos_pages: false,
        qos_flags: true,
    };
    let register =
        |uid: &str| test_support::hostile::register(&vm.join(uid).join("main"), &request(uid));
    let lat = env.pod(&[("main", 30, 8)], &[("tencent.com/vcuda-tier", "latency")]);
    let batch = env.pod(&[("main", 50, 8)], &[("tencent.com/vcuda-tier", "batch")]);
    let plain = env.pod(&[("main", 10, 4)], &[]);
    for (p, cores) in [(&lat, 30), (&batch, 50), (&plain, 10)] {
        env.admit(p, "main", cores, if cores == 10 { 4 } else { 8 })
            .await
            .unwrap();
    }
    let (lat_conn, l, lfds) = register(&lat.uid);
    assert_eq!(l.status, Status::Accepted as i32, "{}", l.message);
    assert_eq!(
        (Tier::from_wire(l.qos_tier), l.qos_page, lfds.len()),
        (Tier::Latency, true, 2)
    );
    assert!(l.qos_slot.is_some(), "{l:?}");
    let (_b, b, bfds) = register(&batch.uid);
    assert_eq!(
        (Tier::from_wire(b.qos_tier), b.qos_slot, bfds.len()),
        (Tier::Batch, None, 2)
    );
    let ino = |fd: &std::os::fd::OwnedFd| {
        std::fs::File::from(fd.try_clone().unwrap())
            .metadata()
            .unwrap()
            .ino()
    };
    // The latency process gets a flag of its own, writable until it seals
    // it; the batch process the GPU's page, read-only.
    let flag = qos_page::Flag::adopt(lfds[1].as_fd()).unwrap();
    let page = QosPage::from_fd(bfds[1].as_fd()).unwrap();
    assert_eq!(page.latency_live(), 1);
    assert!(
        !writable(&bfds[1]),
        "a batch process cannot write the GPU's page"
    );
    // The batch process asks for the latency flags: the sealed one comes,
    // read-only, and shows what the latency process writes.
    let (bflags, bflag_fds) = test_support::hostile::qos_flags(&_b);
    assert_eq!(bflags.len(), 1, "{bflags:?}");
    assert_eq!(
        ino(&bflag_fds[0]),
        ino(&lfds[1]),
        "the latency process's flag"
    );
    assert!(!writable(&bflag_fds[0]), "nor the latency flag");
    let view = qos_page::FlagView::open(bflag_fds[0].as_fd()).unwrap();
    flag.busy(u64::MAX);
    assert_eq!(view.deadline(), u64::MAX);
    flag.idle();
    assert_eq!(view.deadline(), 0);
    // An interposer from before the flags (field 10 unset) is sent no QoS
    // descriptor: it runs plain.
    let old = RegisterRequest {
        qos_flags: false,
        ..request(&batch.uid)
    };
    let (_o, o, ofds) = test_support::hostile::register(&vm.join(&batch.uid).join("main"), &old);
    assert_eq!((o.qos_page, ofds.len()), (false, 1), "{o:?}");
    let (_p, p, pfds) = register(&plain.uid);
    assert_eq!(
        (p.qos_page, pfds.len()),
        (false, 1),
        "a plain share gets no page"
    );
    // The latency process exits: its slot goes.
    drop(lat_conn);
    let end = Instant::now() + Duration::from_secs(5);
    while page.latency_live() != 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(page.latency_live(), 0);
    // The tier is kept in the checkpoint with the allocation.
    let cp = env.checkpoint();
    let tiers: Vec<(&str, &serde_json::Value)> = cp["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["pod_uid"].as_str().unwrap(), &a["tier"]))
        .collect();
    assert!(
        tiers.contains(&(lat.uid.as_str(), &serde_json::json!("latency"))),
        "{cp}"
    );
    assert!(
        tiers.contains(&(plain.uid.as_str(), &serde_json::Value::Null)),
        "{cp}"
    );

    let bad = env.pod(&[("main", 10, 4)], &[("tencent.com/vcuda-tier", "gold")]);
    let m = env
        .admit(&bad, "main", 10, 4)
        .await
        .unwrap_err()
        .to_string();
    assert!(m.contains("annotation tencent.com/vcuda-tier"), "{m}");
    assert!(m.contains("unknown QoS tier \"gold\""), "{m}");
}

/// Whether a shared writable mapping of `fd` can be made.
fn writable(fd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a mapping attempt on a live descriptor, unmapped at once
    // when it succeeds.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return false;
        }
        libc::munmap(p, 4096);
        true
    }
}
