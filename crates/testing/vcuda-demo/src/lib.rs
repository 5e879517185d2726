//! The simulated-node demo behind the `vcuda-demo` binary: installs a simulated GPU
//! node, runs the real `gpu-manager` on it with the kubelet and API server
//! emulators, admits the sample pods of `config/samples/`, runs their
//! workloads under the interposer (Docker containers, or processes in mount
//! namespaces without Docker), measures what each container gets, prints the
//! graph, a usage table and a metrics excerpt, and cleans everything up.
//!
//! ```no_run
//! let opts = vcuda_demo::Options::with_defaults("target/debug".into());
//! let outcome = vcuda_demo::run(&opts)?;
//! std::process::exit(if outcome.passed() { 0 } else { 1 });
//! # Ok::<(), vcuda_demo::DemoError>(())
//! ```

mod checks;
pub mod cluster;
pub mod http;
pub mod measure;
pub mod runtime;
pub mod samples;
mod shutdown;

use cluster::{Admission, Emulators, Layout, Manager};
use kubelet_emulator::PodRef;
use measure::{Driver, Use};
use runtime::{ContainerSpec, Docker, Runtime, Started};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Percentage points a share may run over its core quota and still count as
/// held: the interposer's controller works on sampled utilization.
pub const QUOTA_TOLERANCE: f64 = 10.0;

#[derive(Debug, Error)]
pub enum DemoError {
    /// Something the demo needs is missing or failed to start; the message
    /// says what and how to fix it.
    #[error("{0}")]
    Setup(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("interrupted")]
    Interrupted,
}

/// Which container runtime to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeChoice {
    /// Docker when an engine answers, else mount namespaces.
    Auto,
    Docker,
    Namespaces,
}

#[derive(Debug, Clone)]
pub struct Options {
    /// Node description for `gpu-sim install`.
    pub node: PathBuf,
    /// Pod manifests; their workloads in `<samples>/workloads/*.c`.
    pub samples: PathBuf,
    pub volume_config: PathBuf,
    /// Holds `gpu-manager`, `gpu-sim`, `libvcuda.so` and the simulated
    /// driver's libraries (`target/debug` after `cargo build --workspace`).
    pub bin_dir: PathBuf,
    pub runtime: RuntimeChoice,
    /// How long the compute loops are measured.
    pub measure: Duration,
    /// Keep the work dir (logs, vm dirs) for a look afterwards.
    pub keep: bool,
}

impl Options {
    /// The checkout's `config/` (found from where this crate was built) and
    /// the 4-GPU PCIe node.
    pub fn with_defaults(bin_dir: PathBuf) -> Options {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..");
        let repo = repo.canonicalize().unwrap_or(repo);
        Options {
            node: repo.join("config/nodes/sim-4gpu-pcie.toml"),
            samples: repo.join("config/samples"),
            volume_config: repo.join("config/volume.conf"),
            bin_dir,
            runtime: RuntimeChoice::Auto,
            measure: Duration::from_secs(6),
            keep: false,
        }
    }
}

/// One line of the final summary.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub checks: Vec<Check>,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.ok)
    }
}

// ---- signals: Ctrl-C ends the demo through its cleanup ----

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_signals() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

fn interrupted() -> Result<(), DemoError> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(DemoError::Interrupted)
    } else {
        Ok(())
    }
}

/// Sleeps `d`, waking early (with `Err`) on Ctrl-C.
fn nap(d: Duration) -> Result<(), DemoError> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        interrupted()?;
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(50)));
    }
    interrupted()
}

// ---- progress ----

struct Progress {
    t0: Instant,
}

impl Progress {
    fn say(&self, msg: impl AsRef<str>) {
        let t = self.t0.elapsed().as_secs_f64();
        let mut out = std::io::stdout().lock();
        for (i, line) in msg.as_ref().lines().enumerate() {
            if i == 0 {
                let _ = writeln!(out, "[{t:5.1}s] {line}");
            } else {
                let _ = writeln!(out, "         {line}");
            }
        }
        let _ = out.flush();
    }
}

fn section(title: &str) {
    println!("\n== {title} ==");
}

// ---- the run ----

/// A GPU container the manager admitted.
struct Admitted {
    pod: PodRef,
    container: String,
    cores: u64,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    adm: Admission,
    /// GPU indices (the simulated node's order).
    gpus: Vec<usize>,
}

impl Admitted {
    fn key(&self) -> String {
        format!("{}/{}", self.pod.name, self.container)
    }
    fn shared(&self) -> bool {
        !self.cores.is_multiple_of(100)
    }
}

/// A container's measured use, per GPU it holds.
struct Measured {
    key: String,
    uses: Vec<(usize, Use)>,
}

struct Session<'a> {
    opts: &'a Options,
    p: Progress,
    layout: Layout,
    run_id: String,
    runtime: Runtime,
    emulators: Option<Emulators>,
    manager: Option<Manager>,
    driver: Option<Driver>,
    pods: Vec<PodRef>,
    admitted: Vec<Admitted>,
    started: Vec<Started>,
    checks: Vec<Check>,
}

/// Runs the whole demo, printing as it goes; returns the checks. Every
/// process, container and file it made is gone when it returns, also on
/// error and on Ctrl-C.
pub fn run(opts: &Options) -> Result<Outcome, DemoError> {
    let p = Progress { t0: Instant::now() };
    catch_signals();
    preflight(opts)?;
    let run_id = std::process::id().to_string();
    let runtime = choose_runtime(opts, &run_id)?;
    let work = tempfile::Builder::new()
        .prefix("vcuda-demo-")
        .tempdir()
        .map_err(|source| DemoError::Io {
            what: "creating the demo's work dir".into(),
            source,
        })?;
    let work_path = work.path().to_path_buf();
    let runtime = match runtime {
        Runtime::Namespaces { .. } => Runtime::Namespaces {
            dir: work_path.join("rootfs"),
        },
        d => d,
    };
    println!(
        "vcuda demo: one simulated GPU node, the real gpu-manager, emulated kubelet and API server;\n\
         workloads run as {}",
        runtime.describe()
    );
    let mut s = Session {
        opts,
        p,
        layout: Layout::new(&work_path),
        run_id,
        runtime,
        emulators: None,
        manager: None,
        driver: None,
        pods: Vec::new(),
        admitted: Vec::new(),
        started: Vec::new(),
        checks: Vec::new(),
    };
    s.p.say(format!("work dir {}", work_path.display()));
    let played = s.play();
    if let Err(e) = &played {
        s.p.say(format!("demo stopped: {e}"));
    }
    let keep =
        opts.keep || played.is_err() && std::env::var_os("VCUDA_DEMO_KEEP_ON_ERROR").is_some();
    s.shutdown(if keep {
        let _ = work.keep();
        None
    } else {
        Some(work)
    });
    let elapsed = s.p.t0.elapsed();
    let outcome = Outcome {
        checks: s.checks,
        elapsed,
    };
    section("Summary");
    for c in &outcome.checks {
        println!(
            "{} {}: {}",
            if c.ok { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    let failed = outcome.checks.iter().filter(|c| !c.ok).count();
    println!(
        "demo finished in {:.1} s: {}",
        elapsed.as_secs_f64(),
        match (&played, failed) {
            (Err(e), _) => format!("stopped early ({e})"),
            (Ok(()), 0) => "all checks passed".to_string(),
            (Ok(()), n) => format!("{n} check(s) failed"),
        }
    );
    played.map(|()| outcome)
}

fn preflight(opts: &Options) -> Result<(), DemoError> {
    let mut missing = Vec::new();
    for f in [
        "gpu-manager",
        "gpu-sim",
        "libvcuda.so",
        "libcuda.so",
        "libnvidia_ml.so",
        "nvidia-smi",
    ] {
        if !opts.bin_dir.join(f).is_file() {
            missing.push(f);
        }
    }
    if !missing.is_empty() {
        return Err(DemoError::Setup(format!(
            "{} missing in {}: run `cargo build --workspace` first",
            missing.join(", "),
            opts.bin_dir.display()
        )));
    }
    for (what, p) in [
        ("node description", &opts.node),
        ("samples dir", &opts.samples),
        ("volume config", &opts.volume_config),
    ] {
        if !p.exists() {
            return Err(DemoError::Setup(format!(
                "{what} {} not found",
                p.display()
            )));
        }
    }
    Ok(())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn choose_runtime(opts: &Options, run_id: &str) -> Result<Runtime, DemoError> {
    let namespaces = || {
        if is_root() {
            Ok(Runtime::Namespaces {
                dir: PathBuf::new(),
            })
        } else {
            Err(DemoError::Setup(
                "running workloads without Docker needs root (mount namespaces, chroot, device nodes); \
                 run the demo as root or point DOCKER_HOST at an engine"
                    .into(),
            ))
        }
    };
    match opts.runtime {
        RuntimeChoice::Namespaces => namespaces(),
        RuntimeChoice::Docker => Docker::detect(run_id)
            .map(Runtime::Docker)
            .map_err(|e| DemoError::Setup(format!("no Docker engine: {e}"))),
        RuntimeChoice::Auto => match Docker::detect(run_id) {
            Ok(d) => Ok(Runtime::Docker(d)),
            Err(e) => {
                println!("no Docker engine ({e}); the workloads run as processes instead");
                namespaces()
            }
        },
    }
}

impl Session<'_> {
    fn check(&mut self, name: &'static str, ok: bool, detail: impl Into<String>) {
        self.checks.push(Check {
            name,
            ok,
            detail: detail.into(),
        });
    }

    fn em(&self) -> &Emulators {
        self.emulators.as_ref().expect("emulators started")
    }

    fn play(&mut self) -> Result<(), DemoError> {
        let l = self.layout.clone();
        let line = cluster::install(
            &self.opts.bin_dir.join("gpu-sim"),
            &self.opts.node,
            &l.sim_root,
        )?;
        self.p.say(line);
        interrupted()?;

        self.emulators = Some(Emulators::start(&l)?);
        self.p.say(format!(
            "API server emulator at {} (node {}), kubelet emulator on {}/kubelet.sock",
            self.em().api.url(),
            cluster::NODE,
            l.device_plugins.display()
        ));

        let t = Instant::now();
        let endpoint = match &self.runtime {
            Runtime::Docker(d) => Some(d.host_description()),
            Runtime::Namespaces { .. } => None,
        };
        self.manager = Some(Manager::start(
            &self.opts.bin_dir,
            &self.opts.volume_config,
            &l,
            endpoint.as_deref(),
        )?);
        loop {
            interrupted()?;
            if self.em().registered() {
                break;
            }
            let m = self.manager.as_mut().unwrap();
            if let Ok(Some(st)) = m.child.try_wait() {
                return Err(DemoError::Setup(format!(
                    "gpu-manager exited at startup ({st}):\n{}",
                    cluster::tail(&l.manager_log, 8)
                )));
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err(DemoError::Setup(
                    "gpu-manager did not register its device plugins within 30 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let view = self.em().kubelet.view().borrow().clone();
        let count = |r: &str| view.resources.get(r).map_or(0, |x| x.devices.len());
        let m = self.manager.as_ref().unwrap();
        self.p.say(format!(
            "gpu-manager ready in {:.1} s (pid {}, query port {}): {} {} and {} {} device IDs registered with kubelet",
            t.elapsed().as_secs_f64(),
            m.child.id(),
            m.query_port,
            count(samples::VCORE),
            samples::VCORE,
            count(samples::VMEM),
            samples::VMEM,
        ));
        interrupted()?;

        let bin = l.work.join("workloads");
        let names = samples::compile_workloads(&self.opts.samples.join("workloads"), &bin)?;
        self.p.say(format!(
            "workloads compiled with gcc: {} (they dlopen libcuda.so.1 like the CUDA runtime)",
            names.join(", ")
        ));
        if let Runtime::Docker(d) = &self.runtime {
            let imported = d.ensure_image(&l.work).map_err(DemoError::Setup)?;
            self.p.say(if imported {
                format!("imported image {} from /bin/busybox", runtime::IMAGE)
            } else {
                format!("image {} present", runtime::IMAGE)
            });
        }
        self.driver = Some(Driver::open(&l.sim_root).map_err(DemoError::Setup)?);
        interrupted()?;

        self.admit_all()?;
        self.start_all(&bin)?;
        self.wait_ready()?;
        let measured = self.measure()?;
        self.report(&measured);
        Ok(())
    }

    fn admit_all(&mut self) -> Result<(), DemoError> {
        let pods = samples::load(&self.opts.samples)?;
        let mut wanted = 0;
        let mut failures = Vec::new();
        for sp in &pods {
            let pod = self.em().create_pod(&sp.object)?;
            self.pods.push(pod.clone());
            for c in sp.containers.iter().filter(|c| c.cores > 0) {
                wanted += 1;
                match self.em().admit(&pod, &c.name, c.cores, c.memory_units) {
                    Ok(adm) => {
                        let driver = self.driver.as_ref().unwrap();
                        let gpus: Vec<usize> = adm
                            .minors()
                            .iter()
                            .filter_map(|m| driver.gpu_of_minor(*m))
                            .collect();
                        // Whole GPUs carry their full memory in the annotation: no quota.
                        let quota = if c.cores.is_multiple_of(100) {
                            0
                        } else {
                            adm.memory_bytes()
                        };
                        self.p.say(format!(
                            "admitted {}/{} container {}: {} cores on {}, {}, {}",
                            pod.namespace,
                            pod.name,
                            c.name,
                            c.cores,
                            gpus.iter()
                                .map(|g| format!("GPU{g}"))
                                .collect::<Vec<_>>()
                                .join("+"),
                            if quota > 0 {
                                format!("{} MiB memory quota", quota >> 20)
                            } else {
                                "whole GPUs".into()
                            },
                            if adm.shared() {
                                "interposer volume"
                            } else {
                                "untouched driver volume"
                            },
                        ));
                        self.admitted.push(Admitted {
                            pod: pod.clone(),
                            container: c.name.clone(),
                            cores: c.cores,
                            argv: c.argv.clone(),
                            env: c.env.clone(),
                            adm,
                            gpus,
                        });
                    }
                    Err(e) => {
                        self.p
                            .say(format!("admission of {}/{} failed: {e}", pod.name, c.name));
                        failures.push(format!("{}/{}: {e}", pod.name, c.name));
                    }
                }
                interrupted()?;
            }
        }
        let detail = if failures.is_empty() {
            format!(
                "{} pods, {} GPU containers admitted through the kubelet emulator",
                pods.len(),
                wanted
            )
        } else {
            format!(
                "{} of {wanted} admitted; {}",
                wanted - failures.len(),
                failures.join("; ")
            )
        };
        self.check("all pods admitted", failures.is_empty(), detail);
        Ok(())
    }

    fn spec(&self, a: &Admitted, bin: &Path) -> ContainerSpec {
        let sim = &self.layout.sim_root;
        // The simulated node's /dev is <sim root>/dev: where kubelet would
        // take the response's host paths from.
        let devices = a
            .adm
            .devices
            .iter()
            .map(|(host, ctr)| (sim.join(host.trim_start_matches('/')), ctr.clone()))
            .collect();
        let mut mounts: Vec<(PathBuf, String, bool)> = a
            .adm
            .mounts
            .iter()
            .map(|(h, c, ro)| (PathBuf::from(h), c.clone(), *ro))
            .collect();
        mounts.extend(runtime::base_mounts(&sim.join("run/gpu-sim"), bin));
        let mut env = vec![("PATH".to_string(), "/work:/bin:/usr/bin".to_string())];
        env.extend(a.adm.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.extend(a.env.iter().cloned());
        let labels = vec![
            ("io.kubernetes.pod.uid".into(), a.pod.uid.clone()),
            ("io.kubernetes.pod.name".into(), a.pod.name.clone()),
            (
                "io.kubernetes.pod.namespace".into(),
                a.pod.namespace.clone(),
            ),
            ("io.kubernetes.container.name".into(), a.container.clone()),
        ];
        ContainerSpec {
            key: a.key(),
            slug: format!("{}-{}", a.pod.name, a.container),
            argv: a.argv.clone(),
            env,
            labels,
            devices,
            mounts,
        }
    }

    fn start_all(&mut self, bin: &Path) -> Result<(), DemoError> {
        let specs: Vec<ContainerSpec> = self.admitted.iter().map(|a| self.spec(a, bin)).collect();
        let rt = &self.runtime;
        // In parallel: `docker run` is most of this step's time.
        let results: Vec<Result<Started, String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = specs
                .iter()
                .map(|spec| sc.spawn(move || rt.start(spec)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("start panicked".into())))
                .collect()
        });
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(s) => {
                    self.p.say(format!(
                        "started {} ({}, host pid {})",
                        s.key,
                        self.runtime.short(),
                        s.host_pid
                    ));
                    self.started.push(s);
                }
                Err(e) => {
                    self.p.say(format!("could not start a container: {e}"));
                    errors.push(e);
                }
            }
        }
        for pod in &self.pods {
            self.em().set_phase(pod, "Running");
        }
        if !errors.is_empty() {
            return Err(DemoError::Setup(format!(
                "{} container(s) did not start: {}",
                errors.len(),
                errors.join("; ")
            )));
        }
        Ok(())
    }

    /// Waits for each workload's `ready` line; reports the over-quota one.
    fn wait_ready(&mut self) -> Result<(), DemoError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut pending: Vec<usize> = (0..self.started.len()).collect();
        let mut failed = Vec::new();
        while !pending.is_empty() {
            interrupted()?;
            let mut still = Vec::new();
            for i in pending {
                let logs = self.runtime.logs(&self.started[i]);
                let key = self.started[i].key.clone();
                if let Some(l) = logs.lines().find(|l| l.starts_with("ready")) {
                    self.p.say(format!("{key}: {l}"));
                } else if logs.lines().any(|l| l.starts_with("FAIL"))
                    || !self.runtime.running(&mut self.started[i])
                {
                    let why = logs
                        .lines()
                        .last()
                        .unwrap_or("exited without output")
                        .to_string();
                    self.p.say(format!("{key} failed: {why}"));
                    failed.push(format!("{key}: {why}"));
                } else if Instant::now() > deadline {
                    failed.push(format!("{key}: not ready after 30 s"));
                } else {
                    still.push(i);
                }
            }
            pending = still;
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.check_refusal();
        if !failed.is_empty() {
            self.check("workloads ran", false, failed.join("; "));
            return Err(DemoError::Setup(
                "some workloads failed to start (see above)".into(),
            ));
        }
        Ok(())
    }
}

/// The GPU tree the manager prints at startup (stdout or stderr, between
/// its log lines), for a manager that serves no `/graph`.
fn startup_tree(l: &Layout) -> String {
    let is_log = |line: &str| {
        let b = line.as_bytes();
        b.len() > 10 && b[..4].iter().all(u8::is_ascii_digit) && b[4] == b'-'
    };
    for f in [&l.manager_out, &l.manager_log] {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let mut block = String::new();
        for line in text.lines() {
            if is_log(line) {
                if block.contains("GPU0") {
                    return block;
                }
                block.clear();
            } else if !line.trim().is_empty() {
                block.push_str(line);
                block.push('\n');
            }
        }
        if block.contains("GPU0") {
            return block;
        }
    }
    String::new()
}
