//! CDI specs (Container Device Interface, cdiVersion 0.6.0): what the
//! container runtime injects for a prepared device. The edits are the
//! device plugin's Allocate contract ([`gpu_manager::response::build`]):
//! the GPU's device node plus `nvidiactl` / `nvidia-uvm`, the driver volume
//! read-only at `/usr/local/nvidia` (the interposer's `nvidia` for shares,
//! `origin` for whole GPUs), the vm directory read-only at `/etc/vcuda`,
//! `LD_LIBRARY_PATH` and `NVIDIA_VISIBLE_DEVICES`.
//!
//! One spec file per claim, `<cdi dir>/vcuda.tencent.com-<claim uid>.json`,
//! written atomically; its device names are `<claim uid>-<request>-<device>`.
//! What a container needs once whatever the claim holds (the two mounts,
//! the env, `nvidiactl`, `nvidia-uvm`) is the spec's own `containerEdits`,
//! which a runtime applies once per spec; a device adds only its
//! `/dev/nvidiaN`. Per-device copies would mount `/etc/vcuda` twice and
//! set `NVIDIA_VISIBLE_DEVICES` to one GPU for a claim of two.

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
    pub cores: u32,
    pub memory_bytes: u64,
    pub shared: bool,
    pub vdriver_dir: &'a Path,
    pub vm_dir: &'a Path,
    pub extra_devices: &'a [String],
}

fn node(d: device_plugin::api::DeviceSpec) -> DeviceNode {
    DeviceNode {
        path: d.container_path,
        host_path: Some(d.host_path),
        permissions: Some(d.permissions),
    }
}

/// The claim's spec: the device plugin's Allocate response for all of its
/// GPUs, split into the spec's common edits and one node per device.
pub fn claim_spec(i: &ClaimInput<'_>) -> Spec {
    let r = gpu_manager::response::build(&gpu_manager::response::ResponseInput {
        gpus: i.devices.iter().map(|(_, g)| *g).collect(),
        cores: i.cores,
        memory_units: i.memory_bytes / gpu_allocator::MEMORY_UNIT_BYTES,
        shared: i.shared,
        vdriver_dir: i.vdriver_dir,
        vm_dir: i.vm_dir,
        extra_devices: i.extra_devices,
    });
    // The Allocate response's node of each of the claim's GPUs goes to its
    // device; the rest (nvidiactl, nvidia-uvm, extras) are common.
    let own: Vec<String> = i
        .devices
        .iter()
        .map(|(_, g)| format!("/dev/nvidia{}", g.minor))
        .collect();
    let (mine, common_nodes): (Vec<_>, Vec<_>) = r
        .devices
        .into_iter()
        .partition(|d| own.contains(&d.container_path));
    let mut env: Vec<String> = r.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.sort();
    let common = ContainerEdits {
        env,
        device_nodes: common_nodes.into_iter().map(node).collect(),
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
    };
    let devices = i
        .devices
        .iter()
        .zip(own)
        .map(|((name, _), path)| CdiDevice {
            name: name.clone(),
            container_edits: ContainerEdits {
                device_nodes: mine
                    .iter()
                    .find(|d| d.container_path == path)
                    .cloned()
                    .map(node)
                    .into_iter()
                    .collect(),
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

    fn gpu(index: usize, minor: u32) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            minor,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        }
    }

    #[test]
    fn share_spec() {
        let g = gpu(0, 2);
        let s = claim_spec(&ClaimInput {
            devices: vec![(device_name("u", "gpu", "gpu-0"), &g)],
            cores: 30,
            memory_bytes: 1 << 30,
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
            cores: 200,
            memory_bytes: 32 << 30,
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
}
