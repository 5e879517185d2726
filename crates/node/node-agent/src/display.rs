//! The display service (`gpu-display`: the `vcudactl` socket, `/graph`,
//! `/usage`, metrics) over either mode's state, sampling the GPUs through
//! NVML.

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// Starts `display` as `opts` says (gRPC socket, HTTP address, sample
/// period, escape policy, taking the socket over), sampling the GPUs
/// through `nvml`.
pub async fn start(
    display: &gpu_display::Display,
    nvml: &Arc<nvml_wrapper::Nvml>,
    opts: &gpu_display::DisplayOptions,
    cancel: &CancellationToken,
) -> anyhow::Result<gpu_display::Running> {
    let reader = gpu_display::NvmlReader::new(nvml.clone(), opts.sample_period);
    display
        .start(opts, Some(Box::new(reader)), cancel.clone())
        .await
        .context("starting the display service")
}
