//! Shares on several GPUs: one container holds the same cores and memory
//! on each of N GPUs (a tensor-parallel server, one rank per GPU). The
//! device plugin's split of a container's totals, validation, placement.
//! docs/multi-gpu.md has the request shapes of both modes.

use crate::allocator::{Allocator, GpuUsage, Placement, Request, WHOLE_GPU_CORES};
use crate::error::AllocError;
use crate::select::{self, Fill};
use crate::topology::MEMORY_UNIT_BYTES;

const MIB: u64 = 1 << 20;

impl Request {
    /// The request of a container whose `vcuda-core` / `vcuda-memory`
    /// totals are spread over `gpus` GPUs (the device plugin's
    /// `tencent.com/vcuda-gpus` annotation). One GPU: the totals as
    /// vcuda-core alone means them (1..99 a share, multiples of 100 whole
    /// GPUs). N ≥ 2: both totals split evenly into a share on each GPU, so
    /// vcuda-core 100 over 2 GPUs is two shares of 50 cores, never a whole
    /// GPU; each GPU's part must be 1..99 cores and at least one unit.
    pub fn from_totals(
        cores: u64,
        memory_units: u64,
        gpus: u32,
        share_mode: bool,
    ) -> Result<Request, AllocError> {
        let invalid = |problem: String| AllocError::InvalidShares {
            request: format!("vcuda-core {cores} and vcuda-memory {memory_units} over {gpus} GPUs"),
            problem,
        };
        if gpus == 0 {
            return Err(invalid("the GPU count must be at least 1".into()));
        }
        if gpus == 1 {
            return Ok(Request {
                cores: u32::try_from(cores).unwrap_or(u32::MAX),
                memory_units,
                share_mode,
                gpus: 1,
            });
        }
        let n = u64::from(gpus);
        if cores % n != 0 {
            return Err(invalid(format!(
                "vcuda-core does not split evenly: ask for {gpus} × the cores of one GPU's share"
            )));
        }
        let per_gpu = cores / n;
        if per_gpu == 0 || per_gpu >= u64::from(WHOLE_GPU_CORES) {
            return Err(invalid(format!(
                "each GPU would get {per_gpu} cores, and a share has 1..99 on each GPU; \
                 for whole GPUs ask for vcuda-core {} without a GPU count",
                n * u64::from(WHOLE_GPU_CORES)
            )));
        }
        if memory_units == 0 || memory_units % n != 0 {
            return Err(invalid(format!(
                "vcuda-memory must be {gpus} × the units (256 MiB) of one GPU's share, at least one each"
            )));
        }
        Ok(Request::shares(gpus, per_gpu as u32, memory_units / n))
    }
}

/// "shares of 40 cores and 80 memory units (20480 MiB) on each of 2 GPUs"
fn describe(req: &Request) -> String {
    format!(
        "shares of {} cores and {} memory units ({} MiB) on each of {} GPUs",
        req.cores,
        req.memory_units,
        req.memory_units * MEMORY_UNIT_BYTES / MIB,
        req.gpus
    )
}

impl Allocator {
    /// A share on each of `req.gpus` GPUs: the GPUs with room for one,
    /// ranked as whole-GPU sets are (most NVLink links, closest PCIe
    /// ancestor, smallest PCIe sum), then the fullest set, then the most
    /// fragmented neighbourhood, then the lowest indices.
    pub(crate) fn evaluate_shares(&self, req: &Request) -> Result<Placement, AllocError> {
        self.validate_shares(req)?;
        let (n, cores, units) = (req.gpus as usize, req.cores, req.memory_units);
        let room = |u: &GpuUsage| {
            u.takes_placements()
                && !u.exclusive
                && u.free_cores() >= cores
                && u.free_memory_units() >= units
        };
        let pool: Vec<usize> = (0..self.usage.len())
            .filter(|&i| room(&self.usage[i]))
            .collect();
        let fill: Vec<Fill> = self
            .usage
            .iter()
            .map(|u| {
                (
                    u64::from(u.free_cores().saturating_sub(cores)),
                    u.free_memory_units().saturating_sub(units),
                )
            })
            .collect();
        let free = self.fully_free();
        match select::best_set(self.topology(), &free, &pool, &fill, n) {
            Some(gpus) => Ok(Placement::Shares {
                gpus,
                cores,
                memory_units: units,
            }),
            None => Err(self.shares_insufficient(req, &pool)),
        }
    }

    fn validate_shares(&self, req: &Request) -> Result<(), AllocError> {
        let invalid = |problem: String| {
            Err(AllocError::InvalidShares {
                request: describe(req),
                problem,
            })
        };
        let (n, cores, units) = (req.gpus as usize, req.cores, req.memory_units);
        if n == 0 {
            return invalid("the GPU count must be at least 1".into());
        }
        if cores == 0 || cores >= WHOLE_GPU_CORES {
            return invalid(format!(
                "a share on several GPUs has 1..99 cores on each; for whole GPUs ask for vcuda-core {} without a GPU count",
                n as u64 * u64::from(WHOLE_GPU_CORES)
            ));
        }
        if !req.share_mode {
            return invalid(
                "share mode is off on this node: ask for whole GPUs or run the manager with --share-mode"
                    .into(),
            );
        }
        if units == 0 {
            return invalid("a share needs at least one memory unit (256 MiB) on each GPU".into());
        }
        let total = self.usage.len();
        if n > total {
            return invalid(format!("this node has only {total} GPUs"));
        }
        let big_enough = self
            .usage
            .iter()
            .filter(|u| u.total_memory_units >= units)
            .count();
        if big_enough < n {
            return invalid(format!(
                "{big_enough} GPU(s) on this node hold {units} units; the largest holds {}",
                self.largest_units
            ));
        }
        Ok(())
    }

    /// What was asked, which GPUs had room and what every GPU has free.
    fn shares_insufficient(&self, req: &Request, pool: &[usize]) -> AllocError {
        let with_room = if pool.is_empty() {
            "none".to_string()
        } else {
            pool.iter()
                .map(|g| format!("GPU{g}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let free: Vec<String> = self
            .usage
            .iter()
            .enumerate()
            .map(|(i, u)| {
                if !u.healthy {
                    format!("GPU{i} unhealthy")
                } else if u.mig {
                    format!("GPU{i} in MIG mode")
                } else if u.exclusive {
                    format!("GPU{i} held whole")
                } else {
                    format!(
                        "GPU{i} {} cores/{} units",
                        u.free_cores(),
                        u.free_memory_units()
                    )
                }
            })
            .collect();
        AllocError::Insufficient {
            detail: format!(
                "{} requested, {} GPU(s) have room ({with_room}); free per GPU: {}",
                describe(req),
                pool.len(),
                free.join(", ")
            ),
        }
    }
}

#[cfg(test)]
mod tests;
