//! The `ContainerAllocateResponse` contract other programs rely on (the
//! project's original brief; docs/architecture.md, "A request, from Allocate
//! to the interposer"): devices, env, the two read-only mounts and the
//! annotations.

use std::collections::HashMap;
use std::path::Path;

use device_plugin::api::{ContainerAllocateResponse, DeviceSpec, Mount};
use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES};

pub const ANNOTATION_VCORE: &str = "tencent.com/vcuda-core";
pub const ANNOTATION_VMEMORY: &str = "tencent.com/vcuda-memory";
pub const ANNOTATION_VDEVICE: &str = "tencent.com/vcuda-device";
/// Where the driver volume is mounted in containers.
pub const DRIVER_MOUNT: &str = "/usr/local/nvidia";

pub struct ResponseInput<'a> {
    pub gpus: Vec<&'a GpuInfo>,
    pub cores: u32,
    pub memory_units: u64,
    /// A share (interposer volume) rather than whole GPUs (origin volume).
    pub shared: bool,
    pub vdriver_dir: &'a Path,
    pub vm_dir: &'a Path,
    pub extra_devices: &'a [String],
}

fn dev(path: &str) -> DeviceSpec {
    DeviceSpec {
        container_path: path.to_string(),
        host_path: path.to_string(),
        permissions: "rwm".to_string(),
    }
}

pub fn build(input: &ResponseInput<'_>) -> ContainerAllocateResponse {
    let minors: Vec<String> = input
        .gpus
        .iter()
        .map(|g| format!("/dev/nvidia{}", g.minor))
        .collect();
    let mut devices: Vec<DeviceSpec> = minors.iter().map(|m| dev(m)).collect();
    devices.push(dev("/dev/nvidiactl"));
    devices.push(dev("/dev/nvidia-uvm"));
    devices.extend(input.extra_devices.iter().map(|d| dev(d)));

    let uuids: Vec<&str> = input.gpus.iter().map(|g| g.uuid.as_str()).collect();
    let envs = HashMap::from([
        (
            "LD_LIBRARY_PATH".to_string(),
            format!("{DRIVER_MOUNT}/lib64"),
        ),
        ("NVIDIA_VISIBLE_DEVICES".to_string(), uuids.join(",")),
    ]);
    let volume = if input.shared { "nvidia" } else { "origin" };
    let mounts = vec![
        Mount {
            container_path: DRIVER_MOUNT.to_string(),
            host_path: input.vdriver_dir.join(volume).display().to_string(),
            read_only: true,
        },
        Mount {
            container_path: quota_config::CONTAINER_DIR.to_string(),
            host_path: input.vm_dir.display().to_string(),
            read_only: true,
        },
    ];
    let annotations = HashMap::from([
        (ANNOTATION_VCORE.to_string(), input.cores.to_string()),
        (
            ANNOTATION_VMEMORY.to_string(),
            (input.memory_units * MEMORY_UNIT_BYTES).to_string(),
        ),
        (ANNOTATION_VDEVICE.to_string(), minors.join(",")),
    ]);
    ContainerAllocateResponse {
        envs,
        mounts,
        devices,
        annotations,
        cdi_devices: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_response() {
        let g = GpuInfo {
            index: 1,
            uuid: "GPU-b".into(),
            minor: 3,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3C:00.0".into(),
        };
        let extra = vec!["/dev/nvidia-uvm-tools".to_string()];
        let r = build(&ResponseInput {
            gpus: vec![&g],
            cores: 30,
            memory_units: 8,
            shared: true,
            vdriver_dir: Path::new("/etc/gpu-manager/vdriver"),
            vm_dir: Path::new("/etc/gpu-manager/vm/u/c"),
            extra_devices: &extra,
        });
        let paths: Vec<_> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia3",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
        assert_eq!(r.mounts[0].host_path, "/etc/gpu-manager/vdriver/nvidia");
        assert!(r.mounts.iter().all(|m| m.read_only));
        assert_eq!(r.mounts[1].container_path, "/etc/vcuda");
        assert_eq!(r.annotations[ANNOTATION_VMEMORY], (8u64 << 28).to_string());
        assert_eq!(r.annotations[ANNOTATION_VDEVICE], "/dev/nvidia3");
    }
}
