//! The `vcuda-dra-driver` binary as the DaemonSet runs it (supervised) on
//! a simulated node, with the API server emulator and the emulated
//! kubelet: what crates/node/dra-driver's supervisor test and cost bench share.
//! The binary's path is the caller's (`env!("CARGO_BIN_EXE_vcuda-dra-driver")`
//! exists in the dra-driver package's own tests and benches only).
//!
//! Needs `cargo build --workspace` first (gpu-sim and the interposer).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use apiserver_emulator::{ApiServer, Kind};
use dra_kubelet_emulator::{allocator, plugin};

use crate::dra::{Dirs, NODE, NS, container_env, share_claim, uid, until};
use crate::paths::{artifact, workspace_root};

/// The supervisor, killed (its driver with it) when dropped.
pub struct Sup(pub Child);

impl Drop for Sup {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The supervised binary `bin` over the sim in `dirs`, its stderr in
/// `driver.log` there.
pub fn driver(bin: &Path, dirs: &Dirs, extra: &[&str]) -> Sup {
    let sim = dirs.p("sim");
    let log = std::fs::File::create(dirs.p("driver.log")).unwrap();
    let p = |s: &str| dirs.p(s).display().to_string();
    Command::new(bin)
        .args(["--node-name", NODE])
        .arg("--host-root")
        .arg(&sim)
        .arg("--volume-config")
        .arg(workspace_root().join("config/volume.conf"))
        .arg("--interposer")
        .arg(artifact("libvcuda.so"))
        .arg("--vdriver-dir")
        .arg(sim.join("vdriver"))
        .args([
            "--vm-dir",
            &p("vm"),
            "--cdi-dir",
            &p("cdi"),
            "--state-dir",
            &p("state"),
        ])
        .args([
            "--plugins-dir",
            &p("plugins"),
            "--registry-dir",
            &p("plugins_registry"),
        ])
        .args(["--kubeconfig", &p("kubeconfig"), "--display-socket", "none"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env_remove("VCUDA_DRA_NO_SUPERVISOR")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(Sup)
        .unwrap()
}

/// The driver's log so far.
pub fn log(dirs: &Dirs) -> String {
    std::fs::read_to_string(dirs.p("driver.log")).unwrap_or_default()
}

/// The child processes of `pid` (a supervisor's: its driver).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The API server emulator and a sim node installed by `gpu-sim` from
/// `config/nodes/<node_file>` (e.g. `sim-1gpu.toml`), the kubeconfig
/// written.
pub async fn node(node_file: &str) -> (ApiServer, Dirs) {
    let server = ApiServer::start("127.0.0.1:0").await.unwrap();
    let dirs = Dirs::new();
    crate::sim::gpu_sim_install_at(
        &artifact("gpu-sim"),
        &workspace_root().join("config/nodes").join(node_file),
        &dirs.p("sim"),
    );
    server.write_kubeconfig(&dirs.p("kubeconfig")).unwrap();
    (server, dirs)
}

/// Creates, allocates and prepares share claim `name` (`cores` %,
/// `memory`): how long NodePrepareResources took and the claim's first
/// CDI device id.
pub async fn prepare_share(
    kubelet: &plugin::DraPlugin,
    server: &ApiServer,
    name: &str,
    cores: u32,
    memory: &str,
) -> (Duration, String) {
    let c = share_claim(server, name, cores, memory, None);
    allocator::allocate(server, NS, name, NODE).unwrap_or_else(|e| panic!("allocate {name}: {e}"));
    let claim = plugin::claim(NS, name, &uid(&c));
    let t0 = Instant::now();
    let r = kubelet.prepare(std::slice::from_ref(&claim)).await;
    let r = r.unwrap_or_else(|e| panic!("prepare {name}: {e}\n{}", "(see the driver log)"));
    let took = t0.elapsed();
    let one = &r.claims[&claim.uid];
    assert_eq!(one.error, "", "{name}");
    (took, one.devices[0].cdi_device_ids[0].clone())
}

/// [`prepare_share`] of 20 % and 1 GiB: how long it took.
pub async fn prepare(kubelet: &plugin::DraPlugin, server: &ApiServer, name: &str) -> Duration {
    prepare_share(kubelet, server, name, 20, "1Gi").await.0
}

/// The env of a container given CDI device `cdi_id` ([`container_env`]).
pub fn share_env(dirs: &Dirs, cdi_id: &str) -> Vec<(String, String)> {
    container_env(&dra_kubelet_emulator::cdi::resolve(&dirs.p("cdi"), cdi_id).unwrap())
}

/// The supervised binary `bin` started with `extra`, registered with the
/// emulated kubelet, its slice published and claim c1 prepared; its one
/// registration socket and that socket's inode.
pub async fn serving(
    bin: &Path,
    server: &ApiServer,
    dirs: &Dirs,
    extra: &[&str],
) -> (Sup, plugin::DraPlugin, Vec<PathBuf>, u64) {
    let sup = driver(bin, dirs, extra);
    let kubelet =
        plugin::wait_and_register(&dirs.p("plugins_registry"), Duration::from_secs(60), false)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", log(dirs)));
    // Registered, it publishes (the DeviceClasses with the slice).
    until(20, "the slice published", || {
        server.list(Kind::ResourceSlice).len() == 1
    })
    .await;
    prepare(&kubelet, server, "c1").await;
    let reg = plugin::sockets(&dirs.p("plugins_registry"));
    assert_eq!(reg.len(), 1, "{reg:?}");
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&reg[0]).unwrap());
    (sup, kubelet, reg, ino)
}
