//! Static MIG devices in the slice (issue 36, pure): a GPU in MIG mode is
//! no share or whole-GPU device, but each MIG device found on it (made by
//! an administrator, or by `--mig-geometry` at start, [`crate::geometry`];
//! docs/mig.md) is a device of its own, `gpu-<index>-mig-<gi>-<ci>`: taken
//! whole by one claim with the untouched driver (the hardware is the
//! quota), or shared by claims asking for cores and memory of it.
//!
//! Attributes, as NVIDIA's own DRA driver names its (`type` "gpu" or
//! "mig", so classes tell them apart): `profile`, `uuid` (`MIG-…`),
//! `parentUUID`, `parentIndex`, `gpuInstance`, `computeInstance`,
//! `multiprocessors`, `model`, `driverVersion`, and the parent's
//! `numaNode` and PCIe root. Capacity: `cores` and `memory` (the
//! instance's, in whole 256 MiB units), as a GPU's: a claim asking for less
//! gets a vcuda share inside the instance.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::Device;
use node_agent::mig::MigDevice;

use crate::slices::{self, GpuDevice, int, string, version};
use crate::topology;
use gpu_allocator::MEMORY_UNIT_BYTES;

/// The attribute that tells GPUs from MIG devices (a class selects on it).
pub const TYPE: &str = "type";
/// `type` of a whole GPU (shares and whole GPUs).
pub const TYPE_GPU: &str = "gpu";
/// `type` of a MIG device.
pub const TYPE_MIG: &str = "mig";

/// The device name of the MIG device (`gi`, `ci`) on GPU `index`: a DNS
/// label, unique on the node (the driver's instance ids are per GPU).
pub fn device_name(index: usize, gi: u32, ci: u32) -> String {
    format!("gpu-{index}-mig-{gi}-{ci}")
}

/// The memory capacity of `m` shares are carved from: its whole 256 MiB
/// units.
pub(crate) fn share_memory(m: &MigDevice) -> u64 {
    m.memory_bytes / MEMORY_UNIT_BYTES * MEMORY_UNIT_BYTES
}

/// `m` on `parent` as the slice publishes it (health aside).
pub(crate) fn device(parent: &GpuDevice, m: &MigDevice, driver_version: &str) -> Device {
    let p = &parent.info;
    let mut attributes = BTreeMap::from([
        (TYPE.to_string(), string(TYPE_MIG)),
        ("profile".to_string(), string(&m.profile)),
        ("uuid".to_string(), string(&m.uuid)),
        ("parentUUID".to_string(), string(&p.uuid)),
        ("parentIndex".to_string(), int(p.index as i64)),
        ("gpuInstance".to_string(), int(m.gpu_instance.into())),
        (
            "computeInstance".to_string(),
            int(m.compute_instance.into()),
        ),
        ("multiprocessors".to_string(), int(m.multiprocessors.into())),
        ("model".to_string(), string(&parent.model)),
        ("driverVersion".to_string(), version(driver_version)),
    ]);
    if let Some(n) = p.numa_node {
        attributes.insert("numaNode".to_string(), int(n as i64));
    }
    if let Some(r) = &parent.pcie_root {
        attributes.insert(topology::PCIE_ROOT.to_string(), string(r));
    }
    // As a GPU: a claim asking no capacity takes the instance whole (the
    // untouched driver); one asking `cores`/`memory` gets a vcuda share
    // of the instance, enforced relative to it (docs/mig.md).
    Device {
        name: device_name(p.index, m.gpu_instance, m.compute_instance),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(slices::share_capacity(share_memory(m))),
        ..Default::default()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::slices::{self, Unhealthy};
    use gpu_allocator::GpuInfo;

    /// A 3g.40gb and a 1g.10gb instance, as `nvidia-smi mig -cgi 9,19 -C`
    /// makes them on an H100 80GB (SMs and memory: NVIDIA's MIG user
    /// guide, `nvidia-smi mig -lgip` on H100: 60 SMs / 39.50 GiB, 16 SMs /
    /// 9.75 GiB).
    pub(crate) fn h100_mig() -> GpuDevice {
        let m = |uuid: &str, profile: &str, gi, memory_mib: u64, sms| MigDevice {
            uuid: uuid.into(),
            profile: profile.into(),
            gpu_instance: gi,
            compute_instance: 0,
            memory_bytes: memory_mib << 20,
            multiprocessors: sms,
        };
        GpuDevice {
            info: GpuInfo {
                index: 1,
                uuid: "GPU-h100".into(),
                minor: 1,
                memory_bytes: 81559 << 20,
                numa_node: Some(0),
                pci_bus_id: "00000000:2A:00.0".into(),
            },
            model: "NVIDIA H100 80GB HBM3".into(),
            xid: None,
            mig: Some(vec![
                m("MIG-aaaa", "3g.40gb", 2, 40448, 60),
                m("MIG-bbbb", "1g.10gb", 9, 9984, 16),
            ]),
            pcie_root: Some("pci0000:20".into()),
            nvlink_domain: Some("GPU-h100".into()),
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        }
    }

    #[test]
    fn each_mig_device_is_a_device_with_its_profile_memory_and_sms() {
        let s = slices::build("node-a", &[h100_mig()], "580.95.05", 1, Unhealthy::LeftOut);
        let devs = s.spec.devices.unwrap();
        let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-1-mig-2-0", "gpu-1-mig-9-0"]);
        let d = &devs[0];
        assert_eq!(d.allow_multiple_allocations, Some(true), "shares");
        let a = d.attributes.as_ref().unwrap();
        let s = |k: &str| a[k].string.clone().unwrap_or_default();
        let i = |k: &str| a[k].int.unwrap();
        assert_eq!(
            (s("type"), s("profile"), s("uuid"), s("parentUUID")),
            (
                "mig".into(),
                "3g.40gb".into(),
                "MIG-aaaa".into(),
                "GPU-h100".into()
            )
        );
        assert_eq!(
            (
                i("parentIndex"),
                i("gpuInstance"),
                i("computeInstance"),
                i("multiprocessors"),
                i("numaNode")
            ),
            (1, 2, 0, 60, 0)
        );
        assert_eq!(s("model"), "NVIDIA H100 80GB HBM3");
        assert_eq!(a["driverVersion"].version.as_deref(), Some("580.95.5"));
        assert_eq!(s(topology::PCIE_ROOT), "pci0000:20");
        let c = d.capacity.as_ref().unwrap();
        assert_eq!(c.keys().collect::<Vec<_>>(), ["cores", "memory"]);
        assert_eq!(c["memory"].value.0, "40448Mi");
        assert_eq!(c["cores"].value.0, "100");
        let p = c["memory"].request_policy.as_ref().unwrap();
        assert_eq!(p.default.as_ref().unwrap().0, "40448Mi", "whole by default");
        assert_eq!(
            p.valid_range.as_ref().unwrap().step.as_ref().unwrap().0,
            "256Mi"
        );
        assert_eq!(
            devs[1].capacity.as_ref().unwrap()["memory"].value.0,
            "9984Mi"
        );
    }

    #[test]
    fn a_critical_xid_on_the_parent_reaches_its_mig_devices() {
        let sick = GpuDevice {
            xid: Some(48),
            ..h100_mig()
        };
        let left = slices::build(
            "n",
            std::slice::from_ref(&sick),
            "580.95.05",
            1,
            Unhealthy::LeftOut,
        );
        assert_eq!(left.spec.devices.unwrap().len(), 0);
        let tainted = slices::build("n", &[sick], "580.95.05", 1, Unhealthy::Taint("NoSchedule"));
        let devs = tainted.spec.devices.unwrap();
        assert_eq!(devs.len(), 2);
        for d in devs {
            let t = &d.taints.unwrap()[0];
            assert_eq!(
                (t.key.as_str(), t.value.as_deref(), t.effect.as_str()),
                (slices::UNHEALTHY_TAINT, Some("xid-48"), "NoSchedule")
            );
        }
    }

    #[test]
    fn a_critical_xid_inside_an_instance_reaches_its_devices_alone() {
        let sick = GpuDevice {
            // GPU instance 9 is the 1g.10gb.
            instance_xids: [(9, 94)].into(),
            placement_xids: Default::default(),
            ..h100_mig()
        };
        let left = slices::build(
            "n",
            std::slice::from_ref(&sick),
            "580.95.05",
            1,
            Unhealthy::LeftOut,
        );
        let names: Vec<String> = left
            .spec
            .devices
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["gpu-1-mig-2-0"]);
        let tainted = slices::build("n", &[sick], "580.95.05", 1, Unhealthy::Taint("NoExecute"));
        let taints: Vec<_> = tainted
            .spec
            .devices
            .unwrap()
            .into_iter()
            .map(|d| {
                (
                    d.name,
                    d.taints.map(|t| (t[0].value.clone(), t[0].effect.clone())),
                )
            })
            .collect();
        assert_eq!(
            taints,
            [
                ("gpu-1-mig-2-0".to_string(), None),
                (
                    "gpu-1-mig-9-0".to_string(),
                    Some((Some("xid-94".to_string()), "NoExecute".to_string()))
                )
            ]
        );
    }
}
