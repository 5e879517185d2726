//! Compiles `proto/` ([`proto_build`]: protox, no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    proto_build::compile(
        &[
            "deviceplugin/v1beta1/api.proto",
            "podresources/v1/api.proto",
            "display/api.proto",
            "vcuda/registration.proto",
        ],
        &[&proto_build::proto_dir()],
    )
}
