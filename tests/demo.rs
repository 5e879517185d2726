//! The README's main command end to end: the real `vcuda-demo` binary
//! (simulated node, gpu-manager, kubelet and API server emulators, the pods
//! of config/samples/ with their workloads under the interposer), in Docker
//! containers and as processes in mount namespaces. Checks its output the
//! way a person would read it, and that nothing it started is left.
//!
//! Needs `cargo build --workspace` first (vcuda-demo, gpu-sim, gpu-manager, libvcuda.so,
//! the simulated driver) and gcc.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;
use test_support::{Capability, Docker, target_dir, workspace_root};

/// One demo at a time: each measures GPU time and wants the CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

struct Demo {
    ok: bool,
    out: String,
    secs: f64,
}

fn run_demo(args: &[&str]) -> Demo {
    let bin = target_dir().join("vcuda-demo");
    assert!(
        bin.is_file(),
        "{} missing: run `cargo build --workspace` first",
        bin.display()
    );
    let t = Instant::now();
    let out = Command::new(&bin)
        .args(args)
        .output()
        .expect("run vcuda-demo");
    let secs = t.elapsed().as_secs_f64();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    eprintln!("vcuda-demo {args:?} took {secs:.1} s");
    Demo {
        ok: out.status.success(),
        out: text,
        secs,
    }
}

impl Demo {
    fn line(&self, prefix: &str) -> &str {
        self.out
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{}", self.out))
    }

    fn work_dir(&self) -> PathBuf {
        let l = self
            .out
            .lines()
            .find(|l| l.contains("] work dir "))
            .unwrap_or_else(|| panic!("no work dir line:\n{}", self.out));
        PathBuf::from(l.rsplit(' ').next().unwrap())
    }

    /// Rows of the usage table: pod -> (GPU, GPU time %).
    fn usage(&self) -> Vec<(String, String, f64)> {
        let mut rows = Vec::new();
        let mut inside = false;
        for l in self.out.lines() {
            if l.starts_with("== Usage") {
                inside = true;
                continue;
            }
            if inside && (l.starts_with("==") || l.trim().is_empty()) {
                break;
            }
            if inside && !l.starts_with("POD ") {
                let w: Vec<&str> = l.split_whitespace().collect();
                rows.push((
                    w[0].to_string(),
                    w[2].to_string(),
                    w[4].trim_end_matches('%').parse().unwrap(),
                ));
            }
        }
        rows
    }

    /// What every demo run must show, whatever the runtime.
    fn check(&self) {
        assert!(self.ok, "the demo failed:\n{}", self.out);
        for check in [
            "PASS all pods admitted:",
            "PASS refused allocation:",
            "PASS quotas held:",
            "PASS workloads ran:",
            "PASS clean shutdown:",
        ] {
            self.line(check);
        }
        assert!(!self.out.contains("\nFAIL "), "{}", self.out);
        assert!(
            self.line("demo finished in ")
                .ends_with("all checks passed"),
            "{}",
            self.out
        );
        // The memory quota: refused at the first 256 MiB step past what is
        // free of 1 GiB beside the workload's context (112 MiB on the T4
        // node: 912 MiB free, refused after 768), the card has 15 GiB.
        assert!(
            self.line("PASS refused allocation:").contains(
                "over-quota/alloc: cuMemAlloc refused with CUDA_ERROR_OUT_OF_MEMORY after 768 MiB of 912 MiB free (quota 1024 MiB"
            ),
            "{}",
            self.out
        );
        // Placement: both shares packed on one GPU, the exclusive pod on two others.
        let rows = self.usage();
        let gpu_of = |pod: &str| -> Vec<String> {
            rows.iter()
                .filter(|r| r.0 == pod)
                .map(|r| r.1.clone())
                .collect()
        };
        let (s30, s70, excl) = (
            gpu_of("share-30"),
            gpu_of("share-70"),
            gpu_of("exclusive-2gpu"),
        );
        assert_eq!(s30.len(), 1, "{}", self.out);
        assert_eq!(s30, s70, "shares on one GPU:\n{}", self.out);
        assert_eq!(excl.len(), 2, "{}", self.out);
        assert!(!excl.contains(&s30[0]), "{}", self.out);
        // The compute quotas, read from the table as a person would.
        let util = |pod: &str| rows.iter().find(|r| r.0 == pod).unwrap().2;
        assert!(
            util("share-30") <= 40.0,
            "share-30 over its 30 %:\n{}",
            self.out
        );
        assert!(
            util("share-70") <= 80.0,
            "share-70 over its 70 %:\n{}",
            self.out
        );
        assert!(
            util("share-30") > 5.0 && util("share-70") > 5.0,
            "{}",
            self.out
        );
        assert!(util("exclusive-2gpu") > 50.0, "{}", self.out);
        for section in [
            "== GPU graph",
            "== Usage",
            "== Metrics excerpt",
            "== Summary",
        ] {
            assert!(self.out.contains(section), "no {section}:\n{}", self.out);
        }
        // Nothing left behind.
        let work = self.work_dir();
        assert!(!work.exists(), "{} left behind", work.display());
        let users = processes_mentioning(&work);
        assert!(users.is_empty(), "processes left: {users:?}");
        eprintln!("demo passed in {:.1} s", self.secs);
    }
}

/// Processes whose command line mentions `path` (the demo's manager and
/// workloads all do, through their arguments or mounts).
fn processes_mentioning(path: &Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&needle)
                .then(|| format!("{}: {cmd}", e.file_name().to_string_lossy()))
        })
        .collect()
}

#[test]
fn demo_in_docker_containers() {
    let Some(docker) = Docker::get() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let demo = run_demo(&["--runtime", "docker"]);
    assert!(
        demo.out.contains("workloads run as Docker containers"),
        "{}",
        demo.out
    );
    demo.check();
    let run_id = demo
        .line("PASS clean shutdown:")
        .split("io.vcuda.demo.run=")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("no run id:\n{}", demo.out))
        .to_string();
    let left = docker.ok(&[
        "ps",
        "-a",
        "--filter",
        &format!("label=io.vcuda.demo.run={run_id}"),
        "--format",
        "{{.Names}}",
    ]);
    assert!(left.is_empty(), "containers left: {left}");
}

#[test]
fn demo_as_processes_in_mount_namespaces() {
    if !test_support::is_root() {
        test_support::missing(
            Capability::Root,
            "the demo without Docker needs root (mount namespaces)",
        );
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let demo = run_demo(&["--runtime", "namespaces", "--seconds", "4"]);
    assert!(
        demo.out.contains("processes in their own mount namespace"),
        "{}",
        demo.out
    );
    demo.check();
}

#[test]
fn demo_refuses_to_start_without_the_build_and_says_what_to_do() {
    let empty = tempfile::tempdir().unwrap();
    let demo = run_demo(&["--artifacts", empty.path().to_str().unwrap()]);
    assert!(!demo.ok);
    assert!(
        demo.out.contains("gpu-manager") && demo.out.contains("cargo build --workspace"),
        "{}",
        demo.out
    );
}

#[test]
fn samples_are_valid_kubernetes_pods() {
    use k8s_openapi::api::core::v1::Pod;
    let dir = workspace_root().join("config/samples");
    let mut seen = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let pod: Pod = serde_yaml::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not a valid Pod: {e}", f.display()));
        let spec = pod.spec.expect("spec");
        for c in &spec.containers {
            let limits = c
                .resources
                .as_ref()
                .and_then(|r| r.limits.clone())
                .unwrap_or_default();
            let q = |k: &str| limits.get(k).map(|q| q.0.clone()).unwrap_or_default();
            assert!(
                c.command
                    .as_ref()
                    .is_some_and(|c| c[0].starts_with("/work/")),
                "{}: the demo runs the command from /work",
                f.display()
            );
            let src = workspace_root()
                .join("config/samples/workloads")
                .join(format!(
                    "{}.c",
                    c.command.as_ref().unwrap()[0].trim_start_matches("/work/")
                ));
            assert!(
                src.is_file(),
                "{} has no source {}",
                f.display(),
                src.display()
            );
            seen.push((
                pod.metadata.name.clone().unwrap(),
                q("tencent.com/vcuda-core"),
                q("tencent.com/vcuda-memory"),
            ));
        }
    }
    let want = [
        ("share-30", "30", "8"),
        ("share-70", "70", "16"),
        ("exclusive-2gpu", "200", ""),
    ];
    for (name, core, mem) in want {
        assert!(
            seen.iter()
                .any(|s| s.0 == name && s.1 == core && s.2 == mem),
            "no {name} with {core} cores / {mem} memory units in {seen:?}"
        );
    }
}
