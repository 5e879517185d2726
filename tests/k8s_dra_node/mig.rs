//! MIG on the real node (issue 36), DRA mode: a second simulated node, the
//! H100 (`config/nodes/sim-mig-h100.toml`), GPU 0 in MIG mode with a
//! 3g.40gb, a 2g.20gb and a 1g.10gb (`nvidia-smi mig -cgi 9,14,19 -C`), the
//! driver binary serving it. The real scheduler allocates claims of the MIG
//! class by profile; the real kubelet prepares them; containerd injects the
//! parent's node and the instance's two capability nodes (made on the host
//! as the driver's `nvidia-caps` nodes are, 1:3 like the sim's others). A
//! pod given the 1g.10gb and one given the 3g.40gb see exactly their
//! instance's memory with the untouched driver; a 50 % / 5 GiB share inside
//! the 2g.20gb sees a 5 GiB card, is refused past it and gets half the
//! instance's time by the sim's timeline (the interposer steers by GPM).
//! Deleting the pods unprepares the claims and leaves the instances.
//!
//! There is no NVIDIA container runtime hook here: the pods' command turns
//! the `NVIDIA_VISIBLE_DEVICES=MIG-…` the spec sets into
//! `CUDA_VISIBLE_DEVICES`, as the hook does.

use crate::parts::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::k8s::util::{HostDevCleanup, get_u64, tail, wait};
use test_support::{kv, target_dir, workspace_root};

/// The profiles made on GPU 0 (H100 profile ids 9, 14, 19) and their
/// memory (NVIDIA's MIG user guide, `nvidia-smi mig -lgip` on H100 80GB).
const PROFILES: [(&str, u64); 3] = [("3g.40gb", 40448), ("2g.20gb", 20096), ("1g.10gb", 9984)];

fn mig_template(name: &str, profile: &str, share: Option<(u32, &str)>) -> String {
    let capacity = share
        .map(|(cores, memory)| {
            format!(
                "          capacity:\n            requests: {{cores: \"{cores}\", memory: {memory}}}\n"
            )
        })
        .unwrap_or_default();
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {NS}}}
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: vcuda-mig.vcuda.tencent.com
          selectors:
          - cel: {{expression: "device.attributes['{DRIVER}'].profile == '{profile}'"}}
{capacity}"#
    )
}

/// Host `/dev/nvidia-caps/<node>` for each capability node the sim made
/// (the driver's access nodes of the instances), removed when dropped.
pub fn host_cap_nodes(sim: &Path) -> HostDevCleanup {
    let dir = Path::new("/dev/nvidia-caps");
    fs::create_dir_all(dir).unwrap();
    let mut made = Vec::new();
    for e in fs::read_dir(sim.join("dev/nvidia-caps")).unwrap() {
        let path = dir.join(e.unwrap().file_name());
        if !path.exists() {
            let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
            // SAFETY: a valid C string; /dev/null's number, as the sim's nodes.
            let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
            assert_eq!(rc, 0, "mknod {}", path.display());
        }
        made.push(path);
    }
    HostDevCleanup(made)
}

/// The flags both daemons take alike: the simulated node's root, the
/// repository's volume configuration and the built interposer.
pub fn sim_flags(sim: &Path) -> Vec<String> {
    let volume = workspace_root().join("config/volume.conf");
    let interposer = target_dir().join("libvcuda.so");
    [
        ("--host-root", sim.to_path_buf()),
        ("--volume-config", volume),
        ("--interposer", interposer),
    ]
    .into_iter()
    .flat_map(|(f, p)| [f.to_string(), p.display().to_string()])
    .collect()
}

fn driver(n: &Node, node: &str, w: &Path, sim: &Path) -> DriverProc {
    let p = |s: &str| w.join(s).to_str().unwrap().to_string();
    let args = [
        "--node-name",
        node,
        "--vdriver-dir",
        &p("mig-vdriver"),
        "--vm-dir",
        &p("mig-vm"),
        "--cdi-dir",
        CDI_DIR,
        "--state-dir",
        &p("mig-state"),
        "--kubeconfig",
        n.kubeconfig.to_str().unwrap(),
        "--query-addr",
        "127.0.0.1:25681",
    ];
    DriverProc {
        child: None,
        log: w.join("mig-driver.log"),
        args: sim_flags(sim)
            .into_iter()
            .chain(args.iter().map(|s| s.to_string()))
            .collect(),
    }
}

pub fn mig_phase(n: &Node, node: &str, w: &Path, bin: &Path) {
    eprintln!("k8s_dra: MIG devices and a share inside one (sim-mig-h100)");
    let sim = w.join("mig-sim");
    let installed = sh(Command::new(target_dir().join("gpu-sim"))
        .args(["install", "--node"])
        .arg(workspace_root().join("config/nodes/sim-mig-h100.toml"))
        .arg("--root")
        .arg(&sim)
        .arg("--host-dev"));
    let _host_dev = HostDevCleanup::from_install_output(&installed);
    sh(Command::new(target_dir().join("gpu-sim"))
        .args(["mig", "--root"])
        .arg(&sim)
        .args(["--gpu", "0", "--enable", "--create", "9,14,19"]));
    let _caps = host_cap_nodes(&sim);
    let state = test_support::sim::state_at(&sim);

    let slice_name = format!("{node}-{DRIVER}");
    let _ = n.kubectl(&["delete", "resourceslice", &slice_name]);
    let mut drv = driver(n, node, w, &sim);
    drv.spawn();
    let slice = wait("the MIG node's slice", 60, || {
        let s = n
            .json(&["get", "resourceslice", &slice_name])
            .map_err(|e| format!("{e}; the driver's log ends:\n{}", tail(&drv.text(), 15)))?;
        let migs = s["spec"]["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["attributes"]["type"]["string"] == "mig")
            .count();
        if migs == 3 {
            Ok(s)
        } else {
            Err(format!("{migs} MIG devices: {s}"))
        }
    });
    // The device-plugin phase's manager may still be draining (a mode
    // switch): the driver waits for its sockets to close, it is not refused.
    if drv.count("waiting for it to stop") > 0 {
        eprintln!("k8s_dra: the MIG node's driver waited for the previous phase's manager to stop");
    }
    let allow = slice["spec"]["devices"][0]["allowMultipleAllocations"].clone();
    assert_eq!(allow, true, "{slice}");
    drv.wait_for(
        "the kubelet to register the plugin",
        "registered with the kubelet",
        1,
        60,
    );
    // A namespace an earlier run left goes once a driver can unprepare.
    fresh_namespace(n);

    let mig_cmd = |prog: &str| {
        format!(
            "CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES /work/{prog}; echo ---done; sleep 100000"
        )
    };
    let mut pods = whole_instances(n, "k8s_dra", &state, |name, profile, cmd| {
        n.apply(&mig_template(name, profile, None));
        pod(name, name, cmd, bin, &sim)
    });
    destroyed_under_a_pod(n, &state, "mig-1g-10gb");

    // A share inside the 2g.20gb.
    n.apply(&mig_template("mig-share", "2g.20gb", Some((50, "5Gi"))));
    n.apply(&pod(
        "mig-share-mem",
        "mig-share",
        &mig_cmd("shim_client quota 256"),
        bin,
        &sim,
    ));
    wait_running(n, "mig-share-mem", 120);
    // The H100's context takes 527 MiB of the 5 GiB: what is left fits.
    let out = log_with(n, "mig-share-mem", "---done");
    let a = kv(&out);
    let get = |k: &str| get_u64(&a, k, &out);
    assert_eq!(get("start_total"), 5 << 30, "a 5 GiB card\n{out}");
    assert_eq!(get("last"), 2, "refused past 5 GiB (OOM)\n{out}");
    assert_eq!(get("allocated"), get("start_free") / (256 << 20), "{out}");
    // A share's percent is the sim's device time, host CPU: measured out
    // of the other real-node suite's heavy phases (tests/run.sh runs the
    // 1.20 suite beside this one).
    let load = test_support::k8s::host_load::HostLoad::measure("the share in the 2g.20gb");
    n.apply(&pod(
        "mig-share-run",
        "mig-share",
        &mig_cmd("shim_compute saturate 7"),
        bin,
        &sim,
    ));
    wait_running(n, "mig-share-run", 120);
    let head = log_with(n, "mig-share-run", "start_ns=");
    let start = get_u64(&kv(&head), "start_ns", &head);
    let (from, to) = (start + 2_000_000_000, start + 6_000_000_000);
    let now = test_support::shim::simnode::now_ns();
    std::thread::sleep(std::time::Duration::from_nanos(
        to.saturating_sub(now) + 50_000_000,
    ));
    let u = state.gi_utilization(0, gi_of(&state, "2g.20gb"), from, to);
    drop(load);
    eprintln!(
        "k8s_dra: a 50 % / 5 GiB share inside the 2g.20gb: 5 GiB card, {u:.1} % of the instance"
    );
    assert!((42.0..=58.0).contains(&u), "{u:.1} % of the 2g.20gb");
    log_with(n, "mig-share-run", "---done");
    pods.extend(["mig-share-mem".into(), "mig-share-run".to_string()]);

    for p in &pods {
        n.ok(&["-n", NS, "delete", "pod", p, "--wait=true"]);
    }
    let left = wait("the MIG claims unprepared", 60, || {
        let specs: Vec<PathBuf> = fs::read_dir(CDI_DIR)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let ours = drv.count("claim unprepared");
        if ours >= pods.len() {
            Ok(specs)
        } else {
            Err(format!("{ours} unprepared"))
        }
    });
    eprintln!(
        "k8s_dra: MIG pods deleted, claims unprepared ({} CDI specs left on the node)",
        left.len()
    );
    assert_eq!(state.mig_devices(0).len(), 3, "the instances stay");
    drv.kill9();
    n.ok(&["delete", "resourceslice", &slice_name]);

    crate::mig_plugins::mig_plugins_phase(n, node, w, bin, &sim, &state);
}

/// An operator destroys the instance under `pod` (its program done, so
/// NVML lets it): the kubelet shows the pod's device Unhealthy (the
/// driver's health stream; Healthy before) and the pod gets a
/// `VcudaMigDeviceLost` Event. Made again with the same ids (the sim gives
/// it the same UUID, a real GPU would not), the device is Healthy again.
fn destroyed_under_a_pod(n: &Node, state: &gpu_sim_core::SharedState, pod: &str) {
    let claim = pod_claim(n, pod).unwrap();
    let dev = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string();
    let health = |want: &'static str| {
        let what = format!("the kubelet's health of {pod}'s {dev}: {want}");
        wait(&what, 60, || device_health_is(n, pod, &dev, want));
    };
    health("Healthy");
    let g = destroy_instance(state, "1g.10gb");
    let t0 = std::time::Instant::now();
    health("Unhealthy");
    let uuid = gpu_sim_core::mig::mig_uuid(&state.node().gpus[0].uuid, g.id, 0);
    let metrics = "127.0.0.1:25681";
    wait("vcuda_mig_device_lost", 30, || {
        lost_metric(metrics, &uuid, true)
    });
    let ev = lost_event(n, pod);
    let note = ev["message"].as_str().unwrap_or_default();
    assert!(note.contains("destroyed") && note.contains(&dev), "{ev}");
    eprintln!(
        "k8s_dra: {pod}'s instance destroyed: Unhealthy in its pod status and an Event in {:.1} s (rescan period 10 s)",
        t0.elapsed().as_secs_f64()
    );
    make_again(state, &g);
    health("Healthy");
    wait("vcuda_mig_device_lost gone", 30, || {
        lost_metric(metrics, &uuid, false)
    });
}

/// Destroys GPU 0's instance of `profile` (its compute instance, then
/// it), as `nvidia-smi mig -dci; -dgi` would; what it was.
pub fn destroy_instance(
    state: &gpu_sim_core::SharedState,
    profile: &str,
) -> gpu_sim_core::state::GpuInstance {
    let gi = gi_of(state, profile);
    let g = state.gpu_instance(0, gi).unwrap();
    state.destroy_compute_instance(0, gi, 0).unwrap();
    state.destroy_gpu_instance(0, gi).unwrap();
    g
}

/// Makes `g` again where it was, with a full compute instance: the sim
/// gives it the lowest free id, its old one, so the same MIG UUID.
pub fn make_again(state: &gpu_sim_core::SharedState, g: &gpu_sim_core::state::GpuInstance) {
    let again = state
        .create_gpu_instance(0, g.profile.id, Some(g.placement))
        .unwrap();
    assert_eq!(again.id, g.id, "the sim reuses the lowest free id");
    let whole = g
        .profile
        .ci_profiles()
        .find(|c| c.slices == g.profile.slices);
    state
        .create_compute_instance(0, g.id, whole.unwrap().index, None)
        .unwrap();
}

/// Ok when the daemon serving metrics on `addr` shows
/// `vcuda_mig_device_lost` for `uuid` (`want`) or not; else its lines.
pub fn lost_metric(addr: &str, uuid: &str, want: bool) -> Result<(), String> {
    let (code, text) = test_support::process::http_get(addr.parse().unwrap(), "/metrics");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("vcuda_mig_device_lost{"))
        .collect();
    let shown = lines
        .iter()
        .any(|l| l.contains(&format!("uuid=\"{uuid}\"")) && l.ends_with(" 1"));
    if code == 200 && shown == want {
        Ok(())
    } else {
        Err(format!("HTTP {code}: {lines:?}"))
    }
}

/// The `VcudaMigDeviceLost` Warning Event on `pod`.
pub fn lost_event(n: &Node, pod: &str) -> serde_json::Value {
    event_on(n, "VcudaMigDeviceLost", pod)
}

/// GPU 0's GPU instance of `profile`.
pub fn gi_of(state: &gpu_sim_core::SharedState, profile: &str) -> u32 {
    state
        .mig_devices(0)
        .into_iter()
        .find(|(_, c)| c.profile.device_name() == profile)
        .map(|(g, _)| g.id)
        .unwrap()
}

/// What CUDA in pod `name` given the `profile` instance saw
/// (`sim_cuda info` before `---info` in `out`): one device, the instance's
/// SMs (the simulator's profile table) and memory, and the MIG UUID the
/// pod was given (`visible=`) as the device's UUID.
fn sees_exactly_its_instance(
    state: &gpu_sim_core::SharedState,
    name: &str,
    profile: &str,
    mib: u64,
    out: &str,
) {
    let info = kv(out.split("---info").next().unwrap());
    let sms = state
        .mig_devices(0)
        .into_iter()
        .find(|(_, c)| c.profile.device_name() == profile)
        .map(|(_, c)| c.profile.sms())
        .unwrap();
    let seen = |k: &str| info.get(k).cloned().unwrap_or_default();
    assert_eq!(
        (seen("count"), seen("dev0.sms"), seen("dev0.total_mib")),
        ("1".to_string(), sms.to_string(), mib.to_string()),
        "{name}: CUDA sees exactly its {profile}\n{out}"
    );
    let mig = seen("visible");
    let (Some(given), Some(cuda)) = (
        mig.strip_prefix("MIG-"),
        seen("dev0.uuid").strip_prefix("GPU-").map(str::to_string),
    ) else {
        panic!("{name}: a MIG UUID given and a device UUID seen\n{out}");
    };
    assert_eq!(
        cuda.to_ascii_lowercase(),
        given.to_ascii_lowercase(),
        "{name}: the device is the instance given\n{out}"
    );
}

/// A pod given the 3g.40gb and one given the 1g.10gb (`manifest(name,
/// profile, command)`: the pod, and whatever it needs applied first) see
/// exactly their instance's memory with the untouched driver, then both
/// saturate their instance at once: each keeps its own busy, as hardware
/// partitions do (on one time-sliced GPU the two would share it). Returns
/// the pods (their programs done).
pub fn whole_instances(
    n: &Node,
    tag: &str,
    state: &gpu_sim_core::SharedState,
    manifest: impl Fn(&str, &str, &str) -> String,
) -> Vec<String> {
    let whole = "CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES sh -c \
        'echo visible=$CUDA_VISIBLE_DEVICES; /work/sim_cuda info; echo ---info; \
        /work/shim_client quota 256; echo ---quota; /work/shim_compute saturate 6'; \
        echo ---done; sleep 100000";
    let mut pods = Vec::new();
    let load = test_support::k8s::host_load::HostLoad::measure("two MIG instances saturated");
    for (profile, _) in [PROFILES[0], PROFILES[2]] {
        let name = format!("mig-{}", profile.replace('.', "-"));
        n.apply(&manifest(&name, profile, whole));
        pods.push(name);
    }
    let mut starts = Vec::new();
    for (name, (profile, mib)) in pods.iter().zip([PROFILES[0], PROFILES[2]]) {
        wait_running(n, name, 120);
        let out = log_with(n, name, "start_ns=");
        let total = get_u64(&kv(&out), "start_total", &out);
        assert_eq!(total, mib << 20, "{name}: the instance's memory\n{out}");
        sees_exactly_its_instance(state, name, profile, mib, &out);
        eprintln!("{tag}: {name}: a {profile} instance, {mib} MiB, the untouched driver");
        starts.push(get_u64(&kv(&out), "start_ns", &out));
    }
    let from = starts.iter().max().unwrap() + 1_000_000_000;
    let to = starts.iter().min().unwrap() + 5_500_000_000;
    assert!(
        to > from + 1_000_000_000,
        "the pods started {starts:?}: too far apart"
    );
    let now = test_support::shim::simnode::now_ns();
    std::thread::sleep(std::time::Duration::from_nanos(
        to.saturating_sub(now) + 50_000_000,
    ));
    let busy: Vec<f64> = [PROFILES[0].0, PROFILES[2].0]
        .iter()
        .map(|p| state.gi_utilization(0, gi_of(state, p), from, to))
        .collect();
    drop(load);
    eprintln!(
        "{tag}: both saturating at once: 3g.40gb busy {:.1} %, 1g.10gb busy {:.1} %",
        busy[0], busy[1]
    );
    // The sim's device time is the launching process's host CPU, so an
    // absolute figure moves with host load (83 % beside the 1.20 suite,
    // tests/soak.md 2026-12-07). What only partitions allow does not: on
    // one time-sliced timeline two contexts' busy adds up to at most 100 %,
    // so a sum well past it means they ran at the same time, and each over
    // half means neither waited on the other.
    let sum: f64 = busy.iter().sum();
    assert!(
        sum > 130.0 && busy.iter().all(|&b| b > 50.0),
        "each instance its own (more than 130 % together, over 50 % each): {busy:?}"
    );
    for name in &pods {
        log_with(n, name, "---done");
    }
    pods
}
