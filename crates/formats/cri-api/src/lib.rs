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

/// Stops and removes every pod sandbox labelled `key=value`, and with them
/// their containers: what a test (or a killed run of it) left behind.
/// Errors on single sandboxes are ignored (another cleaner got there
/// first); the list itself must succeed.
pub async fn remove_labelled_sandboxes(
    cri: &mut v1::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>,
    key: &str,
    value: &str,
) -> Result<usize, tonic::Status> {
    let selector = std::collections::HashMap::from([(key.to_string(), value.to_string())]);
    let items = cri
        .list_pod_sandbox(v1::ListPodSandboxRequest {
            filter: Some(v1::PodSandboxFilter {
                label_selector: selector,
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .items;
    for s in &items {
        let _ = cri
            .stop_pod_sandbox(v1::StopPodSandboxRequest {
                pod_sandbox_id: s.id.clone(),
            })
            .await;
        let _ = cri
            .remove_pod_sandbox(v1::RemovePodSandboxRequest {
                pod_sandbox_id: s.id.clone(),
            })
            .await;
    }
    Ok(items.len())
}

/// A sandbox's Linux config for the node's network (no CNI needed), its
/// own PID namespace and a pod IPC namespace: what the tests' pods use.
pub fn host_network_linux() -> v1::LinuxPodSandboxConfig {
    v1::LinuxPodSandboxConfig {
        cgroup_parent: String::new(),
        security_context: Some(v1::LinuxSandboxSecurityContext {
            namespace_options: Some(v1::NamespaceOption {
                network: v1::NamespaceMode::Node as i32,
                pid: v1::NamespaceMode::Container as i32,
                ipc: v1::NamespaceMode::Pod as i32,
                target_id: String::new(),
            }),
            ..Default::default()
        }),
    }
}
