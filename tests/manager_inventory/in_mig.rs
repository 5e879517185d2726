//! vcuda shares inside a MIG instance in device-plugin mode (docs/mig.md,
//! *Shares inside an instance*): with `--mig-shared-profiles 2g.20gb`, the
//! 2g.20gb on GPU 0 of the simulated H100 node takes shares instead of
//! being advertised whole; a pod annotated `tencent.com/vcuda-mig-profile:
//! 2g.20gb` with 50 cores and 20 units (5 GiB) gets the instance's device
//! nodes, `NVIDIA_VISIBLE_DEVICES=MIG-…`, the interposer and a quota
//! relative to the instance: CUDA sees a 5 GiB card, refused past it, and
//! the share runs half of the instance's time.

use std::process::Command;
use std::time::Duration;

use apiserver_emulator::Kind;
use test_support::manager::{Env, Options, VCORE, VMEM, container_env};
use test_support::sim::{SimNode, busy_of_instance, compile_c};

const MIB: u64 = 1 << 20;
const PROFILE: &str = "tencent.com/vcuda-mig-profile";

/// GPU 0 in MIG mode with a 2g.20gb and a 1g.10gb (H100 profile ids 14 and
/// 19).
fn two_g_and_one_g(sim: &SimNode) {
    sim.mig(&["--gpu", "0", "--enable", "--create", "14,19"]);
}

fn options() -> Options {
    Options {
        prepare: Some(two_g_and_one_g),
        extra_args: vec![
            "--interposer".into(),
            test_support::target_dir().join("libvcuda.so").into(),
            "--mig-shared-profiles".into(),
            "2g.20gb".into(),
        ],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_inside_a_2g_instance_is_held_to_its_part_of_the_instance() {
    let mut env = Env::start("sim-mig-h100", options()).await;
    let found = super::instances(&env);
    let (_, two_g) = found
        .iter()
        .find(|(p, _)| p == "2g.20gb")
        .expect("a 2g.20gb on GPU 0");
    let units = two_g.memory_mib / 256;
    let gpu1_units = env.sim.state().node().gpus[1].memory_mib / 256;
    // The kubelet counts GPU 1 and the instance; the 1g.10gb stays whole.
    let healthy = |v: &kubelet_emulator::View, r: &str| {
        v.resources
            .get(r)
            .map_or(0, |r| r.healthy_ids().len() as u64)
    };
    let v = env
        .kubelet
        .wait_for(Duration::from_secs(15), |v| {
            healthy(v, VCORE) == 200
                && healthy(v, VMEM) == gpu1_units + units
                && healthy(v, "tencent.com/mig-1g.10gb") == 1
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the instance's capacity never advertised:\n{}",
                env.log_text()
            )
        });
    assert_eq!(
        healthy(&v, "tencent.com/mig-2g.20gb"),
        0,
        "a shared profile is not served whole"
    );
    let inv = super::published(&env, "the shared instance", |i| !i.instances.is_empty()).await;
    let i = &inv.instances[0];
    assert_eq!(
        (
            i.instance.uuid.as_str(),
            i.instance.gpu,
            i.instance.profile.as_str(),
            i.healthy
        ),
        (two_g.uuid.as_str(), 0, "2g.20gb", true)
    );

    let pod = env.pod(&[("main", 50, 20)], &[(PROFILE, "2g.20gb")]);
    let r = env.admit(&pod, "main", 50, 20).await.unwrap();
    let c = &r[VCORE];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], two_g.uuid);
    super::instance_nodes(c, two_g, "the share's instance");
    assert!(
        c.mounts.iter().any(|m| m.container_path == "/etc/vcuda"),
        "{:?}",
        c.mounts
    );
    assert!(
        c.mounts.iter().any(|m| m.host_path.ends_with("/nvidia")),
        "the interposer's volume: {:?}",
        c.mounts
    );
    let mut cenv = container_env(c);
    cenv.push(("GPU_SIM_ROOT".into(), env.sim_root().display().to_string()));

    // CUDA sees a 5 GiB card inside the instance, and is refused past it.
    let bin = tempfile::tempdir().unwrap();
    let client = compile_c("shim_client", &env.sim, bin.path());
    let out = Command::new(&client)
        .args(["quota", "64"])
        .envs(cenv.iter().cloned())
        .env_remove("LOGGER_LEVEL")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let q = test_support::kv(&text);
    let get = |k: &str| q[k].parse::<u64>().unwrap();
    assert_eq!(get("start_total"), 5 << 30, "cuMemGetInfo total: {text}");
    assert_eq!(get("last"), 2, "refused past 5 GiB (out of memory): {text}");
    assert!(get("allocated") * 64 * MIB <= 5 << 30, "{text}");
    assert!(get("full_free") < 64 * MIB, "{text}");
    // Half of the instance's time, saturating.
    let compute = compile_c("shim_compute", &env.sim, bin.path());
    let u = busy_of_instance(&env.sim, two_g.gi, &compute, &cenv, (6.0, 2.0, 5.5));
    println!(
        "a 50 % share inside a 2g.20gb instance (device-plugin mode) got {u:.1} % of the instance"
    );
    // Issue 36's 50 ± 3 %: 50.0 % in three runs beside a clean-clone run's
    // cargo tests and real-node suite.
    assert!((u - 50.0).abs() <= 3.0, "{u:.1} % of the instance");

    // The pod's record names the instance, for the extender and restarts.
    let annotated = |key: &str| {
        let p = env.api.get(Kind::Pod, Some("default"), &pod.name).unwrap();
        p["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_string)
    };
    let t = std::time::Instant::now();
    while annotated("tencent.com/predicate-mig-0").is_none()
        && t.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        annotated("tencent.com/predicate-mig-0").as_deref(),
        Some(two_g.uuid.as_str())
    );
    assert_eq!(
        annotated("tencent.com/predicate-gpu-idx-0").as_deref(),
        Some("0")
    );

    // More than the instance has left is refused, naming its room; a share
    // without the annotation goes on GPU 1, never into the instance.
    let big = env.pod(&[("main", 60, 4)], &[(PROFILE, "2g.20gb")]);
    let e = env
        .admit(&big, "main", 60, 4)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no healthy 2g.20gb MIG instance has 60 free cores"),
        "{e}"
    );
    let plain = env.pod(&[("main", 30, 4)], &[]);
    let r = env.admit(&plain, "main", 30, 4).await.unwrap();
    assert_eq!(Env::minors(&r), [1]);
    let bad = env.pod(&[("main", 10, 4)], &[(PROFILE, "2g")]);
    let e = env
        .admit(&bad, "main", 10, 4)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"2g\" is not a MIG profile name"), "{e}");

    // An Xid inside the instance's GPU instance: its IDs go Unhealthy and
    // the inventory says so (GPU 1's stay), until the quiet period ends.
    env.sim.xid(0, 94, Some(two_g.gi));
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| healthy(v, VCORE) == 100)
        .await
        .unwrap_or_else(|_| panic!("the instance stayed healthy:\n{}", env.log_text()));
    super::published(&env, "the instance unhealthy", |i| !i.instances[0].healthy).await;
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| healthy(v, VCORE) == 200)
        .await
        .unwrap_or_else(|_| panic!("the instance never came back:\n{}", env.log_text()));

    // kill -9: the share stays where it is, its capacity held; the
    // instance's last 50 cores still take a share.
    let args = test_support::cmdline(env.manager.id());
    env.kill9_and_start(&args).await;
    env.kubelet
        .wait_for(Duration::from_secs(20), |v| healthy(v, VCORE) == 200)
        .await
        .unwrap_or_else(|_| panic!("not back after the kill:\n{}", env.log_text()));
    let again = env.pod(&[("main", 60, 4)], &[(PROFILE, "2g.20gb")]);
    let e = env
        .admit(&again, "main", 60, 4)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("has 60 free cores"),
        "the first share is still held: {e}"
    );
    let rest = env.pod(&[("main", 50, 4)], &[(PROFILE, "2g.20gb")]);
    let r = env.admit(&rest, "main", 50, 4).await.unwrap();
    assert_eq!(r[VCORE].envs["NVIDIA_VISIBLE_DEVICES"], two_g.uuid);
}

/// GPU 0 in MIG mode with two 2g.20gb.
fn two_2g(sim: &SimNode) {
    sim.mig(&["--gpu", "0", "--enable", "--create", "14,14"]);
}

/// Compute tiers inside shared instances in device-plugin mode (docs/qos.md,
/// docs/mig.md): a latency and a batch pod placed in one 2g.20gb order
/// their launches through that instance's QoS page; a batch pod that
/// lands in the other 2g.20gb has a page of its own and is never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_order_the_tenants_of_one_shared_instance_and_no_other() {
    use qos_page::{QosPage, Tier};
    use std::os::fd::AsFd;
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(two_2g),
            ..options()
        },
    )
    .await;
    let tier = |t: &'static str| [(PROFILE, "2g.20gb"), ("tencent.com/vcuda-tier", t)];
    // Fullest first: the batch pod joins the latency pod's instance; the
    // third (50 cores) no longer fits there and opens the other.
    let mut placed = Vec::new();
    for (t, cores) in [("latency", 30), ("batch", 30), ("batch", 50)] {
        let pod = env.pod(&[("main", cores, 8)], &tier(t));
        let r = env.admit(&pod, "main", cores as usize, 8).await.unwrap();
        let uuid = r[VCORE].envs["NVIDIA_VISIBLE_DEVICES"].clone();
        let mut cenv = container_env(&r[VCORE]);
        cenv.push(("GPU_SIM_ROOT".into(), env.sim_root().display().to_string()));
        placed.push((pod, uuid, cenv));
    }
    assert_eq!(
        placed[0].1, placed[1].1,
        "latency and batch in one instance"
    );
    assert_ne!(placed[1].1, placed[2].1, "the far batch in the other");
    // Each batch share's page and ledger, as a process of it receives them.
    let vm = env.vm_dir();
    let page_of = |uid: &str| {
        let req = test_support::hostile::maximal_request(uid, "main");
        let (s, r, fds) = test_support::hostile::register(&vm.join(uid).join("main"), &req);
        assert_eq!(
            (Tier::from_wire(r.qos_tier), r.qos_page, fds.len()),
            (Tier::Batch, true, 2),
            "a batch share inside an instance gets its tier and a page: {r:?}"
        );
        let page = QosPage::from_fd(fds[1].as_fd()).unwrap();
        let ledger = container_ledger::Ledger::from_fd(fds[0].as_fd()).unwrap();
        (s, page, ledger)
    };
    let (_n, _, near) = page_of(&placed[1].0.uid);
    let (_f, far_page, far) = page_of(&placed[2].0.uid);

    let bin = tempfile::tempdir().unwrap();
    let compute = compile_c("shim_compute", &env.sim, bin.path());
    let latency = compile_c("qos_latency", &env.sim, bin.path());
    let text = test_support::sim::latency_beside_batches(
        &compute,
        &latency,
        &placed[0].2,
        &[&placed[1].2, &placed[2].2],
    );
    let (held_ns, holds) = (near.qos_held_ns(), near.qos_holds());
    println!(
        "device-plugin mode, inside one 2g.20gb: batch held {holds} times, {:.1} ms, beside {text}",
        held_ns as f64 / 1e6
    );
    assert!(holds > 0 && held_ns > 0, "the near batch share was held");
    assert_eq!(
        (far.qos_held_ns(), far.qos_holds()),
        (0, 0),
        "the other instance's batch never"
    );
    assert_eq!(far_page.latency_live(), 0);
}

/// Memory requests below limits inside a shared instance (docs/qos.md,
/// "Memory"; docs/mig.md): a 4 GiB share with a 16 GiB limit sees its limit
/// as the card and fills 13 GiB of the 2g.20gb; a guaranteed 8 GiB share
/// placed in the same instance then allocates 7 GiB, for which only the
/// borrower's lent memory can make room: the borrower is ended saying why,
/// an Event on its pod, and the guaranteed allocation succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_inside_an_instance_is_reclaimed_for_a_guaranteed_share() {
    use test_support::process::{field, hold, release};
    let mut env = Env::start("sim-mig-h100", options()).await;
    let limit = [
        (PROFILE, "2g.20gb"),
        ("tencent.com/vcuda-memory-limit", "16Gi"),
    ];
    let burst = env.pod(&[("main", 30, 16)], &limit);
    let rb = env.admit(&burst, "main", 30, 16).await.unwrap()[VCORE].clone();
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c("hold_memory", &env.sim, tmp.path());
    let sim_root = env.sim_root().to_path_buf();
    let in_container = |r: &vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse| {
        let mut c = Command::new(&exe);
        c.envs(container_env(r))
            .env("GPU_SIM_ROOT", &sim_root)
            .env_remove("LOGGER_LEVEL");
        c
    };
    let (probe, line) = hold(&mut in_container(&rb), 1024);
    assert_eq!(
        field(&line, "total_mib"),
        16384,
        "its limit as the card: {line}"
    );
    release(probe);
    let (borrower, line) = hold(&mut in_container(&rb), 13 * 1024);
    assert!(
        line.starts_with("pid="),
        "borrowing 9+ GiB inside the instance: {line}"
    );

    let guaranteed = env.pod(&[("main", 30, 32)], &[(PROFILE, "2g.20gb")]);
    let rg = env.admit(&guaranteed, "main", 30, 32).await.unwrap()[VCORE].clone();
    assert_eq!(
        rg.envs["NVIDIA_VISIBLE_DEVICES"], rb.envs["NVIDIA_VISIBLE_DEVICES"],
        "the same instance"
    );
    let t = std::time::Instant::now();
    let (g, line) = tokio::task::block_in_place(|| hold(&mut in_container(&rg), 7 * 1024));
    assert!(
        line.starts_with("pid="),
        "the guaranteed allocation: {line}"
    );
    println!(
        "inside a 2g.20gb: the guaranteed 7 GiB allocated with one reclaim in {} us ({:?} from its start)",
        field(&line, "alloc_us"),
        t.elapsed()
    );
    let mut borrower = borrower;
    let status = borrower.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let err = std::io::read_to_string(borrower.stderr.take().unwrap()).unwrap();
    assert!(err.contains("was ended to reclaim GPU memory"), "{err}");
    let ev = env
        .wait_event("VcudaMemoryReclaimed", &burst.name, Duration::from_secs(10))
        .await;
    assert!(
        ev["note"].as_str().unwrap().contains(&guaranteed.name),
        "{ev}"
    );
    release(g);
}

/// An operator destroys the shared 2g.20gb under a share (its program
/// done; `--mig-rescan-period 1`): the instance's IDs go Unhealthy, it is
/// published unhealthy (GPU 0's own 100 are listed Unhealthy throughout:
/// MIG mode), the pod gets a `VcudaMigDeviceLost` Event naming
/// it and `/metrics` counts it lost; once the pod goes, the next read
/// forgets the instance and its IDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_instance_destroyed_under_a_share_is_reported() {
    let mut opts = options();
    opts.extra_args
        .extend(["--mig-rescan-period".into(), "1".into()]);
    let mut env = Env::start("sim-mig-h100", opts).await;
    let healthy =
        |v: &kubelet_emulator::View| v.resources.get(VCORE).map_or(0, |r| r.healthy_ids().len());
    let listed = |v: &kubelet_emulator::View| v.resources.get(VCORE).map_or(0, |r| r.devices.len());
    env.kubelet
        .wait_for(Duration::from_secs(15), |v| healthy(v) == 200)
        .await
        .unwrap_or_else(|_| panic!("the instance's IDs:\n{}", env.log_text()));
    let pod = env.pod(&[("main", 50, 20)], &[(PROFILE, "2g.20gb")]);
    env.admit(&pod, "main", 50, 20).await.unwrap();
    let gone = super::destroy(&env, "2g.20gb");
    let ev = env
        .wait_event("VcudaMigDeviceLost", &pod.name, Duration::from_secs(10))
        .await;
    let note = ev["note"].as_str().unwrap_or_default();
    assert!(
        note.contains(&gone.uuid) && note.contains("shared instance"),
        "{ev}"
    );
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| {
            healthy(v) == 100 && listed(v) == 300
        })
        .await
        .unwrap_or_else(|_| {
            let v = env.kubelet.view().borrow().clone();
            panic!(
                "its IDs Unhealthy, still listed: {} healthy of {}\n{}",
                healthy(&v),
                listed(&v),
                env.log_text()
            )
        });
    super::published(&env, "the instance unhealthy", |i| {
        i.instances
            .iter()
            .any(|x| x.instance.uuid == gone.uuid && !x.healthy)
    })
    .await;
    let (_, metrics) = test_support::process::http_get(env.http_addr, "/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("vcuda_mig_device_lost{") && l.contains(&gone.uuid))
        .unwrap_or_else(|| panic!("no vcuda_mig_device_lost for it in\n{metrics}"));
    assert!(line.ends_with(" 1"), "{line}");
    // The pod gone: the next read forgets the instance and its IDs (GPU
    // 0's own stay listed, Unhealthy: it is in MIG mode).
    env.delete(&pod).await;
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| listed(v) == 200)
        .await
        .unwrap_or_else(|_| panic!("its IDs withdrawn:\n{}", env.log_text()));
}
