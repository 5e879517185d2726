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
        interposer: Some(shim),
        display: Some(dra_driver::daemon::DisplayAt {
            socket: dirs.p("display.sock"),
            http: node_agent::config::Listeners {
                query: "127.0.0.1:0".parse().unwrap(),
                health: None,
                metrics: None,
            },
        }),
        ..sim_settings(sim, dirs)
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
    // A 1.37 kubelet opens the stream only when the registration lists
    // it, and takes v1; 1.31-1.36 open v1alpha1 unasked. Both answer.
    assert_eq!(
        kubelet.health_service,
        Some(dra_api::dra_health::v1::SERVICE)
    );
    let first_v1 = tokio::time::timeout(Duration::from_secs(30), async {
        let mut s = kubelet.watch_health_v1().await.unwrap();
        s.message().await.unwrap().unwrap()
    })
    .await
    .expect("a v1 health message within 30 s");
    let d = &first_v1.devices[0];
    assert_eq!(d.device.as_ref().unwrap().device_name, "gpu-0");
    assert_eq!(
        d.health,
        dra_api::dra_health::v1::HealthStatus::Healthy as i32
    );
    let mut health = kubelet.watch_health().await.unwrap();
    let next_health = async |s: &mut tonic::Streaming<_>| -> (i32, String) {
        let m: dra_api::dra_health::v1alpha1::NodeWatchResourcesResponse =
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
    use dra_api::dra_health::v1alpha1::HealthStatus;
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

/// The simulated H100 node with GPU 0 in MIG mode holding a 3g.40gb and a
/// 1g.10gb instance (`nvidia-smi mig -cgi 9,19 -C`), the driver running
/// and registered, its slice published.
struct MigNode {
    server: ApiServer,
    dirs: Dirs,
    sim: PathBuf,
    cancel: CancellationToken,
    daemon: tokio::task::JoinHandle<anyhow::Result<()>>,
    kubelet: plugin::DraPlugin,
    /// The published devices, by name.
    devices: HashMap<String, serde_json::Value>,
}

async fn mig_node() -> MigNode {
    let gpu_sim = artifact("gpu-sim");
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    let sim = install(&gpu_sim, "sim-mig-h100", &dirs);
    sh(Command::new(&gpu_sim)
        .args(["mig", "--root"])
        .arg(&sim)
        .args(["--gpu", "0", "--enable", "--create", "9,19"]));
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let (cancel, daemon, _) = start(settings(&sim, &dirs, artifact("libvcuda.so"))).await;
    let kubelet =
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
    let devices = s["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["name"].as_str().unwrap().to_string(), d.clone()))
        .collect();
    MigNode {
        server,
        dirs,
        sim,
        cancel,
        daemon,
        kubelet,
        devices,
    }
}

/// The published MIG device of `profile` on GPU 0: its name and attributes.
fn mig_device<'a>(n: &'a MigNode, profile: &str) -> (&'a str, &'a serde_json::Value) {
    let (name, d) = n
        .devices
        .iter()
        .find(|(_, d)| d["attributes"]["profile"]["string"] == profile)
        .unwrap_or_else(|| panic!("no {profile} device in {:?}", n.devices.keys()));
    (name, &d["attributes"])
}

/// SMs and memory of the H100 80GB profiles, from NVIDIA's MIG user guide
/// (`nvidia-smi mig -lgip` on an H100 80GB: 3g.40gb 60 SMs, 39.50 GiB;
/// 1g.10gb 16 SMs, 9.75 GiB), not from the simulator's tables.
const H100_PROFILES: [(&str, u64, i64); 2] = [("3g.40gb", 40448, 60), ("1g.10gb", 9984, 16)];

/// Issue 36: a GPU in MIG mode (GPU 0 of the simulated H100 node) is no
/// share or whole device (its SMs and memory are its instances'), but each
/// of its MIG devices is a device, with its profile, memory and SMs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_in_mig_mode_publishes_its_mig_devices() {
    let n = mig_node().await;
    let mut names: Vec<&str> = n.devices.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(
        names.contains(&"gpu-1") && !names.contains(&"gpu-0"),
        "{names:?}"
    );
    let gpu1 = &n.devices["gpu-1"];
    assert_eq!(gpu1["attributes"]["type"]["string"], "gpu");
    assert_eq!(gpu1["allowMultipleAllocations"], true);
    for (profile, mib, sms) in H100_PROFILES {
        let (name, a) = mig_device(&n, profile);
        let (gi, ci) = (
            a["gpuInstance"]["int"].as_i64().unwrap(),
            a["computeInstance"]["int"].as_i64().unwrap(),
        );
        assert_eq!(name, format!("gpu-0-mig-{gi}-{ci}"));
        assert_eq!(a["type"]["string"], "mig");
        assert_eq!(a["multiprocessors"]["int"], sms, "{profile}");
        assert_eq!(a["parentIndex"]["int"], 0);
        assert_eq!(
            a["parentUUID"]["string"],
            "GPU-2c9f6a41-7b3e-5d08-a1c4-8e0f3b6d9a21"
        );
        assert!(
            a["uuid"]["string"].as_str().unwrap().starts_with("MIG-"),
            "{a}"
        );
        assert_eq!(a["model"]["string"], "NVIDIA H100 80GB HBM3");
        let d = &n.devices[name];
        assert_eq!(d["capacity"]["memory"]["value"], format!("{mib}Mi"));
        // Taken whole by default; shares inside it ask for less.
        assert_eq!(d["allowMultipleAllocations"], true, "{d}");
        assert_eq!(d["capacity"]["cores"]["value"], "100", "{d}");
        let default = &d["capacity"]["memory"]["requestPolicy"]["default"];
        assert_eq!(default, &format!("{mib}Mi"), "{d}");
    }
    n.cancel.cancel();
    n.daemon.await.unwrap().unwrap();
}

/// The minor in one of the driver's capability files (`DeviceFileMinor:`).
fn cap_minor(path: &Path) -> u32 {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .unwrap_or_else(|| panic!("{}: {text}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

/// What the CDI edits give a program, without a mount namespace: the env,
/// container mount paths mapped to their host paths.
fn mig_env(edits: &serde_json::Value) -> Vec<(String, String)> {
    let mounts: Vec<(&str, &str)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap(),
                m["hostPath"].as_str().unwrap(),
            )
        })
        .collect();
    edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            let v = mounts
                .iter()
                .fold(v.to_string(), |v, (c, h)| match v.strip_prefix(c) {
                    Some(rest) => format!("{h}{rest}"),
                    None => v,
                });
            (k.to_string(), v)
        })
        .collect()
}

/// Issue 36: claims for the 3g.40gb and the 1g.10gb devices (the MIG class,
/// a selector on `profile`) are prepared through the kubelet: each CDI spec
/// gives the parent GPU's node and the instance's two capability nodes,
/// NVIDIA_VISIBLE_DEVICES=MIG-…, the untouched driver and nothing else; a
/// CUDA program run with it sees exactly the instance. Unprepare removes
/// the spec and leaves the instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_for_mig_devices_get_the_instance_and_the_untouched_driver() {
    let n = mig_node().await;
    let prog = n.dirs.p("sim_cuda");
    sh(Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&prog)
        .arg(workspace().join("tests/c/sim_cuda.c"))
        .arg("-I")
        .arg(workspace().join("tests/c"))
        .arg("-L")
        .arg(n.sim.join("usr/lib/x86_64-linux-gnu"))
        .args(["-lcuda", "-ldl", "-lpthread"]));
    let mut claims = Vec::new();
    for (profile, mib, sms) in H100_PROFILES {
        let (device, attrs) = mig_device(&n, profile);
        let (mig_uuid, gi, ci) = (
            attrs["uuid"]["string"].as_str().unwrap(),
            attrs["gpuInstance"]["int"].as_u64().unwrap(),
            attrs["computeInstance"]["int"].as_u64().unwrap(),
        );
        let name = format!("mig-{}", profile.replace('.', "-"));
        let c = mig_claim(&n.server, &name, profile);
        let a = allocator::allocate(&n.server, NS, &name, NODE).unwrap();
        assert_eq!(a["devices"]["results"][0]["device"], device);
        let claim = plugin::claim(NS, &name, &uid(&c));
        let r = n
            .kubelet
            .prepare(std::slice::from_ref(&claim))
            .await
            .unwrap();
        let one = &r.claims[&claim.uid];
        assert_eq!(one.error, "");
        let id = &one.devices[0].cdi_device_ids[0];
        let edits = cdi::resolve(&n.dirs.p("cdi"), id).unwrap();

        // The parent's node and the two access nodes. Their minors are in
        // the driver's capability files (the sim writes them under its
        // root), and follow open-gpu-kernel-modules' nv-caps.c table:
        // 3 + 135 × GPU minor + 9 × GI, and the CI's 1 + CI above it.
        let caps = n
            .sim
            .join(format!("proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}"));
        let (gi_minor, ci_minor) = (
            cap_minor(&caps.join("access")),
            cap_minor(&caps.join(format!("ci{ci}/access"))),
        );
        assert_eq!(
            (u64::from(gi_minor), u64::from(ci_minor)),
            (3 + 9 * gi, 3 + 9 * gi + 1 + ci)
        );
        let nodes: Vec<&str> = edits["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["path"].as_str().unwrap())
            .collect();
        let cap = |m: u32| format!("/dev/nvidia-caps/nvidia-cap{m}");
        let mut want = vec![
            "/dev/nvidia0".to_string(),
            cap(gi_minor),
            cap(ci_minor),
            "/dev/nvidiactl".into(),
            "/dev/nvidia-uvm".into(),
        ];
        let mut got: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want, "{edits}");
        // The untouched driver, nothing of vcuda's.
        let mounts: Vec<(&str, &str)> = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["hostPath"].as_str().unwrap(),
                    m["containerPath"].as_str().unwrap(),
                )
            })
            .collect();
        let origin = n.sim.join("vdriver/origin");
        assert_eq!(
            mounts,
            [(origin.to_str().unwrap(), "/usr/local/nvidia")],
            "{edits}"
        );
        assert!(!n.dirs.p("vm").join(&claim.uid).exists());
        let env = mig_env(&edits);
        assert!(
            env.contains(&("NVIDIA_VISIBLE_DEVICES".into(), mig_uuid.into())),
            "{env:?}"
        );

        // NVIDIA's runtime exposes the instance as CUDA_VISIBLE_DEVICES.
        let out = sh(Command::new(&prog)
            .arg("info")
            .envs(env.iter().cloned())
            .env("CUDA_VISIBLE_DEVICES", mig_uuid));
        let r = kv_lines(&out);
        assert_eq!(r["count"], "1", "{out}");
        assert_eq!(r["dev0.total_mib"], mib.to_string(), "{profile}: {out}");
        assert_eq!(r["total_mib"], mib.to_string(), "cuMemGetInfo: {out}");
        assert_eq!(r["dev0.sms"], sms.to_string(), "{profile}: {out}");
        // cuDeviceGetUuid gives the MIG device's 16 bytes (the program
        // prints them GPU-style).
        assert_eq!(
            r["dev0.uuid"].trim_start_matches("GPU-"),
            mig_uuid.trim_start_matches("MIG-"),
            "{out}"
        );
        claims.push((claim, mig_uuid.to_string()));
    }

    // Deleting the pods: the specs go, the instances stay.
    let refs: Vec<_> = claims.iter().map(|(c, _)| c.clone()).collect();
    let u = n.kubelet.unprepare(&refs).await.unwrap();
    for (c, _) in &claims {
        assert_eq!(u.claims[&c.uid].error, "");
        assert!(!dra_driver::cdi::spec_path(&n.dirs.p("cdi"), &c.uid).exists());
    }
    let listed = sh(Command::new(n.sim.join("usr/bin/nvidia-smi"))
        .arg("-L")
        .env("LD_LIBRARY_PATH", n.sim.join("usr/lib/x86_64-linux-gnu")));
    for (_, mig_uuid) in &claims {
        assert!(listed.contains(mig_uuid.as_str()), "{listed}");
    }
    n.cancel.cancel();
    n.daemon.await.unwrap().unwrap();
}

/// `key=value` lines (values may hold spaces).
fn kv_lines(out: &str) -> HashMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
