//! The `ContainerAllocateResponse` contract other programs rely on
//! (docs/architecture.md, "A request, from Allocate to the interposer"): the
//! container edits ([`node_agent::edits`]: devices, env, the two read-only
//! mounts) rendered for kubelet, plus the annotations.

use std::collections::HashMap;
use std::path::Path;

use device_plugin::api::{ContainerAllocateResponse, DeviceSpec, Mount};
use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES};
pub use node_agent::edits::DRIVER_MOUNT;
use node_agent::edits::{self, EditsInput, GpuEdits};

pub const ANNOTATION_VCORE: &str = "tencent.com/vcuda-core";
pub const ANNOTATION_VMEMORY: &str = "tencent.com/vcuda-memory";
pub const ANNOTATION_VDEVICE: &str = "tencent.com/vcuda-device";

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

/// The edits as kubelet takes them; `annotations` added as they are.
pub fn render(e: &GpuEdits, annotations: HashMap<String, String>) -> ContainerAllocateResponse {
    ContainerAllocateResponse {
        envs: e.common.env.iter().cloned().collect(),
        mounts: e
            .common
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                read_only: m.read_only,
            })
            .collect(),
        devices: e
            .device_nodes()
            .map(|d| DeviceSpec {
                container_path: d.path.clone(),
                host_path: d.path.clone(),
                permissions: d.permissions.clone(),
            })
            .collect(),
        annotations,
        cdi_devices: vec![],
    }
}

pub fn build(input: &ResponseInput<'_>) -> ContainerAllocateResponse {
    let e = edits::for_gpus(&EditsInput {
        gpus: &input.gpus,
        shared: input.shared,
        vdriver_dir: input.vdriver_dir,
        vm_dir: input.vm_dir,
        extra_devices: input.extra_devices,
    });
    let minors: Vec<&str> = e.gpus.iter().map(|d| d.path.as_str()).collect();
    render(
        &e,
        annotations(input.cores, input.memory_units, &minors.join(",")),
    )
}

/// The response's annotations: the container's cores, memory in bytes and
/// GPU device nodes (`/dev/nvidia1,/dev/nvidia3`).
pub fn annotations(cores: u32, memory_units: u64, devices: &str) -> HashMap<String, String> {
    HashMap::from([
        (ANNOTATION_VCORE.to_string(), cores.to_string()),
        (
            ANNOTATION_VMEMORY.to_string(),
            (memory_units * MEMORY_UNIT_BYTES).to_string(),
        ),
        (ANNOTATION_VDEVICE.to_string(), devices.to_string()),
    ])
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

    /// Every node, mount and variable of the edits, as they are.
    #[test]
    fn renders_the_edits_as_they_are() {
        let gpus: Vec<GpuInfo> = (0..2)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                minor: i as u32 + 4,
                memory_bytes: 16 << 30,
                numa_node: None,
                pci_bus_id: "00000000:3B:00.0".into(),
            })
            .collect();
        let extra = ["/dev/nvidia-uvm-tools".to_string()];
        let e = edits::for_gpus(&EditsInput {
            gpus: &[&gpus[0], &gpus[1]],
            shared: false,
            vdriver_dir: Path::new("/v"),
            vm_dir: Path::new("/vm/u/c"),
            extra_devices: &extra,
        });
        let r = render(&e, HashMap::new());
        let nodes: Vec<_> = e.device_nodes().map(|d| d.path.as_str()).collect();
        let devices: Vec<_> = r
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert_eq!(devices, nodes);
        assert!(r.devices.iter().all(|d| d.host_path == d.container_path));
        assert_eq!(r.envs.len(), e.common.env.len());
        for (k, v) in &e.common.env {
            assert_eq!(&r.envs[k], v);
        }
        let mounts: Vec<_> = r
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only))
            .collect();
        let want: Vec<_> = e
            .common
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only))
            .collect();
        assert_eq!(mounts, want);
        assert!(r.annotations.is_empty() && r.cdi_devices.is_empty());
    }
}
