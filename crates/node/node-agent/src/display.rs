//! The display service (`gpu-display`: the `vcudactl` socket, `/graph`,
//! `/usage`, metrics) over either mode's state, sampling the GPUs through
//! NVML.

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// A GPU's tier and lending figures as the display's view carries them
/// (the rest of the view left default, for struct update).
pub fn gpu_figures_view(f: crate::registry::GpuFigures) -> gpu_display::GpuView {
    gpu_display::GpuView {
        batch_held_seconds: f.tiered.then_some(f.batch_held_ns as f64 / 1e9),
        batch_holds: f.tiered.then_some(f.batch_holds),
        memory_lent_bytes: f.memory_lent_bytes,
        ..Default::default()
    }
}

/// Starts `display` as `opts` says (gRPC socket, HTTP address, sample
/// period, escape policy, taking the socket over), sampling the GPUs
/// through `nvml`.
pub async fn start(
    display: &gpu_display::Display,
    nvml: &Arc<nvml_wrapper::Nvml>,
    opts: &gpu_display::DisplayOptions,
    cancel: &CancellationToken,
) -> anyhow::Result<gpu_display::Running> {
    let reader = MigReader {
        inner: gpu_display::NvmlReader::new(nvml.clone(), opts.sample_period),
        nvml: nvml.clone(),
    };
    display
        .start(opts, Some(Box::new(reader)), cancel.clone())
        .await
        .context("starting the display service")
}

/// The display's NVML reader plus each GPU's MIG devices, read as
/// discovery reads them ([`crate::mig::read`]), with what their processes
/// hold: NVML reports per-process memory of a GPU in MIG mode with the
/// GPU instance each process runs on.
struct MigReader {
    inner: gpu_display::NvmlReader,
    nvml: Arc<nvml_wrapper::Nvml>,
}

impl gpu_display::GpuReader for MigReader {
    fn sample(&mut self) -> Result<Vec<gpu_display::GpuSample>, gpu_display::Error> {
        let mut gpus = self.inner.sample()?;
        for g in &mut gpus {
            match mig_samples(&self.nvml, g.index) {
                Ok(m) => g.mig = m,
                Err(e) => tracing::debug!(gpu = g.index, error = %e, "sampling MIG devices failed"),
            }
        }
        Ok(gpus)
    }
}

fn mig_samples(
    nvml: &nvml_wrapper::Nvml,
    index: u32,
) -> Result<Vec<gpu_display::MigSample>, nvml_wrapper::error::NvmlError> {
    let dev = nvml.device_by_index(index)?;
    let state = crate::mig::read(nvml, std::slice::from_ref(&dev))
        .map_err(|e| e.source)?
        .pop()
        .unwrap_or_default();
    if !state.enabled {
        return Ok(Vec::new());
    }
    let procs = dev.running_compute_processes()?;
    Ok(state
        .devices
        .into_iter()
        .map(|d| {
            let mine = procs
                .iter()
                .filter(|p| p.gpu_instance_id == Some(d.gpu_instance));
            let used = mine
                .clone()
                .map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                })
                .sum();
            gpu_display::MigSample {
                uuid: d.uuid,
                profile: d.profile,
                memory_total_bytes: d.memory_bytes,
                memory_used_bytes: used,
                processes: mine.count() as u32,
            }
        })
        .collect())
}
