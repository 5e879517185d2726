//! Issue #7: the manager survives restarts and failures. Real containers on
//! the private Docker engine run with the AllocateResponse applied (devices,
//! mounts, env, `io.kubernetes.*` labels) and interposed CUDA workloads;
//! the manager is killed with SIGKILL and started again.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kubelet_emulator::PodRef;
use test_support::manager::{self, Env, Options};
use test_support::{Capability, Docker, cmdline, compile_c, target_dir};
use vcuda_api::deviceplugin::v1beta1::ContainerAllocateResponse;

/// The manager's argv, read back from /proc, so a restart runs the same
/// command line.
fn argv(env: &Env) -> Vec<String> {
    cmdline(env.manager.id())
}

/// SIGKILL, then the same command line (plus `extra`), appending to the log.
async fn kill9_and_restart(env: &mut Env, extra: &[&str]) {
    let args = argv(env);
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    respawn(env, &args, extra).await;
}

async fn respawn(env: &mut Env, args: &[String], extra: &[&str]) {
    // The log is shared by every start: this start's line is one more.
    let ready = "step 6/6: registered with kubelet";
    let before = env.log_text().matches(ready).count();
    let regs = env.registrations();
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(&env.log)
        .unwrap();
    let mut args = args.to_vec();
    // A later flag of the same name wins in clap for single values.
    args.extend(extra.iter().map(|s| s.to_string()));
    env.manager = Command::new(&args[0])
        .args(&args[1..])
        .env("RUST_LOG", "info,gpu_manager=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    env.wait_registered_since(regs).await;
    // Registered comes after recovery. Counting from before the start:
    // a fixed count was met by earlier starts from the third on, and a
    // CI run read the log before the new start had recovered.
    env.wait_log(ready, before + 1).await;
}

struct Workload {
    docker: Docker,
    bin: tempfile::TempDir,
    names: Vec<String>,
}

impl Workload {
    /// `docker run -d` of a container as kubelet would create it from the
    /// AllocateResponse (device host paths inside the simulated node's root).
    fn run(
        &mut self,
        env: &Env,
        pod: &PodRef,
        container: &str,
        resp: &ContainerAllocateResponse,
        cmd: &[&str],
    ) -> String {
        let name = cname(pod, container);
        let mut a: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "-i".into(),
            "--name".into(),
            name.clone(),
            "--network".into(),
            "none".into(),
        ];
        for (k, v) in [
            ("io.kubernetes.pod.uid", pod.uid.as_str()),
            ("io.kubernetes.pod.name", pod.name.as_str()),
            ("io.kubernetes.pod.namespace", pod.namespace.as_str()),
            ("io.kubernetes.container.name", container),
        ] {
            a.push("--label".into());
            a.push(format!("{k}={v}"));
        }
        let root = env.sim_root().display().to_string();
        for d in &resp.devices {
            a.push("--device".into());
            a.push(format!(
                "{root}{}:{}:{}",
                d.host_path, d.container_path, d.permissions
            ));
        }
        for m in &resp.mounts {
            a.push("--mount".into());
            a.push(format!(
                "type=bind,source={},target={}{}",
                m.host_path,
                m.container_path,
                if m.read_only { ",readonly" } else { "" }
            ));
        }
        for (k, v) in &resp.envs {
            a.push("-e".into());
            a.push(format!("{k}={v}"));
        }
        a.extend(Docker::glibc_mounts());
        a.extend([
            "-v".into(),
            format!("{root}/run/gpu-sim:/run/gpu-sim"),
            "-v".into(),
            format!("{}:/work:ro", self.bin.path().display()),
            self.docker.image.clone(),
        ]);
        a.extend(cmd.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let id = self.docker.ok(&a);
        self.names.push(name.clone());
        id
    }

    fn host_pid(&self, name: &str) -> i32 {
        self.docker
            .ok(&["inspect", "--format", "{{.State.Pid}}", name])
            .parse()
            .unwrap()
    }

    fn exec(&self, name: &str, cmd: &[&str]) -> (bool, String) {
        let mut a = vec!["exec", name];
        a.extend(cmd);
        let out = self.docker.cli(&a).unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = self.docker.cli(&["rm", "-f", n]);
        }
    }
}

const GIB: u64 = 1 << 30;

fn setup() -> Option<(Docker, tempfile::TempDir)> {
    let docker = Docker::get()?;
    Some((docker, tempfile::tempdir().unwrap()))
}

/// The manager's options for these tests: the interposer in the `nvidia`
/// volume from the first start, and the test's Docker engine (flags, not
/// the environment: a restart re-runs the same argv, and tests run in
/// parallel threads).
fn docker_options(docker: &Docker) -> Options {
    let shim = target_dir().join("libvcuda.so");
    assert!(
        shim.is_file(),
        "{} missing: cargo build --workspace",
        shim.display()
    );
    Options {
        extra_args: vec![
            "--interposer".into(),
            shim.into(),
            "--container-runtime-endpoint".into(),
            docker.host.clone().into(),
        ],
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_keeps_live_containers_frees_dead_ones_and_never_double_books() {
    let Some((docker, bin)) = setup() else { return };
    let mut env = Env::start("sim-1gpu", docker_options(&docker)).await;
    compile_c("shim_client", &env.sim, bin.path());
    let mut w = Workload {
        docker,
        bin,
        names: vec![],
    };

    // A: 2 GiB share holding 1 GiB through the interposer (and its context,
    // 423 MiB on the A100 node: 1447 MiB in all). B, C: sleepers.
    let a = env.pod(&[("main", 30, 8)], &[]);
    let ra = env.admit(&a, "main", 30, 8).await.unwrap();
    let name_a = cname(&a, "main");
    w.run(
        &env,
        &a,
        "main",
        &ra[manager::VCORE],
        &["/work/shim_client", "hold", "1024"],
    );
    let b = env.pod(&[("main", 20, 4)], &[]);
    let rb = env.admit(&b, "main", 20, 4).await.unwrap();
    w.run(&env, &b, "main", &rb[manager::VCORE], &["sleep", "3600"]);
    let c = env.pod(&[("main", 20, 4)], &[]);
    let rc = env.admit(&c, "main", 20, 4).await.unwrap();
    let name_c = w.run(&env, &c, "main", &rc[manager::VCORE], &["sleep", "3600"]);

    let pid_a = w.host_pid(&name_a);
    let log = env
        .wait_log(&format!("interposer registered pid={pid_a}"), 1)
        .await;
    assert!(log.contains("interposer registered"));
    let before = env.allocations_by_container();
    assert_eq!(before.len(), 3);
    let vdriver = env.tmp.path().join("vdriver/nvidia/lib64");
    let lib_inodes: BTreeMap<String, u64> = std::fs::read_dir(&vdriver)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::symlink_metadata(e.path()).unwrap().ino(),
            )
        })
        .collect();
    let cfg_a = env.vm_dir().join(&a.uid).join("main/vcuda.config");
    let cfg_ino = std::fs::metadata(&cfg_a).unwrap().ino();

    // The manager dies; C's pod is deleted and its container removed meanwhile.
    let args = argv(&env);
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    env.api.delete_pod(&c.namespace, &c.name).unwrap();
    env.kubelet.release_pod(&c.uid).unwrap();
    w.docker.ok(&["rm", "-f", &name_c]);
    // Quota enforced while the manager is down: A's process still holds
    // its ledger, so a second process may not take another GiB.
    respawn(&mut env, &args, &[]).await;

    let after = env.allocations_by_container();
    let mut expect = before.clone();
    expect.remove(&format!("{}/main", c.uid));
    assert_eq!(after, expect, "allocation state after the restart");
    let vm_c = env.vm_dir().join(&c.uid);
    assert!(
        !vm_c.exists(),
        "dead container's vm dir removed: {:?}\n{}",
        std::fs::read_dir(&vm_c).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>()),
        env.log_text()
            .lines()
            .filter(|l| l.contains("recovery") || l.contains("vm dir"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !env.vm_dir().join(&c.uid).exists(),
        "dead container's vm dir removed"
    );
    // Mounted driver files were not rewritten; A's quota file neither.
    for (f, ino) in &lib_inodes {
        let now = std::fs::symlink_metadata(vdriver.join(f)).unwrap().ino();
        assert_eq!(now, *ino, "{f} was rewritten");
    }
    assert_eq!(std::fs::metadata(&cfg_a).unwrap().ino(), cfg_ino);

    // A's interposer re-registered on its own with the restarted manager.
    env.wait_log(&format!("interposer registered pid={pid_a}"), 2)
        .await;
    // And the quota holds: 1447 MiB held, 2 GiB quota; another process's
    // context fits (423 MiB), another GiB does not, 128 MiB do.
    let (ok, out) = w.exec(&name_a, &["/work/shim_client", "hold", "1024"]);
    assert!(
        !ok && out.contains("error cuMemAlloc=2"),
        "over quota must fail: {out}"
    );
    let (ok, out) = w.exec(&name_a, &["/work/shim_client", "hold", "128"]);
    assert!(ok && out.contains("holding"), "within quota: {out}");

    // No double booking: A and B hold 12 of the GPU's 160 memory units; a
    // request for 150 fits only if the restarted manager forgot them.
    // (Allocate waits for a just-created pod to reach the manager.)
    let e = env.pod(&[("main", 10, 150)], &[]);
    let err = env.direct_allocate(90..100).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    env.api.delete_pod(&e.namespace, &e.name).unwrap();

    // Docker socket missing: degraded (logged), nothing released.
    let before = env.allocations_by_container();
    kill9_and_restart(
        &mut env,
        &[
            "--container-runtime-endpoint",
            "unix:///nonexistent/docker.sock",
        ],
    )
    .await;
    let log = env.log_text();
    assert!(log.contains("recovery: source unreachable"), "{log}");
    assert_eq!(env.allocations_by_container(), before);

    // Corrupt checkpoint: set aside, A and B rebuilt from Docker, kubelet
    // and their vm directories.
    let cp = env.checkpoint_dir();
    let args = argv(&env);
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    // Both slots damaged (one alone would be ignored for the other).
    for slot in gpu_manager::world::checkpoint::SLOT_FILES {
        std::fs::write(cp.join(slot), b"vcuda-checkpoint v2 gen=0000").unwrap();
    }
    // Back to the test's engine: the nonexistent endpoint appended last goes
    // (the first --container-runtime-endpoint, the engine's, stays).
    let mut args = args;
    if args.last().is_some_and(|a| a.contains("nonexistent")) {
        args.truncate(args.len() - 2);
    }
    respawn(&mut env, &args, &[]).await;
    let log = env.log_text();
    assert!(log.contains("checkpoint is unreadable; set aside"), "{log}");
    let rebuilt = env.allocations_by_container();
    for p in [&a, &b] {
        let id = format!("{}/main", p.uid);
        let (x, y) = (&rebuilt[&id], &before[&id]);
        for k in [
            "placement",
            "cores",
            "memory_units",
            "vcore_ids",
            "pod_name",
        ] {
            assert_eq!(x[k], y[k], "{id} {k} rebuilt");
        }
    }
    assert!(
        std::fs::read_dir(&cp)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains(".corrupt-")),
        "the corrupt checkpoint is kept aside"
    );
}

/// A container name unique per test run.
fn cname(pod: &PodRef, container: &str) -> String {
    format!("vcuda-rec-{}-{}-{container}", std::process::id(), pod.uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_during_load_loses_no_allocation() {
    let mut env = Env::start("sim-4gpu-pcie", Options::default()).await;
    let kubelet = env.kubelet.clone();
    let restarter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        kubelet.restart().await.unwrap();
    });
    let mut admitted = 0;
    let mut failed = 0;
    let t = Instant::now();
    while admitted < 16 {
        // An admission in the restart window fails (plugin not connected);
        // kubelet fails such a pod, and it is created again.
        let p = env.pod(&[("main", 10, 2)], &[]);
        match env.admit(&p, "main", 10, 2).await {
            Ok(_) => admitted += 1,
            Err(e) => {
                failed += 1;
                assert!(t.elapsed() < Duration::from_secs(60), "{e}");
                env.api.delete_pod(&p.namespace, &p.name).unwrap();
                env.kubelet.release_pod(&p.uid).unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    eprintln!("admitted {admitted}, {failed} refused during the restart");
    restarter.await.unwrap();
    assert_eq!(env.kubelet.view().borrow().restarts, 1);
    env.wait_registered().await;
    tokio::time::sleep(Duration::from_secs(3)).await; // two periodic checks
    let mine = env.allocations_by_container();
    assert_eq!(mine.len(), admitted, "manager lost an allocation");
    let held: std::collections::BTreeSet<String> = env
        .kubelet
        .allocations()
        .into_iter()
        .filter(|e| e.resource_name == manager::VCORE)
        .map(|e| format!("{}/{}", e.pod_uid, e.container_name))
        .collect();
    assert_eq!(
        held,
        mine.keys().cloned().collect(),
        "kubelet and manager agree"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_checkpoint_dir_refuses_allocate_and_keeps_the_previous_file() {
    if !test_support::is_root() {
        test_support::missing(Capability::Root, "needs root for a read-only bind mount");
        return;
    }
    let mut env = Env::start("sim-1gpu", Options::default()).await;
    let a = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&a, "main", 30, 4).await.unwrap();
    // The lazy write (vcuda-memory IDs, verified) lands first.
    env.settled_checkpoint().await;
    let dir = env.checkpoint_dir();
    let slots = || {
        gpu_manager::world::checkpoint::SLOT_FILES
            .map(|f| std::fs::read(dir.join(f)).unwrap_or_default())
    };
    let before = slots();
    let recorded = env.checkpoint();
    let d = dir.display().to_string();
    let mount = |args: &[&str]| {
        let st = Command::new("mount").args(args).status().unwrap();
        assert!(st.success(), "mount {args:?}");
    };
    mount(&["--bind", &d, &d]);
    mount(&["-o", "remount,ro,bind", &d]);
    let b = env.pod(&[("main", 30, 4)], &[]);
    let err = env.admit(&b, "main", 30, 4).await.unwrap_err().to_string();
    let _ = Command::new("umount").arg(&d).status();
    assert!(
        err.contains("recording the allocation durably failed"),
        "{err}"
    );
    assert!(err.contains("previous checkpoint is intact"), "{err}");
    assert_eq!(slots(), before, "neither slot written");
    assert_eq!(env.checkpoint(), recorded);
    assert!(
        !env.vm_dir().join(&b.uid).exists(),
        "the refused allocation is undone"
    );
    assert!(
        env.log_text()
            .contains("writing the allocation checkpoint failed")
    );
    // Writable again: the next admission works and is recorded.
    env.admit(&b, "main", 30, 4).await.unwrap();
    assert_eq!(env.allocation_count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_pod_is_released_by_the_watch_not_the_next_allocate() {
    let mut env = Env::start("sim-1gpu", Options::default()).await;
    let a = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&a, "main", 30, 4).await.unwrap();
    let t = Instant::now();
    env.api.delete_pod(&a.namespace, &a.name).unwrap();
    let dir = env.vm_dir().join(&a.uid);
    while (dir.exists() || env.allocation_count() > 0) && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!dir.exists());
    assert_eq!(env.allocation_count(), 0);
    assert!(env.log_text().contains("pod is gone"));
    // Well before a periodic check would have (period 1 s in these tests,
    // but the watch answers in milliseconds).
    eprintln!("released {:?} after the delete", t.elapsed());
    let _ = GIB;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_checkpoint_of_an_earlier_version_is_migrated() {
    use gpu_manager::world::checkpoint::{CHECKPOINT_FILE, SLOT_FILES};
    let mut env = Env::start("sim-1gpu", Options::default()).await;
    let a = env.pod(&[("main", 30, 4)], &[]);
    env.admit(&a, "main", 30, 4).await.unwrap();
    // The lazy write (vcuda-memory IDs, verified) lands first.
    env.settled_checkpoint().await;
    let args = argv(&env);
    // SAFETY: SIGKILL to our own child, not yet reaped.
    unsafe { libc::kill(env.manager.id() as i32, libc::SIGKILL) };
    let _ = env.manager.wait();
    let before = env.allocations_by_container();
    assert_eq!(before.len(), 1);
    // As earlier versions wrote it: one JSON file, no slot files.
    let dir = env.checkpoint_dir();
    let mut old = env.checkpoint();
    old["version"] = 1.into();
    for s in SLOT_FILES {
        let _ = std::fs::remove_file(dir.join(s));
    }
    std::fs::write(dir.join(CHECKPOINT_FILE), serde_json::to_vec(&old).unwrap()).unwrap();
    respawn(&mut env, &args, &[]).await;
    assert_eq!(
        env.allocations_by_container(),
        before,
        "allocation kept across the migration"
    );
    assert!(dir.join(SLOT_FILES[0]).is_file());
    assert!(!dir.join(CHECKPOINT_FILE).exists(), "old file removed");
    assert!(env.log_text().contains("checkpoint migrated to slot files"));
}
