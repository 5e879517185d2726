//! NVIDIA's real user-space drivers (535 and 550, unpacked from Debian
//! non-free by tests/nvidia/fetch.sh) as the oracle for what the interposer
//! must look like to programs, checked for every driver the suite carries:
//!
//! * exports: every function the real `libcuda.so` and `libnvidia-ml.so`
//!   export, the interposer exports too (their data symbols excepted, by a
//!   documented list);
//! * `cuGetProcAddress` / `_v2`, for every base name, version and flag of
//!   NVIDIA's headers (cuda-abi's table supplies only the *questions*), every
//!   exported name asked for as itself, unknown and empty names and a bad
//!   flag: the interposer over the real driver answers with the real driver's
//!   status and `symbolStatus`, and with the same exported symbol — its own
//!   wrapper of it where it enforces that symbol, the driver's own pointer
//!   where it does not. Which symbols must be enforced is this file's list,
//!   not the interposer's.
//!
//! Without a GPU the real drivers load and answer `cuGetProcAddress` before
//! `cuInit` (which answers `CUDA_ERROR_NO_DEVICE`), so all of this runs on CI.

use goblin::elf::Elf;
use goblin::elf::sym::{STB_GLOBAL, STB_WEAK, STT_FUNC, STT_OBJECT};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use test_support::{NvidiaDriver, nvidia_drivers, target_dir, workspace_root};

/// The real libcuda's data objects, which the interposer does not export on
/// purpose (crates/formats/cuda-abi/symbols/gen.py): the CUDA debugger's variables,
/// which cuda-gdb writes by symbol lookup; a copy in the interposer would
/// shadow the driver's. The same 20 in 535 and 550.
const DATA_SYMBOLS: &[&str] = &[
    "cudbgApiClientPid",
    "cudbgApiClientRevision",
    "cudbgAttachHandlerAvailable",
    "cudbgDebuggerCapabilities",
    "cudbgDebuggerInitialized",
    "cudbgDetachSuspendedDevicesMask",
    "cudbgEnableIntegratedMemcheck",
    "cudbgEnableLaunchBlocking",
    "cudbgEnablePreemptionDebugging",
    "cudbgInjectionPath",
    "cudbgIpcFlag",
    "cudbgReportDriverApiErrorFlags",
    "cudbgReportedDriverApiErrorCode",
    "cudbgReportedDriverApiErrorFuncNameAddr",
    "cudbgReportedDriverApiErrorFuncNameSize",
    "cudbgReportedDriverInternalErrorCode",
    "cudbgResumeForAttachDetach",
    "cudbgRpcEnabled",
    "cudbgSessionId",
    "cudbgUseExternalDebugger",
];

/// Functions whose every answer must be the interposer's wrapper, as base
/// names (each `_vN`, `_ptsz`, `_ptds` variant included): device memory that
/// counts against the quota, contexts (charged and registered), launches and
/// graph launches (the compute quota), and the memory views (the quota's
/// size). Host allocations (`cuMemAllocHost`) are not on the list.
const MUST_ENFORCE: &[&str] = &[
    "cuMemAlloc",
    "cuMemAllocPitch",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemCreate",
    "cuMemGetInfo",
    "cuCtxCreate",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceTotalMem",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
    "cuGraphInstantiate",
    "cuGraphInstantiateWithFlags",
    "cuGraphInstantiateWithParams",
];

/// "cuMemAlloc_v2" -> "cuMemAlloc", "cuLaunchKernel_ptsz" -> "cuLaunchKernel".
fn base_name(symbol: &str) -> &str {
    let s = symbol
        .strip_suffix("_ptsz")
        .or_else(|| symbol.strip_suffix("_ptds"))
        .unwrap_or(symbol);
    match s.rsplit_once("_v") {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => s,
    }
}

/// The interposer under test: `VCUDA_INTERPOSER` (tests/run.sh sets it to
/// the shipped glibc-2.17 build on a second pass), else this profile's.
fn interposer() -> PathBuf {
    std::env::var_os("VCUDA_INTERPOSER")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("libvcuda.so"))
}

/// (name, is a function) of every defined global dynamic symbol.
fn dynamic_symbols(path: &Path) -> BTreeMap<String, (bool, u64)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let elf = Elf::parse(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    elf.dynsyms
        .iter()
        .filter(|s| s.st_shndx != 0 && matches!(s.st_bind(), STB_GLOBAL | STB_WEAK))
        .filter(|s| matches!(s.st_type(), STT_FUNC | STT_OBJECT))
        .filter_map(|s| {
            let name = elf.dynstrtab.get_at(s.st_name)?.to_string();
            Some((name, (s.st_type() == STT_FUNC, s.st_size)))
        })
        .collect()
}

#[test]
fn the_interposer_exports_every_function_the_real_drivers_export() {
    let ours = dynamic_symbols(&interposer());
    for d in nvidia_drivers() {
        for real in [d.libcuda(), d.libnvml()] {
            let theirs = dynamic_symbols(&real);
            let missing: Vec<&String> = theirs
                .iter()
                .filter(|(n, (func, _))| *func && !ours.contains_key(*n))
                .map(|(n, _)| n)
                .collect();
            assert!(
                missing.is_empty(),
                "{} exports functions the interposer does not: {missing:?}",
                real.display()
            );
            let data: BTreeSet<&str> = theirs
                .iter()
                .filter(|(_, (func, _))| !func)
                .map(|(n, _)| n.as_str())
                .collect();
            let listed: BTreeSet<&str> = DATA_SYMBOLS.iter().copied().collect();
            if real == d.libcuda() {
                assert_eq!(data, listed, "{}'s data symbols", real.display());
            } else {
                assert!(data.is_empty(), "{}: data symbols {data:?}", real.display());
            }
            for n in &data {
                assert!(
                    !ours.contains_key(*n),
                    "the interposer exports {n}, a data symbol"
                );
            }
        }
    }
}

/// One query: (name, cudaVersion, flags); "-" is the empty name.
type Query = (String, i32, u64);

/// Every base name of NVIDIA's headers (cuda-abi's table, only as the list of
/// questions) at each version a variant was introduced, just below it, and a
/// grid of released versions (some above either driver's own), each with no
/// flag, the legacy and the per-thread flag; every exported name as itself;
/// unknown and empty names; an undefined flag.
fn queries() -> Vec<Query> {
    const GRID: &[i32] = &[
        1000, 2000, 3020, 4000, 9020, 10000, 11000, 11030, 11040, 12000, 12020, 12040, 12080, 13000,
    ];
    let mut q = BTreeSet::new();
    for p in cuda_abi::procs() {
        let intro = p.plain.iter().chain(p.per_thread).map(|&(v, _)| v);
        let versions: BTreeSet<i32> = intro
            .flat_map(|v| [v, v - 10])
            .chain(GRID.iter().copied())
            .collect();
        for v in versions {
            for flags in [0, 1, 2] {
                q.insert((p.name.to_string(), v, flags));
            }
        }
        q.insert((p.name.to_string(), 12000, 4));
    }
    for n in cuda_abi::libcuda_symbols() {
        q.insert((n.to_string(), 12000, 0));
    }
    for n in [
        "cuNoSuchFunction",
        "-",
        "nvmlInit_v2",
        "cuMemAlloc_v9",
        "cuMemAlloc_v2",
    ] {
        q.insert((n.to_string(), 12000, 0));
    }
    q.into_iter().collect()
}

/// What one library answered: "R2 STATUS2 WHAT2 R1 WHAT1" (tests/c/procaddr_oracle.c).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    r2: i32,
    status: i32,
    what2: String,
    r1: i32,
    what1: String,
}

/// tests/c/procaddr_oracle.c, built into a directory removed when the
/// returned guard drops.
fn oracle_binary() -> (tempfile::TempDir, PathBuf) {
    let out = tempfile::Builder::new()
        .prefix("procaddr-oracle")
        .tempdir()
        .unwrap();
    let bin = out.path().join("procaddr_oracle");
    let src = workspace_root().join("tests/c/procaddr_oracle.c");
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-ldl")
        .status()
        .expect("gcc");
    assert!(st.success(), "gcc {}", src.display());
    (out, bin)
}

fn ask(oracle: &Path, lib: &Path, config_dir: &Path, q: &[Query]) -> Vec<Answer> {
    ask_with(oracle, lib, config_dir, q, &[]).0
}

/// [`ask`] with extra environment; also returns the library's
/// cuDriverGetVersion.
fn ask_with(
    oracle: &Path,
    lib: &Path,
    config_dir: &Path,
    q: &[Query],
    env: &[(&str, &std::ffi::OsStr)],
) -> (Vec<Answer>, i32) {
    use std::io::Write;
    let mut child = Command::new(oracle)
        .arg(lib)
        .env("VCUDA_CONFIG_DIR", config_dir)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input: String = q.iter().map(|(n, v, f)| format!("{n} {v} {f}\n")).collect();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "oracle on {}: {stderr}",
        lib.display()
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let answers: Vec<Answer> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 8, "oracle line {l:?}");
            Answer {
                r2: f[3].parse().unwrap(),
                status: f[4].parse().unwrap(),
                what2: f[5].into(),
                r1: f[6].parse().unwrap(),
                what1: f[7].into(),
            }
        })
        .collect();
    assert_eq!(
        answers.len(),
        q.len(),
        "oracle on {}: {stderr}",
        lib.display()
    );
    let cuda = stderr
        .lines()
        .find_map(|l| l.strip_prefix("cuDriverGetVersion: 0 "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{}: no cuDriverGetVersion: {stderr}", lib.display()));
    (answers, cuda)
}

/// A container's view of one real driver: the interposer as libcuda.so.1 and
/// libnvidia-ml.so.1 with the real versioned files beside it (the vdriver
/// mirror's layout, cuda-shim/src/real.rs), and an enforcing vcuda.config
/// naming that driver's version.
struct Container {
    _dir: tempfile::TempDir,
    libcuda: PathBuf,
    config: PathBuf,
}

fn container(d: &NvidiaDriver) -> Container {
    let dir = tempfile::Builder::new()
        .prefix("nvidia-oracle")
        .tempdir()
        .unwrap();
    let lib = dir.path().join("lib");
    let config = dir.path().join("etc-vcuda");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(&config).unwrap();
    std::fs::copy(interposer(), lib.join("libcuda.so.1")).unwrap();
    std::fs::hard_link(lib.join("libcuda.so.1"), lib.join("libnvidia-ml.so.1")).unwrap();
    for real in [d.libcuda(), d.libnvml()] {
        std::fs::copy(&real, lib.join(real.file_name().unwrap())).unwrap();
    }
    let mut v = d.version.split('.').map(|x| x.parse::<i32>().unwrap());
    let data = quota_config::ResourceData {
        pod_uid: "pod-oracle".into(),
        container_name: "main".into(),
        bus_id: "0000:01:00.0".into(),
        gpu_memory: 1 << 30,
        utilization: 30,
        hard_limit: true,
        driver_version: (v.next().unwrap(), v.next().unwrap()),
        enable: true,
        ..Default::default()
    };
    quota_config::write_atomic(
        &config.join(quota_config::CONFIG_FILE),
        &data.to_bytes().unwrap(),
        0o644,
        quota_config::Durability::Derived,
    )
    .unwrap();
    Container {
        libcuda: lib.join("libcuda.so.1"),
        config,
        _dir: dir,
    }
}

/// Why the interposer's answer `ours` is wrong, given the real driver's
/// `real`; `wrapped(symbol)`: the interposer defines a wrapper for it (not a
/// 6-byte forwarding trampoline).
fn judge(real: &Answer, ours: &Answer, wrapped: &dyn Fn(&str) -> bool) -> Option<String> {
    if (real.r2, real.status, real.r1) != (ours.r2, ours.status, ours.r1) {
        return Some(format!(
            "status: real (v2 {}, symbolStatus {}, v1 {}), interposer (v2 {}, symbolStatus {}, v1 {})",
            real.r2, real.status, real.r1, ours.r2, ours.status, ours.r1
        ));
    }
    for (r, o) in [(&real.what2, &ours.what2), (&real.what1, &ours.what1)] {
        let Some((symbol, _)) = r.split_once('@').filter(|_| !r.starts_with("internal@")) else {
            if r != o {
                return Some(format!("real {r}, interposer {o}"));
            }
            continue;
        };
        let expected = if wrapped(symbol) {
            format!("{symbol}@libcuda.so.1")
        } else {
            r.clone()
        };
        if *o != expected {
            return Some(format!("real {r}, interposer {o}, expected {expected}"));
        }
        if MUST_ENFORCE.contains(&base_name(symbol)) && !wrapped(symbol) {
            return Some(format!(
                "{symbol} must be enforced but the interposer forwards it"
            ));
        }
    }
    None
}

#[test]
fn get_proc_address_answers_as_the_real_driver() {
    let drivers = nvidia_drivers();
    if drivers.is_empty() {
        return;
    }
    let (_oracle_dir, oracle) = oracle_binary();
    let ours = dynamic_symbols(&interposer());
    let wrapped = |s: &str| ours.get(s).is_some_and(|&(func, size)| func && size != 6);
    let q = queries();
    for d in &drivers {
        let c = container(d);
        let real = ask(&oracle, &d.libcuda(), &c.config, &q);
        let answered = real.iter().filter(|a| a.what2.contains('@')).count();
        assert!(
            answered > 5000,
            "the real {} answered only {answered} queries",
            d.version
        );
        let mine = ask(&oracle, &c.libcuda, &c.config, &q);
        let wrong: Vec<String> = q
            .iter()
            .zip(real.iter().zip(&mine))
            .filter_map(|(q, (r, o))| judge(r, o, &wrapped).map(|why| format!("{q:?}: {why}")))
            .collect();
        assert!(
            wrong.is_empty(),
            "driver {}: {} of {} cuGetProcAddress answers differ, first: {:#?}",
            d.version,
            wrong.len(),
            q.len(),
            &wrong[..wrong.len().min(25)]
        );
        let enforced = mine
            .iter()
            .filter(|a| a.what2.ends_with("@libcuda.so.1"))
            .count();
        eprintln!(
            "driver {}: {} queries, {answered} answered by the driver, {enforced} with the interposer's wrapper",
            d.version,
            q.len()
        );
    }
}

/// The recording the simulator answers from (crates/sim/gpu-sim-cuda/procaddr/,
/// format in crates/sim/gpu-sim-cuda/src/procaddr.rs): per base name and flag,
/// the answer at each version where it changes; names the driver never
/// finds are left out, flag 1 where it equals no flag.
fn recording(d: &NvidiaDriver, cuda: i32, q: &[Query], real: &[Answer]) -> String {
    let bases: BTreeSet<&str> = cuda_abi::procs().iter().map(|p| p.name).collect();
    let mut by: BTreeMap<(&str, u64), Vec<(i32, String)>> = BTreeMap::new();
    for ((name, version, flags), a) in q.iter().zip(real) {
        if *flags > 2 || !bases.contains(name.as_str()) {
            continue;
        }
        let answer = match a.what2.split_once('@') {
            Some((symbol, _)) => symbol.to_string(),
            None => format!("!{}", a.status),
        };
        by.entry((name, *flags))
            .or_default()
            .push((*version, answer));
    }
    let mut out = format!(
        "# cuGetProcAddress_v2 of NVIDIA's driver {} (Debian non-free), as it answered\n\
         # tests/nvidia_oracle.rs, which writes this file (VCUDA_RECORD=1) and checks it\n\
         # against the driver on every run. Do not edit.\n\
         # NAME FLAGS FROM_CUDA_VERSION (SYMBOL | !1 not found | !2 version not sufficient)\n\
         cuda {cuda}\n",
        d.version
    );
    let steps = |name: &str, flags: u64| -> Vec<(i32, String)> {
        let mut v = by.get(&(name, flags)).cloned().unwrap_or_default();
        v.sort();
        v.dedup_by(|b, a| a.1 == b.1);
        v
    };
    for name in &bases {
        let s0 = steps(name, 0);
        if s0.iter().all(|(_, a)| a == "!1") && steps(name, 2).iter().all(|(_, a)| a == "!1") {
            continue;
        }
        for flags in [0, 1, 2] {
            let s = steps(name, flags);
            if flags == 1 && s == s0 {
                continue;
            }
            for (v, a) in s {
                out.push_str(&format!("{name} {flags} {v} {a}\n"));
            }
        }
    }
    out
}

/// "S@file" / "internal:S@file" -> S; anything else as it is.
fn symbol_of(what: &str) -> &str {
    match what.split_once('@') {
        Some((s, _)) if !what.starts_with("internal@") => s.strip_prefix("internal:").unwrap_or(s),
        _ => what,
    }
}

#[test]
fn the_simulator_answers_get_proc_address_as_the_real_drivers() {
    let drivers = nvidia_drivers();
    if drivers.is_empty() {
        return;
    }
    let (_oracle_dir, oracle) = oracle_binary();
    let q = queries();
    // A node of each recorded branch (config/nodes/).
    let nodes = [("535", "sim-16gpu"), ("550", "sim-4gpu-pcie")];
    for d in &drivers {
        let none = tempfile::tempdir().unwrap();
        let (real, cuda) = ask_with(&oracle, &d.libcuda(), none.path(), &q, &[]);
        let text = recording(d, cuda, &q, &real);
        let file = workspace_root().join(format!(
            "crates/sim/gpu-sim-cuda/procaddr/{}.txt",
            d.major()
        ));
        if std::env::var("VCUDA_RECORD").as_deref() == Ok("1") {
            std::fs::write(&file, &text).unwrap();
        }
        let committed = std::fs::read_to_string(&file).unwrap_or_default();
        assert!(
            committed == text,
            "{} is not what driver {} answers now: run this test with VCUDA_RECORD=1 and review the diff",
            file.display(),
            d.version
        );
        let node_name = nodes.iter().find(|(m, _)| *m == d.major()).map(|(_, n)| *n);
        let node = test_support::SimNode::install(node_name.expect("a sim node of this branch"));
        let sim_lib = node.lib_dir().join("libcuda.so.1");
        let (sim, _) = ask_with(&oracle, &sim_lib, none.path(), &q, &[]);
        let wrong: Vec<String> = q
            .iter()
            .zip(real.iter().zip(&sim))
            .filter(|(_, (r, s))| {
                (r.r2, r.status, r.r1) != (s.r2, s.status, s.r1)
                    || symbol_of(&r.what2) != symbol_of(&s.what2)
                    || symbol_of(&r.what1) != symbol_of(&s.what1)
            })
            .map(|(q, (r, s))| format!("{q:?}: real {r:?}, sim {s:?}"))
            .collect();
        assert!(
            wrong.is_empty(),
            "the simulated {} node answers {} of {} queries unlike driver {}, first: {:#?}",
            node_name.unwrap(),
            wrong.len(),
            q.len(),
            d.version,
            &wrong[..wrong.len().min(20)]
        );
    }
}
