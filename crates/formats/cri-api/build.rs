//! Compiles `proto/cri/v1/api.proto` ([`proto_build`]: protox, no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    proto_build::compile(&["cri/v1/api.proto"], &[&proto_build::proto_dir()])
}
