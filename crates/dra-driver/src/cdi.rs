//! CDI specs (Container Device Interface, cdiVersion 0.6.0): what the
//! container runtime injects for a prepared device. The edits are the
//! device plugin's Allocate contract ([`gpu_manager::response::build`]):
//! the GPU's device node plus `nvidiactl` / `nvidia-uvm`, the driver volume
//! read-only at `/usr/local/nvidia` (the interposer's `nvidia` for shares,
//! `origin` for whole GPUs), the vm directory read-only at `/etc/vcuda`,
//! `LD_LIBRARY_PATH` and `NVIDIA_VISIBLE_DEVICES`.
//!
//! One spec file per claim, `<cdi dir>/vcuda.tencent.com-<claim uid>.json`,
//! written atomically; its device names are `<claim uid>-<request>`.

use std::path::{Path, PathBuf};

use gpu_allocator::GpuInfo;
use serde::{Deserialize, Serialize};

use crate::CDI_KIND;

pub const CDI_VERSION: &str = "0.6.0";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
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

/// A device's CDI name: `<claim uid>-<request>` with a subrequest's '/'
/// as '-' (CDI names allow `[A-Za-z0-9_.:-]`).
pub fn device_name(claim_uid: &str, request: &str) -> String {
    format!("{claim_uid}-{}", request.replace('/', "-"))
}

/// The fully qualified ID the kubelet hands the runtime.
pub fn qualified(name: &str) -> String {
    format!("{CDI_KIND}={name}")
}

pub fn spec_path(cdi_dir: &Path, claim_uid: &str) -> PathBuf {
    cdi_dir.join(format!("{}-{claim_uid}.json", crate::DRIVER_NAME))
}

/// What one device needs to build its edits.
pub struct EditsInput<'a> {
    pub gpu: &'a GpuInfo,
    pub cores: u32,
    pub memory_bytes: u64,
    pub shared: bool,
    pub vdriver_dir: &'a Path,
    pub vm_dir: &'a Path,
    pub extra_devices: &'a [String],
}

pub fn edits(i: &EditsInput<'_>) -> ContainerEdits {
    let r = gpu_manager::response::build(&gpu_manager::response::ResponseInput {
        gpus: vec![i.gpu],
        cores: i.cores,
        memory_units: i.memory_bytes / gpu_allocator::MEMORY_UNIT_BYTES,
        shared: i.shared,
        vdriver_dir: i.vdriver_dir,
        vm_dir: i.vm_dir,
        extra_devices: i.extra_devices,
    });
    let mut env: Vec<String> = r.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.sort();
    ContainerEdits {
        env,
        device_nodes: r
            .devices
            .into_iter()
            .map(|d| DeviceNode {
                path: d.container_path,
                host_path: Some(d.host_path),
                permissions: Some(d.permissions),
            })
            .collect(),
        mounts: r
            .mounts
            .into_iter()
            .map(|m| CdiMount {
                host_path: m.host_path,
                container_path: m.container_path,
                options: if m.read_only {
                    vec!["ro".into(), "nosuid".into(), "nodev".into(), "rbind".into()]
                } else {
                    vec!["nosuid".into(), "nodev".into(), "rbind".into()]
                },
                r#type: Some("bind".into()),
            })
            .collect(),
    }
}

pub fn spec(devices: Vec<CdiDevice>) -> Spec {
    Spec {
        cdi_version: CDI_VERSION.to_string(),
        kind: CDI_KIND.to_string(),
        devices,
    }
}

/// Writes the claim's spec atomically (temp + fsync + rename): the runtime
/// may read the directory at any time.
pub fn write(cdi_dir: &Path, claim_uid: &str, spec: &Spec) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(cdi_dir)?;
    let path = spec_path(cdi_dir, claim_uid);
    let body = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    crate::checkpoint::write_atomic(&path, &body)?;
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

    #[test]
    fn share_edits() {
        let g = GpuInfo {
            index: 0,
            uuid: "GPU-a".into(),
            minor: 2,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        };
        let e = edits(&EditsInput {
            gpu: &g,
            cores: 30,
            memory_bytes: 1 << 30,
            shared: true,
            vdriver_dir: Path::new("/etc/gpu-manager/vdriver"),
            vm_dir: Path::new("/etc/gpu-manager/vm/u/gpu"),
            extra_devices: &[],
        });
        assert_eq!(
            e.env,
            [
                "LD_LIBRARY_PATH=/usr/local/nvidia/lib64",
                "NVIDIA_VISIBLE_DEVICES=GPU-a"
            ]
        );
        let nodes: Vec<_> = e.device_nodes.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(nodes, ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm"]);
        assert_eq!(e.mounts[0].host_path, "/etc/gpu-manager/vdriver/nvidia");
        assert_eq!(e.mounts[0].container_path, "/usr/local/nvidia");
        assert_eq!(e.mounts[1].container_path, "/etc/vcuda");
        assert!(
            e.mounts
                .iter()
                .all(|m| m.options.contains(&"ro".to_string()))
        );
        assert_eq!(device_name("u1", "gpu/sub"), "u1-gpu-sub");
        assert_eq!(qualified("u1-gpu"), "vcuda.tencent.com/gpu=u1-gpu");
    }
}
