//! A hostile process in a share container of the real manager (the
//! `gpu-manager` binary, supervised, on a simulated node): it registers as
//! its own container's process, as any program there can, then truncates,
//! grows and writes the ledger it was handed, holds 1,000 registrations
//! with maximal requests and sends garbage and slow frames. The manager
//! stays the same process and keeps answering, its RSS stays bounded, and
//! the quotas hold: the hostile container's for its ordinary processes
//! (also with `VCUDA_CONFIG_DIR` pointed at a copied config that turns
//! enforcement off), the other share's beside it. Needs root (a mount
//! namespace for the container's `/etc/vcuda`) and `cargo build
//! --workspace` first.
//!
//! And a process of the share that loads the real driver beside the
//! interposer: the manager's escape guard reports it within a sampling
//! period, and ends it under `--escape-policy kill`; and a share whose
//! ledger counters were zeroed, so that its processes hold more than its
//! quota: under `kill` its largest process is ended.

use std::time::Instant;

use test_support::hostile::{self, assert_held, children_of, quota_run, rss_kib};
use test_support::manager::{Env, Options, container_env};
use test_support::{Capability, compile_c, http_get, require};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_share_cannot_harm_the_manager_nor_lift_its_quota() {
    if !require(Capability::Root) {
        return;
    }
    let mut env = Env::start("sim-4gpu-pcie", with_interposer(&[])).await;
    let sup = env.manager.id() as i32;
    let child = children_of(sup);
    assert_eq!(child.len(), 1, "the supervisor's one child: {child:?}");
    let child = child[0];

    let hostile = env.pod(&[("main", 30, 4)], &[]);
    let rh = env.admit(&hostile, "main", 30, 4).await.unwrap();
    let victim = env.pod(&[("main", 30, 4)], &[]);
    let rv = env.admit(&victim, "main", 30, 4).await.unwrap();
    let vcore = test_support::manager::VCORE;
    assert_eq!(Env::minors(&rh), Env::minors(&rv), "both shares on one GPU");
    let dir = env.vm_dir().join(&hostile.uid).join("main");
    let req = hostile::maximal_request(&hostile.uid, "main");

    // The ledger descriptor: no resize takes, the quota word is written.
    let (conn, resp, fds) = hostile::register(&dir, &req);
    assert_eq!(resp.status, 1, "accepted: {resp:?}");
    assert_eq!(fds.len(), 1);
    let r = hostile::resize(&fds[0]);
    assert_eq!(r.truncate, Err(libc::EPERM), "{r:?}");
    assert_eq!(r.grow, Err(libc::EPERM), "{r:?}");
    assert_eq!(r.fallocate, Err(libc::EPERM), "{r:?}");
    assert_eq!(r.len_after, container_ledger::FILE_SIZE as u64);
    hostile::scribble(&fds[0]);
    // One process holds at most 4 registrations.
    let more: Vec<_> = (0..3).map(|_| hostile::register(&dir, &req)).collect();
    assert!(more.iter().all(|(_, r, _)| r.status == 1));
    let (_, refused, _) = hostile::register(&dir, &req);
    assert_eq!(refused.status, 2, "{refused:?}");
    assert!(
        refused.message.contains("already holds 4 registrations"),
        "{refused:?}"
    );
    assert!(
        !dir.join(container_ledger::LEDGER_FILE).exists(),
        "no ledger file on the host to grow"
    );

    // 1,000 registrations held (250 processes x 4), garbage, slow frames.
    let addr = env.http_addr;
    let rss0 = rss_kib(child);
    let t0 = Instant::now();
    let held = tokio::task::block_in_place(|| hostile::hold_registrations(&dir, &req, 250));
    let slow = tokio::task::block_in_place(|| hostile::garbage(&dir, &req, 300));
    let attack = t0.elapsed();
    let (code, metrics) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .unwrap();
    assert_eq!(code, 200, "{metrics}");
    assert!(
        metrics.contains(&hostile.name),
        "the hostile pod is still listed"
    );
    let rss1 = rss_kib(child);
    println!(
        "manager RSS {rss0} KiB before, {rss1} KiB holding 1,000 registrations, 300 slow and 600 garbage connections (attack took {:.1} s)",
        attack.as_secs_f64()
    );
    assert!(
        rss1 < rss0 + 64 * 1024,
        "RSS grew from {rss0} to {rss1} KiB"
    );
    drop((held, slow, conn, fds, more));
    assert_eq!(children_of(sup), vec![child], "the same manager child");

    // The quotas hold for ordinary processes, whatever the environment.
    let tmp = tempfile::tempdir().unwrap();
    let client = compile_c("shim_client", &env.sim, tmp.path());
    let copied = tmp.path().join("copied");
    std::fs::create_dir(&copied).unwrap();
    let mut off = quota_config::read_quota(&dir).unwrap();
    if let quota_config::Quota::Single(d) = &mut off {
        d.enable = false;
        d.gpu_memory = 64 << 30;
        std::fs::write(
            copied.join(quota_config::CONFIG_FILE),
            d.to_bytes().unwrap(),
        )
        .unwrap();
    }
    let sim_root = env.sim_root().to_path_buf();
    let (eh, ev) = (container_env(&rh[vcore]), container_env(&rv[vcore]));
    tokio::task::block_in_place(|| {
        assert_held(
            &quota_run(&client, &eh, &sim_root, &[]),
            1024 * MIB,
            "hostile share",
        );
        let out = quota_run(
            &client,
            &eh,
            &sim_root,
            &[("VCUDA_CONFIG_DIR", copied.to_str().unwrap())],
        );
        assert_held(
            &out,
            1024 * MIB,
            "hostile share, VCUDA_CONFIG_DIR at a copied config",
        );
        assert_held(
            &quota_run(&client, &ev, &sim_root, &[]),
            1024 * MIB,
            "the other share",
        );
    });
    // An NVML-only tool in the hostile share reads its container's use
    // from the live ledger (found by the recorded inode, not the other
    // share's ledger of the same name) while a CUDA process holds 512 MiB.
    let entry = compile_c("shim_entry", &env.sim, tmp.path());
    let (total, used) = tokio::task::block_in_place(|| {
        let mut holder = holding(hostile::in_share(&client, &eh, &sim_root, &[]));
        let out = hostile::in_share(&entry, &eh, &sim_root, &[])
            .arg("nvmlonly")
            .output()
            .unwrap();
        let _ = holder.kill();
        let _ = holder.wait();
        let r = test_support::kv(&String::from_utf8_lossy(&out.stdout));
        (
            r["total"].parse::<u64>().unwrap(),
            r["used"].parse::<u64>().unwrap(),
        )
    });
    assert_eq!(total, 1024 * MIB);
    assert!((512 * MIB..1024 * MIB).contains(&used), "used {used}");
    assert_eq!(children_of(sup), vec![child], "the same manager child");
    let (code, _) = tokio::task::spawn_blocking(move || http_get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!(code, 200);
}

/// A process of the share that loads the real driver beside the
/// interposer (by path, through its own `libcuda.so.1`): with `policy`,
/// the manager's guard reports it within a sampling period (1 s here)
/// and, under `kill`, ends it. Returns (seconds to the report, whether
/// the process was ended).
async fn bypass_under(policy: &str) -> (f64, bool) {
    let OneShare {
        env,
        pod,
        e,
        client,
        tmp,
        ..
    } = OneShare::start(&["--escape-policy", policy]).await;
    let bypass = hostile::real_driver_dir(&e, tmp.path());
    let lib = e
        .iter()
        .find(|(k, _)| k == "LD_LIBRARY_PATH")
        .unwrap()
        .1
        .clone();
    let path = format!("{}:{lib}", bypass.display());
    let mut p = holding(hostile::in_share(
        &client,
        &e,
        env.sim_root(),
        &[("LD_LIBRARY_PATH", &path)],
    ));
    let t0 = Instant::now();
    let addr = env.http_addr;
    let series = format!(
        "vcuda_container_escapes_total{{container=\"main\",namespace=\"default\",pod=\"{}\",reason=\"unregistered_process\"}} 1",
        pod.name
    );
    loop {
        let (_, m) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
            .await
            .unwrap();
        if m.contains(&series) {
            break;
        }
        assert!(
            t0.elapsed().as_secs() < 10,
            "no {series} after 10 s; log:\n{}",
            env.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let reported = t0.elapsed().as_secs_f64();
    let log = env
        .wait_log("without the vcuda interposer: it never registered", 1)
        .await;
    // unshare and sh exec: the PID NVML reports is the one spawned.
    assert!(
        log.contains(&format!("process {} uses the GPU", p.id())),
        "{log}"
    );
    let t1 = Instant::now();
    let mut ended = false;
    while t1.elapsed().as_secs() < 3 {
        if p.try_wait().unwrap().is_some() {
            ended = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = p.kill();
    let _ = p.wait();
    (reported, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_bypasses_the_interposer_is_reported() {
    if !require(Capability::Root) {
        return;
    }
    let (secs, ended) = bypass_under("report").await;
    println!("escape reported {secs:.2} s after the process held its memory (sample period 1 s)");
    assert!(!ended, "report never ends the process");
    // Within one sample period (1 s) of the next sample, and this test's
    // 50 ms poll of /metrics: 0.24-0.40 s on an idle machine.
    assert!(
        secs < BYPASS_SEEN_S,
        "reported after {secs:.2} s: more than a sample period late"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_bypasses_the_interposer_is_ended_under_kill() {
    if !require(Capability::Root) {
        return;
    }
    let (secs, ended) = bypass_under("kill").await;
    println!("escape reported and ended {secs:.2} s after the process held its memory");
    assert!(ended, "the kill policy ended the process");
    assert!(
        secs < BYPASS_SEEN_S,
        "reported and ended after {secs:.2} s: more than a sample period late"
    );
}

/// How late a bypass may be seen: the guard's sample period (1 s) and as
/// much again for a loaded 2-core machine's scheduling and the poll.
const BYPASS_SEEN_S: f64 = 2.0;

/// A share (1 GiB) holding 512 MiB in one process zeroes its ledger's use
/// counters, and a second process then holds 600 MiB more: NVML counts
/// the share past its quota, the guard reports it within a sampling
/// period (1 s), and under `kill` ends the larger process; the first one
/// lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_over_its_quota_loses_its_largest_process_under_kill() {
    if !require(Capability::Root) {
        return;
    }
    let share = OneShare::start(&["--escape-policy", "kill"]).await;
    let (mut first, mut second) = tokio::task::block_in_place(|| {
        let first = holding(share.in_share());
        let req = hostile::maximal_request(&share.pod.uid, "main");
        let (_conn, _, fds) = hostile::register(&share.dir(), &req);
        hostile::zero_counters(&fds[0]);
        (first, hostile::holding_mib(share.in_share(), 600))
    });
    let (env, pod) = (&share.env, &share.pod);
    let t0 = Instant::now();
    let addr = env.http_addr;
    let series = format!(
        "vcuda_container_escapes_total{{container=\"main\",namespace=\"default\",pod=\"{}\",reason=\"over_memory_quota\"}} 1",
        pod.name
    );
    let mut ended = None;
    while t0.elapsed().as_secs() < 10 {
        let (_, m) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
            .await
            .unwrap();
        if m.contains(&series) && second.try_wait().unwrap().is_some() {
            ended = Some(t0.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let alive = first.try_wait().unwrap().is_none();
    let _ = (first.kill(), second.kill());
    let _ = (first.wait(), second.wait());
    let secs = ended.unwrap_or_else(|| {
        panic!(
            "no {series} with the 600 MiB process ended after 10 s; log:\n{}",
            env.log_text()
        )
    });
    println!(
        "over quota: reported and the largest process ended {secs:.2} s after it held its memory"
    );
    assert!(alive, "the smaller process was ended too");
    assert!(
        secs < BYPASS_SEEN_S,
        "over quota: reported and ended after {secs:.2} s: more than a sample period late"
    );
    let log = env
        .wait_log("over its 1024 MiB quota (the largest: process", 1)
        .await;
    assert!(log.contains("escape policy kill"), "{log}");
}

/// The manager's options with the interposer mirrored, plus `extra` flags.
/// A process that dies while no manager runs (the supervisor's child
/// stopped, then killed: nobody watched its connection close) leaves its
/// ledger slot holding its 512 MiB; the next manager, taking the ledger
/// back from the share's live process, clears that slot at its start, so
/// a new process of the share may allocate what one could before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_of_a_process_that_died_while_no_manager_ran_is_cleared_at_start() {
    if !require(Capability::Root) {
        return;
    }
    // (`tmp` holds the client's build: kept to the end.)
    let OneShare {
        env,
        e,
        client,
        sim_root,
        tmp: _tmp,
        ..
    } = OneShare::start(&[]).await;
    let sup = env.manager.id() as i32;
    let allocated = |out: &str| test_support::kv(out)["allocated"].parse::<u64>().unwrap();
    // A live process keeps the ledger (its memfd) for the next manager to
    // take back; with none, the next one starts a new ledger.
    let (mut keeper, before, mut holder) = tokio::task::block_in_place(|| {
        let keeper = hostile::holding_mib(hostile::in_share(&client, &e, &sim_root, &[]), 64);
        let before = allocated(&quota_run(&client, &e, &sim_root, &[]));
        let holder = holding(hostile::in_share(&client, &e, &sim_root, &[]));
        (keeper, before, holder)
    });
    let child = children_of(sup);
    assert_eq!(child.len(), 1, "{child:?}");
    // SAFETY: signals processes this test started (the supervisor's child
    // and the share's client).
    unsafe {
        libc::kill(child[0], libc::SIGSTOP);
        libc::kill(holder.id() as i32, libc::SIGKILL);
    }
    let _ = holder.wait();
    // SAFETY: as above.
    unsafe { libc::kill(child[0], libc::SIGKILL) };
    env.wait_log("registered with kubelet; ready", 2).await;
    env.wait_log("ledger slots of dead processes cleared", 1)
        .await;
    assert_ne!(children_of(sup), child, "the next manager");
    let after = tokio::task::block_in_place(|| {
        let out = quota_run(&client, &e, &sim_root, &[]);
        assert_held(&out, 1024 * MIB, "after the restart");
        allocated(&out)
    });
    let _ = (keeper.kill(), keeper.wait());
    assert_eq!(
        after, before,
        "64 MiB blocks before and after: the dead slot's 512 MiB freed"
    );
}

/// A process of a share (1 GiB) holds 600 MiB; the ledger's use counters
/// are zeroed under it (any process of the container can write them), so
/// the ledger says the share holds nothing. Asked for 600 MiB more, the
/// process is refused all the same: the interposer also checks what this
/// process holds by its own count, in its own memory. Before that count
/// was consulted, the allocation went through (the ledger alone said yes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_whose_ledger_was_zeroed_is_still_held_to_the_quota() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::AsFd;
    if !require(Capability::Root) {
        return;
    }
    let share = OneShare::start(&[]).await;
    let (answer, held_before, refused) = tokio::task::block_in_place(|| {
        let mut p = hostile::holding_mib(share.in_share(), 600);
        let req = hostile::maximal_request(&share.pod.uid, "main");
        let (_conn, _, fds) = hostile::register(&share.dir(), &req);
        let ledger = container_ledger::Ledger::from_fd(fds[0].as_fd()).unwrap();
        let held_before = ledger.used();
        hostile::zero_counters(&fds[0]);
        assert_eq!(ledger.used(), 0, "the counters were zeroed");
        let mut stdin = p.stdin.take().unwrap();
        let mut out = BufReader::new(p.stdout.take().unwrap());
        writeln!(stdin, "alloc").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let refused = ledger.refused_allocations();
        drop(stdin);
        let _ = (p.kill(), p.wait());
        (line, held_before, refused)
    });
    assert!(held_before >= 600 * MIB, "the ledger held {held_before}");
    assert_eq!(
        answer.trim(),
        "alloc=2",
        "600 MiB more past a 1 GiB quota, the ledger zeroed: CUDA_ERROR_OUT_OF_MEMORY wanted"
    );
    assert_eq!(refused, 1, "the refusal is counted");
}

/// The manager (with the interposer and `extra` flags) on the simulated
/// 4-GPU node, one pod's share admitted (`main`: 30 %, 1 GiB), and
/// `shim_client` built against the node's driver.
struct OneShare {
    env: Env,
    pod: kubelet_emulator::PodRef,
    /// The share container's environment.
    e: Vec<(String, String)>,
    client: std::path::PathBuf,
    sim_root: std::path::PathBuf,
    tmp: tempfile::TempDir,
}

impl OneShare {
    async fn start(extra: &[&str]) -> OneShare {
        let mut env = Env::start("sim-4gpu-pcie", with_interposer(extra)).await;
        let pod = env.pod(&[("main", 30, 4)], &[]);
        let r = env.admit(&pod, "main", 30, 4).await.unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let client = compile_c("shim_client", &env.sim, tmp.path());
        let e = container_env(&r[test_support::manager::VCORE]);
        let sim_root = env.sim_root().to_path_buf();
        OneShare {
            env,
            pod,
            e,
            client,
            sim_root,
            tmp,
        }
    }

    /// The share's vm directory.
    fn dir(&self) -> std::path::PathBuf {
        self.env.vm_dir().join(&self.pod.uid).join("main")
    }

    /// `shim_client` in the share's container.
    fn in_share(&self) -> std::process::Command {
        hostile::in_share(&self.client, &self.e, &self.sim_root, &[])
    }
}

fn with_interposer(extra: &[&str]) -> Options {
    let mut extra_args: Vec<std::ffi::OsString> = vec![
        "--interposer".into(),
        test_support::target_dir().join("libvcuda.so").into(),
    ];
    extra_args.extend(extra.iter().map(Into::into));
    Options {
        extra_args,
        ..Options::default()
    }
}

/// `shim_client … hold 512` spawned from `cmd`, once it holds its memory.
fn holding(cmd: std::process::Command) -> std::process::Child {
    hostile::holding_mib(cmd, 512)
}
