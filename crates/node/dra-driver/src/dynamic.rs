//! Dynamic MIG in the slice (issue 36, pure): a GPU named in
//! `--mig-dynamic` is partitioned on demand, so every placement of every
//! GPU-instance profile it offers is a device (KEP-4815, partitionable
//! devices), `gpu-<index>-mig-<profile, . as ->-<start>`, which the
//! driver creates at prepare and destroys at unprepare.
//!
//! Overlapping placements must never be allocated together, and the
//! scheduler knows nothing of MIG: the GPU's memory slices are a counter
//! set `gpu-<index>-mig` of one counter per slice (`memory-slice-<n>`,
//! value 1), and each placement consumes the counters of the slices it
//! covers, so two placements sharing a slice exceed its counter. (Compute
//! slices need no counters of their own: on every MIG GPU a placement's
//! compute slices follow from its memory slices.)
//!
//! The API wants counters and devices in different slices of the pool
//! ("Only one of Devices and SharedCounters can be set in a
//! ResourceSlice"), at most 64 devices in a slice whose devices consume
//! counters and 32 counters in a slice: a pool with a dynamic GPU is
//! several slices ([`pool`]).

use std::collections::BTreeMap;

use gpu_allocator::GpuInfo;
use gpu_allocator::mig::Slices;
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceCapacity, DeviceCounterConsumption, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use node_agent::geometry::GiProfile;
use node_agent::mig::MigDevice;
use serde::{Deserialize, Serialize};

use crate::mig::{TYPE, TYPE_MIG};
use crate::plan::Inventory;
use crate::slices::{GpuDevice, int, string, version};
use crate::{CAPACITY_MEMORY, quantity, topology};

/// A placement device as the checkpoint keeps it: what prepare creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The driver's GPU-instance profile id.
    pub profile: u32,
    pub start: u32,
    pub size: u32,
}

/// The placement published as `name` on a dynamic GPU of `inv`: its
/// parent and the MIG device it will be (memory where known; no UUID
/// before it exists).
pub(crate) fn find<'a>(
    inv: &'a Inventory,
    name: &str,
) -> Option<(&'a GpuInfo, MigDevice, Placement)> {
    inv.dynamic.iter().find_map(|(&index, d)| {
        let parent = inv.gpus.iter().find(|g| g.index == index)?;
        d.profiles.iter().find_map(|p| {
            let s = p
                .placements
                .iter()
                .find(|s| placement_name(index, &p.name, s.start) == name)?;
            let m = MigDevice {
                uuid: String::new(),
                profile: p.name.clone(),
                gpu_instance: 0,
                compute_instance: 0,
                memory_bytes: d.memory_bytes.get(&p.id).copied().unwrap_or(0),
                multiprocessors: d.multiprocessors.get(&p.id).copied().unwrap_or(0),
            };
            let at = Placement {
                profile: p.id,
                start: s.start,
                size: s.size,
            };
            Some((parent, m, at))
        })
    })
}

/// Devices in a slice whose devices consume counters (API validation).
pub const MAX_DEVICES_WITH_COUNTERS: usize = 64;
/// Counters in all the counter sets of one slice (API validation).
pub const MAX_COUNTERS_PER_SLICE: usize = 32;

/// What the slice needs of a dynamic GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamicGpu {
    /// The GPU-instance profiles it offers, with their placements.
    pub profiles: Vec<GiProfile>,
    /// Memory per profile id, where known (the device's capacity).
    pub memory_bytes: BTreeMap<u32, u64>,
    /// Multiprocessors per profile id, where known.
    pub multiprocessors: BTreeMap<u32, u32>,
    /// Instances no prepared claim made (an operator's, a geometry's):
    /// the scheduler cannot see them, so no placement overlapping one is
    /// published. Instances of prepared claims are their allocated
    /// placement devices, whose counters the scheduler already counts.
    pub foreign: Vec<Slices>,
}

pub fn counter_set_name(index: usize) -> String {
    format!("gpu-{index}-mig")
}

pub fn counter_name(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// The device of `profile` (`3g.40gb`) at memory slice `start` on GPU
/// `index`: a DNS label (`.` is not allowed in one).
pub fn placement_name(index: usize, profile: &str, start: u32) -> String {
    let p = profile.replace(['.', '+'], "-");
    format!("gpu-{index}-mig-{p}-{start}")
}

/// The GPU's memory slices: the end of its widest placement.
fn memory_slices(d: &DynamicGpu) -> u32 {
    let ends = d.profiles.iter().flat_map(|p| &p.placements);
    ends.map(|s| s.start + s.size).max().unwrap_or(0)
}

/// GPU `index`'s counter set: one counter of 1 per memory slice.
pub fn counter_set(index: usize, d: &DynamicGpu) -> CounterSet {
    let one = || Counter {
        value: Quantity("1".into()),
    };
    CounterSet {
        name: counter_set_name(index),
        counters: (0..memory_slices(d))
            .map(|s| (counter_name(s), one()))
            .collect(),
    }
}

fn overlaps(a: Slices, b: Slices) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

/// Every placement of every profile on `g` not overlapping a foreign
/// instance, each consuming its memory slices' counters.
pub(crate) fn devices(g: &GpuDevice, d: &DynamicGpu, driver_version: &str) -> Vec<Device> {
    let mut out = Vec::new();
    for p in &d.profiles {
        for &s in &p.placements {
            if d.foreign.iter().any(|&f| overlaps(f, s)) {
                continue;
            }
            out.push(device(g, d, p, s, driver_version));
        }
    }
    out
}

fn device(g: &GpuDevice, d: &DynamicGpu, p: &GiProfile, s: Slices, dv: &str) -> Device {
    let i = &g.info;
    let mut attributes = BTreeMap::from([
        (TYPE.to_string(), string(TYPE_MIG)),
        ("profile".to_string(), string(&p.name)),
        ("parentUUID".to_string(), string(&i.uuid)),
        ("parentIndex".to_string(), int(i.index as i64)),
        ("placementStart".to_string(), int(s.start.into())),
        ("placementSize".to_string(), int(s.size.into())),
        ("model".to_string(), string(&g.model)),
        ("driverVersion".to_string(), version(dv)),
    ]);
    if let Some(&n) = d.multiprocessors.get(&p.id) {
        attributes.insert("multiprocessors".to_string(), int(n.into()));
    }
    if let Some(n) = i.numa_node {
        attributes.insert("numaNode".to_string(), int(n as i64));
    }
    if let Some(r) = &g.pcie_root {
        attributes.insert(topology::PCIE_ROOT.to_string(), string(r));
    }
    let capacity = d.memory_bytes.get(&p.id).map(|&m| {
        BTreeMap::from([(
            CAPACITY_MEMORY.to_string(),
            DeviceCapacity {
                value: Quantity(quantity::bytes(m)),
                request_policy: None,
            },
        )])
    });
    let one = || Counter {
        value: Quantity("1".into()),
    };
    let consumes = DeviceCounterConsumption {
        counter_set: counter_set_name(i.index),
        counters: (s.start..s.start + s.size)
            .map(|n| (counter_name(n), one()))
            .collect(),
    };
    // No multiple allocations: one claim takes the instance whole.
    Device {
        name: placement_name(i.index, &p.name, s.start),
        attributes: Some(attributes),
        capacity,
        consumes_counters: Some(vec![consumes]),
        ..Default::default()
    }
}

/// The pool as slices: without counter sets the one slice `one` as it
/// is; with them, slices of at most [`MAX_COUNTERS_PER_SLICE`] counters
/// (`<slice>-counters`, `-counters-1`, …) and slices of at most
/// [`MAX_DEVICES_WITH_COUNTERS`] devices (`<slice>`, `<slice>-1`, …), every
/// one carrying the pool's slice count.
pub fn pool(one: ResourceSlice, sets: Vec<CounterSet>) -> Vec<ResourceSlice> {
    if sets.is_empty() {
        return vec![one];
    }
    let name = one.metadata.name.clone().unwrap_or_default();
    let named = |base: &str, n: usize| match n {
        0 => base.to_string(),
        n => format!("{base}-{n}"),
    };
    let mut out = Vec::new();
    for (n, chunk) in chunk_counters(sets).into_iter().enumerate() {
        let mut s = one.clone();
        s.metadata.name = Some(named(&format!("{name}-counters"), n));
        s.spec.devices = None;
        s.spec.shared_counters = Some(chunk);
        out.push(s);
    }
    let devices = one.spec.devices.clone().unwrap_or_default();
    let mut chunks: Vec<Vec<Device>> = devices
        .chunks(MAX_DEVICES_WITH_COUNTERS)
        .map(<[Device]>::to_vec)
        .collect();
    if chunks.is_empty() {
        chunks.push(Vec::new());
    }
    for (n, chunk) in chunks.into_iter().enumerate() {
        let mut s = one.clone();
        s.metadata.name = Some(named(&name, n));
        s.spec.devices = Some(chunk);
        out.push(s);
    }
    let count = out.len() as i64;
    for s in &mut out {
        s.spec.pool.resource_slice_count = count;
    }
    out
}

/// Counter sets packed into slices of at most [`MAX_COUNTERS_PER_SLICE`]
/// counters (a set is never split: devices name it whole).
fn chunk_counters(sets: Vec<CounterSet>) -> Vec<Vec<CounterSet>> {
    let mut out: Vec<Vec<CounterSet>> = vec![Vec::new()];
    let mut used = 0;
    for s in sets {
        let n = s.counters.len();
        if used + n > MAX_COUNTERS_PER_SLICE && used > 0 {
            out.push(Vec::new());
            used = 0;
        }
        used += n;
        out.last_mut().expect("never empty").push(s);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::slices::{self, Unhealthy};

    /// The H100 80GB's profiles (NVIDIA's MIG user guide, `nvidia-smi
    /// mig -lgipp`): ids and placements as the driver lists them.
    pub(crate) fn h100() -> DynamicGpu {
        let p = |id, name: &str, size, starts: &[u32]| GiProfile {
            id,
            name: name.into(),
            placements: starts.iter().map(|&start| Slices { start, size }).collect(),
        };
        DynamicGpu {
            profiles: vec![
                p(19, "1g.10gb", 1, &[0, 1, 2, 3, 4, 5, 6]),
                p(15, "1g.20gb", 2, &[0, 2, 4, 6]),
                p(14, "2g.20gb", 2, &[0, 2, 4]),
                p(9, "3g.40gb", 4, &[0, 4]),
                p(5, "4g.40gb", 4, &[0]),
                p(0, "7g.80gb", 8, &[0]),
            ],
            memory_bytes: BTreeMap::from([(9, 40448 << 20), (0, 80896 << 20)]),
            multiprocessors: BTreeMap::from([(9, 60), (0, 132)]),
            foreign: Vec::new(),
        }
    }

    fn gpu(index: usize) -> GpuDevice {
        GpuDevice {
            mig: Some(Vec::new()),
            ..crate::mig::tests::h100_mig()
        }
        .with_index(index)
    }

    impl GpuDevice {
        fn with_index(mut self, index: usize) -> GpuDevice {
            self.info.index = index;
            self.info.uuid = format!("GPU-{index}");
            self
        }
    }

    fn counters(d: &Device) -> Vec<String> {
        let c = &d.consumes_counters.as_ref().unwrap()[0];
        c.counters.keys().cloned().collect()
    }

    #[test]
    fn names_and_the_counter_set_of_a_dynamic_gpu() {
        assert_eq!(placement_name(0, "3g.40gb", 4), "gpu-0-mig-3g-40gb-4");
        assert_eq!(placement_name(2, "1g.10gb+me", 6), "gpu-2-mig-1g-10gb-me-6");
        let set = counter_set(1, &h100());
        assert_eq!(set.name, "gpu-1-mig");
        let names: Vec<&String> = set.counters.keys().collect();
        assert_eq!(names.len(), 8);
        assert_eq!(
            (names[0].as_str(), names[7].as_str()),
            ("memory-slice-0", "memory-slice-7")
        );
        assert!(set.counters.values().all(|c| c.value.0 == "1"));
    }

    #[test]
    fn every_placement_is_a_device_consuming_its_memory_slices() {
        let devs = devices(&gpu(0), &h100(), "580.95.05");
        assert_eq!(devs.len(), 7 + 4 + 3 + 2 + 1 + 1);
        let d = devs
            .iter()
            .find(|d| d.name == "gpu-0-mig-3g-40gb-4")
            .unwrap();
        assert_eq!(
            counters(d),
            [
                "memory-slice-4",
                "memory-slice-5",
                "memory-slice-6",
                "memory-slice-7"
            ]
        );
        assert_eq!(
            d.consumes_counters.as_ref().unwrap()[0].counter_set,
            "gpu-0-mig"
        );
        assert_eq!(d.allow_multiple_allocations, None, "one claim's");
        let a = d.attributes.as_ref().unwrap();
        assert_eq!(a["type"].string.as_deref(), Some("mig"));
        assert_eq!(a["profile"].string.as_deref(), Some("3g.40gb"));
        assert_eq!(a["parentUUID"].string.as_deref(), Some("GPU-0"));
        assert_eq!(
            (a["parentIndex"].int, a["placementStart"].int),
            (Some(0), Some(4))
        );
        assert_eq!(a["multiprocessors"].int, Some(60));
        assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "40448Mi");
        let small = devs
            .iter()
            .find(|d| d.name == "gpu-0-mig-1g-10gb-6")
            .unwrap();
        assert!(
            small.capacity.is_none()
                && !small
                    .attributes
                    .as_ref()
                    .unwrap()
                    .contains_key("multiprocessors")
        );
        let all = devs
            .iter()
            .find(|d| d.name == "gpu-0-mig-7g-80gb-0")
            .unwrap();
        assert_eq!(counters(all).len(), 8, "overlaps every other placement");
    }

    #[test]
    fn placements_overlapping_a_foreign_instance_are_left_out() {
        let d = DynamicGpu {
            foreign: vec![Slices { start: 2, size: 2 }],
            ..h100()
        };
        let names: Vec<String> = devices(&gpu(0), &d, "580.95.05")
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert!(names.contains(&"gpu-0-mig-3g-40gb-4".to_string()));
        assert!(names.contains(&"gpu-0-mig-1g-10gb-1".to_string()));
        for gone in [
            "gpu-0-mig-3g-40gb-0",
            "gpu-0-mig-1g-10gb-2",
            "gpu-0-mig-2g-20gb-2",
            "gpu-0-mig-7g-80gb-0",
        ] {
            assert!(!names.contains(&gone.to_string()), "{gone}");
        }
    }

    /// GPU 0 dynamic, as an H100.
    pub(crate) fn inventory() -> Inventory {
        Inventory {
            gpus: vec![gpu(0).info],
            mig: vec![Some(Vec::new())],
            dynamic: BTreeMap::from([(0, h100())]),
            ..Default::default()
        }
    }

    pub(crate) fn claim_for(
        uid: &str,
        device: &str,
    ) -> k8s_openapi::api::resource::v1::ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [{"request": "mig",
                "driver": crate::DRIVER_NAME, "pool": "n1", "device": device}]}}}
        }))
        .unwrap()
    }

    #[test]
    fn a_placement_device_is_planned_as_the_instance_to_create() {
        let inv = inventory();
        let p =
            crate::plan::plan(&claim_for("u1", "gpu-0-mig-3g-40gb-4"), "u1", "n1", &inv).unwrap();
        assert_eq!(p.len(), 1);
        let (d, m) = (&p[0], p[0].mig.as_ref().unwrap());
        assert_eq!(
            (d.gpu_index, d.whole, d.memory_bytes),
            (0, true, 40448 << 20)
        );
        assert_eq!(
            m.placement,
            Some(Placement {
                profile: 9,
                start: 4,
                size: 4
            })
        );
        assert!(m.uuid.is_empty(), "made at prepare");
        let e = crate::plan::plan(&claim_for("u2", "gpu-0-mig-3g-40gb-2"), "u2", "n1", &inv)
            .unwrap_err();
        assert!(
            e.to_string().contains("no device \"gpu-0-mig-3g-40gb-2\""),
            "{e}"
        );
    }

    #[test]
    fn without_counters_the_pool_is_the_one_slice() {
        let one = slices::build("n", &[gpu(0)], "580.95.05", 3, Unhealthy::LeftOut);
        assert_eq!(pool(one.clone(), Vec::new()), vec![one]);
    }

    #[test]
    fn with_counters_the_pool_is_counter_slices_and_device_slices_of_at_most_64() {
        let mut one = slices::build("n", &[], "580.95.05", 3, Unhealthy::LeftOut);
        let g = gpu(0);
        let devs: Vec<Device> = (0..5)
            .flat_map(|_| devices(&g, &h100(), "580.95.05"))
            .collect();
        assert_eq!(devs.len(), 90);
        one.spec.devices = Some(devs);
        // Five GPUs' sets: 40 counters, over the 32 a slice holds.
        let sets: Vec<CounterSet> = (0..5).map(|i| counter_set(i, &h100())).collect();
        let p = pool(one, sets);
        let names: Vec<&str> = p
            .iter()
            .map(|s| s.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "n-vcuda.tencent.com-counters",
                "n-vcuda.tencent.com-counters-1",
                "n-vcuda.tencent.com",
                "n-vcuda.tencent.com-1"
            ]
        );
        let sizes: Vec<(usize, usize)> = p
            .iter()
            .map(|s| {
                let c = s.spec.shared_counters.iter().flatten();
                (
                    c.map(|c| c.counters.len()).sum(),
                    s.spec.devices.as_ref().map_or(0, Vec::len),
                )
            })
            .collect();
        assert_eq!(sizes, [(32, 0), (8, 0), (0, 64), (0, 26)]);
        for s in &p {
            assert_eq!(
                (s.spec.pool.resource_slice_count, s.spec.pool.generation),
                (4, 3)
            );
            assert!(
                s.spec.devices.is_none() || s.spec.shared_counters.is_none(),
                "one of the two"
            );
        }
    }
}
