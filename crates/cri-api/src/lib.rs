//! kubelet's Container Runtime Interface, `runtime.v1` (the subset in
//! `proto/cri/v1/api.proto`): clients for gpu-manager's CRI backend
//! (containerd, CRI-O) and servers for test doubles.

pub mod runtime {
    pub mod v1 {
        tonic::include_proto!("runtime.v1");

        /// containerd's CRI socket (its default `grpc.address`).
        pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
        /// CRI-O's socket (its default `listen`).
        pub const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";
    }
}

pub use runtime::v1;
