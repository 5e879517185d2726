//! What the driver publishes (pure): one ResourceSlice per node holding a
//! device per healthy GPU, and the DeviceClasses users select.
//!
//! Every device allows multiple allocations and offers consumable capacity
//! `cores` (100 = the whole GPU) and `memory` (bytes, in 256 MiB steps), so
//! the scheduler packs several claims onto one GPU (KEP-5075, beta in
//! 1.36). A claim that asks for no capacity gets the defaults, which are
//! the whole GPU. A GPU with a recent critical Xid stays in the slice with a
//! device taint (KEP-5055, beta and on in 1.36) until it is healthy again:
//! new claims avoid it, claims already allocated there keep a published
//! device (and, under `NoExecute`, the taint eviction controller evicts their
//! pods). Where the API server drops taints it is left out instead.
//!
//! A GPU in MIG mode is no such device: its MIG devices are, each taken
//! whole ([`crate::mig`]). Devices say which they are in the `type`
//! attribute, and each class selects one type.

use std::collections::BTreeMap;

use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES};
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute,
    DeviceCapacity, DeviceClass, DeviceClassConfiguration, DeviceClassSpec, DeviceSelector,
    DeviceTaint, OpaqueDeviceConfiguration, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

use crate::dynamic::{self, DynamicGpu};
use crate::mig::{self, TYPE, TYPE_GPU, TYPE_MIG};
use crate::{CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME, quantity, topology};

/// One GPU as discovery and health see it.
#[derive(Debug, Clone)]
pub struct GpuDevice {
    pub info: GpuInfo,
    pub model: String,
    /// The critical Xid that made the GPU unhealthy, until its quiet
    /// period passes; `None` while healthy.
    pub xid: Option<u64>,
    /// In MIG mode, its MIG devices: its SMs and memory are in hardware
    /// partitions, so it is no share or whole-GPU device, they are.
    /// `None`: not in MIG mode.
    pub mig: Option<Vec<node_agent::mig::MigDevice>>,
    /// Critical Xids NVML named inside a GPU instance, by its id, until
    /// their quiet period passes: those MIG devices alone are out.
    pub instance_xids: BTreeMap<u32, u64>,
    /// On a dynamic GPU, the placement devices whose instance has one of
    /// those Xids (by device name; the controller derives it from the
    /// prepared claims when it publishes): only they are out.
    pub placement_xids: BTreeMap<String, u64>,
    /// `resource.kubernetes.io/pcieRoot`, where sysfs says
    /// ([`crate::topology::pcie_root`]).
    pub pcie_root: Option<String>,
    /// `nvlinkDomain` ([`crate::topology::nvlink_domains`]).
    pub nvlink_domain: Option<String>,
}

impl GpuDevice {
    pub fn healthy(&self) -> bool {
        self.xid.is_none()
    }
}

pub use gpu_pods::dra::UNHEALTHY_TAINT;

/// How the slice shows a GPU with a recent critical Xid
/// (`--xid-taint-effect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unhealthy {
    /// In the slice with the [`UNHEALTHY_TAINT`] of this effect
    /// (`NoSchedule` or `NoExecute`).
    Taint(&'static str),
    /// Out of the slice: for API servers without device taints, where a
    /// claim allocated on it then names a device no slice publishes.
    LeftOut,
}

/// An `--xid-taint-effect` that is none of the three.
#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?}: expected NoSchedule (new claims avoid the GPU), NoExecute (and pods using it are \
     evicted) or LeaveOut (the GPU leaves the slice)"
)]
pub struct UnknownEffect(String);

impl std::str::FromStr for Unhealthy {
    type Err = UnknownEffect;
    fn from_str(s: &str) -> Result<Self, UnknownEffect> {
        match s {
            "NoSchedule" => Ok(Unhealthy::Taint("NoSchedule")),
            "NoExecute" => Ok(Unhealthy::Taint("NoExecute")),
            "LeaveOut" => Ok(Unhealthy::LeftOut),
            _ => Err(UnknownEffect(s.to_string())),
        }
    }
}

/// The device name of GPU `index` in the slice and in allocation results.
pub fn device_name(index: usize) -> String {
    format!("gpu-{index}")
}

/// The slice's name: one per node and driver, so a restart replaces it
/// rather than adding another.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER_NAME}")
}

pub(crate) fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_string()),
        ..Default::default()
    }
}

pub(crate) fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

/// A driver version as a semantic version attribute ("550.54.15"; "550.54"
/// gets ".0"), or a string where it is not numeric.
pub(crate) fn version(v: &str) -> DeviceAttribute {
    let parts: Vec<&str> = v.split('.').collect();
    if parts
        .iter()
        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        let mut p: Vec<String> = parts
            .iter()
            .map(|p| p.trim_start_matches('0').to_string())
            .collect();
        for x in &mut p {
            if x.is_empty() {
                *x = "0".into();
            }
        }
        p.resize(3.max(p.len()), "0".into());
        if p.len() == 3 {
            return DeviceAttribute {
                version: Some(p.join(".")),
                ..Default::default()
            };
        }
    }
    string(v)
}

/// `g`'s devices as the slice shows them under `unhealthy`: the GPU, or
/// in MIG mode its MIG devices, or when `dynamic` every placement
/// ([`crate::dynamic`]); a critical Xid of the GPU is theirs too, one
/// inside a GPU instance that instance's MIG devices' (or placement's)
/// alone.
fn published(
    g: &GpuDevice,
    dynamic: Option<&DynamicGpu>,
    driver_version: &str,
    unhealthy: Unhealthy,
) -> Vec<Device> {
    let devices: Vec<(Device, Option<u64>)> = match (&g.mig, dynamic) {
        (_, Some(d)) => dynamic::devices(g, d, driver_version)
            .into_iter()
            .map(|d| {
                let xid = g.xid.or(g.placement_xids.get(&d.name).copied());
                (d, xid)
            })
            .collect(),
        (None, None) => vec![(device(g, driver_version), g.xid)],
        (Some(migs), None) => migs
            .iter()
            .map(|m| {
                let xid = g.xid.or(g.instance_xids.get(&m.gpu_instance).copied());
                (mig::device(g, m, driver_version), xid)
            })
            .collect(),
    };
    devices
        .into_iter()
        .filter_map(|(d, xid)| match (xid, unhealthy) {
            (None, _) => Some(d),
            (Some(_), Unhealthy::LeftOut) => None,
            (Some(xid), Unhealthy::Taint(effect)) => Some(Device {
                taints: Some(vec![DeviceTaint {
                    key: UNHEALTHY_TAINT.to_string(),
                    value: Some(format!("xid-{xid}")),
                    effect: effect.to_string(),
                    // The API server stamps it.
                    time_added: None,
                }]),
                ..d
            }),
        })
        .collect()
}

fn device(g: &GpuDevice, driver_version: &str) -> Device {
    let i = &g.info;
    let mut attributes = BTreeMap::from([
        (TYPE.to_string(), string(TYPE_GPU)),
        ("model".to_string(), string(&g.model)),
        ("uuid".to_string(), string(&i.uuid)),
        (
            "pciBusID".to_string(),
            string(&i.pci_bus_id.to_ascii_lowercase()),
        ),
        ("index".to_string(), int(i.index as i64)),
        ("minor".to_string(), int(i.minor as i64)),
        ("driverVersion".to_string(), version(driver_version)),
    ]);
    if let Some(n) = i.numa_node {
        attributes.insert("numaNode".to_string(), int(n as i64));
    }
    // What a claim matches to get GPUs close to each other.
    if let Some(r) = &g.pcie_root {
        attributes.insert(topology::PCIE_ROOT.to_string(), string(r));
    }
    if let Some(d) = &g.nvlink_domain {
        attributes.insert(topology::NVLINK_DOMAIN.to_string(), string(d));
    }
    // Whole 256 MiB units: what a share's memory is carved in.
    let capacity = share_capacity(i.memory_units() * MEMORY_UNIT_BYTES);
    Device {
        name: device_name(i.index),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Default::default()
    }
}

/// What a device shares are carved from: `cores` 1..=100 (100 by
/// default, the whole device) and `memory` (bytes in 256 MiB steps, all of
/// `memory` by default); a claim that asks for neither takes it whole.
pub(crate) fn share_capacity(memory: u64) -> BTreeMap<String, DeviceCapacity> {
    BTreeMap::from([
        (
            CAPACITY_CORES.to_string(),
            DeviceCapacity {
                value: Quantity("100".into()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity("100".into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity("1".into()),
                        max: Some(Quantity("100".into())),
                        step: Some(Quantity("1".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            CAPACITY_MEMORY.to_string(),
            DeviceCapacity {
                value: Quantity(quantity::bytes(memory)),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity(quantity::bytes(memory))),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity(quantity::bytes(MEMORY_UNIT_BYTES)),
                        max: Some(Quantity(quantity::bytes(memory))),
                        step: Some(Quantity(quantity::bytes(MEMORY_UNIT_BYTES))),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ])
}

/// The node's slice at pool generation `generation`, unhealthy GPUs shown
/// as `unhealthy` says (no dynamic GPU).
pub fn build(
    node: &str,
    gpus: &[GpuDevice],
    driver_version: &str,
    generation: i64,
    unhealthy: Unhealthy,
) -> ResourceSlice {
    let none = BTreeMap::new();
    build_one(node, gpus, &none, driver_version, generation, unhealthy)
}

/// The node's pool: [`build`]'s one slice, or with dynamic GPUs (by
/// index) their counter sets and devices in several
/// ([`dynamic::pool`]).
pub fn build_pool(
    node: &str,
    gpus: &[GpuDevice],
    dynamic: &BTreeMap<usize, DynamicGpu>,
    driver_version: &str,
    generation: i64,
    unhealthy: Unhealthy,
) -> Vec<ResourceSlice> {
    let one = build_one(node, gpus, dynamic, driver_version, generation, unhealthy);
    let sets = gpus
        .iter()
        .filter_map(|g| {
            Some(dynamic::counter_set(
                g.info.index,
                dynamic.get(&g.info.index)?,
            ))
        })
        .collect();
    dynamic::pool(one, sets)
}

fn build_one(
    node: &str,
    gpus: &[GpuDevice],
    dynamic: &BTreeMap<usize, DynamicGpu>,
    driver_version: &str,
    generation: i64,
    unhealthy: Unhealthy,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.to_string(),
            node_name: Some(node.to_string()),
            pool: ResourcePool {
                name: node.to_string(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(
                gpus.iter()
                    .flat_map(|g| {
                        let d = dynamic.get(&g.info.index);
                        published(g, d, driver_version, unhealthy)
                    })
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

/// Whether two slice specs publish the same devices (the generation and
/// the API server's taint stamps aside).
pub fn same_devices(a: &ResourceSliceSpec, b: &ResourceSliceSpec) -> bool {
    let strip = |s: &ResourceSliceSpec| {
        let mut s = s.clone();
        s.pool.generation = 0;
        for d in s.devices.iter_mut().flatten() {
            for t in d.taints.iter_mut().flatten() {
                t.time_added = None;
            }
        }
        serde_json::to_value(s).unwrap_or_default()
    };
    strip(a) == strip(b)
}

/// Whether the API server kept the taints `sent` carried (one without
/// device taints drops the field on write).
pub fn taints_kept(sent: &ResourceSliceSpec, stored: &ResourceSliceSpec) -> bool {
    let tainted = |s: &ResourceSliceSpec| {
        s.devices
            .iter()
            .flatten()
            .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
            .count()
    };
    tainted(stored) >= tainted(sent)
}

/// DeviceClass for shares: any vcuda GPU; the claim says how much with
/// `capacity.requests` (`cores`, `memory`).
pub const SHARE_CLASS: &str = gpu_pods::dra::SHARE_CLASS;
/// DeviceClass for whole GPUs: the defaults (all cores, all memory), the
/// untouched driver; the driver refuses a partial allocation under it.
pub const WHOLE_CLASS: &str = gpu_pods::dra::WHOLE_CLASS;
/// DeviceClass for MIG devices (each whole, the untouched driver); a
/// claim picks a profile with a selector on `profile`.
pub const MIG_CLASS: &str = gpu_pods::dra::MIG_CLASS;

/// The CEL expression selecting this driver's devices of type `t`.
pub fn type_selector(t: &str) -> String {
    format!("device.attributes['{DRIVER_NAME}'].{TYPE} == '{t}'")
}

fn class(
    name: &str,
    t: &str,
    config: Option<serde_json::Value>,
    extended_resource: Option<&str>,
) -> DeviceClass {
    let cel = |expression: String| DeviceSelector {
        cel: Some(CELDeviceSelector { expression }),
    };
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(BTreeMap::from([(
                CLASS_OWNER_LABEL.0.to_string(),
                CLASS_OWNER_LABEL.1.to_string(),
            )])),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            // Both must match: the driver, then the type (a device of
            // another driver has no attributes under this domain).
            selectors: Some(vec![
                cel(format!("device.driver == '{DRIVER_NAME}'")),
                cel(type_selector(t)),
            ]),
            config: config.map(|p| {
                vec![DeviceClassConfiguration {
                    opaque: Some(OpaqueDeviceConfiguration {
                        driver: DRIVER_NAME.to_string(),
                        parameters: RawExtension(p),
                    }),
                }]
            }),
            extended_resource_name: extended_resource.map(str::to_string),
        },
    }
}

/// The label on the DeviceClasses this driver makes: it keeps them as its
/// release defines them.
pub const CLASS_OWNER_LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "vcuda-dra-driver");

/// What to do with a class of one of this driver's names that the API
/// server has already.
#[derive(Debug, Clone, PartialEq)]
pub enum ClassAction {
    Keep,
    /// Ours, of another release (or unlabelled in the shape an earlier
    /// release made, the driver selector alone): replaced by this.
    Update(Box<DeviceClass>),
    /// Someone else's: left alone, and why that matters.
    Foreign(String),
}

/// Whether `have` is to become `want`. An earlier release's classes
/// selected the driver alone; left so, a share claim could be given a MIG
/// device (which takes cores and memory since shares inside instances).
pub fn class_action(have: &DeviceClass, want: &DeviceClass) -> ClassAction {
    if have.spec == want.spec {
        return ClassAction::Keep;
    }
    let labelled = have
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CLASS_OWNER_LABEL.0))
        .is_some_and(|v| v == CLASS_OWNER_LABEL.1);
    let expressions: Vec<&str> = have
        .spec
        .selectors
        .iter()
        .flatten()
        .filter_map(|s| Some(s.cel.as_ref()?.expression.as_str()))
        .collect();
    let earlier = expressions == [format!("device.driver == '{DRIVER_NAME}'")];
    if labelled || earlier {
        let mut new = want.clone();
        new.metadata.resource_version = have.metadata.resource_version.clone();
        return ClassAction::Update(Box::new(new));
    }
    ClassAction::Foreign(format!(
        "DeviceClass {} exists, not labelled {}={} and selecting {expressions:?}: left as it is; \
         this release's class selects the devices of its type only (delete it and the driver makes it)",
        have.metadata.name.as_deref().unwrap_or(""),
        CLASS_OWNER_LABEL.0,
        CLASS_OWNER_LABEL.1
    ))
}

/// The extended resource the whole-GPU class maps (`limits:
/// {vcuda.tencent.com/gpu: N}`: N whole GPUs, no claim written).
pub const WHOLE_RESOURCE: &str = gpu_pods::dra::WHOLE_RESOURCE;

pub fn device_classes() -> Vec<DeviceClass> {
    vec![
        class(SHARE_CLASS, TYPE_GPU, None, None),
        class(
            WHOLE_CLASS,
            TYPE_GPU,
            Some(serde_json::json!({
                "apiVersion": gpu_pods::dra::CONFIG_API_VERSION,
                "kind": gpu_pods::dra::CONFIG_KIND,
                "exclusive": true,
            })),
            Some(WHOLE_RESOURCE),
        ),
        class(MIG_CLASS, TYPE_MIG, None, None),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: usize, healthy: bool) -> GpuDevice {
        GpuDevice {
            info: GpuInfo {
                index,
                uuid: format!("GPU-{index}"),
                minor: index as u32,
                memory_bytes: (15 << 30) + (100 << 20),
                numa_node: Some(0),
                pci_bus_id: format!("00000000:3{index}:00.0"),
            },
            model: "Tesla T4".into(),
            xid: (!healthy).then_some(79),
            mig: None,
            pcie_root: None,
            nvlink_domain: None,
            instance_xids: Default::default(),
            placement_xids: Default::default(),
        }
    }

    #[test]
    fn slice_shape() {
        let s = build(
            "node-a",
            &[gpu(0, true), gpu(1, false)],
            "550.54.15",
            3,
            Unhealthy::LeftOut,
        );
        assert_eq!(s.metadata.name.as_deref(), Some("node-a-vcuda.tencent.com"));
        assert_eq!(s.spec.pool.generation, 3);
        let devs = s.spec.devices.as_ref().unwrap();
        assert_eq!(devs.len(), 1, "the unhealthy GPU is left out");
        let d = &devs[0];
        assert_eq!(d.name, "gpu-0");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let a = d.attributes.as_ref().unwrap();
        assert_eq!(a["driverVersion"].version.as_deref(), Some("550.54.15"));
        assert_eq!(a["pciBusID"].string.as_deref(), Some("00000000:30:00.0"));
        assert_eq!(a["numaNode"].int, Some(0));
        assert!(!a.contains_key(topology::PCIE_ROOT) && !a.contains_key("nvlinkDomain"));
        let c = d.capacity.as_ref().unwrap();
        assert_eq!(c["cores"].value.0, "100");
        // 15 GiB + 100 MiB: whole 256 MiB units only.
        assert_eq!(c["memory"].value.0, "15Gi");
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json.pointer("/spec/devices/0/capacity/memory/requestPolicy/validRange/step"),
            Some(&serde_json::json!("256Mi"))
        );
        let healthy = |gpus: &[GpuDevice], generation| {
            build("node-a", gpus, "550.54.15", generation, Unhealthy::LeftOut).spec
        };
        assert!(same_devices(&s.spec, &healthy(&[gpu(0, true)], 9)));
        assert!(!same_devices(
            &s.spec,
            &healthy(&[gpu(0, true), gpu(1, true)], 3)
        ));
    }

    #[test]
    fn an_unhealthy_gpu_stays_with_a_taint_naming_its_xid() {
        let gpus = [gpu(0, true), gpu(1, false)];
        let effect: Unhealthy = "NoSchedule".parse().unwrap();
        let s = build("node-a", &gpus, "550.54.15", 4, effect);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json.pointer("/spec/devices/0/taints"), None);
        assert_eq!(
            json.pointer("/spec/devices/1/taints"),
            Some(&serde_json::json!([{
                "key": "vcuda.tencent.com/unhealthy", "value": "xid-79", "effect": "NoSchedule"
            }]))
        );
        // The API server's stamp is not a change; a lost taint is noticed.
        let mut stored = s.spec.clone();
        stored.devices.as_mut().unwrap()[1].taints.as_mut().unwrap()[0].time_added =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-02T15:00:00Z".parse().unwrap(),
            ));
        assert!(same_devices(&s.spec, &stored) && taints_kept(&s.spec, &stored));
        stored.devices.as_mut().unwrap()[1].taints = None;
        assert!(!same_devices(&s.spec, &stored) && !taints_kept(&s.spec, &stored));
        let evict = build(
            "node-a",
            &gpus,
            "550.54.15",
            4,
            "NoExecute".parse().unwrap(),
        );
        assert!(!same_devices(&s.spec, &evict.spec));
        let e = "Evict".parse::<Unhealthy>().unwrap_err().to_string();
        assert!(e.contains("NoSchedule") && e.contains("LeaveOut"), "{e}");
    }

    #[test]
    fn a_gpu_in_mig_mode_is_not_in_the_slice_but_its_mig_devices_are() {
        let mig = GpuDevice {
            mig: Some(Vec::new()),
            ..gpu(1, true)
        };
        let s = build(
            "node-a",
            &[gpu(0, true), mig],
            "550.54.15",
            1,
            Unhealthy::LeftOut,
        );
        let names: Vec<String> = s
            .spec
            .devices
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["gpu-0"], "in MIG mode without MIG devices");
        let s = build(
            "node-a",
            &[gpu(0, true), crate::mig::tests::h100_mig()],
            "550.54.15",
            1,
            Unhealthy::LeftOut,
        );
        let types: Vec<(String, String)> = s
            .spec
            .devices
            .unwrap()
            .into_iter()
            .map(|d| {
                (
                    d.name,
                    d.attributes.unwrap()["type"].string.clone().unwrap(),
                )
            })
            .collect();
        let want = [
            ("gpu-0", "gpu"),
            ("gpu-1-mig-2-0", "mig"),
            ("gpu-1-mig-9-0", "mig"),
        ];
        assert_eq!(types, want.map(|(n, t)| (n.to_string(), t.to_string())));
    }

    #[test]
    fn pcie_root_and_nvlink_domain_attributes() {
        let g = GpuDevice {
            pcie_root: Some("pci0000:3a".into()),
            nvlink_domain: Some("GPU-0".into()),
            instance_xids: Default::default(),
            placement_xids: Default::default(),
            ..gpu(0, true)
        };
        let s = build("node-a", &[g], "550.54.15", 1, Unhealthy::LeftOut);
        let a = s.spec.devices.unwrap()[0].attributes.clone().unwrap();
        assert_eq!(
            a["resource.kubernetes.io/pcieRoot"].string.as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(a["nvlinkDomain"].string.as_deref(), Some("GPU-0"));
    }

    #[test]
    fn versions_and_classes() {
        assert_eq!(version("550.54").version.as_deref(), Some("550.54.0"));
        assert_eq!(version("580.65.06").version.as_deref(), Some("580.65.6"));
        assert_eq!(version("r550").string.as_deref(), Some("r550"));
        let classes = device_classes();
        let selectors = |c: &DeviceClass| -> Vec<String> {
            let s = c.spec.selectors.iter().flatten();
            s.map(|s| s.cel.as_ref().unwrap().expression.clone())
                .collect()
        };
        let names: Vec<_> = classes
            .iter()
            .map(|c| c.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "vcuda-share.vcuda.tencent.com",
                "vcuda-gpu.vcuda.tencent.com",
                "vcuda-mig.vcuda.tencent.com"
            ]
        );
        let driver = "device.driver == 'vcuda.tencent.com'";
        let of_type = |t: &str| format!("device.attributes['vcuda.tencent.com'].type == '{t}'");
        assert_eq!(selectors(&classes[0]), [driver.into(), of_type("gpu")]);
        assert_eq!(selectors(&classes[1]), [driver.into(), of_type("gpu")]);
        assert_eq!(selectors(&classes[2]), [driver.into(), of_type("mig")]);
        assert!(classes[1].spec.config.is_some());
        assert!(classes[0].spec.config.is_none() && classes[2].spec.config.is_none());
        // Only the whole class maps an extended resource: a count of its
        // devices is a count of GPUs (a share's 30 would be 30 devices).
        let mapped: Vec<_> = classes
            .iter()
            .map(|c| c.spec.extended_resource_name.as_deref())
            .collect();
        assert_eq!(mapped, [None, Some("vcuda.tencent.com/gpu"), None]);
    }

    #[test]
    fn an_earlier_releases_classes_are_updated_and_foreign_ones_kept() {
        let want = &device_classes()[0];
        assert_eq!(class_action(want, want), ClassAction::Keep);
        // The pre-MIG shape: the driver selector alone, no label.
        let mut earlier = want.clone();
        earlier.metadata.labels = None;
        earlier.metadata.resource_version = Some("41".into());
        earlier.spec.selectors.as_mut().unwrap().truncate(1);
        let ClassAction::Update(new) = class_action(&earlier, want) else {
            panic!("the earlier class is updated");
        };
        assert_eq!(new.spec, want.spec);
        assert_eq!(new.metadata.resource_version.as_deref(), Some("41"));
        assert_eq!(new.metadata.labels, want.metadata.labels);
        // Labelled ours with other selectors: updated too.
        let mut ours = want.clone();
        ours.spec.selectors.as_mut().unwrap()[1] = DeviceSelector {
            cel: Some(CELDeviceSelector {
                expression: "true".into(),
            }),
        };
        assert!(matches!(class_action(&ours, want), ClassAction::Update(_)));
        // An operator's own class of that name: kept, and said why.
        ours.metadata.labels = None;
        let ClassAction::Foreign(why) = class_action(&ours, want) else {
            panic!("a foreign class is kept");
        };
        assert!(
            why.contains("vcuda-share.vcuda.tencent.com exists, not labelled"),
            "{why}"
        );
    }
}
