//! Shared helpers for the end-to-end tests in this directory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Root of the workspace checkout.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Directory cargo puts this profile's binaries and cdylibs in.
pub fn target_dir() -> PathBuf {
    // Tests run from target/<profile>/deps/<test-binary>.
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

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

/// The interposer the deploy image ships: the glibc-2.17 build that
/// `cargo zigbuild -p cuda-shim --release --target
/// x86_64-unknown-linux-gnu.2.17` leaves in the same target dir (see
/// cuda-shim/README.md, "glibc floor"), or `$VCUDA_INTERPOSER` when set.
pub fn shipped_interposer() -> PathBuf {
    if let Some(p) = std::env::var_os("VCUDA_INTERPOSER") {
        return PathBuf::from(p);
    }
    target_dir()
        .parent()
        .expect("target dir")
        .join("x86_64-unknown-linux-gnu/release/libvcuda.so")
}

/// One HTTP/1.1 GET with `Connection: close`: the status code (0 when the
/// answer has none) and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let code = raw.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (code, body)
}

/// The command line of process `pid`, read back from /proc.
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
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

    pub fn install_file(node: &Path) -> SimNode {
        let dir = tempfile::Builder::new()
            .prefix("gpu-sim-")
            .tempdir()
            .unwrap();
        let gpu_sim = target_dir().join("gpu-sim");
        assert!(
            gpu_sim.is_file(),
            "{} missing: run `cargo build --workspace` first",
            gpu_sim.display()
        );
        let out = std::process::Command::new(&gpu_sim)
            .arg("install")
            .arg("--node")
            .arg(node)
            .arg("--root")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gpu-sim install failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SimNode { dir }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// The multiarch library directory holding libcuda.so.1 and libnvidia-ml.so.1.
    pub fn lib_dir(&self) -> PathBuf {
        self.root().join("usr/lib/x86_64-linux-gnu")
    }
}

/// Compiles a C test program from `tests/c/<name>.c` against the node's
/// libcuda (`-lcuda`), into `out_dir`.
pub fn compile_c(name: &str, node: &SimNode, out_dir: &Path) -> PathBuf {
    let src = workspace_root().join("tests/c").join(format!("{name}.c"));
    let out = out_dir.join(name);
    let st = std::process::Command::new("gcc")
        .arg("-O1")
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .arg("-L")
        .arg(node.lib_dir())
        .arg("-lcuda")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
    out
}

/// The private Docker engine started by `tests/run.sh` (tests/docker/engine.sh).
pub struct Docker {
    /// Value for DOCKER_HOST.
    pub host: String,
    pub image: String,
}

/// A test that cannot run on this machine: where tests/run.sh (and so CI)
/// says everything must run (`VCUDA_REQUIRE_ALL=1`), this fails the test;
/// elsewhere it says why it skips. Returns so the caller can `return`.
pub fn cannot_run(reason: &str) {
    if std::env::var("VCUDA_REQUIRE_ALL").as_deref() == Ok("1") {
        panic!("VCUDA_REQUIRE_ALL=1 but this test cannot run here: {reason}");
    }
    eprintln!("skipped: {reason}");
}

impl Docker {
    /// The engine, if one answers. When `VCUDA_REQUIRE_DOCKER=1` (set by
    /// tests/run.sh) a missing engine fails the test instead of skipping it.
    pub fn get() -> Option<Docker> {
        let host = std::env::var("DOCKER_HOST").unwrap_or_default();
        let image = std::env::var("VCUDA_TEST_IMAGE")
            .unwrap_or_else(|_| "vcuda-test/busybox:latest".into());
        let d = Docker { host, image };
        let ok = !d.host.is_empty()
            && d.cli(&["info"])
                .map(|o| o.status.success())
                .unwrap_or(false);
        if ok {
            return Some(d);
        }
        if std::env::var("VCUDA_REQUIRE_DOCKER").as_deref() == Ok("1") {
            panic!(
                "VCUDA_REQUIRE_DOCKER=1 but no Docker engine answers at DOCKER_HOST={:?}; \
                 start one with `source tests/docker/engine.sh && start_docker_engine`",
                d.host
            );
        }
        eprintln!("skipped: no Docker engine (set DOCKER_HOST, see tests/docker/engine.sh)");
        None
    }

    /// A Docker CLI command aimed at this engine (Debian's client, matching
    /// Debian's engine, when present).
    pub fn command(&self) -> std::process::Command {
        let bin = if Path::new("/usr/bin/docker").exists() {
            "/usr/bin/docker"
        } else {
            "docker"
        };
        let mut c = std::process::Command::new(bin);
        c.env("DOCKER_HOST", &self.host);
        c
    }

    /// Runs the Docker CLI with `args`.
    pub fn cli(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        self.command().args(args).output()
    }

    /// Like [`cli`](Self::cli), panicking with the CLI's stderr on failure.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args).expect("docker cli");
        assert!(
            out.status.success(),
            "docker {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Bind mounts that give a busybox container the host's glibc, so
    /// programs built here (and the driver libraries) run inside it.
    pub fn glibc_mounts() -> Vec<String> {
        let mut v = Vec::new();
        for (host, ctr) in [
            ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"),
            ("/usr/lib64", "/lib64"),
        ] {
            if Path::new(host).exists() {
                v.push("-v".into());
                v.push(format!("{host}:{ctr}:ro"));
            }
        }
        v
    }
}

/// Starts a kubelet emulator in `dir` (pod resources on `pod_resources`)
/// and waits up to `wait` until `resource`'s plugin has registered and is
/// connected.
pub async fn kubelet_with_plugin(
    dir: &Path,
    pod_resources: PathBuf,
    resource: &str,
    wait: Duration,
) -> kubelet_emulator::KubeletEmulator {
    let emu = kubelet_emulator::KubeletEmulator::start(dir, pod_resources)
        .await
        .unwrap();
    emu.wait_for(wait, |v| {
        v.resources.get(resource).is_some_and(|r| r.connected)
    })
    .await
    .unwrap_or_else(|e| {
        panic!("{resource} not registered within {wait:?} of kubelet appearing: {e}")
    });
    emu
}

/// `n` timings of GetDevicePluginOptions, an RPC that does nothing in the
/// plugin: the floor of any RPC on `client`'s socket.
pub async fn options_rpc_floor(
    client: &mut device_plugin::api::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    n: usize,
) -> Vec<Duration> {
    let mut floor = Vec::with_capacity(n);
    for _ in 0..n {
        let t = std::time::Instant::now();
        client
            .get_device_plugin_options(device_plugin::api::Empty {})
            .await
            .unwrap();
        floor.push(t.elapsed());
    }
    floor
}

/// One of NVIDIA's real user-space drivers, unpacked from Debian's
/// `non-free` packages by tests/nvidia/fetch.sh (never installed).
#[derive(Debug, Clone)]
pub struct NvidiaDriver {
    /// The dpkg-deb -x root (Debian's layout under it).
    pub root: PathBuf,
    /// "535.261.03".
    pub version: String,
}

impl NvidiaDriver {
    /// `usr/lib/x86_64-linux-gnu/nvidia/current`: libcuda.so.<v>,
    /// libnvidia-ml.so.<v> and their sonames.
    pub fn lib_dir(&self) -> PathBuf {
        self.root.join("usr/lib/x86_64-linux-gnu/nvidia/current")
    }
    pub fn libcuda(&self) -> PathBuf {
        self.lib_dir().join(format!("libcuda.so.{}", self.version))
    }
    pub fn libnvml(&self) -> PathBuf {
        self.lib_dir()
            .join(format!("libnvidia-ml.so.{}", self.version))
    }
    pub fn nvidia_smi(&self) -> PathBuf {
        self.root.join("usr/lib/nvidia/current/nvidia-smi")
    }
    /// CUDA's runtime (`libcudart.so.12`), where the suite carries it (trixie).
    pub fn libcudart(&self) -> Option<PathBuf> {
        let p = self.root.join("usr/lib/x86_64-linux-gnu/libcudart.so.12");
        p.exists().then_some(p)
    }
    /// Driver branch, "535".
    pub fn major(&self) -> &str {
        self.version.split('.').next().unwrap_or("")
    }
}

/// The real drivers of `VCUDA_NVIDIA_ROOTS` (colon-separated roots, set by
/// tests/run.sh through tests/nvidia/fetch.sh), oldest first. Empty, with
/// [`cannot_run`] said, when the variable is unset: under
/// `VCUDA_REQUIRE_ALL=1` that fails the test.
pub fn nvidia_drivers() -> Vec<NvidiaDriver> {
    let Some(roots) = std::env::var_os("VCUDA_NVIDIA_ROOTS").filter(|v| !v.is_empty()) else {
        cannot_run(
            "VCUDA_NVIDIA_ROOTS is unset: `source tests/nvidia/fetch.sh && fetch_nvidia_drivers` \
             unpacks NVIDIA's real drivers 535 and 550 from Debian non-free",
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for root in std::env::split_paths(&roots) {
        let dir = root.join("usr/lib/x86_64-linux-gnu/nvidia/current");
        let version = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("VCUDA_NVIDIA_ROOTS names {}: {e}", dir.display()))
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find_map(|n| {
                let v = n.strip_prefix("libcuda.so.")?;
                (v.matches('.').count() == 2).then(|| v.to_string())
            })
            .unwrap_or_else(|| panic!("no libcuda.so.<version> in {}", dir.display()));
        out.push(NvidiaDriver { root, version });
    }
    out.sort_by(|a, b| a.version.cmp(&b.version));
    out
}
