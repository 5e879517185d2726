//! The manager's core record: one container's allocation, as decisions
//! make it, the checkpoint persists it and recovery rebuilds it (its serde
//! form is the checkpoint's payload: `docs/contracts.md`).

use gpu_allocator::Placement;
use qos_page::Tier;
use serde::{Deserialize, Serialize};

/// One container's allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub pod_uid: String,
    pub namespace: String,
    pub pod_name: String,
    pub container: String,
    /// Index of the container in the pod spec (`predicate-gpu-idx-<i>`).
    pub container_index: usize,
    /// `vcuda-core` of the request.
    pub cores: u32,
    /// `vcuda-memory` units of the container (whole GPUs: all their memory).
    pub memory_units: u64,
    /// The container's `vcuda-memory` limit (what kubelet allocates IDs for).
    #[serde(default)]
    pub memory_limit: u64,
    pub placement: PlacementRecord,
    /// Soft limit ceiling (`tencent.com/vcuda-core-limit`), if any.
    pub soft_limit: Option<u32>,
    /// Compute tier (`tencent.com/vcuda-tier` or the PriorityClass;
    /// docs/qos.md). Absent in the checkpoint when plain.
    #[serde(default, skip_serializing_if = "Tier::is_plain")]
    pub tier: Tier,
    /// Memory it may borrow up to (`tencent.com/vcuda-memory-limit`,
    /// docs/qos.md), above its quota; absent in the checkpoint when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_ceiling: Option<u64>,
    /// The advertised IDs kubelet passed to Allocate.
    pub vcore_ids: Vec<String>,
    #[serde(default)]
    pub vmemory_ids: Vec<String>,
    /// kubelet's record was seen to agree with the pod the manager guessed.
    #[serde(default)]
    pub verified: bool,
    /// Unix seconds of the allocation.
    pub created: u64,
}

impl Allocation {
    /// The allocator's id for this allocation.
    pub fn id(&self) -> String {
        alloc_id(&self.pod_uid, &self.container)
    }
}

pub fn alloc_id(pod_uid: &str, container: &str) -> String {
    format!("{pod_uid}/{container}")
}

/// [`Placement`] in a stable serialised form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum PlacementRecord {
    Share {
        gpu: usize,
        cores: u32,
        memory_units: u64,
    },
    Exclusive {
        gpus: Vec<usize>,
    },
    /// A share on each of several GPUs (docs/multi-gpu.md).
    Shares {
        gpus: Vec<usize>,
        cores: u32,
        memory_units: u64,
    },
    /// A share inside MIG instance `instance` (its UUID) of GPU `gpu`
    /// (docs/mig.md). A manager from before it cannot read the record: a
    /// rollback past it refuses the checkpoint, naming the field.
    #[serde(rename = "in_mig")]
    InMig {
        gpu: usize,
        instance: String,
        cores: u32,
        memory_units: u64,
    },
}

impl From<&Placement> for PlacementRecord {
    fn from(p: &Placement) -> Self {
        match p {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => PlacementRecord::Share {
                gpu: *gpu,
                cores: *cores,
                memory_units: *memory_units,
            },
            Placement::Exclusive { gpus } => PlacementRecord::Exclusive { gpus: gpus.clone() },
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => PlacementRecord::Shares {
                gpus: gpus.clone(),
                cores: *cores,
                memory_units: *memory_units,
            },
            Placement::InMig {
                gpu,
                instance,
                cores,
                memory_units,
            } => PlacementRecord::InMig {
                gpu: *gpu,
                instance: instance.clone(),
                cores: *cores,
                memory_units: *memory_units,
            },
        }
    }
}

impl From<&PlacementRecord> for Placement {
    fn from(p: &PlacementRecord) -> Self {
        match p {
            PlacementRecord::Share {
                gpu,
                cores,
                memory_units,
            } => Placement::Share {
                gpu: *gpu,
                cores: *cores,
                memory_units: *memory_units,
            },
            PlacementRecord::Exclusive { gpus } => Placement::Exclusive { gpus: gpus.clone() },
            PlacementRecord::Shares {
                gpus,
                cores,
                memory_units,
            } => Placement::Shares {
                gpus: gpus.clone(),
                cores: *cores,
                memory_units: *memory_units,
            },
            PlacementRecord::InMig {
                gpu,
                instance,
                cores,
                memory_units,
            } => Placement::InMig {
                gpu: *gpu,
                instance: instance.clone(),
                cores: *cores,
                memory_units: *memory_units,
            },
        }
    }
}
