//! A ResourceClaim's allocation -> what to prepare on this node (pure).
//! Each allocation result of this driver in this node's pool becomes one
//! [`PlannedDevice`]: the GPU, the consumed cores and memory (defaults:
//! the whole GPU), the soft limit from opaque parameters. Anything wrong
//! is an error naming the claim and the field. A MIG device is planned
//! whole (no share, no interposer, no vm directory) and alone in its claim.

use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES};
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim,
};
use node_agent::mig::MigDevice;
use serde::{Deserialize, Serialize};

use crate::params::{GpuConfig, ParamsError};
use crate::{CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME, mig, quantity, slices};
use qos_page::Tier;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedDevice {
    /// The request the device was allocated for ("gpu" or "gpu/sub").
    pub request: String,
    pub pool: String,
    pub device: String,
    pub gpu_index: usize,
    pub gpu_uuid: String,
    pub cores: u32,
    pub memory_bytes: u64,
    /// A soft compute limit (`coreLimit`), above `cores`.
    pub soft_limit: Option<u32>,
    /// The share's compute tier (`tier`); absent when plain.
    #[serde(default, skip_serializing_if = "Tier::is_plain")]
    pub tier: Tier,
    /// Memory it may borrow up to, above `memory_bytes` (`memoryLimit`);
    /// absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<u64>,
    /// The whole GPU with the untouched driver (no interposer).
    pub whole: bool,
    pub share_id: Option<String>,
    /// A MIG device of the GPU (`gpu_index`, `gpu_uuid`: its parent);
    /// absent in checkpoints from before MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<PlannedMig>,
}

/// The MIG device a [`PlannedDevice`] is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedMig {
    /// `MIG-…`.
    pub uuid: String,
    #[serde(default)]
    pub gpu_instance: u32,
    #[serde(default)]
    pub compute_instance: u32,
    /// A dynamic GPU's placement: the instance is created at prepare
    /// (then `uuid` and the ids are its) and destroyed at unprepare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<crate::dynamic::Placement>,
}

/// What this node offers claims: its GPUs (by index) and, for each GPU in
/// MIG mode, its MIG devices (the GPU itself is then no device).
#[derive(Debug, Clone, Default)]
pub struct Inventory {
    pub gpus: Vec<GpuInfo>,
    /// Per GPU index; `None` (or missing): not in MIG mode.
    pub mig: Vec<Option<Vec<MigDevice>>>,
    /// The dynamic MIG GPUs by index: their placements are devices.
    pub dynamic: std::collections::BTreeMap<usize, crate::dynamic::DynamicGpu>,
    /// The host's `/` as mounted here: where the driver's MIG capability
    /// files are read at prepare (`proc/driver/nvidia/capabilities`).
    pub host_root: std::path::PathBuf,
}

impl From<Vec<GpuInfo>> for Inventory {
    /// GPUs without MIG.
    fn from(gpus: Vec<GpuInfo>) -> Inventory {
        Inventory {
            gpus,
            ..Inventory::default()
        }
    }
}

impl Inventory {
    fn migs(&self, gpu: usize) -> Option<&[MigDevice]> {
        self.mig.get(gpu).and_then(|m| m.as_deref())
    }

    /// The GPU published as `name` (not one in MIG mode).
    fn gpu(&self, name: &str) -> Option<&GpuInfo> {
        self.gpus
            .iter()
            .find(|g| slices::device_name(g.index) == name && self.migs(g.index).is_none())
    }

    /// The MIG device published as `name`, with its parent.
    fn mig_device(&self, name: &str) -> Option<(&GpuInfo, &MigDevice)> {
        self.gpus.iter().find_map(|g| {
            let m = self
                .migs(g.index)?
                .iter()
                .find(|m| mig::device_name(g.index, m.gpu_instance, m.compute_instance) == name)?;
            Some((g, m))
        })
    }

    /// The MIG device `uuid` on GPU `gpu`, as discovered.
    pub fn mig_by_uuid(&self, gpu: usize, uuid: &str) -> Option<&MigDevice> {
        self.migs(gpu)?.iter().find(|m| m.uuid == uuid)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("claim {claim}: {problem}")]
pub struct PlanError {
    pub claim: String,
    pub problem: Refusal,
}

/// Why a claim cannot be prepared as allocated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error(
        "the API server has UID {server:?}, the kubelet asked for {kubelet:?} (deleted and re-created?)"
    )]
    UidChanged { server: String, kubelet: String },
    #[error("is not allocated (no status.allocation.devices)")]
    NotAllocated,
    #[error("request {request:?} was allocated from pool {pool:?}, not this node's {node:?}")]
    OtherPool {
        request: String,
        pool: String,
        node: String,
    },
    #[error("request {request:?}: no device {device:?} on this node")]
    NoDevice { request: String, device: String },
    #[error("request {request:?}: consumedCapacity.{name}: {source}")]
    BadCapacity {
        request: String,
        name: String,
        source: quantity::BadQuantity,
    },
    #[error("request {request:?}: cores {cores} is not within 1..=100")]
    Cores { request: String, cores: u64 },
    #[error(
        "request {request:?}: memory {memory} is not a multiple of 256 MiB within the GPU's {full_memory}"
    )]
    Memory {
        request: String,
        memory: u64,
        full_memory: u64,
    },
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error(
        "request {request:?} is for a whole GPU (exclusive) but consumed {cores} cores / {memory} bytes"
    )]
    NotWhole {
        request: String,
        cores: u64,
        memory: u64,
    },
    #[error("request {request:?}: coreLimit {limit} applies to shares, not whole GPUs")]
    SoftLimitOnWhole { request: String, limit: u32 },
    #[error("request {request:?}: coreLimit {limit} is below the {cores} cores consumed")]
    SoftLimitBelowCores {
        request: String,
        limit: u32,
        cores: u64,
    },
    #[error("has no devices of {} allocated", DRIVER_NAME)]
    NoDevices,
    #[error("request {request:?}: memoryLimit {limit} applies to one-GPU shares, not to {on}")]
    MemoryLimitNotHere {
        request: String,
        limit: u64,
        on: &'static str,
    },
    #[error(
        "request {request:?}: memoryLimit {limit} is below the {memory} bytes of memory consumed"
    )]
    MemoryLimitBelow {
        request: String,
        limit: u64,
        memory: u64,
    },
    #[error(
        "{device} is allocated twice (requests {first:?} and {second:?}); ask for more capacity in one request"
    )]
    AllocatedTwice {
        device: String,
        first: String,
        second: String,
    },
    #[error(
        "request {share:?} is a share of {share_device} but the claim also holds {whole_device} whole (request {whole:?}): a share must be the claim's only device, or every device of the claim a share of its own GPU"
    )]
    ShareBesideWhole {
        share: String,
        share_device: String,
        whole_device: String,
        whole: String,
    },
    #[error(
        "request {request:?}: {device} is a MIG device made for one claim, taken whole with the untouched driver: {what} does not apply to it"
    )]
    NotForMig {
        request: String,
        device: String,
        what: NotForMig,
    },
    #[error(
        "request {request:?} holds MIG device {device}, which must be the claim's only device (CUDA enumerates one MIG device per process, and no GPU beside it), but the claim also holds {other}"
    )]
    MigNotAlone {
        request: String,
        device: String,
        other: String,
    },
}

/// What a claim asked of a MIG device that only shares have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotForMig {
    #[error("consumedCapacity.cores {0}")]
    Cores(String),
    #[error("consumedCapacity.memory {asked} (the instance has {instance} bytes)")]
    Memory { asked: String, instance: u64 },
    #[error("coreLimit {0}")]
    CoreLimit(u32),
}

/// Plans `claim` (which the kubelet named with `uid`) on `node`.
pub fn plan(
    claim: &ResourceClaim,
    uid: &str,
    node: &str,
    inventory: &Inventory,
) -> Result<Vec<PlannedDevice>, PlanError> {
    let err = |problem: Refusal| PlanError {
        claim: format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or(""),
            claim.metadata.name.as_deref().unwrap_or("")
        ),
        problem,
    };
    if claim.metadata.uid.as_deref() != Some(uid) {
        return Err(err(Refusal::UidChanged {
            server: claim.metadata.uid.clone().unwrap_or_default(),
            kubelet: uid.to_string(),
        }));
    }
    let alloc = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| err(Refusal::NotAllocated))?;
    let configs = alloc.config.as_deref().unwrap_or_default();
    let out = alloc
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == DRIVER_NAME)
        .map(|r| plan_device(r, configs, node, inventory))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    check_together(&out).map_err(err)?;
    Ok(out)
}

/// One allocation result of this driver: its GPU, the capacity it
/// consumed and the configs that apply to its request.
fn plan_device(
    r: &DeviceRequestAllocationResult,
    configs: &[DeviceAllocationConfiguration],
    node: &str,
    inventory: &Inventory,
) -> Result<PlannedDevice, Refusal> {
    let request = &r.request;
    if r.pool != node {
        return Err(Refusal::OtherPool {
            request: request.clone(),
            pool: r.pool.clone(),
            node: node.to_string(),
        });
    }
    if let Some((parent, m)) = inventory.mig_device(&r.device) {
        return plan_mig_share(r, configs, parent, m);
    }
    if let Some((parent, m, at)) = crate::dynamic::find(inventory, &r.device) {
        let mut d = plan_mig(r, configs, parent, &m)?;
        d.mig
            .as_mut()
            .expect("plan_mig plans a MIG device")
            .placement = Some(at);
        return Ok(d);
    }
    let gpu = inventory.gpu(&r.device).ok_or_else(|| Refusal::NoDevice {
        request: request.clone(),
        device: r.device.clone(),
    })?;
    let full_memory = gpu.memory_units() * MEMORY_UNIT_BYTES;
    let (cores, memory) = consumed_capacity(r, full_memory)?;
    let config = request_config(configs, request)?;
    let whole = cores == 100 && memory == full_memory;
    if config.exclusive == Some(true) && !whole {
        return Err(Refusal::NotWhole {
            request: request.clone(),
            cores,
            memory,
        });
    }
    Ok(PlannedDevice {
        request: request.clone(),
        pool: r.pool.clone(),
        device: r.device.clone(),
        gpu_index: gpu.index,
        gpu_uuid: gpu.uuid.clone(),
        cores: cores as u32,
        memory_bytes: memory,
        soft_limit: soft_limit(config.core_limit, whole, cores, request)?,
        tier: if whole { Tier::Plain } else { config.tier() },
        memory_limit: memory_limit(&config, whole, memory, request)?,
        whole,
        share_id: r.share_id.clone(),
        mig: None,
    })
}

/// A static MIG device: whole with no capacity asked (or all of it), else
/// a vcuda share of the instance, as on a GPU.
fn plan_mig_share(
    r: &DeviceRequestAllocationResult,
    configs: &[DeviceAllocationConfiguration],
    parent: &GpuInfo,
    m: &MigDevice,
) -> Result<PlannedDevice, Refusal> {
    let full_memory = mig::share_memory(m);
    let (cores, memory) = consumed_capacity(r, full_memory)?;
    if cores == 100 && memory == full_memory {
        return plan_mig(r, configs, parent, m);
    }
    let config = request_config(configs, &r.request)?;
    if config.exclusive == Some(true) {
        return Err(Refusal::NotWhole {
            request: r.request.clone(),
            cores,
            memory,
        });
    }
    Ok(PlannedDevice {
        cores: cores as u32,
        memory_bytes: memory,
        soft_limit: soft_limit(config.core_limit, false, cores, &r.request)?,
        tier: config.tier(),
        memory_limit: match config.memory_limit()? {
            Some(limit) => {
                return Err(Refusal::MemoryLimitNotHere {
                    request: r.request.clone(),
                    limit,
                    on: "a share inside a MIG device",
                });
            }
            None => None,
        },
        whole: false,
        ..whole_mig(r, parent, m)
    })
}

/// A MIG device taken whole: no cores, all of its memory or none said,
/// and no soft limit.
fn plan_mig(
    r: &DeviceRequestAllocationResult,
    configs: &[DeviceAllocationConfiguration],
    parent: &GpuInfo,
    m: &MigDevice,
) -> Result<PlannedDevice, Refusal> {
    let refuse = |what| Refusal::NotForMig {
        request: r.request.clone(),
        device: r.device.clone(),
        what,
    };
    let consumed = r.consumed_capacity.as_ref();
    if let Some(q) = consumed.and_then(|c| c.get(CAPACITY_CORES))
        && q.0 != "100"
    {
        return Err(refuse(NotForMig::Cores(q.0.clone())));
    }
    // All of it: the instance's bytes, or its whole 256 MiB units (what
    // a static device's capacity says).
    let all = [m.memory_bytes, mig::share_memory(m)];
    if let Some(q) = consumed.and_then(|c| c.get(CAPACITY_MEMORY))
        && !quantity::parse(&q.0).is_ok_and(|b| all.contains(&b))
    {
        return Err(refuse(NotForMig::Memory {
            asked: q.0.clone(),
            instance: m.memory_bytes,
        }));
    }
    if let Some(limit) = request_config(configs, &r.request)?.core_limit {
        return Err(refuse(NotForMig::CoreLimit(limit)));
    }
    Ok(whole_mig(r, parent, m))
}

fn whole_mig(r: &DeviceRequestAllocationResult, parent: &GpuInfo, m: &MigDevice) -> PlannedDevice {
    PlannedDevice {
        request: r.request.clone(),
        pool: r.pool.clone(),
        device: r.device.clone(),
        gpu_index: parent.index,
        gpu_uuid: parent.uuid.clone(),
        cores: 100,
        memory_bytes: m.memory_bytes,
        soft_limit: None,
        tier: Tier::Plain,
        memory_limit: None,
        whole: true,
        share_id: r.share_id.clone(),
        mig: Some(PlannedMig {
            uuid: m.uuid.clone(),
            gpu_instance: m.gpu_instance,
            compute_instance: m.compute_instance,
            placement: None,
        }),
    }
}

/// Cores (1..=100) and memory (whole 256 MiB units of the GPU's) the
/// result consumed; without `consumedCapacity`, the whole GPU.
fn consumed_capacity(
    r: &DeviceRequestAllocationResult,
    full_memory: u64,
) -> Result<(u64, u64), Refusal> {
    let consumed = |name: &str| -> Result<Option<u64>, Refusal> {
        match r.consumed_capacity.as_ref().and_then(|c| c.get(name)) {
            None => Ok(None),
            Some(q) => quantity::parse(&q.0)
                .map(Some)
                .map_err(|source| Refusal::BadCapacity {
                    request: r.request.clone(),
                    name: name.to_string(),
                    source,
                }),
        }
    };
    let cores = consumed(CAPACITY_CORES)?.unwrap_or(100);
    let memory = consumed(CAPACITY_MEMORY)?.unwrap_or(full_memory);
    if cores == 0 || cores > 100 {
        return Err(Refusal::Cores {
            request: r.request.clone(),
            cores,
        });
    }
    if memory == 0 || memory > full_memory || !memory.is_multiple_of(MEMORY_UNIT_BYTES) {
        return Err(Refusal::Memory {
            request: r.request.clone(),
            memory,
            full_memory,
        });
    }
    Ok((cores, memory))
}

/// This driver's opaque configs that name `request` (or its parent
/// request, or none), merged. Class configs come first, then the
/// claim's: later ones win.
fn request_config(
    configs: &[DeviceAllocationConfiguration],
    request: &str,
) -> Result<GpuConfig, ParamsError> {
    let mut config = GpuConfig::default();
    for c in configs {
        let Some(o) = c.opaque.as_ref().filter(|o| o.driver == DRIVER_NAME) else {
            continue;
        };
        let applies = c.requests.as_ref().is_none_or(|rs| {
            rs.is_empty()
                || rs
                    .iter()
                    .any(|x| *x == request || request.starts_with(&format!("{x}/")))
        });
        if applies {
            let parsed = GpuConfig::parse(&o.parameters.0)?;
            config = config.merge(parsed);
        }
    }
    Ok(config)
}

/// The soft limit `coreLimit` asks for: only on a share, not below its
/// cores; equal to them it is no soft limit at all.
fn soft_limit(
    core_limit: Option<u32>,
    whole: bool,
    cores: u64,
    request: &str,
) -> Result<Option<u32>, Refusal> {
    match core_limit {
        Some(limit) if whole => Err(Refusal::SoftLimitOnWhole {
            request: request.to_string(),
            limit,
        }),
        Some(limit) if u64::from(limit) < cores => Err(Refusal::SoftLimitBelowCores {
            request: request.to_string(),
            limit,
            cores,
        }),
        Some(l) if u64::from(l) == cores => Ok(None),
        l => Ok(l),
    }
}

/// A share's memory limit (`memoryLimit`): above what it consumed; none
/// for whole GPUs. Equal to it: no limit.
fn memory_limit(
    config: &crate::params::GpuConfig,
    whole: bool,
    memory: u64,
    request: &str,
) -> Result<Option<u64>, Refusal> {
    use gpu_pods::LimitProblem;
    let Some(limit) = config.memory_limit()? else {
        return Ok(None);
    };
    // One device: a claim's several are refused together (check_together).
    gpu_pods::check_memory_limit(limit, whole, 1, memory).map_err(|p| match p {
        LimitProblem::Below => Refusal::MemoryLimitBelow {
            request: request.to_string(),
            limit,
            memory,
        },
        LimitProblem::Whole | LimitProblem::Spans(_) => Refusal::MemoryLimitNotHere {
            request: request.to_string(),
            limit,
            on: "a whole GPU",
        },
    })
}

/// What the claim's devices must be together: at least one, each once,
/// and shares only beside shares (a memory limit only on a claim's only
/// share).
fn check_together(out: &[PlannedDevice]) -> Result<(), Refusal> {
    if out.is_empty() {
        return Err(Refusal::NoDevices);
    }
    if out.len() > 1
        && let Some(d) = out.iter().find(|d| d.memory_limit.is_some())
    {
        return Err(Refusal::MemoryLimitNotHere {
            request: d.request.clone(),
            limit: d.memory_limit.unwrap_or_default(),
            on: "a share on several GPUs",
        });
    }
    for (i, d) in out.iter().enumerate() {
        if let Some(e) = out[..i].iter().find(|e| e.device == d.device) {
            return Err(Refusal::AllocatedTwice {
                device: d.device.clone(),
                first: e.request.clone(),
                second: d.request.clone(),
            });
        }
    }
    if let Some(m) = out.iter().find(|d| d.mig.is_some())
        && let Some(o) = out.iter().find(|d| d.device != m.device)
    {
        return Err(Refusal::MigNotAlone {
            request: m.request.clone(),
            device: m.device.clone(),
            other: o.device.clone(),
        });
    }
    // All shares (one container's quotas on N GPUs, docs/multi-gpu.md) or
    // all whole GPUs: a share beside a whole GPU would need the interposer
    // and the untouched driver in one container.
    if let Some(s) = out.iter().find(|d| !d.whole)
        && let Some(w) = out.iter().find(|d| d.whole)
    {
        return Err(Refusal::ShareBesideWhole {
            share: s.request.clone(),
            share_device: s.device.clone(),
            whole_device: w.device.clone(),
            whole: w.request.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpus() -> Inventory {
        Inventory::from(vec![GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            minor: 0,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        }])
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c1", "namespace": "ns", "uid": "u1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    fn result(cap: serde_json::Value) -> serde_json::Value {
        json!([{"request": "gpu", "driver": DRIVER_NAME, "pool": "n1", "device": "gpu-0",
                "shareID": "s1", "consumedCapacity": cap}])
    }

    #[test]
    fn share_whole_and_soft() {
        let c = claim(result(json!({"cores": "30", "memory": "1Gi"})), json!([]));
        let p = plan(&c, "u1", "n1", &gpus()).unwrap();
        assert_eq!(
            (p[0].cores, p[0].memory_bytes, p[0].whole),
            (30, 1 << 30, false)
        );
        assert_eq!(p[0].share_id.as_deref(), Some("s1"));

        let whole = claim(result(json!(null)), json!([]));
        assert!(plan(&whole, "u1", "n1", &gpus()).unwrap()[0].whole);

        let cfg = json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER_NAME,
            "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 60}}}]);
        let soft = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
        assert_eq!(
            plan(&soft, "u1", "n1", &gpus()).unwrap()[0].soft_limit,
            Some(60)
        );
    }

    #[test]
    fn a_share_is_alone_and_devices_are_distinct() {
        let mut g = gpus();
        g.gpus.push(GpuInfo {
            index: 1,
            uuid: "GPU-1".into(),
            ..g.gpus[0].clone()
        });
        let r = |req: &str, dev: &str, cap: serde_json::Value| {
            json!({"request": req, "driver": DRIVER_NAME, "pool": "n1", "device": dev,
                   "consumedCapacity": cap})
        };
        let two_whole = claim(
            json!([
                r("gpu", "gpu-0", json!(null)),
                r("gpu", "gpu-1", json!(null))
            ]),
            json!([]),
        );
        let p = plan(&two_whole, "u1", "n1", &g).unwrap();
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|d| d.whole));

        let mixed = claim(
            json!([
                r("a", "gpu-0", json!({"cores": "30", "memory": "1Gi"})),
                r("b", "gpu-1", json!(null))
            ]),
            json!([]),
        );
        let e = plan(&mixed, "u1", "n1", &g).unwrap_err().to_string();
        assert!(e.contains("request \"a\" is a share of gpu-0"), "{e}");
        assert!(e.contains("a share must be the claim's only device"), "{e}");

        // Shares of two GPUs: one container's quotas on each.
        let two_shares = claim(
            json!([
                r("gpus", "gpu-0", json!({"cores": "40", "memory": "2Gi"})),
                r("gpus", "gpu-1", json!({"cores": "40", "memory": "2Gi"}))
            ]),
            json!([]),
        );
        let p = plan(&two_shares, "u1", "n1", &g).unwrap();
        let got: Vec<_> = p
            .iter()
            .map(|d| (d.gpu_index, d.cores, d.memory_bytes, d.whole))
            .collect();
        assert_eq!(got, [(0, 40, 2 << 30, false), (1, 40, 2 << 30, false)]);

        let twice = claim(
            json!([
                r("a", "gpu-0", json!({"cores": "30", "memory": "1Gi"})),
                r("b", "gpu-0", json!({"cores": "20", "memory": "1Gi"}))
            ]),
            json!([]),
        );
        let e = plan(&twice, "u1", "n1", &g).unwrap_err().to_string();
        assert!(e.contains("gpu-0 is allocated twice"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let c = claim(result(json!({"cores": "30", "memory": "1Gi"})), json!([]));
        let e = plan(&c, "other", "n1", &gpus()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("claim ns/c1: the API server has UID"),
            "{e}"
        );
        let e = plan(&c, "u1", "n2", &gpus()).unwrap_err();
        assert!(e.to_string().contains("not this node's \"n2\""), "{e}");
        let bad = claim(result(json!({"cores": "30", "memory": "100Mi"})), json!([]));
        assert!(
            plan(&bad, "u1", "n1", &gpus())
                .unwrap_err()
                .to_string()
                .contains("multiple of 256 MiB")
        );
        let cfg = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER_NAME,
            "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 20}}}]);
        let low = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
        assert!(
            plan(&low, "u1", "n1", &gpus())
                .unwrap_err()
                .to_string()
                .contains("below the 30 cores")
        );
        let cfg = json!([{"source": "FromClass", "opaque": {"driver": DRIVER_NAME,
            "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "exclusive": true}}}]);
        let part = claim(result(json!({"cores": "30", "memory": "1Gi"})), cfg);
        assert!(
            plan(&part, "u1", "n1", &gpus())
                .unwrap_err()
                .to_string()
                .contains("exclusive")
        );
        let none: ResourceClaim = serde_json::from_value(
            json!({"metadata": {"name": "c1", "namespace": "ns", "uid": "u1"}, "spec": {}}),
        )
        .unwrap();
        assert!(
            plan(&none, "u1", "n1", &gpus())
                .unwrap_err()
                .to_string()
                .contains("not allocated")
        );
    }

    /// GPU 0 whole; GPU 1 in MIG mode with a 3g.40gb instance (gi 2).
    fn with_mig() -> Inventory {
        let mut inv = gpus();
        inv.gpus.push(GpuInfo {
            index: 1,
            uuid: "GPU-1".into(),
            minor: 1,
            ..inv.gpus[0].clone()
        });
        inv.mig = vec![
            None,
            Some(vec![MigDevice {
                uuid: "MIG-3g".into(),
                profile: "3g.40gb".into(),
                gpu_instance: 2,
                compute_instance: 0,
                memory_bytes: 40448 << 20,
                multiprocessors: 60,
            }]),
        ];
        inv
    }

    fn on(dev: &str, cap: serde_json::Value) -> serde_json::Value {
        json!({"request": "mig", "driver": DRIVER_NAME, "pool": "n1", "device": dev,
               "consumedCapacity": cap})
    }

    #[test]
    fn a_mig_device_is_planned_whole_with_its_instance() {
        let inv = with_mig();
        let c = claim(json!([on("gpu-1-mig-2-0", json!(null))]), json!([]));
        let p = plan(&c, "u1", "n1", &inv).unwrap();
        assert_eq!(p.len(), 1);
        let d = &p[0];
        assert_eq!(
            (d.gpu_index, d.gpu_uuid.as_str(), d.whole, d.soft_limit),
            (1, "GPU-1", true, None)
        );
        assert_eq!(d.memory_bytes, 40448 << 20);
        assert_eq!(
            d.mig,
            Some(PlannedMig {
                uuid: "MIG-3g".into(),
                gpu_instance: 2,
                compute_instance: 0,
                placement: None,
            })
        );
        // All of its memory, said, is the same.
        let all = claim(
            json!([on("gpu-1-mig-2-0", json!({"memory": "40448Mi"}))]),
            json!([]),
        );
        assert_eq!(plan(&all, "u1", "n1", &inv).unwrap(), p);
        // A checkpoint written before MIG devices still loads.
        let mut old = serde_json::to_value(&p[0]).unwrap();
        assert!(old.get("mig").is_some());
        old.as_object_mut().unwrap().remove("mig");
        let back: PlannedDevice = serde_json::from_value(old).unwrap();
        assert_eq!(back.mig, None);
        let plain = plan(&claim(result(json!(null)), json!([])), "u1", "n1", &inv).unwrap();
        let json = serde_json::to_value(&plain[0]).unwrap();
        assert!(json.get("mig").is_none(), "{json}");
    }

    #[test]
    fn a_share_of_a_static_mig_device_is_planned_in_its_instance() {
        let inv = with_mig();
        let planned = |results: serde_json::Value, config: serde_json::Value| {
            plan(&claim(results, config), "u1", "n1", &inv)
        };
        let share = planned(
            json!([on("gpu-1-mig-2-0", json!({"cores": "50", "memory": "5Gi"}))]),
            json!([]),
        )
        .unwrap();
        let d = &share[0];
        assert_eq!(
            (d.whole, d.cores, d.memory_bytes, d.soft_limit),
            (false, 50, 5 << 30, None)
        );
        assert_eq!(d.mig.as_ref().unwrap().uuid, "MIG-3g");
        let cfg = |p: serde_json::Value| {
            let mut params =
                json!({"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig"});
            params
                .as_object_mut()
                .unwrap()
                .extend(p.as_object().unwrap().clone());
            json!([{"source": "FromClaim", "requests": ["mig"],
                    "opaque": {"driver": DRIVER_NAME, "parameters": params}}])
        };
        let soft = planned(
            json!([on("gpu-1-mig-2-0", json!({"cores": "30", "memory": "1Gi"}))]),
            cfg(json!({"coreLimit": 60})),
        )
        .unwrap();
        assert_eq!(soft[0].soft_limit, Some(60));
        // The whole instance has no soft limit, and exclusive means whole.
        let e = planned(
            json!([on("gpu-1-mig-2-0", json!(null))]),
            cfg(json!({"coreLimit": 60})),
        );
        assert!(matches!(
            e.unwrap_err().problem,
            Refusal::NotForMig {
                what: NotForMig::CoreLimit(60),
                ..
            }
        ));
        let e = planned(
            json!([on("gpu-1-mig-2-0", json!({"cores": "30", "memory": "1Gi"}))]),
            cfg(json!({"exclusive": true})),
        );
        assert!(matches!(
            e.unwrap_err().problem,
            Refusal::NotWhole { cores: 30, .. }
        ));
        // More than the instance has is refused, naming it.
        let e = planned(
            json!([on(
                "gpu-1-mig-2-0",
                json!({"cores": "30", "memory": "41Gi"})
            )]),
            json!([]),
        );
        assert!(
            matches!(e.unwrap_err().problem, Refusal::Memory { full_memory, .. } if full_memory == 40448 << 20)
        );
    }

    #[test]
    fn a_dynamic_mig_device_is_taken_whole() {
        let inv = with_mig();
        let m = inv.mig[1].as_ref().unwrap()[0].clone();
        let parent = inv.gpus[1].clone();
        let r = |cap: serde_json::Value| -> DeviceRequestAllocationResult {
            serde_json::from_value(on("gpu-1-mig-2-0", cap)).unwrap()
        };
        let not_for = |what| Refusal::NotForMig {
            request: "mig".into(),
            device: "gpu-1-mig-2-0".into(),
            what,
        };
        let refused = |cap, configs: &[DeviceAllocationConfiguration]| {
            plan_mig(&r(cap), configs, &parent, &m).unwrap_err()
        };
        assert_eq!(
            refused(json!({"cores": "30", "memory": "1Gi"}), &[]),
            not_for(NotForMig::Cores("30".into()))
        );
        assert_eq!(
            refused(json!({"memory": "1Gi"}), &[]),
            not_for(NotForMig::Memory {
                asked: "1Gi".into(),
                instance: 40448 << 20
            })
        );
        let cfg: Vec<DeviceAllocationConfiguration> = serde_json::from_value(json!([{"source": "FromClaim", "requests": ["mig"], "opaque": {"driver": DRIVER_NAME,
            "parameters": {"apiVersion": "vcuda.tencent.com/v1alpha1", "kind": "GpuConfig", "coreLimit": 60}}}])).unwrap();
        let e = refused(json!(null), &cfg);
        assert_eq!(e, not_for(NotForMig::CoreLimit(60)));
        assert_eq!(
            e.to_string(),
            "request \"mig\": gpu-1-mig-2-0 is a MIG device made for one claim, taken whole with the untouched driver: coreLimit 60 does not apply to it"
        );
    }

    #[test]
    fn a_mig_device_is_alone_in_its_claim() {
        let inv = with_mig();
        let refused = |results: serde_json::Value, config: serde_json::Value| {
            plan(&claim(results, config), "u1", "n1", &inv)
                .unwrap_err()
                .problem
        };
        // Alone in its claim, once.
        let beside = json!([on("gpu-1-mig-2-0", json!(null)),
            {"request": "gpu", "driver": DRIVER_NAME, "pool": "n1", "device": "gpu-0"}]);
        assert_eq!(
            refused(beside, json!([])),
            Refusal::MigNotAlone {
                request: "mig".into(),
                device: "gpu-1-mig-2-0".into(),
                other: "gpu-0".into()
            }
        );
        let twice = json!([
            on("gpu-1-mig-2-0", json!(null)),
            on("gpu-1-mig-2-0", json!(null))
        ]);
        assert!(matches!(
            refused(twice, json!([])),
            Refusal::AllocatedTwice { device, .. } if device == "gpu-1-mig-2-0"
        ));
        // Unknown MIG devices, and the GPU in MIG mode itself, are no devices.
        for dev in ["gpu-1-mig-9-0", "gpu-1-mig-2-1", "gpu-1", "gpu-0-mig-2-0"] {
            assert_eq!(
                refused(json!([on(dev, json!(null))]), json!([])),
                Refusal::NoDevice {
                    request: "mig".into(),
                    device: dev.into()
                }
            );
        }
    }
}
