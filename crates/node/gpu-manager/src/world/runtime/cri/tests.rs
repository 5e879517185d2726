use std::collections::HashMap;
use std::time::Duration;

use cri_api::v1::{Container, ContainerMetadata, ContainerState, PodSandbox, PodSandboxMetadata};

use super::*;

fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn container(state: ContainerState, l: &[(&str, &str)]) -> Container {
    Container {
        id: "c1".into(),
        pod_sandbox_id: "s1".into(),
        metadata: Some(ContainerMetadata {
            name: "meta-name".into(),
            attempt: 0,
        }),
        state: state as i32,
        labels: labels(l),
        ..Default::default()
    }
}

#[test]
fn kubelet_labels_name_the_pod_and_container() {
    let c = container(
        ContainerState::ContainerRunning,
        &[
            (LABEL_POD_UID, "uid-1"),
            (LABEL_POD_NAME, "p"),
            (LABEL_POD_NAMESPACE, "ns"),
            (LABEL_CONTAINER, "main"),
        ],
    );
    let l = kubernetes_container(&c, None).unwrap();
    assert_eq!(
        (
            l.pod_uid.as_str(),
            l.pod_name.as_str(),
            l.namespace.as_str(),
            l.container.as_str()
        ),
        ("uid-1", "p", "ns", "main")
    );
    assert!(l.alive);
    assert_eq!(l.vm_source, None);
}

#[test]
fn the_sandbox_fills_in_missing_labels_and_foreign_containers_are_skipped() {
    let sandbox = PodSandbox {
        id: "s1".into(),
        metadata: Some(PodSandboxMetadata {
            name: "p".into(),
            uid: "uid-2".into(),
            namespace: "ns".into(),
            attempt: 0,
        }),
        ..Default::default()
    };
    let c = container(ContainerState::ContainerExited, &[]);
    let l = kubernetes_container(&c, Some(&sandbox)).unwrap();
    assert_eq!(
        (l.pod_uid.as_str(), l.container.as_str()),
        ("uid-2", "meta-name")
    );
    assert!(!l.alive, "exited");
    // Not kubelet's (no labels, no sandbox): not a Kubernetes container.
    assert_eq!(kubernetes_container(&c, None), None);
}

#[test]
fn only_exited_containers_are_dead() {
    assert!(alive(ContainerState::ContainerCreated));
    assert!(alive(ContainerState::ContainerRunning));
    assert!(alive(ContainerState::ContainerUnknown), "unknown may run");
    assert!(!alive(ContainerState::ContainerExited));
}

/// The shape containerd 1.6 returns: kubelet's config and the OCI spec.
#[test]
fn containerd_info_gives_kubelet_envs_and_devices() {
    let info = r#"{"sandboxID":"s1","pid":42,
      "config":{"metadata":{"name":"main"},
        "envs":[{"key":"PATH","value":"/bin"},{"key":"NVIDIA_VISIBLE_DEVICES","value":"GPU-a, GPU-b"}],
        "devices":[{"container_path":"/dev/nvidia1","host_path":"/sim/dev/nvidia1","permissions":"rwm"},
                   {"container_path":"/dev/nvidiactl","host_path":"/dev/nvidiactl","permissions":"rwm"}]},
      "runtimeSpec":{"process":{"env":["NVIDIA_VISIBLE_DEVICES=all"]},
        "linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]}}}"#;
    let g = gpus_from_info(info).unwrap();
    assert_eq!(
        g.visible,
        vec!["GPU-a", "GPU-b"],
        "kubelet's value, not the image's"
    );
    assert_eq!(g.devices, vec!["/dev/nvidia1"]);
}

/// The shape CRI-O returns: no config, the OCI spec only; the image's
/// variable comes first and the container's overrides it.
#[test]
fn crio_info_gives_the_spec_environment_and_devices() {
    let info = r#"{"sandboxID":"s1","pid":42,"privileged":false,
      "runtimeSpec":{"process":{"env":["NVIDIA_VISIBLE_DEVICES=all","HOME=/","NVIDIA_VISIBLE_DEVICES=GPU-c"]},
        "linux":{"devices":[{"path":"/dev/nvidia3","type":"c"},{"path":"/dev/nvidia-uvm","type":"c"}]}}}"#;
    let g = gpus_from_info(info).unwrap();
    assert_eq!(g.visible, vec!["GPU-c"]);
    assert_eq!(g.devices, vec!["/dev/nvidia3"]);
}

#[test]
fn info_without_a_spec_is_an_error_that_says_so() {
    let e = gpus_from_info(r#"{"pid":1}"#).unwrap_err();
    assert!(e.to_string().contains("runtimeSpec"), "{e}");
    assert!(
        gpus_from_info("not json")
            .unwrap_err()
            .to_string()
            .contains("not JSON")
    );
}

#[tokio::test]
async fn a_missing_socket_is_unreachable_and_names_the_endpoint() {
    let rt = Cri::new("containerd", "unix:///nonexistent/vcuda/containerd.sock");
    for e in [
        rt.containers().await.unwrap_err(),
        rt.gpus("c1").await.unwrap_err(),
    ] {
        assert!(matches!(e, RuntimeError::Unreachable { .. }), "{e:?}");
        assert!(
            e.to_string().contains("/nonexistent/vcuda/containerd.sock"),
            "{e}"
        );
    }
}

/// A socket that accepts but never speaks (a hung runtime): the call ends
/// at the timeout, unreachable.
#[tokio::test]
async fn a_silent_runtime_is_unreachable_after_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            conns.push(s);
        }
    });
    let rt = Cri::new("containerd", &format!("unix://{}", sock.display()))
        .with_timeout(Duration::from_secs(1));
    let e = rt.containers().await.unwrap_err();
    assert!(matches!(e, RuntimeError::Unreachable { .. }), "{e:?}");
    held.abort();
}
