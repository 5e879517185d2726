//! Host roots built from NVIDIA's real driver files (tests/nvidia/fetch.sh),
//! in the two layouts a GPU node has them in, for the vdriver mirror
//! (tests/nvidia_real.rs). Files are hard links of the unpacked packages
//! (copies across filesystems); nothing is ever written through them.

use super::NvidiaDriver;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const MULTIARCH: &str = "usr/lib/x86_64-linux-gnu";

/// The multiarch slaves of Debian's `nvidia` alternative that the unpacked
/// packages provide a source for (nvidia-alternative 535.261.03-1's
/// postinst, `add_multiarch_slave /usr/lib "" <name> /usr/lib
/// nvidia/current/`: a slave is registered only when its source `-f`
/// exists). `libnvidia-ml.so` is a slave only when nvml.h is installed
/// (nvidia-cuda-dev), which it is not here.
const DEBIAN_LIB_SLAVES: [&str; 9] = [
    "libcuda.so.1",
    "libcuda.so",
    "libcudadebugger.so.1",
    "libnvidia-ml.so.1",
    "libnvidia-nvvm.so.4",
    "libnvidia-opencl.so.1",
    "libnvidia-ptxjitcompiler.so.1",
    "libnvcuvid.so.1",
    "libnvidia-encode.so.1",
];

/// A host file from the package: a hard link, or a copy elsewhere.
fn place(src: &Path, dst: &Path) {
    fs::create_dir_all(dst.parent().unwrap()).unwrap();
    if fs::hard_link(src, dst).is_err() {
        fs::copy(src, dst).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    }
}

fn link(target: impl AsRef<Path>, at: &Path) {
    fs::create_dir_all(at.parent().unwrap()).unwrap();
    symlink(target, at).unwrap_or_else(|e| panic!("symlink {}: {e}", at.display()));
}

/// Debian's root skeleton: merged /usr (`/lib` and `/bin` are links into
/// `/usr`, so ld.so.cache names `/lib/x86_64-linux-gnu/...`), libc6's
/// ld.so.conf.d entry for the multiarch directories.
fn skeleton(root: &Path) {
    for d in [
        MULTIARCH,
        "usr/bin",
        "usr/local/lib/x86_64-linux-gnu",
        "etc",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    link("usr/lib", &root.join("lib"));
    link("usr/bin", &root.join("bin"));
    fs::write(
        root.join("etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    fs::create_dir_all(root.join("etc/ld.so.conf.d")).unwrap();
    fs::write(
        root.join("etc/ld.so.conf.d/x86_64-linux-gnu.conf"),
        "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
    )
    .unwrap();
}

/// `ldconfig -r <root>`, as dpkg's ldconfig trigger runs it on the host
/// (it follows the alternatives' absolute links inside the root).
fn ldconfig(root: &Path) {
    let out = Command::new("ldconfig")
        .arg("-r")
        .arg(root)
        .output()
        .expect("ldconfig");
    assert!(
        out.status.success(),
        "ldconfig -r {}: {}",
        root.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Debian host with `d` installed from its packages: the files where
/// dpkg puts them (`/usr/lib/x86_64-linux-gnu/nvidia/current/`,
/// `/usr/lib/nvidia/current/nvidia-smi`), and the links that
/// nvidia-alternative's postinst makes through update-alternatives:
/// `/usr/lib/x86_64-linux-gnu/libcuda.so.1 ->
/// /etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu ->
/// /usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.1 -> libcuda.so.<v>`,
/// `/usr/bin/nvidia-smi -> /etc/alternatives/nvidia--nvidia-smi -> ...`.
pub fn debian(parent: &Path, d: &NvidiaDriver) -> PathBuf {
    let root = parent.join(format!("debian-{}", d.version));
    skeleton(&root);
    let current = root.join(MULTIARCH).join("nvidia/current");
    fs::create_dir_all(&current).unwrap();
    // dpkg-deb -x kept the package's own relative links; copy them as links.
    for e in fs::read_dir(d.lib_dir()).unwrap() {
        let e = e.unwrap();
        let dst = current.join(e.file_name());
        if e.file_type().unwrap().is_symlink() {
            link(fs::read_link(e.path()).unwrap(), &dst);
        } else {
            place(&e.path(), &dst);
        }
    }
    let smi_dir = root.join("usr/lib/nvidia/current");
    place(&d.nvidia_smi(), &smi_dir.join("nvidia-smi"));
    // The master alternative: /usr/lib/nvidia/nvidia -> /etc/alternatives/nvidia.
    link(
        "/usr/lib/nvidia/current",
        &root.join("etc/alternatives/nvidia"),
    );
    link(
        "/etc/alternatives/nvidia",
        &root.join("usr/lib/nvidia/nvidia"),
    );
    let mut slaves: Vec<(String, String, String)> = DEBIAN_LIB_SLAVES
        .iter()
        .map(|n| {
            (
                format!("/{MULTIARCH}/{n}"),
                format!("nvidia--{n}-x86_64-linux-gnu"),
                format!("/{MULTIARCH}/nvidia/current/{n}"),
            )
        })
        .collect();
    slaves.push((
        "/usr/bin/nvidia-smi".into(),
        "nvidia--nvidia-smi".into(),
        "/usr/lib/nvidia/current/nvidia-smi".into(),
    ));
    for (target, name, source) in slaves {
        // `[ -f source ]`: through the package's own links.
        if !root.join(&source[1..]).is_file() {
            continue;
        }
        let alt = format!("/etc/alternatives/{name}");
        link(&source, &root.join(&alt[1..]));
        link(&alt, &root.join(&target[1..]));
    }
    ldconfig(&root);
    root
}

/// A host where NVIDIA's .run installer put `d`: the versioned files flat in
/// the multiarch directory with their soname links beside them
/// (`libcuda.so.1 -> libcuda.so.<v>`, `libcuda.so -> libcuda.so.1`; the
/// installer's manifest calls them CUDA_LIB / CUDA_SYMLINK, UTILITY_LIB /
/// UTILITY_LIB_SYMLINK), `nvidia-smi` a file in `/usr/bin`.
pub fn run_installer(parent: &Path, d: &NvidiaDriver) -> PathBuf {
    let root = parent.join(format!("run-{}", d.version));
    skeleton(&root);
    let lib = root.join(MULTIARCH);
    let v = &d.version;
    for (name, soname, dev) in [
        ("libcuda.so", "libcuda.so.1", true),
        ("libnvidia-ml.so", "libnvidia-ml.so.1", true),
        (
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-ptxjitcompiler.so.1",
            false,
        ),
    ] {
        let file = format!("{name}.{v}");
        place(&d.lib_dir().join(&file), &lib.join(&file));
        link(&file, &lib.join(soname));
        if dev {
            link(soname, &lib.join(name));
        }
    }
    place(&d.nvidia_smi(), &root.join("usr/bin/nvidia-smi"));
    ldconfig(&root);
    root
}
