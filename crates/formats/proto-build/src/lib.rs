//! The one proto build of the workspace, for the build scripts of the
//! generated-API crates (`cri-api`, `dra-api`, `vcuda-api`): protos are
//! parsed with protox (pure Rust, so no `protoc` is needed anywhere) and
//! turned into prost messages and tonic servers and clients in `OUT_DIR`.
//!
//! ```no_run
//! // build.rs
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     proto_build::compile(&["cri/v1/api.proto"], &[&proto_build::proto_dir()])
//! }
//! ```

use std::error::Error;
use std::path::{Path, PathBuf};

/// The workspace's `proto/` directory, where every vendored and own proto
/// lives.
pub fn proto_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../proto")
}

/// Compiles `files` (each named relative to one of `includes`, as in its
/// `import`s) and what they import into `OUT_DIR`: messages, gRPC servers
/// and clients. Cargo reruns the build script when any of them that lives
/// under `includes` changes (protox's built-in `google/protobuf/*` do not).
pub fn compile(files: &[&str], includes: &[&Path]) -> Result<(), Box<dyn Error>> {
    let fds = protox::compile(files, includes)?;
    for f in &fds.file {
        if let Some(p) = includes
            .iter()
            .map(|i| i.join(f.name()))
            .find(|p| p.is_file())
        {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
