//! Issue #4: mirroring a (fake, gcc-built) NVIDIA driver installation into the vdriver tree.
//!
//! Each test builds a host root in a temp dir: shared objects with real sonames built by
//! gcc, the symlinks a driver installer makes (some absolute, Debian style), binaries on
//! the root's PATH, and an ld.so.cache written by the system's `ldconfig -r <root>`.
//! Then it mirrors with `vdriver::mirror` and checks the tree, and runs real programs
//! against it.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use test_support::{Capability, require};
use vdriver::{Error, VolumeConfig};

const V1: &str = "550.54.15";
const V2: &str = "560.35.03";
const LIB64: &str = "usr/lib/x86_64-linux-gnu";
const LIB32: &str = "usr/lib/i386-linux-gnu";

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds a shared object from C source with gcc, into a temp name renamed into place
/// (a new inode, as a package manager installs it).
fn build_so(out: &Path, soname: Option<&str>, src: &str, m32: bool, extra: &[&str]) {
    let c = out.with_extension("build.c");
    fs::write(&c, src).unwrap();
    let tmp = out.with_extension("build.tmp");
    let mut cmd = Command::new("gcc");
    cmd.args(["-shared", "-fPIC", "-o"]).arg(&tmp).arg(&c);
    if m32 {
        // No 32-bit libc development files here: a libc-free object is enough.
        cmd.args(["-m32", "-nostdlib"]);
    }
    if let Some(s) = soname {
        cmd.arg(format!("-Wl,-soname,{s}"));
    }
    cmd.args(extra);
    run(&mut cmd);
    fs::remove_file(&c).unwrap();
    fs::rename(&tmp, out).unwrap();
}

fn link(target: &str, at: &Path) {
    let _ = fs::remove_file(at);
    symlink(target, at).unwrap();
}

fn exe(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

fn cuda_src(value: i32) -> String {
    format!(
        "int vd_value(void) {{ return {value}; }}\nint cuInit(unsigned f) {{ (void)f; return 0; }}\n"
    )
}

/// A fake host: `root` is what the manager sees as the host root.
struct Host {
    _dir: tempfile::TempDir,
    root: PathBuf,
    has32: bool,
}

impl Host {
    fn new() -> Host {
        Self::new_in(&std::env::temp_dir())
    }

    fn new_in(parent: &Path) -> Host {
        let dir = tempfile::tempdir_in(parent).unwrap();
        let root = dir.path().join("host");
        for d in [LIB64, LIB32, "etc", "usr/bin", "bin"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        // Without it the 32-bit half of every check is dropped: said (and
        // a failure where CI requires it).
        let has32 = require(Capability::Gcc32);
        fs::write(root.join("etc/ld.so.conf"), format!("/{LIB64}\n/{LIB32}\n")).unwrap();
        let l64 = root.join(LIB64);
        // Not NVIDIA's: a Mesa-like EGL (blacklisted), GLVND's dispatcher and libGL (kept),
        // and an unrelated library (not in the config).
        build_so(
            &l64.join("libEGL.so.1.1.0"),
            Some("libEGL.so.1"),
            "int egl(void){return 0;}",
            false,
            &[],
        );
        link("libEGL.so.1.1.0", &l64.join("libEGL.so.1"));
        build_so(
            &l64.join("libGLdispatch.so.0.0.0"),
            Some("libGLdispatch.so.0"),
            "int d(void){return 0;}",
            false,
            &[],
        );
        link("libGLdispatch.so.0.0.0", &l64.join("libGLdispatch.so.0"));
        let dep = format!("-L{}", l64.display());
        build_so(
            &l64.join("libGL.so.1.7.0"),
            Some("libGL.so.1"),
            "int d(void); int gl(void){return d();}",
            false,
            &[&dep, "-l:libGLdispatch.so.0"],
        );
        link("libGL.so.1.7.0", &l64.join("libGL.so.1"));
        build_so(
            &l64.join("libfoo.so.1"),
            Some("libfoo.so.1"),
            "int foo(void){return 0;}",
            false,
            &[],
        );
        // nvidia-smi on the PATH; nvidia-debugdump an absolute link that must resolve to
        // the root's /bin/true, never the machine's.
        exe(
            &root.join("usr/bin/nvidia-smi"),
            "#!/bin/sh\necho fake nvidia-smi\n",
        );
        exe(
            &root.join("bin/true"),
            "#!/bin/sh\necho inside the host root\n",
        );
        link("/bin/true", &root.join("usr/bin/nvidia-debugdump"));
        Host {
            _dir: dir,
            root,
            has32,
        }
    }

    /// Installs driver `version`; `libcuda`'s `vd_value()` returns `value`.
    fn install_driver(&self, version: &str, value: i32) {
        let l64 = self.root.join(LIB64);
        let cuda = format!("libcuda.so.{version}");
        build_so(
            &l64.join(&cuda),
            Some("libcuda.so.1"),
            &cuda_src(value),
            false,
            &[],
        );
        link(&cuda, &l64.join("libcuda.so.1"));
        link("libcuda.so.1", &l64.join("libcuda.so"));
        // NVML lives in a private directory behind an absolute link (Debian's layout).
        let private = l64.join("nvidia/current");
        fs::create_dir_all(&private).unwrap();
        let ml = format!("libnvidia-ml.so.{version}");
        build_so(
            &private.join(&ml),
            Some("libnvidia-ml.so.1"),
            "int nvmlInit(void){return 0;}",
            false,
            &[],
        );
        link(
            &format!("/{LIB64}/nvidia/current/{ml}"),
            &l64.join("libnvidia-ml.so.1"),
        );
        for (name, soname) in [
            ("libGLX_nvidia", Some("libGLX_nvidia.so.0")),
            (
                "libnvidia-ptxjitcompiler",
                Some("libnvidia-ptxjitcompiler.so.1"),
            ),
            ("libnvidia-glcore", None),
        ] {
            let file = format!("{name}.so.{version}");
            build_so(
                &l64.join(&file),
                soname,
                "int x(void){return 0;}",
                false,
                &[],
            );
            if let Some(s) = soname {
                link(&file, &l64.join(s));
            }
        }
        // Two nvidia-tls variants, told apart by their ABI note: only 2.3.99 is mirrored.
        for (file, abi) in [
            (format!("libnvidia-tls.so.{version}"), "2, 3, 99"),
            (format!("libnvidia-tls.so.{version}.0"), "2, 2, 5"),
        ] {
            let src = format!(
                r#"__asm__(".section .note.ABI-tag,\"a\",@note\n.p2align 2\n.long 4, 16, 1\n"
                        ".asciz \"GNU\"\n.long 0, {abi}\n.previous");
                   int tls(void) {{ return 0; }}"#
            );
            build_so(&l64.join(&file), Some(&file), &src, false, &[]);
        }
        if self.has32 {
            let l32 = self.root.join(LIB32);
            build_so(
                &l32.join(&cuda),
                Some("libcuda.so.1"),
                &cuda_src(value),
                true,
                &[],
            );
            link(&cuda, &l32.join("libcuda.so.1"));
        }
    }

    fn remove_driver(&self, version: &str) {
        let l64 = self.root.join(LIB64);
        for name in [
            "libcuda",
            "libGLX_nvidia",
            "libnvidia-ptxjitcompiler",
            "libnvidia-glcore",
        ] {
            fs::remove_file(l64.join(format!("{name}.so.{version}"))).unwrap();
        }
        fs::remove_file(l64.join(format!("nvidia/current/libnvidia-ml.so.{version}"))).unwrap();
        fs::remove_file(l64.join(format!("libnvidia-tls.so.{version}"))).unwrap();
        fs::remove_file(l64.join(format!("libnvidia-tls.so.{version}.0"))).unwrap();
        if self.has32 {
            fs::remove_file(self.root.join(LIB32).join(format!("libcuda.so.{version}"))).unwrap();
        }
    }

    /// Writes `<root>/etc/ld.so.cache` with the system's ldconfig, in `format`
    /// (`new`, or `compat`: the old table with the new one appended).
    fn ldconfig(&self, format: &str) {
        run(Command::new("ldconfig")
            .args(["-X", "-c", format, "-r"])
            .arg(&self.root));
        let head = fs::read(self.root.join("etc/ld.so.cache")).unwrap();
        let magic: &[u8] = if format == "compat" {
            b"ld.so-1.7.0"
        } else {
            b"glibc-ld.so.cache"
        };
        assert!(
            head.starts_with(magic),
            "ldconfig -c {format} wrote another format"
        );
    }
}

/// The interposer stand-in: its `vd_value()` returns 42.
fn interposer(dir: &Path) -> PathBuf {
    let p = dir.join("libvcuda.so");
    build_so(&p, Some("libcuda.so.1"), &cuda_src(42), false, &[]);
    p
}

/// Installs driver V1 (value 550) on `host` under a new-format ld cache and
/// builds the interposer in `work`: (the interposer, `work/vdriver`).
fn with_driver(host: &Host, work: &Path) -> (PathBuf, PathBuf) {
    host.install_driver(V1, 550);
    host.ldconfig("new");
    (interposer(work), work.join("vdriver"))
}

fn config() -> VolumeConfig {
    VolumeConfig::load(&test_support::workspace_root().join("config/volume.conf")).unwrap()
}

fn soname(path: &Path) -> Option<String> {
    vdriver::elf::inspect(&fs::read(path).unwrap())
        .unwrap()
        .soname
}

fn link_target(path: &Path) -> String {
    fs::read_link(path)
        .unwrap_or_else(|e| panic!("{} is not a symlink: {e}", path.display()))
        .to_string_lossy()
        .into_owned()
}

fn ino(path: &Path) -> u64 {
    fs::metadata(path).unwrap().ino()
}

/// Builds a program linked with `-lcuda` against `vol/lib64` and runs it with that
/// directory as its library path: prints `vd_value()` of whatever libcuda.so.1 it gets.
fn probe(vol: &Path, work: &Path) -> String {
    let c = work.join("probe.c");
    fs::write(&c, "#include <stdio.h>\nint vd_value(void);\nint main(void){printf(\"%d\\n\", vd_value());return 0;}\n").unwrap();
    let bin = work.join("probe");
    run(Command::new("gcc")
        .arg(&c)
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", vol.join("lib64").display()))
        .arg("-lcuda"));
    let out = Command::new(&bin)
        .env("LD_LIBRARY_PATH", vol.join("lib64"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn mirrors_a_fake_driver_in_both_modes() {
    let host = Host::new();
    let work = tempfile::tempdir().unwrap();
    let (shim, vdriver) = with_driver(&host, work.path());

    let report = vdriver::mirror(&host.root, &config(), &vdriver, Some(&shim)).unwrap();
    assert_eq!(report.driver_version.to_string(), V1);
    assert_eq!(
        (
            report.driver_version.major,
            report.driver_version.minor,
            report.driver_version.patch
        ),
        (550, 54, Some(15))
    );

    let l64 = host.root.join(LIB64);
    for name in ["origin", "nvidia"] {
        let vol = vdriver.join(name);
        let r = report.volume(name).unwrap();
        assert_eq!(r.path, vol);
        assert_eq!(r.mode, "ro");
        assert_eq!(r.shared, name == "nvidia");
        for d in ["bin", "lib", "lib64"] {
            assert!(vol.join(d).is_dir(), "{name}/{d}");
        }
        let lib64 = vol.join("lib64");
        // Real files are hard links of the host's (same filesystem here).
        let cuda = format!("libcuda.so.{V1}");
        assert_eq!(ino(&lib64.join(&cuda)), ino(&l64.join(&cuda)));
        assert_eq!(soname(&lib64.join(&cuda)).as_deref(), Some("libcuda.so.1"));
        // Reached through an absolute symlink, resolved inside the host root.
        let ml = format!("libnvidia-ml.so.{V1}");
        assert_eq!(
            ino(&lib64.join(&ml)),
            ino(&l64.join("nvidia/current").join(&ml))
        );
        // Soname + unversioned links, GLVND's indirect GLX link.
        let glx = format!("libGLX_nvidia.so.{V1}");
        assert_eq!(link_target(&lib64.join("libGLX_nvidia.so.0")), glx);
        assert_eq!(link_target(&lib64.join("libGLX_nvidia.so")), glx);
        assert_eq!(link_target(&lib64.join("libGLX_indirect.so.0")), glx);
        let ptx = format!("libnvidia-ptxjitcompiler.so.{V1}");
        assert_eq!(
            link_target(&lib64.join("libnvidia-ptxjitcompiler.so.1")),
            ptx
        );
        assert!(lib64.join(format!("libnvidia-glcore.so.{V1}")).is_file());
        // The TLS library for the current ABI only.
        let tls = format!("libnvidia-tls.so.{V1}");
        assert_eq!(ino(&lib64.join(&tls)), ino(&l64.join(&tls)));
        assert!(
            !lib64.join(format!("{tls}.0")).exists(),
            "old-ABI nvidia-tls mirrored"
        );
        // GLVND's libGL kept (links libGLdispatch), the Mesa-like EGL left out,
        // the unrelated library never considered.
        assert_eq!(link_target(&lib64.join("libGL.so.1")), "libGL.so.1.7.0");
        assert!(lib64.join("libGLdispatch.so.0.0.0").is_file());
        assert!(!lib64.join("libEGL.so.1.1.0").exists());
        assert!(!lib64.join("libEGL.so.1").exists());
        assert!(!lib64.join("libfoo.so.1").exists());
        // Binaries: by the name asked for; the absolute link resolved inside the root.
        let smi = fs::read_to_string(vol.join("bin/nvidia-smi")).unwrap();
        assert!(smi.contains("fake nvidia-smi"));
        let dd = fs::read_to_string(vol.join("bin/nvidia-debugdump")).unwrap();
        assert!(dd.contains("inside the host root"), "{dd}");
        assert!(!vol.join("bin/nvidia-persistenced").exists());
        assert!(fs::metadata(vol.join("bin/nvidia-smi")).unwrap().mode() & 0o111 != 0);
        // The report lists exactly what is there.
        for rel in &r.files {
            assert!(
                fs::symlink_metadata(vol.join(rel)).is_ok(),
                "{}",
                rel.display()
            );
        }
        if host.has32 {
            assert!(vol.join("lib").join(&cuda).is_file());
        }
    }

    // origin: the real driver under its sonames.
    let origin = vdriver.join("origin/lib64");
    assert_eq!(
        link_target(&origin.join("libcuda.so.1")),
        format!("libcuda.so.{V1}")
    );
    assert_eq!(
        link_target(&origin.join("libcuda.so")),
        format!("libcuda.so.{V1}")
    );
    assert_eq!(
        link_target(&origin.join("libnvidia-ml.so.1")),
        format!("libnvidia-ml.so.{V1}")
    );
    if host.has32 {
        assert_eq!(
            link_target(&vdriver.join("origin/lib/libcuda.so.1")),
            format!("libcuda.so.{V1}")
        );
    }

    // nvidia: the four names are one file, the interposer; the real ones beside it.
    let shared = vdriver.join("nvidia/lib64");
    let shim_ino = ino(&shared.join("libcuda.so.1"));
    assert_eq!(shim_ino, ino(&shim));
    for name in ["libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"] {
        let m = fs::symlink_metadata(shared.join(name)).unwrap();
        assert!(m.is_file(), "{name} is a file, not a link");
        assert_eq!(m.ino(), shim_ino, "{name}");
    }
    assert_eq!(
        ino(&shared.join(format!("libcuda.so.{V1}"))),
        ino(&l64.join(format!("libcuda.so.{V1}")))
    );
    if host.has32 {
        // No 32-bit interposer: no 32-bit way around it either.
        assert!(!vdriver.join("nvidia/lib/libcuda.so.1").exists());
        assert!(
            vdriver
                .join("nvidia/lib")
                .join(format!("libcuda.so.{V1}"))
                .is_file()
        );
    }

    // A real program linked with -lcuda gets the driver in origin, the interposer in nvidia.
    assert_eq!(probe(&vdriver.join("origin"), work.path()), "550");
    assert_eq!(probe(&vdriver.join("nvidia"), work.path()), "42");
}

#[test]
fn old_and_new_ld_cache_formats_give_the_same_tree() {
    let host = Host::new();
    host.install_driver(V1, 550);
    let work = tempfile::tempdir().unwrap();
    let shim = interposer(work.path());
    let mut trees = Vec::new();
    for format in ["new", "compat"] {
        host.ldconfig(format);
        let out = work.path().join(format);
        let report = vdriver::mirror(&host.root, &config(), &out, Some(&shim)).unwrap();
        assert_eq!(report.driver_version.to_string(), V1, "{format}");
        trees.push(
            report
                .volumes
                .iter()
                .map(|v| (v.name.clone(), v.files.clone()))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(trees[0], trees[1]);
    assert!(trees[0][0].1.len() > 10);
}

/// A process that has a mirrored library dlopen'ed and its bytes mapped, and reports
/// whether they are still what they were.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Holder {
    fn start(lib: &Path, work: &Path) -> (Holder, String) {
        let c = work.join("holder.c");
        fs::write(&c, HOLDER_C).unwrap();
        let bin = work.join("holder");
        run(Command::new("gcc").arg(&c).arg("-o").arg(&bin).arg("-ldl"));
        let mut child = Command::new(&bin)
            .arg(lib)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        (
            Holder {
                child,
                stdin,
                stdout,
            },
            line.trim().to_owned(),
        )
    }

    fn check(&mut self) -> String {
        self.stdin.write_all(b"check\n").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const HOLDER_C: &str = r#"
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    int (*f)(void) = (int (*)(void))dlsym(h, "vd_value");
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    fstat(fd, &st);
    unsigned char *m = mmap(0, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    unsigned char *before = malloc(st.st_size);
    memcpy(before, m, st.st_size);
    printf("value=%d ino=%lu\n", f(), (unsigned long)st.st_ino);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        struct stat now;
        fstat(fd, &now);
        /* A truncated file would SIGBUS here; a rewritten one would compare unequal. */
        int same = now.st_size == st.st_size && memcmp(before, m, st.st_size) == 0;
        printf("value=%d ino=%lu %s\n", f(), (unsigned long)now.st_ino, same ? "unchanged" : "CHANGED");
        fflush(stdout);
    }
    return 0;
}
"#;

fn remirror_keeps_running_process_intact(host: Host, work: &Path) {
    let (shim, vdriver) = with_driver(&host, work);
    let cfg = config();
    vdriver::mirror(&host.root, &cfg, &vdriver, Some(&shim)).unwrap();

    let lib = vdriver.join("origin/lib64/libcuda.so.1");
    let (mut holder, first) = Holder::start(&lib, work);
    let old_ino = ino(&lib);
    assert_eq!(first, format!("value=550 ino={old_ino}"));

    // The host reinstalls the same version with other content (a new inode), the
    // interposer is rebuilt, and the manager re-mirrors while the process runs.
    host.install_driver(V1, 551);
    interposer(work);
    let report = vdriver::mirror(&host.root, &cfg, &vdriver, Some(&shim)).unwrap();
    assert!(report.volumes.iter().all(|v| v.removed.is_empty()));

    // The running process: same inode, same bytes, same code.
    assert_eq!(holder.check(), format!("value=550 ino={old_ino} unchanged"));
    // The tree: new content under a new inode, for processes started from now on.
    assert_ne!(ino(&lib), old_ino);
    assert_eq!(probe(&vdriver.join("origin"), work), "551");
    assert_eq!(probe(&vdriver.join("nvidia"), work), "42");
    assert_eq!(holder.check(), format!("value=550 ino={old_ino} unchanged"));
}

#[test]
fn remirror_leaves_a_running_process_intact_hard_links() {
    let work = tempfile::tempdir().unwrap();
    remirror_keeps_running_process_intact(Host::new(), work.path());
}

#[test]
fn remirror_leaves_a_running_process_intact_copies() {
    // Host root on another filesystem than the vdriver dir: hard links fail, files are
    // copied. Skipped where /dev/shm is not a separate filesystem.
    let work = tempfile::tempdir().unwrap();
    if !require(Capability::ShmFilesystem) {
        return;
    }
    let shm = Path::new("/dev/shm");
    assert_ne!(
        fs::metadata(shm).unwrap().dev(),
        fs::metadata(work.path()).unwrap().dev(),
        "/dev/shm and the work dir share a filesystem"
    );
    let host = Host::new_in(shm);
    host.install_driver(V1, 550);
    host.ldconfig("new");
    let report =
        vdriver::mirror(&host.root, &config(), &work.path().join("probe-copy"), None).unwrap();
    let origin = report.volume("origin").unwrap();
    assert!(origin.copied > 0 && origin.linked == 0, "{origin:?}");
    let again =
        vdriver::mirror(&host.root, &config(), &work.path().join("probe-copy"), None).unwrap();
    assert_eq!(
        again.volume("origin").unwrap().copied,
        0,
        "copies are recognised as current"
    );
    remirror_keeps_running_process_intact(host, work.path());
}

#[test]
fn rerun_is_idempotent_and_a_driver_upgrade_removes_stale_files() {
    let host = Host::new();
    let work = tempfile::tempdir().unwrap();
    let (shim, vdriver) = with_driver(&host, work.path());
    let cfg = config();
    let first = vdriver::mirror(&host.root, &cfg, &vdriver, Some(&shim)).unwrap();

    // Same host, second run: nothing made, nothing removed.
    let inodes = |vol: &str| -> Vec<(PathBuf, u64)> {
        let mut v: Vec<_> = ["bin", "lib", "lib64"]
            .iter()
            .flat_map(|d| fs::read_dir(vdriver.join(vol).join(d)).unwrap())
            .map(|e| {
                let e = e.unwrap();
                (e.path(), fs::symlink_metadata(e.path()).unwrap().ino())
            })
            .collect();
        v.sort();
        v
    };
    let before = (inodes("origin"), inodes("nvidia"));
    let second = vdriver::mirror(&host.root, &cfg, &vdriver, Some(&shim)).unwrap();
    for (a, b) in first.volumes.iter().zip(&second.volumes) {
        assert_eq!(a.files, b.files);
        assert_eq!((b.linked, b.copied, b.symlinked), (0, 0, 0), "{b:?}");
        assert_eq!(b.unchanged, a.files.len());
        assert!(b.removed.is_empty());
    }
    assert_eq!(before, (inodes("origin"), inodes("nvidia")));

    // Upgrade: the old driver goes, the new one comes, ldconfig runs.
    host.remove_driver(V1);
    host.install_driver(V2, 560);
    host.ldconfig("new");
    let third = vdriver::mirror(&host.root, &cfg, &vdriver, Some(&shim)).unwrap();
    assert_eq!(third.driver_version.to_string(), V2);
    for vol in ["origin", "nvidia"] {
        let r = third.volume(vol).unwrap();
        assert!(
            r.removed
                .contains(&PathBuf::from(format!("lib64/libcuda.so.{V1}"))),
            "{r:?}"
        );
        for (path, _) in inodes(vol) {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(!name.contains(V1), "stale {}", path.display());
            if let Ok(t) = fs::read_link(&path) {
                assert!(
                    !t.to_string_lossy().contains(V1),
                    "{} -> {}",
                    path.display(),
                    t.display()
                );
                assert!(path.exists(), "dangling {}", path.display());
            }
        }
    }
    assert_eq!(
        link_target(&vdriver.join("origin/lib64/libcuda.so.1")),
        format!("libcuda.so.{V2}")
    );
    assert_eq!(probe(&vdriver.join("origin"), work.path()), "560");
    assert_eq!(probe(&vdriver.join("nvidia"), work.path()), "42");
}

#[test]
fn bad_volume_conf_names_the_unknown_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("volume.conf");
    let text = fs::read_to_string(test_support::workspace_root().join("config/volume.conf"))
        .unwrap()
        .replacen("\"components\"", "\"compnents\"", 1);
    fs::write(&path, text).unwrap();
    let err = VolumeConfig::load(&path).unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("volume[0].compnents"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn a_host_without_the_driver_is_a_clear_error_and_touches_nothing() {
    let host = Host::new(); // GL libraries only, no NVIDIA driver
    host.ldconfig("new");
    let work = tempfile::tempdir().unwrap();
    let vdriver = work.path().join("vdriver");
    let err = vdriver::mirror(&host.root, &config(), &vdriver, None).unwrap_err();
    assert!(matches!(err, Error::DriverNotFound { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("NVIDIA driver not found") && msg.contains("ld.so.cache"),
        "{msg}"
    );
    assert!(!vdriver.exists());

    // No ld.so.cache at all: names the file.
    fs::remove_file(host.root.join("etc/ld.so.cache")).unwrap();
    let err = vdriver::mirror(&host.root, &config(), &vdriver, None).unwrap_err();
    assert!(matches!(err, Error::LdCacheRead { .. }), "{err:?}");
    assert!(err.to_string().contains("etc/ld.so.cache"), "{err}");
}

#[test]
fn mirrors_a_gpu_sim_root() {
    // The simulated node's driver root, laid out by the real `gpu-sim install`.
    let node = test_support::SimNode::install("sim-1gpu");
    let spec =
        fs::read_to_string(test_support::workspace_root().join("config/nodes/sim-1gpu.toml"))
            .unwrap();
    let version = spec
        .lines()
        .find_map(|l| l.strip_prefix("driver_version = "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let work = tempfile::tempdir().unwrap();
    let shim = interposer(work.path());
    let vdriver = work.path().join("vdriver");

    let report = vdriver::mirror(node.root(), &config(), &vdriver, Some(&shim)).unwrap();
    assert_eq!(report.driver_version.to_string(), version);
    let cuda = format!("libcuda.so.{version}");
    let ml = format!("libnvidia-ml.so.{version}");
    let origin = vdriver.join("origin");
    assert_eq!(link_target(&origin.join("lib64/libcuda.so.1")), cuda);
    assert_eq!(link_target(&origin.join("lib64/libnvidia-ml.so.1")), ml);
    assert_eq!(
        ino(&origin.join("lib64").join(&cuda)),
        ino(&node.lib_dir().join(&cuda))
    );
    assert_eq!(
        soname(&origin.join("lib64").join(&ml)).as_deref(),
        Some("libnvidia-ml.so.1")
    );
    assert!(origin.join("bin/nvidia-smi").is_file());
    let shared = vdriver.join("nvidia/lib64");
    for name in [
        "libcuda.so.1",
        "libcuda.so",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so",
    ] {
        assert_eq!(ino(&shared.join(name)), ino(&shim), "{name}");
    }
    assert_eq!(ino(&shared.join(&cuda)), ino(&node.lib_dir().join(&cuda)));
}
