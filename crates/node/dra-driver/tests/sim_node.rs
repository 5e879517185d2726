//! The whole driver (`daemon::run`) on a simulated node (gpu-sim, NVML and
//! Xids included), the interposer mirrored as the shares' libcuda, the API
//! server emulator and the emulated kubelet: two 30 % / 1 GiB claims are
//! packed on the GPU; a C program run with what their CDI specs inject
//! sees 1024 MiB and is refused past it; an Xid takes the GPU out of the
//! slice (generation bump) and the quiet period brings it back; deleting
//! the pod (unprepare) releases the claim. Prints claim-to-running latency.
//!
//! Needs `cargo build --workspace` first (gpu-sim, its cdylibs, libvcuda.so).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use apiserver_emulator::{ApiServer, Kind};
use dra_driver::daemon::{Settings, run};
use dra_driver::slices;
use dra_kubelet_emulator::{allocator, cdi, plugin};
use test_support::dra::*;
use tokio_util::sync::CancellationToken;

const MIB: u64 = 1 << 20;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

/// `target/<profile>` of this test binary (`target/<profile>/deps/...`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn artifact(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.is_file(),
        "{} missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn kv(out: &str) -> HashMap<String, String> {
    out.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn slice_generation(server: &ApiServer) -> Option<(i64, usize)> {
    let s = server.get(Kind::ResourceSlice, None, &slices::slice_name(NODE))?;
    Some((
        s["spec"]["pool"]["generation"].as_i64()?,
        s["spec"]["devices"].as_array()?.len(),
    ))
}

/// The value of the first device's unhealthy taint.
fn taint(server: &ApiServer) -> Option<String> {
    let s = server.get(Kind::ResourceSlice, None, &slices::slice_name(NODE))?;
    let t = &s["spec"]["devices"][0]["taints"][0];
    (t["key"] == slices::UNHEALTHY_TAINT && t["effect"] == "NoSchedule")
        .then(|| t["value"].as_str().unwrap_or_default().to_string())
}

/// The driver started on `settings`, once its sockets are served.
async fn start(
    settings: Settings,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<anyhow::Result<()>>,
    dra_driver::daemon::Ready,
) {
    let cancel = CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(run(settings, cancel.clone(), Some(tx)));
    let ready = tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .expect("the driver served its sockets within 60 s")
        .expect("the driver said it was ready");
    (cancel, daemon, ready)
}

/// `config/nodes/<node>.toml` installed at `dirs`' `sim`: its root.
fn install(gpu_sim: &Path, node: &str, dirs: &Dirs) -> PathBuf {
    let sim = dirs.p("sim");
    sh(Command::new(gpu_sim)
        .args(["install", "--node"])
        .arg(workspace().join(format!("config/nodes/{node}.toml")))
        .arg("--root")
        .arg(&sim));
    sim
}

/// The driver's settings on the simulated node at `sim`, its directories
/// in `dirs`.
fn settings(sim: &Path, dirs: &Dirs, shim: PathBuf) -> Settings {
    Settings {
        node: NODE.into(),
        host_root: sim.to_path_buf(),
        nvml_library: None,
        volume_config: workspace().join("config/volume.conf"),
        interposer: Some(shim),
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
        display: Some((dirs.p("display.sock"), "127.0.0.1:0".parse().unwrap())),
        sample_period: Duration::from_secs(1),
        escape_policy: gpu_display::guard::Policy::Report,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_on_a_simulated_node_under_the_interposer() {
    let gpu_sim = artifact("gpu-sim");
    let shim = artifact("libvcuda.so");
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let sim = install(&gpu_sim, "sim-1gpu", &dirs);
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let settings = settings(&sim, &dirs, shim);
    let (cancel, daemon, ready) = start(settings.clone()).await;
    let http = ready.display_http.unwrap();
    // Serving but not registered: no slice yet (the scheduler must not send
    // a claim the kubelet cannot prepare), not ready.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(slice_generation(&server), None);
    let readyz = http_get(http, "/readyz").await;
    assert!(readyz.starts_with("HTTP/1.1 503"), "{readyz}");
    let kubelet =
        plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(20), false)
            .await
            .unwrap();
    until(10, "the slice published once registered", || {
        slice_generation(&server) == Some((1, 1))
    })
    .await;
    let t0 = std::time::Instant::now();
    while !http_get(http, "/readyz").await.starts_with("HTTP/1.1 200") {
        assert!(t0.elapsed() < Duration::from_secs(10), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let attrs = &s["spec"]["devices"][0]["attributes"];
    assert_eq!(attrs["model"]["string"], "NVIDIA A100-SXM4-40GB");
    assert_eq!(attrs["driverVersion"]["version"], "580.95.5");
    assert_eq!(
        s["spec"]["devices"][0]["capacity"]["memory"]["value"],
        "40Gi"
    );

    // Two 30 % / 1 GiB claims, packed on the one GPU, prepared; a program
    // in each sees 1024 MiB and is refused past it.
    let client = dirs.p("shim_client");
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&client)
        .arg(workspace().join("tests/c/shim_client.c"))
        .arg("-L")
        .arg(sim.join("usr/lib/x86_64-linux-gnu"))
        .arg("-lcuda"));
    let mut claims = Vec::new();
    for name in ["train-a", "train-b"] {
        let t0 = Instant::now();
        let c = share_claim(&server, name, 30, "1Gi", None);
        let a = allocator::allocate(&server, NS, name, NODE).unwrap();
        assert_eq!(a["devices"]["results"][0]["device"], "gpu-0");
        let claim = plugin::claim(NS, name, &uid(&c));
        let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
        let one = &r.claims[&claim.uid];
        assert_eq!(one.error, "");
        let prepared = t0.elapsed();
        let edits = cdi::resolve(&dirs.p("cdi"), &one.devices[0].cdi_device_ids[0]).unwrap();
        let env = container_env(&edits);
        let out = sh(Command::new(&client)
            .arg("init")
            .envs(env.iter().cloned())
            .env_remove("LOGGER_LEVEL"));
        assert_eq!(kv(&out)["cuInit"], "0");
        println!(
            "claim {name}: claim-to-prepared {:.1} ms, claim-to-running (cuInit answered under the interposer) {:.1} ms",
            prepared.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        let out = sh(Command::new(&client)
            .args(["quota", "64"])
            .envs(env.iter().cloned())
            .env_remove("LOGGER_LEVEL"));
        let r = kv(&out);
        let get = |k: &str| r[k].parse::<u64>().unwrap();
        assert_eq!(
            get("start_total"),
            1024 * MIB,
            "cuMemGetInfo total = the claim's 1 GiB: {out}"
        );
        assert_eq!(get("start_device_total"), 1024 * MIB, "{out}");
        assert_eq!(
            get("last"),
            2,
            "refused past the quota (CUDA_ERROR_OUT_OF_MEMORY): {out}"
        );
        assert!(get("allocated") * 64 * MIB <= get("start_free"), "{out}");
        assert!(get("full_free") < 64 * MIB, "{out}");
        // The program reserved through the ledger the driver passed it over
        // the claim's vcuda.sock, up to the quota and no further.
        let l = test_support::ledger::live(&dirs.p("vm").join(&claim.uid).join("gpu"), 0);
        assert!(
            l.peak() > 1024 * MIB - 64 * MIB && l.peak() <= 1024 * MIB,
            "peak {}",
            l.peak()
        );
        until(10, "the process's slot released", || l.used() == 0).await;
        claims.push(claim);
    }

    // The display lists the claims like containers.
    let usage = http_get(http, "/usage").await;
    for name in ["train-a", "train-b"] {
        assert!(usage.contains(name), "{usage}");
    }
    let metrics = http_get(http, "/metrics").await;
    assert!(metrics.contains("train-a"), "{metrics}");
    let vcudactl = profile_dir().join("vcudactl");
    if vcudactl.is_file() {
        let out = sh(Command::new(&vcudactl)
            .arg("--socket")
            .arg(dirs.p("display.sock"))
            .arg("usage"));
        assert!(
            out.contains("train-a") && out.contains("train-b") && out.contains(NS),
            "{out}"
        );
    }
    let graph = http_get(http, "/graph").await;
    assert!(
        graph.contains("cores 60/100, memory 2048/40960 MiB, 2 claim device(s)"),
        "{graph}"
    );

    // A critical Xid: the GPU is tainted in the slice (generation 2), and
    // the taint goes after the quiet period (generation 3); one slice
    // throughout.
    // The kubelet's health stream says so too, with the reason.
    let mut health = kubelet.watch_health().await.unwrap();
    let next_health = async |s: &mut tonic::Streaming<_>| -> (i32, String) {
        let m: dra_api::dra_health::NodeWatchResourcesResponse =
            tokio::time::timeout(Duration::from_secs(30), s.message())
                .await
                .expect("a health message within 30 s")
                .unwrap()
                .unwrap();
        let d = &m.devices[0];
        assert_eq!(d.device.as_ref().unwrap().pool_name, NODE);
        assert_eq!(d.device.as_ref().unwrap().device_name, "gpu-0");
        (d.health, d.message.clone())
    };
    use dra_api::dra_health::HealthStatus;
    assert_eq!(
        next_health(&mut health).await,
        (HealthStatus::Healthy as i32, String::new())
    );
    sh(Command::new(&gpu_sim)
        .arg("xid")
        .arg("--root")
        .arg(&sim)
        .args(["--gpu", "0", "--code", "79"]));
    until(30, "the GPU tainted in the slice", || {
        slice_generation(&server) == Some((2, 1)) && taint(&server).as_deref() == Some("xid-79")
    })
    .await;
    let (state, why) = next_health(&mut health).await;
    assert_eq!(state, HealthStatus::Unhealthy as i32, "{why}");
    assert!(why.starts_with("critical Xid 79"), "{why}");
    assert_eq!(
        next_health(&mut health).await,
        (HealthStatus::Healthy as i32, String::new()),
        "healthy again after the quiet period"
    );
    until(30, "the GPU's taint gone", || {
        slice_generation(&server) == Some((3, 1)) && taint(&server).is_none()
    })
    .await;
    assert_eq!(server.list(Kind::ResourceSlice).len(), 1);
    // The slice deleted behind the driver's back, as a starting kubelet
    // deletes all of its node's slices: back well before the 60 s resync,
    // above the last generation.
    let t_wipe = Instant::now();
    server
        .delete(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    until(10, "the deleted slice published again", || {
        slice_generation(&server) == Some((4, 1))
    })
    .await;
    println!(
        "slice deleted -> published again: {:.0} ms",
        t_wipe.elapsed().as_secs_f64() * 1e3
    );
    // Prepared claims were not touched by the health change.
    assert!(
        dirs.p("vm")
            .join(&claims[0].uid)
            .join("gpu")
            .join(quota_config::CONFIG_FILE)
            .exists()
    );

    // A driver restart with a process holding 256 MiB of claim B: it
    // registers again with the new driver, keeps its bytes, and the quota
    // still holds (256 more fit, the next 256 do not).
    let env_b = container_env(
        &cdi::resolve(
            &dirs.p("cdi"),
            &format!("vcuda.tencent.com/gpu={}-gpu-gpu-0", claims[1].uid),
        )
        .unwrap(),
    );
    let mut hold = Command::new(&client)
        .args(["hold", "256"])
        .envs(env_b.iter().cloned())
        .env_remove("LOGGER_LEVEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("LOGGER_LEVEL", "3")
        .spawn()
        .unwrap();
    // The interposer's log (info): how the test sees it register again.
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    {
        use std::io::BufRead;
        let (log, err) = (log.clone(), hold.stderr.take().unwrap());
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                log.lock().unwrap().push_str(&(l + "\n"));
            }
        });
    }
    let vm_b = dirs.p("vm").join(&claims[1].uid).join("gpu");
    let ledger_b = test_support::ledger::live(&vm_b, 0);
    until(10, "the held 256 MiB", || ledger_b.used() > 256 * MIB).await;
    let held = ledger_b.used();
    let pid = hold.id() as i32;
    let pids = || {
        std::fs::read(vm_b.join(quota_config::PIDS_FILE))
            .ok()
            .and_then(|b| quota_config::decode_pids(&b).ok())
            .unwrap_or_default()
    };
    assert_eq!(pids(), [pid]);
    cancel.cancel();
    daemon.await.unwrap().unwrap();
    let (cancel, daemon, _) = start(settings).await;
    let kubelet =
        plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(20), false)
            .await
            .unwrap();
    assert_eq!(
        slice_generation(&server),
        Some((4, 1)),
        "a restart on the same GPUs writes no new generation"
    );
    let sock = vm_b.join(quota_config::SOCKET_FILE);
    until(10, "vcuda.sock served again", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .await;
    until(20, "the process registered again", || {
        log.lock().unwrap().contains("re-registered")
    })
    .await;
    assert_eq!(pids(), [pid]);
    assert_eq!(ledger_b.used(), held, "its bytes are still counted");
    {
        use std::io::Write;
        let stdin = hold.stdin.as_mut().unwrap();
        stdin.write_all(b"alloc\nalloc\n").unwrap();
    }
    drop(hold.stdin.take());
    let out = hold.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("alloc=0\nalloc=2"), "{stdout}");
    // Only a process registered with the new driver is released by it on
    // exit (its PID leaves pids.config, its ledger slot is cleared).
    until(10, "the process's bytes released", || {
        ledger_b.used() == 0 && pids().is_empty()
    })
    .await;

    // Deleting the pod: the kubelet unprepares its claim.
    let u = kubelet.unprepare(&claims[..1]).await.unwrap();
    assert_eq!(u.claims[&claims[0].uid].error, "");
    assert!(!dirs.p("vm").join(&claims[0].uid).exists());
    assert!(dirs.p("vm").join(&claims[1].uid).exists());
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// Issue 36: a GPU in MIG mode (GPU 0 of the simulated H100 node, a
/// 3g.40gb instance made as `nvidia-smi mig -cgi 9 -C` would) is not in
/// the slice: its SMs and memory are the instance's, not shares'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_in_mig_mode_is_not_published() {
    let gpu_sim = artifact("gpu-sim");
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let sim = install(&gpu_sim, "sim-mig-h100", &dirs);
    sh(Command::new(&gpu_sim)
        .args(["mig", "--root"])
        .arg(&sim)
        .args(["--gpu", "0", "--enable", "--create", "9"]));
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let (cancel, daemon, _) = start(settings(&sim, &dirs, artifact("libvcuda.so"))).await;
    let _kubelet =
        plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(20), false)
            .await
            .unwrap();
    until(10, "the slice published once registered", || {
        slice_generation(&server).is_some()
    })
    .await;
    let s = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let names: Vec<&str> = s["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpu-1"], "{s}");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}
