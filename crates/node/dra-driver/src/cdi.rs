//! CDI specs (Container Device Interface, cdiVersion 0.6.0): what the
//! container runtime injects for a prepared device: the container edits
//! both modes give ([`node_agent::edits`]: the GPU's device node plus
//! `nvidiactl` / `nvidia-uvm`, the driver volume read-only at
//! `/usr/local/nvidia` (the interposer's `nvidia` for shares, `origin` for
//! whole GPUs), the vm directory read-only at `/etc/vcuda`,
//! `LD_LIBRARY_PATH` and `NVIDIA_VISIBLE_DEVICES`), rendered in CDI.
//!
//! One spec file per claim, `<cdi dir>/vcuda.tencent.com-<claim uid>.json`,
//! written atomically; its device names are `<claim uid>-<request>-<device>`.
//! What a container needs once whatever the claim holds (the two mounts,
//! the env, `nvidiactl`, `nvidia-uvm`) is the spec's own `containerEdits`,
//! which a runtime applies once per spec; a device adds only its
//! `/dev/nvidiaN`. Per-device copies would mount `/etc/vcuda` twice and
//! set `NVIDIA_VISIBLE_DEVICES` to one GPU for a claim of two.
//!
//! A MIG device's spec ([`mig_spec`]) has one device holding the parent
//! GPU's node and the instance's two access capability nodes; its common
//! edits are the origin driver and `NVIDIA_VISIBLE_DEVICES=MIG-…`, no vm
//! directory.

use std::path::{Path, PathBuf};

use gpu_allocator::GpuInfo;
use node_agent::edits::{self, EditsInput, GpuEdits};
use serde::{Deserialize, Serialize};

use crate::CDI_KIND;

pub const CDI_VERSION: &str = "0.6.0";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
    pub devices: Vec<CdiDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<CdiMount>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiMount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r#type: Option<String>,
}

/// A device's CDI name: `<claim uid>-<request>-<device>` with a
/// subrequest's '/' as '-' (CDI names allow `[A-Za-z0-9_.:-]`); the device
/// keeps two results of one request (`count: 2`) apart.
pub fn device_name(claim_uid: &str, request: &str, device: &str) -> String {
    format!("{claim_uid}-{}-{device}", request.replace('/', "-"))
}

/// The fully qualified ID the kubelet hands the runtime.
pub fn qualified(name: &str) -> String {
    format!("{CDI_KIND}={name}")
}

pub fn spec_path(cdi_dir: &Path, claim_uid: &str) -> PathBuf {
    cdi_dir.join(format!("{}-{claim_uid}.json", crate::DRIVER_NAME))
}

/// What a claim's spec is built from: its GPUs (in result order, with
/// their CDI device names), one share or whole GPUs, and its vm directory.
pub struct ClaimInput<'a> {
    pub devices: Vec<(String, &'a GpuInfo)>,
    pub shared: bool,
    pub vdriver_dir: &'a Path,
    pub vm_dir: &'a Path,
    pub extra_devices: &'a [String],
}

fn node(d: &edits::DeviceNode) -> DeviceNode {
    DeviceNode {
        path: d.path.clone(),
        host_path: Some(d.path.clone()),
        permissions: Some(d.permissions.clone()),
    }
}

fn mount(m: &edits::Mount) -> CdiMount {
    let mut options = vec!["nosuid".into(), "nodev".into(), "rbind".into()];
    if m.read_only {
        options.insert(0, "ro".into());
    }
    CdiMount {
        host_path: m.host_path.clone(),
        container_path: m.container_path.clone(),
        options,
        r#type: Some("bind".into()),
    }
}

/// The edits in CDI: what the container needs once is the spec's own
/// edits, each GPU's node goes to the device named beside it.
pub fn render(e: &GpuEdits, names: &[String]) -> Spec {
    let common = ContainerEdits {
        env: e
            .common
            .env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        device_nodes: e.common.device_nodes.iter().map(node).collect(),
        mounts: e.common.mounts.iter().map(mount).collect(),
    };
    let devices = names
        .iter()
        .zip(&e.gpus)
        .map(|(name, n)| CdiDevice {
            name: name.clone(),
            container_edits: ContainerEdits {
                device_nodes: vec![node(n)],
                ..ContainerEdits::default()
            },
        })
        .collect();
    Spec {
        cdi_version: CDI_VERSION.to_string(),
        kind: CDI_KIND.to_string(),
        container_edits: common,
        devices,
    }
}

/// The claim's spec: the container edits of all of its GPUs.
pub fn claim_spec(i: &ClaimInput<'_>) -> Spec {
    let gpus: Vec<&GpuInfo> = i.devices.iter().map(|(_, g)| *g).collect();
    let e = edits::for_gpus(&EditsInput {
        gpus: &gpus,
        shared: i.shared,
        vdriver_dir: i.vdriver_dir,
        vm_dir: i.vm_dir,
        extra_devices: i.extra_devices,
    });
    let names: Vec<String> = i.devices.iter().map(|(n, _)| n.clone()).collect();
    render(&e, &names)
}

/// What a MIG device's spec is built from.
pub struct MigInput<'a> {
    /// Its CDI device name.
    pub name: String,
    pub parent: &'a GpuInfo,
    /// `MIG-…`.
    pub uuid: &'a str,
    pub caps: node_agent::mig::AccessCaps,
    pub vdriver_dir: &'a Path,
    pub extra_devices: &'a [String],
    /// A share inside the instance: its vm directory.
    pub share_vm_dir: Option<&'a Path>,
}

/// The spec of a claim holding one MIG device, whole or a share in it.
pub fn mig_spec(i: &MigInput<'_>) -> Spec {
    let e = edits::for_mig(&edits::MigEditsInput {
        parent: i.parent,
        uuid: i.uuid,
        caps: i.caps,
        vdriver_dir: i.vdriver_dir,
        extra_devices: i.extra_devices,
        share_vm_dir: i.share_vm_dir,
    });
    let mut spec = render(&e, &[]);
    // The parent's node and both cap nodes: the device is all three.
    spec.devices = vec![CdiDevice {
        name: i.name.clone(),
        container_edits: ContainerEdits {
            device_nodes: e.gpus.iter().map(node).collect(),
            ..ContainerEdits::default()
        },
    }];
    spec
}

/// Writes the claim's spec atomically (temp + fsync + rename + fsync of the
/// directory): the runtime may read the directory at any time. The error
/// names the spec's path.
pub fn write(cdi_dir: &Path, claim_uid: &str, spec: &Spec) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(cdi_dir)?;
    let path = spec_path(cdi_dir, claim_uid);
    let body = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    quota_config::write_atomic(
        &path,
        &body,
        crate::checkpoint::FILE_MODE,
        quota_config::Durability::Durable,
    )
    .map_err(|e| std::io::Error::new(e.source.kind(), e))?;
    Ok(path)
}

/// [`write`] unless the file already holds this spec; true when written.
pub fn write_if_changed(cdi_dir: &Path, claim_uid: &str, spec: &Spec) -> std::io::Result<bool> {
    let path = spec_path(cdi_dir, claim_uid);
    let body = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    if std::fs::read(&path).is_ok_and(|b| b == body) {
        return Ok(false);
    }
    write(cdi_dir, claim_uid, spec)?;
    Ok(true)
}

pub fn remove(cdi_dir: &Path, claim_uid: &str) -> std::io::Result<()> {
    match std::fs::remove_file(spec_path(cdi_dir, claim_uid)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::fixtures::gpu;

    #[test]
    fn share_spec() {
        let g = gpu(0, 2);
        let s = claim_spec(&ClaimInput {
            devices: vec![(device_name("u", "gpu", "gpu-0"), &g)],
            shared: true,
            vdriver_dir: Path::new("/etc/gpu-manager/vdriver"),
            vm_dir: Path::new("/etc/gpu-manager/vm/u/gpu"),
            extra_devices: &[],
        });
        let e = &s.container_edits;
        assert_eq!(
            e.env,
            [
                "LD_LIBRARY_PATH=/usr/local/nvidia/lib64",
                "NVIDIA_VISIBLE_DEVICES=GPU-0"
            ]
        );
        let nodes: Vec<_> = e.device_nodes.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(nodes, ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
        assert_eq!(e.mounts[0].host_path, "/etc/gpu-manager/vdriver/nvidia");
        assert_eq!(e.mounts[0].container_path, "/usr/local/nvidia");
        assert_eq!(e.mounts[1].container_path, "/etc/vcuda");
        assert!(
            e.mounts
                .iter()
                .all(|m| m.options.contains(&"ro".to_string()))
        );
        assert_eq!(s.devices.len(), 1);
        assert_eq!(s.devices[0].name, "u-gpu-gpu-0");
        assert_eq!(
            s.devices[0].container_edits.device_nodes[0].path,
            "/dev/nvidia2"
        );
        assert!(s.devices[0].container_edits.mounts.is_empty());
        assert_eq!(device_name("u1", "gpu/sub", "gpu-1"), "u1-gpu-sub-gpu-1");
        assert_eq!(
            qualified("u1-gpu-gpu-0"),
            "vcuda.tencent.com/gpu=u1-gpu-gpu-0"
        );
    }

    /// Two whole GPUs of one request: one `/etc/vcuda`, both GPUs visible,
    /// each device its own node.
    #[test]
    fn two_whole_gpus_share_the_common_edits() {
        let (a, b) = (gpu(0, 0), gpu(1, 1));
        let s = claim_spec(&ClaimInput {
            devices: vec![
                (device_name("u", "gpu", "gpu-0"), &a),
                (device_name("u", "gpu", "gpu-1"), &b),
            ],
            shared: false,
            vdriver_dir: Path::new("/v"),
            vm_dir: Path::new("/vm/u/gpu"),
            extra_devices: &[],
        });
        let vcuda = s
            .container_edits
            .mounts
            .iter()
            .filter(|m| m.container_path == "/etc/vcuda")
            .count();
        assert_eq!(vcuda, 1);
        assert_eq!(s.container_edits.mounts[0].host_path, "/v/origin");
        assert!(
            s.container_edits
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=GPU-0,GPU-1".to_string())
        );
        let names: Vec<_> = s.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["u-gpu-gpu-0", "u-gpu-gpu-1"]);
        let nodes: Vec<_> = s
            .devices
            .iter()
            .map(|d| d.container_edits.device_nodes[0].path.as_str())
            .collect();
        assert_eq!(nodes, ["/dev/nvidia0", "/dev/nvidia1"]);
        let body = serde_json::to_value(&s).unwrap();
        assert!(body["containerEdits"]["mounts"].is_array(), "{body}");
    }

    /// Every node, mount and variable of the edits, each once: the GPUs'
    /// nodes on their devices, the rest in the spec's own edits.
    #[test]
    fn renders_the_edits_as_they_are() {
        let (a, b) = (gpu(0, 4), gpu(1, 5));
        let extra = ["/dev/nvidia-uvm-tools".to_string()];
        let e = edits::for_gpus(&EditsInput {
            gpus: &[&a, &b],
            shared: false,
            vdriver_dir: Path::new("/v"),
            vm_dir: Path::new("/vm/u/c"),
            extra_devices: &extra,
        });
        let s = render(&e, &["d0".into(), "d1".into()]);
        let mut nodes: Vec<_> = s
            .devices
            .iter()
            .flat_map(|d| &d.container_edits.device_nodes)
            .chain(&s.container_edits.device_nodes)
            .map(|n| n.path.as_str())
            .collect();
        let want: Vec<_> = e.device_nodes().map(|d| d.path.as_str()).collect();
        assert_eq!(nodes, want);
        nodes.dedup();
        assert_eq!(nodes.len(), want.len());
        let env: Vec<_> = e
            .common
            .env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(s.container_edits.env, env);
        let mounts: Vec<_> = s
            .container_edits
            .mounts
            .iter()
            .map(|m| {
                (
                    m.host_path.as_str(),
                    m.container_path.as_str(),
                    m.options[0] == "ro",
                )
            })
            .collect();
        let want: Vec<_> = e
            .common
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only))
            .collect();
        assert_eq!(mounts, want);
        assert!(
            s.devices
                .iter()
                .all(|d| d.container_edits.mounts.is_empty())
        );
    }

    #[test]
    fn a_mig_device_is_its_parent_node_and_two_cap_nodes_with_the_origin_driver() {
        let parent = gpu(1, 3);
        let s = mig_spec(&MigInput {
            name: "u-mig-gpu-1-mig-2-0".into(),
            parent: &parent,
            uuid: "MIG-abc",
            caps: node_agent::mig::AccessCaps {
                gpu_instance: 426,
                compute_instance: 427,
            },
            vdriver_dir: Path::new("/v"),
            extra_devices: &[],
            share_vm_dir: None,
        });
        assert_eq!(s.devices.len(), 1);
        let nodes: Vec<&str> = s.devices[0]
            .container_edits
            .device_nodes
            .iter()
            .map(|d| d.path.as_str())
            .collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap426",
                "/dev/nvidia-caps/nvidia-cap427"
            ]
        );
        let c = &s.container_edits;
        assert!(
            c.env
                .contains(&"NVIDIA_VISIBLE_DEVICES=MIG-abc".to_string()),
            "{c:?}"
        );
        let mounts: Vec<(&str, &str)> = c
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect();
        assert_eq!(mounts, [("/v/origin", "/usr/local/nvidia")]);
    }
}
