//! The display service (`gpu-display`: the `vcudactl` socket, `/graph`,
//! `/usage`, metrics) over either mode's state, sampling the GPUs through
//! NVML.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// Starts `display` (gRPC on `socket`, HTTP on `query_addr`), sampling
/// the GPUs through `nvml` every `sample_period`, the escape guard judging
/// each sample under `escape_policy`. `take_over_socket`: bind
/// the socket even while a live server answers on it (the manager this one
/// replaces).
pub async fn start(
    display: &gpu_display::Display,
    nvml: &Arc<nvml_wrapper::Nvml>,
    socket: PathBuf,
    query_addr: SocketAddr,
    sample_period: Duration,
    escape_policy: gpu_display::guard::Policy,
    take_over_socket: bool,
    cancel: &CancellationToken,
) -> anyhow::Result<gpu_display::Running> {
    let reader = gpu_display::NvmlReader::new(nvml.clone(), sample_period);
    display
        .start(
            &gpu_display::DisplayOptions {
                socket,
                query_addr,
                sample_period,
                take_over_socket,
                escape_policy: Some(escape_policy),
                ..Default::default()
            },
            Some(Box::new(reader)),
            cancel.clone(),
        )
        .await
        .context("starting the display service")
}
