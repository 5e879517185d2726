//! `--mig-geometry` in DRA mode (issue 36, static MIG), the whole driver
//! (`daemon::run`) on the simulated H100 node: GPU 0 is in MIG mode with an
//! operator's 1g.10gb, GPU 1 is not in MIG mode. The driver enables GPU 1
//! (idle), makes a 3g.40gb and a 1g.10gb beside the operator's instance
//! and a 2g.20gb on GPU 1, and publishes them (no whole GPU). A claim is
//! prepared on the 2g.20gb; restarted with a geometry that needs its room
//! (a 7g.80gb), the driver destroys nothing ("do not fit") and still
//! publishes it. Its own test binary: it installs the process's log
//! subscriber to read what the driver logged.
//!
//! Needs `cargo build --workspace` first (gpu-sim, its cdylibs, libvcuda.so).

use std::sync::Mutex;

use apiserver_emulator::{ApiServer, Kind};
use dra_driver::daemon::Settings;
use dra_driver::slices;
use dra_kubelet_emulator::{allocator, plugin};
use test_support::dra::*;
use test_support::sim::SimNode;

/// What the driver logged: each event's fields, a line each.
static LOG: Mutex<String> = Mutex::new(String::new());

/// The process's subscriber: INFO and above into [`LOG`], spans ignored.
struct Capture;

impl tracing::Subscriber for Capture {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::INFO
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.push_str(&format!(" {}={v:?}", f.name()));
            }
        }
        let mut line = Line(e.metadata().level().to_string());
        e.record(&mut line);
        LOG.lock().unwrap().push_str(&(line.0 + "\n"));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn settings(sim: &SimNode, dirs: &Dirs, geometry: &str) -> Settings {
    Settings {
        mig_geometry: geometry.parse().unwrap(),
        ..sim_settings(sim.root(), dirs)
    }
}

/// The slice's devices: (name, parent index or the GPU's own for a
/// whole GPU, profile or "gpu", MIG UUID), sorted.
fn published(server: &ApiServer) -> Vec<(String, i64, String, String)> {
    let s = server
        .get(Kind::ResourceSlice, None, &slices::slice_name(NODE))
        .unwrap();
    let mut v: Vec<_> = s["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let a = &d["attributes"];
            let text = |k: &str| a[k]["string"].as_str().unwrap_or("gpu").to_string();
            (
                d["name"].as_str().unwrap().to_string(),
                a["parentIndex"]["int"].as_i64().unwrap_or(-1),
                text("profile"),
                text("uuid"),
            )
        })
        .collect();
    v.sort();
    v
}

/// (profile, GPU instance id, compute instance id) of the sim's MIG
/// devices on `gpu`, sorted.
fn instances(sim: &SimNode, gpu: usize) -> Vec<(String, u32, u32)> {
    let mut v: Vec<_> = sim
        .state()
        .mig_devices(gpu)
        .into_iter()
        .map(|(g, c)| (c.profile.device_name(), g.id, c.id))
        .collect();
    v.sort();
    v
}

/// A claim for the MIG device of `profile` (the MIG class, a selector on
/// `profile`), allocated and prepared; the device it got.
async fn prepare_mig(server: &ApiServer, kubelet: &plugin::DraPlugin, profile: &str) -> String {
    let name = format!("mig-{}", profile.replace('.', "-"));
    let c = mig_claim(server, &name, profile);
    let a = allocator::allocate(server, NS, &name, NODE).unwrap();
    let claim = plugin::claim(NS, &name, &uid(&c));
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(r.claims[&claim.uid].error, "");
    a["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_geometry_is_applied_at_start_and_a_prepared_instance_kept() {
    tracing::subscriber::set_global_default(Capture).expect("the only subscriber");
    let sim = SimNode::install("sim-mig-h100");
    sim.mig(&["--gpu", "0", "--enable", "--create", "19"]);
    let operators = instances(&sim, 0);
    assert_eq!(operators.len(), 1, "{operators:?}");
    let (_, op_gi, op_ci) = operators[0].clone();
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();

    // The operator's 1g.10gb is one of the two wanted; GPU 1 is enabled
    // and partitioned.
    let geometry = "0=3g.40gb,1g.10gb,1g.10gb;1=2g.20gb";
    let (cancel, daemon, kubelet) =
        run_daemon(&server, &dirs, settings(&sim, &dirs, geometry)).await;
    let log = || LOG.lock().unwrap().clone();
    let names = |v: &[(String, u32, u32)]| v.iter().map(|i| i.0.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&instances(&sim, 0)),
        ["1g.10gb", "1g.10gb", "3g.40gb"],
        "{}",
        log()
    );
    assert!(instances(&sim, 0).contains(&operators[0]), "kept");
    let gpu1 = instances(&sim, 1);
    assert_eq!(names(&gpu1), ["2g.20gb"], "{}", log());
    let devices = published(&server);
    let mut shape: Vec<(i64, &str)> = devices.iter().map(|d| (d.1, d.2.as_str())).collect();
    shape.sort();
    assert_eq!(
        shape,
        [
            (0, "1g.10gb"),
            (0, "1g.10gb"),
            (0, "3g.40gb"),
            (1, "2g.20gb")
        ],
        "MIG devices only, no whole GPU: {devices:?}"
    );
    let op_device = format!("gpu-0-mig-{op_gi}-{op_ci}");
    assert!(devices.iter().any(|d| d.0 == op_device), "{devices:?}");

    // A claim on the 2g.20gb; restarted with a geometry that needs its
    // room: the prepared instance stays, vcuda's and idle as it is.
    let small = prepare_mig(&server, &kubelet, "2g.20gb").await;
    let before = devices.iter().find(|d| d.0 == small).unwrap().clone();
    assert_eq!(before.1, 1, "{before:?}");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
    let (cancel, daemon, _kubelet) =
        run_daemon(&server, &dirs, settings(&sim, &dirs, "1=7g.80gb")).await;
    let l = log();
    assert!(
        l.lines()
            .any(|x| x.contains("do not fit") && x.contains("gpu=1")),
        "{l}"
    );
    assert_eq!(instances(&sim, 1), gpu1, "{l}");
    assert_eq!(instances(&sim, 0).len(), 3, "GPU 0 is not named");
    let after = published(&server);
    assert!(after.contains(&before), "{after:?}");
    assert!(!after.iter().any(|d| d.0 == "gpu-1"), "{after:?}");
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}

/// Instances an operator makes or destroys while the driver runs
/// (`--mig-rescan-period`, docs/mig.md): GPU 0 in MIG mode with a 3g.40gb
/// and a 1g.10gb; the 1g.10gb destroyed and a 2g.20gb made in its room.
/// The slice publishes the 2g.20gb and no longer the 1g.10gb within a few
/// periods, and a claim for the 2g.20gb is prepared on the new instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_made_or_destroyed_while_the_driver_runs_are_published() {
    let sim = SimNode::install("sim-mig-h100");
    sim.mig_3g_and_1g();
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    let s = Settings {
        mig_rescan_period: Some(std::time::Duration::from_millis(300)),
        ..sim_settings(sim.root(), &dirs)
    };
    let (cancel, daemon, kubelet) = run_daemon(&server, &dirs, s).await;
    let on_gpu0 = || {
        let mut v: Vec<String> = published(&server)
            .into_iter()
            .filter(|d| d.1 == 0)
            .map(|d| d.2)
            .collect();
        v.sort();
        v
    };
    assert_eq!(on_gpu0(), ["1g.10gb", "3g.40gb"]);
    let (_, gi, ci) = instances(&sim, 0)
        .into_iter()
        .find(|i| i.0 == "1g.10gb")
        .unwrap();
    let state = sim.state();
    state.destroy_compute_instance(0, gi, ci).unwrap();
    state.destroy_gpu_instance(0, gi).unwrap();
    sim.mig(&["--gpu", "0", "--create", "14"]);
    let (_, made_gi, made_ci) = instances(&sim, 0)
        .into_iter()
        .find(|i| i.0 == "2g.20gb")
        .unwrap();
    let t = std::time::Instant::now();
    while on_gpu0() != ["2g.20gb", "3g.40gb"] {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "published on GPU 0: {:?}",
            on_gpu0()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    println!(
        "an operator's 2g.20gb published and the 1g.10gb withdrawn {} ms after (rescan every 300 ms)",
        t.elapsed().as_millis()
    );
    let device = prepare_mig(&server, &kubelet, "2g.20gb").await;
    assert_eq!(device, format!("gpu-0-mig-{made_gi}-{made_ci}"));
    cancel.cancel();
    daemon.await.unwrap().unwrap();
}
