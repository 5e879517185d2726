//! What each container really got, from the simulated driver's own
//! accounting: the kernel timeline every process on a GPU shares (what NVML's
//! process utilization samples report) and the memory each process holds.
//! This is the ground truth the quotas are checked against, independent of
//! the manager's own view.

use gpu_sim_core::state::now_ns;
use gpu_sim_core::{SharedState, SimRoot};
use std::path::Path;

pub struct Driver {
    state: SharedState,
}

/// A container's use of one GPU over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Use {
    /// Percent of the GPU's time its processes ran kernels.
    pub util: f64,
    pub memory_bytes: u64,
}

impl Driver {
    pub fn open(sim_root: &Path) -> Result<Driver, String> {
        SharedState::open(&SimRoot::new(sim_root))
            .map(|state| Driver { state })
            .map_err(|e| e.to_string())
    }

    pub fn now() -> u64 {
        now_ns()
    }

    /// GPU index for a device minor.
    pub fn gpu_of_minor(&self, minor: u32) -> Option<usize> {
        self.state.node().gpu_by_minor(minor)
    }

    pub fn gpu_count(&self) -> usize {
        self.state.gpu_count()
    }

    pub fn gpu_utilization(&self, gpu: usize, from: u64, to: u64) -> f64 {
        self.state.utilization(gpu, from, to)
    }

    /// Use of `gpu` by the processes `pids` (host PIDs) over [from, to).
    pub fn usage(&self, gpu: usize, pids: &[u32], from: u64, to: u64) -> Use {
        let util = self
            .state
            .process_utilization(gpu, from, to)
            .iter()
            .filter(|(p, _)| pids.contains(&p.pid()))
            .map(|(_, u)| *u)
            .fold(0.0, |a, b| a + b)
            .min(100.0);
        let memory_bytes = self
            .state
            .processes(gpu)
            .iter()
            .filter(|p| pids.contains(&p.pid()))
            .map(|p| p.used_bytes)
            .sum();
        Use { util, memory_bytes }
    }

    /// Processes the driver still knows on any GPU (dead ones reclaimed).
    pub fn live_processes(&self) -> Vec<String> {
        (0..self.gpu_count())
            .flat_map(|g| {
                self.state
                    .processes(g)
                    .into_iter()
                    .map(move |p| format!("GPU{g}: pid {} ({})", p.pid(), p.name))
            })
            .collect()
    }
}
