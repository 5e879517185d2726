//! Where the workloads run: Docker containers when an engine answers,
//! otherwise processes in their own mount namespace and root that look the
//! same from inside (the allocate response's devices, mounts and envs, the
//! host's glibc, the simulated driver's state at /run/gpu-sim).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The demo's own image: busybox-static as a one-binary root file system.
pub const IMAGE: &str = "vcuda-demo/busybox:latest";
/// Label on every container the demo starts; its value is the run's id.
pub const LABEL: &str = "io.vcuda.demo.run";

/// One container to start.
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    /// `pod/container`, for people.
    pub key: String,
    /// `pod-container`, for names.
    pub slug: String,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Runtime labels (Docker only): the `io.kubernetes.*` ones kubelet's
    /// Docker integration sets, which the manager reconciles with.
    pub labels: Vec<(String, String)>,
    /// (path on this machine, path in the container)
    pub devices: Vec<(PathBuf, String)>,
    /// (path on this machine, path in the container, read-only)
    pub mounts: Vec<(PathBuf, String, bool)>,
}

/// A started container.
pub struct Started {
    pub key: String,
    /// Its main process as the host sees it (what the driver reports).
    pub host_pid: u32,
    handle: Handle,
    /// Output captured when it was stopped.
    final_log: Option<String>,
}

enum Handle {
    Docker { name: String },
    Process { child: Child, log: PathBuf },
}

pub enum Runtime {
    Docker(Docker),
    /// Processes, each in a new mount namespace chrooted into
    /// `<dir>/<slug>`.
    Namespaces {
        dir: PathBuf,
    },
}

pub struct Docker {
    cli: PathBuf,
    /// DOCKER_HOST, or `None` for the CLI's default.
    host: Option<String>,
    pub version: String,
    run_id: String,
}

impl Docker {
    /// The engine named by `DOCKER_HOST`, or the default socket; `Err` says
    /// why there is none.
    pub fn detect(run_id: &str) -> Result<Docker, String> {
        let host = std::env::var("DOCKER_HOST").ok().filter(|h| !h.is_empty());
        if host.is_none() && !Path::new("/var/run/docker.sock").exists() {
            return Err("DOCKER_HOST is unset and /var/run/docker.sock does not exist".into());
        }
        // Debian's client matches Debian's engine; another one may be first on PATH.
        let cli = if Path::new("/usr/bin/docker").exists() {
            PathBuf::from("/usr/bin/docker")
        } else {
            PathBuf::from("docker")
        };
        let mut d = Docker {
            cli,
            host,
            version: String::new(),
            run_id: run_id.to_string(),
        };
        let out = d.cli(&["version", "--format", "{{.Server.Version}}"])?;
        d.version = out;
        Ok(d)
    }

    pub fn host_description(&self) -> String {
        self.host
            .clone()
            .unwrap_or_else(|| "unix:///var/run/docker.sock".into())
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.cli);
        if let Some(h) = &self.host {
            c.env("DOCKER_HOST", h);
        }
        c.stdin(Stdio::null());
        c
    }

    /// Runs the CLI; stdout on success, a message with its stderr otherwise.
    fn cli(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .command()
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.cli.display()))?;
        if !out.status.success() {
            return Err(format!(
                "docker {}: {}",
                args.first().unwrap_or(&""),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Imports the demo image from /bin/busybox unless present. Returns
    /// whether it had to.
    pub fn ensure_image(&self, scratch: &Path) -> Result<bool, String> {
        if self
            .cli(&["image", "inspect", "--format", "{{.Id}}", IMAGE])
            .is_ok()
        {
            return Ok(false);
        }
        let busybox = Path::new("/bin/busybox");
        if !busybox.is_file() {
            return Err(format!(
                "{IMAGE} is missing and there is no /bin/busybox to build it from (install busybox-static)"
            ));
        }
        let rootfs = scratch.join("image-rootfs");
        let io = |e: std::io::Error| format!("building {IMAGE} in {}: {e}", rootfs.display());
        for d in [
            "bin",
            "dev",
            "etc",
            "proc",
            "sys",
            "tmp",
            "run",
            "usr/local",
            "work",
        ] {
            std::fs::create_dir_all(rootfs.join(d)).map_err(io)?;
        }
        std::fs::copy(busybox, rootfs.join("bin/busybox")).map_err(io)?;
        for applet in ["sh", "ls", "cat", "echo", "sleep", "env", "ps", "true"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).map_err(io)?;
        }
        let tar = scratch.join("image.tar");
        let st = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .status()
            .map_err(|e| format!("cannot run tar: {e}"))?;
        if !st.success() {
            return Err(format!("tar of {} failed", rootfs.display()));
        }
        self.cli(&["import", tar.to_str().unwrap_or_default(), IMAGE])?;
        let _ = std::fs::remove_dir_all(&rootfs);
        let _ = std::fs::remove_file(&tar);
        Ok(true)
    }

    fn name(&self, slug: &str) -> String {
        format!("vcuda-demo-{}-{slug}", self.run_id)
    }

    fn run(&self, spec: &ContainerSpec) -> Result<Started, String> {
        let name = self.name(&spec.slug);
        let mut args: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--name".into(),
            name.clone(),
            "--label".into(),
            format!("{LABEL}={}", self.run_id),
            "--network".into(),
            "none".into(),
        ];
        for (k, v) in &spec.labels {
            args.push("--label".into());
            args.push(format!("{k}={v}"));
        }
        for (host, ctr) in &spec.devices {
            args.push("--device".into());
            args.push(format!("{}:{ctr}", host.display()));
        }
        for (host, ctr, ro) in &spec.mounts {
            args.push("-v".into());
            args.push(format!(
                "{}:{ctr}{}",
                host.display(),
                if *ro { ":ro" } else { "" }
            ));
        }
        for (k, v) in &spec.env {
            args.push("-e".into());
            args.push(format!("{k}={v}"));
        }
        args.push(IMAGE.into());
        args.extend(spec.argv.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.cli(&args)?;
        let pid = self
            .cli(&["inspect", "--format", "{{.State.Pid}}", &name])?
            .parse::<u32>()
            .map_err(|e| format!("docker inspect {name}: State.Pid: {e}"))?;
        Ok(Started {
            key: spec.key.clone(),
            host_pid: pid,
            handle: Handle::Docker { name },
            final_log: None,
        })
    }

    fn logs(&self, name: &str) -> String {
        match self.command().args(["logs", name]).output() {
            Ok(o) => {
                let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
                s.push_str(&String::from_utf8_lossy(&o.stderr));
                s
            }
            Err(e) => format!("(docker logs {name}: {e})"),
        }
    }

    /// Containers of this run that still exist.
    fn leftovers(&self) -> Vec<String> {
        match self.cli(&[
            "ps",
            "-a",
            "--filter",
            &format!("label={LABEL}={}", self.run_id),
            "--format",
            "{{.Names}} ({{.Status}})",
        ]) {
            Ok(s) => s.lines().map(str::to_string).collect(),
            Err(e) => vec![format!("cannot list containers: {e}")],
        }
    }
}

impl Runtime {
    pub fn describe(&self) -> String {
        match self {
            Runtime::Docker(d) => format!(
                "Docker containers (engine {} at {})",
                d.version,
                d.host_description()
            ),
            Runtime::Namespaces { .. } => {
                "processes in their own mount namespace and root (no Docker)".into()
            }
        }
    }

    pub fn short(&self) -> &'static str {
        match self {
            Runtime::Docker(_) => "docker",
            Runtime::Namespaces { .. } => "namespaces",
        }
    }

    pub fn start(&self, spec: &ContainerSpec) -> Result<Started, String> {
        match self {
            Runtime::Docker(d) => d.run(spec),
            Runtime::Namespaces { dir } => spawn_in_namespace(spec, &dir.join(&spec.slug)),
        }
    }

    /// Everything it printed so far (stdout and stderr).
    pub fn logs(&self, s: &Started) -> String {
        if let Some(l) = &s.final_log {
            return l.clone();
        }
        match (&s.handle, self) {
            (Handle::Docker { name }, Runtime::Docker(d)) => d.logs(name),
            (Handle::Process { log, .. }, _) => std::fs::read_to_string(log).unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Stops every container (SIGTERM, then SIGKILL after `grace`), keeps
    /// their output and removes them. Returns notes on anything unusual.
    pub fn stop_all(&self, started: &mut [Started], grace: Duration) -> Vec<String> {
        let mut notes = Vec::new();
        match self {
            Runtime::Docker(d) => {
                let names: Vec<String> = started
                    .iter()
                    .filter_map(|s| match &s.handle {
                        Handle::Docker { name } => Some(name.clone()),
                        _ => None,
                    })
                    .collect();
                if names.is_empty() {
                    return notes;
                }
                let t = grace.as_secs().max(1).to_string();
                let mut args = vec!["stop", "-t", &t];
                args.extend(names.iter().map(String::as_str));
                if let Err(e) = d.cli(&args) {
                    notes.push(e);
                }
                for s in started.iter_mut() {
                    if let Handle::Docker { name } = &s.handle {
                        s.final_log = Some(d.logs(name));
                    }
                }
                let mut args = vec!["rm", "-f"];
                args.extend(names.iter().map(String::as_str));
                if let Err(e) = d.cli(&args) {
                    notes.push(e);
                }
            }
            Runtime::Namespaces { .. } => {
                for s in started.iter() {
                    if let Handle::Process { child, .. } = &s.handle {
                        // SAFETY: SIGTERM to our own child, not yet reaped (its PID is still ours).
                        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                    }
                }
                let t = Instant::now();
                for s in started.iter_mut() {
                    let Handle::Process { child, log } = &mut s.handle else {
                        continue;
                    };
                    loop {
                        match child.try_wait() {
                            Ok(Some(_)) => break,
                            Ok(None) if t.elapsed() < grace => {
                                std::thread::sleep(Duration::from_millis(20))
                            }
                            _ => {
                                notes.push(format!("{} ignored SIGTERM; killed", s.key));
                                let _ = child.kill();
                                let _ = child.wait();
                                break;
                            }
                        }
                    }
                    s.final_log = Some(std::fs::read_to_string(log).unwrap_or_default());
                }
            }
        }
        notes
    }

    /// What is still there of this run's containers after `stop_all`.
    pub fn leftovers(&self, started: &mut [Started]) -> Vec<String> {
        match self {
            Runtime::Docker(d) => d.leftovers(),
            Runtime::Namespaces { .. } => started
                .iter_mut()
                .filter_map(|s| match &mut s.handle {
                    Handle::Process { child, .. } => matches!(child.try_wait(), Ok(None))
                        .then(|| format!("{} (pid {})", s.key, child.id())),
                    _ => None,
                })
                .collect(),
        }
    }

    /// Whether it is still running (false once its program exited).
    pub fn running(&self, s: &mut Started) -> bool {
        match (&mut s.handle, self) {
            (Handle::Process { child, .. }, _) => matches!(child.try_wait(), Ok(None)),
            (Handle::Docker { name }, Runtime::Docker(d)) => d
                .cli(&["inspect", "--format", "{{.State.Running}}", name])
                .is_ok_and(|s| s == "true"),
            _ => false,
        }
    }
}

/// The mounts every demo container gets besides the allocate response's:
/// the host's glibc (the workloads are built here and the driver libraries
/// need it; the image is busybox-static), the simulated driver's shared state
/// (the simulated libcuda finds its node at /run/gpu-sim, as the real one
/// finds /dev and /proc/driver/nvidia) and the workloads at /work.
pub fn base_mounts(sim_state: &Path, workloads: &Path) -> Vec<(PathBuf, String, bool)> {
    let mut v = Vec::new();
    for (host, ctr) in [
        ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"),
        ("/usr/lib64", "/lib64"),
    ] {
        if Path::new(host).exists() {
            v.push((PathBuf::from(host), ctr.to_string(), true));
        }
    }
    v.push((sim_state.to_path_buf(), "/run/gpu-sim".into(), false));
    v.push((workloads.to_path_buf(), "/work".into(), true));
    v
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{} has a NUL byte", p.display()))
}

/// Everything the child does between fork and exec, prepared beforehand so
/// the child only makes system calls (no allocation after fork).
struct NsPlan {
    root: CString,
    binds: Vec<(CString, CString, bool)>,
    dev: CString,
    /// (path, mode incl. file type, rdev)
    nodes: Vec<(CString, libc::mode_t, libc::dev_t)>,
    proc_dir: CString,
    tmpfs: CString,
    proc_fs: CString,
    dev_opts: CString,
    slash: CString,
}

fn spawn_in_namespace(spec: &ContainerSpec, root: &Path) -> Result<Started, String> {
    let io = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    let inside = |ctr: &str| root.join(ctr.trim_start_matches('/'));
    for d in ["dev", "proc", "tmp", "bin"] {
        let p = root.join(d);
        std::fs::create_dir_all(&p).map_err(|e| io("creating", &p, e))?;
    }
    let mut binds = Vec::new();
    for (host, ctr, ro) in &spec.mounts {
        let target = inside(ctr);
        std::fs::create_dir_all(&target).map_err(|e| io("creating", &target, e))?;
        binds.push((cstr(host)?, cstr(&target)?, *ro));
    }
    let mut nodes = Vec::new();
    for (host, ctr) in &spec.devices {
        let md = std::fs::metadata(host).map_err(|e| io("device", host, e))?;
        let (kind, rdev) = if md.file_type().is_char_device() {
            (libc::S_IFCHR, md.rdev() as libc::dev_t)
        } else {
            // A root without mknod rights has plain files as device nodes.
            (libc::S_IFREG, 0)
        };
        nodes.push((cstr(&inside(ctr))?, kind | 0o666, rdev));
    }
    let plan = NsPlan {
        root: cstr(root)?,
        binds,
        dev: cstr(&root.join("dev"))?,
        nodes,
        proc_dir: cstr(&root.join("proc"))?,
        tmpfs: c"tmpfs".to_owned(),
        proc_fs: c"proc".to_owned(),
        dev_opts: c"mode=755".to_owned(),
        slash: c"/".to_owned(),
    };
    let log = root.with_extension("log");
    let out = std::fs::File::create(&log).map_err(|e| io("creating", &log, e))?;
    let err = out.try_clone().map_err(|e| io("opening", &log, e))?;
    let mut cmd = Command::new(&spec.argv[0]);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    // SAFETY: the closure only makes system calls on memory prepared above.
    unsafe {
        cmd.pre_exec(move || enter(&plan));
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("starting {} in a mount namespace: {e}", spec.key))?;
    Ok(Started {
        key: spec.key.clone(),
        host_pid: child.id(),
        handle: Handle::Process { child, log },
        final_log: None,
    })
}

/// In the child: a private mount namespace, the container's mounts, a fresh
/// /dev with only its device nodes, /proc, then chroot.
fn enter(p: &NsPlan) -> std::io::Result<()> {
    fn ok(r: libc::c_int) -> std::io::Result<()> {
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    let null = std::ptr::null::<libc::c_char>();
    // SAFETY: runs in the forked child before exec: only async-signal-safe calls (unshare, mount) on NUL-terminated literals and NULL.
    unsafe {
        ok(libc::unshare(libc::CLONE_NEWNS))?;
        // Nothing mounted here may propagate back to the host.
        ok(libc::mount(
            null,
            p.slash.as_ptr(),
            null,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        for (src, dst, ro) in &p.binds {
            ok(libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                null,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ))?;
            if *ro {
                ok(libc::mount(
                    null,
                    dst.as_ptr(),
                    null,
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                    std::ptr::null(),
                ))?;
            }
        }
        ok(libc::mount(
            p.tmpfs.as_ptr(),
            p.dev.as_ptr(),
            p.tmpfs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            p.dev_opts.as_ptr().cast(),
        ))?;
        for (path, mode, rdev) in &p.nodes {
            ok(libc::mknod(path.as_ptr(), *mode, *rdev))?;
        }
        ok(libc::mount(
            p.proc_fs.as_ptr(),
            p.proc_dir.as_ptr(),
            p.proc_fs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        ))?;
        ok(libc::chroot(p.root.as_ptr()))?;
        ok(libc::chdir(p.slash.as_ptr()))?;
    }
    Ok(())
}
