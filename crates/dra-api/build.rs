//! Compiles the kubelet's DRA and plugin-registration protos with protox
//! (pure Rust, no `protoc`), like `vcuda-api`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "dra/v1/api.proto",
        "dra/v1beta1/api.proto",
        "dra-health/v1alpha1/api.proto",
        "pluginregistration/v1/api.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", proto_root.join(f).display());
    }
    let fds = protox::compile(files, [&proto_root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
