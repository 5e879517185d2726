//! The kubelet emulator with a device plugin registered, and the floor of
//! an RPC on a plugin's socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Starts a kubelet emulator in `dir` (pod resources on `pod_resources`)
/// and waits up to `wait` until `resource`'s plugin has registered and is
/// connected.
pub async fn kubelet_with_plugin(
    dir: &Path,
    pod_resources: PathBuf,
    resource: &str,
    wait: Duration,
) -> kubelet_emulator::KubeletEmulator {
    let emu = kubelet_emulator::KubeletEmulator::start(dir, pod_resources)
        .await
        .unwrap();
    emu.wait_for(wait, |v| {
        v.resources.get(resource).is_some_and(|r| r.connected)
    })
    .await
    .unwrap_or_else(|e| {
        panic!("{resource} not registered within {wait:?} of kubelet appearing: {e}")
    });
    emu
}

/// `n` timings of GetDevicePluginOptions, an RPC that does nothing in the
/// plugin: the floor of any RPC on `client`'s socket.
pub async fn options_rpc_floor(
    client: &mut device_plugin::api::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    n: usize,
) -> Vec<Duration> {
    let mut floor = Vec::with_capacity(n);
    for _ in 0..n {
        let t = std::time::Instant::now();
        client
            .get_device_plugin_options(device_plugin::api::Empty {})
            .await
            .unwrap();
        floor.push(t.elapsed());
    }
    floor
}
