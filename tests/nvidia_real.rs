//! Issue 20: NVIDIA's real user-space drivers as the oracle (535.261.03 from
//! bookworm, 550.163.01 from trixie, unpacked from Debian non-free by
//! tests/nvidia/fetch.sh; tests/nvidia/README.md). Without a GPU they load,
//! `cuInit` answers CUDA_ERROR_NO_DEVICE and NVML's init fails; the
//! interposer, over them, must fail in exactly the same way:
//!
//! * the real `nvidia-smi` over the interposer as `libnvidia-ml.so.1`;
//! * NVIDIA's real CUDA runtime (`libcudart.so.12`, 12.4) over the
//!   interposer as `libcuda.so.1` (tests/c/cudart_nodev.c);
//! * every wrapped driver-API and NVML entry point's status
//!   (tests/c/driver_nodev.c);
//! * the vdriver mirror of a Debian host (`nvidia/current` behind the
//!   `nvidia` alternative) and of a .run-installer host, and the same two
//!   programs over the mirrored tree.
//!
//! Needs `cargo build -p cuda-shim` (libvcuda.so) and root for `ldconfig -r`.

use server::{Event, TestManager};
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::nvidia::hosts;
use test_support::shim::server;
use test_support::{Capability, NvidiaDriver, missing, nvidia_drivers, target_dir, workspace_root};

const GIB: u64 = 1 << 30;

/// The interposer under test: this profile's build, or `$VCUDA_INTERPOSER`
/// (the shipped glibc-2.17 build), as in the shim tests.
fn interposer() -> PathBuf {
    let p = std::env::var_os("VCUDA_INTERPOSER")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("libvcuda.so"));
    assert!(
        p.is_file(),
        "{} missing: cargo build -p cuda-shim",
        p.display()
    );
    p
}

/// How a process ended and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `program` with the interposer's logging off, as in production.
fn cmd(program: &Path) -> Command {
    let mut c = Command::new(program);
    c.env_remove("LOGGER_LEVEL");
    c
}

fn outcome(cmd: &mut Command) -> Outcome {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    Outcome {
        code: out.status.code(),
        signal: out.status.signal(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// What the dynamic linker or a tool says when a symbol or a version is
/// missing: never acceptable over the interposer.
fn assert_no_link_error(what: &str, o: &Outcome) {
    for bad in [
        "symbol lookup error",
        "undefined symbol",
        "version `",
        "Function Not Found",
        "cannot open shared object",
    ] {
        assert!(
            !o.stdout.contains(bad) && !o.stderr.contains(bad),
            "{what}: {bad:?} in {o:#?}"
        );
    }
}

/// A directory laid out as the vdriver mirror's `nvidia/lib64`: the
/// interposer hard-linked under `libcuda.so{,.1}` and
/// `libnvidia-ml.so{,.1}`, the real `libcuda.so.<v>` /
/// `libnvidia-ml.so.<v>` beside it (hard links of the package's files).
fn shim_dir(parent: &Path, d: &NvidiaDriver) -> PathBuf {
    let dir = parent.join(format!("shim-{}", d.version));
    fs::create_dir_all(&dir).unwrap();
    let shim = dir.join("libvcuda.so");
    fs::copy(interposer(), &shim).unwrap();
    for name in INTERPOSED {
        fs::hard_link(&shim, dir.join(name)).unwrap();
    }
    fs::remove_file(&shim).unwrap();
    for real in [d.libcuda(), d.libnvml()] {
        let dst = dir.join(real.file_name().unwrap());
        if fs::hard_link(&real, &dst).is_err() {
            fs::copy(&real, &dst).unwrap();
        }
    }
    dir
}

/// The names the interposer takes in a shared volume (cuda-shim/README.md),
/// spelled out here rather than taken from vdriver's plan under test.
const INTERPOSED: [&str; 4] = [
    "libcuda.so.1",
    "libcuda.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
];

/// The container the interposer runs in: its `VCUDA_CONFIG_DIR`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No vcuda.config: the interposer fails closed (by design).
    NoConfig,
    /// enable = 0.
    PassThrough,
    /// A 1 GiB, 50 % hard quota with a manager to register with.
    Enforcing,
}

struct Vm {
    dir: tempfile::TempDir,
    manager: Option<TestManager>,
}

impl Vm {
    fn new(mode: Mode, d: &NvidiaDriver) -> Vm {
        let dir = tempfile::tempdir().unwrap();
        let mut parts = d.version.split('.').map(|p| p.parse::<i32>().unwrap());
        let version = (parts.next().unwrap(), parts.next().unwrap());
        let manager = match mode {
            Mode::NoConfig => None,
            Mode::PassThrough => {
                server::write_config(dir.path(), GIB, version, false);
                None
            }
            Mode::Enforcing => {
                server::write_config(dir.path(), GIB, version, true);
                Some(TestManager::start(dir.path(), GIB))
            }
        };
        Vm { dir, manager }
    }

    fn command(&self, program: &Path, lib_path: &str) -> Command {
        let mut c = cmd(program);
        c.env("LD_LIBRARY_PATH", lib_path)
            .env("VCUDA_CONFIG_DIR", self.dir.path());
        c
    }

    /// Programs that registered with this container's manager.
    fn registered(&self) -> Vec<String> {
        let Some(m) = &self.manager else {
            return Vec::new();
        };
        m.events()
            .into_iter()
            .filter_map(|e| match e {
                Event::Registered { program, .. } => Some(program),
                _ => None,
            })
            .collect()
    }
}

fn lib_path(dirs: &[&Path]) -> String {
    std::env::join_paths(dirs).unwrap().into_string().unwrap()
}

/// nvidia-smi command lines: the default table and the queries tools and
/// people run (each its own path through NVML before the driver is found
/// missing).
const SMI_ARGS: [&[&str]; 6] = [
    &[],
    &["-L"],
    &["-q"],
    &["--query-gpu=name,memory.total,memory.used", "--format=csv"],
    &["topo", "-m"],
    &["pmon", "-c", "1"],
];

/// The real nvidia-smi over its own real NVML, without a GPU. nvidia-smi(1),
/// RETURN VALUE: "Return code 9 - NVIDIA driver is not loaded".
fn smi_oracle(d: &NvidiaDriver, args: &[&str]) -> Outcome {
    let o = outcome(
        cmd(&d.nvidia_smi())
            .args(args)
            .env("LD_LIBRARY_PATH", d.lib_dir()),
    );
    assert_eq!(o.code, Some(9), "the oracle itself, {args:?}: {o:#?}");
    assert!(
        o.stdout
            .contains("couldn't communicate with the NVIDIA driver"),
        "{o:#?}"
    );
    o
}

/// `smi` over the interposer in `lib64` answers exactly as the real one
/// over the real NVML, for each of [`SMI_ARGS`], in every container mode
/// (NVML never registers, so a missing config does not change nvidia-smi's
/// answer either), and it was the interposer that answered: with logging on
/// it says which real NVML it loaded.
fn check_smi(what: &str, smi: &Path, lib64: &Path, d: &NvidiaDriver) {
    let lp = lib_path(&[lib64]);
    for args in SMI_ARGS {
        let oracle = smi_oracle(d, args);
        for mode in [Mode::NoConfig, Mode::PassThrough, Mode::Enforcing] {
            let vm = Vm::new(mode, d);
            let got = outcome(vm.command(smi, &lp).args(args));
            assert_eq!(got, oracle, "{what}: nvidia-smi {args:?} {mode:?}");
            assert_no_link_error(what, &got);
            assert!(vm.registered().is_empty(), "{what}: NVML registered");
        }
    }
    let vm = Vm::new(Mode::Enforcing, d);
    let traced = outcome(vm.command(smi, &lp).env("LOGGER_LEVEL", "debug"));
    let real = lib64.join(format!("libnvidia-ml.so.{}", d.version));
    assert!(
        traced
            .stderr
            .contains(&format!("loaded the real driver {}", real.display())),
        "{what}: the interposer did not load {}: {traced:#?}",
        real.display()
    );
}

#[test]
fn nvidia_smi_over_the_interposer_fails_as_over_the_real_library() {
    let drivers = nvidia_drivers();
    let work = tempfile::tempdir().unwrap();
    for d in &drivers {
        let lib64 = shim_dir(work.path(), d);
        check_smi(&d.version, &d.nvidia_smi(), &lib64, d);
        let oracle = smi_oracle(d, &[]);
        eprintln!(
            "{}: nvidia-smi exit {:?}, {:?} (real NVML and interposer alike)",
            d.version,
            oracle.code,
            oracle.stdout.trim()
        );
    }
}

/// tests/c/cudart_nodev.c linked with the real `libcudart.so.12`.
fn cudart_program(cudart: &Path, out: &Path) -> PathBuf {
    let src = workspace_root().join("tests/c/cudart_nodev.c");
    let bin = out.join("cudart_nodev");
    let st = Command::new("gcc")
        .arg("-O1")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .arg(cudart)
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
    bin
}

/// The status the program printed for `call`.
fn status(o: &Outcome, call: &str) -> i32 {
    o.stdout
        .lines()
        .find_map(|l| l.strip_prefix(call)?.strip_prefix(' '))
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {call} line: {o:#?}"))
}

/// Ran to the end: exit 0, no signal, "done" printed.
fn assert_clean(what: &str, o: &Outcome) {
    assert!(
        o.code == Some(0) && o.signal.is_none() && o.stdout.ends_with("done\n"),
        "{what}: {o:#?}"
    );
}

/// The runtime program over the real driver alone: a clean
/// cudaErrorNoDevice (100), or cudaErrorInsufficientDriver (35) where the
/// driver's CUDA is older than the runtime's.
fn cudart_oracle(prog: &Path, cudart_dir: &Path, d: &NvidiaDriver) -> Outcome {
    let o = outcome(cmd(prog).env("LD_LIBRARY_PATH", lib_path(&[cudart_dir, &d.lib_dir()])));
    assert_clean(&format!("{} oracle", d.version), &o);
    let s = status(&o, "cudaGetDeviceCount");
    assert!(s == 100 || s == 35, "{}: {o:#?}", d.version);
    o
}

/// The runtime program over the interposer in `lib64` answers as `oracle`,
/// enforcing (registered with the manager first) and in pass-through; with
/// no config it fails closed: cudaErrorNotPermitted (800), cleanly.
fn check_cudart(
    what: &str,
    prog: &Path,
    cudart_dir: &Path,
    lib64: &Path,
    d: &NvidiaDriver,
    oracle: &Outcome,
) {
    let lp = lib_path(&[cudart_dir, lib64]);
    for mode in [Mode::Enforcing, Mode::PassThrough] {
        let vm = Vm::new(mode, d);
        let got = outcome(&mut vm.command(prog, &lp));
        assert_eq!(&got, oracle, "{what}: cudart {mode:?}");
        assert_no_link_error(what, &got);
        if mode == Mode::Enforcing {
            // The interposer really was in the path: cuInit registered.
            let reg = vm.registered();
            assert!(
                reg.iter().any(|p| p.contains("cudart_nodev")),
                "{what}: no registration: {reg:?}"
            );
        }
    }
    let vm = Vm::new(Mode::NoConfig, d);
    let closed = outcome(&mut vm.command(prog, &lp));
    assert_clean(&format!("{what} without a config"), &closed);
    assert_eq!(status(&closed, "cudaGetDeviceCount"), 800, "{closed:#?}");
    assert!(closed.stderr.contains("no GPU quota"), "{closed:#?}");
}

#[test]
fn cudart_over_the_interposer_answers_as_the_real_driver() {
    let drivers = nvidia_drivers();
    let Some(cudart) = drivers.iter().find_map(NvidiaDriver::libcudart) else {
        if !drivers.is_empty() {
            missing(
                Capability::NvidiaDrivers,
                "no libcudart.so.12 in VCUDA_NVIDIA_ROOTS (trixie's root carries it)",
            );
        }
        return;
    };
    let cudart_dir = cudart.parent().unwrap().to_path_buf();
    let work = tempfile::tempdir().unwrap();
    let prog = cudart_program(&cudart, work.path());
    for d in &drivers {
        let oracle = cudart_oracle(&prog, &cudart_dir, d);
        let lib64 = shim_dir(work.path(), d);
        check_cudart(&d.version, &prog, &cudart_dir, &lib64, d, &oracle);
        eprintln!(
            "{}: cudart 12.4 cudaGetDeviceCount {} / cudaMalloc {} (real driver and interposer alike)",
            d.version,
            status(&oracle, "cudaGetDeviceCount"),
            status(&oracle, "cudaMalloc")
        );
    }
}

/// tests/c/driver_nodev.c: every wrapped driver-API and NVML entry point,
/// before and after a failing cuInit / nvmlInit_v2, through whatever
/// libcuda.so.1 / libnvidia-ml.so.1 the library path gives.
fn driver_program(out: &Path) -> PathBuf {
    let src = workspace_root().join("tests/c/driver_nodev.c");
    let bin = out.join("driver_nodev");
    let st = Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-ldl")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
    bin
}

/// The interposer's wrappers hand the real driver's statuses back
/// unchanged: NOT_INITIALIZED (3) before cuInit, INVALID_HANDLE (400) or
/// NOT_INITIALIZED after cuInit's NO_DEVICE (100), NVML's UNINITIALIZED
/// (1) — also where they withhold an answer (another tenant's PID) or
/// reserve quota before calling the driver. Enforcing (the first enforced
/// call registers) and pass-through, line for line the real driver's.
#[test]
fn driver_api_statuses_over_the_interposer_are_the_real_drivers() {
    let drivers = nvidia_drivers();
    let work = tempfile::tempdir().unwrap();
    let prog = driver_program(work.path());
    for d in &drivers {
        let lib64 = shim_dir(work.path(), d);
        let n = check_driver_api(&d.version, &prog, &lib64, d);
        eprintln!(
            "{}: {n} driver-API / NVML statuses as the real driver's",
            d.version
        );
    }
}

/// driver_nodev over the interposer in `lib64` prints the real driver's
/// lines; returns how many statuses were compared.
fn check_driver_api(what: &str, prog: &Path, lib64: &Path, d: &NvidiaDriver) -> usize {
    let oracle = outcome(cmd(prog).env("LD_LIBRARY_PATH", d.lib_dir()));
    assert_clean(&format!("{what} oracle"), &oracle);
    let lp = lib_path(&[lib64]);
    for mode in [Mode::Enforcing, Mode::PassThrough] {
        let vm = Vm::new(mode, d);
        let got = outcome(&mut vm.command(prog, &lp));
        let differ: Vec<(&str, &str)> = oracle
            .stdout
            .lines()
            .zip(got.stdout.lines())
            .filter(|(a, b)| a != b)
            .collect();
        assert!(
            differ.is_empty(),
            "{what}: {mode:?}: (NVIDIA's, ours): {differ:#?}"
        );
        assert_eq!(got, oracle, "{what}: driver API {mode:?}");
        if mode == Mode::Enforcing {
            assert!(!vm.registered().is_empty(), "{what}: no registration");
        }
    }
    oracle.stdout.lines().count() - 1
}

fn ino(p: &Path) -> (u64, u64) {
    let m = fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.dev(), m.ino())
}

/// Same content: the same inode (a hard link), or equal bytes (a copy).
fn same_file(a: &Path, b: &Path) -> bool {
    ino(a) == ino(b) || fs::read(a).unwrap() == fs::read(b).unwrap()
}

fn link_target(p: &Path) -> String {
    fs::read_link(p)
        .unwrap_or_else(|e| panic!("{} is not a link: {e}", p.display()))
        .to_string_lossy()
        .into_owned()
}

/// What each volume must hold for `d`: the binaries and libraries of
/// config/volume.conf that the packages carry, with their sonames and
/// unversioned links; nothing else.
fn expected_files(d: &NvidiaDriver) -> BTreeSet<PathBuf> {
    let v = &d.version;
    let mut s = BTreeSet::from([PathBuf::from("bin/nvidia-smi")]);
    for (base, soname) in [
        ("libcuda.so", "libcuda.so.1"),
        ("libnvidia-ml.so", "libnvidia-ml.so.1"),
        (
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-ptxjitcompiler.so.1",
        ),
    ] {
        for name in [format!("{base}.{v}"), soname.to_owned(), base.to_owned()] {
            s.insert(Path::new("lib64").join(name));
        }
    }
    s
}

/// Mirrors `root` as the manager does (`vdriver::mirror` with
/// config/volume.conf and the interposer) and checks both volumes file by
/// file, then runs nvidia-smi and the two C programs over the mirror.
fn check_mirror(layout: &str, root: &Path, d: &NvidiaDriver, work: &Path, progs: &Programs) {
    let what = format!("{layout} {}", d.version);
    let shim = work.join(format!("libvcuda-{layout}-{}.so", d.version));
    fs::copy(interposer(), &shim).unwrap();
    let config = vdriver::VolumeConfig::load(&workspace_root().join("config/volume.conf")).unwrap();
    let vdir = work.join(format!("vdriver-{layout}-{}", d.version));
    let report = vdriver::mirror(root, &config, &vdir, Some(&shim))
        .unwrap_or_else(|e| panic!("{what}: mirror: {e}"));
    assert_eq!(report.driver_version.to_string(), d.version, "{what}");
    let want = expected_files(d);
    let v = &d.version;
    let real = |name: &str| -> PathBuf {
        if name == "nvidia-smi" {
            d.nvidia_smi()
        } else {
            d.lib_dir().join(name)
        }
    };
    for vol in ["origin", "nvidia"] {
        let r = report.volume(vol).unwrap();
        let got: BTreeSet<PathBuf> = r.files.iter().cloned().collect();
        assert_eq!(got, want, "{what}: {vol} holds exactly these");
        let dir = &r.path;
        for rel in &want {
            let p = dir.join(rel);
            let name = rel.file_name().unwrap().to_str().unwrap();
            let interposed = vol == "nvidia" && INTERPOSED.contains(&name);
            let meta = fs::symlink_metadata(&p).unwrap();
            if interposed {
                // The interposer, one inode under the four names.
                assert!(meta.is_file(), "{what}: {vol}/{} is a file", rel.display());
                assert_eq!(ino(&p), ino(&shim), "{what}: {vol}/{}", rel.display());
            } else if name.ends_with(v.as_str()) || name == "nvidia-smi" {
                // The real file, untouched.
                assert!(meta.is_file(), "{what}: {vol}/{}", rel.display());
                assert!(
                    same_file(&p, &real(name)),
                    "{what}: {vol}/{} is not NVIDIA's",
                    rel.display()
                );
            } else {
                // A soname or unversioned link to the real file beside it.
                let stem = name.split(".so").next().unwrap();
                assert_eq!(
                    link_target(&p),
                    format!("{stem}.so.{v}"),
                    "{what}: {vol}/{}",
                    rel.display()
                );
            }
        }
    }
    // The mirrored tree loads: the interposer finds the real driver beside
    // it and answers as NVIDIA's own libraries do.
    let shared = report.volume("nvidia").unwrap().path.clone();
    let origin = report.volume("origin").unwrap().path.clone();
    assert_eq!(
        outcome(cmd(&origin.join("bin/nvidia-smi")).env("LD_LIBRARY_PATH", origin.join("lib64"))),
        smi_oracle(d, &[]),
        "{what}: origin"
    );
    check_smi(
        &what,
        &shared.join("bin/nvidia-smi"),
        &shared.join("lib64"),
        d,
    );
    check_driver_api(&what, &progs.driver, &shared.join("lib64"), d);
    if let Some((prog, cudart_dir)) = &progs.cudart {
        let oracle = cudart_oracle(prog, cudart_dir, d);
        check_cudart(&what, prog, cudart_dir, &shared.join("lib64"), d, &oracle);
    }
}

/// The C programs run over a mirrored tree.
struct Programs {
    driver: PathBuf,
    /// cudart_nodev and the directory of the `libcudart.so.12` it links.
    cudart: Option<(PathBuf, PathBuf)>,
}

fn mirror_layout(layout: &str, build: fn(&Path, &NvidiaDriver) -> PathBuf) {
    let drivers = nvidia_drivers();
    if drivers.is_empty() {
        return;
    }
    if !test_support::is_root() {
        missing(Capability::Root, "ldconfig -r needs root");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let progs = Programs {
        driver: driver_program(work.path()),
        cudart: drivers.iter().find_map(NvidiaDriver::libcudart).map(|c| {
            let prog = cudart_program(&c, work.path());
            (prog, c.parent().unwrap().to_path_buf())
        }),
    };
    for d in &drivers {
        let root = build(work.path(), d);
        check_mirror(layout, &root, d, work.path(), &progs);
    }
}

#[test]
fn vdriver_mirrors_the_debian_alternatives_layout() {
    mirror_layout("debian", hosts::debian);
}

#[test]
fn vdriver_mirrors_the_run_installer_layout() {
    mirror_layout("run", hosts::run_installer);
}
