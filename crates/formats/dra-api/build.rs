//! Compiles the kubelet's DRA and plugin-registration protos
//! ([`proto_build`]: protox, no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    proto_build::compile(
        &[
            "dra/v1/api.proto",
            "dra/v1beta1/api.proto",
            "dra-health/v1/api.proto",
            "dra-health/v1alpha1/api.proto",
            "pluginregistration/v1/api.proto",
        ],
        &[&proto_build::proto_dir()],
    )
}
