//! Requests, placements and the allocation state.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::AllocError;
use crate::instances::Instances;
use crate::select::{self, Fragmentation};
use crate::topology::Topology;

/// Cores of one whole GPU (`vcuda-core` 100).
pub const WHOLE_GPU_CORES: u32 = 100;

/// What a container asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// `tencent.com/vcuda-core`: 1..99 is a share of one GPU, a multiple of
    /// 100 is that many whole GPUs. With `gpus` ≥ 2: the cores of the share
    /// on each GPU, 1..99.
    pub cores: u32,
    /// `tencent.com/vcuda-memory` in 256 MiB units. Required (≥ 1) for a
    /// share; ignored for whole GPUs, which get all their memory. With
    /// `gpus` ≥ 2: the units on each GPU.
    pub memory_units: u64,
    /// The node's `--share-mode`: without it only whole GPUs are handed out.
    pub share_mode: bool,
    /// GPUs the share spans: 1 for every request vcuda-core alone can
    /// express; N ≥ 2 for a share of `cores` and `memory_units` on each of
    /// N GPUs ([`Request::from_totals`] splits a container's totals).
    #[serde(default = "one_gpu")]
    pub gpus: u32,
}

fn one_gpu() -> u32 {
    1
}

impl Request {
    /// A one-GPU request's cores: 1..99 (a share) or a multiple of 100.
    pub fn check_cores(&self) -> Result<(), AllocError> {
        let cores = self.cores;
        if self.gpus == 1
            && (cores == 0 || (cores > WHOLE_GPU_CORES && cores % WHOLE_GPU_CORES != 0))
        {
            return Err(AllocError::InvalidCores { cores });
        }
        Ok(())
    }

    /// What no node could place, whatever its GPUs: the cores' shape, and
    /// a share of one GPU without memory.
    pub fn check_shape(&self) -> Result<(), AllocError> {
        self.check_cores()?;
        let cores = self.cores;
        if self.gpus == 1 && cores % WHOLE_GPU_CORES != 0 && self.memory_units == 0 {
            return Err(AllocError::ShareWithoutMemory { cores });
        }
        Ok(())
    }
}

impl Request {
    /// A share of one GPU (share mode on).
    pub fn share(cores: u32, memory_units: u64) -> Request {
        Request {
            cores,
            memory_units,
            share_mode: true,
            gpus: 1,
        }
    }

    /// `gpus` whole GPUs.
    pub fn whole(gpus: u32) -> Request {
        Request {
            cores: gpus * WHOLE_GPU_CORES,
            memory_units: 0,
            share_mode: true,
            gpus: 1,
        }
    }

    /// A share of `cores` and `memory_units` on each of `gpus` GPUs (share
    /// mode on).
    pub fn shares(gpus: u32, cores: u32, memory_units: u64) -> Request {
        Request {
            cores,
            memory_units,
            share_mode: true,
            gpus,
        }
    }

    /// This request placed on `gpus` (indices, any order; a scheduler's
    /// recorded choice), or `None` when that is not as many GPUs as the
    /// request takes. Whether it fits is [`Allocator::commit`]'s to say.
    pub fn placement_on(&self, gpus: &[usize]) -> Option<Placement> {
        let mut gpus = gpus.to_vec();
        gpus.sort_unstable();
        gpus.dedup();
        let n = gpus.len() as u32;
        match self.gpus {
            1 if self.cores < WHOLE_GPU_CORES => (n == 1).then(|| Placement::Share {
                gpu: gpus[0],
                cores: self.cores,
                memory_units: self.memory_units,
            }),
            1 => (n * WHOLE_GPU_CORES == self.cores).then_some(Placement::Exclusive { gpus }),
            k => (n == k).then_some(Placement::Shares {
                gpus,
                cores: self.cores,
                memory_units: self.memory_units,
            }),
        }
    }
}

/// Where a request goes. Also what the manager checkpoints and hands back
/// to [`Allocator::restore`] (serde: `{"share":{"gpu":2,"cores":30,"memory_units":8}}`,
/// `{"exclusive":{"gpus":[0,1]}}` or
/// `{"shares":{"gpus":[0,1],"cores":40,"memory_units":80}}`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Part of one GPU.
    Share {
        gpu: usize,
        cores: u32,
        memory_units: u64,
    },
    /// Whole GPUs (ascending indices), all cores and memory of each.
    Exclusive { gpus: Vec<usize> },
    /// A share of `cores` and `memory_units` on each of two or more GPUs
    /// (ascending indices), for one container.
    Shares {
        gpus: Vec<usize>,
        cores: u32,
        memory_units: u64,
    },
    /// A share inside MIG instance `instance` (its UUID) of GPU `gpu`:
    /// cores of the instance's SMs, units of its memory
    /// ([`crate::SharedInstance`]).
    InMig {
        gpu: usize,
        instance: String,
        cores: u32,
        memory_units: u64,
    },
}

impl Placement {
    /// The GPU indices this placement uses.
    pub fn gpus(&self) -> &[usize] {
        match self {
            Placement::Share { gpu, .. } | Placement::InMig { gpu, .. } => {
                std::slice::from_ref(gpu)
            }
            Placement::Exclusive { gpus } | Placement::Shares { gpus, .. } => gpus,
        }
    }

    /// The cores and memory units held on `gpu` (a whole GPU: 100 cores and
    /// `None` for all its memory), or `None` when the placement does not
    /// use it — nor for a share inside one of its MIG instances, which
    /// holds the instance's cores and memory, not the GPU's.
    pub fn on_gpu(&self, gpu: usize) -> Option<(u32, Option<u64>)> {
        if !self.gpus().contains(&gpu) || matches!(self, Placement::InMig { .. }) {
            return None;
        }
        Some(match self {
            Placement::Share {
                cores,
                memory_units,
                ..
            }
            | Placement::Shares {
                cores,
                memory_units,
                ..
            } => (*cores, Some(*memory_units)),
            Placement::Exclusive { .. } => (WHOLE_GPU_CORES, None),
            Placement::InMig { .. } => unreachable!("returned above"),
        })
    }

    pub fn is_exclusive(&self) -> bool {
        matches!(self, Placement::Exclusive { .. })
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => write!(
                f,
                "share of GPU{gpu}: {cores} cores, {memory_units} memory units"
            ),
            Placement::Exclusive { gpus } => {
                f.write_str("whole ")?;
                write_gpus(f, gpus)
            }
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => {
                f.write_str("shares of ")?;
                write_gpus(f, gpus)?;
                write!(f, ": {cores} cores, {memory_units} memory units on each")
            }
            Placement::InMig {
                gpu,
                instance,
                cores,
                memory_units,
            } => write!(
                f,
                "share of MIG instance {instance} on GPU{gpu}: {cores} cores, {memory_units} memory units"
            ),
        }
    }
}

fn write_gpus(f: &mut fmt::Formatter<'_>, gpus: &[usize]) -> fmt::Result {
    for (i, g) in gpus.iter().enumerate() {
        write!(f, "{}GPU{g}", if i > 0 { "," } else { "" })?;
    }
    Ok(())
}

/// One GPU's accounting, as [`Allocator::usage`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuUsage {
    pub total_memory_units: u64,
    /// 0..=100; 100 for a GPU held whole.
    pub allocated_cores: u32,
    pub allocated_memory_units: u64,
    pub healthy: bool,
    /// In MIG mode: its memory and SMs belong to hardware partitions, not
    /// to shares or whole-GPU allocations (docs/mig.md).
    pub mig: bool,
    /// Held whole by one allocation.
    pub exclusive: bool,
    /// Number of shares placed on it.
    pub shares: u32,
}

impl GpuUsage {
    /// A card of `total_memory_units` with nothing on it, healthy.
    pub(crate) fn empty(total_memory_units: u64) -> GpuUsage {
        GpuUsage {
            total_memory_units,
            allocated_cores: 0,
            allocated_memory_units: 0,
            healthy: true,
            mig: false,
            exclusive: false,
            shares: 0,
        }
    }

    pub fn free_cores(&self) -> u32 {
        WHOLE_GPU_CORES - self.allocated_cores
    }

    pub fn free_memory_units(&self) -> u64 {
        self.total_memory_units - self.allocated_memory_units
    }

    /// Whether new placements may land on it: healthy, not in MIG mode.
    pub fn takes_placements(&self) -> bool {
        self.healthy && !self.mig
    }

    /// Adds (or removes) a checked share of `cores` and `units`.
    pub(crate) fn count_share(&mut self, cores: u32, units: u64, add: bool) {
        if add {
            self.allocated_cores += cores;
            self.allocated_memory_units += units;
            self.shares += 1;
        } else {
            self.allocated_cores -= cores;
            self.allocated_memory_units -= units;
            self.shares -= 1;
        }
    }

    /// Nothing allocated on it.
    pub fn is_idle(&self) -> bool {
        self.allocated_cores == 0 && self.allocated_memory_units == 0 && self.shares == 0
    }
}

/// The allocation state of one node.
///
/// Per-GPU aggregates are kept next to the allocation map, so a decision
/// costs O(GPUs) (O(groups) more for whole GPUs), whatever the number of
/// allocations.
#[derive(Debug, Clone)]
pub struct Allocator {
    topo: Topology,
    pub(crate) usage: Vec<GpuUsage>,
    allocations: HashMap<String, Placement>,
    pub(crate) largest_units: u64,
    pub(crate) instances: Instances,
}

impl Allocator {
    /// An empty node: every GPU free and healthy.
    pub fn new(topology: Topology) -> Allocator {
        let usage = topology
            .gpus()
            .iter()
            .map(|g| GpuUsage::empty(g.memory_units()))
            .collect();
        let largest_units = topology
            .gpus()
            .iter()
            .map(|g| g.memory_units())
            .max()
            .unwrap_or(0);
        Allocator {
            topo: topology,
            usage,
            allocations: HashMap::new(),
            largest_units,
            instances: Instances::default(),
        }
    }

    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// One GPU's accounting. Panics on an index out of range.
    pub fn usage(&self, gpu: usize) -> GpuUsage {
        self.usage[gpu]
    }

    /// Every GPU's accounting, by index.
    pub fn usages(&self) -> &[GpuUsage] {
        &self.usage
    }

    pub fn allocation(&self, id: &str) -> Option<&Placement> {
        self.allocations.get(id)
    }

    /// Every committed allocation (in no particular order).
    pub fn allocations(&self) -> impl Iterator<Item = (&str, &Placement)> {
        self.allocations.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Decides where a request goes, changing nothing.
    pub fn evaluate(&self, req: &Request) -> Result<Placement, AllocError> {
        if req.gpus != 1 {
            return self.evaluate_shares(req);
        }
        let cores = req.cores;
        req.check_cores()?;
        if cores % WHOLE_GPU_CORES == 0 {
            self.evaluate_whole((cores / WHOLE_GPU_CORES) as usize, cores)
        } else {
            self.evaluate_share(cores, req)
        }
    }

    fn evaluate_whole(&self, n: usize, cores: u32) -> Result<Placement, AllocError> {
        let total = self.topo.len();
        if n > total {
            return Err(AllocError::TooManyGpus {
                cores,
                requested: n,
                total,
            });
        }
        let free = self.fully_free();
        match select::whole_gpus(&self.topo, &free, n) {
            Some(gpus) => Ok(Placement::Exclusive { gpus }),
            None => {
                let free_list: Vec<String> = (0..total)
                    .filter(|&i| free[i])
                    .map(|i| format!("GPU{i}"))
                    .collect();
                let unhealthy = self.usage.iter().filter(|u| !u.healthy).count();
                let mig = self.usage.iter().filter(|u| u.mig).count();
                Err(AllocError::Insufficient {
                    detail: format!(
                        "{n} whole GPU{} requested, {} fully free ({}){}{}",
                        if n == 1 { "" } else { "s" },
                        free_list.len(),
                        if free_list.is_empty() {
                            "none".to_string()
                        } else {
                            free_list.join(", ")
                        },
                        if unhealthy > 0 {
                            format!(", {unhealthy} unhealthy")
                        } else {
                            String::new()
                        },
                        if mig > 0 {
                            format!(", {mig} in MIG mode")
                        } else {
                            String::new()
                        }
                    ),
                })
            }
        }
    }

    fn evaluate_share(&self, cores: u32, req: &Request) -> Result<Placement, AllocError> {
        if !req.share_mode {
            return Err(AllocError::ShareModeOff { cores });
        }
        let units = req.memory_units;
        if units == 0 {
            return Err(AllocError::ShareWithoutMemory { cores });
        }
        if units > self.largest_units {
            return Err(AllocError::MemoryTooLarge {
                requested: units,
                largest: self.largest_units,
            });
        }
        // Fullest first: least free cores, then least free memory, then
        // lowest index. Exclusive GPUs have no free cores, so never fit.
        let fits = |u: &GpuUsage| {
            u.takes_placements() && u.free_cores() >= cores && u.free_memory_units() >= units
        };
        let best = self
            .usage
            .iter()
            .enumerate()
            .filter(|(_, u)| fits(u))
            .min_by_key(|(i, u)| (u.free_cores(), u.free_memory_units(), *i));
        let Some((mut gpu, best_usage)) = best else {
            return Err(self.share_insufficient(cores, units));
        };
        // Several equally full idle GPUs: start a new one where it breaks
        // the fewest intact groups, as a single whole GPU would.
        if best_usage.is_idle() {
            let free = self.fully_free();
            let frag = Fragmentation::new(&self.topo, &free);
            let level = (best_usage.free_cores(), best_usage.free_memory_units());
            gpu = (0..self.usage.len())
                .filter(|&i| {
                    let u = &self.usage[i];
                    fits(u) && u.is_idle() && (u.free_cores(), u.free_memory_units()) == level
                })
                .min_by_key(|&i| (frag.of_gpu(i), i))
                .unwrap_or(gpu);
        }
        Ok(Placement::Share {
            gpu,
            cores,
            memory_units: units,
        })
    }

    fn share_insufficient(&self, cores: u32, units: u64) -> AllocError {
        let most = self
            .usage
            .iter()
            .enumerate()
            .filter(|(_, u)| u.takes_placements() && !u.exclusive)
            .max_by_key(|(i, u)| {
                (
                    u.free_cores().min(cores),
                    u.free_memory_units(),
                    usize::MAX - i,
                )
            });
        let detail = match most {
            Some((i, u)) => format!(
                "no healthy GPU has {cores} free cores and {units} free memory units ({} MiB); the roomiest is GPU{i} with {} cores and {} units free",
                units * 256,
                u.free_cores(),
                u.free_memory_units()
            ),
            None => format!(
                "no healthy GPU has {cores} free cores and {units} free memory units: every GPU is held whole, unhealthy or in MIG mode"
            ),
        };
        AllocError::Insufficient { detail }
    }

    /// Healthy GPUs with nothing on them.
    pub(crate) fn fully_free(&self) -> Vec<bool> {
        self.usage
            .iter()
            .map(|u| u.takes_placements() && u.is_idle())
            .collect()
    }

    /// Records a placement under `id`. Checks it still fits (another commit
    /// may have come between evaluate and commit) and changes nothing if
    /// not. Health is not checked: it steers new decisions only.
    pub fn commit(
        &mut self,
        id: impl Into<String>,
        placement: &Placement,
    ) -> Result<(), AllocError> {
        let id = id.into();
        if self.allocations.contains_key(&id) {
            return Err(AllocError::DuplicateAllocation { id });
        }
        self.check_fits(&id, placement)?;
        self.apply(placement, true);
        self.allocations.insert(id, placement.clone());
        Ok(())
    }

    /// `evaluate` then `commit`.
    pub fn allocate(
        &mut self,
        id: impl Into<String>,
        req: &Request,
    ) -> Result<Placement, AllocError> {
        let placement = self.evaluate(req)?;
        self.commit(id, &placement)?;
        Ok(placement)
    }

    /// Frees what `id` holds, exactly, and returns its placement.
    pub fn release(&mut self, id: &str) -> Result<Placement, AllocError> {
        let placement = self
            .allocations
            .remove(id)
            .ok_or_else(|| AllocError::UnknownAllocation { id: id.to_string() })?;
        self.apply(&placement, false);
        Ok(placement)
    }

    /// Marks a GPU (un)healthy. Unhealthy GPUs get no new placements; what
    /// is on them stays until released.
    pub fn set_healthy(&mut self, gpu: usize, healthy: bool) -> Result<(), AllocError> {
        self.usage_mut(gpu)?.healthy = healthy;
        Ok(())
    }

    /// Marks a GPU in (or out of) MIG mode: in it, the GPU gets no new
    /// placements; what is on it stays until released.
    pub fn set_mig(&mut self, gpu: usize, mig: bool) -> Result<(), AllocError> {
        self.usage_mut(gpu)?.mig = mig;
        Ok(())
    }

    fn usage_mut(&mut self, gpu: usize) -> Result<&mut GpuUsage, AllocError> {
        let total = self.usage.len();
        self.usage
            .get_mut(gpu)
            .ok_or(AllocError::UnknownGpu { gpu, total })
    }

    /// Re-commits allocations found at recovery (checkpoint, live
    /// containers). Each is checked like a commit; the ones that do not fit
    /// (duplicate ids, over-committed GPUs, unknown GPUs) are left out and
    /// returned with the reason, the rest are in.
    pub fn restore(
        &mut self,
        allocations: impl IntoIterator<Item = (String, Placement)>,
    ) -> Vec<(String, AllocError)> {
        let mut rejected = Vec::new();
        for (id, placement) in allocations {
            if let Err(e) = self.commit(id.clone(), &placement) {
                rejected.push((id, e));
            }
        }
        rejected
    }

    fn check_fits(&self, id: &str, placement: &Placement) -> Result<(), AllocError> {
        let malformed = |detail: String| Err(AllocError::InvalidPlacement { detail });
        match placement {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => self.check_share(id, *gpu, *cores, *memory_units),
            Placement::InMig {
                gpu,
                instance,
                cores,
                memory_units,
            } => self.check_in_mig(id, *gpu, instance, *cores, *memory_units),
            Placement::Exclusive { gpus } => {
                if gpus.is_empty() {
                    return malformed("whole-GPU placement names no GPU".into());
                }
                self.check_distinct(gpus)?;
                match gpus.iter().find(|&&g| !self.usage[g].is_idle()) {
                    Some(gpu) => Err(AllocError::Conflict {
                        id: id.to_string(),
                        detail: format!("GPU{gpu} is not free"),
                    }),
                    None => Ok(()),
                }
            }
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => {
                if gpus.len() < 2 {
                    return malformed(format!(
                        "shares on several GPUs name {} GPU(s); a share of one GPU is a share placement",
                        gpus.len()
                    ));
                }
                self.check_distinct(gpus)?;
                for &gpu in gpus {
                    self.check_share(id, gpu, *cores, *memory_units)?;
                }
                Ok(())
            }
        }
    }

    /// Every GPU exists and none is named twice.
    fn check_distinct(&self, gpus: &[usize]) -> Result<(), AllocError> {
        let total = self.usage.len();
        for (i, &gpu) in gpus.iter().enumerate() {
            if gpu >= total {
                return Err(AllocError::UnknownGpu { gpu, total });
            }
            if gpus[..i].contains(&gpu) {
                return Err(AllocError::InvalidPlacement {
                    detail: format!("GPU{gpu} is named twice"),
                });
            }
        }
        Ok(())
    }

    /// A share of `cores` and `units` still fits on `gpu`.
    fn check_share(&self, id: &str, gpu: usize, cores: u32, units: u64) -> Result<(), AllocError> {
        let total = self.usage.len();
        if gpu >= total {
            return Err(AllocError::UnknownGpu { gpu, total });
        }
        if cores == 0 || cores >= WHOLE_GPU_CORES {
            return Err(AllocError::InvalidPlacement {
                detail: format!("a share has 1..99 cores, not {cores}"),
            });
        }
        let conflict = |detail: String| {
            Err(AllocError::Conflict {
                id: id.to_string(),
                detail,
            })
        };
        let u = &self.usage[gpu];
        if u.exclusive {
            return conflict(format!("GPU{gpu} is held whole"));
        }
        if u.free_cores() < cores || u.free_memory_units() < units {
            return conflict(format!(
                "GPU{gpu} has {} cores and {} memory units free, the share needs {cores} and {units}",
                u.free_cores(),
                u.free_memory_units()
            ));
        }
        Ok(())
    }

    /// Adds (or removes) a checked placement to the per-GPU aggregates.
    fn apply(&mut self, placement: &Placement, add: bool) {
        match placement {
            Placement::Share {
                gpu,
                cores,
                memory_units,
            } => self.apply_share(*gpu, *cores, *memory_units, add),
            Placement::InMig {
                instance,
                cores,
                memory_units,
                ..
            } => self.apply_in_mig(instance, *cores, *memory_units, add),
            Placement::Shares {
                gpus,
                cores,
                memory_units,
            } => {
                for &gpu in gpus {
                    self.apply_share(gpu, *cores, *memory_units, add);
                }
            }
            Placement::Exclusive { gpus } => {
                for &gpu in gpus {
                    let u = &mut self.usage[gpu];
                    u.exclusive = add;
                    u.allocated_cores = if add { WHOLE_GPU_CORES } else { 0 };
                    u.allocated_memory_units = if add { u.total_memory_units } else { 0 };
                }
            }
        }
    }

    fn apply_share(&mut self, gpu: usize, cores: u32, units: u64, add: bool) {
        self.usage[gpu].count_share(cores, units, add);
    }
}
