//! A simulated GPU node installed by the real `gpu-sim install`, and C
//! programs built against its libcuda.

use crate::paths::{target_dir, workspace_root};
use std::path::{Path, PathBuf};

/// What one context costs on the sample node `sim-1gpu` (its overhead and
/// its 8 MiB device heap): the interposer charges it through the NVML
/// reconcile.
pub fn sample_ctx_cost() -> u64 {
    const MIB: u64 = 1 << 20;
    let spec =
        gpu_sim_core::NodeSpec::load(&workspace_root().join("config/nodes/sim-1gpu.toml")).unwrap();
    let c = spec.gpus[0].context_overhead_bytes() + 8 * MIB;
    assert!(c > 8 * MIB, "the sample node gives contexts a cost");
    c
}

/// A simulated node installed in a temporary directory by the real
/// `gpu-sim install`. Removed when dropped.
pub struct SimNode {
    pub dir: tempfile::TempDir,
}

impl SimNode {
    /// Installs `config/nodes/<name>.toml`. Needs the workspace built
    /// (`cargo build --workspace`): the libraries are cdylibs that `cargo
    /// test` alone does not build.
    pub fn install(name: &str) -> SimNode {
        let node = workspace_root()
            .join("config/nodes")
            .join(format!("{name}.toml"));
        Self::install_file(&node)
    }

    /// Installs the node file `node` with this profile's `gpu-sim`.
    pub fn install_file(node: &Path) -> SimNode {
        SimNode {
            dir: gpu_sim_install(&target_dir().join("gpu-sim"), node),
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// The node's shared state (its GPUs, timeline, memory).
    pub fn state(&self) -> gpu_sim_core::SharedState {
        state_at(self.root())
    }

    /// The multiarch library directory holding libcuda.so.1 and libnvidia-ml.so.1.
    pub fn lib_dir(&self) -> PathBuf {
        self.root().join("usr/lib/x86_64-linux-gnu")
    }

    /// The profiles of the MIG devices on `gpu`, sorted.
    pub fn mig_profiles(&self, gpu: usize) -> Vec<String> {
        let mut v: Vec<String> = self
            .state()
            .mig_devices(gpu)
            .into_iter()
            .map(|(_, c)| c.profile.device_name())
            .collect();
        v.sort();
        v
    }

    /// `gpu-sim xid`: a critical Xid `code` on `gpu`, inside MIG GPU
    /// instance `gpu_instance` when given; panics with its stderr on failure.
    pub fn xid(&self, gpu: usize, code: u32, gpu_instance: Option<u32>) {
        let mut cmd = std::process::Command::new(crate::target_dir().join("gpu-sim"));
        cmd.args(["xid", "--root"]).arg(self.root()).args([
            "--gpu",
            &gpu.to_string(),
            "--code",
            &code.to_string(),
        ]);
        if let Some(gi) = gpu_instance {
            cmd.args(["--gpu-instance", &gi.to_string()]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "gpu-sim xid: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `gpu-sim mig --root <root> <args>` (as `nvidia-smi -mig 1` and
    /// `nvidia-smi mig -cgi <ids> -C`); panics with its stderr on failure.
    pub fn mig(&self, args: &[&str]) {
        gpu_sim_mig(self.root(), args);
    }

    /// GPU 0 of a MIG-capable node in MIG mode with a 3g.40gb and a
    /// 1g.10gb (H100 profile ids 9 and 19), each with one full compute
    /// instance.
    pub fn mig_3g_and_1g(&self) {
        self.mig(&["--gpu", "0", "--enable", "--create", "9,19"]);
    }
}

/// `gpu-sim mig --root <root> <args>` on a node installed at `root` (as
/// `nvidia-smi -mig 1` and `nvidia-smi mig -cgi <ids> -C`); panics with its
/// stderr on failure.
pub fn gpu_sim_mig(root: &Path, args: &[&str]) {
    let out = std::process::Command::new(crate::target_dir().join("gpu-sim"))
        .args(["mig", "--root"])
        .arg(root)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-sim mig {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The shared state of the sim installed at `root`.
pub fn state_at(root: &Path) -> gpu_sim_core::SharedState {
    gpu_sim_core::SharedState::open(&gpu_sim_core::SimRoot::new(root)).unwrap()
}

/// Compiles a C test program from `tests/c/<name>.c` against the node's
/// libcuda (`-lcuda`), into `out_dir`.
pub fn compile_c(name: &str, node: &SimNode, out_dir: &Path) -> PathBuf {
    let src = workspace_root().join("tests/c").join(format!("{name}.c"));
    let out = out_dir.join(name);
    gcc_lcuda(&src, &node.lib_dir(), &out);
    out
}

/// Runs `gpu_sim install --node <node>` into a new temporary root (the sim's
/// cdylibs are found beside `gpu_sim`).
pub fn gpu_sim_install(gpu_sim: &Path, node: &Path) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("gpu-sim-")
        .tempdir()
        .unwrap();
    gpu_sim_install_at(gpu_sim, node, dir.path());
    dir
}

/// Runs `gpu_sim install --node <node> --root <root>`, which must succeed.
pub fn gpu_sim_install_at(gpu_sim: &Path, node: &Path, root: &Path) {
    assert!(
        gpu_sim.is_file(),
        "{} missing: build the workspace first (cargo build [--release] --workspace)",
        gpu_sim.display()
    );
    let out = std::process::Command::new(gpu_sim)
        .arg("install")
        .arg("--node")
        .arg(node)
        .arg("--root")
        .arg(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-sim install failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `gcc -O1 -o out src -L lib_dir -lcuda`, which must succeed.
pub fn gcc_lcuda(src: &Path, lib_dir: &Path, out: &Path) {
    let st = std::process::Command::new("gcc")
        .arg("-O1")
        .arg("-o")
        .arg(out)
        .arg(src)
        .arg("-L")
        .arg(lib_dir)
        .arg("-lcuda")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
}

/// Percent of [`from`, `to`) seconds after it began launching during
/// which GPU instance `gi` ran kernels, while `compute` saturated it for
/// `run` seconds.
pub fn busy_of_instance(
    sim: &SimNode,
    gi: u32,
    compute: &std::path::Path,
    env: &[(String, String)],
    (run, from, to): (f64, f64, f64),
) -> f64 {
    let mut child = std::process::Command::new(compute)
        .args(["saturate", &run.to_string()])
        .envs(env.iter().cloned())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("start_ns=") {
        line.clear();
        if std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() == 0 {
            panic!(
                "shim_compute ended before launching: {}",
                stderr(&mut child)
            );
        }
    }
    let start: u64 = crate::kv(&line)["start_ns"].parse().unwrap();
    let at = |s: f64| start + (s * 1e9) as u64;
    let (from, to) = (at(from), at(to));
    let now = crate::shim::simnode::now_ns();
    std::thread::sleep(std::time::Duration::from_nanos(
        to.saturating_sub(now) + 20_000_000,
    ));
    let u = sim.state().gi_utilization(0, gi, from, to);
    let st = child.wait().unwrap();
    let err = stderr(&mut child);
    assert!(st.success(), "shim_compute: {st}: {err}");
    if std::env::var_os("VCUDA_TEST_SHOW_LOG").is_some() {
        eprintln!("{err}");
    }
    u
}

fn stderr(child: &mut std::process::Child) -> String {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    }
    err
}

/// `qos_latency` (`latency`, 4 s of 100 requests a second of three
/// 17280-block kernels, 1 s warm-up) run with `lat_env` while `compute`
/// saturates with each of `batch_envs` (`saturate 6 4`, started 0.5 s
/// before): the latency client's output, once every process ended well.
pub fn latency_beside_batches(
    compute: &Path,
    latency: &Path,
    lat_env: &[(String, String)],
    batch_envs: &[&[(String, String)]],
) -> String {
    let spawn = |prog: &Path, args: &[&str], env: &[(String, String)]| {
        std::process::Command::new(prog)
            .args(args)
            .envs(env.iter().cloned())
            .env_remove("LOGGER_LEVEL")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let batches: Vec<_> = batch_envs
        .iter()
        .map(|e| spawn(compute, &["saturate", "6", "4"], e))
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let lat = spawn(latency, &["4", "100", "3", "17280", "warmup=1"], lat_env);
    let out = lat.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "qos_latency: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for b in batches {
        let o = b.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    text
}
