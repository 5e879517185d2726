//! vcuda shares inside MIG instances (docs/mig.md, *Shares inside an
//! instance*). An operator names profiles whose instances serve shares;
//! each such instance is a card of its own to the allocator: 100 cores (of
//! the instance's SMs) and the instance's memory, placed fullest first like
//! a GPU's shares. A pod asks for one by profile (`Request` unchanged, the
//! profile beside it: [`Allocator::evaluate_for`]), so a pod without the
//! profile never lands in an instance, nor one with it on a whole GPU.
//!
//! Instances are named by their MIG UUID, not a position: the set follows
//! what the node has (a restart, a rescan), and a placement recorded
//! before must still name the same hardware or be refused.

use serde::{Deserialize, Serialize};

use crate::allocator::{Allocator, GpuUsage, Placement, Request, WHOLE_GPU_CORES};
use crate::error::AllocError;
use crate::topology::MEMORY_UNIT_BYTES;

/// A MIG instance the node serves shares in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedInstance {
    /// Its MIG device's UUID (`MIG-…`).
    pub uuid: String,
    /// Index of the GPU it is on.
    pub gpu: usize,
    /// Profile name as NVIDIA's tools print it (`2g.20gb`).
    pub profile: String,
    pub memory_bytes: u64,
}

impl SharedInstance {
    pub fn memory_units(&self) -> u64 {
        self.memory_bytes / MEMORY_UNIT_BYTES
    }
}

/// The instances and their accounting, in the allocator.
#[derive(Debug, Clone, Default)]
pub(crate) struct Instances {
    pub(crate) list: Vec<(SharedInstance, GpuUsage)>,
}

impl Instances {
    fn find(&self, uuid: &str) -> Option<usize> {
        self.list.iter().position(|(i, _)| i.uuid == uuid)
    }
}

impl Request {
    /// What no instance of `profile` could take, whatever the node: a
    /// share inside one is 1..99 of one instance's cores and some memory.
    pub fn check_in_mig(&self, profile: &str) -> Result<(), AllocError> {
        let (cores, units) = (self.cores, self.memory_units);
        if self.gpus != 1 || cores == 0 || cores >= WHOLE_GPU_CORES {
            return Err(AllocError::InvalidShares {
                request: format!(
                    "vcuda-core {cores} and vcuda-memory {units} inside a {profile} MIG instance"
                ),
                problem: "a share inside an instance is one instance's 1..99 cores (of its SMs); a whole instance is asked for by its own resource, shares on several GPUs are not served in instances".into(),
            });
        }
        if !self.share_mode {
            return Err(AllocError::ShareModeOff { cores });
        }
        if units == 0 {
            return Err(AllocError::ShareWithoutMemory { cores });
        }
        Ok(())
    }
}

impl Allocator {
    /// The node's shared instances now: `found` replaces the list, keeping
    /// each known instance's accounting; one no longer found that still
    /// holds shares stays, unhealthy (its pods keep running until they go,
    /// and nothing new lands there).
    pub fn set_instances(&mut self, found: Vec<SharedInstance>) {
        let old = std::mem::take(&mut self.instances.list);
        let mut list: Vec<(SharedInstance, GpuUsage)> = found
            .into_iter()
            .map(|i| {
                let usage = old
                    .iter()
                    .find(|(o, _)| o.uuid == i.uuid)
                    .map_or_else(|| GpuUsage::empty(i.memory_units()), |(_, u)| *u);
                (i, usage)
            })
            .collect();
        for (i, mut u) in old {
            if u.shares > 0 && !list.iter().any(|(n, _)| n.uuid == i.uuid) {
                u.healthy = false;
                list.push((i, u));
            }
        }
        self.instances.list = list;
    }

    /// Every shared instance with its accounting.
    pub fn instances(&self) -> impl Iterator<Item = (&SharedInstance, GpuUsage)> {
        self.instances.list.iter().map(|(i, u)| (i, *u))
    }

    /// The instance `uuid` and its accounting.
    pub fn instance(&self, uuid: &str) -> Option<(&SharedInstance, GpuUsage)> {
        let k = self.instances.find(uuid)?;
        let (i, u) = &self.instances.list[k];
        Some((i, *u))
    }

    /// Marks an instance (un)healthy: no new shares while unhealthy.
    /// Unknown UUIDs are ignored (an instance served whole, or gone).
    pub fn set_instance_healthy(&mut self, uuid: &str, healthy: bool) {
        if let Some(k) = self.instances.find(uuid) {
            self.instances.list[k].1.healthy = healthy;
        }
    }

    /// [`Allocator::evaluate`], inside an instance of `mig_profile` when
    /// one is given (a share of 1..99 cores of the instance and memory
    /// units of it; the fullest instance that fits).
    pub fn evaluate_for(
        &self,
        req: &Request,
        mig_profile: Option<&str>,
    ) -> Result<Placement, AllocError> {
        let Some(profile) = mig_profile else {
            return self.evaluate(req);
        };
        req.check_in_mig(profile)?;
        let (cores, units) = (req.cores, req.memory_units);
        let refuse = |problem: String| AllocError::InvalidShares {
            request: format!(
                "vcuda-core {cores} and vcuda-memory {units} inside a {profile} MIG instance"
            ),
            problem,
        };
        let of_profile: Vec<&(SharedInstance, GpuUsage)> = self
            .instances
            .list
            .iter()
            .filter(|(i, _)| i.profile == profile)
            .collect();
        let largest = of_profile.iter().map(|(i, _)| i.memory_units()).max();
        match largest {
            None => {
                return Err(AllocError::Insufficient {
                    detail: format!(
                        "no {profile} MIG instance serves shares on this node{}",
                        self.profiles_note()
                    ),
                });
            }
            Some(l) if units > l => {
                return Err(refuse(format!(
                    "a {profile} instance holds {l} units ({} MiB)",
                    l * 256
                )));
            }
            Some(_) => {}
        }
        let fits = |u: &GpuUsage| {
            u.takes_placements() && u.free_cores() >= cores && u.free_memory_units() >= units
        };
        let best = of_profile
            .iter()
            .filter(|(_, u)| fits(u))
            .min_by_key(|(i, u)| (u.free_cores(), u.free_memory_units(), i.gpu, i.uuid.clone()));
        match best {
            Some((i, _)) => Ok(Placement::InMig {
                gpu: i.gpu,
                instance: i.uuid.clone(),
                cores,
                memory_units: units,
            }),
            None => {
                let room = of_profile
                    .iter()
                    .filter(|(_, u)| u.takes_placements())
                    .map(|(i, u)| {
                        format!("{} {}c/{}u", i.uuid, u.free_cores(), u.free_memory_units())
                    })
                    .collect::<Vec<_>>();
                Err(AllocError::Insufficient {
                    detail: format!(
                        "no healthy {profile} MIG instance has {cores} free cores and {units} free memory units ({} MiB); free in each: {}",
                        units * 256,
                        if room.is_empty() {
                            "none healthy".to_string()
                        } else {
                            room.join(", ")
                        }
                    ),
                })
            }
        }
    }

    /// ` (shared profiles here: …)` or that there are none.
    fn profiles_note(&self) -> String {
        let mut p: Vec<&str> = self
            .instances
            .list
            .iter()
            .map(|(i, _)| i.profile.as_str())
            .collect();
        p.sort_unstable();
        p.dedup();
        if p.is_empty() {
            " (none of its MIG profiles is configured to take shares)".into()
        } else {
            format!(" (profiles taking shares here: {})", p.join(", "))
        }
    }

    /// A share of `cores` and `units` still fits in instance `uuid` on
    /// `gpu`.
    pub(crate) fn check_in_mig(
        &self,
        id: &str,
        gpu: usize,
        uuid: &str,
        cores: u32,
        units: u64,
    ) -> Result<(), AllocError> {
        let Some(k) = self.instances.find(uuid) else {
            return Err(AllocError::InvalidPlacement {
                detail: format!("MIG instance {uuid} does not serve shares on this node"),
            });
        };
        let (i, u) = &self.instances.list[k];
        if i.gpu != gpu {
            return Err(AllocError::InvalidPlacement {
                detail: format!("MIG instance {uuid} is on GPU{}, not GPU{gpu}", i.gpu),
            });
        }
        if cores == 0 || cores >= WHOLE_GPU_CORES {
            return Err(AllocError::InvalidPlacement {
                detail: format!("a share has 1..99 cores, not {cores}"),
            });
        }
        if u.free_cores() < cores || u.free_memory_units() < units {
            return Err(AllocError::Conflict {
                id: id.to_string(),
                detail: format!(
                    "MIG instance {uuid} has {} cores and {} memory units free, the share needs {cores} and {units}",
                    u.free_cores(),
                    u.free_memory_units()
                ),
            });
        }
        Ok(())
    }

    /// Adds (or removes) a checked share to its instance's accounting.
    pub(crate) fn apply_in_mig(&mut self, uuid: &str, cores: u32, units: u64, add: bool) {
        let k = self.instances.find(uuid).expect("checked by commit");
        self.instances.list[k].1.count_share(cores, units, add);
    }
}

#[cfg(test)]
mod tests;
