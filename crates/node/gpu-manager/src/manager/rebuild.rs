//! An allocation rebuilt for a live container the checkpoint lost: its
//! GPUs from what the runtime says it was given (a share on several GPUs:
//! from its `vcuda-gpus.config`), its size from kubelet's device IDs or
//! its quota files, its pod from the runtime's labels and the
//! API server. The GPU and size steps are pure (tested in
//! `restore::tests`).

use gpu_allocator::{GpuInfo, MEMORY_UNIT_BYTES, Placement};
use quota_config::{MultiGpuQuota, Quota, ResourceData};

use super::{Manager, now, short_bus_id};
use crate::allocation::{Allocation, PlacementRecord};
use crate::decide::ids;
use crate::decide::pods;
use crate::decide::recovery;
use crate::world::Held;
use crate::world::{ContainerGpus, LiveContainer};

/// Why an allocation cannot be rebuilt for a live container.
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    #[error(transparent)]
    VmDir(#[from] node_agent::vm::VmError),
    #[error(transparent)]
    Runtime(#[from] crate::world::RuntimeError),
    #[error("no GPU found in its environment, devices or vcuda.config")]
    NoGpu,
    #[error("its GPU {uuid} ({bus_id}) is not on this node")]
    GpuNotHere { uuid: String, bus_id: String },
    #[error("its size is unknown (no kubelet record and no readable vcuda.config)")]
    SizeUnknown,
}

/// The GPUs (indices into `gpus`) a container was given: from its
/// environment's UUIDs, else its `/dev/nvidia<N>` devices, else its quota
/// file's bus id; sorted, without repeats.
pub(super) fn gpus_seen(
    gpus: &[GpuInfo],
    seen: &ContainerGpus,
    cfg: Option<&ResourceData>,
) -> Vec<usize> {
    let mut found: Vec<usize> = seen
        .visible
        .iter()
        .filter_map(|u| gpus.iter().position(|g| &g.uuid == u))
        .collect();
    if found.is_empty() {
        found = seen
            .devices
            .iter()
            .filter_map(|d| d.strip_prefix("/dev/nvidia")?.parse::<u32>().ok())
            .filter_map(|m| gpus.iter().position(|g| g.minor == m))
            .collect();
    }
    if found.is_empty()
        && let Some(cfg) = cfg
        && let Some(g) = gpus
            .iter()
            .position(|g| short_bus_id(&g.pci_bus_id) == cfg.bus_id)
    {
        found.push(g);
    }
    found.sort_unstable();
    found.dedup();
    found
}

/// How big a rebuilt allocation is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Size {
    pub cores: u32,
    pub memory_units: u64,
    pub memory_limit: u64,
    pub placement: Placement,
}

impl Size {
    /// The size of an allocation on `on` (indices into `gpus`, not empty):
    /// kubelet's device IDs count cores and memory, else the quota file
    /// `cfg` tells; a share when the quota file says so, else when kubelet
    /// gave fewer than 100 cores on one GPU.
    pub fn of(
        gpus: &[GpuInfo],
        on: &[usize],
        cfg: Option<&ResourceData>,
        vcore_ids: &[String],
        vmemory_ids: &[String],
    ) -> Result<Size, RebuildError> {
        let shared = match cfg {
            Some(cfg) => cfg.enable,
            None => on.len() == 1 && !vcore_ids.is_empty() && vcore_ids.len() < 100,
        };
        let cores = if !vcore_ids.is_empty() {
            vcore_ids.len() as u32
        } else if shared {
            cfg.map_or(0, |c| c.utilization.max(0) as u32)
        } else {
            100 * on.len() as u32
        };
        let memory_limit = if !vmemory_ids.is_empty() {
            vmemory_ids.len() as u64
        } else {
            cfg.map_or(0, |c| c.gpu_memory / MEMORY_UNIT_BYTES)
        };
        let (memory_units, placement) = if shared {
            let units = cfg.map_or(memory_limit, |c| c.gpu_memory / MEMORY_UNIT_BYTES);
            let placement = Placement::Share {
                gpu: on[0],
                cores,
                memory_units: units,
            };
            (units, placement)
        } else {
            (
                on.iter().map(|&g| gpus[g].memory_units()).sum(),
                Placement::Exclusive { gpus: on.to_vec() },
            )
        };
        if cores == 0 || (shared && memory_units == 0) {
            return Err(RebuildError::SizeUnknown);
        }
        Ok(Size {
            cores,
            memory_units,
            memory_limit,
            placement,
        })
    }

    /// The size of a share on several GPUs from its quota files (`q`, its
    /// records matched to this node's GPUs by bus id); kubelet's device
    /// IDs, when it has them, count the container's totals.
    pub fn of_multi(
        gpus: &[GpuInfo],
        q: &MultiGpuQuota,
        vcore_ids: &[String],
        vmemory_ids: &[String],
    ) -> Result<Size, RebuildError> {
        let on = q
            .gpus
            .iter()
            .map(|r| {
                gpus.iter()
                    .position(|g| short_bus_id(&g.pci_bus_id) == r.bus_id)
                    .ok_or_else(|| RebuildError::GpuNotHere {
                        uuid: r.uuid.clone(),
                        bus_id: r.bus_id.clone(),
                    })
            })
            .collect::<Result<Vec<usize>, _>>()?;
        let (first, n) = (&q.gpus[0], q.gpus.len() as u64);
        let per_gpu_units = first.gpu_memory / MEMORY_UNIT_BYTES;
        let memory_units = per_gpu_units * n;
        Ok(Size {
            cores: if vcore_ids.is_empty() {
                first.utilization.max(0) as u32 * n as u32
            } else {
                vcore_ids.len() as u32
            },
            memory_units,
            memory_limit: if vmemory_ids.is_empty() {
                memory_units
            } else {
                vmemory_ids.len() as u64
            },
            // One record naming a MIG device: a share inside that instance.
            placement: match (&on[..], first.uuid.starts_with("MIG-")) {
                ([gpu], true) => Placement::InMig {
                    gpu: *gpu,
                    instance: first.uuid.clone(),
                    cores: first.utilization.max(0) as u32,
                    memory_units: per_gpu_units,
                },
                _ => Placement::Shares {
                    gpus: on,
                    cores: first.utilization.max(0) as u32,
                    memory_units: per_gpu_units,
                },
            },
        })
    }
}

impl Manager {
    /// An allocation for a live container the checkpoint lost: GPUs from
    /// its environment or devices (else the quota file's bus id), sizes
    /// from kubelet's device IDs (else the quota file), the pod from the
    /// runtime's labels and the API server.
    pub(super) async fn rebuild(
        &self,
        c: &LiveContainer,
        kubelet: Option<&[Held]>,
    ) -> Result<Allocation, RebuildError> {
        let dir = self.shares.vm().dir(&c.pod_uid, &c.container)?;
        let (cfg, multi) = match quota_config::read_quota(&dir) {
            Ok(Quota::Single(c)) => (Some(c), None),
            Ok(Quota::Multi(q)) => (None, Some(q)),
            Err(_) => (None, None),
        };
        let seen = self.runtime.gpus(&c.id).await?;
        let on = gpus_seen(&self.gpus, &seen, cfg.as_ref());
        if on.is_empty() && multi.is_none() {
            return Err(RebuildError::NoGpu);
        }
        let probe = Allocation {
            pod_uid: c.pod_uid.clone(),
            namespace: c.namespace.clone(),
            pod_name: c.pod_name.clone(),
            container: c.container.clone(),
            container_index: 0,
            cores: 0,
            memory_units: 0,
            memory_limit: 0,
            placement: PlacementRecord::Exclusive { gpus: vec![] },
            soft_limit: None,
            // The vm directory does not say: the pod's annotations, below.
            tier: Default::default(),
            memory_ceiling: None,
            vcore_ids: vec![],
            vmemory_ids: vec![],
            verified: false,
            created: now(),
        };
        let held = kubelet.and_then(|k| recovery::held_by(&probe, k));
        let ids_of = |r: &str| held.and_then(|h| h.ids.get(r).cloned()).unwrap_or_default();
        let (vcore_ids, vmemory_ids) = (ids_of(ids::VCORE_RESOURCE), ids_of(ids::VMEMORY_RESOURCE));
        let size = match &multi {
            Some(q) => Size::of_multi(&self.gpus, q, &vcore_ids, &vmemory_ids)?,
            None => Size::of(&self.gpus, &on, cfg.as_ref(), &vcore_ids, &vmemory_ids)?,
        };
        let soft_limit = match &multi {
            Some(q) => (!q.hard_limit).then(|| q.gpus[0].limit.max(0) as u32),
            None => cfg
                .as_ref()
                .filter(|c| !c.hard_limit)
                .map(|c| c.limit.max(0) as u32),
        };
        let (tier, memory_ceiling) = self.qos_of(c, &size);
        Ok(Allocation {
            container_index: self.container_index(c),
            tier,
            memory_ceiling,
            cores: size.cores,
            memory_units: size.memory_units,
            memory_limit: size.memory_limit,
            placement: (&size.placement).into(),
            soft_limit,
            verified: held.is_some(),
            vcore_ids,
            vmemory_ids,
            ..probe
        })
    }

    /// The share's compute tier and memory limit as Allocate would take
    /// them from the pod's annotations (plain and none when the pod is not
    /// known or they no longer parse: the quota files hold no tier, and the
    /// ledger's guarantee is kept either way).
    fn qos_of(&self, c: &LiveContainer, size: &Size) -> (qos_page::Tier, Option<u64>) {
        let Some(pod) = self
            .pods
            .pods()
            .into_iter()
            .find(|p| pods::uid(p) == c.pod_uid)
        else {
            return Default::default();
        };
        let tier = pods::tier(&pod).unwrap_or_default();
        let ceiling = match &size.placement {
            Placement::Share { .. } | Placement::InMig { .. } => {
                gpu_pods::memory_limit(&pod, false, 1, size.memory_units * MEMORY_UNIT_BYTES)
                    .ok()
                    .flatten()
            }
            _ => None,
        };
        (tier, ceiling)
    }

    /// The container's index among its pod's GPU containers, as the API
    /// server has the pod (0 when it cannot tell).
    fn container_index(&self, c: &LiveContainer) -> usize {
        let pod = self
            .pods
            .pods()
            .into_iter()
            .find(|p| pods::uid(p) == c.pod_uid);
        pod.as_ref()
            .and_then(|p| {
                pods::gpu_containers(p)
                    .into_iter()
                    .find(|(_, n)| *n == c.container)
            })
            .map_or(0, |(i, _)| i)
    }
}
