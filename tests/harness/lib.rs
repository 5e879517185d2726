//! Shared helpers for the end-to-end tests in this directory.

use std::path::{Path, PathBuf};

/// Root of the workspace checkout.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Directory cargo puts this profile's binaries and cdylibs in.
pub fn target_dir() -> PathBuf {
    // Tests run from target/<profile>/deps/<test-binary>.
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}
