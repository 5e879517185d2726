//! What the C-ABI tests of the built library share: loading it from a
//! sim root installed from a node file, and calling its exports with their
//! nvml.h signatures (written here, independently of the library's).

#![allow(dead_code)] // each test binary uses part of it

use gpu_sim_core::{NodeSpec, SharedState, SimRoot};
use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};

pub type Ret = i32;
pub type Dev = *mut c_void;

pub const SUCCESS: Ret = 0;
pub const INVALID_ARGUMENT: Ret = 2;
pub const NOT_SUPPORTED: Ret = 3;
pub const NOT_FOUND: Ret = 6;
pub const IN_USE: Ret = 19;
pub const INSUFFICIENT_RESOURCES: Ret = 23;
pub const VERSION_MISMATCH: Ret = 25;

/// A root with `config/nodes/<node>.toml` and a copy of the built library
/// in it (it finds its root from its own file).
pub fn install(node: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = SimRoot::new(dir.path());
    let node_file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../config/nodes")
        .join(format!("{node}.toml"));
    let node = NodeSpec::load(&node_file).unwrap();
    SharedState::install(&root, &node).unwrap();
    std::fs::create_dir_all(root.dev_dir()).unwrap();
    for g in &node.gpus {
        std::fs::write(root.device_node(g.minor), b"").unwrap();
    }
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/libnvidia_ml.so
    let exe = std::env::current_exe().unwrap();
    let built = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("libnvidia_ml.so");
    assert!(built.is_file(), "{} not built", built.display());
    assert_fresh(&built);
    let lib_dir = dir.path().join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let lib = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(&built, &lib).unwrap();
    (dir, lib)
}

/// `cargo test` does not rebuild a cdylib: refuse a library older than
/// the crate's sources rather than test stale code.
pub fn assert_fresh(built: &Path) {
    let mtime = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let lib = mtime(built);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        assert!(
            mtime(&p) <= lib,
            "{} is older than {}: run `cargo build -p gpu-sim-nvml` first",
            built.display(),
            p.display()
        );
    }
}

pub struct Nvml(*mut c_void);

impl Nvml {
    pub fn open(path: &Path) -> Nvml {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: dlopen of a NUL-terminated path.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {}", path.display());
        Nvml(h)
    }
    /// The address of `name`, to transmute to its C signature.
    pub fn sym(&self, name: &str) -> *mut c_void {
        let n = CString::new(name).unwrap();
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, n.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        p
    }
}

/// Calls export `$name` of `$lib` with the C signature `fn($($t),*) -> Ret`.
macro_rules! call {
    ($lib:expr, $name:literal, ($($t:ty),* $(,)?) $(, $arg:expr)* $(,)?) => {{
        // SAFETY: the symbol is NVML's function of this C signature (nvml.h).
        let f: unsafe extern "C" fn($($t),*) -> Ret = unsafe { std::mem::transmute($lib.sym($name)) };
        // SAFETY: every pointer argument points at a live local of the right type.
        unsafe { f($($arg),*) }
    }};
}
