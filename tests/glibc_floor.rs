//! The glibc floor of the interposer we ship (cuda-shim/README.md, "glibc
//! floor"): it is loaded into every CUDA container as libcuda.so.1, so one
//! versioned glibc symbol newer than the container's glibc makes CUDA
//! vanish there (`version 'GLIBC_2.34' not found`). Ubuntu 20.04 has 2.31,
//! UBI 8 2.28, CentOS 7 2.17: the shipped build must need at most 2.17.
//!
//! The shipped build is `cargo zigbuild -p cuda-shim --release --target
//! x86_64-unknown-linux-gnu.2.17` (tests/run.sh and deploy/Dockerfile make
//! it), at `target/x86_64-unknown-linux-gnu/release/libvcuda.so`;
//! `VCUDA_INTERPOSER=<path>` checks another file instead.
//!
//! Beyond reading the tables, `loads_and_runs_under_an_old_glibc` loads it
//! in an old distribution's root (`VCUDA_OLD_GLIBC_ROOT`, Debian bullseye,
//! glibc 2.31, which tests/run.sh debootstraps), with the host build as the
//! control that must not load there.

use goblin::elf::Elf;
use goblin::elf::dynamic::{DF_SYMBOLIC, DT_FLAGS, DT_SYMBOLIC};
use goblin::elf::sym::{STB_GLOBAL, STB_WEAK, STT_FUNC};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use test_support::{shipped_interposer, target_dir, workspace_root};

/// The oldest glibc the interposer must load under (CentOS 7).
const FLOOR: (u32, u32) = (2, 17);
/// `vna_flags` bit of a weak version reference: ld.so does not fail the
/// load when the version is missing (glibc elf/dl-version.c).
const VER_FLG_WEAK: u16 = 0x2;

/// One `GLIBC_x.y` version reference of the library's verneed table.
struct VersionRef {
    /// The needed library it names (libc.so.6, libpthread.so.0, ...).
    file: String,
    version: (u32, u32),
    name: String,
    weak: bool,
    /// Undefined symbols bound to this version, "(weak)" marking weak
    /// bindings: why the reference is there.
    symbols: Vec<String>,
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; build it first (tests/run.sh does: `cargo zigbuild -p cuda-shim --release \
             --target x86_64-unknown-linux-gnu.2.17`, and `cargo build --workspace` for the host build)",
            path.display()
        )
    })
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Elf<'a> {
    Elf::parse(bytes).unwrap_or_else(|e| panic!("{} is not an ELF file: {e}", path.display()))
}

/// "GLIBC_2.17" -> (2, 17); GLIBC_PRIVATE (tied to one glibc build) ->
/// above any floor; other version names (GCC_3.0) -> None.
fn glibc_version(name: &str) -> Option<(u32, u32)> {
    if name == "GLIBC_PRIVATE" {
        return Some((u32::MAX, 0));
    }
    let (major, minor) = name.strip_prefix("GLIBC_")?.split_once('.')?;
    let minor = minor.split('.').next()?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

fn glibc_refs(elf: &Elf) -> Vec<VersionRef> {
    let str_at = |off: usize| elf.dynstrtab.get_at(off).unwrap_or("?").to_string();
    // versym index -> undefined symbols bound to it.
    let mut by_index: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    if let Some(versym) = &elf.versym {
        for (i, sym) in elf.dynsyms.iter().enumerate() {
            if sym.st_shndx != 0 || sym.st_name == 0 {
                continue;
            }
            let Some(v) = versym.get_at(i) else { continue };
            let weak = if sym.st_bind() == STB_WEAK {
                " (weak)"
            } else {
                ""
            };
            by_index
                .entry(v.version())
                .or_default()
                .push(format!("{}{weak}", str_at(sym.st_name)));
        }
    }
    let mut refs = Vec::new();
    let Some(verneed) = &elf.verneed else {
        return refs;
    };
    for need in verneed.iter() {
        let file = str_at(need.vn_file);
        for aux in need.iter() {
            let name = str_at(aux.vna_name);
            let Some(version) = glibc_version(&name) else {
                continue;
            };
            refs.push(VersionRef {
                file: file.clone(),
                version,
                name,
                weak: aux.vna_flags & VER_FLG_WEAK != 0,
                symbols: by_index.remove(&aux.vna_other).unwrap_or_default(),
            });
        }
    }
    refs
}

/// The names of the functions the library defines and exports.
fn exported_functions(elf: &Elf) -> BTreeSet<String> {
    elf.dynsyms
        .iter()
        .filter(|s| {
            s.st_shndx != 0
                && s.st_type() == STT_FUNC
                && matches!(s.st_bind(), STB_GLOBAL | STB_WEAK)
        })
        .filter_map(|s| elf.dynstrtab.get_at(s.st_name).map(str::to_string))
        .collect()
}

fn symbolic(elf: &Elf) -> bool {
    elf.dynamic.as_ref().is_some_and(|d| {
        d.dyns
            .iter()
            .any(|e| e.d_tag == DT_SYMBOLIC || (e.d_tag == DT_FLAGS && e.d_val & DF_SYMBOLIC != 0))
    })
}

fn describe(r: &VersionRef) -> String {
    format!(
        "{} {} ({}) for {}",
        r.file,
        r.name,
        if r.weak { "weak" } else { "required" },
        if r.symbols.is_empty() {
            "no symbol".to_string()
        } else {
            r.symbols.join(", ")
        }
    )
}

/// Only required version references decide whether ld.so loads the
/// library: for each one the needed library lacks, the load fails, even
/// when every symbol bound to it is a weak reference. A reference flagged
/// VER_FLG_WEAK only makes ld.so warn. Rust's std calls what is newer than
/// its floor (statx, getrandom, memfd_create, ...) through dlsym at run
/// time, so those never show up here; a weak *symbol* with a version newer
/// than 2.17 (`__cxa_thread_atexit_impl@GLIBC_2.18` in a host build) still
/// carries a required version reference and is reported.
#[test]
fn shipped_interposer_needs_at_most_glibc_2_17() {
    let path = shipped_interposer();
    let bytes = read(&path);
    let elf = parse(&path, &bytes);
    let refs = glibc_refs(&elf);
    assert!(
        refs.iter().any(|r| r.name == "GLIBC_2.2.5"),
        "{}: no GLIBC_2.2.5 version reference: not a dynamically linked x86_64 glibc library?",
        path.display()
    );
    for r in refs.iter().filter(|r| r.weak) {
        eprintln!(
            "weak version reference, not needed to load: {}",
            describe(r)
        );
    }
    // What std resolves at run time when present (statx, getrandom, ...):
    // no version, so nothing for ld.so to check.
    let unversioned_weak: Vec<&str> = elf
        .dynsyms
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            s.st_shndx == 0
                && s.st_bind() == STB_WEAK
                && elf
                    .versym
                    .as_ref()
                    .and_then(|v| v.get_at(*i))
                    .is_none_or(|v| v.version() <= 1)
        })
        .filter_map(|(_, s)| elf.dynstrtab.get_at(s.st_name))
        .filter(|n| !n.is_empty())
        .collect();
    eprintln!("unversioned weak references (optional at run time): {unversioned_weak:?}");
    let too_new: Vec<String> = refs
        .iter()
        .filter(|r| !r.weak && r.version > FLOOR)
        .map(describe)
        .collect();
    assert!(
        too_new.is_empty(),
        "{} needs glibc newer than {}.{}, so it cannot load on CentOS 7 / UBI 8 / Ubuntu 20.04:\n  {}\n\
         build it with `cargo zigbuild -p cuda-shim --release --target x86_64-unknown-linux-gnu.2.17`",
        path.display(),
        FLOOR.0,
        FLOOR.1,
        too_new.join("\n  ")
    );
}

/// The glibc-2.17 build is the same library as the host build the other
/// tests exercise: same exported functions (wrappers and forwarding
/// trampolines), same SONAME, still linked -Bsymbolic (cuda-shim/build.rs).
#[test]
fn shipped_interposer_exports_what_the_host_build_exports() {
    let host_path: PathBuf = target_dir().join("libvcuda.so");
    let shipped_path = shipped_interposer();
    let (host_bytes, shipped_bytes) = (read(&host_path), read(&shipped_path));
    let host = parse(&host_path, &host_bytes);
    let shipped = parse(&shipped_path, &shipped_bytes);

    assert_eq!(host.soname, Some("libcuda.so.1"), "{}", host_path.display());
    assert_eq!(
        shipped.soname,
        host.soname,
        "SONAME of {}",
        shipped_path.display()
    );
    assert!(symbolic(&host), "{} not -Bsymbolic", host_path.display());
    assert!(
        symbolic(&shipped),
        "{} not linked -Bsymbolic (cuda-shim/build.rs)",
        shipped_path.display()
    );

    let (h, s) = (exported_functions(&host), exported_functions(&shipped));
    assert!(
        h.contains("cuInit") && h.contains("nvmlInit_v2") && h.len() > 100,
        "{}: only {} exported functions",
        host_path.display(),
        h.len()
    );
    let only_host: Vec<&String> = h.difference(&s).collect();
    let only_shipped: Vec<&String> = s.difference(&h).collect();
    assert!(
        only_host.is_empty() && only_shipped.is_empty(),
        "exports differ (or one build is stale: tests/run.sh makes both from one tree): \
         only in {}: {only_host:?}; only in {}: {only_shipped:?}",
        host_path.display(),
        shipped_path.display()
    );
}

/// Runs `tests/c/load_interposer.c` (built by zig for glibc 2.17) on `lib`
/// inside `root` with chroot: (exit code, stdout, stderr).
fn load_in(root: &Path, loader: &Path, lib: &Path) -> (i32, String, String) {
    let dir = tempfile::Builder::new()
        .prefix("vcuda-glibc-")
        .tempdir_in(root.join("tmp"))
        .expect("tempdir in the old root's /tmp");
    for f in [loader, lib] {
        std::fs::copy(f, dir.path().join(f.file_name().unwrap()))
            .unwrap_or_else(|e| panic!("copy {} into {}: {e}", f.display(), dir.path().display()));
    }
    let inside = Path::new("/tmp").join(dir.path().file_name().unwrap());
    let out = Command::new("chroot")
        .arg(root)
        .arg(inside.join(loader.file_name().unwrap()))
        .arg(inside.join(lib.file_name().unwrap()))
        .output()
        .expect("chroot (needs root)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The shipped interposer loads (RTLD_NOW) under glibc 2.31 and its code
/// runs there: cuInit fails closed for want of vcuda.config (800, one line
/// naming the file), a forwarded entry point goes through its trampoline
/// and the resolver and answers CUDA_ERROR_NOT_FOUND (500: no real driver in
/// that root). The host build, in the same root, must fail to load: proof
/// that the root's glibc really is older than what the host build needs.
#[test]
fn loads_and_runs_under_an_old_glibc() {
    let root = PathBuf::from(std::env::var_os("VCUDA_OLD_GLIBC_ROOT").unwrap_or_else(|| {
        panic!(
            "VCUDA_OLD_GLIBC_ROOT unset: point it at an old distribution's root, e.g. \
             `debootstrap --variant=minbase bullseye <dir> http://deb.debian.org/debian` \
             (tests/run.sh does this)"
        )
    }));
    assert!(
        root.join("tmp").is_dir() && root.join("usr/bin/ldd").is_file(),
        "VCUDA_OLD_GLIBC_ROOT={}: not a distribution root (no tmp/ or usr/bin/ldd)",
        root.display()
    );
    let ldd = Command::new("chroot")
        .arg(&root)
        .args(["/usr/bin/ldd", "--version"])
        .output()
        .expect("chroot (needs root)");
    let glibc = String::from_utf8_lossy(&ldd.stdout);
    eprintln!("old root: {}", glibc.lines().next().unwrap_or("?"));

    let work = tempfile::tempdir().unwrap();
    let loader = work.path().join("load_interposer");
    let src = workspace_root().join("tests/c/load_interposer.c");
    let zig = Command::new("python3")
        .args([
            "-m",
            "ziglang",
            "cc",
            "-target",
            "x86_64-linux-gnu.2.17",
            "-O1",
            "-o",
        ])
        .arg(&loader)
        .arg(&src)
        .output()
        .expect("python3");
    assert!(
        zig.status.success(),
        "`python3 -m ziglang cc` failed to build {} (pip install ziglang; tests/run.sh does): {}",
        src.display(),
        String::from_utf8_lossy(&zig.stderr)
    );

    let shipped = shipped_interposer();
    read(&shipped);
    let (code, out, err) = load_in(&root, &loader, &shipped);
    assert!(
        code == 0 && out.contains("loaded"),
        "{} does not load under {}: exit {code}\n{out}{err}",
        shipped.display(),
        root.display()
    );
    assert!(
        out.contains("cuInit 800") && err.contains("vcuda.config"),
        "cuInit under the old glibc: expected fail-closed 800 naming vcuda.config:\n{out}{err}"
    );
    assert!(
        out.contains("cuDriverGetVersion 500"),
        "forwarded call without a real driver: expected 500 (CUDA_ERROR_NOT_FOUND):\n{out}{err}"
    );

    let host = target_dir().join("libvcuda.so");
    read(&host);
    let (code, out, err) = load_in(&root, &loader, &host);
    assert!(
        code == 1 && err.contains("version `GLIBC_2."),
        "control: the host build {} should not load under {} (version not found), got exit {code}\n{out}{err}",
        host.display(),
        root.display()
    );
}

/// The value of `<prefix><NAME>=<value>` in `text`.
fn pin(text: &str, file: &str, prefix: &str, name: &str) -> String {
    let key = format!("{prefix}{name}=");
    text.lines()
        .find_map(|l| l.trim().strip_prefix(&key))
        .unwrap_or_else(|| panic!("{file} sets no {key}"))
        .trim()
        .to_string()
}

/// CI (tests/run.sh) tests the interposer built by the same zig and
/// cargo-zigbuild as the image (deploy/Dockerfile) ships.
#[test]
fn run_sh_and_the_dockerfile_pin_the_same_zig_toolchain() {
    let root = workspace_root();
    let run = std::fs::read_to_string(root.join("tests/run.sh")).unwrap();
    let docker = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
    for name in ["ZIGLANG_VERSION", "CARGO_ZIGBUILD_VERSION"] {
        assert_eq!(
            pin(&run, "tests/run.sh", "", name),
            pin(&docker, "deploy/Dockerfile", "ARG ", name),
            "{name} differs between tests/run.sh and deploy/Dockerfile"
        );
    }
    for text in [&run, &docker] {
        assert!(text.contains("x86_64-unknown-linux-gnu.2.17"));
    }
}
