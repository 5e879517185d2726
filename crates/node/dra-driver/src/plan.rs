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
        // Lent inside the instance alone (its memory is the card).
        memory_limit: memory_limit(&config, false, memory, &r.request)?,
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
mod tests;
