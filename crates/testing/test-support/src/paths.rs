//! Where the tests run from: the workspace checkout, the profile's build
//! directory, artifacts a benchmark needs.

use std::path::{Path, PathBuf};

/// Root of the workspace checkout.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(3)
        .expect("crates/testing/test-support sits three levels below the workspace root")
        .to_path_buf()
}

/// Directory cargo puts this profile's binaries and cdylibs in
/// (`target/<profile>`: tests and benches run from
/// `target/<profile>/deps/<binary>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
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

/// A benchmark's build artifact: `name` in [`target_dir`], else in
/// target/debug.
pub fn artifact(name: &str) -> PathBuf {
    let profile = target_dir();
    let here = profile.join(name);
    if here.exists() {
        return here;
    }
    let debug = profile.parent().unwrap().join("debug").join(name);
    assert!(
        debug.exists(),
        "{name} not found in {} or target/debug: run `cargo build --release --workspace` first",
        profile.display()
    );
    eprintln!("note: using {} (no {})", debug.display(), here.display());
    debug
}
