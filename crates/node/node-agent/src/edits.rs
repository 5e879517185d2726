//! What a container holding GPUs gets, in neither mode's wire type: the
//! GPUs' device nodes plus `nvidiactl` / `nvidia-uvm` and the extra devices,
//! the driver volume read-only at [`DRIVER_MOUNT`] (the interposer's
//! `nvidia` volume for shares, `origin` for whole GPUs), the vm directory
//! read-only at `/etc/vcuda`, `LD_LIBRARY_PATH` and `NVIDIA_VISIBLE_DEVICES`.
//! A MIG device ([`for_mig`]) gets its instance's capability nodes and the
//! untouched driver instead. The device plugin renders it as an Allocate
//! response, the DRA driver as a CDI spec.

use std::path::Path;

use gpu_allocator::GpuInfo;

/// Where the driver volume is mounted in containers.
pub const DRIVER_MOUNT: &str = "/usr/local/nvidia";

/// A host device node, at the same path inside the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    pub path: String,
    /// cgroup permissions ("rwm").
    pub permissions: String,
}

impl DeviceNode {
    fn rwm(path: impl Into<String>) -> DeviceNode {
        DeviceNode {
            path: path.into(),
            permissions: "rwm".into(),
        }
    }
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

/// Device nodes, mounts and environment for one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    pub device_nodes: Vec<DeviceNode>,
    pub mounts: Vec<Mount>,
    /// (name, value), sorted by name.
    pub env: Vec<(String, String)>,
}

/// A container's edits split by what they come from: each GPU's own node
/// (in the order of the GPUs) and what the container needs once, however
/// many GPUs it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEdits {
    pub gpus: Vec<DeviceNode>,
    pub common: ContainerEdits,
}

impl GpuEdits {
    /// Every device node: the GPUs' first, then the common ones.
    pub fn device_nodes(&self) -> impl Iterator<Item = &DeviceNode> {
        self.gpus.iter().chain(&self.common.device_nodes)
    }
}

/// What the edits are made from.
pub struct EditsInput<'a> {
    pub gpus: &'a [&'a GpuInfo],
    /// A share (interposer volume) rather than whole GPUs (origin volume).
    pub shared: bool,
    pub vdriver_dir: &'a Path,
    pub vm_dir: &'a Path,
    pub extra_devices: &'a [String],
}

/// `/dev/nvidia<minor>`.
pub fn gpu_node_path(g: &GpuInfo) -> String {
    format!("/dev/nvidia{}", g.minor)
}

pub fn for_gpus(i: &EditsInput<'_>) -> GpuEdits {
    let gpus = i.gpus.iter().map(|g| DeviceNode::rwm(gpu_node_path(g)));
    let mut device_nodes = vec![
        DeviceNode::rwm("/dev/nvidiactl"),
        DeviceNode::rwm("/dev/nvidia-uvm"),
    ];
    device_nodes.extend(i.extra_devices.iter().map(DeviceNode::rwm));
    let uuids: Vec<&str> = i.gpus.iter().map(|g| g.uuid.as_str()).collect();
    let volume = if i.shared { "nvidia" } else { "origin" };
    GpuEdits {
        gpus: gpus.collect(),
        common: ContainerEdits {
            device_nodes,
            mounts: vec![
                Mount {
                    host_path: i.vdriver_dir.join(volume).display().to_string(),
                    container_path: DRIVER_MOUNT.to_string(),
                    read_only: true,
                },
                Mount {
                    host_path: i.vm_dir.display().to_string(),
                    container_path: quota_config::CONTAINER_DIR.to_string(),
                    read_only: true,
                },
            ],
            env: vec![
                ("LD_LIBRARY_PATH".into(), format!("{DRIVER_MOUNT}/lib64")),
                ("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(",")),
            ],
        },
    }
}

/// What a MIG device's edits are made from.
pub struct MigEditsInput<'a> {
    /// The GPU the instance is on.
    pub parent: &'a GpuInfo,
    /// `MIG-…`.
    pub uuid: &'a str,
    pub caps: crate::mig::AccessCaps,
    pub vdriver_dir: &'a Path,
    pub extra_devices: &'a [String],
    /// A vcuda share inside the instance: its vm directory (the quota,
    /// relative to the instance, and the interposer volume). `None`: the
    /// whole instance with the untouched driver.
    pub share_vm_dir: Option<&'a Path>,
}

/// One MIG device: the parent GPU's node and the instance's two access
/// capability nodes (NVIDIA's MIG user guide, "Device Nodes and
/// Capabilities"), `NVIDIA_VISIBLE_DEVICES=MIG-…`; taken whole, the origin
/// volume and no vm directory (the hardware is the quota); a share inside
/// it, the interposer volume and its vm directory, as on a whole GPU.
pub fn for_mig(i: &MigEditsInput<'_>) -> GpuEdits {
    let mut e = for_gpus(&EditsInput {
        gpus: &[i.parent],
        shared: i.share_vm_dir.is_some(),
        vdriver_dir: i.vdriver_dir,
        vm_dir: i.share_vm_dir.unwrap_or(Path::new("")),
        extra_devices: i.extra_devices,
    });
    e.gpus.extend(i.caps.node_paths().map(DeviceNode::rwm));
    if i.share_vm_dir.is_none() {
        e.common.mounts.retain(|m| m.container_path == DRIVER_MOUNT);
    }
    for (k, v) in &mut e.common.env {
        if k == "NVIDIA_VISIBLE_DEVICES" {
            *v = i.uuid.to_string();
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_gpus() -> [GpuInfo; 2] {
        [(0, 2), (1, 3)].map(|(index, minor)| GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            minor,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        })
    }

    #[test]
    fn a_share_and_whole_gpus() {
        let [a, b] = sample_gpus();
        let extra = ["/dev/nvidia-uvm-tools".to_string()];
        let e = for_gpus(&EditsInput {
            gpus: &[&a, &b],
            shared: true,
            vdriver_dir: Path::new("/v"),
            vm_dir: Path::new("/vm/u/c"),
            extra_devices: &extra,
        });
        let nodes: Vec<_> = e.device_nodes().map(|d| d.path.as_str()).collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidia2",
                "/dev/nvidia3",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
        assert!(e.device_nodes().all(|d| d.permissions == "rwm"));
        let m = &e.common.mounts;
        assert_eq!(
            (m[0].host_path.as_str(), m[0].container_path.as_str()),
            ("/v/nvidia", "/usr/local/nvidia")
        );
        assert_eq!(
            (m[1].host_path.as_str(), m[1].container_path.as_str()),
            ("/vm/u/c", "/etc/vcuda")
        );
        assert!(m.iter().all(|m| m.read_only));
        assert_eq!(
            e.common.env,
            [
                ("LD_LIBRARY_PATH".into(), "/usr/local/nvidia/lib64".into()),
                ("NVIDIA_VISIBLE_DEVICES".into(), "GPU-0,GPU-1".into())
            ]
        );
        let whole = for_gpus(&EditsInput {
            gpus: &[&a],
            shared: false,
            vdriver_dir: Path::new("/v"),
            vm_dir: Path::new("/vm/u/c"),
            extra_devices: &[],
        });
        assert_eq!(whole.common.mounts[0].host_path, "/v/origin");
        assert_eq!(whole.common.device_nodes.len(), 2);
    }

    #[test]
    fn a_mig_device() {
        let [_, b] = sample_gpus();
        let caps = crate::mig::AccessCaps {
            gpu_instance: 156,
            compute_instance: 157,
        };
        let e = for_mig(&MigEditsInput {
            parent: &b,
            uuid: "MIG-0a1b",
            caps,
            vdriver_dir: Path::new("/v"),
            extra_devices: &[],
            share_vm_dir: None,
        });
        let nodes: Vec<_> = e.device_nodes().map(|d| d.path.as_str()).collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap156",
                "/dev/nvidia-caps/nvidia-cap157",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm"
            ]
        );
        let m = &e.common.mounts;
        assert_eq!(m.len(), 1, "the driver only, no vm directory: {m:?}");
        assert_eq!(m[0].host_path, "/v/origin");
        assert_eq!(
            e.common.env,
            [
                ("LD_LIBRARY_PATH".into(), "/usr/local/nvidia/lib64".into()),
                ("NVIDIA_VISIBLE_DEVICES".into(), "MIG-0a1b".into())
            ]
        );
        // A share inside it: the same nodes, the interposer and the quota.
        let s = for_mig(&MigEditsInput {
            share_vm_dir: Some(Path::new("/vm/claim/gpu")),
            ..MigEditsInput {
                parent: &b,
                uuid: "MIG-0a1b",
                caps,
                vdriver_dir: Path::new("/v"),
                extra_devices: &[],
                share_vm_dir: None,
            }
        });
        assert!(s.device_nodes().eq(e.device_nodes()));
        let m: Vec<_> = s
            .common
            .mounts
            .iter()
            .map(|m| m.host_path.as_str())
            .collect();
        assert_eq!(m, ["/v/nvidia", "/vm/claim/gpu"]);
        assert_eq!(s.common.env, e.common.env);
    }
}
