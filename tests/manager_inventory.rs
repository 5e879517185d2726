//! The manager publishes its node's GPU inventory on the Node object
//! (`gpu_allocator::inventory`, annotation `tencent.com/vcuda-gpu-inventory`)
//! for the scheduler extender: what the simulated node's GPUs are (minor,
//! UUID, memory, bus id, PCIe levels and NVLink counts as the node file
//! says) and their health, updated when a critical Xid takes a GPU out and
//! when it comes back. Needs `cargo build --workspace`.

use std::time::{Duration, Instant};

use apiserver_emulator::Kind;
use gpu_allocator::PcieLevel;
use gpu_allocator::inventory::{ANNOTATION, Inventory};
use test_support::manager::{Env, NODE, Options};

#[path = "manager_inventory/in_mig.rs"]
mod in_mig;
#[path = "manager_inventory/lost.rs"]
mod lost;

async fn published(env: &Env, what: &str, pred: impl Fn(&Inventory) -> bool) -> Inventory {
    let t = Instant::now();
    loop {
        let node = env.api.get(Kind::Node, None, NODE).unwrap();
        if let Some(v) = node["metadata"]["annotations"][ANNOTATION].as_str() {
            let inv = Inventory::from_json(v).unwrap();
            if pred(&inv) {
                return inv;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{what}: never published; node {node}\nlog:\n{}",
            env.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_carries_its_gpu_inventory_and_health() {
    let env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let inv = published(&env, "the inventory", |_| true).await;
    assert!(inv.share_mode);
    let state = env.sim.state();
    let sim = state.node();
    assert_eq!(inv.gpus.len(), 4);
    for (g, s) in inv.gpus.iter().zip(&sim.gpus) {
        assert_eq!((g.minor, g.uuid.as_str()), (s.minor, s.uuid.as_str()));
        assert_eq!(g.memory_bytes, s.memory_mib << 20);
        assert!(g.healthy);
    }
    // Two PCIe switches of two GPUs each: the same tree the manager uses.
    let t = inv.topology();
    assert_eq!(t.pcie_level(0, 1), PcieLevel::Single);
    assert_eq!(t.pcie_level(2, 3), PcieLevel::Single);
    assert!(t.pcie_level(1, 2) > PcieLevel::Single);
    assert!(!t.has_nvlink());

    env.sim.xid(2, 79, None);
    published(&env, "GPU 2 unhealthy", |i| !i.gpus[2].healthy).await;
    let back = published(&env, "GPU 2 healthy again", |i| i.gpus[2].healthy).await;
    assert!(back.gpus.iter().all(|g| g.healthy));
}

/// An operator's MIG geometry on GPU 0 of the simulated H100 node
/// (`gpu-sim mig`, as `nvidia-smi -mig 1` then `nvidia-smi mig -cgi 9,19
/// -C`): the manager reports the MIG devices it finds, advertises GPU 0's
/// vcuda IDs Unhealthy (the kubelet counts none allocatable), publishes it
/// `mig` for the extender and the webhook, places nothing there, and keeps
/// it out when an Xid on it clears; GPU 1 serves shares and whole-GPU
/// requests as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_in_mig_mode_is_neither_shared_nor_given_whole() {
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(test_support::sim::SimNode::mig_3g_and_1g),
            quiet_s: 1,
            ..Default::default()
        },
    )
    .await;
    let log = env.log_text();
    assert!(log.contains("GPU in MIG mode"), "{log}");
    for profile in ["3g.40gb", "1g.10gb"] {
        assert!(
            log.lines()
                .any(|l| l.contains("MIG device") && l.contains(&format!("profile={profile}"))),
            "no MIG device {profile} logged:\n{log}"
        );
    }
    let healthy_ids = |env: &Env, gpu: usize| {
        let v = env.kubelet.view();
        let v = v.borrow();
        let ids = v.resources[test_support::manager::VCORE]
            .devices
            .iter()
            .filter(|(id, _)| id.starts_with(&format!("vcore-{gpu}-")))
            .map(|(_, d)| d.healthy)
            .collect::<Vec<_>>();
        (ids.iter().filter(|h| **h).count(), ids.len())
    };
    assert_eq!(healthy_ids(&env, 0), (0, 100), "GPU 0's IDs");
    assert_eq!(healthy_ids(&env, 1), (100, 100), "GPU 1's IDs");
    let inv = published(&env, "GPU 0 in MIG mode", |i| i.gpus[0].mig).await;
    assert!(!inv.gpus[1].mig);

    // A whole GPU: GPU 1, the only one.
    let whole = env.pod(&[("main", 100, 0)], &[]);
    let r = env.admit(&whole, "main", 100, 0).await.unwrap();
    assert_eq!(Env::minors(&r), vec![1]);
    env.delete(&whole).await;
    // Shares: GPU 1 too.
    for cores in [60, 40] {
        let p = env.pod(&[("main", cores, 4)], &[]);
        let r = env.admit(&p, "main", cores as usize, 4).await.unwrap();
        assert_eq!(Env::minors(&r), vec![1], "a {cores}-core share");
    }

    // An Xid on GPU 0 and its quiet period: still no IDs to offer.
    env.sim.xid(0, 79, None);
    env.wait_log("GPU health changed", 1).await;
    env.wait_log("GPU health changed", 2).await;
    assert_eq!(
        healthy_ids(&env, 0),
        (0, 100),
        "GPU 0's IDs after its Xid cleared"
    );
}

/// A MIG device the simulated node holds: what CUDA in a container given
/// it must see.
struct Instance {
    uuid: String,
    sms: u32,
    memory_mib: u64,
    gi: u32,
    ci: u32,
}

fn instances(env: &Env) -> Vec<(String, Instance)> {
    let state = env.sim.state();
    let gpu0 = state.node().gpus[0].uuid.clone();
    state
        .mig_devices(0)
        .into_iter()
        .map(|(g, c)| {
            let i = Instance {
                uuid: gpu_sim_core::mig::mig_uuid(&gpu0, g.id, c.id),
                sms: c.profile.sms(),
                memory_mib: g.profile.memory_mib,
                gi: g.id,
                ci: c.id,
            };
            (c.profile.device_name(), i)
        })
        .collect()
}

/// The capability minors of instance `i` (the driver's table: 3 + 135 ×
/// GPU minor + 9 × GI, + 1 + CI), asserted as the response's first device
/// nodes after GPU 0's.
fn instance_nodes(
    c: &vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse,
    i: &Instance,
    what: &str,
) -> (u32, u32) {
    let (gi, ci) = (3 + 9 * i.gi, 3 + 9 * i.gi + 1 + i.ci);
    let nodes: Vec<_> = c.devices.iter().map(|d| d.host_path.clone()).collect();
    assert_eq!(
        nodes[..3],
        [
            "/dev/nvidia0".to_string(),
            format!("/dev/nvidia-caps/nvidia-cap{gi}"),
            format!("/dev/nvidia-caps/nvidia-cap{ci}")
        ],
        "{what}"
    );
    (gi, ci)
}

/// Static MIG in device-plugin mode (NVIDIA's `mixed` strategy): with a
/// 3g.40gb and a 1g.10gb on GPU 0, the manager registers one resource per
/// profile, each advertising its instance by MIG UUID; a pod given either
/// gets the parent's node and the instance's two capability nodes (their
/// minors as the driver's table gives them: 3 + 135 × GPU minor + 9 × GI,
/// + 1 + CI for the compute instance: open-gpu-kernel-modules,
/// kernel-open/nvidia/nv-caps.c), `NVIDIA_VISIBLE_DEVICES=MIG-…` and the
/// untouched driver, no vm directory; CUDA run with that environment sees
/// exactly its instance (one device, its SMs, memory and UUID). A manager
/// kill -9 leaves the instances as they were, the new one serving them
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_devices_are_served_whole_one_resource_per_profile() {
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(test_support::sim::SimNode::mig_3g_and_1g),
            ..Default::default()
        },
    )
    .await;
    let found = instances(&env);
    assert_eq!(
        found.len(),
        2,
        "{:?}",
        found.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    let resource = |profile: &str| format!("tencent.com/mig-{profile}");
    let view = env
        .kubelet
        .wait_for(Duration::from_secs(15), |v| {
            found.iter().all(|(p, _)| {
                v.resources
                    .get(&resource(p))
                    .is_some_and(|r| r.healthy_ids().len() == 1)
            })
        })
        .await
        .unwrap_or_else(|_| panic!("MIG resources not registered:\n{}", env.log_text()));
    for (profile, i) in &found {
        assert_eq!(
            view.resources[&resource(profile)].healthy_ids(),
            std::slice::from_ref(&i.uuid)
        );
    }

    let bin = tempfile::tempdir().unwrap();
    let prog = test_support::compile_c("sim_cuda", &env.sim, bin.path());
    let mut minors = Vec::new();
    for (profile, i) in &found {
        let pod = env.pod(&[], &[]);
        let r = env
            .kubelet
            .admit(&pod, "main", &[(&resource(profile), 1)])
            .await
            .unwrap();
        let c = &r[&resource(profile)];
        assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], i.uuid);
        let (gi, ci) = instance_nodes(c, i, profile);
        for m in [gi, ci] {
            let node = env
                .sim_root()
                .join(format!("dev/nvidia-caps/nvidia-cap{m}"));
            assert!(node.exists(), "{} is not the sim driver's", node.display());
        }
        minors.push(gi);
        assert!(
            c.mounts.len() == 1 && c.mounts[0].host_path.ends_with("/origin"),
            "the untouched driver only: {:?}",
            c.mounts
        );
        let out = std::process::Command::new(&prog)
            .arg("info")
            .envs(test_support::manager::container_env(c))
            .env("GPU_SIM_ROOT", env.sim_root())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{profile}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kv = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("no {k} in {text}"))
                .to_string()
        };
        assert_eq!(kv("count"), "1", "{profile}: {text}");
        assert_eq!(kv("dev0.sms"), i.sms.to_string(), "{profile}");
        assert_eq!(kv("dev0.total_mib"), i.memory_mib.to_string(), "{profile}");
        assert_eq!(
            kv("dev0.uuid")[4..],
            i.uuid[4..],
            "{profile}: the MIG UUID's bytes"
        );
        assert!(
            kv("dev0.name").ends_with(&format!("MIG {profile}")),
            "{text}"
        );
    }
    assert_ne!(minors[0], minors[1]);

    // An Xid inside the 1g.10gb's GPU instance (as the driver reports an
    // error in one): that device alone goes out, for the quiet period.
    let (small, big) = match found[0].1.sms < found[1].1.sms {
        true => (&found[0], &found[1]),
        false => (&found[1], &found[0]),
    };
    env.sim.xid(0, 94, Some(small.1.gi));
    let healthy =
        |v: &kubelet_emulator::View, p: &str| v.resources[&resource(p)].healthy_ids().len();
    let v = env
        .kubelet
        .wait_for(Duration::from_secs(10), |v| healthy(v, &small.0) == 0)
        .await
        .unwrap_or_else(|_| panic!("the 1g.10gb stayed healthy:\n{}", env.log_text()));
    assert_eq!(
        healthy(&v, &big.0),
        1,
        "the 3g.40gb is not in the Xid's instance"
    );
    let sums = |v: &kubelet_emulator::View| {
        [test_support::manager::VCORE, test_support::manager::VMEM]
            .map(|r| v.resources[r].healthy_ids().len())
    };
    assert_eq!(sums(&v)[0], 100, "GPU 1's shares are not touched");
    env.kubelet
        .wait_for(Duration::from_secs(10), |v| healthy(v, &small.0) == 1)
        .await
        .unwrap_or_else(|_| panic!("the 1g.10gb never came back:\n{}", env.log_text()));

    // kill -9 of the manager: the instances stay; the next one, started
    // with the same command line, registers and serves them again.
    let mig_regs = |v: &kubelet_emulator::View| -> u64 {
        found
            .iter()
            .map(|(p, _)| v.resources[&resource(p)].registrations)
            .sum()
    };
    let before = mig_regs(&env.kubelet.view().borrow());
    let args = test_support::cmdline(env.manager.id());
    env.kill9_and_start(&args).await;
    let uuids = |v: &[(String, Instance)]| v.iter().map(|i| i.1.uuid.clone()).collect::<Vec<_>>();
    assert_eq!(
        uuids(&instances(&env)),
        uuids(&found),
        "instances after the kill"
    );
    env.kubelet
        .wait_for(Duration::from_secs(20), |v| {
            mig_regs(v) >= before + 2
                && found
                    .iter()
                    .all(|(p, _)| v.resources[&resource(p)].healthy_ids().len() == 1)
        })
        .await
        .unwrap_or_else(|_| panic!("MIG resources not back after the kill:\n{}", env.log_text()));
}

/// Instances an operator makes and destroys while the manager runs
/// (`--mig-rescan-period 1`, docs/mig.md): a 2g.20gb made on GPU 0 is
/// advertised under a resource of its own (a plugin registered for the new
/// profile) and a pod admitted to it gets that instance; the 1g.10gb
/// destroyed is withdrawn (its resource stays, advertising nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_made_or_destroyed_while_the_manager_runs_are_followed() {
    let mut env = rescanning_3g_and_1g().await;
    // The 1g.10gb's instances destroyed, then `nvidia-smi mig -cgi 14 -C`
    // (in its room).
    destroy(&env, "1g.10gb");
    env.sim.mig(&["--gpu", "0", "--create", "14"]);
    let (_, made) = instances(&env)
        .into_iter()
        .find(|(p, _)| p == "2g.20gb")
        .unwrap();
    let t = Instant::now();
    mig_resources(&env, &[("3g.40gb", 1), ("1g.10gb", 0), ("2g.20gb", 1)]).await;
    println!(
        "an operator's 2g.20gb advertised and the 1g.10gb withdrawn {} ms after (rescan every 1 s)",
        t.elapsed().as_millis()
    );
    let pod = env.pod(&[], &[]);
    let r = env
        .kubelet
        .admit(&pod, "main", &[("tencent.com/mig-2g.20gb", 1)])
        .await
        .unwrap_or_else(|e| panic!("admitting to the new 2g.20gb: {e}\n{}", env.log_text()));
    let c = &r["tencent.com/mig-2g.20gb"];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], made.uuid);
}

/// The manager on the simulated H100 with a 3g.40gb and a 1g.10gb on GPU
/// 0, rescanning every second, both advertised.
pub(crate) async fn rescanning_3g_and_1g() -> Env {
    let env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(test_support::sim::SimNode::mig_3g_and_1g),
            extra_args: vec!["--mig-rescan-period".into(), "1".into()],
            ..Default::default()
        },
    )
    .await;
    mig_resources(&env, &[("3g.40gb", 1), ("1g.10gb", 1)]).await;
    env
}

/// Destroys GPU 0's instance of `profile` (its compute instance, then
/// it), as an operator's `nvidia-smi mig -dci; -dgi`; what it was.
pub(crate) fn destroy(env: &Env, profile: &str) -> Instance {
    let (_, i) = instances(env)
        .into_iter()
        .find(|(p, _)| p == profile)
        .unwrap();
    let state = env.sim.state();
    state.destroy_compute_instance(0, i.gi, i.ci).unwrap();
    state.destroy_gpu_instance(0, i.gi).unwrap();
    i
}

/// Waits until the kubelet sees `want` (resource, healthy count) among the
/// MIG resources.
async fn mig_resources(env: &Env, want: &[(&str, usize)]) {
    let r = env
        .kubelet
        .wait_for(Duration::from_secs(20), |v| {
            want.iter().all(|(p, n)| {
                v.resources
                    .get(&format!("tencent.com/mig-{p}"))
                    .is_some_and(|r| r.healthy_ids().len() == *n)
            })
        })
        .await;
    if r.is_err() {
        let v = env.kubelet.view().borrow().clone();
        let got: Vec<_> = v
            .resources
            .iter()
            .map(|(k, r)| (k.clone(), r.healthy_ids().len()))
            .collect();
        panic!("want {want:?}, kubelet has {got:?}\n{}", env.log_text());
    }
}

/// `--mig-geometry`: GPU 0 is in MIG mode with an operator's 1g.10gb,
/// GPU 1 is not in MIG mode. The manager enables GPU 1 (idle), makes
/// 3g.40gb + 1g.10gb beside the operator's instance on GPU 0 and a
/// 2g.20gb on GPU 1, and advertises them. Restarted (kill -9) with
/// geometries that need the room of the 3g.40gb, which a process uses,
/// and of the 2g.20gb, which a pod holds: neither is destroyed. Once the
/// process ends, the 3g.40gb goes for the new geometry; the operator's
/// instance never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_geometry_is_applied_and_adopted() {
    fn operators_instance(sim: &test_support::sim::SimNode) {
        sim.mig(&["--gpu", "0", "--enable", "--create", "19"]);
    }
    let geometry = |g: &str| vec!["--mig-geometry".into(), g.to_string().into()];
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            prepare: Some(operators_instance),
            extra_args: geometry("0=3g.40gb,1g.10gb,1g.10gb;1=2g.20gb"),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        env.sim.mig_profiles(0),
        ["1g.10gb", "1g.10gb", "3g.40gb"],
        "{}",
        env.log_text()
    );
    assert_eq!(env.sim.mig_profiles(1), ["2g.20gb"]);
    assert_eq!(env.sim.state().mig_mode(1), Ok((true, true)));
    mig_resources(&env, &[("3g.40gb", 1), ("1g.10gb", 2), ("2g.20gb", 1)]).await;
    let operators: Vec<String> = instances(&env)
        .into_iter()
        .filter(|(p, _)| p == "1g.10gb")
        .map(|(_, i)| i.uuid)
        .collect();
    assert_eq!(operators.len(), 2, "the operator's and one of ours");

    // A pod holds the 2g.20gb; a process runs on the 3g.40gb.
    let pod = env.pod(&[], &[]);
    env.kubelet
        .admit(&pod, "main", &[("tencent.com/mig-2g.20gb", 1)])
        .await
        .unwrap();
    let big = instances(&env)
        .into_iter()
        .find(|(p, _)| p == "3g.40gb")
        .unwrap()
        .1;
    let bin = tempfile::tempdir().unwrap();
    let prog = test_support::compile_c("sim_cuda", &env.sim, bin.path());
    let mut busy = std::process::Command::new(&prog)
        .args(["saturate", "100"])
        .env("LD_LIBRARY_PATH", env.sim.lib_dir())
        .env("CUDA_VISIBLE_DEVICES", &big.uuid)
        .env("GPU_SIM_ROOT", env.sim_root())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = std::io::BufReader::new(busy.stdout.take().unwrap());
    while !line.contains("done") {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "saturate ended"
        );
    }

    // /metrics lists each MIG device with what runs in it (the sampler
    // ticks every second).
    let line = |text: &str, name: &str, uuid: &str| {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(uuid))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    let t = Instant::now();
    let metrics = loop {
        let (code, text) = test_support::process::http_get(env.http_addr, "/metrics");
        assert_eq!(code, 200);
        if line(&text, "vcuda_mig_device_processes", &big.uuid).as_deref() == Some("1") {
            break text;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no process on the 3g.40gb in /metrics:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        line(&metrics, "vcuda_mig_device_memory_total_bytes", &big.uuid),
        Some((big.memory_mib << 20).to_string())
    );
    let mib_used: u64 = line(&metrics, "vcuda_mig_device_memory_used_bytes", &big.uuid)
        .unwrap()
        .parse()
        .unwrap();
    assert!(mib_used > 0, "{metrics}");
    assert!(metrics.contains("profile=\"2g.20gb\""), "{metrics}");
    let (_, graph) = test_support::process::http_get(env.http_addr, "/graph");
    assert!(
        graph.contains(&format!("GPU0 {} 3g.40gb", big.uuid)) && graph.contains("1 process(es)"),
        "{graph}"
    );

    // A geometry that needs the busy 3g.40gb's slices (seven 1g.10gb) and
    // one that needs the held 2g.20gb's (a 7g.80gb): neither is applied,
    // nothing is destroyed.
    let mut args = test_support::cmdline(env.manager.id());
    let at = args.iter().position(|a| a == "--mig-geometry").unwrap();
    let seven = ["1g.10gb"; 7].join(",");
    args[at + 1] = format!("0={seven};1=7g.80gb");
    env.kill9_and_start(&args).await;
    let log = env.log_text();
    assert_eq!(log.matches("do not fit").count(), 2, "{log}");
    assert_eq!(env.sim.mig_profiles(0), ["1g.10gb", "1g.10gb", "3g.40gb"]);
    assert_eq!(env.sim.mig_profiles(1), ["2g.20gb"]);
    assert!(instances(&env).iter().any(|(_, i)| i.uuid == big.uuid));

    // The process ends: the 3g.40gb, vcuda's and idle, makes room for
    // the seven; the operator's 1g.10gb is one of them. The pod still
    // holds the 2g.20gb.
    std::io::Write::write_all(busy.stdin.as_mut().unwrap(), b"\n").unwrap();
    assert!(busy.wait().unwrap().success());
    env.kill9_and_start(&args).await;
    assert_eq!(
        env.sim.mig_profiles(0),
        vec!["1g.10gb"; 7],
        "{}",
        env.log_text()
    );
    assert_eq!(env.sim.mig_profiles(1), ["2g.20gb"]);
    let now = instances(&env);
    for u in &operators {
        assert!(now.iter().any(|(_, i)| &i.uuid == u), "the 1g.10gb {u}");
    }
    mig_resources(&env, &[("1g.10gb", 7), ("2g.20gb", 1)]).await;
    let v = env.kubelet.view().borrow().clone();
    assert!(
        !v.resources["tencent.com/mig-3g.40gb"].connected,
        "no plugin serves the 3g.40gb any more"
    );
}

/// `--mig-dynamic 0` (docs/mig.md, Dynamic MIG in device-plugin mode): GPU
/// 0 of the simulated H100 node is put in MIG mode, holding nothing. Pods
/// the scheduler marked Unschedulable for want of a 3g.40gb get one made
/// each while they fit (two; the third waits, logged; a pod selecting
/// other nodes counts for nothing), and the kubelet
/// sees them advertised; a pod then bound and admitted gets one. Once the
/// others are deleted, the instances nobody needs are destroyed after the
/// grace period (withdrawn, not listed as lost), the held one stays until
/// its pod is gone too. A kill -9 between changes nothing, and a GPU
/// given whole to a pod is not put in MIG mode when named dynamic. A pod
/// the scheduler never places beside a free instance is passed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_mig_makes_instances_for_waiting_pods_and_destroys_them_after() {
    let args = ["--mig-dynamic", "0", "--mig-rescan-period", "1"];
    let mut extra_args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    extra_args.extend(["--mig-dynamic-grace".into(), "2".into()]);
    let mut env = Env::start(
        "sim-mig-h100",
        Options {
            extra_args,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(env.sim.state().mig_mode(0), Ok((true, true)));
    assert!(env.sim.mig_profiles(0).is_empty(), "{}", env.log_text());
    let resource = "tencent.com/mig-3g.40gb";
    // A pod that selects other nodes: its 7g.80gb (placed first, the
    // largest) would take the whole GPU if it counted here.
    env.api
        .create_pod(serde_json::json!({
            "metadata": {"name": "elsewhere", "namespace": "default"},
            "spec": {"nodeSelector": {"pool": "b"}, "containers": [{"name": "main",
                "image": "cuda", "resources": {"limits": {"tencent.com/mig-7g.80gb": "1"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable"}]}
        }))
        .unwrap();
    let t = Instant::now();
    let waiting: Vec<String> = (1..=3)
        .map(|i| {
            let name = format!("waiting-{i}");
            env.api
                .create_pod(serde_json::json!({
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": {"containers": [{"name": "main", "image": "cuda",
                        "resources": {"limits": {resource: "1"}}}]},
                    "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                        "status": "False", "reason": "Unschedulable"}]}
                }))
                .unwrap();
            name
        })
        .collect();
    mig_resources(&env, &[("3g.40gb", 2)]).await;
    println!(
        "two 3g.40gb made for waiting pods and advertised {} ms after",
        t.elapsed().as_millis()
    );
    assert_eq!(env.sim.mig_profiles(0), ["3g.40gb", "3g.40gb"]);
    env.wait_log("fit on no dynamic GPU now", 1).await;
    let unplaced = "vcuda_mig_dynamic_unplaced{node=\"sim-node\",profile=\"3g.40gb\"}";
    wait_metric(env.http_addr, unplaced, "1").await;
    let made = "vcuda_mig_dynamic_instances_total{action=\"made\"";
    wait_metric(env.http_addr, made, "2").await;

    // The scheduler binds the first; the kubelet admits it.
    let uid = env.api.pod("default", &waiting[0]).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    let patch = serde_json::json!({"spec": {"nodeName": NODE}, "status": {"conditions": null}});
    env.api.patch_pod("default", &waiting[0], &patch).unwrap();
    let pod = kubelet_emulator::PodRef {
        uid,
        name: waiting[0].clone(),
        namespace: "default".into(),
    };
    let r = env
        .kubelet
        .admit(&pod, "main", &[(resource, 1)])
        .await
        .unwrap_or_else(|e| panic!("admitting to a made 3g.40gb: {e}\n{}", env.log_text()));
    let held = r[resource].envs["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(held.starts_with("MIG-"), "{held}");

    // A pod given GPU 1 whole (GPU 0 is MIG's), no process on it yet.
    let whole = env.pod(&[("main", 100, 0)], &[]);
    let r = env.admit(&whole, "main", 100, 0).await.unwrap();
    assert_eq!(Env::minors(&r), [1]);

    // kill -9 and a new manager, now with GPU 1 dynamic too: both
    // instances stay, adopted (the record says they are vcuda's), the held
    // one still advertised; GPU 1 stays whole under its pod.
    let mut args = test_support::cmdline(env.manager.id());
    let at = args.iter().position(|a| a == "--mig-dynamic").unwrap();
    args[at + 1] = "0,1".into();
    env.kill9_and_start(&args).await;
    mig_resources(&env, &[("3g.40gb", 2)]).await;
    assert_eq!(env.sim.mig_profiles(0), ["3g.40gb", "3g.40gb"]);
    env.wait_log("the GPU holds shares of pods", 1).await;
    assert_eq!(env.sim.state().mig_mode(1), Ok((false, false)));

    for name in &waiting[1..] {
        env.api.delete_pod("default", name).unwrap();
    }
    let t = Instant::now();
    let one_left = env
        .kubelet
        .wait_for(Duration::from_secs(20), |v| {
            v.resources
                .get(resource)
                .is_some_and(|r| r.devices.keys().collect::<Vec<_>>() == [&held])
        })
        .await;
    assert!(
        one_left.is_ok(),
        "the free one withdrawn\n{}",
        env.log_text()
    );
    println!(
        "the 3g.40gb nobody needs destroyed and withdrawn {} ms after its pods went (grace 2 s)",
        t.elapsed().as_millis()
    );
    assert_eq!(env.sim.mig_profiles(0), ["3g.40gb"]);
    assert!(env.kubelet.view().borrow().resources[resource].devices[&held].healthy);

    // Its pod gone too: no instance left.
    env.kubelet.release_pod(&pod.uid).unwrap();
    env.api.delete_pod("default", &waiting[0]).unwrap();
    mig_resources(&env, &[("3g.40gb", 0)]).await;
    assert!(env.sim.mig_profiles(0).is_empty(), "{}", env.log_text());
    let http = env
        .logged_http_addr()
        .expect("the restarted manager's address");
    // The restarted manager destroyed both (counters start at its start).
    let destroyed = "vcuda_mig_dynamic_instances_total{action=\"destroyed\"";
    wait_metric(http, destroyed, "2").await;
    let (_, metrics) = test_support::process::http_get(http, "/metrics");
    assert!(
        !metrics.contains("vcuda_mig_device_lost{"),
        "destroyed by vcuda, not lost:\n{metrics}"
    );

    // A pod the scheduler never places here (here, nobody binds it) beside
    // the instance made for it: passed over after the grace period, its
    // instance destroyed, and none made again meanwhile.
    env.api
        .create_pod(serde_json::json!({
            "metadata": {"name": "stubborn", "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "cuda",
                "resources": {"limits": {"tencent.com/mig-1g.10gb": "1"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable"}]}
        }))
        .unwrap();
    mig_resources(&env, &[("1g.10gb", 1)]).await;
    env.wait_log("is not counted for a while", 1).await;
    mig_resources(&env, &[("1g.10gb", 0)]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(env.sim.mig_profiles(0).is_empty(), "{}", env.log_text());
}

/// Waits (10 s at most) until the `/metrics` line starting `name` ends in
/// `want`.
async fn wait_metric(http: std::net::SocketAddr, name: &str, want: &str) {
    let t = Instant::now();
    loop {
        let (_, text) = test_support::process::http_get(http, "/metrics");
        let got = text.lines().find(|l| l.starts_with(name));
        if got.is_some_and(|l| l.rsplit(' ').next() == Some(want)) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{name} is not {want}: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
