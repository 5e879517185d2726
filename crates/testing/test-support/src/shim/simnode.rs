//! A simulated GPU node whose driver tree is a vdriver mirror with the
//! interposer as `libcuda.so.1` / `libnvidia-ml.so.1`, plus per-container
//! vm directories served by [`TestManager`]: what the
//! interposer's tests (`tests/shim_quota.rs`, `tests/shim_compute.rs`) and
//! benchmarks (`benches/overhead.rs`, `benches/compute_accuracy.rs`) run
//! their C programs under.

use super::server::TestManager;
use gpu_sim_core::{SharedState, SimRoot};
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct ShimNode {
    pub sim: tempfile::TempDir,
    /// The mirror's `nvidia/lib64`: LD_LIBRARY_PATH of a shared container.
    pub lib64: PathBuf,
    pub driver: (i32, i32),
    /// The GPU's bus id as the config carries it (4-digit domain).
    pub bus_id: String,
}

impl ShimNode {
    /// Installs `<workspace>/config/nodes/<node>.toml` with the `gpu-sim`
    /// binary `gpu_sim` (the sim's cdylibs beside it), then mirrors it with
    /// the interposer `shim` (a `libvcuda.so`), or `$VCUDA_INTERPOSER` when
    /// set: tests/run.sh runs the shim tests again on the glibc-2.17 build.
    pub fn install(workspace: &Path, gpu_sim: &Path, shim: &Path, node: &str) -> ShimNode {
        let shim_env = std::env::var_os("VCUDA_INTERPOSER").map(PathBuf::from);
        let shim = shim_env.as_deref().unwrap_or(shim);
        assert!(
            shim.is_file(),
            "{} missing: build the workspace first (cargo build [--release] --workspace)",
            shim.display()
        );
        let node_file = workspace.join("config/nodes").join(format!("{node}.toml"));
        let sim = crate::sim::gpu_sim_install(gpu_sim, &node_file);
        let config = vdriver::VolumeConfig::load(&workspace.join("config/volume.conf"))
            .expect("config/volume.conf");
        // Inside the sim root, so the sim's libraries find their state.
        let vdir = sim.path().join("vdriver");
        let report = vdriver::mirror(sim.path(), &config, &vdir, Some(shim)).expect("mirror");
        let lib64 = report
            .volume("nvidia")
            .expect("nvidia volume")
            .path
            .join("lib64");
        let v = report.driver_version.to_string();
        let mut parts = v.split('.').map(|p| p.parse::<i32>().unwrap());
        let driver = (parts.next().unwrap(), parts.next().unwrap());
        let st = SharedState::open(&SimRoot::new(sim.path())).unwrap();
        let (d, b, dv, f) = st.node().gpus[0].pci_location();
        ShimNode {
            lib64,
            driver,
            bus_id: format!("{:04x}:{b:02x}:{dv:02x}.{f:x}", d & 0xffff),
            sim,
        }
    }

    /// The sample node `sim-1gpu` of `workspace` with the `gpu-sim` and
    /// `libvcuda.so` built in `target`, and `tests/c/<program>` compiled
    /// against it: what the shim tests under tests/ run on.
    pub fn sample(workspace: &Path, target: &Path, program: &str) -> (ShimNode, PathBuf) {
        let n = ShimNode::install(
            workspace,
            &target.join("gpu-sim"),
            &target.join("libvcuda.so"),
            "sim-1gpu",
        );
        let prog = n.compile_c(&workspace.join("tests/c").join(program));
        (n, prog)
    }

    pub fn root(&self) -> &Path {
        self.sim.path()
    }

    /// Compiles `src` against the sim's libcuda (`-lcuda`) into the node.
    pub fn compile_c(&self, src: &Path) -> PathBuf {
        let out = self.root().join(src.file_stem().unwrap());
        crate::sim::gcc_lcuda(src, &self.root().join("usr/lib/x86_64-linux-gnu"), &out);
        out
    }

    pub fn state(&self) -> SharedState {
        SharedState::open(&SimRoot::new(self.root())).unwrap()
    }

    /// A container's vm directory with this compute quota (and 4 GiB of
    /// memory), served by a test manager.
    pub fn container(&self, utilization: i32, hard: bool, limit: i32) -> Container {
        let dir = tempfile::tempdir().unwrap();
        let d = quota_config::ResourceData {
            pod_uid: "pod-uid-compute".into(),
            container_name: "main".into(),
            bus_id: self.bus_id.clone(),
            gpu_memory: 4 << 30,
            utilization,
            hard_limit: hard,
            limit,
            driver_version: self.driver,
            enable: true,
        };
        write_config(dir.path(), &d);
        let manager = TestManager::start(dir.path(), d.gpu_memory);
        Container {
            dir,
            manager: Some(manager),
            lib64: self.lib64.clone(),
        }
    }

    /// A container's vm directory with nothing in it yet (no config, no
    /// manager): the test writes what it needs.
    pub fn vm_dir(&self) -> Container {
        Container {
            dir: tempfile::tempdir().unwrap(),
            manager: None,
            lib64: self.lib64.clone(),
        }
    }

    /// A copy of the mirror's `lib64` (links to the same files) without the
    /// entries whose names start with `prefix`, e.g. `libnvidia-ml.so.` for
    /// a driver tree that lacks the real NVML.
    pub fn lib64_without(&self, prefix: &str) -> PathBuf {
        let dir = self
            .root()
            .join(format!("lib64-without-{}", prefix.trim_end_matches('.')));
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&self.lib64).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            if name.to_string_lossy().starts_with(prefix) {
                continue;
            }
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                let to = std::fs::read_link(e.path()).unwrap();
                std::os::unix::fs::symlink(to, dir.join(&name)).unwrap();
            } else if ft.is_file() {
                std::fs::hard_link(e.path(), dir.join(&name)).unwrap();
            }
        }
        dir
    }

    /// Device memory in use on GPU 0, as the sim's driver counts it.
    pub fn memory_used(&self) -> u64 {
        self.state().memory_used(0)
    }

    /// A whole-GPU container (`enable` = 0): no manager, no limits.
    pub fn whole_gpu(&self) -> Container {
        let dir = tempfile::tempdir().unwrap();
        let d = quota_config::ResourceData {
            bus_id: self.bus_id.clone(),
            utilization: 100,
            hard_limit: true,
            driver_version: self.driver,
            enable: false,
            ..Default::default()
        };
        write_config(dir.path(), &d);
        Container {
            dir,
            manager: None,
            lib64: self.lib64.clone(),
        }
    }

    /// A container run directly on the sim's driver (no interposer).
    pub fn direct(&self) -> Container {
        Container {
            dir: tempfile::tempdir().unwrap(),
            manager: None,
            lib64: self.root().join("usr/lib/x86_64-linux-gnu"),
        }
    }

    /// Percent of `[from, to)` (CLOCK_MONOTONIC ns) the processes `pids`
    /// kept GPU 0 busy, from the sim's timeline (ground truth).
    pub fn busy(&self, pids: &[i32], from: u64, to: u64) -> f64 {
        self.state()
            .process_utilization(0, from, to)
            .into_iter()
            .filter(|(p, _)| {
                pids.contains(&(p.host_pid.unwrap_or(p.ns_pid) as i32))
                    || pids.contains(&(p.ns_pid as i32))
            })
            .map(|(_, pct)| pct)
            .sum()
    }
}

fn write_config(dir: &Path, d: &quota_config::ResourceData) {
    quota_config::write_atomic(
        &dir.join(quota_config::CONFIG_FILE),
        &d.to_bytes().unwrap(),
        0o644,
        quota_config::Durability::Derived,
    )
    .unwrap();
}

pub struct Container {
    pub dir: tempfile::TempDir,
    pub manager: Option<TestManager>,
    lib64: PathBuf,
}

impl Container {
    /// The vm directory (`VCUDA_CONFIG_DIR`).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The same container with another driver directory on its
    /// `LD_LIBRARY_PATH`.
    pub fn with_lib64(mut self, lib64: PathBuf) -> Container {
        self.lib64 = lib64;
        self
    }

    /// `program` under the interposer in this container.
    pub fn command(&self, program: &Path) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", &self.lib64)
            .env("VCUDA_CONFIG_DIR", self.dir.path())
            .env_remove("LOGGER_LEVEL");
        c
    }
}

/// CLOCK_MONOTONIC ns, the sim's clock.
pub fn now_ns() -> u64 {
    gpu_sim_core::state::now_ns()
}
